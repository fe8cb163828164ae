#include "src/attention/bwd_params.h"

namespace flare::detail {
namespace {

std::size_t align256(std::size_t x) { return (x + 255) / 256 * 256; }

}  // namespace

BwdWorkspaceLayout bwd_workspace_layout(const AttentionShape& s, int block_m, int block_n, bool deterministic,
                                        int hopper_head_dim, int dq_chains, int64_t sparse_dq_per_head,
                                        int64_t sparse_dkv_per_head, int64_t dkv_tail_elems, int dq_replicas) {
  BwdWorkspaceLayout l;
  l.dq_replicas = deterministic ? dq_replicas : 1;
  const std::size_t replicas = static_cast<std::size_t>(l.dq_replicas);
  std::size_t at = 0;
  auto take = [&](std::size_t bytes) {
    std::size_t off = at;
    at += align256(bytes);
    return off;
  };
  const std::size_t rows_q = static_cast<std::size_t>(s.total_q), rows_k = static_cast<std::size_t>(s.total_k);
  l.dpsum = take(rows_q * s.heads * sizeof(float));
  l.hopper_head_dim = hopper_head_dim;
  if (hopper_head_dim > 0) {
    const std::size_t m_blocks = static_cast<std::size_t>(hopper_row_blocks(s.seqlen_q));
    l.row_stats = take(std::size_t{1} * s.batch * s.heads * m_blocks * 2 * kRowStatsBlockM * sizeof(float));
    const std::size_t padded = static_cast<std::size_t>(hopper_dq_padded_rows(s.total_q, s.batch));
    l.dq_replica_floats = padded * s.heads * hopper_head_dim;
    l.dq_accum = take(replicas * l.dq_replica_floats * sizeof(float));
  } else {
    const std::size_t padded = static_cast<std::size_t>(portable_dq_padded_rows(s.total_q, s.batch));
    l.dq_replica_floats = padded * s.heads * s.head_dim;
    l.dq_accum = take(replicas * l.dq_replica_floats * sizeof(float));
  }
  l.dq_first_stores = deterministic && hopper_head_dim > 0 && sparse_dq_per_head <= 0;
  l.zero_from = l.dq_first_stores ? at : l.dq_accum;
  if (s.heads_kv != s.heads) {
    l.dk_accum = take(rows_k * s.heads_kv * s.head_dim * sizeof(float));
    l.dv_accum = take(rows_k * s.heads_kv * s.head_dim * sizeof(float));
  }
  if (dkv_tail_elems > 0) l.dkv_tail = take(2 * static_cast<std::size_t>(dkv_tail_elems) * sizeof(float));
  if (deterministic) {
    const std::size_t m_blocks = hopper_head_dim > 0 ? static_cast<std::size_t>(hopper_row_blocks(s.seqlen_q))
                                                     : (s.seqlen_q + block_m - 1) / block_m;
    const std::size_t n_blocks = (s.seqlen_k + block_n - 1) / block_n;
    const std::size_t dq_per_head =
        sparse_dq_per_head > 0 ? static_cast<std::size_t>(sparse_dq_per_head) : m_blocks * dq_chains;
    const std::size_t dkv_per_head = sparse_dkv_per_head > 0 ? static_cast<std::size_t>(sparse_dkv_per_head) : n_blocks;
    l.dq_replica_semaphores = std::size_t{1} * s.batch * s.heads * dq_per_head;
    l.dq_semaphore = take(replicas * l.dq_replica_semaphores * sizeof(int));
    l.dkv_semaphore = take(std::size_t{1} * s.batch * s.heads_kv * dkv_per_head * sizeof(int));
  }
  l.total = at;
  return l;
}

AttentionForwardParams forward_view(const AttentionBackwardParams& b) {
  AttentionForwardParams f;
  f.q = b.q;
  f.k = b.k;
  f.v = b.v;
  f.out = b.out;
  f.lse = b.lse;
  f.cu_seqlens_q = b.cu_seqlens_q;
  f.cu_seqlens_k = b.cu_seqlens_k;
  f.max_seqlen_q = b.max_seqlen_q;
  f.max_seqlen_k = b.max_seqlen_k;
  f.softmax_scale = b.softmax_scale;
  f.softcap = b.softcap;
  f.sinks = b.sinks;
  f.mask = b.mask;
  return f;
}

BwdKernelParams make_bwd_kernel_params(const AttentionBackwardParams& p, const FwdKernelParams& fwd,
                                       const AttentionShape& s, const BwdWorkspaceLayout& l, void* workspace,
                                       int block_m, int block_n, const sched::TailSplit& tail) {
  char* ws = static_cast<char*>(workspace);
  BwdKernelParams k;
  k.fwd = fwd;
  k.dout = p.dout.data;
  k.dout_str = row_strides(p.dout, s.varlen);
  k.dq = p.dq.data;
  k.dk = p.dk.data;
  k.dv = p.dv.data;
  k.dq_str = row_strides(p.dq, s.varlen);
  k.dk_str = row_strides(p.dk, s.varlen);
  k.dv_str = row_strides(p.dv, s.varlen);
  k.dsinks = static_cast<float*>(p.dsinks.data);
  k.dpsum = reinterpret_cast<float*>(ws + l.dpsum);
  if (l.hopper_head_dim > 0) {
    k.row_stats = reinterpret_cast<float*>(ws + l.row_stats);
    k.dq_tile_elems = kRowStatsBlockM * l.hopper_head_dim;
    k.dq_padded_rows = hopper_dq_padded_rows(s.total_q, s.batch);
  }
  k.dq_accum = reinterpret_cast<float*>(ws + l.dq_accum);
  if (s.heads_kv != s.heads) {
    k.dk_accum = reinterpret_cast<float*>(ws + l.dk_accum);
    k.dv_accum = reinterpret_cast<float*>(ws + l.dv_accum);
  }
  k.deterministic = p.deterministic;
  if (p.deterministic) {
    k.dq_semaphore = reinterpret_cast<int*>(ws + l.dq_semaphore);
    k.dkv_semaphore = reinterpret_cast<int*>(ws + l.dkv_semaphore);
    k.dq_replicas = l.dq_replicas;
    k.dq_replica_floats = static_cast<int64_t>(l.dq_replica_floats);
    k.dq_replica_semaphores = static_cast<int64_t>(l.dq_replica_semaphores);
    k.dq_first_stores = l.dq_first_stores;
  }
  if (tail.active()) {
    k.tail = tail;
    if (l.dkv_tail > 0) k.dkv_tail = reinterpret_cast<float*>(ws + l.dkv_tail);
  }
  k.num_m_blocks = l.hopper_head_dim > 0 ? hopper_row_blocks(s.seqlen_q) : (s.seqlen_q + block_m - 1) / block_m;
  k.num_n_blocks = (s.seqlen_k + block_n - 1) / block_n;
  return k;
}

GridDims dense_bwd_grid(BwdKernelParams& P, int block_n, int elem_bytes, int64_t l2_budget_bytes) {
  const FwdKernelParams& p = P.fwd;
  P.fwd.order = sched::TileOrder{};
  if (P.deterministic || !has_band(p) || P.tail.active())
    return GridDims{static_cast<unsigned>(P.num_n_blocks), static_cast<unsigned>(p.heads), static_cast<unsigned>(p.batch)};
  // The order's q_block only shapes the forward axis; its key blocks are the kernel's.
  P.fwd.order = sched::make_backward_order(forward_tile_shape(p, block_n, block_n, elem_bytes), l2_budget_bytes,
                                           /*deterministic=*/false);
  return GridDims{static_cast<unsigned>(P.fwd.order.num_tiles), 1, 1};
}

}  // namespace flare::detail
