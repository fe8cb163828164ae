// Tile-shape sweep of the portable backward (ordinary and deterministic) on the benchmark's
// configuration (bf16, 16k tokens, hidden 2048, seqlen 4096). Each variant's dQ/dK/dV are compared
// with the default configuration's (relative L2): used to choose BwdConfigFor<head_dim>.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "bench/common/bench_common.h"
#include "src/attention/attention_args.h"
#include "src/attention/portable/bwd2_kernel.h"
#include "src/attention/portable/bwd_kernel.h"

namespace flare::bench {
namespace {

using portable::BwdTileConfig;

constexpr int kSeqlen = 4096;
constexpr int64_t kElems = int64_t{16384} * 2048;

struct Env {
  __nv_bfloat16 *q, *k, *v, *out, *dout, *dq, *dk, *dv, *ref_dq;
  float* lse;
  void* ws;
  cudaStream_t stream;
  Args args;
  Table table;
};

AttentionBackwardParams api_params(Env& e, int d, bool causal, bool det) {
  const int b = 16384 / kSeqlen, h = 2048 / d;
  auto view = [&](void* p) { return TensorView::contiguous(p, DType::kBFloat16, {b, kSeqlen, h, d}); };
  AttentionBackwardParams p;
  p.q = view(e.q);
  p.k = view(e.k);
  p.v = view(e.v);
  p.out = view(e.out);
  p.dout = view(e.dout);
  p.dq = view(e.dq);
  p.dk = view(e.dk);
  p.dv = view(e.dv);
  p.lse = TensorView::contiguous(e.lse, DType::kFloat32, {b, h, kSeqlen});
  p.mask.causal = causal;
  p.deterministic = det;
  p.stream = e.stream;
  return p;
}

// The forward (out, lse) and the default backward's dQ as the reference for this head dim.
void prepare(Env& e, int d, bool causal) {
  AttentionBackwardParams bp = api_params(e, d, causal, false);
  AttentionForwardParams f = flare::detail::forward_view(bp);
  f.stream = e.stream;
  if (!attention_forward(f).ok() || !attention_backward(bp).ok()) std::abort();
  FLARE_BENCH_CHECK(cudaMemcpyAsync(e.ref_dq, e.dq, kElems * 2, cudaMemcpyDeviceToDevice, e.stream));
}

// k2d: Cfg is a Bwd2TileConfig, run by the 2-D warp tiling (bwd2_kernel.h).
template <typename Cfg, bool k2d = false>
void measure(Env& e, const char* label, bool causal) {
  constexpr int d = Cfg::kHeadDim;
  const std::string name = "d" + std::to_string(d) + (causal ? " causal " : " ") + label;
  if (!e.args.selected(name)) return;
  std::fprintf(stderr, "%s...\n", name.c_str());
  double ms[2] = {0, 0}, err = 0;
  for (int det = 0; det < 2; ++det) {
    AttentionBackwardParams bp = api_params(e, d, causal, det == 1);
    flare::detail::AttentionShape shape;
    if (!flare::detail::validate_attention_backward(bp, DeviceKind::kCUDA, &shape).ok()) std::abort();
    const auto layout = flare::detail::bwd_workspace_layout(shape, Cfg::kBlockM, Cfg::kBlockN, det == 1);
    const auto kp = flare::detail::make_bwd_kernel_params(
        bp, flare::detail::make_fwd_kernel_params(flare::detail::forward_view(bp), shape), shape, layout, e.ws,
        Cfg::kBlockM, Cfg::kBlockN);
    auto run = [&](cudaStream_t st) {
      FLARE_BENCH_CHECK(cudaMemsetAsync(static_cast<char*>(e.ws) + layout.dq_accum, 0, layout.total - layout.dq_accum, st));
      Status s;
      if constexpr (k2d) s = portable::launch_portable_bwd2_cfg<Cfg, __nv_bfloat16>(kp, st);
      else s = portable::launch_portable_bwd_cfg<Cfg, __nv_bfloat16>(kp, st);
      if (!s.ok()) {
        std::fprintf(stderr, "%s: %s\n", name.c_str(), s.message().c_str());
        std::exit(1);
      }
    };
    run(e.stream);
    if (det == 0) {
      err = compare_bf16(e.dq, e.ref_dq, kElems, e.stream).rel_l2;
    }
    ms[det] = time_kernel(run, e.args.timing({.warmup = 2, .repeats = 10}), e.stream).median_ms;
  }
  cudaFuncAttributes attr;
  if constexpr (k2d) FLARE_BENCH_CHECK(cudaFuncGetAttributes(&attr, portable::portable_bwd2_kernel<Cfg, __nv_bfloat16>));
  else FLARE_BENCH_CHECK(cudaFuncGetAttributes(&attr, portable::portable_bwd_kernel<Cfg, __nv_bfloat16>));
  const double flops = 2.5 * attention_fwd_flops(16384 / kSeqlen, 2048 / d, kSeqlen, kSeqlen, d, causal);
  std::fprintf(stderr, "%-26s %7.3f ms %6.1f TF/s det %7.3f ms %6.1f TF/s regs %d spill %d err %.4f\n", name.c_str(),
               ms[0], tflops(flops, ms[0]), ms[1], tflops(flops, ms[1]), attr.numRegs, (int)attr.localSizeBytes, err);
  e.table.add_row({{"config", name}, {"ms", Table::Cell(ms[0], 3)}, {"TFLOP/s", Table::Cell(tflops(flops, ms[0]), 1)},
                   {"det ms", Table::Cell(ms[1], 3)}, {"det TFLOP/s", Table::Cell(tflops(flops, ms[1]), 1)},
                   {"regs", attr.numRegs}, {"spill B", static_cast<int>(attr.localSizeBytes)},
                   {"dq err vs default", Table::Cell(err, 4)}});
}

// row warps (16 keys each), warps per key rows (dK/dV column split), query block
template <int d>
void sweep(Env& e, bool causal) {
  prepare(e, d, causal);
  measure<BwdTileConfig<d, 4, 1, 16>>(e, "r4 c1 m16", causal);
  measure<BwdTileConfig<d, 4, 1, 32>>(e, "r4 c1 m32", causal);
  measure<BwdTileConfig<d, 4, 2, 32>>(e, "r4 c2 m32", causal);
  measure<BwdTileConfig<d, 4, 2, 64>>(e, "r4 c2 m64", causal);
  measure<BwdTileConfig<d, 8, 1, 32>>(e, "r8 c1 m32", causal);
  if constexpr (d <= 64) measure<BwdTileConfig<d, 4, 1, 64>>(e, "r4 c1 m64", causal);
  if constexpr (d >= 128) measure<BwdTileConfig<d, 2, 2, 32>>(e, "r2 c2 m32", causal);
  measure<typename portable::Bwd2ConfigFor<d>::type, true>(e, "2-D tiling", causal);  // docs/portable_bwd_v2.md
  if constexpr (d == 64) measure<portable::Bwd2TileConfig<64, 128, 128>, true>(e, "2-D tiling m128", causal);
}

int run(int argc, char** argv) {
  Env e{};
  e.args = parse_args_or_exit(argc, argv);
  require_cuda_device_or_exit();
  FLARE_BENCH_CHECK(cudaStreamCreate(&e.stream));
  for (__nv_bfloat16** p : {&e.q, &e.k, &e.v, &e.out, &e.dout, &e.dq, &e.dk, &e.dv, &e.ref_dq})
    FLARE_BENCH_CHECK(cudaMalloc(p, kElems * 2));
  FLARE_BENCH_CHECK(cudaMalloc(&e.lse, kElems / 64 * 4));
  FLARE_BENCH_CHECK(cudaMalloc(&e.ws, size_t{1} << 31));  // 2 GiB: any layout of this configuration fits
  fill_normal_bf16(e.q, kElems, 1, e.stream);
  fill_normal_bf16(e.k, kElems, 2, e.stream);
  fill_normal_bf16(e.v, kElems, 3, e.stream);
  fill_normal_bf16(e.dout, kElems, 4, e.stream);
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
