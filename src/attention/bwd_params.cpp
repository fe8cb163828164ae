#include "src/attention/bwd_params.h"

namespace flare::detail {
namespace {

std::size_t align256(std::size_t x) { return (x + 255) / 256 * 256; }

}  // namespace

BwdWorkspaceLayout bwd_workspace_layout(const AttentionShape& s, int block_m, int block_n, bool deterministic) {
  BwdWorkspaceLayout l;
  std::size_t at = 0;
  auto take = [&](std::size_t bytes) {
    std::size_t off = at;
    at += align256(bytes);
    return off;
  };
  const std::size_t rows_q = static_cast<std::size_t>(s.total_q), rows_k = static_cast<std::size_t>(s.total_k);
  l.dpsum = take(rows_q * s.heads * sizeof(float));
  l.dq_accum = take(rows_q * s.heads * s.head_dim * sizeof(float));
  if (s.heads_kv != s.heads) {
    l.dk_accum = take(rows_k * s.heads_kv * s.head_dim * sizeof(float));
    l.dv_accum = take(rows_k * s.heads_kv * s.head_dim * sizeof(float));
  }
  if (deterministic) {
    const std::size_t m_blocks = (s.seqlen_q + block_m - 1) / block_m, n_blocks = (s.seqlen_k + block_n - 1) / block_n;
    l.dq_semaphore = take(std::size_t{1} * s.batch * s.heads * m_blocks * sizeof(int));
    l.dkv_semaphore = take(std::size_t{1} * s.batch * s.heads_kv * n_blocks * sizeof(int));
  }
  l.total = at;
  return l;
}

}  // namespace flare::detail
