// The portable attention kernels (src/attention/portable/fwd_kernel.h; bwd_kernel.h: the dpsum
// pre-pass, the main kernel and the fp32 -> dtype conversions), run on the CPU under the CUDA
// emulation of tests/cpu/cuda_emu (one OS thread per CUDA thread, the m16n8k16 fragment layouts
// of ldmatrix / mma.sync computed exactly): the kernels' index, mask and layout logic is checked
// on every CI run, without a GPU. g++ cannot parse the launchers' <<< >>>, so the kernel headers
// included here are copies made at build time with only the launch configurations cut and one
// PTX-only helper (cp_async_4) left to the emulation (tests/cpu/cuda_emu/emulable_kernel.cmake;
// tests/CMakeLists.txt puts the copies first).
//
// Each case goes through the API's own steps over host memory labelled as device memory:
// validate_attention_forward / _backward, make_fwd_kernel_params, bwd_workspace_layout and
// make_bwd_kernel_params, then the kernels with the launchers' grids, blocks and order
// (launch_portable_fwd_cfg, launch_portable_bwd_cfg). Outputs, workspace and shared memory are
// poisoned (NaN) first, and the results are judged by the GPU tests' rule (tests/gpu:
// attention_case.h, gpu_harness.h): max|emulated - fp64 oracle| <= k max|same math in the input
// dtype - oracle| + atol, no NaN, +inf LSE exactly where the oracle has it; and the error must
// be > 0 (16-bit operands are never exact), so a test that compares nothing cannot pass.
// Small shapes only (the emulation is slow); the GPU tests cover the rest. Not emulated: the
// attention-sinks gradient (bwd_common.cu's kernel: not in a header, and its function-scope
// __shared__ array would be one per thread under the emulation), so the backward cases have no
// sinks. The block-sparse kernels (fwd_sparse_kernel.h, bwd_sparse_kernel.h) are emulated by
// test_block_sparse_emulated.cpp.
#include "tests/cpu/cuda_emu/cuda_emu.h"  // first: the emulated runtime for the kernel headers

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <type_traits>
#include <utility>
#include <vector>

#include "flare/attention.h"
#include "reference/attention_ref.h"
#include "reference/host_tensor.h"
#include "src/attention/attention_args.h"
#include "src/attention/bwd_params.h"
#include "src/attention/fwd_params.h"
#include "src/attention/portable/bwd2_kernel.h"  // the emulable copies (see above)
#include "src/attention/portable/bwd_kernel.h"
#include "src/attention/portable/fwd_kernel.h"
#include "src/scheduling/tile_order.h"
#include "tests/cpu/emulated_attention.h"  // on_device, visit_kernel, run_bwd_finish, expect_close
#include "tests/gpu/attention_case.h"  // AttnCase, compare, within_tolerance

CUDA_EMU_SHARED_MEMORY(flare::portable, smem_raw)

namespace {

using flare::test::emu::expect_close;
using flare::test::emu::on_device;
using flare::test::emu::visit_kernel;

using flare::AttentionBackwardParams;
using flare::AttentionForwardParams;
using flare::DType;
using flare::Status;
using flare::TensorView;
using flare::detail::AttentionShape;
using flare::detail::BwdKernelParams;
using flare::detail::FwdKernelParams;
using flare::ref::HostTensor;
using flare::test::AttnCase;
using flare::test::ErrorReport;
namespace portable = flare::portable;

// A case and how it runs.
struct EmuCase {
  AttnCase c;
  // Forward grid: 0, one CTA per tile (detail::dense_fwd_grid: bands over the tile order); N > 0, the
  // persistent kernel on min(tiles, N) CTAs (the launcher's for uniform work, on a GPU of N
  // CTA slots), over the tile order for an L2 budget of l2_budget bytes.
  int persistent_ctas = 0;
  int64_t l2_budget = int64_t{25} << 20;  // half an H100's L2, as the launcher passes
  bool padded_rows = false;    // q, k, v rows 8 elements apart more than dense (strided operands)
  bool backward = false;
  bool deterministic = false;  // backward: dQ (and GQA's dK/dV) in turn order, through semaphores
  bool bwd_2d = false;         // backward: the 2-D warp tiling (bwd2_kernel.h) instead of bwd_kernel.h
  bool fwd_split = false;      // forward: the split K/V pipeline (FwdTileConfig kStages = 1), 4 warps x 64 keys
};

// The inputs of AttnProblem (tests/gpu/attention_case.h), drawn the same way, on the host; the
// shapes and varlen lengths are its AttnLayout.
struct Problem : flare::test::AttnLayout {
  explicit Problem(const EmuCase& e) : AttnLayout(e.c), c(e.c) {
    std::mt19937_64 rng(c.seed);
    const int pad = e.padded_rows ? 8 : 0;
    for (auto [t, shape] : {std::pair{&q, &q_shape}, {&k, &k_shape}, {&v, &k_shape}}) {
      std::vector<int64_t> stored = *shape;
      stored.back() += pad;
      t->reset(c.dtype, stored);
      t->fill(std::nan(""));  // the padding: read, it would show
    }
    q_view = operand_view(q, q_shape);
    k_view = operand_view(k, k_shape);
    v_view = operand_view(v, k_shape);
    fill_normal(q_view, rng);
    fill_normal(k_view, rng);
    fill_normal(v_view, rng);
    if (c.sinks) {
      sinks.reset(DType::kFloat32, {c.heads});
      sinks.fill_normal(rng);
    }
  }

  // The first `shape` elements of each row of `t` (all of them without padding).
  static TensorView operand_view(const HostTensor& t, const std::vector<int64_t>& shape) {
    TensorView v = t.view();
    v.shape[v.rank - 1] = shape.back();
    return v;
  }
  static void fill_normal(const TensorView& t, std::mt19937_64& rng) {
    std::normal_distribution<double> dist(0.0, 1.0);
    const int64_t d = t.shape[t.rank - 1], rows = t.numel() / d;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t e = 0; e < d; ++e) flare::ref::store(t, r * t.stride[t.rank - 2] + e, dist(rng));
  }

  template <typename P>
  void fill_common(P& p) const {
    p.q = q_view, p.k = k_view, p.v = v_view;
    p.mask = c.mask;
    p.softcap = c.softcap;
    if (c.sinks) p.sinks = sinks;
    if (c.varlen()) {
      p.cu_seqlens_q = cu_q, p.cu_seqlens_k = cu_k;
      p.max_seqlen_q = max_q, p.max_seqlen_k = max_k;
    }
  }

  AttnCase c;
  HostTensor q, k, v, sinks;
  TensorView q_view, k_view, v_view;
};



// launch_portable_fwd_cfg's grid and kernel for a given launch mode.
template <typename Cfg, typename T>
void run_forward_kernels_cfg(FwdKernelParams p, const EmuCase& e) {
  static_assert(portable::fwd_smem_bytes<Cfg, T>() <= static_cast<int>(cuda_emu::kSharedBytes));
  if (p.seqlen_q == 0 || p.batch == 0) return;
  if (e.persistent_ctas == 0) {
    const flare::detail::GridDims g = flare::detail::dense_fwd_grid(p, Cfg::kBlockM, Cfg::kBlockN, sizeof(T), e.l2_budget);
    cuda_emu::launch(dim3(g.x, g.y, g.z), Cfg::kThreads, portable::smem_raw, [&] {
      if (p.order.num_tiles > 0)
        portable::portable_fwd_kernel<Cfg, T, false, true>(p);
      else
        portable::portable_fwd_kernel<Cfg, T, false>(p);
    });
    return;
  }
  p.order = flare::sched::make_forward_order(
      flare::detail::forward_tile_shape(p, Cfg::kBlockM, Cfg::kBlockN, sizeof(T)), e.l2_budget);
  const dim3 grid(std::min(p.order.num_tiles, e.persistent_ctas));
  cuda_emu::launch(grid, Cfg::kThreads, portable::smem_raw, [&] { portable::portable_fwd_kernel<Cfg, T, true>(p); });
}

template <int kHeadDim, typename T>
void run_forward_kernels(const FwdKernelParams& p, const EmuCase& e) {
  if (e.fwd_split)  // the tuning sweep's split-pipeline shapes (bench/tuning/tune_portable_fwd.cu)
    run_forward_kernels_cfg<portable::FwdTileConfig<kHeadDim, 4, kHeadDim <= 128 ? 2 : 1, 64, 1>, T>(p, e);
  else
    run_forward_kernels_cfg<typename portable::FwdConfigFor<kHeadDim>::type, T>(p, e);
}

// launch_portable_bwd_cfg: the dpsum pre-pass, the main kernel, the conversions.
template <int kHeadDim, typename T>
void run_backward_kernels(const BwdKernelParams& P, bool bwd_2d, int64_t l2_budget) {
  using Cfg = typename portable::BwdConfigFor<kHeadDim>::type;
  using Cfg2 = typename portable::Bwd2ConfigFor<kHeadDim>::type;
  static_assert(portable::bwd_smem_bytes<Cfg, T>() <= static_cast<int>(cuda_emu::kSharedBytes));
  static_assert(portable::bwd2_smem_bytes<Cfg2, T>() <= static_cast<int>(cuda_emu::kSharedBytes));
  static_assert(Cfg2::kBlockN == Cfg::kBlockN, "the 2-D tiling runs on the API's key blocks");
  const FwdKernelParams& p = P.fwd;
  if (p.batch == 0 || p.heads == 0) return;
  unsigned char* smem = portable::smem_raw;
  if (p.seqlen_q > 0)
    cuda_emu::launch(dim3((p.seqlen_q + 7) / 8, p.heads, p.batch), 256, smem,
                     [&] { portable::bwd_dpsum_kernel<T>(P); });
  if (p.seqlen_k > 0 && P.num_n_blocks > 0) {
    // The launcher's grid (launch_bwd_passes): masked ordinary work over the tile order.
    BwdKernelParams ordered = P;
    const flare::detail::GridDims g = flare::detail::dense_bwd_grid(ordered, Cfg::kBlockN, sizeof(T), l2_budget);
    if (bwd_2d)  // the library's step order per mode (launch_portable_bwd2_cfg)
      cuda_emu::launch(dim3(g.x, g.y, g.z), Cfg2::kThreads, smem, [&] {
        if (P.deterministic) portable::portable_bwd2_kernel<Cfg2, T, FLARE_PORTABLE_BWD2_DET_DQ_FIRST != 0>(ordered);
        else portable::portable_bwd2_kernel<Cfg2, T>(ordered);
      });
    else
      cuda_emu::launch(dim3(g.x, g.y, g.z), Cfg::kThreads, smem,
                       [&] { portable::portable_bwd_kernel<Cfg, T>(ordered); });
  }
  flare::test::emu::run_bwd_finish<T>(P, smem);
}


void run_case(const EmuCase& e) {
  const AttnCase& c = e.c;
  SCOPED_TRACE(c.name());
  std::printf("  %s%s%s%s\n", c.name().c_str(), e.persistent_ctas ? " persistent" : "",
              e.backward ? (e.deterministic ? " + backward, deterministic" : " + backward") : "",
              e.backward && e.bwd_2d ? " (2-D tiling)" : "");
  Problem pr(e);

  // Forward: the oracle (fp64 and in the input dtype), then the kernel.
  HostTensor out_ref(DType::kFloat64, pr.q_shape), out_lowp(DType::kFloat64, pr.q_shape);
  HostTensor lse_ref(DType::kFloat64, pr.lse_shape), lse_lowp(DType::kFloat64, pr.lse_shape);
  {
    AttentionForwardParams f;
    pr.fill_common(f);
    f.out = out_ref, f.lse = lse_ref;
    ASSERT_TRUE(flare::ref::attention_forward(f).ok());
    f.out = out_lowp, f.lse = lse_lowp;
    ASSERT_TRUE(flare::ref::attention_forward(f, {true}).ok());
  }
  HostTensor out(c.dtype, pr.q_shape), lse(DType::kFloat32, pr.lse_shape);
  out.fill(std::nan(""));
  lse.fill(std::nan(""));
  AttentionForwardParams f;
  pr.fill_common(f);
  f.out = out, f.lse = lse;
  f = on_device(f);
  AttentionShape shape;
  const Status sf = flare::detail::validate_attention_forward(f, flare::DeviceKind::kCUDA, &shape);
  ASSERT_TRUE(sf.ok()) << sf.message();
  const FwdKernelParams kp = flare::detail::make_fwd_kernel_params(f, shape);
  const bool uniform = !kp.causal && kp.window_left < 0 && kp.window_right < 0;
  ASSERT_TRUE(uniform || e.persistent_ctas == 0) << "the launcher runs masked work one CTA per tile";
  visit_kernel(shape.head_dim, c.dtype, [&](auto hd, auto elem) {
    run_forward_kernels<decltype(hd)::value, decltype(elem)>(kp, e);
  });
  expect_close(out, out_ref, out_lowp, "out", 2.0, 1e-5);
  // The LSE is fp32 in every implementation: judged by an fp32-level tolerance (as on the GPU).
  expect_close(lse, lse_ref, lse_lowp, "lse", 2.0, 1e-5, 1e-4);
  if (!e.backward) return;

  // Backward from the emulated forward's out and lse, as attention_backward runs it.
  ASSERT_FALSE(c.sinks) << "the sinks gradient kernel is not emulated";
  std::mt19937_64 rng(c.seed + 7);
  HostTensor dout(c.dtype, pr.q_shape);
  dout.fill_normal(rng);
  HostTensor dq_ref, dk_ref, dv_ref, dq_lowp, dk_lowp, dv_lowp;
  for (bool emulate : {false, true}) {
    HostTensor& dq = emulate ? dq_lowp : dq_ref;
    HostTensor& dk = emulate ? dk_lowp : dk_ref;
    HostTensor& dv = emulate ? dv_lowp : dv_ref;
    dq.reset(DType::kFloat64, pr.q_shape);
    dk.reset(DType::kFloat64, pr.k_shape);
    dv.reset(DType::kFloat64, pr.k_shape);
    HostTensor lse64(DType::kFloat64, pr.lse_shape);
    AttentionBackwardParams b;
    pr.fill_common(b);
    b.lse = lse64, b.dout = dout, b.dq = dq, b.dk = dk, b.dv = dv;
    ASSERT_TRUE(flare::ref::attention_backward(b, {emulate}).ok());
  }
  HostTensor dq(c.dtype, pr.q_shape), dk(c.dtype, pr.k_shape), dv(c.dtype, pr.k_shape);
  for (HostTensor* t : {&dq, &dk, &dv}) t->fill(std::nan(""));
  AttentionBackwardParams b;
  pr.fill_common(b);
  b.out = out, b.lse = lse, b.dout = dout, b.dq = dq, b.dk = dk, b.dv = dv;
  b.deterministic = e.deterministic;
  b = on_device(b);
  const Status sb = flare::detail::validate_attention_backward(b, flare::DeviceKind::kCUDA, &shape);
  ASSERT_TRUE(sb.ok()) << sb.message();
  visit_kernel(shape.head_dim, c.dtype, [&](auto hd, auto elem) {
    using Cfg = typename portable::BwdConfigFor<decltype(hd)::value>::type;
    // plan_backward's layout and attention_backward's reset: zero from dq_accum on; dpsum poisoned.
    const flare::detail::BwdWorkspaceLayout l =
        flare::detail::bwd_workspace_layout(shape, Cfg::kBlockM, Cfg::kBlockN, b.deterministic);
    std::vector<unsigned char> workspace(l.total + 256, 0xFF);
    unsigned char* ws = workspace.data() + (256 - reinterpret_cast<uintptr_t>(workspace.data()) % 256) % 256;
    std::memset(ws + l.dq_accum, 0, l.total - l.dq_accum);
    const BwdKernelParams P = flare::detail::make_bwd_kernel_params(
        b, flare::detail::make_fwd_kernel_params(flare::detail::forward_view(b), shape), shape, l, ws, Cfg::kBlockM,
        Cfg::kBlockN);
    run_backward_kernels<decltype(hd)::value, decltype(elem)>(P, e.bwd_2d, e.l2_budget);
  });
  // tests/gpu/attention_case.h's check_backward: k = 2, atol 1e-3 (without its one-ulp allowance).
  expect_close(dq, dq_ref, dq_lowp, "dq", 2.0, 1e-3);
  expect_close(dk, dk_ref, dk_lowp, "dk", 2.0, 1e-3);
  expect_close(dv, dv_ref, dv_lowp, "dv", 2.0, 1e-3);
}

AttnCase attn(int batch, int seqlen_q, int seqlen_k, int heads, int heads_kv, int head_dim, DType dtype,
              flare::MaskParams mask, uint64_t seed) {
  AttnCase c;
  c.batch = batch, c.seqlen_q = seqlen_q, c.seqlen_k = seqlen_k, c.heads = heads, c.heads_kv = heads_kv;
  c.head_dim = head_dim, c.dtype = dtype, c.mask = mask, c.seed = seed;
  return c;
}

constexpr DType kBf16 = DType::kBFloat16, kFp16 = DType::kFloat16;
constexpr flare::MaskParams kNoMask{}, kCausal{true, -1, -1};

// Lengths that are no tile multiples; uniform work on the persistent grid, where a CTA takes
// several tiles (4 tiles on 3 CTAs; an L2 budget of one byte: a group per (batch, kv head)).
TEST(AttentionEmulated, ForwardUniformPersistent) {
  run_case({.c = attn(2, 33, 47, 2, 2, 128, kBf16, kNoMask, 1), .persistent_ctas = 3, .l2_budget = 1});
  run_case({.c = attn(1, 150, 70, 2, 1, 64, kFp16, kNoMask, 2), .persistent_ctas = 2, .padded_rows = true});
}

// Masks on the one-CTA-per-tile grid, longest first: causal over two query blocks with GQA 2:1,
// causal with more queries than keys (the first rows see no key: out 0, LSE +inf), a two-sided
// sliding window, and causal with a window at a head dim below the kernel's (96 on the 128 one).
TEST(AttentionEmulated, ForwardMasks) {
  run_case({.c = attn(1, 150, 170, 2, 1, 128, kFp16, kCausal, 3)});
  run_case({.c = attn(2, 33, 47, 2, 1, 64, kBf16, kCausal, 4)});
  run_case({.c = attn(1, 70, 33, 2, 1, 64, kBf16, kCausal, 9)});
  run_case({.c = attn(1, 70, 90, 2, 2, 64, kFp16, {false, 16, 8}, 5), .padded_rows = true});
  run_case({.c = attn(1, 33, 47, 2, 2, 96, kBf16, {true, 20, -1}, 6)});
}

// Masked work over L2 groups of the tile order, the partial group first (6 (batch, kv head) units:
// forward K/V 12,032 bytes a unit, 4 a group in 50,000 bytes: groups of 2 and 4; backward 20,800
// bytes a unit, 4 a group in 83,200: the same), one CTA per index: every tile once.
TEST(AttentionEmulated, MaskedTilesInGroupsOfTheOrder) {
  run_case({.c = attn(3, 40, 47, 2, 2, 64, kBf16, kCausal, 31), .l2_budget = 50000});
  run_case({.c = attn(3, 40, 47, 2, 2, 64, kFp16, {true, 20, -1}, 32), .l2_budget = 83200, .backward = true});
  run_case({.c = attn(3, 40, 47, 2, 2, 64, kBf16, kCausal, 33), .l2_budget = 83200, .backward = true, .bwd_2d = true});
}

// The split K/V pipeline (one K and one V buffer, FlashAttention-2's load order): causal over
// several key blocks with GQA, a window with padded rows, uniform work on the persistent grid (a
// CTA's second tile starts its groups afresh), and varlen with an empty sequence and a keyless one.
TEST(AttentionEmulated, ForwardSplitPipeline) {
  run_case({.c = attn(1, 150, 170, 2, 1, 128, kFp16, kCausal, 21), .fwd_split = true});
  run_case({.c = attn(1, 70, 200, 2, 2, 64, kBf16, {false, 48, 8}, 22), .padded_rows = true, .fwd_split = true});
  run_case({.c = attn(2, 33, 147, 2, 2, 128, kBf16, kNoMask, 23), .persistent_ctas = 3, .l2_budget = 1,
            .fwd_split = true});
  AttnCase varlen = attn(4, 0, 0, 2, 1, 64, kBf16, {true, 20, -1}, 24);
  varlen.varlen_q = {0, 17, 40, 3};
  varlen.varlen_k = {5, 130, 47, 0};
  run_case({.c = varlen, .fwd_split = true});
}

// Soft-capping and attention sinks; varlen with an empty query sequence and one with no keys
// (its rows: out 0, LSE +inf).
TEST(AttentionEmulated, ForwardSoftcapSinksVarlen) {
  AttnCase capped = attn(1, 33, 47, 2, 2, 64, kBf16, kNoMask, 7);
  capped.softcap = 5.f;
  capped.sinks = true;
  run_case({.c = capped, .persistent_ctas = 1});
  AttnCase varlen = attn(4, 0, 0, 2, 1, 128, kBf16, {true, 20, -1}, 8);
  varlen.varlen_q = {0, 17, 40, 3};
  varlen.varlen_k = {5, 30, 47, 0};
  run_case({.c = varlen});
}

// The backward after the emulated forward, deterministic (the dQ turn semaphores; with GQA the
// dK/dV ones too, which the emulation checks: a block's turn must have come when it asks):
// causal over two key blocks with GQA 2:1 (kv blocks in descending order, dK/dV through the fp32
// accumulators and their conversion); varlen with an empty sequence, GQA, a two-sided window and
// soft-capping. Ordinary mode: dense dK/dV writes; causal with rows that see no key, GQA, head
// dim 96 on the 128 kernel.
TEST(AttentionEmulated, Backward) {
  run_case({.c = attn(1, 33, 150, 2, 1, 128, kBf16, kCausal, 11), .backward = true, .deterministic = true});
  AttnCase varlen = attn(3, 0, 0, 2, 1, 64, kBf16, {false, 10, 10}, 13);
  varlen.varlen_q = {17, 0, 40};
  varlen.varlen_k = {30, 5, 47};
  varlen.softcap = 4.f;
  run_case({.c = varlen, .backward = true, .deterministic = true});
  run_case({.c = attn(2, 40, 47, 2, 2, 64, kFp16, kNoMask, 12), .persistent_ctas = 4, .backward = true});
  run_case({.c = attn(1, 70, 33, 2, 1, 96, kFp16, kCausal, 14), .backward = true});
}

// The same cases on the 2-D warp tiling (bwd2_kernel.h, docs/portable_bwd_v2.md).
TEST(AttentionEmulated, Backward2dTiling) {
  run_case({.c = attn(1, 33, 150, 2, 1, 128, kBf16, kCausal, 11), .backward = true, .deterministic = true,
            .bwd_2d = true});
  AttnCase varlen = attn(3, 0, 0, 2, 1, 64, kBf16, {false, 10, 10}, 13);
  varlen.varlen_q = {17, 0, 40};
  varlen.varlen_k = {30, 5, 47};
  varlen.softcap = 4.f;
  run_case({.c = varlen, .backward = true, .deterministic = true, .bwd_2d = true});
  run_case({.c = attn(2, 40, 47, 2, 2, 64, kFp16, kNoMask, 12), .persistent_ctas = 4, .backward = true, .bwd_2d = true});
  run_case({.c = attn(1, 70, 33, 2, 1, 96, kFp16, kCausal, 14), .backward = true, .bwd_2d = true});
  run_case({.c = attn(1, 150, 170, 1, 1, 128, kBf16, {true, 60, -1}, 15), .backward = true, .bwd_2d = true});
  // Head dim 256 (FlashAttention-2's warp grids: S on 4 x 2, dK/dV on 2 x 4), served to 200
  // columns; GQA deterministic, causal.
  run_case({.c = attn(1, 90, 130, 2, 1, 200, kBf16, kCausal, 16), .backward = true, .deterministic = true,
            .bwd_2d = true});
}

}  // namespace
