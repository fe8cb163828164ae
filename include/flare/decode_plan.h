// Decode planning: which kernel runs a decode shape, how its KV sequence is split, and how much
// workspace the run needs. Plan once per shape on the host (pure, no CUDA, no device query), then
// run many times with the plan and a caller-provided workspace: the run allocates nothing, so a
// decode step can be captured in a CUDA graph and replayed with new cache lengths.
//
// Kernels. The standard kernel runs one CTA per (sequence, KV head) (the sm_90 engines: per
// sequence and block of heads_per_cta KV heads): the q_len x (heads_q / heads_kv) query rows of
// a KV head are packed together so K/V are read once. The split-KV kernel runs num_splits CTAs
// per (sequence, KV head or head block), each over one chunk of keys, writes fp32 partial outputs
// and their log-sum-exps to the workspace, and a combine step merges them by LSE: in the kernel
// (the last CTA of each head block to finish) or in a second kernel (see DecodeCombine).
//
// Where a split's keys lie (what the kernels implement). For sequence b with L_b =
// cache_seqlens[b] keys, the attended span is [span_begin, L_b) with span_begin = 0, or with a
// window span_begin = max(0, L_b - q_len - window_left) (the earliest key any of the q_len queries
// sees). Splits start at origin = span_begin rounded down to a multiple of kv_align, and split i
// covers [origin + i * kv_chunk, origin + (i + 1) * kv_chunk) intersected with the span. kv_chunk
// and origin are multiples of kv_align, itself a multiple of the page size, so no split starts
// inside a page. The plan covers the longest span from the origin: max_cache_len, or with a window
// min(max_cache_len, window_left + q_len + kv_align - 1) (the worst rounding of the origin).
// Without a window, a sequence of max_cache_len keys leaves no split empty; a shorter sequence
// (or a window whose origin rounds less) leaves trailing splits empty: such a split writes
// LSE = -inf and a zero partial output, and the combine gives it weight 0.
//
// Workspace (split-KV only; 0 bytes for the standard kernel), row-major:
//   partial_out fp32 [batch, heads_q, q_len, num_splits, head_dim]   at byte 0
//   partial_lse fp32 [batch, heads_q, q_len, num_splits]            at byte partial_lse_offset
//   counters    int32 [batch, heads_kv]                             at byte counters_offset
// with counters_offset = partial_lse_offset + (the partial_lse bytes rounded up to 16), so
// workspace_bytes = counters_offset + batch * heads_kv * 4. head_dim is a multiple of 64, so
// partial_lse_offset is a multiple of 256 bytes. The counters are the in-kernel combine's arrival
// counters (one per sequence and block of KV heads, see DecodeCombine); the rest is scratch.
//
// How a plan runs (engine, combine, heads_per_cta). The defaults are the fastest known; the
// others stay selectable so that runs can be compared in one process (bench_decode --compare).
// A plan's engine runs where it applies and the portable kernel elsewhere: the sm_90 engines need
// sm_90 code on the device, head dim 128 (64 and 256 compile but have not run on a GPU), at most
// 16 packed query rows per KV head (group x q_len), head slices adjacent in a cache row and
// 16-byte aligned rows. FLARE_DECODE_PORTABLE=1 in the environment forces the portable kernel and
// FLARE_DECODE_ENGINE=key_groups|head_warps|portable overrides every plan's engine (both read once
// per process).
//
// Choosing the plan. A tuning table hit wins (its split count, heads per CTA, engine and combine
// measured on the device, see DecodeTuningTable; `bench_decode --tune PATH --all-engines` times
// every decode_candidates() plan of a grid of shapes on both sm_90 engines under CUDA-graph replay
// with L2 flushed and writes the winners; data/decode_tuning_h100.txt
// is its H100 table for head dim 128, heads_kv 8, group 4, one query token, batches 1-64, caches
// 256-65536, contiguous and paged). Otherwise the fallback heuristic, "wave efficiency":
//   n = batch * heads_kv CTAs per split (the engines' rule gives small grids one KV head per
//   CTA); a grid of n * s CTAs on `slots` CTA slots has wave efficiency
//     eff(s) = n * s / (ceil(n * s / slots) * slots),
//   the fraction of the launched waves' slots that do work. Decode streams K/V, so its time goes
//   as (waves x keys per CTA), i.e. as 1 / eff(s). slots = max(1, num_sms / 2): a CTA of the
//   key-group engine (one per SM, its loads as TMA boxes) streams fast enough that half the SMs
//   saturate the memory system, and the tuner's winners on the H100 are grids of about half a
//   wave (batch 1: 6-8 splits, batch 2: 3-4, batch 4: 2, batch 8: 1-2; bench/RESULTS.md, session
//   18); a full wave only adds splits and their fixed costs.
//   Split counts are fitted to the span first: kv_chunk = ceil(span / s) rounded up to kv_align,
//   then s = ceil(span / kv_chunk) (so no split is empty; span = the keys a sequence attends,
//   max_cache_len without a window). Candidates: s = 1 (standard), and fitted s up to
//     kMaxDecodeSplits = 128 whose splits average at least kDecodeMinKvPerSplit = 256 keys
//     (below that a split's fixed costs, its pipeline fill, partial write and combine read, are
//     no longer small against its K/V stream) and whose grid is at most kDecodeMaxWaves = 8
//     waves of num_sms CTAs (past 8 full waves the last partial wave costs under 1/9 of the run).
//   Choice: the fewest splits whose efficiency is within kDecodeWaveEfficiencySlack = 0.05 of the
//     best candidate's ("ties"): every extra split costs the fixed costs above, which the wave
//     model does not count.
// Examples on an H100 (num_sms = 132, 66 slots), heads_q 32, heads_kv 8, head dim 128, q_len 1,
// contiguous:
//   batch 1,  cache   1024: 4 splits (256 keys each, eff 0.48: the cache is too short to fill more)
//   batch 1,  cache   4096: 8 splits of 512 keys, eff 0.97
//   batch 1,  cache  65536: 8 splits of 8192 keys, eff 0.97
//   batch 8,  cache   4096: standard (64 CTAs fill 0.97 of the slots)
//   batch 64, cache  65536: standard (512 CTAs, eff 0.97)
//   any batch, cache < 512: standard (two splits would average under 256 keys)
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "flare/decode.h"
#include "flare/status.h"
#include "flare/tensor.h"

namespace flare {

// The combine step merges at most this many partial states per query row.
inline constexpr int kMaxDecodeSplits = 128;
// Split boundaries are multiples of this many keys (or of the page size if larger), so only a
// span's first and last KV tile need masking for any kernel tile of 16, 32 or 64 keys.
inline constexpr int kDecodeKvAlign = 64;
// The heuristic's numbers (see above).
inline constexpr int kDecodeMinKvPerSplit = 256;
inline constexpr int kDecodeMaxWaves = 8;
inline constexpr double kDecodeWaveEfficiencySlack = 0.05;

enum class DecodeKernel : uint8_t { kStandard, kSplitKv };
const char* decode_kernel_name(DecodeKernel k);  // "standard", "split_kv"

// The kernel family of a plan (see "How a plan runs" above).
enum class DecodeEngine : uint8_t {
  // sm_90, the default: a CTA loads 16-key x heads_per_cta-head boxes of the caches by TMA
  // (tensor maps encoded per launch; the head-warp engine runs where the driver refuses them),
  // and its 8 consumer warps split them as heads x key groups: each head's 16-key sub-tiles are
  // dealt to 8 / heads_per_cta warps, merged at the end by their LSE (head dim 256: 4 warps).
  kKeyGroups,
  // sm_90, the kernel of 2026-11-22: whole cache rows by cp.async.bulk, one consumer warp per KV
  // head (CTAs of 1-2 heads with long splits run the portable kernel). A tuning table may still
  // choose it (it wins at batch 1-2 with 1-4k keys on the H100).
  kHeadWarps,
  // mma.sync (sm_80+): one CTA of 4 warps per KV head.
  kPortable,
};
const char* decode_engine_name(DecodeEngine e);  // "key_groups", "head_warps", "portable"
// The engine of that name, or none.
std::optional<DecodeEngine> decode_engine_from_name(std::string_view name);

// How split-KV partial states are merged.
enum class DecodeCombine : uint8_t {
  // Where the key-group engine runs a split plan: the last CTA of each (sequence, head block) to
  // finish its split merges all splits' states and writes out / lse. It finds out it is last by an
  // arrival counter in the workspace (atomically incremented after its states are written), and
  // resets the counter to 0. A small kernel zeroes the counters first, so any workspace contents
  // work (the attention kernel is its programmatic dependent and waits for it only before
  // arriving). Elsewhere (other engines, the portable fallback): as kSeparateKernel.
  kInKernel,
  // A second kernel merges the states (a programmatic dependent launch on sm_90).
  kSeparateKernel,
  // kInKernel without the zeroing kernel: the counters must be 0 when the call starts. Zero the
  // workspace once (e.g. cudaMemset(workspace, 0, workspace_bytes)) before the first call; every
  // call that completes leaves them 0 again (so CUDA-graph replays stay correct). A call that
  // starts with non-zero counters writes wrong outputs. For callers that own their workspace.
  kInKernelPrezeroed,
  // Where the key-group engine runs a split plan of at most kDecodeMaxClusterSplits splits: the
  // splits of one (sequence, head block) run as one thread-block cluster (sm_90). Each CTA keeps
  // its partial state in shared memory; after a cluster barrier every CTA merges a slice of the
  // rows' outputs, reading its peers' states through distributed shared memory. No counters, no
  // global round trip, no second kernel; the workspace is not touched. More splits, or another
  // engine: as kInKernel.
  kCluster,
};
const char* decode_combine_name(DecodeCombine c);  // "in_kernel", "separate_kernel", "in_kernel_prezeroed", "cluster"
// The combine of that name, or none.
std::optional<DecodeCombine> decode_combine_from_name(std::string_view name);

// The most splits DecodeCombine::kCluster merges in a cluster (a non-portable cluster size on sm_90).
inline constexpr int kDecodeMaxClusterSplits = 16;

// KV heads per CTA of the sm_90 engines: at most this many (4 at head dim 256), a power of two
// dividing heads_kv. 0 in a plan: the engine's own rule (see the launcher).
inline constexpr int kDecodeMaxHeadsPerCta = 8;
constexpr int decode_max_heads_per_cta(int head_dim) { return head_dim > 128 ? 4 : kDecodeMaxHeadsPerCta; }

// Everything a plan depends on. Build it by hand (e.g. before the caches exist) or from the
// params with decode_shape_key().
struct DecodeShapeKey {
  int batch = 0;
  int heads_q = 0, heads_kv = 0;
  int head_dim = 0;
  int q_len = 1;
  int64_t max_cache_len = 0;  // keys one sequence can hold (paged: max_pages_per_seq * page_size)
  int page_size = 0;          // 0: contiguous cache
  int window_left = -1;       // -1: unbounded; else splits cover only the window's span
  DType dtype = DType::kBFloat16;

  bool paged() const { return page_size > 0; }
  friend bool operator==(const DecodeShapeKey&, const DecodeShapeKey&) = default;
};

// The key of validated params (validated on the device where q lives).
Status decode_shape_key(const DecodeParams& params, DecodeShapeKey* key);

enum class DecodePlanSource : uint8_t { kHeuristic, kTuningTable, kForced };

struct DecodePlan {
  DecodeKernel kernel = DecodeKernel::kStandard;
  int num_splits = 1;            // 1 exactly for the standard kernel
  int kv_chunk = 0;              // keys per split, a multiple of kv_align
  int kv_align = kDecodeKvAlign; // split boundaries are multiples of it: max(page_size, 64)
  std::size_t workspace_bytes = 0;
  std::size_t partial_lse_offset = 0;  // byte offset of partial_lse in the workspace
  std::size_t counters_offset = 0;     // byte offset of the arrival counters in the workspace
  DecodePlanSource source = DecodePlanSource::kHeuristic;
  // How it runs; may be edited after planning (check_decode_plan accepts any valid value).
  // The key-group engine with the cluster combine by default: with its cache loads as TMA tensor
  // boxes it runs 0.9-1.1x the head-warp engine's time at batch 1 and 1.05-1.14x faster at
  // batch 8 (bench/RESULTS.md, decode, session 18).
  DecodeEngine engine = DecodeEngine::kKeyGroups;
  DecodeCombine combine = DecodeCombine::kCluster;
  int heads_per_cta = 0;         // sm_90 engines: 0 (their rule) or a power of two dividing heads_kv
  // sm_90 engines: the K/V loads carry an evict-first L2 policy (the cache is read once per step,
  // so its lines displace each other rather than what the L2 held before). Its effect depends on
  // the plan, so the tuner times every candidate both ways: on the H100's table it is chosen for
  // 63 of 120 classes, and the same plans without it run 1-14 % slower at batch 1 with 4k-32k keys
  // and batch 8 with 512-4k keys, the same at batch 8 from 8k; with 6-8 one-head splits at batch 1
  // it had cost 1-7 % (bench/RESULTS.md, decode, sessions 21-22). The portable engine ignores it.
  bool l2_evict_first = false;
  DecodeShapeKey shape;          // the shape planned for; the run checks its params against it
};

// The class of shapes that share one tuned winner. Neighbouring batches and cache lengths share
// a class: both are bucketed to the largest power of two not above them, which is the shape a
// tuner sweeping powers of two measures, so a shape never has less work per split than was timed.
// heads_kv is exact (it multiplies the grid like the batch does); the dtype is left out (fp16
// and bf16 stream the same bytes through the same instructions); the page size is reduced to
// paged or not (kv_chunk is refitted to the actual page size).
struct DecodeShapeClass {
  int batch_bucket = 0;
  int heads_kv = 0;
  int group = 0;                 // heads_q / heads_kv
  int head_dim = 0;
  int q_len = 0;
  int64_t kv_len_bucket = 0;     // of the keys one sequence attends: max_cache_len or the window span
  bool paged = false;

  friend auto operator<=>(const DecodeShapeClass&, const DecodeShapeClass&) = default;
};

// The class of a valid key (decode_plan validates; this does not).
DecodeShapeClass decode_shape_class(const DecodeShapeKey& key);

// A measured winner: the standard kernel (num_splits 1) or split-KV with 2..kMaxDecodeSplits,
// the KV heads per CTA it was timed with (0: the engine's rule), and the engine and combine it
// ran on (unset: DecodePlan's defaults), and whether its loads carried the evict-first L2 policy.
struct DecodeTuningEntry {
  DecodeKernel kernel = DecodeKernel::kStandard;
  int num_splits = 1;
  int heads_per_cta = 0;
  std::optional<DecodeEngine> engine;
  std::optional<DecodeCombine> combine;
  bool l2_evict_first = false;
  friend bool operator==(const DecodeTuningEntry&, const DecodeTuningEntry&) = default;
};

// Winners by shape class, filled by a GPU tuner, saved to and loaded from a text file:
//
//   flare-decode-tuning 1
//   # comment lines and blank lines are ignored
//   batch=1 heads_kv=8 group=4 head_dim=128 q_len=1 kv_len=4096 layout=contiguous kernel=split_kv splits=16
//
// Line 1 names the format and its version. Each other line is one class and its winner, every
// field exactly once in any order: batch and kv_len are bucket values (powers of two), layout is
// contiguous or paged, kernel is standard (splits=1) or split_kv (splits 2..128). Optional
// fields, written only when set, so files without them (tuned before they existed) still load:
// heads_per_cta=N (a power of two up to kDecodeMaxHeadsPerCta that divides heads_kv; absent: 0,
// the engine's rule), engine=key_groups|head_warps|portable and combine=in_kernel|separate_kernel|
// cluster (absent: DecodePlan's defaults), l2=evict_first|normal (absent: normal). A malformed
// file gives InvalidArgument "<source>:<line>: <what is wrong>", and the table is left unchanged.
class DecodeTuningTable {
 public:
  std::optional<DecodeTuningEntry> lookup(const DecodeShapeKey& key) const;
  // Records (or replaces) the winner of key's class.
  Status insert(const DecodeShapeKey& key, const DecodeTuningEntry& winner);

  Status save(const std::string& path) const;
  Status load(const std::string& path);  // replaces the contents
  void write(std::ostream& out) const;
  Status read(std::istream& in, const std::string& source_name);  // replaces the contents

  std::size_t size() const { return entries_.size(); }
  const std::map<DecodeShapeClass, DecodeTuningEntry>& entries() const { return entries_; }

 private:
  std::map<DecodeShapeClass, DecodeTuningEntry> entries_;
};

// The plan for `key`: the table's winner for its class if `table` has one, else the heuristic.
// num_sms: the device's SM count (cudaDevAttrMultiProcessorCount, 132 on an H100 SXM), queried
// once by the caller. Pure: allocates nothing on success and touches no device.
Status decode_plan(const DecodeShapeKey& key, const DecodeTuningTable* table, int num_sms, DecodePlan* plan);

// The plan with (at most) `num_splits` splits: 1 is the standard kernel. The split count is
// fitted so that no split is empty at the longest span, which can lower it. For tests and tuners.
Status decode_plan_for_splits(const DecodeShapeKey& key, int num_splits, DecodePlan* plan);

// What a GPU tuner times for `key`: the standard kernel, then every distinct fitted split count
// from 2 up, each split averaging at least kDecodeKvAlign keys, up to kMaxDecodeSplits splits and
// kDecodeMaxWaves waves of CTAs on num_sms SMs. Includes the heuristic's choice. Empty if the key
// or num_sms is invalid. Every plan has heads_per_cta 0.
std::vector<DecodePlan> decode_candidates(const DecodeShapeKey& key, int num_sms);

// decode_candidates(key, num_sms), each with every explicit heads_per_cta the sm_90 engines can
// take for the key (powers of two dividing heads_kv, up to decode_max_heads_per_cta), widest
// first: what bench_decode --tune times.
std::vector<DecodePlan> decode_candidates_with_heads_per_cta(const DecodeShapeKey& key, int num_sms);

// For the run: `plan` was made for `key` (the params' key) and is internally consistent, and its
// engine, combine and heads_per_cta are valid values for the key.
Status check_decode_plan(const DecodePlan& plan, const DecodeShapeKey& key);

// Runs one decode step on params.stream with `plan` (made for the params' shape: see
// check_decode_plan). Split-KV plans need `workspace`: device memory of at least
// plan.workspace_bytes, 16-byte aligned, its contents scratch (except the counters under
// DecodeCombine::kInKernelPrezeroed); the standard kernel needs none (nullptr, 0). Calls sharing a
// workspace must be ordered (one stream). Validates, launches, allocates nothing: capturable in a
// CUDA graph, whose replays read the current cache_seqlens and page_table contents.
Status decode_run(const DecodePlan& plan, const DecodeParams& params, void* workspace, std::size_t workspace_bytes);

// n / (ceil(n / num_sms) * num_sms): the fraction of the launched waves' SM slots in use.
double decode_wave_efficiency(int64_t num_ctas, int num_sms);
// The CTA slots the heuristic's wave efficiency counts on num_sms SMs: max(1, num_sms / 2).
int decode_heuristic_slots(int num_sms);

}  // namespace flare
