// The attention forward as the kernels see it: host params turned into device params once.
#pragma once

#include <cstddef>
#include <cstdint>

#include "flare/attention.h"
#include "src/attention/attention_args.h"
#include "src/scheduling/mask_math.h"
#include "src/scheduling/tile_order.h"

namespace flare::detail {

// Row strides of one q/k/v-like operand, in elements. batch stride is 0 for varlen.
struct RowStrides {
  int64_t batch = 0, row = 0, head = 0;
};

struct FwdKernelParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // optional
  RowStrides q_str, k_str, v_str, out_str;
  int64_t lse_batch_stride = 0, lse_head_stride = 0;  // lse offset: b*bs + h*hs + q_start + i
  const int* cu_seqlens_q = nullptr;                  // varlen when non-null
  const int* cu_seqlens_k = nullptr;
  int batch = 0, heads = 0, heads_kv = 0, group = 1, head_dim = 0;
  int seqlen_q = 0, seqlen_k = 0;  // batched lengths, or the max lengths when varlen
  int64_t total_q = 0, total_k = 0;  // rows of the q and k tensors (batch * seqlen when batched)
  float scale = 1.f;               // softmax scale
  float scale_log2 = 1.f;          // scale * log2(e): the online softmax runs in exp2
  float softcap = 0.f;             // 0: off
  const float* sinks = nullptr;    // optional, [heads], natural-log units
  bool causal = false;
  int window_left = -1, window_right = -1;
  // Persistent launches: CTA c works on tiles c, c + gridDim.x, ... of `order` (heads grouped so
  // their K/V stay in L2, longest work first).
  sched::TileOrder order;
  // Scratch from attention_forward_workspace_size() (the Hopper grid's split tiles); nullptr:
  // allocated on the stream where a launch needs it.
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
};

// A sequence's place in the packed or batched tensors.
struct SeqInfo {
  int64_t q_start = 0, k_start = 0;  // first row (varlen) or 0
  int seqlen_q = 0, seqlen_k = 0;
};

FLARE_HD SeqInfo seq_info(const FwdKernelParams& p, int b) {
  SeqInfo s;
  if (p.cu_seqlens_q != nullptr) {
    s.q_start = p.cu_seqlens_q[b];
    s.k_start = p.cu_seqlens_k[b];
    int lq = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
    int lk = p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b];
    // Device values are not validated on the host: a malformed list yields empty sequences.
    s.seqlen_q = lq < 0 ? 0 : (lq > p.seqlen_q ? p.seqlen_q : lq);
    s.seqlen_k = lk < 0 ? 0 : (lk > p.seqlen_k ? p.seqlen_k : lk);
  } else {
    s.seqlen_q = p.seqlen_q;
    s.seqlen_k = p.seqlen_k;
  }
  return s;
}

FLARE_HD int64_t row_offset(const RowStrides& st, int b, int64_t row, int h) {
  return b * st.batch + row * st.row + h * st.head;
}

FLARE_HD sched::Band band_of(const FwdKernelParams& p, const SeqInfo& s) {
  return sched::Band::make(p.causal, p.window_left, p.window_right, s.seqlen_q, s.seqlen_k);
}

RowStrides row_strides(const TensorView& t, bool varlen);
// The scheduling view of a forward launch with q_block x kv_block tiles of elem_bytes elements.
sched::TileShape forward_tile_shape(const FwdKernelParams& p, int q_block, int kv_block, int elem_bytes);
FwdKernelParams make_fwd_kernel_params(const AttentionForwardParams& p, const AttentionShape& s);

// Whether rows see different numbers of keys: a causal mask or a window.
inline bool has_band(const FwdKernelParams& p) { return p.causal || p.window_left >= 0 || p.window_right >= 0; }

// A grid's CTAs, {x, y, z} (dim3 without the CUDA headers).
struct GridDims {
  unsigned x = 1, y = 1, z = 1;
};

// The dense forward's grid of one CTA per block_m-row tile. Uniform work: (q block, head, batch).
// Banded work (has_band), whose rows see different numbers of keys: {tiles, 1, 1} over the
// L2-grouped, longest-first forward tile order, written to p.order (the kernels' tile:
// sched::tile_at(p.order, blockIdx.x)), which the hardware dispatches in index order, so that the
// longest tiles of every head in a group start first and short ones fill the tail. (Until session
// 52 the grid was (q block, head, batch), longest first inside each head only: the last heads' long
// tiles started near the end; a CPU model of d256 causal 1k put the makespan 14 % above the work /
// CTA slots, against 3 % for the order.)
GridDims dense_fwd_grid(FwdKernelParams& p, int block_m, int block_n, int elem_bytes, int64_t l2_budget_bytes);

// The simple fp32-arithmetic kernel (Backend::kReference).
Status naive_attention_forward(const FwdKernelParams& p, DType dtype, Stream stream);

}  // namespace flare::detail
