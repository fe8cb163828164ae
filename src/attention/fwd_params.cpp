#include "src/attention/fwd_params.h"

#include <cmath>

namespace flare::detail {

RowStrides row_strides(const TensorView& t, bool varlen) {
  RowStrides r;
  if (varlen) {
    r.row = t.stride[0];
    r.head = t.stride[1];
  } else {
    r.batch = t.stride[0];
    r.row = t.stride[1];
    r.head = t.stride[2];
  }
  return r;
}

sched::TileShape forward_tile_shape(const FwdKernelParams& p, int q_block, int kv_block, int elem_bytes) {
  sched::TileShape shape;
  shape.batch = p.batch;
  shape.heads = p.heads;
  shape.heads_kv = p.heads_kv;
  shape.seqlen_q = p.seqlen_q;
  shape.seqlen_k = p.seqlen_k;
  shape.q_block = q_block;
  shape.kv_block = kv_block;
  shape.head_dim = p.head_dim;
  shape.elem_bytes = elem_bytes;
  shape.causal = p.causal;
  shape.window_left = p.window_left;
  shape.window_right = p.window_right;
  return shape;
}

GridDims dense_fwd_grid(FwdKernelParams& p, int block_m, int block_n, int elem_bytes, int64_t l2_budget_bytes) {
  p.order = sched::TileOrder{};
  if (!has_band(p))
    return GridDims{static_cast<unsigned>((p.seqlen_q + block_m - 1) / block_m), static_cast<unsigned>(p.heads),
                    static_cast<unsigned>(p.batch)};
  p.order = sched::make_forward_order(forward_tile_shape(p, block_m, block_n, elem_bytes), l2_budget_bytes);
  return GridDims{static_cast<unsigned>(p.order.num_tiles), 1, 1};
}

FwdKernelParams make_fwd_kernel_params(const AttentionForwardParams& p, const AttentionShape& s) {
  FwdKernelParams k;
  k.q = p.q.data;
  k.k = p.k.data;
  k.v = p.v.data;
  k.out = p.out.data;
  k.lse = static_cast<float*>(p.lse.data);
  k.q_str = row_strides(p.q, s.varlen);
  k.k_str = row_strides(p.k, s.varlen);
  k.v_str = row_strides(p.v, s.varlen);
  k.out_str = row_strides(p.out, s.varlen);
  if (s.varlen) {
    k.lse_head_stride = s.total_q;
  } else {
    k.lse_batch_stride = int64_t{s.heads} * s.seqlen_q;
    k.lse_head_stride = s.seqlen_q;
  }
  k.cu_seqlens_q = static_cast<const int*>(p.cu_seqlens_q.data);
  k.cu_seqlens_k = static_cast<const int*>(p.cu_seqlens_k.data);
  k.batch = s.batch;
  k.heads = s.heads;
  k.heads_kv = s.heads_kv;
  k.group = s.heads / s.heads_kv;
  k.head_dim = s.head_dim;
  k.seqlen_q = s.seqlen_q;
  k.seqlen_k = s.seqlen_k;
  k.total_q = s.total_q;
  k.total_k = s.total_k;
  k.scale = s.softmax_scale;
  k.scale_log2 = s.softmax_scale * static_cast<float>(M_LOG2E);
  k.softcap = p.softcap;
  k.sinks = static_cast<const float*>(p.sinks.data);
  k.causal = p.mask.causal;
  k.window_left = p.mask.window_left;
  k.window_right = p.mask.window_right;
  k.workspace = p.workspace;
  k.workspace_bytes = p.workspace_bytes;
  return k;
}

}  // namespace flare::detail
