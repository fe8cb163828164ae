// The attention backward as the kernels see it. The forward's fields (inputs, strides, mask,
// scale, softcap, sinks) are shared through `fwd`; the backward adds its inputs, outputs and the
// fp32 workspace: dq_accum (portable: 8 x 8 blocks, portable_dq_offset), dk/dv_accum [rows_k, heads_kv, head_dim]
// (GQA only), dpsum (= rowsum(dO o O), laid out like the LSE), the Hopper kernel's padded row
// statistics, and the deterministic mode's semaphores.
#pragma once

#include <cstddef>
#include <cstdint>

#include "src/attention/fwd_params.h"
#include "src/scheduling/tail_split.h"

namespace flare::detail {

struct BwdKernelParams {
  FwdKernelParams fwd;          // q, k, v, out (the forward's output), lse, mask, scale, ...
  const void* dout = nullptr;
  RowStrides dout_str;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  RowStrides dq_str, dk_str, dv_str;
  float* dsinks = nullptr;      // optional [heads]
  // Workspace.
  float* dpsum = nullptr;       // like the LSE
  // Hopper only: per (sequence, head, 64-row query block) the block's LSE in log2 units, then its
  // dpsum: [batch, heads, num_m_blocks, 2, kRowStatsBlockM]; rows past the sequence hold (+inf, 0),
  // so a block is one aligned bulk copy and its padded rows get P = 0.
  float* row_stats = nullptr;
  // Portable: in 8 x 8 blocks over a padded row space (portable_dq_offset). Hopper
  // (dq_tile_elems > 0): per (head, 64-row query block) one tile of dq_tile_elems floats in the
  // order the kernel's threads hold them (hopper_dq_tile_offset), so a block's dQ is added with
  // one bulk reduction; see hopper_dq_tile.
  float* dq_accum = nullptr;
  float* dk_accum = nullptr;    // GQA only: row r of k, kv head, channel
  float* dv_accum = nullptr;
  int* dq_semaphore = nullptr;  // deterministic: [batch, heads, num_m_blocks, dQ chains] (a block mask: its plan's)
  // Deterministic Hopper dense grids: dq_accum and the dQ semaphores in dq_replicas copies, the
  // floats and the semaphores of copy c dq_replica_floats and dq_replica_semaphores on from the
  // first; turn t adds into copy t mod R (sched::dq_replica_turn), the convert sums them in order.
  int dq_replicas = 1;
  int64_t dq_replica_floats = 0, dq_replica_semaphores = 0;
  // Deterministic Hopper dense grids: turn 0 of each copy's chain stores its tile instead of adding
  // it, so dq_accum is not zeroed; the convert reads a copy only where its semaphore moved.
  bool dq_first_stores = false;
  int* dkv_semaphore = nullptr; // deterministic GQA: [batch, heads_kv, num_n_blocks]
  // Hopper, ordinary dense grids: the last tiles split into parts (sched::tail_split; inactive:
  // none). Without GQA the parts add their dK and dV (dK scaled) into dkv_tail, [tail.tiles,
  // block_n keys, head_dim] for dK then the same for dV, converted after the grid.
  sched::TailSplit tail;
  float* dkv_tail = nullptr;
  int num_m_blocks = 0, num_n_blocks = 0;  // per sequence, from the max lengths (Hopper: hopper_row_blocks)
  int dq_tile_elems = 0;        // Hopper: kRowStatsBlockM x the instantiated head dim
  int64_t dq_padded_rows = 0;   // Hopper: query rows of dq_accum per head, sequences 64-aligned
  bool deterministic = false;
};

inline constexpr int kRowStatsBlockM = 64;

// The Hopper backward's 64-row query blocks per sequence (num_m_blocks): rounded up to an even
// count, so a 128-row step's second block has statistics (padding rows: +inf, 0) and a semaphore.
FLARE_HD int hopper_row_blocks(int seqlen_q) {
  return (seqlen_q + 2 * kRowStatsBlockM - 1) / (2 * kRowStatsBlockM) * 2;
}

// Rows of the q (or k) side: batch * seqlen when batched, total rows when varlen.
FLARE_HD int64_t accum_row(const FwdKernelParams& p, int b, int64_t start, int i, int seqlen) {
  return p.cu_seqlens_q != nullptr ? start + i : int64_t{b} * seqlen + i;
}

// A padded row space where every sequence starts on a multiple of `align` rows: sequence b (its
// rows start at first_row) starts at floor((first_row + align b) / align) * align. Sequences never
// overlap and all rows fit in aligned_sequence_rows(total, batch, align). Both dq_accum layouts use it.
FLARE_HD int64_t aligned_sequence_start(int64_t first_row, int b, int align) {
  return (first_row + int64_t{align} * b) / align * align;
}
FLARE_HD int64_t aligned_sequence_rows(int64_t total, int batch, int align) {
  return (total + int64_t{align} * (batch + 1) - 1) / align * align;
}

// Portable dq_accum. Rows live in the aligned row space above with 8-row alignment. The floats
// are stored in blocks of 8 rows x 8 columns, row-major inside a block, blocks ordered by (8-row
// group, head, 8-column group). A warp's reduction of an MMA accumulator fragment (lane (g, t):
// row g, columns 2t and 2t + 1 of an 8 x 8 tile) is then one contiguous 256-byte span: 2 L1 tag
// lookups where a row-major accumulator took 8 (the H100's lg_throttle stalls of session 30;
// FlashAttention-2 keeps its accumulator in fragment order too).
FLARE_HD int64_t portable_dq_padded_start(int64_t first_row, int b) { return aligned_sequence_start(first_row, b, 8); }
FLARE_HD int64_t portable_dq_padded_rows(int64_t total_q, int batch) { return aligned_sequence_rows(total_q, batch, 8); }
// Row i of sequence b (its rows start at q_start) in that row space.
FLARE_HD int64_t portable_dq_row(const FwdKernelParams& p, int b, int64_t q_start, int i) {
  return portable_dq_padded_start(accum_row(p, b, q_start, 0, p.seqlen_q), b) + i;
}
// The float offset of (padded row, head, column); the column group of 8 and the row group of 8 are
// contiguous blocks of 64 floats, the next row group heads * head_dim * 8 floats on.
FLARE_HD int64_t portable_dq_offset(int64_t row, int h, int col, int heads, int head_dim) {
  return (row >> 3) * (int64_t{heads} * head_dim * 8) + (int64_t{h} * head_dim + (col & ~7)) * 8 + (row & 7) * 8 +
         (col & 7);
}

// Hopper dq_accum: the first row of sequence b (its rows start at q_start) in the aligned row
// space with 64-row (kRowStatsBlockM) alignment.
FLARE_HD int64_t hopper_dq_padded_start(int64_t q_start, int b) { return aligned_sequence_start(q_start, b, kRowStatsBlockM); }
FLARE_HD int64_t hopper_dq_padded_rows(int64_t total_q, int batch) {
  return aligned_sequence_rows(total_q, batch, kRowStatsBlockM);
}

// Hopper dQ tile order: element i of consumer thread ct's dQ fragment (of `threads` consumer
// threads), i a multiple of 4 starting a 16-byte group, sits at this float offset of its tile, so
// consecutive threads write consecutive 16 bytes.
FLARE_HD int hopper_dq_tile_offset(int threads, int ct, int i) { return ((i / 4) * threads + ct) * 4; }

// The workspace a backward needs, carved from one buffer.
struct BwdWorkspaceLayout {
  int hopper_head_dim = 0;
  std::size_t dpsum = 0, row_stats = 0, dq_accum = 0, dk_accum = 0, dv_accum = 0, dq_semaphore = 0, dkv_semaphore = 0;
  std::size_t dkv_tail = 0;  // dkv_tail_elems > 0: BwdKernelParams::dkv_tail
  int dq_replicas = 1;       // copies of dq_accum and the dQ semaphores (BwdKernelParams::dq_replicas)
  std::size_t dq_replica_floats = 0, dq_replica_semaphores = 0;
  bool dq_first_stores = false;  // BwdKernelParams::dq_first_stores: dq_accum is not zeroed
  std::size_t zero_from = 0;     // the call zeroes [zero_from, total): dq_accum on, or what follows it
  std::size_t total = 0;
};

// `hopper_head_dim` > 0: the Hopper kernel's layout (its padded row statistics and dQ tiles, for
// that instantiated head dim; hopper_row_blocks query blocks, whatever block_m). `dq_chains`: dQ
// semaphores per query block (independent turn chains of its parts). The deterministic block-sparse backward
// counts its own semaphores: sparse_dq_per_head per (batch, head) and sparse_dkv_per_head per
// (batch, kv head) when positive. `dkv_tail_elems`: floats of the split tiles' partial dK (and as
// many for dV), zeroed with the rest after dq_accum. `dq_replicas` (deterministic only): copies of
// dq_accum and of the dQ semaphores. The deterministic Hopper dense backward (hopper_head_dim > 0,
// no sparse semaphore counts) stores its first turns (dq_first_stores) and leaves dq_accum out of
// the zeroed range.
BwdWorkspaceLayout bwd_workspace_layout(const AttentionShape& s, int block_m, int block_n, bool deterministic,
                                        int hopper_head_dim = 0, int dq_chains = 1, int64_t sparse_dq_per_head = 0,
                                        int64_t sparse_dkv_per_head = 0, int64_t dkv_tail_elems = 0,
                                        int dq_replicas = 1);

// The forward's view of a backward call: the same inputs, mask and scalars.
AttentionForwardParams forward_view(const AttentionBackwardParams& b);

// Device params over a workspace laid out by `layout` at `workspace`; `tail` the grid's split
// (sched::tail_split), its partial dK/dV in the layout's dkv_tail without GQA.
BwdKernelParams make_bwd_kernel_params(const AttentionBackwardParams& p, const FwdKernelParams& fwd,
                                       const AttentionShape& s, const BwdWorkspaceLayout& layout, void* workspace,
                                       int block_m, int block_n, const sched::TailSplit& tail = sched::TailSplit{});

// The dense backward's grid of one CTA per key block: (key block, head, sequence). The ordinary
// mode's banded work (has_band: its key blocks see different numbers of query blocks) instead
// takes {tiles, 1, 1} over the L2-grouped, longest-first backward tile order, written to
// P.fwd.order, as dense_fwd_grid does for the forward. The deterministic mode and a tail split
// keep their own grids.
GridDims dense_bwd_grid(BwdKernelParams& P, int block_n, int elem_bytes, int64_t l2_budget_bytes);

}  // namespace flare::detail
