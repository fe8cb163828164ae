#include "src/block_sparse/block_sparse_params.h"

namespace flare::block_sparse {
namespace {

// A dim of size 1 broadcasts: every index reads element 0.
int64_t broadcast_stride(const TensorView& t, int dim) { return t.shape[dim] == 1 ? 0 : t.stride[dim]; }

BlockListParams list_params(const TensorView& counts, const TensorView& indices) {
  BlockListParams l;
  if (!counts.defined()) return l;
  l.counts = counts.ptr<const int32_t>();
  l.indices = indices.ptr<const int32_t>();
  l.counts_batch = broadcast_stride(counts, 0);
  l.counts_head = broadcast_stride(counts, 1);
  l.counts_row = counts.stride[2];
  l.indices_batch = broadcast_stride(indices, 0);
  l.indices_head = broadcast_stride(indices, 1);
  l.indices_row = indices.stride[2];
  return l;
}

// Neighbouring ids of a document-id array [batch, seqlen] load as one 8-byte int2.
bool id_pairs(const TensorView& ids) {
  return ids.stride[1] == 1 && reinterpret_cast<uintptr_t>(ids.data) % 8 == 0 &&
         (ids.shape[0] == 1 || ids.stride[0] % 2 == 0);
}

}  // namespace

ElementMaskParams make_element_mask_params(const ElementMask& e) {
  ElementMaskParams m;
  m.causal = e.causal;
  m.window_left = e.window_left;
  m.window_right = e.window_right;
  m.prefix_length = e.prefix_length;
  if (e.doc_ids_q.defined()) {
    m.doc_q = e.doc_ids_q.ptr<const int32_t>();
    m.doc_k = e.doc_ids_k.ptr<const int32_t>();
    m.doc_q_batch = e.doc_ids_q.stride[0];
    m.doc_q_row = e.doc_ids_q.stride[1];
    m.doc_k_batch = e.doc_ids_k.stride[0];
    m.doc_k_row = e.doc_ids_k.stride[1];
    m.doc_q_pairs = id_pairs(e.doc_ids_q);
    m.doc_k_pairs = id_pairs(e.doc_ids_k);
  }
  if (e.bits.defined()) {
    m.bits = e.bits.ptr<const uint32_t>();
    m.bits_batch = broadcast_stride(e.bits, 0);
    m.bits_head = broadcast_stride(e.bits, 1);
    m.bits_row = e.bits.stride[2];
  }
  return m;
}

BlockSparseParams make_block_sparse_params(const BlockMask& mask, int seqlen_q, int seqlen_k) {
  BlockSparseParams p;
  p.partial_kv = list_params(mask.kv_num_blocks, mask.kv_indices);
  p.full_kv = list_params(mask.full_kv_num_blocks, mask.full_kv_indices);
  p.partial_q = list_params(mask.q_num_blocks, mask.q_indices);
  p.full_q = list_params(mask.full_q_num_blocks, mask.full_q_indices);
  p.q_block_size = mask.q_block_size;
  p.kv_block_size = mask.kv_block_size;
  p.num_q_blocks = (seqlen_q + mask.q_block_size - 1) / mask.q_block_size;
  p.num_kv_blocks = (seqlen_k + mask.kv_block_size - 1) / mask.kv_block_size;
  p.element = make_element_mask_params(mask.element);
  return p;
}

}  // namespace flare::block_sparse
