// Tile-shape sweep of the portable forward: times alternative FwdTileConfigs against the default
// on the benchmark's configuration (bf16, 16k tokens, hidden 2048, seqlen 4096) and checks each
// against the simple fp32 kernel. Used to choose FwdConfigFor<head_dim>.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "bench/tuning/fwd_tuning_env.h"
#include "src/attention/portable/fwd_kernel.h"

namespace flare::bench {
namespace {

using portable::FwdTileConfig;

template <typename Cfg>
void measure(Env& e, const char* label, bool causal, int persistent = 0) {
  constexpr int d = Cfg::kHeadDim, s = 4096;
  std::string name = "d" + std::to_string(d) + (causal ? " causal " : " ") + label;
  if (!e.args.selected(name)) return;
  std::fprintf(stderr, "%s...\n", name.c_str());
  const int64_t n = int64_t{16384} * 2048;
  flare::detail::FwdKernelParams ref = params_for(e, d, s, causal, e.ref);
  if (!flare::detail::naive_attention_forward(ref, DType::kBFloat16, e.stream).ok()) std::abort();
  flare::detail::FwdKernelParams p = params_for(e, d, s, causal, e.out);
  FLARE_BENCH_CHECK(cudaMemsetAsync(e.out, 0xFF, n * 2, e.stream));
  Status st = portable::launch_portable_fwd_cfg<Cfg, __nv_bfloat16>(p, e.stream, persistent);
  if (!st.ok()) {
    e.table.add_row({{"config", name}, {"check", st.message()}});
    return;
  }
  const double rel = compare_bf16(e.out, e.ref, n, e.stream).rel_l2;
  FLARE_BENCH_CHECK(cudaStreamSynchronize(e.stream));
  Timing t = time_kernel([&](cudaStream_t st2) {
    if (!portable::launch_portable_fwd_cfg<Cfg, __nv_bfloat16>(p, st2, persistent).ok()) std::abort();
  }, e.args.timing({.warmup = 3, .repeats = 15}), e.stream);
  const double tf = tflops(attention_fwd_flops(16384 / s, 2048 / d, s, s, d, causal), t.median_ms);
  cudaFuncAttributes attr;
  FLARE_BENCH_CHECK(cudaFuncGetAttributes(&attr, portable::portable_fwd_kernel<Cfg, __nv_bfloat16, false>));
  int blocks = 0;
  FLARE_BENCH_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &blocks, portable::portable_fwd_kernel<Cfg, __nv_bfloat16, false>, Cfg::kThreads,
      portable::fwd_smem_bytes<Cfg, __nv_bfloat16>()));
  std::fprintf(stderr, "%-28s %8.3f ms %7.1f TFLOP/s regs %d CTAs/SM %d rel err %.4f\n", name.c_str(), t.median_ms,
               tf, attr.numRegs, blocks, rel);
  e.table.add_row({{"config", name}, {"ms", Table::Cell(t.median_ms, 3)}, {"TFLOP/s", Table::Cell(tf, 1)},
                   {"regs", attr.numRegs}, {"spill B", static_cast<int>(attr.localSizeBytes)},
                   {"CTAs/SM", blocks}, {"rel err", Table::Cell(rel, 4)}, {"check", rel < 2e-2 ? "ok" : "FAIL"}});
}

// warps, m-tiles per warp, kv block, stages
template <int d>
void sweep(Env& e, bool causal) {
  using Default = typename portable::FwdConfigFor<d>::type;
  measure<Default>(e, "default, one CTA per tile", causal, 0);
  measure<Default>(e, "default, persistent L2-grouped", causal, 1);
  if (e.args.quick) return;
  measure<FwdTileConfig<d, 4, 1, 64>>(e, "w4 m1 n64", causal);
  measure<FwdTileConfig<d, 8, 1, 64>>(e, "w8 m1 n64", causal);
  measure<FwdTileConfig<d, 4, 2, 32>>(e, "w4 m2 n32", causal);
  measure<FwdTileConfig<d, 4, 1, 32>>(e, "w4 m1 n32", causal);
  measure<FwdTileConfig<d, 8, 1, 32>>(e, "w8 m1 n32", causal);
  if constexpr (d <= 128) measure<FwdTileConfig<d, 4, 1, 64, 3>>(e, "w4 m1 n64 s3", causal);
  if constexpr (d <= 128) {
    measure<FwdTileConfig<d, 4, 2, 64>>(e, "w4 m2 n64", causal);
    measure<FwdTileConfig<d, 4, 1, 128>>(e, "w4 m1 n128", causal);
  }
  // The split K/V pipeline (kStages = 1): FlashAttention-2's H100 shapes, 128 x 64 on 4 warps at
  // d128 (70 KB: two CTAs an SM, as registers allow) and 64 x 64 on 4 warps at d256 (101 KB: two
  // CTAs, where the 2-stage w8 m1 n64 default's 198 KB fits one).
  measure<FwdTileConfig<d, 4, 1, 64, 1>>(e, "w4 m1 n64 split", causal);
  if constexpr (d <= 128) measure<FwdTileConfig<d, 4, 2, 64, 1>>(e, "w4 m2 n64 split", causal);
  if constexpr (d == 64) measure<FwdTileConfig<d, 4, 2, 128, 1>>(e, "w4 m2 n128 split", causal);  // FA2's d64
  // Around the split defaults: shorter key blocks (fewer S registers), more warps per CTA.
  if constexpr (d >= 128) measure<FwdTileConfig<d, 4, 1, 32, 1>>(e, "w4 m1 n32 split", causal);
  if constexpr (d >= 128) measure<FwdTileConfig<d, 8, 1, 64, 1>>(e, "w8 m1 n64 split", causal);
  if constexpr (d == 128) measure<FwdTileConfig<d, 4, 2, 32, 1>>(e, "w4 m2 n32 split", causal);
}

int run(int argc, char** argv) {
  Env e{};
  setup_fwd_tuning(e, argc, argv);
  for (bool causal : {false, true}) {
    sweep<64>(e, causal);
    sweep<128>(e, causal);
    sweep<256>(e, causal);
  }
  e.table.print();
  return 0;
}

}  // namespace
}  // namespace flare::bench

int main(int argc, char** argv) { return flare::bench::run(argc, argv); }
