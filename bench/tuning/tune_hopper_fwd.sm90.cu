// Tile-shape sweep of the Hopper forward: times alternative HopperFwdConfigs on the benchmark's
// configuration (bf16, 16k tokens, hidden 2048, seqlen 4096 or --seqlen N, N dividing 16384), each
// checked against the simple fp32 kernel. Used to choose HopperFwdConfigFor<head_dim> (and whether
// the persistent grid wins at short sequences).
#include <cuda_bf16.h>

#include <cstdio>
#include <string>

#include "bench/tuning/fwd_tuning_env.h"
#include "src/attention/hopper/fwd_launch_impl.h"

namespace flare::bench {
namespace {

using hopper::HopperFwdConfig;

// -DFLARE_TUNE_HEAD_DIM=D compiles only head dim D's configurations (each is a kernel of its own:
// the whole sweep takes most of an hour to compile on two cores); 0, the default, all of them.
#ifndef FLARE_TUNE_HEAD_DIM
#define FLARE_TUNE_HEAD_DIM 0
#endif

template <typename Cfg, bool kPersistent>
void measure_config(Env& e, const char* label, bool causal) {
  constexpr int d = Cfg::kHeadDim;
  const int s = e.args.seqlen.value_or(4096);
  std::string name = "d" + std::to_string(d) + " s" + std::to_string(s) + (causal ? " causal " : " ") + label;
  if (!e.args.selected(name)) return;
  const int64_t n = int64_t{16384} * (2048 / d) * d;
  auto ref = params_for(e, d, s, causal, e.ref);
  if (!flare::detail::naive_attention_forward(ref, DType::kBFloat16, e.stream).ok()) std::abort();
  auto p = params_for(e, d, s, causal, e.out);
  FLARE_BENCH_CHECK(cudaMemsetAsync(e.out, 0xFF, n * 2, e.stream));
  Status st = hopper::launch_hopper_fwd_cfg<Cfg, __nv_bfloat16, kPersistent>(p, e.stream);
  if (!st.ok()) {
    e.table.add_row({{"config", name}, {"check", st.message()}});
    return;
  }
  const double rel = compare_bf16(e.out, e.ref, n, e.stream).rel_l2;
  Timing t = time_kernel([&](cudaStream_t st2) {
    if (!hopper::launch_hopper_fwd_cfg<Cfg, __nv_bfloat16, kPersistent>(p, st2).ok()) std::abort();
  }, e.args.timing({.warmup = 3, .repeats = 15}), e.stream);
  const double tf = tflops(attention_fwd_flops(16384 / s, 2048 / d, s, s, d, causal), t.median_ms);
  cudaFuncAttributes attr;
  FLARE_BENCH_CHECK(cudaFuncGetAttributes(&attr, hopper::hopper_fwd_kernel<Cfg, __nv_bfloat16, kPersistent>));
  e.table.add_row({{"config", name}, {"ms", Table::Cell(t.median_ms, 3)}, {"TFLOP/s", Table::Cell(tf, 1)},
                   {"spill B", static_cast<int>(attr.localSizeBytes)}, {"rel err", Table::Cell(rel, 4)},
                   {"check", rel < 2e-2 ? "ok" : "FAIL"}});
}

template <typename Cfg, bool kPersistent = false>
void measure(Env& e, const char* label, bool causal) {
  if constexpr (FLARE_TUNE_HEAD_DIM == 0 || FLARE_TUNE_HEAD_DIM == Cfg::kHeadDim)
    measure_config<Cfg, kPersistent>(e, label, causal);
}

// HopperFwdConfig<head dim, kBlockN, consumer warpgroups, stages, ping-pong, exp2 poly, lazy
// rescale, idle warpgroups skipped, two P sets>
void sweep(Env& e, bool causal) {
  measure<HopperFwdConfig<64, 128, 3>>(e, "3wg n128", causal);
  measure<HopperFwdConfig<64, 128, 3, 2, true, 0, false, false>>(e, "3wg n128 idle warpgroups compute", causal);
  measure<HopperFwdConfig<64, 128, 2>>(e, "2wg n128", causal);
  measure<HopperFwdConfig<64, 128, 3>, true>(e, "3wg n128 persistent", causal);
  measure<HopperFwdConfig<64, 128, 3, 3>>(e, "3wg n128 3 stages", causal);
  measure<HopperFwdConfig<64, 128, 3, 2, false>>(e, "3wg n128 no ping-pong", causal);
  measure<HopperFwdConfig<64, 128, 2>, true>(e, "2wg n128 persistent", causal);
  measure<HopperFwdConfig<64, 128, 2, 2, true, 0, false, true, true>>(e, "2wg n128 two P", causal);
  measure<HopperFwdConfig<64, 128, 2, 2, true, 0, false, true, true>, true>(e, "2wg n128 two P persistent", causal);
  measure<HopperFwdConfig<64, 192, 2, 2, true, 0, false, true, true>>(e, "2wg n192 two P", causal);
  measure<HopperFwdConfig<64, 192, 2, 2, true, 0, false, true, true>, true>(e, "2wg n192 two P persistent", causal);
  measure<HopperFwdConfig<64, 128, 3, 2, true, 0, false, true, true>>(e, "3wg n128 two P", causal);
  measure<HopperFwdConfig<64, 64, 3>, true>(e, "3wg n64 persistent", causal);
  measure<HopperFwdConfig<64, 64, 3, 4>, true>(e, "3wg n64 4 stages persistent", causal);
  measure<HopperFwdConfig<64, 64, 3, 2, true, 0, false, true, true>, true>(e, "3wg n64 two P persistent", causal);
  measure<HopperFwdConfig<96, 128, 2>>(e, "2wg n128", causal);
  measure<HopperFwdConfig<128, 128, 2>>(e, "2wg n128", causal);
  measure<HopperFwdConfig<128, 128, 2>, true>(e, "2wg n128 persistent", causal);
  measure<HopperFwdConfig<128, 128, 2, 3>>(e, "2wg n128 3 stages", causal);
  measure<HopperFwdConfig<128, 128, 2, 2, false>>(e, "2wg n128 no ping-pong", causal);
  measure<HopperFwdConfig<128, 128, 2, 2, true, 8>>(e, "2wg n128 exp2 poly 1/8", causal);
  measure<HopperFwdConfig<128, 128, 2, 2, true, 4>>(e, "2wg n128 exp2 poly 1/4", causal);
  measure<HopperFwdConfig<128, 64, 2>>(e, "2wg n64", causal);
  measure<HopperFwdConfig<128, 64, 3>>(e, "3wg n64", causal);
  measure<HopperFwdConfig<128, 64, 3>, true>(e, "3wg n64 persistent", causal);
  measure<HopperFwdConfig<128, 64, 3, 2, true, 0, true, true, true>>(e, "3wg n64 two P", causal);
  measure<HopperFwdConfig<128, 64, 3, 2, true, 0, true, true, true>, true>(e, "3wg n64 two P persistent", causal);
  measure<HopperFwdConfig<128, 128, 2, 2, true, 0, true, true, true>>(e, "2wg n128 two P", causal);
  measure<HopperFwdConfig<128, 128, 2, 2, true, 0, true, true, true>, true>(e, "2wg n128 two P persistent", causal);
  measure<HopperFwdConfig<128, 64, 3, 3>>(e, "3wg n64 3 stages", causal);
  measure<HopperFwdConfig<128, 64, 3, 4>>(e, "3wg n64 4 stages", causal);
  measure<HopperFwdConfig<128, 96, 3>>(e, "3wg n96", causal);
  measure<HopperFwdConfig<128, 80, 3>>(e, "3wg n80", causal);
  measure<HopperFwdConfig<128, 80, 3>, true>(e, "3wg n80 persistent", causal);
  measure<HopperFwdConfig<192, 96, 2>>(e, "2wg n96", causal);
  measure<HopperFwdConfig<256, 64, 2>>(e, "2wg n64", causal);
  measure<HopperFwdConfig<256, 64, 2>, true>(e, "2wg n64 persistent", causal);
  measure<HopperFwdConfig<256, 80, 2>>(e, "2wg n80", causal);
  measure<HopperFwdConfig<256, 64, 2, 2, false>>(e, "2wg n64 no ping-pong", causal);
  measure<HopperFwdConfig<256, 64, 2, 2, true, 4>>(e, "2wg n64 exp2 poly 1/4", causal);
  measure<HopperFwdConfig<256, 64, 2, 2, true, 0, true, true, true>>(e, "2wg n64 two P", causal);
  measure<HopperFwdConfig<256, 64, 2, 2, true, 0, true, true, true>, true>(e, "2wg n64 two P persistent", causal);
}

int run(int argc, char** argv) {
  Env e{};
  setup_fwd_tuning(e, argc, argv);
  if (16384 % e.args.seqlen.value_or(4096) != 0) {
    std::fprintf(stderr, "tune_hopper_fwd: --seqlen must divide 16384 (the batch is 16384 / seqlen)\n");
    return 2;
  }
  for (bool causal : {false, true}) sweep(e, causal);
  e.table.print();
  return 0;
}

}  // namespace
}  // namespace flare::bench

int main(int argc, char** argv) { return flare::bench::run(argc, argv); }
