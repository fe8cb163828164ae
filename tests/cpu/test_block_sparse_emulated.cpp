// The portable BLOCK-SPARSE attention kernels (src/attention/portable/fwd_sparse_kernel.h, and
// bwd_sparse_kernel.h in its ordinary and deterministic modes, with bwd_kernel.h's dpsum pre-pass
// and fp32 -> dtype conversions around it), run on the CPU under the CUDA emulation of
// tests/cpu/cuda_emu (one OS thread per CUDA thread, the m16n8k16 fragment layouts of ldmatrix /
// mma.sync computed exactly): the kernels' list walks, block and tile ends, element predicates and
// deterministic turns are checked on every CI run, without a GPU. As in test_attention_emulated,
// the kernel headers included here are build-time copies with the launch configurations cut
// (tests/cpu/cuda_emu/emulable_kernel.cmake; tests/CMakeLists.txt puts them first).
//
// Each case builds its block mask on the host as tests/gpu/block_sparse_case.h does (the host
// builders of src/block_sparse/block_mask_build.h: an element mask classified block by block, or
// random block kinds over random bits), then goes through the API's own steps
// (attention_api.cpp) over host memory labelled as device memory: validate_attention_forward /
// _backward, validate_block_mask (kCUDA), make_fwd_kernel_params, make_block_sparse_params, the
// block-sparse backward's workspace layout (its sparse semaphore counts as plan_backward computes
// them), make_bwd_kernel_params and, deterministic, make_block_sparse_dq_plan over the mask's CPU
// views and dq_plan_view; then the kernels with the launchers' grids, blocks and order
// (launch_portable_fwd_sparse_cfg, launch_portable_bwd_sparse_cfg). Outputs, workspace and shared
// memory are poisoned (NaN) first; the oracle is reference/attention_ref.h's forward and backward
// over the same mask (fp64, and in the input dtype), and the results are judged by the GPU tests'
// rule (tests/gpu/block_sparse_case.h via attention_case.h: max|emulated - oracle| <= 2 max|lowp -
// oracle| + atol, no NaN, +inf LSE exactly where the oracle has it), with the error also required
// to be > 0. Tiny shapes only (the emulation is slow: about 20 s on 2 cores for the four cases);
// tests/gpu/test_block_sparse.cu covers the rest. Not emulated: the attention-sinks gradient (as in
// test_attention_emulated), so no case has sinks.
//
// Checked to fail (temporary edits of this test's params): the partial and full lists swapped
// (forward: every case; backward: every case's ordinary mode, as the deterministic one walks the
// plan), a block count one short (num_kv_blocks forward, num_q_blocks backward) and the plan's full
// flags inverted (deterministic) each fail all four cases, by errors of 0.1 to 300 against
// baselines of 0.001 to 0.016; a plan turn off by one aborts the emulation (a CTA would wait
// forever for its turn).
#include "tests/cpu/cuda_emu/cuda_emu.h"  // first: the emulated runtime for the kernel headers

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "flare/attention.h"
#include "flare/block_mask.h"
#include "reference/attention_ref.h"
#include "reference/host_tensor.h"
#include "src/attention/attention_args.h"
#include "src/attention/bwd_params.h"
#include "src/attention/fwd_params.h"
#include "src/attention/portable/bwd_sparse_kernel.h"  // the emulable copies (see above)
#include "src/attention/portable/fwd_sparse_kernel.h"
#include "src/block_sparse/block_mask_args.h"
#include "src/block_sparse/block_mask_build.h"
#include "src/block_sparse/block_sparse_params.h"
#include "src/block_sparse/dq_write_order.h"
#include "tests/cpu/emulated_attention.h"  // on_device, visit_kernel, run_bwd_finish, expect_close
#include "tests/gpu/attention_case.h"  // AttnCase, AttnLayout, compare, within_tolerance

CUDA_EMU_SHARED_MEMORY(flare::portable, smem_raw)

namespace {

using flare::test::emu::expect_close;
using flare::test::emu::on_device;
using flare::test::emu::visit_kernel;

using flare::AttentionBackwardParams;
using flare::AttentionForwardParams;
using flare::BlockMask;
using flare::DType;
using flare::ElementMask;
using flare::Status;
using flare::TensorView;
using flare::block_sparse::BlockKindGrid;
using flare::block_sparse::BlockMaskGeometry;
using flare::block_sparse::BlockSparseParams;
using flare::block_sparse::DqPlanView;
using flare::block_sparse::HostBlockMask;
using flare::block_sparse::TileKind;
using flare::detail::AttentionShape;
using flare::detail::BwdKernelParams;
using flare::detail::FwdKernelParams;
using flare::ref::HostTensor;
using flare::test::AttnCase;
using flare::test::ErrorReport;
namespace portable = flare::portable;

// The mask kinds (block_sparse_case.h's MaskKind, those these cases use).
enum class MaskKind {
  kCausal,        // ElementMask::causal; diagonal blocks partial, those below full
  kPrefixLm,      // prefix-LM: the keys before prefix_length, and causal after
  kDocuments,     // doc ids (two documents per sequence) and causal
  kRandomBlocks,  // random block kinds (a third each), random bits inside the partial ones
};

const char* kind_name(MaskKind k) {
  switch (k) {
    case MaskKind::kCausal: return "causal";
    case MaskKind::kPrefixLm: return "prefix-lm";
    case MaskKind::kDocuments: return "documents";
    case MaskKind::kRandomBlocks: return "random-blocks";
  }
  return "?";
}

struct SparseEmuCase {
  AttnCase c;  // shapes, dtype, dense mask (composed with the block mask), seed
  MaskKind kind = MaskKind::kCausal;
  int q_block = 128, kv_block = 128;
  bool broadcast_heads = false;  // the mask's head dim 1

  std::string name() const {
    return std::string(kind_name(kind)) + " blocks " + std::to_string(q_block) + "x" + std::to_string(kv_block) +
           (broadcast_heads ? " bcast-h" : "") + " | " + c.name();
  }
};

// The case's block mask on the host: the element tensors, the builder's lists, their CPU views
// (the oracle's, the planner's) and the same memory labelled as device memory (the kernels').
struct HostMask {
  HostTensor doc_q, doc_k, bits;
  ElementMask element;
  HostBlockMask host;
  BlockMask host_view, device_view;
  int partial_blocks = 0, full_blocks = 0, empty_blocks = 0;  // over the mask's rows
};

void build_mask(const SparseEmuCase& e, HostMask* m) {
  const AttnCase& c = e.c;
  std::mt19937_64 rng(c.seed * 7919 + 13);
  BlockMaskGeometry g;
  g.batch = c.batch;
  g.heads = e.broadcast_heads ? 1 : c.heads;
  g.seqlen_q = c.seqlen_q, g.seqlen_k = c.seqlen_k;
  g.q_block_size = e.q_block, g.kv_block_size = e.kv_block;
  ElementMask& el = m->element;
  switch (e.kind) {
    case MaskKind::kCausal:
      el.causal = true;
      break;
    case MaskKind::kPrefixLm:
      el.prefix_length = 50;
      break;
    case MaskKind::kDocuments: {
      // Sorted documents, the same boundaries on both sides, one boundary per batch entry at a
      // random position: long enough documents for full blocks inside them.
      m->doc_q.reset(DType::kInt32, {c.batch, c.seqlen_q});
      m->doc_k.reset(DType::kInt32, {c.batch, c.seqlen_k});
      for (int b = 0; b < c.batch; ++b) {
        const int boundary = 20 + static_cast<int>(rng() % 80);
        for (int t = 0; t < c.seqlen_q; ++t) m->doc_q.set(int64_t{b} * c.seqlen_q + t, t < boundary ? 0 : 1);
        for (int t = 0; t < c.seqlen_k; ++t) m->doc_k.set(int64_t{b} * c.seqlen_k + t, t < boundary ? 0 : 1);
      }
      el.doc_ids_q = m->doc_q.view();
      el.doc_ids_k = m->doc_k.view();
      el.causal = true;
      break;
    }
    case MaskKind::kRandomBlocks: {
      // block_sparse_case.h's random pattern with long runs.
      m->bits.reset(DType::kInt32, {g.batch, g.heads, c.seqlen_q, (c.seqlen_k + 31) / 32});
      auto* w = static_cast<int32_t*>(m->bits.data());
      for (int64_t i = 0; i < m->bits.numel(); ++i) {
        const int r = static_cast<int>(rng() % 8);
        w[i] = r < 3 ? 0 : (r < 6 ? -1 : static_cast<int32_t>(rng()));
      }
      el.bits = m->bits.view();
      break;
    }
  }
  if (e.kind == MaskKind::kRandomBlocks) {
    BlockKindGrid kinds = BlockKindGrid::all_empty(g.batch, g.heads, g.num_q_blocks(), g.num_kv_blocks());
    for (TileKind& k : kinds.kinds) k = static_cast<TileKind>(rng() % 3);
    const Status s = flare::block_sparse::build_from_kinds(kinds, g, el, &m->host);
    ASSERT_TRUE(s.ok()) << s.message();
  } else {
    const Status s = flare::block_sparse::build_from_element_mask(el, g, &m->host);
    ASSERT_TRUE(s.ok()) << s.message();
  }
  for (int b = 0; b < g.batch; ++b)
    for (int h = 0; h < g.heads; ++h)
      for (int q = 0; q < g.num_q_blocks(); ++q)
        for (int n = 0; n < g.num_kv_blocks(); ++n) {
          const TileKind k = m->host.kind(b, h, q, n);
          ++(k == TileKind::kPartial ? m->partial_blocks : k == TileKind::kFull ? m->full_blocks : m->empty_blocks);
        }
  m->host_view = m->host.view();
  m->host_view.element = el;
  m->device_view = m->host_view;
  BlockMask& d = m->device_view;
  for (TensorView* t : {&d.kv_num_blocks, &d.kv_indices, &d.full_kv_num_blocks, &d.full_kv_indices, &d.q_num_blocks,
                        &d.q_indices, &d.full_q_num_blocks, &d.full_q_indices, &d.element.doc_ids_q,
                        &d.element.doc_ids_k, &d.element.bits})
    if (t->defined()) t->device = flare::Device{flare::DeviceKind::kCUDA, 0};
}

// The inputs, drawn as tests/gpu/attention_case.h's AttnProblem draws them, on the host.
struct Problem : flare::test::AttnLayout {
  explicit Problem(const AttnCase& c) : AttnLayout(c), c(c) {
    std::mt19937_64 rng(c.seed);
    draw_qkv(c.dtype, rng, q, k, v);
  }
  template <typename P>
  void fill_common(P& p) const {
    p.q = q, p.k = k, p.v = v;
    p.mask = c.mask;
    p.softcap = c.softcap;
  }
  AttnCase c;
  HostTensor q, k, v;
};



// launch_portable_fwd_sparse_cfg: one CTA per (kernel q tile, head, batch).
template <int kHeadDim, typename T>
void run_forward_kernel(const FwdKernelParams& p, const BlockSparseParams& bs) {
  using Cfg = typename portable::FwdSparseConfigFor<kHeadDim>::type;
  static_assert(portable::fwd_smem_bytes<Cfg, T>() <= static_cast<int>(cuda_emu::kSharedBytes));
  if (p.seqlen_q == 0 || p.batch == 0) return;
  const int tiles_per_q_block = (bs.q_block_size + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const dim3 grid(bs.num_q_blocks * tiles_per_q_block, p.heads, p.batch);
  cuda_emu::launch(grid, Cfg::kThreads, portable::smem_raw,
                   [&] { portable::portable_fwd_sparse_kernel<Cfg, T>(p, bs); });
}

// launch_portable_bwd_sparse_cfg: the dpsum pre-pass, the main kernel (one CTA per (kernel key
// tile, head, batch); deterministic: the plan's 1-D grid), the conversions.
template <int kHeadDim, typename T>
void run_backward_kernels(const BwdKernelParams& P, const BlockSparseParams& bs, const DqPlanView* plan) {
  using Cfg = typename portable::BwdConfigFor<kHeadDim>::type;
  static_assert(portable::bwd_smem_bytes<Cfg, T>() <= static_cast<int>(cuda_emu::kSharedBytes));
  static_assert(portable::DqStage<Cfg, T>::kBytes <= static_cast<int>(cuda_emu::kSharedBytes));
  const FwdKernelParams& p = P.fwd;
  if (p.batch == 0 || p.heads == 0) return;
  unsigned char* smem = portable::smem_raw;
  if (p.seqlen_q > 0)
    cuda_emu::launch(dim3((p.seqlen_q + 7) / 8, p.heads, p.batch), 256, smem,
                     [&] { portable::bwd_dpsum_kernel<T>(P); });
  if (p.seqlen_k > 0 && bs.num_kv_blocks > 0) {
    const int tiles_per_kv_block = (bs.kv_block_size + Cfg::kBlockN - 1) / Cfg::kBlockN;
    if (plan != nullptr)
      cuda_emu::launch(dim3(plan->num_tiles() * tiles_per_kv_block), Cfg::kThreads, smem,
                       [&] { portable::portable_bwd_sparse_kernel<Cfg, T, true>(P, bs, *plan); });
    else
      cuda_emu::launch(dim3(bs.num_kv_blocks * tiles_per_kv_block, p.heads, p.batch), Cfg::kThreads, smem, [&] {
        portable::portable_bwd_sparse_kernel<Cfg, T, false>(P, bs, flare::block_sparse::DqPlanView{});
      });
  }
  flare::test::emu::run_bwd_finish<T>(P, smem);
}


// The backward in one mode from the emulated forward's out and lse, as attention_backward runs it
// (plan_backward's checks and workspace, then launch_portable_bwd_sparse_cfg), against the
// oracle's gradients. Deterministic: with the mask's plan, made from its CPU views (the planner's
// input) and used in place (its "device" copy).
struct Grads {
  HostTensor dq, dk, dv;
};
void run_backward(const SparseEmuCase& e, const HostMask& mask, const Problem& pr, const HostTensor& out,
                  const HostTensor& lse, const HostTensor& dout, const Grads& ref, const Grads& lowp,
                  bool deterministic) {
  const AttnCase& c = e.c;
  SCOPED_TRACE(deterministic ? "deterministic backward" : "backward");
  std::printf("    %s\n", deterministic ? "deterministic backward" : "backward");
  HostTensor dq(c.dtype, pr.q_shape), dk(c.dtype, pr.k_shape), dv(c.dtype, pr.k_shape);
  for (HostTensor* t : {&dq, &dk, &dv}) t->fill(std::nan(""));
  AttentionBackwardParams b;
  pr.fill_common(b);
  b.out = out, b.lse = lse, b.dout = dout, b.dq = dq, b.dk = dk, b.dv = dv;
  b.deterministic = deterministic;
  b = on_device(b);
  b.block_mask = &mask.device_view;
  flare::BlockSparseDqPlan plan;
  if (deterministic) {
    const Status s = flare::make_block_sparse_dq_plan(mask.host_view, c.batch, c.heads, c.heads_kv, c.seqlen_q,
                                                      c.seqlen_k, &plan);
    ASSERT_TRUE(s.ok()) << s.message();
    b.block_mask_dq_plan = &plan;
    b.block_mask_dq_plan_data = plan.data.data();
  }
  // plan_backward: validate_attention_backward, then check_block_sparse_backward.
  AttentionShape shape;
  const Status sb = flare::detail::validate_attention_backward(b, flare::DeviceKind::kCUDA, &shape);
  ASSERT_TRUE(sb.ok()) << sb.message();
  ASSERT_FALSE(shape.varlen);
  const flare::detail::BlockMaskProblem problem{shape.batch, shape.heads, shape.seqlen_q, shape.seqlen_k};
  flare::detail::BlockMaskShape mask_shape;
  const Status sm = flare::detail::validate_block_mask(*b.block_mask, problem, flare::DeviceKind::kCUDA, &mask_shape);
  ASSERT_TRUE(sm.ok()) << sm.message();
  ASSERT_TRUE(mask_shape.has_transposed_lists);
  if (deterministic) {  // check_dq_plan
    ASSERT_EQ(plan.batch, shape.batch);
    ASSERT_EQ(plan.heads, shape.heads);
    ASSERT_EQ(plan.heads_kv, shape.heads_kv);
    ASSERT_EQ(plan.num_q_blocks, mask_shape.num_q_blocks);
    ASSERT_EQ(plan.num_kv_blocks, mask_shape.num_kv_blocks);
    ASSERT_EQ(plan.q_block_size, b.block_mask->q_block_size);
    ASSERT_EQ(plan.kv_block_size, b.block_mask->kv_block_size);
  }
  visit_kernel(shape.head_dim, c.dtype, [&](auto hd, auto elem) {
    using Cfg = typename portable::BwdConfigFor<decltype(hd)::value>::type;
    // plan_backward's layout with the block-sparse semaphores, and attention_backward's reset:
    // zero from dq_accum on; dpsum poisoned.
    int64_t sparse_dq = 0, sparse_dkv = 0;
    if (deterministic) {
      const int64_t q_tiles = (b.block_mask->q_block_size + Cfg::kBlockM - 1) / Cfg::kBlockM;
      const int64_t kv_tiles = (b.block_mask->kv_block_size + Cfg::kBlockN - 1) / Cfg::kBlockN;
      sparse_dq = int64_t{mask_shape.num_q_blocks} * q_tiles;
      sparse_dkv = int64_t{mask_shape.num_kv_blocks} * kv_tiles;
    }
    const flare::detail::BwdWorkspaceLayout l = flare::detail::bwd_workspace_layout(
        shape, Cfg::kBlockM, Cfg::kBlockN, deterministic, 0, 1, sparse_dq, sparse_dkv);
    std::vector<unsigned char> workspace(l.total + 256, 0xFF);
    unsigned char* ws = workspace.data() + (256 - reinterpret_cast<uintptr_t>(workspace.data()) % 256) % 256;
    std::memset(ws + l.dq_accum, 0, l.total - l.dq_accum);
    const BwdKernelParams P = flare::detail::make_bwd_kernel_params(
        b, flare::detail::make_fwd_kernel_params(flare::detail::forward_view(b), shape), shape, l, ws, Cfg::kBlockM,
        Cfg::kBlockN);
    const BlockSparseParams bs =
        flare::block_sparse::make_block_sparse_params(*b.block_mask, shape.seqlen_q, shape.seqlen_k);
    const DqPlanView dq_plan = deterministic
                                   ? flare::block_sparse::dq_plan_view(*b.block_mask_dq_plan, b.block_mask_dq_plan_data)
                                   : DqPlanView{};
    run_backward_kernels<decltype(hd)::value, decltype(elem)>(P, bs, deterministic ? &dq_plan : nullptr);
  });
  // tests/gpu/attention_case.h's check_backward: k = 2, atol 1e-3 (without its one-ulp allowance).
  expect_close(dq, ref.dq, lowp.dq, "dq", 2.0, 1e-3);
  expect_close(dk, ref.dk, lowp.dk, "dk", 2.0, 1e-3);
  expect_close(dv, ref.dv, lowp.dv, "dv", 2.0, 1e-3);
}

// The forward, then the backward in both modes from its out and lse.
void run_case(const SparseEmuCase& e) {
  const AttnCase& c = e.c;
  SCOPED_TRACE(e.name());
  std::printf("  %s\n", e.name().c_str());
  HostMask mask;
  ASSERT_NO_FATAL_FAILURE(build_mask(e, &mask));
  std::printf("    mask: %d partial, %d full, %d empty blocks\n", mask.partial_blocks, mask.full_blocks,
              mask.empty_blocks);
  // Every case has partial and full blocks, so both walks (predicate and none) run.
  ASSERT_GT(mask.partial_blocks, 0);
  ASSERT_GT(mask.full_blocks, 0);
  const flare::detail::BlockMaskProblem problem{c.batch, c.heads, c.seqlen_q, c.seqlen_k};
  flare::detail::BlockMaskShape mask_shape;
  {
    const Status s = flare::detail::validate_block_mask(mask.host_view, problem, flare::DeviceKind::kCPU, &mask_shape);
    ASSERT_TRUE(s.ok()) << "host mask: " << s.message();
  }
  Problem pr(c);

  // Forward: the oracle over the mask's CPU views (fp64 and in the input dtype), then the kernel.
  HostTensor out_ref(DType::kFloat64, pr.q_shape), out_lowp(DType::kFloat64, pr.q_shape);
  HostTensor lse_ref(DType::kFloat64, pr.lse_shape), lse_lowp(DType::kFloat64, pr.lse_shape);
  {
    AttentionForwardParams f;
    pr.fill_common(f);
    f.block_mask = &mask.host_view;
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
  f.block_mask = &mask.device_view;
  // attention_forward, then block_sparse_forward.
  AttentionShape shape;
  const Status sf = flare::detail::validate_attention_forward(f, flare::DeviceKind::kCUDA, &shape);
  ASSERT_TRUE(sf.ok()) << sf.message();
  const FwdKernelParams kp = flare::detail::make_fwd_kernel_params(f, shape);
  ASSERT_FALSE(shape.varlen);
  {
    const Status s = flare::detail::validate_block_mask(*f.block_mask, problem, flare::DeviceKind::kCUDA, &mask_shape);
    ASSERT_TRUE(s.ok()) << s.message();
  }
  const BlockSparseParams bs = flare::block_sparse::make_block_sparse_params(*f.block_mask, shape.seqlen_q, shape.seqlen_k);
  visit_kernel(shape.head_dim, c.dtype, [&](auto hd, auto elem) {
    run_forward_kernel<decltype(hd)::value, decltype(elem)>(kp, bs);
  });
  expect_close(out, out_ref, out_lowp, "out", 2.0, 1e-5);
  // The LSE is fp32 in every implementation: judged by an fp32-level tolerance (as on the GPU).
  expect_close(lse, lse_ref, lse_lowp, "lse", 2.0, 1e-5, 1e-4);

  // The oracle's gradients (fp64, and in the input dtype) over the mask's CPU views.
  std::mt19937_64 rng(c.seed + 7);
  HostTensor dout(c.dtype, pr.q_shape);
  dout.fill_normal(rng);
  Grads ref, lowp;
  for (bool emulate : {false, true}) {
    Grads& g = emulate ? lowp : ref;
    g.dq.reset(DType::kFloat64, pr.q_shape);
    g.dk.reset(DType::kFloat64, pr.k_shape);
    g.dv.reset(DType::kFloat64, pr.k_shape);
    HostTensor lse64(DType::kFloat64, pr.lse_shape);
    AttentionBackwardParams b;
    pr.fill_common(b);
    b.block_mask = &mask.host_view;
    b.lse = lse64, b.dout = dout, b.dq = g.dq, b.dk = g.dk, b.dv = g.dv;
    ASSERT_TRUE(flare::ref::attention_backward(b, {emulate}).ok());
  }
  for (bool deterministic : {false, true})
    run_backward(e, mask, pr, out, lse, dout, ref, lowp, deterministic);
}

AttnCase attn(int batch, int seqlen_q, int seqlen_k, int heads, int heads_kv, int head_dim, DType dtype,
              uint64_t seed, flare::MaskParams mask = {}) {
  AttnCase c;
  c.batch = batch, c.seqlen_q = seqlen_q, c.seqlen_k = seqlen_k, c.heads = heads, c.heads_kv = heads_kv;
  c.head_dim = head_dim, c.dtype = dtype, c.mask = mask, c.seed = seed;
  return c;
}

constexpr DType kBf16 = DType::kBFloat16, kFp16 = DType::kFloat16;

// The cases, each forward, then backward in both modes, in the kernels' tile terms (forward: 128
// query rows a CTA, 64 keys a tile at d64 and 32 at d128; backward: 128 keys a CTA, 32 query rows
// a tile; deterministic: the plan's 1-D grid, planned walks, dQ staged in groups of up to 4 query
// tiles under per-group turn semaphores, GQA's dK/dV under per-key-slice ones, the emulation
// aborting if a CTA waits for a turn that has not come).

// Causal, 64x64 blocks, GQA 2:1, the mask broadcast over heads, d128: 2 key tiles a kv block
// forward, a kv block half a backward CTA (its other keys zero), 2 query tiles a q block; dK/dV
// through the fp32 accumulators and their conversion.
TEST(BlockSparseEmulated, CausalGqaBroadcastHeads) {
  run_case({.c = attn(1, 150, 150, 2, 1, 128, kBf16, 21), .kind = MaskKind::kCausal, .q_block = 64, .kv_block = 64,
            .broadcast_heads = true});
}

// Documents (a boundary per batch entry) and causal, 48x32 blocks, batch 2, d64 fp16: q blocks
// under a forward CTA's rows (the rest idle), kv blocks half a key tile (masked past the block's
// end), q blocks of 1.5 backward query tiles, lengths off the block grid.
TEST(BlockSparseEmulated, DocumentsSmallBlocks) {
  run_case({.c = attn(2, 130, 130, 2, 2, 64, kFp16, 22), .kind = MaskKind::kDocuments, .q_block = 48,
            .kv_block = 32});
}

// Random block kinds over random bits (per head), 64x48 blocks, seqlen_q != seqlen_k, a dense
// sliding window (bottom-right aligned) composed on top, soft-capping, d64 bf16.
TEST(BlockSparseEmulated, RandomBitsWithDenseWindowSoftcap) {
  AttnCase c = attn(1, 160, 140, 2, 2, 64, kBf16, 23, {false, 60, -1});
  c.softcap = 5.f;
  run_case({.c = c, .kind = MaskKind::kRandomBlocks, .q_block = 64, .kv_block = 48});
}

// Prefix-LM (prefix 50), 160x144 blocks, GQA 2:1, d96 on the 128 kernel: a q block of two forward
// CTAs (the second one's rows past the last, short, q block: nothing to do) and 5 backward query
// tiles (two staged dQ groups), a kv block of two backward CTAs (key slices of 128 keys and 16),
// the last kv block's second slice past seqlen_k (no keys: deterministic, it still takes its
// turns).
TEST(BlockSparseEmulated, PrefixLmKeySlicesAndDqGroups) {
  run_case({.c = attn(1, 200, 200, 2, 1, 96, kBf16, 24), .kind = MaskKind::kPrefixLm, .q_block = 160,
            .kv_block = 144});
}

}  // namespace
