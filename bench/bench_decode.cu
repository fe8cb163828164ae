// Decode benchmark and tuner (issue 7): bf16, heads 32 query / 8 KV, head dim 128, one query
// token per sequence, batches 1 and 8, cache lengths 256 to 65536, contiguous caches and paged
// caches (pages of 16 and 64, scattered by a random page table).
//
// Benchmark (default): for each shape, the plan decode_plan() gives with the tuning table (or the
// heuristic when no table is found), run by --engine (default: the library's, DecodePlan{}.engine,
// key_groups; key_groups runs with --combine, default the library's cluster combine; head_warps
// and portable with the combine kernel),
// timed under CUDA-graph replay and as plain launches: median, p10-p90 spread and standard
// deviation after warm-up, L2 flushed before every sample; KV bytes per second against the
// measured copy bandwidth. Where the heuristic picks another split count its time is printed too.
// Checks: every plan's output against the portable standard kernel's (rel L2 error under 1e-2),
// and each paged output against the contiguous one (same keys, same splits).
//
// --compare: in the same run, per shape, also the previous path (the head-warp kernel of
// 2026-11-22 with the combine kernel, planned by --baseline-table, default
// data/decode_tuning_h100_head_warps.txt: the table tuned for it) and, for split plans of the
// key-group engine, the same plan with the combine kernel (what the in-kernel combine gains) and
// with prezeroed counters (what the counters' zeroing kernel costs); each checked like the plan.
//
// Tuner (--tune PATH): for a grid of shapes (batches 1 to 64, cache lengths 256 to 65536 as powers
// of two, contiguous and paged), times every candidate of decode_candidates() (key_groups: every
// split count with every heads_per_cta, decode_candidates_with_heads_per_cta) under CUDA-graph
// replay (L2 flushed), re-times the three fastest and the heuristic's choice with more samples,
// and writes the winners as a DecodeTuningTable to PATH. A candidate within kTieFraction of the
// fastest with fewer splits wins (less workspace, less combine work).
//
//   bench_decode [--table PATH] [--engine E] [--combine C] [--compare] [--baseline-table PATH] [--quick]
//                [--json PATH] [--filter S] [--repeats N] [--warmup N] [--l2 normal|evict_first]
//   bench_decode --tune PATH [--engine E | --all-engines] [--combine C] [--quick] [--filter S] [--show N]
// --all-engines: the tuner times the key-group engine's candidates (with --combine) and the
// head-warp engine's (with the combine kernel) for every shape; the table records each winner's
// engine and combine, and the benchmark runs them (without --engine).
// --combine: the key-group engine's combine of split plans (in_kernel, separate_kernel,
// in_kernel_prezeroed, cluster; default the library's, cluster).
// Tuner only: --filter S tunes the shapes whose name ("b1 L1024 contiguous", "b8 L256 page16")
// contains S; --show N prints each shape's N fastest candidates of the first pass.
// The tuner times every sm_90 candidate with and without the evict-first L2 policy
// (DecodePlan::l2_evict_first) and records the winner's; --l2 makes the benchmark run every plan
// with the one named (for A/B runs).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "bench/common/bench_common.h"
#include "flare/decode.h"
#include "flare/decode_plan.h"
#include "src/decode/decode_timeline.h"  // FLARE_DECODE_TIMELINE builds

namespace flare::bench {
namespace {

constexpr int kHeadsQ = 32, kHeadsKv = 8, kHeadDim = 128;
constexpr int kElemBytes = 2;                   // bf16
constexpr double kMaxRelError = 1e-2;           // vs the standard kernel's output
constexpr double kTieFraction = 0.01;           // tuner: within 1 % of the fastest is a tie
constexpr int64_t kMaxTuneTokens = int64_t{1} << 20;  // tuner: batch x cache length (4 GiB of K/V)
// The shipped table of the device (bench_decode --tune on each GPU), by its name.
const char* shipped_table() {
  cudaDeviceProp prop{};
  const bool h200 = cudaGetDeviceProperties(&prop, 0) == cudaSuccess && std::strstr(prop.name, "H200") != nullptr;
  return h200 ? "data/decode_tuning_h200.txt" : "data/decode_tuning_h100.txt";
}
constexpr const char* kDefaultBaselineTable = "data/decode_tuning_h100_head_warps.txt";

std::vector<int> cache_lengths(int from, int to) {
  std::vector<int> lens;
  for (int l = from; l <= to; l *= 2) lens.push_back(l);
  return lens;
}

// ---- device data --------------------------------------------------------------------------------

// The floor of a timed sample: an empty kernel, timed like the decode steps (what no decode step
// can beat under this harness: graph launch, event records, a cold L2).
__global__ void empty_kernel() {}

// Random pages: page j of sequence b is physical page page_ids[b * pages_per_seq + j].
__global__ void gather_pages(const __nv_bfloat16* contiguous, __nv_bfloat16* paged, const int32_t* page_ids,
                             int64_t pages, int64_t page_elems) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < pages * page_elems / 8;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t logical = i * 8 / page_elems, offset = i * 8 % page_elems;
    reinterpret_cast<uint4*>(paged + page_ids[logical] * page_elems + offset)[0] =
        reinterpret_cast<const uint4*>(contiguous + logical * page_elems + offset)[0];
  }
}

// One decode shape's inputs on the device: q, contiguous K/V caches [batch, cache_len, 8, 128]
// and, per page size, the same keys in scattered pages; every sequence holds cache_len keys.
class DecodeData {
 public:
  DecodeData(int batch, int cache_len, cudaStream_t stream) : batch_(batch), cache_len_(cache_len), stream_(stream) {
    const int64_t q_elems = int64_t{batch} * kHeadsQ * kHeadDim;
    FLARE_BENCH_CHECK(cudaMalloc(&q_, q_elems * kElemBytes));
    FLARE_BENCH_CHECK(cudaMalloc(&out_, q_elems * kElemBytes));
    FLARE_BENCH_CHECK(cudaMalloc(&reference_out_, q_elems * kElemBytes));
    FLARE_BENCH_CHECK(cudaMalloc(&k_, cache_elems() * kElemBytes));
    FLARE_BENCH_CHECK(cudaMalloc(&v_, cache_elems() * kElemBytes));
    fill_normal_bf16(q_, q_elems, 1, stream);
    fill_normal_bf16(k_, cache_elems(), 2, stream);
    fill_normal_bf16(v_, cache_elems(), 3, stream);
    std::vector<int32_t> lens(batch, cache_len);
    FLARE_BENCH_CHECK(cudaMalloc(&seqlens_, batch * sizeof(int32_t)));
    FLARE_BENCH_CHECK(cudaMemcpy(seqlens_, lens.data(), batch * sizeof(int32_t), cudaMemcpyHostToDevice));
  }
  DecodeData(const DecodeData&) = delete;
  DecodeData& operator=(const DecodeData&) = delete;
  ~DecodeData() {
    for (void* p : {q_, out_, reference_out_, k_, v_, paged_k_, paged_v_, workspace_}) cudaFree(p);  // null: no-op
    cudaFree(page_table_);
    cudaFree(seqlens_);
  }

  // Caches from now on: contiguous (page_size 0) or pages of page_size, scattered at random.
  void use_layout(int page_size) {
    page_size_ = page_size;
    if (page_size == 0) return;
    if (paged_k_ == nullptr) {
      FLARE_BENCH_CHECK(cudaMalloc(&paged_k_, cache_elems() * kElemBytes));
      FLARE_BENCH_CHECK(cudaMalloc(&paged_v_, cache_elems() * kElemBytes));
      FLARE_BENCH_CHECK(cudaMalloc(&page_table_, int64_t{batch_} * cache_len_ / 16 * sizeof(int32_t)));
    }
    const int64_t pages = int64_t{batch_} * cache_len_ / page_size;
    std::vector<int32_t> ids(pages);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937_64(page_size));
    FLARE_BENCH_CHECK(cudaMemcpy(page_table_, ids.data(), pages * sizeof(int32_t), cudaMemcpyHostToDevice));
    const int64_t page_elems = int64_t{page_size} * kHeadsKv * kHeadDim;
    gather_pages<<<1024, 256, 0, stream_>>>(static_cast<__nv_bfloat16*>(k_), static_cast<__nv_bfloat16*>(paged_k_),
                                            page_table_, pages, page_elems);
    gather_pages<<<1024, 256, 0, stream_>>>(static_cast<__nv_bfloat16*>(v_), static_cast<__nv_bfloat16*>(paged_v_),
                                            page_table_, pages, page_elems);
    FLARE_BENCH_CHECK(cudaGetLastError());
    FLARE_BENCH_CHECK(cudaStreamSynchronize(stream_));
  }

  DecodeParams params(void* out, cudaStream_t stream) const {
    DecodeParams p;
    const Device gpu{DeviceKind::kCUDA, 0};
    p.q = TensorView::contiguous(q_, DType::kBFloat16, {batch_, 1, kHeadsQ, kHeadDim}, gpu);
    p.out = TensorView::contiguous(out, DType::kBFloat16, {batch_, 1, kHeadsQ, kHeadDim}, gpu);
    if (page_size_ == 0) {
      p.k_cache = TensorView::contiguous(k_, DType::kBFloat16, {batch_, cache_len_, kHeadsKv, kHeadDim}, gpu);
      p.v_cache = TensorView::contiguous(v_, DType::kBFloat16, {batch_, cache_len_, kHeadsKv, kHeadDim}, gpu);
    } else {
      const int64_t pages_per_seq = cache_len_ / page_size_;
      const int64_t pages = batch_ * pages_per_seq;
      p.k_cache = TensorView::contiguous(paged_k_, DType::kBFloat16, {pages, page_size_, kHeadsKv, kHeadDim}, gpu);
      p.v_cache = TensorView::contiguous(paged_v_, DType::kBFloat16, {pages, page_size_, kHeadsKv, kHeadDim}, gpu);
      p.page_table = TensorView::contiguous(page_table_, DType::kInt32, {batch_, pages_per_seq}, gpu);
    }
    p.cache_seqlens = TensorView::contiguous(seqlens_, DType::kInt32, {batch_}, gpu);
    p.causal = true;
    p.stream = stream;
    return p;
  }

  DecodeShapeKey key() const {
    DecodeShapeKey k;
    check_ok(decode_shape_key(params(out_, stream_), &k), "decode_shape_key");
    return k;
  }

  // Enqueues one decode step with `plan` into `out` (default: the benchmark's output buffer).
  void run(const DecodePlan& plan, cudaStream_t stream, void* out = nullptr) {
    reserve_workspace(plan.workspace_bytes);
    check_ok(decode_run(plan, params(out != nullptr ? out : out_, stream), workspace_, workspace_bytes_), "decode_run");
  }
  // Zeroed when (re)allocated. DecodeCombine::kInKernelPrezeroed needs its counters at 0: every
  // complete in-kernel-combine call leaves them so, but another plan's partial states may lie
  // where this plan's counters are (their offset depends on the split count): zero_counters.
  void reserve_workspace(std::size_t bytes) {
    if (bytes <= workspace_bytes_) return;
    FLARE_BENCH_CHECK(cudaStreamSynchronize(stream_));
    if (workspace_ != nullptr) FLARE_BENCH_CHECK(cudaFree(workspace_));
    FLARE_BENCH_CHECK(cudaMalloc(&workspace_, bytes));
    FLARE_BENCH_CHECK(cudaMemset(workspace_, 0, bytes));
    workspace_bytes_ = bytes;
  }

  // Zeroes `plan`'s arrival counters (on the stream, outside any timed region).
  void zero_counters(const DecodePlan& plan, cudaStream_t stream) {
    if (plan.kernel != DecodeKernel::kSplitKv) return;
    reserve_workspace(plan.workspace_bytes);
    FLARE_BENCH_CHECK(cudaMemsetAsync(static_cast<char*>(workspace_) + plan.counters_offset, 0,
                                      plan.workspace_bytes - plan.counters_offset, stream));
  }

  double kv_bytes() const { return 2.0 * static_cast<double>(cache_elems()) * kElemBytes; }
  int64_t out_elems() const { return int64_t{batch_} * kHeadsQ * kHeadDim; }
  void* out() const { return out_; }
  void* reference_out() const { return reference_out_; }

 private:
  int64_t cache_elems() const { return int64_t{batch_} * cache_len_ * kHeadsKv * kHeadDim; }

  int batch_, cache_len_, page_size_ = 0;
  cudaStream_t stream_;
  void *q_ = nullptr, *out_ = nullptr, *reference_out_ = nullptr, *k_ = nullptr, *v_ = nullptr;
  void *paged_k_ = nullptr, *paged_v_ = nullptr, *workspace_ = nullptr;
  int32_t *page_table_ = nullptr, *seqlens_ = nullptr;
  std::size_t workspace_bytes_ = 0;
};

std::string layout_name(int page_size) { return page_size == 0 ? "contiguous" : "page" + std::to_string(page_size); }

std::string plan_name(const DecodePlan& p) {
  std::string name = p.kernel == DecodeKernel::kStandard ? std::string("standard") : "split x" + std::to_string(p.num_splits);
  if (p.heads_per_cta != 0) name += " h" + std::to_string(p.heads_per_cta);
  if (p.engine != DecodePlan{}.engine) name += std::string(" ") + decode_engine_name(p.engine);
  if (p.l2_evict_first) name += " l2ef";
  return name;
}

// The key-group engine's combine for split plans (--combine; default the library's).
DecodeCombine key_group_combine = DecodePlan{}.combine;

// The plan as `engine` runs it: the key-group engine with key_group_combine, the others with the
// combine kernel.
DecodePlan with_engine(DecodePlan p, DecodeEngine engine) {
  p.engine = engine;
  p.combine = engine == DecodeEngine::kKeyGroups ? key_group_combine : DecodeCombine::kSeparateKernel;
  return p;
}

bool same_launch(const DecodePlan& a, const DecodePlan& b) {
  return a.num_splits == b.num_splits && a.heads_per_cta == b.heads_per_cta && a.engine == b.engine &&
         a.combine == b.combine && a.l2_evict_first == b.l2_evict_first;
}

Timing time_plan(DecodeData& data, const DecodePlan& plan, TimingOptions options, cudaStream_t stream) {
  data.reserve_workspace(plan.workspace_bytes);  // allocated before, never inside, a capture
  data.zero_counters(plan, stream);
  return time_kernel([&](cudaStream_t s) { data.run(plan, s); }, options, stream);
}

int num_sms() {
  int device = 0, n = 0;
  FLARE_BENCH_CHECK(cudaGetDevice(&device));
  FLARE_BENCH_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  return n;
}

// ---- tuner --------------------------------------------------------------------------------------

struct Scored {
  DecodePlan plan;
  double us = 0;
};

// The fastest plan of `scored`; a plan with fewer splits within kTieFraction of it wins instead.
const Scored& pick_winner(const std::vector<Scored>& scored) {
  const Scored* best = &scored.front();
  for (const Scored& s : scored)
    if (s.us < best->us) best = &s;
  const Scored* chosen = best;
  for (const Scored& s : scored)
    if (s.us <= best->us * (1 + kTieFraction) && s.plan.num_splits < chosen->plan.num_splits) chosen = &s;
  return *chosen;
}

// engines: the engines whose candidates compete (each with its combine, see with_engine); the
// table records each winner's engine and combine.
int tune(const Args& args, const std::string& path, const std::vector<DecodeEngine>& engines, int show,
         cudaStream_t stream) {
  const DecodeEngine engine = engines.front();  // the heuristic's plan runs on the first
  const int sms = num_sms();
  const std::vector<int> batches = args.quick ? std::vector<int>{1, 8} : std::vector<int>{1, 2, 4, 8, 16, 32, 64};
  const std::vector<int> lens = args.quick ? std::vector<int>{1024, 16384} : cache_lengths(256, 65536);
  TimingOptions first_pass{.warmup = 3, .repeats = 10, .flush_l2 = true, .cuda_graph = true};
  TimingOptions final_pass{.warmup = 5, .repeats = 40, .flush_l2 = true, .cuda_graph = true};
  DecodeTuningTable table;
  Table report;
  for (int batch : batches)
    for (int len : lens) {
      if (int64_t{batch} * len > kMaxTuneTokens) continue;
      auto shape_name = [&](int page_size) {
        return "b" + std::to_string(batch) + " L" + std::to_string(len) + " " + layout_name(page_size);
      };
      if (!args.selected(shape_name(0)) && !args.selected(shape_name(16))) continue;
      DecodeData data(batch, len, stream);
      for (int page_size : {0, 16}) {
        if (!args.selected(shape_name(page_size))) continue;
        data.use_layout(page_size);
        const DecodeShapeKey key = data.key();
        std::vector<Scored> scored;
        for (DecodeEngine e : engines) {
          const std::vector<DecodePlan> candidates = e == DecodeEngine::kKeyGroups
                                                         ? decode_candidates_with_heads_per_cta(key, sms)
                                                         : decode_candidates(key, sms);
          for (const DecodePlan& candidate : candidates)
            for (bool l2_evict_first : {false, true}) {  // the sm_90 engines, both L2 policies
              if (l2_evict_first && e == DecodeEngine::kPortable) continue;
              DecodePlan plan = with_engine(candidate, e);
              plan.l2_evict_first = l2_evict_first;
              scored.push_back({plan, 1e3 * time_plan(data, plan, first_pass, stream).median_ms});
            }
        }
        std::sort(scored.begin(), scored.end(), [](const Scored& a, const Scored& b) { return a.us < b.us; });
        for (int i = 0; i < std::min<int>(show, static_cast<int>(scored.size())); ++i)
          std::printf("%s | %s %s | %.2f us\n", shape_name(page_size).c_str(), plan_name(scored[i].plan).c_str(),
                      scored[i].plan.kernel == DecodeKernel::kSplitKv ? decode_combine_name(scored[i].plan.combine) : "",
                      scored[i].us);
        DecodePlan heuristic;
        check_ok(decode_plan(key, nullptr, sms, &heuristic), "decode_plan");
        heuristic = with_engine(heuristic, engine);
        std::vector<Scored> finalists(scored.begin(), scored.begin() + std::min<size_t>(3, scored.size()));
        if (std::none_of(finalists.begin(), finalists.end(),
                         [&](const Scored& s) { return same_launch(s.plan, heuristic); }))
          finalists.push_back({heuristic, 0});
        for (Scored& f : finalists) f.us = 1e3 * time_plan(data, f.plan, final_pass, stream).median_ms;
        const Scored& winner = pick_winner(finalists);
        const double heuristic_us =
            std::find_if(finalists.begin(), finalists.end(),
                         [&](const Scored& s) { return same_launch(s.plan, heuristic); })->us;
        DecodeTuningEntry entry{winner.plan.kernel, winner.plan.num_splits, winner.plan.heads_per_cta};
        entry.engine = winner.plan.engine;
        entry.combine = winner.plan.combine;
        entry.l2_evict_first = winner.plan.l2_evict_first;
        check_ok(table.insert(key, entry), "table insert");
        report.add_row({{"batch", batch}, {"cache", len}, {"layout", layout_name(page_size)},
                        {"candidates", static_cast<int>(scored.size())},
                        {"winner", plan_name(winner.plan)},  // names the engine where not the default
                        {"us", Table::Cell(winner.us, 2)}, {"heuristic", plan_name(heuristic)},
                        {"heuristic us", Table::Cell(heuristic_us, 2)},
                        {"gain", Table::Cell(heuristic_us / winner.us, 2)}});
        std::fflush(stdout);
      }
    }
  report.print();
  for (DecodeEngine e : engines) std::printf("engine: %s\n", decode_engine_name(e));
  check_ok(table.save(path), "saving the tuning table");
  std::printf("wrote %zu entries to %s\n", table.size(), path.c_str());
  return 0;
}

// ---- benchmark ----------------------------------------------------------------------------------

// The table named on the command line, else the shipped one `fallback` (from the working
// directory or the source tree); nullptr when none is found, so the heuristic plans.
const DecodeTuningTable* load_table(const std::string& requested, DecodeTuningTable* table,
                                    const char* fallback = shipped_table()) {
  std::vector<std::string> paths;
  if (!requested.empty()) {
    paths = {requested};
  } else {
    paths = {fallback, (std::filesystem::path(__FILE__).parent_path().parent_path() / fallback).string()};
  }
  for (const std::string& p : paths) {
    if (!std::filesystem::exists(p)) continue;
    check_ok(table->load(p), "loading the tuning table");
    std::printf("tuning table: %s (%zu entries)\n", p.c_str(), table->size());
    return table;
  }
  if (!requested.empty()) check_ok(Status::InvalidArgument("--table", "no file " + requested), "tuning table");
  std::printf("tuning table: none found (%s): heuristic plans\n", fallback);
  return nullptr;
}

struct BenchOptions {
  std::string table_path, baseline_table_path;
  std::optional<DecodeEngine> engine;  // --engine; unset: as the plan says (its table entry or the defaults)
  std::optional<bool> l2_evict_first;  // --l2; unset: as the plan says
  bool compare = false;
};

int benchmark(const Args& args, const BenchOptions& options, cudaStream_t stream) {
  const int sms = num_sms();
  const double copy_gbps = measure_copy_bandwidth_gbps(stream);
  std::printf("measured copy bandwidth: %.0f GB/s (read + write)\n", copy_gbps);
  std::printf("engine: %s\n", options.engine ? decode_engine_name(*options.engine) : "the plan's");
  DecodeTuningTable storage, baseline_storage;
  const DecodeTuningTable* table = load_table(options.table_path, &storage);
  const DecodeTuningTable* baseline_table =
      options.compare ? load_table(options.baseline_table_path, &baseline_storage, kDefaultBaselineTable) : nullptr;
  const TimingOptions floor_options{.warmup = 10, .repeats = 50, .flush_l2 = true, .cuda_graph = true};
  const Timing floor = time_kernel([](cudaStream_t s) { empty_kernel<<<1, 32, 0, s>>>(); }, floor_options, stream);
  std::printf("harness floor (an empty kernel, CUDA graph, L2 flushed): %.2f us\n", 1e3 * floor.median_ms);

  const std::vector<int> lens = args.quick ? std::vector<int>{1024, 4096, 65536} : cache_lengths(256, 65536);
  const TimingOptions graph = args.timing({.warmup = 10, .repeats = 50, .flush_l2 = true, .cuda_graph = true});
  TimingOptions plain = graph;
  plain.cuda_graph = false;

  Table report;
  std::vector<Record> records;
  bool all_ok = true;
  for (int batch : {1, 8})
    for (int len : lens) {
      const std::string shape = "b" + std::to_string(batch) + " L" + std::to_string(len);
      if (!args.selected(shape)) continue;
      DecodeData data(batch, len, stream);
      double contiguous_us = 0;
      for (int page_size : {0, 16, 64}) {
        data.use_layout(page_size);
        const DecodeShapeKey key = data.key();
        DecodePlan plan, heuristic, standard;
        check_ok(decode_plan(key, table, sms, &plan), "decode_plan");
        check_ok(decode_plan(key, nullptr, sms, &heuristic), "decode_plan");
        check_ok(decode_plan_for_splits(key, 1, &standard), "decode_plan_for_splits");
        if (options.engine) {
          plan = with_engine(plan, *options.engine);
          heuristic = with_engine(heuristic, *options.engine);
        }
        if (options.l2_evict_first) plan.l2_evict_first = heuristic.l2_evict_first = *options.l2_evict_first;
        standard = with_engine(standard, DecodeEngine::kPortable);  // the reference: an independent kernel

        // Checks: the portable standard kernel on contiguous caches is the reference of this shape.
        if (page_size == 0) data.run(standard, stream, data.reference_out());
        bool row_ok = true;
        auto check = [&](const DecodePlan& p) {
          FLARE_BENCH_CHECK(cudaMemsetAsync(data.out(), 0xFF, data.out_elems() * kElemBytes, stream));
          data.zero_counters(p, stream);
          data.run(p, stream);
          const ErrorStats err = compare_bf16(data.out(), data.reference_out(), data.out_elems(), stream);
          const bool ok = err.rel_l2 < kMaxRelError && std::isfinite(err.max_abs);
          if (!ok)
            std::printf("CHECK FAILED: %s %s %s %s %s: rel err %g\n", shape.c_str(), layout_name(page_size).c_str(),
                        plan_name(p).c_str(), decode_engine_name(p.engine), decode_combine_name(p.combine), err.rel_l2);
          all_ok &= ok;
          row_ok &= ok;
          return err.rel_l2;
        };
        const double rel_err = check(plan);

        const Timing tg = time_plan(data, plan, graph, stream);
        const Timing tp = time_plan(data, plan, plain, stream);
#if FLARE_DECODE_TIMELINE
        // Two more launches, stamped (src/decode/decode_timeline.h): after an L2 flush like the timed
        // ones, then right after without one (the kernel's code and, where it fits, the cache still
        // in the L2: phases that touch no cache data and shrink there waited on instruction fetch).
        for (bool flush : {true, false}) {
          TimingOptions once = plain;
          once.warmup = 0, once.repeats = 1, once.flush_l2 = flush;
          decode::decode_timeline_reset(stream);
          (void)time_plan(data, plan, once, stream);
          std::printf("%s %s %s%s: %s", shape.c_str(), layout_name(page_size).c_str(), plan_name(plan).c_str(),
                      flush ? "" : ", L2 warm", decode::decode_timeline_summary().c_str());
        }
#endif
        const double us = 1e3 * tg.median_ms, gb_s = gbps(data.kv_bytes(), tg.median_ms);
        if (page_size == 0) contiguous_us = us;
        double heuristic_us = us;
        if (!same_launch(heuristic, plan)) heuristic_us = 1e3 * time_plan(data, heuristic, graph, stream).median_ms;

        const std::string source = plan.source == DecodePlanSource::kTuningTable ? "table" : "heuristic";
        std::vector<std::pair<std::string, Table::Cell>> row = {
            {"shape", shape}, {"layout", layout_name(page_size)}, {"plan", plan_name(plan)}, {"from", source},
            {"graph us", Table::Cell(us, 2)},
            {"p10-p90 %", Table::Cell(100 * (tg.p90_ms - tg.p10_ms) / tg.median_ms, 1)},
            {"plain us", Table::Cell(1e3 * tp.median_ms, 2)}, {"KV GB/s", Table::Cell(gb_s, 0)},
            {"of copy", Table::Cell(gb_s / copy_gbps, 2)}, {"vs contig", Table::Cell(us / contiguous_us, 3)},
            {"heuristic", plan_name(heuristic)}, {"heur us", Table::Cell(heuristic_us, 2)},
            {"rel err", Table::Cell(rel_err, 5)}};
        std::map<std::string, double> values = {
            {"graph_us", us}, {"graph_p10_us", 1e3 * tg.p10_ms}, {"graph_p90_us", 1e3 * tg.p90_ms},
            {"graph_stddev_us", 1e3 * tg.stddev_ms}, {"plain_us", 1e3 * tp.median_ms},
            {"plain_p10_us", 1e3 * tp.p10_ms}, {"plain_p90_us", 1e3 * tp.p90_ms}, {"kv_gbps", gb_s},
            {"copy_gbps", copy_gbps}, {"fraction_of_copy", gb_s / copy_gbps}, {"num_splits", plan.num_splits},
            {"heads_per_cta", plan.heads_per_cta}, {"heuristic_splits", heuristic.num_splits},
            {"heuristic_us", heuristic_us}, {"rel_err", rel_err}};

        if (options.compare) {
          // The previous path: the head-warp kernel and the combine kernel, planned by its own table.
          DecodePlan old;
          check_ok(decode_plan(key, baseline_table, sms, &old), "decode_plan (baseline)");
          old = with_engine(old, DecodeEngine::kHeadWarps);
          check(old);
          const double old_us = 1e3 * time_plan(data, old, graph, stream).median_ms;
          row.push_back({"old plan", plan_name(old)});
          row.push_back({"old us", Table::Cell(old_us, 2)});
          row.push_back({"old / new", Table::Cell(old_us / us, 2)});
          values["old_us"] = old_us;
          values["old_splits"] = old.num_splits;
          values["speedup_vs_old"] = old_us / us;
          if (plan.engine == DecodeEngine::kKeyGroups && plan.kernel == DecodeKernel::kSplitKv) {
            DecodePlan separate = plan, prezeroed = plan;
            separate.combine = DecodeCombine::kSeparateKernel;
            prezeroed.combine = DecodeCombine::kInKernelPrezeroed;
            check(separate);
            check(prezeroed);
            const double separate_us = 1e3 * time_plan(data, separate, graph, stream).median_ms;
            const double prezeroed_us = 1e3 * time_plan(data, prezeroed, graph, stream).median_ms;
            row.push_back({"comb.kernel us", Table::Cell(separate_us, 2)});
            row.push_back({"prezeroed us", Table::Cell(prezeroed_us, 2)});
            values["separate_combine_us"] = separate_us;
            values["prezeroed_us"] = prezeroed_us;
            if (plan.num_splits <= kDecodeMaxClusterSplits) {
              DecodePlan clustered = plan;
              clustered.combine = DecodeCombine::kCluster;
              check(clustered);
              const double cluster_us = 1e3 * time_plan(data, clustered, graph, stream).median_ms;
              row.push_back({"cluster us", Table::Cell(cluster_us, 2)});
              values["cluster_combine_us"] = cluster_us;
            } else {
              row.push_back({"cluster us", "-"});
            }
          } else {
            row.push_back({"comb.kernel us", "-"});
            row.push_back({"prezeroed us", "-"});
            row.push_back({"cluster us", "-"});
          }
        }
        row.push_back({"check", row_ok ? "ok" : "FAIL"});
        report.add_row(row);
        records.push_back({shape + " " + layout_name(page_size), values,
                           {{"batch", std::to_string(batch)}, {"cache_len", std::to_string(len)},
                            {"layout", layout_name(page_size)}, {"plan_source", source}, {"dtype", "bf16"},
                            {"engine", decode_engine_name(plan.engine)}, {"combine", decode_combine_name(plan.combine)},
                            {"heads_q", std::to_string(kHeadsQ)}, {"heads_kv", std::to_string(kHeadsKv)},
                            {"head_dim", std::to_string(kHeadDim)}}});
        std::fflush(stdout);
      }
    }
  report.print();
  if (!args.json_path.empty()) write_json(args.json_path, records);
  std::printf(all_ok ? "all checks passed\n" : "SOME CHECKS FAILED\n");
  return all_ok ? 0 : 1;
}

// Removes "--NAME PATH" / "--NAME=PATH" from argv (the shared parser does not know it).
std::string take_path_option(int* argc, char** argv, std::string_view name) {
  std::string value;
  int kept = 1;
  for (int i = 1; i < *argc; ++i) {
    const std::string_view a = argv[i];
    if (a == name && i + 1 < *argc) {
      value = argv[++i];
    } else if (a.starts_with(name) && a.size() > name.size() && a[name.size()] == '=') {
      value = std::string(a.substr(name.size() + 1));
    } else {
      argv[kept++] = argv[i];
    }
  }
  *argc = kept;
  return value;
}

// Removes the flag `name` from argv; whether it was there.
bool take_flag(int* argc, char** argv, std::string_view name) {
  bool found = false;
  int kept = 1;
  for (int i = 1; i < *argc; ++i) {
    if (name == argv[i]) {
      found = true;
    } else {
      argv[kept++] = argv[i];
    }
  }
  *argc = kept;
  return found;
}

DecodeEngine parse_engine(const std::string& name) {
  if (name.empty()) return DecodePlan{}.engine;  // the library's default
  if (const std::optional<DecodeEngine> e = decode_engine_from_name(name)) return *e;
  std::fprintf(stderr, "--engine: expected key_groups, head_warps or portable, got '%s'\n", name.c_str());
  std::exit(2);
}

DecodeCombine parse_combine(const std::string& name) {
  if (name.empty()) return DecodePlan{}.combine;
  if (const std::optional<DecodeCombine> c = decode_combine_from_name(name)) return *c;
  std::fprintf(stderr, "--combine: expected in_kernel, separate_kernel, in_kernel_prezeroed or cluster, got '%s'\n",
               name.c_str());
  std::exit(2);
}

int run(int argc, char** argv) {
  const std::string tune_path = take_path_option(&argc, argv, "--tune");
  key_group_combine = parse_combine(take_path_option(&argc, argv, "--combine"));
  BenchOptions options;
  options.table_path = take_path_option(&argc, argv, "--table");
  options.baseline_table_path = take_path_option(&argc, argv, "--baseline-table");
  const std::string engine_name = take_path_option(&argc, argv, "--engine");
  if (!engine_name.empty()) options.engine = parse_engine(engine_name);
  const bool all_engines = take_flag(&argc, argv, "--all-engines");
  const std::string show = take_path_option(&argc, argv, "--show");
  const std::string l2 = take_path_option(&argc, argv, "--l2");
  if (!l2.empty()) {
    if (l2 != "normal" && l2 != "evict_first") {
      std::fprintf(stderr, "--l2 must be normal or evict_first, got '%s'\n", l2.c_str());
      return 2;
    }
    options.l2_evict_first = l2 == "evict_first";
  }
  options.compare = take_flag(&argc, argv, "--compare");
  const Args args = parse_args_or_exit(argc, argv);
  require_cuda_device_or_exit();
  cudaStream_t stream;
  FLARE_BENCH_CHECK(cudaStreamCreate(&stream));
  if (!tune_path.empty()) {
    std::vector<DecodeEngine> engines = {options.engine.value_or(DecodePlan{}.engine)};
    if (all_engines) engines = {DecodeEngine::kKeyGroups, DecodeEngine::kHeadWarps};
    return tune(args, tune_path, engines, show.empty() ? 0 : std::atoi(show.c_str()), stream);
  }
  return benchmark(args, options, stream);
}

}  // namespace
}  // namespace flare::bench

int main(int argc, char** argv) { return flare::bench::run(argc, argv); }
