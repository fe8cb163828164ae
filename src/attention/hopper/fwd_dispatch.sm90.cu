// Picks the Hopper forward's instantiation, after checking that the problem suits it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "src/attention/hopper/fwd_config.h"
#include "src/attention/hopper/fwd_grid.h"
#include "src/attention/hopper/fwd_launch.h"
#include "src/attention/hopper/operand_checks.h"
#include "src/attention/hopper/sparse_tile_list.h"
#include "src/attention/portable/head_dims.h"
#include "src/block_sparse/doc_spans.h"
#include "src/common/device_facts.h"

namespace flare::hopper {

Status hopper_forward_check(const detail::FwdKernelParams& p, DType dtype) {
  FLARE_RETURN_IF_ERROR(check_sm90());
  if (portable::instantiated_head_dim(p.head_dim) == 0)
    return Status::NotSupported("head dim " + std::to_string(p.head_dim) +
                                ": no kernel instantiated for it in this build (see FLARE_HEAD_DIMS)");
#ifndef FLARE_HAS_DTYPE_bf16
  if (dtype == DType::kBFloat16) return Status::NotSupported("dtype bf16: not instantiated in this build (see FLARE_DTYPES)");
#endif
#ifndef FLARE_HAS_DTYPE_fp16
  if (dtype == DType::kFloat16) return Status::NotSupported("dtype fp16: not instantiated in this build (see FLARE_DTYPES)");
#endif
  const bool varlen = p.cu_seqlens_q != nullptr;
  FLARE_RETURN_IF_ERROR(check_tma_operand("q", p.q, p.q_str, varlen));
  FLARE_RETURN_IF_ERROR(check_tma_operand("k", p.k, p.k_str, varlen));
  FLARE_RETURN_IF_ERROR(check_tma_operand("v", p.v, p.v_str, varlen));
  return check_pair_output("out", p.out, p.out_str);
}

Status hopper_attention_forward(const detail::FwdKernelParams& p, DType dtype, Stream stream) {
  return portable::visit_instantiation(p.head_dim, dtype, [&](auto hd, auto elem) {
    return launch_hopper_fwd<decltype(hd)::value, decltype(elem)>(p, stream);
  });
}

std::size_t hopper_forward_workspace_bytes(const detail::FwdKernelParams& p, DType dtype) {
  std::size_t bytes = 0;
  (void)portable::visit_instantiation(p.head_dim, dtype, [&](auto hd, auto) {
    constexpr int kHeadDim = decltype(hd)::value;
    bytes = hopper_fwd_tail_bytes<typename HopperFwdConfigFor<kHeadDim>::type>(hopper_fwd_grid<kHeadDim>(p).tail);
    return Status::Ok();
  });
  return bytes;
}

namespace {
// The block-sparse forward's CTAs: one a q tile of each (batch, head).
int64_t sparse_forward_tiles(const detail::FwdKernelParams& p) {
  return int64_t{(p.seqlen_q + kHopperSparseBlockM - 1) / kHopperSparseBlockM} * p.heads * p.batch;
}
}  // namespace

bool hopper_sparse_ordered(const detail::FwdKernelParams& p, int num_sms) {
  const char* forced = std::getenv("FLARE_HOPPER_SPARSE_ORDER");
  if (forced != nullptr && (forced[0] == '0' || forced[0] == '1')) return forced[0] == '1';
  return sparse_forward_tiles(p) > num_sms;
}

bool hopper_sparse_persistent(const detail::FwdKernelParams& p, int kv_tile) {
  if (int64_t{p.seqlen_k} > int64_t{kMaxPersistentSparseTiles} * kv_tile) return false;
  const char* forced = std::getenv("FLARE_HOPPER_SPARSE_PERSISTENT");
  return !(forced != nullptr && forced[0] == '0');
}

bool hopper_sparse_doc_spans(bool doc_ids) {
  const char* forced = std::getenv("FLARE_HOPPER_DOC_SPANS");
  return doc_ids && !(forced != nullptr && forced[0] == '0');
}

SparseScratch hopper_sparse_scratch(const detail::FwdKernelParams& p, bool doc_ids, int num_sms) {
  SparseScratch s;
  if (hopper_sparse_ordered(p, num_sms)) {
    s.order_bytes = (static_cast<std::size_t>(sparse_forward_tiles(p)) * sizeof(int2) + 15) / 16 * 16;
    s.counter_bytes = 16;
  }
  if (hopper_sparse_doc_spans(doc_ids)) s.span_bytes = block_sparse::doc_spans_bytes(p.batch, p.seqlen_q);
  return s;
}

std::size_t hopper_forward_sparse_workspace_bytes(const detail::FwdKernelParams& p, bool doc_ids) {
  return hopper_sparse_scratch(p, doc_ids, detail::current_device_facts().num_sms).total();
}

int hopper_sparse_order_units_override() {
  const char* units = std::getenv("FLARE_HOPPER_SPARSE_ORDER_UNITS");
  return units != nullptr ? std::max(0, std::atoi(units)) : 0;
}

Status hopper_forward_sparse_check(const detail::FwdKernelParams& p, const block_sparse::BlockSparseParams& bs,
                                   DType dtype) {
  FLARE_RETURN_IF_ERROR(hopper_forward_check(p, dtype));
  if (bs.q_block_size % kHopperSparseBlockM != 0)
    return Status::NotSupported("block_mask: q block size " + std::to_string(bs.q_block_size) +
                                ": the Hopper block-sparse forward needs a multiple of " +
                                std::to_string(kHopperSparseBlockM));
  const int kv_tile = hopper_sparse_kv_tile(portable::instantiated_head_dim(p.head_dim));
  if (bs.kv_block_size % kv_tile != 0)
    return Status::NotSupported("block_mask: kv block size " + std::to_string(bs.kv_block_size) +
                                ": the Hopper block-sparse forward at head dim " + std::to_string(p.head_dim) +
                                " needs a multiple of " + std::to_string(kv_tile));
  // A CTA's list row, expanded into key tiles in shared memory (sparse_tile_list.h), holds at most
  // kMaxSparseTiles of them.
  if (int64_t{p.seqlen_k} > int64_t{kMaxSparseTiles} * kv_tile)
    return Status::NotSupported("seqlen_k " + std::to_string(p.seqlen_k) +
                                ": the Hopper block-sparse forward at head dim " + std::to_string(p.head_dim) +
                                " takes at most " + std::to_string(int64_t{kMaxSparseTiles} * kv_tile) + " keys");
  return Status::Ok();
}

Status hopper_attention_forward_sparse(const detail::FwdKernelParams& p, const block_sparse::BlockSparseParams& bs,
                                       DType dtype, Stream stream) {
  return portable::visit_instantiation(p.head_dim, dtype, [&](auto hd, auto elem) {
    return launch_hopper_fwd_sparse<decltype(hd)::value, decltype(elem)>(p, bs, stream);
  });
}

}  // namespace flare::hopper
