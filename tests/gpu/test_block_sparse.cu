// Block-sparse attention on the GPU: the block-sparse forward (portable, and Hopper where it takes
// the mask's block sizes) and the portable backward against the
// CPU oracle (reference/attention_ref.h, which reads the same BlockMask) over host-built masks of every
// kind (random block kinds, causal, sliding window, documents, prefix-LM, bit-packed), head dims
// 64/128, GQA, sequence lengths off the block grid, broadcast batch/head dims and block sizes that
// are not the kernel's tiles; the GPU builder (include/flare/block_mask.h) against the host
// builder list for list; and a fuzzer over all of it with its seed printed
// (FLARE_BLOCK_SPARSE_SEED=<n> replays one run, FLARE_BLOCK_SPARSE_CASES=<n> sets its size).
// FLARE_TEST_REDUCED=1 runs a small subset (for compute-sanitizer).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <tuple>
#include <string>
#include <vector>

#include "flare/block_mask.h"
#include "flare_instantiated.h"
#include "src/attention/hopper/fwd_launch.h"
#include "src/attention/hopper/sparse_tiles.h"
#include "src/block_sparse/block_mask_build.h"
#include "src/block_sparse/block_sparse_params.h"
#include "src/block_sparse/doc_spans.h"
#include "src/block_sparse/sparse_fwd_order.h"
#include "src/common/device_facts.h"
#include "src/scheduling/sparse_order.h"
#include "tests/gpu/block_sparse_case.h"
#include "tests/gpu/unbuilt.h"

namespace flare::test {
namespace {

using block_sparse::BlockKindGrid;
using block_sparse::BlockMaskGeometry;
using block_sparse::HostBlockMask;
using block_sparse::TileKind;


// ---- the forward against the oracle --------------------------------------------------------------

// Cases the Hopper block-sparse forward and backward ran (tests assert that the standard masks
// reached them).
int g_hopper_sparse_runs = 0;
int g_hopper_sparse_backward_runs = 0;

// A case whose head dim or dtype this build lacks: skipped (before its oracle runs) and counted
// with the other tests' unbuilt cases (tests/gpu/unbuilt.h reports the count at the end).
bool skip_unbuilt(const SparseCase& c) {
  if (instantiated(c.attn)) return false;
  ++unbuilt_cases();
  return true;
}

void run_sparse_forward(const SparseCase& c, const BlockMask* gpu_built = nullptr) {
  SCOPED_TRACE(c.name());
  if (skip_unbuilt(c)) return;
  SparseMask mask;
  ASSERT_NO_FATAL_FAILURE(build_mask(c, &mask));
  AttnProblem prob(c.attn);
  ASSERT_NO_FATAL_FAILURE(run_sparse_forward_oracle(c, mask, &prob));

  for (Backend backend : {Backend::kPortable, Backend::kHopper}) {
    SCOPED_TRACE(backend == Backend::kHopper ? "hopper" : "portable");
    AttentionForwardParams p = prob.forward_params(backend);  // outputs poisoned
    p.block_mask = gpu_built ? gpu_built : &mask.device_view;
    const Status s = attention_forward(p);
    if (backend == Backend::kHopper && !hopper_sparse_runs(c)) {
      ASSERT_EQ(s.code(), StatusCode::kNotSupported) << s.message();
      continue;
    }
    ASSERT_TRUE(s.ok()) << s.message();
    FLARE_CUDA_OK(cudaDeviceSynchronize());
    prob.check_forward();
    if (backend == Backend::kHopper) ++g_hopper_sparse_runs;
  }
}

// The Hopper forward ran the mask kinds (on an sm_90 device of a build with it).
void expect_hopper_ran(int before) {
  if (hopper_sparse_runs(SparseCase{})) EXPECT_GT(g_hopper_sparse_runs, before) << "the Hopper block-sparse forward never ran";
}

// Tests whose case is written for head dim 128: skipped by a build that serves no head dim of 128
// (a d64-only build), as skip_unbuilt skips a sweep's unbuilt cases.
#define FLARE_REQUIRE_D128()                                                                          \
  do {                                                                                                 \
    if (portable::instantiated_head_dim(128) == 0) GTEST_SKIP() << "this build serves no head dim 128"; \
  } while (0)

SparseCase base_case(MaskKind kind, int head_dim, uint64_t seed) {
  SparseCase c;
  c.kind = kind;
  c.attn.head_dim = head_dim;
  c.attn.batch = 2;
  c.attn.seqlen_q = 300;
  c.attn.seqlen_k = 300;
  c.attn.heads = 4;
  c.attn.heads_kv = 2;
  c.attn.seed = seed;
  return c;
}

TEST(BlockSparseForward, EveryMaskKind) {
  FLARE_REQUIRE_GPU();
  const int before = g_hopper_sparse_runs;
  uint64_t seed = 1000;
  for (int d : {64, 128})
    for (int k = 0; k < static_cast<int>(MaskKind::kCount); ++k) {
      if (reduced() && (d == 64 || k % 2)) continue;
      run_sparse_forward(base_case(static_cast<MaskKind>(k), d, seed++));
    }
  expect_hopper_ran(before);
}

TEST(BlockSparseForward, ShapesGqaAndBlockSizes) {
  FLARE_REQUIRE_GPU();
  struct Shape {
    int sq, sk, heads, heads_kv, q_block, kv_block;
  };
  // Lengths off the 128 grid, seqlen_q != seqlen_k, MQA/GQA, blocks smaller than the kernel's
  // q tile, kv blocks that are not a multiple of its kv tile.
  const Shape shapes[] = {{1, 1, 2, 1, 128, 128},     {17, 200, 4, 1, 128, 128}, {257, 129, 8, 2, 128, 128},
                          {385, 385, 4, 4, 64, 64},   {200, 333, 6, 3, 16, 48},  {500, 260, 2, 1, 256, 128},
                          {130, 650, 4, 2, 128, 256}, {333, 333, 2, 2, 96, 80}};
  uint64_t seed = 2000;
  int i = 0;
  for (const Shape& s : shapes) {
    if (reduced() && i++ % 3) continue;
    SparseCase c = base_case(static_cast<MaskKind>(seed % static_cast<int>(MaskKind::kCount)), 128, seed);
    c.attn.seqlen_q = s.sq;
    c.attn.seqlen_k = s.sk;
    c.attn.heads = s.heads;
    c.attn.heads_kv = s.heads_kv;
    c.q_block = s.q_block;
    c.kv_block = s.kv_block;
    ++seed;
    run_sparse_forward(c);
  }
}

TEST(BlockSparseForward, BroadcastBatchAndHeads) {
  FLARE_REQUIRE_GPU();
  uint64_t seed = 3000;
  for (MaskKind kind : {MaskKind::kRandomBlocks, MaskKind::kBits, MaskKind::kCausal, MaskKind::kWindow})
    for (int bc = 1; bc < 4; ++bc) {
      SparseCase c = base_case(kind, 128, seed++);
      c.broadcast_batch = bc & 1;
      c.broadcast_heads = bc & 2;
      if (reduced() && bc != 3) continue;
      run_sparse_forward(c);
    }
}

TEST(BlockSparseForward, WithDenseMaskSoftcapSinksFp16) {
  FLARE_REQUIRE_GPU();
  SparseCase c = base_case(MaskKind::kDocuments, 128, 4000);
  c.attn.mask.causal = true;
  run_sparse_forward(c);
  c = base_case(MaskKind::kRandomBlocks, 64, 4001);
  c.attn.mask.window_left = 100;
  c.attn.softcap = 30.f;
  c.attn.sinks = true;
  run_sparse_forward(c);
  c = base_case(MaskKind::kPrefixLm, 128, 4002);
  c.attn.dtype = DType::kFloat16;
  run_sparse_forward(c);
}

TEST(BlockSparseForward, EmptyMaskWritesZerosAndInfiniteLse) {
  FLARE_REQUIRE_GPU();
  FLARE_REQUIRE_D128();
  // Every block empty: no key anywhere, out 0 and LSE +inf everywhere (checked by the oracle).
  SparseCase c = base_case(MaskKind::kRandomBlocks, 128, 5000);
  SparseMask mask;
  ASSERT_NO_FATAL_FAILURE(build_mask(c, &mask));
  for (std::unique_ptr<IntTensor>& t : mask.lists) {
    std::memset(t->data(), 0, t->host.nbytes());
    t->upload();
  }
  AttnProblem prob(c.attn);
  for (Backend backend : {Backend::kPortable, Backend::kHopper}) {
    if (backend == Backend::kHopper && !hopper_sparse_runs(c)) continue;
    SCOPED_TRACE(backend == Backend::kHopper ? "hopper" : "portable");
    AttentionForwardParams p = prob.forward_params(backend);  // outputs poisoned
    p.block_mask = &mask.device_view;
    ASSERT_TRUE(attention_forward(p).ok());
    FLARE_CUDA_OK(cudaDeviceSynchronize());
    cudaMemcpy(prob.out_host.data(), p.out.data, prob.out_host.nbytes(), cudaMemcpyDeviceToHost);
    cudaMemcpy(prob.lse_host.data(), p.lse.data, prob.lse_host.nbytes(), cudaMemcpyDeviceToHost);
    for (int64_t i = 0; i < prob.out_host.numel(); ++i) ASSERT_EQ(prob.out_host.get(i), 0.0) << i;
    for (int64_t i = 0; i < prob.lse_host.numel(); ++i) ASSERT_TRUE(std::isinf(prob.lse_host.get(i))) << i;
  }
}

TEST(BlockSparseForward, RejectsWhatItDoesNotRun) {
  FLARE_REQUIRE_GPU();
  FLARE_REQUIRE_D128();
  SparseCase c = base_case(MaskKind::kCausal, 128, 6000);
  SparseMask mask;
  ASSERT_NO_FATAL_FAILURE(build_mask(c, &mask));
  AttnProblem prob(c.attn);
  AttentionForwardParams p = prob.forward_params(Backend::kPortable);
  p.block_mask = &mask.host_view;  // CPU views on the GPU op
  Status s = attention_forward(p);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  p.block_mask = &mask.device_view;
  p.backend = Backend::kReference;
  EXPECT_EQ(attention_forward(p).code(), StatusCode::kNotSupported);
  // The Hopper forward names the block size it cannot take.
  c.q_block = 64;
  SparseMask mask64;
  ASSERT_NO_FATAL_FAILURE(build_mask(c, &mask64));
  p.block_mask = &mask64.device_view;
  p.backend = Backend::kHopper;
  s = attention_forward(p);
  EXPECT_EQ(s.code(), StatusCode::kNotSupported);
#ifdef FLARE_HAS_HOPPER
  if (hopper_device()) EXPECT_NE(s.message().find("q block size 64"), std::string::npos) << s.message();
#endif
}

#ifdef FLARE_HAS_HOPPER
// A CTA of the Hopper forward expands its list row into at most 8192 key tiles in shared memory
// (sparse_tile_list.h): longer key sequences are refused by name, so kAuto takes the portable
// kernel. Checked on the parameters alone (nothing launches: no operands of millions of keys).
TEST(BlockSparseForward, HopperRefusesMoreKeyTilesThanItsListHolds) {
  FLARE_REQUIRE_GPU();
  if (!hopper_device()) GTEST_SKIP() << "not an sm_90 device";
#ifndef FLARE_HAS_DTYPE_bf16
  GTEST_SKIP() << "bf16: not in this build";
#endif
  const int served = portable::instantiated_head_dim(128);
  if (served == 0) GTEST_SKIP() << "head dim 128: not in this build";
  const int limit = 8192 * (served <= 128 ? 128 : 64);  // key tiles of 128 keys up to head dim 128, else 64
  detail::FwdKernelParams p;
  p.batch = 1, p.heads = p.heads_kv = p.group = 1, p.head_dim = 128;
  p.seqlen_q = 128;
  void* const fake = reinterpret_cast<void*>(uintptr_t{1} << 20);  // aligned; never dereferenced
  p.q = p.k = p.v = fake;
  p.out = fake;
  for (detail::RowStrides* st : {&p.q_str, &p.k_str, &p.v_str, &p.out_str}) st->row = 128, st->head = 128;
  block_sparse::BlockSparseParams bs;  // 128 x 128 blocks
  for (const int seqlen_k : {limit, limit + 1}) {
    p.seqlen_k = seqlen_k;
    p.k_str.batch = p.v_str.batch = int64_t{seqlen_k} * 128;
    p.q_str.batch = p.out_str.batch = int64_t{p.seqlen_q} * 128;
    const Status s = hopper::hopper_forward_sparse_check(p, bs, DType::kBFloat16);
    if (seqlen_k == limit) {
      EXPECT_TRUE(s.ok()) << s.message();
    } else {
      EXPECT_EQ(s.code(), StatusCode::kNotSupported);
      EXPECT_NE(s.message().find("seqlen_k " + std::to_string(limit + 1)), std::string::npos) << s.message();
    }
  }
}

// The sort kernel (block_sparse/sparse_fwd_order.cu) against its CPU reference
// (sched::sparse_forward_order_host) on masks whose rows have many lengths, with one, two and all
// units in a group, q blocks of one and two q tiles, and lengths past the last bucket's (forced
// through a bucket cap of 0 blocks: every tile ties, so the order is the natural one), and each
// record's first key tile against first_sparse_tile on the host lists.
TEST(BlockSparseForward, CtaOrderKernelMatchesItsReference) {
  FLARE_REQUIRE_GPU();
  if (!hopper_device()) GTEST_SKIP() << "not an sm_90 device";
  for (MaskKind kind : {MaskKind::kDocuments, MaskKind::kRandomBlocks, MaskKind::kCausal, MaskKind::kWindow})
    for (int q_block : {128, 256})
      for (int units_per_group : {1, 2, 64}) {
        SparseCase c = base_case(kind, 128, 7100 + q_block + units_per_group);
        c.attn.seqlen_q = c.attn.seqlen_k = 1500;
        c.attn.heads = 6, c.attn.heads_kv = 3;
        c.q_block = q_block;
        SCOPED_TRACE(c.name() + " units a group " + std::to_string(units_per_group));
        SparseMask mask;
        ASSERT_NO_FATAL_FAILURE(build_mask(c, &mask));
        const block_sparse::BlockSparseParams host =
            block_sparse::make_block_sparse_params(mask.host_view, c.attn.seqlen_q, c.attn.seqlen_k);
        const block_sparse::BlockSparseParams dev =
            block_sparse::make_block_sparse_params(mask.device_view, c.attn.seqlen_q, c.attn.seqlen_k);
        sched::SparseOrder o;
        o.batch = c.attn.batch, o.heads = c.attn.heads, o.group = c.attn.heads / c.attn.heads_kv;
        o.m_tiles = (c.attn.seqlen_q + 127) / 128;
        o.units_per_group = units_per_group;
        const std::vector<int> expected = sched::sparse_forward_order_host(o, [&](const sched::TileCoord& t) {
          const int row = t.block * 128 / host.q_block_size;
          return host.partial_kv.count(t.batch, t.head, row, host.num_kv_blocks) +
                 host.full_kv.count(t.batch, t.head, row, host.num_kv_blocks);
        });
        std::set<int> lengths;
        for (int v = 0; v < o.num_tiles(); ++v) {
          const sched::TileCoord t = o.decode(v);
          const int row = t.block * 128 / host.q_block_size;
          lengths.insert(host.partial_kv.count(t.batch, t.head, row, 1 << 20) +
                         host.full_kv.count(t.batch, t.head, row, 1 << 20));
        }
        EXPECT_GE(lengths.size(), 2u) << "rows of several lengths";
        // Each record's first key tile, as the list writer expands the row (key tiles of 64 here:
        // two a block, so the index is the block's first tile's).
        constexpr int kKvTile = 64;
        int2* order = nullptr;
        FLARE_CUDA_OK(cudaMalloc(&order, o.num_tiles() * sizeof(int2)));
        FLARE_CUDA_OK(cudaMemset(order, 0xFF, o.num_tiles() * sizeof(int2)));  // -1: unwritten
        const Status st =
            block_sparse::launch_sparse_forward_order(o, dev, 128, kKvTile, c.attn.seqlen_k, order, nullptr, nullptr);
        ASSERT_TRUE(st.ok()) << st.message();
        std::vector<int2> got(o.num_tiles());
        FLARE_CUDA_OK(cudaMemcpy(got.data(), order, got.size() * sizeof(int2), cudaMemcpyDeviceToHost));
        cudaFree(order);
        std::vector<int> got_tiles;
        int masked_firsts = 0;
        for (const int2& r : got) {
          got_tiles.push_back(r.x);
          const sched::TileCoord t = o.decode(r.x);
          const int row = t.block * 128 / host.q_block_size;
          const int first =
              hopper::first_sparse_tile(host, hopper::sparse_list_row(host, t.batch, t.head, row), c.attn.seqlen_k, kKvTile);
          EXPECT_EQ(r.y, first) << "tile " << r.x;
          masked_firsts += first >= 0 && (first & hopper::kSparseTileMasked) != 0;
        }
        EXPECT_EQ(got_tiles, expected);
        if (kind != MaskKind::kRandomBlocks) EXPECT_GT(masked_firsts, 0) << "rows that start with a partial block";
      }
}

// The forward with its CTAs ordered (FLARE_HOPPER_SPARSE_ORDER=1: the order's path on shapes of
// fewer tiles than SMs) against the oracle on every mask kind, on the persistent grid and on one
// CTA per tile (FLARE_HOPPER_SPARSE_PERSISTENT), and the rule without the variable: ordered where
// the tiles outnumber the SMs.
TEST(BlockSparseForward, OrderedCtasOnEveryMaskKind) {
  FLARE_REQUIRE_GPU();
  if (!hopper_device()) GTEST_SKIP() << "not an sm_90 device";
  struct OrderVariable {  // unset again however the test ends (later tests run the library's rule)
    OrderVariable() { unsetenv("FLARE_HOPPER_SPARSE_ORDER"), unsetenv("FLARE_HOPPER_SPARSE_PERSISTENT"); }
    ~OrderVariable() { unsetenv("FLARE_HOPPER_SPARSE_ORDER"), unsetenv("FLARE_HOPPER_SPARSE_PERSISTENT"); }
  } order_variable;
  const int sms = detail::current_device_facts().num_sms;
  detail::FwdKernelParams p;
  p.batch = 2, p.heads = sms / 2, p.seqlen_q = 128;
  EXPECT_FALSE(hopper::hopper_sparse_ordered(p, sms));  // one wave: the grid's order
  EXPECT_EQ(hopper::hopper_forward_sparse_workspace_bytes(p, false), 0u);
  p.seqlen_q = 129;
  EXPECT_TRUE(hopper::hopper_sparse_ordered(p, sms));
  // The order (an int2 a tile, 16-byte rounded) and the persistent grid's two counters (16 bytes).
  const std::size_t order_bytes = (8u * 2 * p.heads * 2 + 15) / 16 * 16 + 16;
  EXPECT_EQ(hopper::hopper_forward_sparse_workspace_bytes(p, false), order_bytes);
  EXPECT_EQ(hopper::hopper_forward_sparse_workspace_bytes(p, true),
            order_bytes + block_sparse::doc_spans_bytes(p.batch, p.seqlen_q));
  // Persistent up to its lists' capacity; the variable turns it off.
  p.seqlen_k = hopper::kMaxPersistentSparseTiles * 128;
  EXPECT_TRUE(hopper::hopper_sparse_persistent(p, 128));
  p.seqlen_k += 1;  // more key tiles than its lists hold
  EXPECT_FALSE(hopper::hopper_sparse_persistent(p, 128));
  EXPECT_TRUE(hopper::hopper_sparse_persistent(p, 256));
  setenv("FLARE_HOPPER_SPARSE_PERSISTENT", "0", 1);
  EXPECT_FALSE(hopper::hopper_sparse_persistent(p, 256));
  setenv("FLARE_HOPPER_SPARSE_ORDER", "0", 1);
  EXPECT_FALSE(hopper::hopper_sparse_ordered(p, sms));
  setenv("FLARE_HOPPER_SPARSE_ORDER", "1", 1);
  const int before = g_hopper_sparse_runs;
  uint64_t seed = 7300;
  for (const char* persistent : {"0", "1"}) {
    SCOPED_TRACE(std::string("FLARE_HOPPER_SPARSE_PERSISTENT=") + persistent);
    setenv("FLARE_HOPPER_SPARSE_PERSISTENT", persistent, 1);
    for (int d : {64, 128, 256})
      for (int k = 0; k < static_cast<int>(MaskKind::kCount); ++k) {
        if (reduced() && (d != 128 || k % 2)) continue;
        SparseCase c = base_case(static_cast<MaskKind>(k), d, seed++);
        c.attn.seqlen_q = 700;  // 6 q tiles a head, rows of several lengths
        // More tiles than persistent CTAs (a CTA takes several: its lists' two buffers in turn).
        if (d == 128 && (k == 0 || k == 3)) c.attn.heads = 2 * sms / 6 + 4, c.attn.heads_kv = c.attn.heads / 2;
        run_sparse_forward(c);
      }
  }
  // The order and the document spans in the caller's workspace: attention_forward_workspace_size
  // counts an int2 a tile and an int2 a row, a poisoned workspace of that size runs, a smaller one is
  // refused by name.
  // On the persistent grid (FLARE_HOPPER_SPARSE_PERSISTENT=1 from the loop above), with several
  // tiles a CTA, its counters after the forward (the workspace's 16 bytes after the order): tiles
  // claimed and tiles done, each the tile count (a tile computed twice or never is counted).
  if (portable::instantiated_head_dim(128) != 0) {
    SparseCase c = base_case(MaskKind::kDocuments, 128, 7400);
    c.attn.seqlen_q = 700;
    c.attn.heads = 2 * sms / 6 + 4, c.attn.heads_kv = c.attn.heads / 2;
    SparseMask mask;
    ASSERT_NO_FATAL_FAILURE(build_mask(c, &mask));
    AttnProblem prob(c.attn);
    ASSERT_NO_FATAL_FAILURE(run_sparse_forward_oracle(c, mask, &prob));
    AttentionForwardParams fp = prob.forward_params(Backend::kHopper);
    fp.block_mask = &mask.device_view;
    std::size_t bytes = 0;
    ASSERT_TRUE(attention_forward_workspace_size(fp, &bytes).ok());
    const std::size_t tiles = std::size_t{(700 + 127) / 128} * c.attn.heads * c.attn.batch;
    EXPECT_EQ(bytes, (tiles * sizeof(int2) + 15) / 16 * 16 + 16 + block_sparse::doc_spans_bytes(c.attn.batch, 700));
    void* workspace = nullptr;
    FLARE_CUDA_OK(cudaMalloc(&workspace, bytes));
    FLARE_CUDA_OK(cudaMemset(workspace, 0xFF, bytes));
    fp.workspace = workspace, fp.workspace_bytes = bytes;
    const Status ran = attention_forward(fp);
    EXPECT_TRUE(ran.ok()) << ran.message();
    FLARE_CUDA_OK(cudaDeviceSynchronize());
    prob.check_forward();
    int counters[2] = {-1, -1};
    FLARE_CUDA_OK(cudaMemcpy(counters, static_cast<char*>(workspace) + (tiles * sizeof(int2) + 15) / 16 * 16,
                             sizeof(counters), cudaMemcpyDeviceToHost));
    EXPECT_EQ(counters[0], static_cast<int>(tiles)) << "tiles claimed";
    EXPECT_EQ(counters[1], static_cast<int>(tiles)) << "tiles done";
    fp.workspace_bytes = bytes - 16;
    const Status small = attention_forward(fp);
    EXPECT_EQ(small.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(small.message().find("workspace"), std::string::npos) << small.message();
    cudaFree(workspace);
  }
  expect_hopper_ran(before);
}
#endif

// The document spans kernel (block_sparse/doc_spans.cu) against a linear scan: sorted ids, ids
// that recur in separate runs (the marker in every row of that batch entry only), rows whose
// document has no key, strided ids, and keys past the shared-memory copy (binary search in global
// memory).
TEST(BlockSparseForward, DocumentSpansMatchALinearScan) {
  FLARE_REQUIRE_GPU();
  struct Shape {
    int sq, sk, stride;
  };
  std::mt19937_64 rng(7500);
  for (const Shape& sh : {Shape{300, 300, 1}, Shape{700, 500, 1}, Shape{5000, 260, 2}, Shape{600, 60000, 1}}) {
    SCOPED_TRACE("seqlen_q " + std::to_string(sh.sq) + " seqlen_k " + std::to_string(sh.sk) + " stride " +
                 std::to_string(sh.stride));
    const int batch = 3;
    // Entry 0 sorted, 1 recurring (unsorted), 2 sorted with query documents the keys lack.
    std::vector<int32_t> q(static_cast<size_t>(batch) * sh.sq), k(static_cast<size_t>(batch) * sh.sk * sh.stride, -7);
    for (int b = 0; b < batch; ++b) {
      for (int side = 0; side < 2; ++side) {
        const int n = side == 0 ? sh.sq : sh.sk;
        int doc = 0;
        for (int t = 0; t < n; ++t) {
          if (t > 0 && rng() % 53 == 0) ++doc;
          int32_t id = b == 1 ? doc % 3 : doc;
          if (b == 2 && side == 1) id = 2 * doc;  // odd query documents have no keys
          if (side == 0) q[static_cast<size_t>(b) * sh.sq + t] = id;
          else k[(static_cast<size_t>(b) * sh.sk + t) * sh.stride] = id;
        }
      }
    }
    std::vector<int2> expected(static_cast<size_t>(batch) * sh.sq);
    for (int b = 0; b < batch; ++b) {
      const int32_t* kb = k.data() + static_cast<size_t>(b) * sh.sk * sh.stride;
      bool sorted = true;
      for (int j = 0; j + 1 < sh.sk; ++j) sorted = sorted && kb[j * sh.stride] <= kb[(j + 1) * sh.stride];
      EXPECT_EQ(sorted, b != 1);
      for (int i = 0; i < sh.sq; ++i) {
        int2 e = make_int2(block_sparse::kNoDocSpan, block_sparse::kNoDocSpan);
        if (sorted) {
          const int32_t doc = q[static_cast<size_t>(b) * sh.sq + i];
          int lo = 0;
          while (lo < sh.sk && kb[lo * sh.stride] < doc) ++lo;
          int hi = lo;
          while (hi < sh.sk && kb[hi * sh.stride] == doc) ++hi;
          e = make_int2(lo, hi);
        }
        expected[static_cast<size_t>(b) * sh.sq + i] = e;
      }
    }
    int32_t *dq = nullptr, *dk = nullptr;
    int2* spans = nullptr;
    FLARE_CUDA_OK(cudaMalloc(&dq, q.size() * sizeof(int32_t)));
    FLARE_CUDA_OK(cudaMalloc(&dk, k.size() * sizeof(int32_t)));
    FLARE_CUDA_OK(cudaMalloc(&spans, expected.size() * sizeof(int2)));
    FLARE_CUDA_OK(cudaMemcpy(dq, q.data(), q.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    FLARE_CUDA_OK(cudaMemcpy(dk, k.data(), k.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    FLARE_CUDA_OK(cudaMemset(spans, 0x5A, expected.size() * sizeof(int2)));  // poison
    block_sparse::ElementMaskParams el;
    el.doc_q = dq, el.doc_k = dk;
    el.doc_q_batch = sh.sq, el.doc_q_row = 1;
    el.doc_k_batch = int64_t{sh.sk} * sh.stride, el.doc_k_row = sh.stride;
    const Status st = block_sparse::launch_doc_spans(el, batch, sh.sq, sh.sk, spans, nullptr);
    ASSERT_TRUE(st.ok()) << st.message();
    std::vector<int2> got(expected.size());
    FLARE_CUDA_OK(cudaMemcpy(got.data(), spans, got.size() * sizeof(int2), cudaMemcpyDeviceToHost));
    int wrong = 0;
    for (size_t r = 0; r < got.size(); ++r)
      if (got[r].x != expected[r].x || got[r].y != expected[r].y) {
        if (++wrong <= 5)
          ADD_FAILURE() << "row " << r << ": span [" << got[r].x << ", " << got[r].y << "), expected ["
                        << expected[r].x << ", " << expected[r].y << ")";
      }
    EXPECT_EQ(wrong, 0);
    cudaFree(dq), cudaFree(dk), cudaFree(spans);
  }
  const Status refused = block_sparse::launch_doc_spans(block_sparse::ElementMaskParams{}, 1, 8, 8,
                                                        reinterpret_cast<int2*>(16), nullptr);
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
}

// Documents masks through the Hopper forward's two paths against the oracle: a batch of sorted ids
// (the rows narrowed to their spans) and recurring ids (looked up), with and without causal, GQA,
// q blocks of 256 rows, and the spans switched off (FLARE_HOPPER_DOC_SPANS=0: lookups everywhere).
TEST(BlockSparseForward, DocumentSpansAndLookups) {
  FLARE_REQUIRE_GPU();
  struct SpansVariable {  // unset again however the test ends
    SpansVariable() { unsetenv("FLARE_HOPPER_DOC_SPANS"); }
    ~SpansVariable() { unsetenv("FLARE_HOPPER_DOC_SPANS"); }
  } spans_variable;
  const int before = g_hopper_sparse_runs;
  uint64_t seed = 7600;
  for (const char* spans : {"1", "0"})
    for (int d : {64, 128})
      for (int variant = 0; variant < 3; ++variant) {
        if (reduced() && (d == 64 || spans[0] == '0')) continue;
        setenv("FLARE_HOPPER_DOC_SPANS", spans, 1);
        SCOPED_TRACE(std::string("FLARE_HOPPER_DOC_SPANS=") + spans);
        SparseCase c = base_case(MaskKind::kDocuments, d, seed++);
        c.recurring_documents = variant != 1;
        c.attn.seqlen_q = variant == 2 ? 517 : 300;
        c.attn.seqlen_k = variant == 2 ? 389 : 300;
        if (variant == 2) c.q_block = 256, c.attn.heads = 8;
        run_sparse_forward(c);
      }
  expect_hopper_ran(before);
}

// ---- the backward against the oracle -------------------------------------------------------------

// The GPU forward (for out and the LSE), then the backward on kAuto (block masks stay on the
// portable kernel there) with dq, dk, dv poisoned, against the oracle's backward over the same
// mask. Deterministic: with the mask's plan, then `repeats` more runs (outputs poisoned each time)
// bitwise equal to the first. Then the Hopper block-sparse backward (kHopper) where it runs.
void run_sparse_backward(const SparseCase& c, bool deterministic = false, int repeats = 0) {
  SCOPED_TRACE(c.name() + (deterministic ? " | deterministic backward" : " | backward"));
  if (skip_unbuilt(c)) return;
  SparseMask mask;
  ASSERT_NO_FATAL_FAILURE(build_mask(c, &mask));
  AttnProblem prob(c.attn);
  AttentionForwardParams f = prob.forward_params(Backend::kPortable);
  f.block_mask = &mask.device_view;
  Status s = attention_forward(f);
  ASSERT_TRUE(s.ok()) << s.message();
  DqPlanOnDevice plan;
  if (deterministic) {
    s = plan.make(mask.host_view, c.attn.batch, c.attn.heads, c.attn.heads_kv, c.attn.seqlen_q, c.attn.seqlen_k);
    ASSERT_TRUE(s.ok()) << s.message();
  }
  auto run = [&] {
    AttentionBackwardParams p = prob.backward_params(Backend::kAuto, deterministic);
    p.block_mask = &mask.device_view;
    if (deterministic) plan.attach(&p);
    const Status st = attention_backward(p);
    ASSERT_TRUE(st.ok()) << st.message();
    FLARE_CUDA_OK(cudaDeviceSynchronize());
  };
  ASSERT_NO_FATAL_FAILURE(run());
  ASSERT_NO_FATAL_FAILURE(prob.run_backward_oracle(&mask.host_view, prob.stored_out()));
  prob.check_backward();
  const ref::HostTensor first_dq = prob.dq_host, first_dk = prob.dk_host, first_dv = prob.dv_host;
  for (int r = 1; r <= repeats; ++r) {
    ASSERT_NO_FATAL_FAILURE(run());
    prob.download_grads();
    ASSERT_EQ(std::memcmp(first_dq.data(), prob.dq_host.data(), first_dq.nbytes()), 0) << "dq differs in run " << r;
    ASSERT_EQ(std::memcmp(first_dk.data(), prob.dk_host.data(), first_dk.nbytes()), 0) << "dk differs in run " << r;
    ASSERT_EQ(std::memcmp(first_dv.data(), prob.dv_host.data(), first_dv.nbytes()), 0) << "dv differs in run " << r;
  }
  // The Hopper kernel (Backend::kHopper), grads poisoned again, against the same oracle (and,
  // deterministic, bitwise equal over the repeats); it must refuse what it does not run.
  SCOPED_TRACE("hopper backward");
  auto run_hopper = [&](Status* st) {
    AttentionBackwardParams p = prob.backward_params(Backend::kHopper, deterministic);
    p.block_mask = &mask.device_view;
    if (deterministic) plan.attach(&p);
    *st = attention_backward(p);
    if (st->ok()) FLARE_CUDA_OK(cudaDeviceSynchronize());
  };
  Status st;
  ASSERT_NO_FATAL_FAILURE(run_hopper(&st));
  if (!hopper_sparse_backward_runs(c)) {
    ASSERT_EQ(st.code(), StatusCode::kNotSupported) << st.message();
    return;
  }
  ASSERT_TRUE(st.ok()) << st.message();
  prob.check_backward();
  ++g_hopper_sparse_backward_runs;
  const ref::HostTensor hopper_dq = prob.dq_host, hopper_dk = prob.dk_host, hopper_dv = prob.dv_host;
  for (int r = 1; r <= repeats; ++r) {
    ASSERT_NO_FATAL_FAILURE(run_hopper(&st));
    ASSERT_TRUE(st.ok()) << st.message();
    prob.download_grads();
    ASSERT_EQ(std::memcmp(hopper_dq.data(), prob.dq_host.data(), hopper_dq.nbytes()), 0) << "hopper dq differs in run " << r;
    ASSERT_EQ(std::memcmp(hopper_dk.data(), prob.dk_host.data(), hopper_dk.nbytes()), 0) << "hopper dk differs in run " << r;
    ASSERT_EQ(std::memcmp(hopper_dv.data(), prob.dv_host.data(), hopper_dv.nbytes()), 0) << "hopper dv differs in run " << r;
  }
}

// The Hopper backward ran some of the cases (on an sm_90 device of a build with it).
void expect_hopper_backward_ran(int before) {
  if (hopper_sparse_backward_runs(SparseCase{}))
    EXPECT_GT(g_hopper_sparse_backward_runs, before) << "the Hopper block-sparse backward never ran";
}

TEST(BlockSparseBackward, EveryMaskKind) {
  FLARE_REQUIRE_GPU();
  const int before = g_hopper_sparse_backward_runs;
  uint64_t seed = 11000;
  for (int d : {64, 128})
    for (int k = 0; k < static_cast<int>(MaskKind::kCount); ++k) {
      if (reduced() && (d == 64 || k % 2)) continue;
      run_sparse_backward(base_case(static_cast<MaskKind>(k), d, seed++));
    }
  expect_hopper_backward_ran(before);
}

// Lengths off the block grid, seqlen_q != seqlen_k, MHA (dK/dV stored directly) and MQA/GQA
// (through the fp32 accumulators), blocks of 64 and 128, blocks smaller than the kernel's tiles
// (q 16 < 32 rows, kv 48 < 128 keys) and larger (kv 256: two key tiles), fp16.
struct BackwardShape {
  int sq, sk, heads, heads_kv, q_block, kv_block, head_dim;
  DType dtype;
};
constexpr BackwardShape kBackwardShapes[] = {{1, 1, 2, 1, 128, 128, 128, DType::kBFloat16},
                                             {17, 200, 4, 1, 128, 128, 64, DType::kFloat16},
                                             {257, 129, 8, 2, 128, 128, 128, DType::kBFloat16},
                                             {385, 385, 4, 4, 64, 64, 128, DType::kFloat16},
                                             {300, 300, 2, 2, 64, 128, 64, DType::kBFloat16},
                                             {200, 333, 6, 3, 16, 48, 128, DType::kBFloat16},
                                             {500, 260, 2, 1, 256, 128, 64, DType::kBFloat16},
                                             {130, 650, 4, 2, 128, 256, 128, DType::kFloat16},
                                             {333, 333, 2, 2, 96, 80, 128, DType::kBFloat16}};

// run(case) for every shape (every third in a reduced run), mask kinds in turn by seed.
template <typename Run>
void for_each_backward_shape(uint64_t seed, Run run) {
  int i = 0;
  for (const BackwardShape& sh : kBackwardShapes) {
    if (reduced() && i++ % 3) continue;
    SparseCase c = base_case(static_cast<MaskKind>(seed % static_cast<int>(MaskKind::kCount)), sh.head_dim, seed);
    c.attn.seqlen_q = sh.sq;
    c.attn.seqlen_k = sh.sk;
    c.attn.heads = sh.heads;
    c.attn.heads_kv = sh.heads_kv;
    c.attn.dtype = sh.dtype;
    c.q_block = sh.q_block;
    c.kv_block = sh.kv_block;
    ++seed;
    run(c);
  }
}

TEST(BlockSparseBackward, ShapesGqaAndBlockSizes) {
  FLARE_REQUIRE_GPU();
  for_each_backward_shape(12000, [](const SparseCase& c) { run_sparse_backward(c); });
}

// The deterministic backward (the planned walks, turns and schedule of dq_write_order.h): every
// mask kind at head dims 64 and 128 against the oracle and bitwise equal over 20 runs; the shapes
// above (GQA / MQA dK/dV turns, blocks smaller and larger than the kernel's tiles, key slices past
// seqlen_k that only pass their turns), broadcast masks with a dense mask, softcap and sinks.
TEST(BlockSparseBackward, Deterministic) {
  FLARE_REQUIRE_GPU();
  const int before = g_hopper_sparse_backward_runs;
  const int repeats = reduced() ? 2 : 19;
  uint64_t seed = 17000;
  for (int d : {64, 128})
    for (int k = 0; k < static_cast<int>(MaskKind::kCount); ++k) {
      if (reduced() && (d == 64 || k % 2)) continue;
      run_sparse_backward(base_case(static_cast<MaskKind>(k), d, seed++), true, repeats);
    }
  for_each_backward_shape(seed, [&](const SparseCase& c) { run_sparse_backward(c, true, repeats); });
  seed += std::size(kBackwardShapes);
  SparseCase c = base_case(MaskKind::kBits, 128, seed++);
  c.broadcast_batch = c.broadcast_heads = true;
  c.attn.heads_kv = 1;
  run_sparse_backward(c, true, repeats);
  c = base_case(MaskKind::kRandomBlocks, 64, seed++);
  c.attn.mask.window_left = 100;
  c.attn.softcap = 30.f;
  c.attn.sinks = true;
  run_sparse_backward(c, true, repeats);
  expect_hopper_backward_ran(before);
}

TEST(BlockSparseBackward, EveryMaskKindFp16Blocks64) {
  FLARE_REQUIRE_GPU();
  uint64_t seed = 13000;
  for (int k = 0; k < static_cast<int>(MaskKind::kCount); ++k) {
    if (reduced() && k % 2) continue;
    SparseCase c = base_case(static_cast<MaskKind>(k), k % 2 ? 64 : 128, seed++);
    c.attn.dtype = DType::kFloat16;
    c.attn.seqlen_q = 250;
    c.attn.seqlen_k = 310;
    c.q_block = c.kv_block = 64;
    run_sparse_backward(c);
  }
}

TEST(BlockSparseBackward, BroadcastDenseMaskSoftcapSinks) {
  FLARE_REQUIRE_GPU();
  SparseCase c = base_case(MaskKind::kBits, 128, 14000);
  c.broadcast_batch = c.broadcast_heads = true;
  run_sparse_backward(c);
  c = base_case(MaskKind::kDocuments, 128, 14001);
  c.attn.mask.causal = true;
  run_sparse_backward(c);
  c = base_case(MaskKind::kRandomBlocks, 64, 14002);
  c.attn.mask.window_left = 100;
  c.attn.softcap = 30.f;
  c.attn.sinks = true;
  run_sparse_backward(c);
}

TEST(BlockSparseBackward, EmptyMaskWritesZeroGradients) {
  FLARE_REQUIRE_GPU();
  FLARE_REQUIRE_D128();
  // Every block empty: no query sees any key, so dQ, dK and dV are 0 everywhere (over poison).
  SparseCase c = base_case(MaskKind::kRandomBlocks, 128, 15000);
  c.attn.heads_kv = c.attn.heads;  // dK/dV stored directly by the kernel, not converted
  SparseMask mask;
  ASSERT_NO_FATAL_FAILURE(build_mask(c, &mask));
  for (std::unique_ptr<IntTensor>& t : mask.lists) {
    std::memset(t->data(), 0, t->host.nbytes());
    t->upload();
  }
  AttnProblem prob(c.attn);
  AttentionForwardParams f = prob.forward_params(Backend::kPortable);
  f.block_mask = &mask.device_view;
  ASSERT_TRUE(attention_forward(f).ok());
  for (Backend backend : {Backend::kPortable, Backend::kHopper}) {
    if (backend == Backend::kHopper && !hopper_sparse_backward_runs(c)) continue;
    SCOPED_TRACE(backend == Backend::kHopper ? "hopper" : "portable");
    AttentionBackwardParams p = prob.backward_params(backend, false);  // grads poisoned
    p.block_mask = &mask.device_view;
    const Status s = attention_backward(p);
    ASSERT_TRUE(s.ok()) << s.message();
    FLARE_CUDA_OK(cudaDeviceSynchronize());
    prob.download_grads();
    for (const ref::HostTensor* t : {&prob.dq_host, &prob.dk_host, &prob.dv_host})
      for (int64_t i = 0; i < t->numel(); ++i) ASSERT_EQ(t->get(i), 0.0) << i;
  }
}

TEST(BlockSparseBackward, RejectsWhatItDoesNotRun) {
  FLARE_REQUIRE_GPU();
  FLARE_REQUIRE_D128();
  SparseCase c = base_case(MaskKind::kCausal, 128, 16000);
  SparseMask mask;
  ASSERT_NO_FATAL_FAILURE(build_mask(c, &mask));
  AttnProblem prob(c.attn);
  ASSERT_TRUE(attention_forward(prob.forward_params(Backend::kPortable)).ok());
  AttentionBackwardParams p = prob.backward_params(Backend::kPortable, false);
  // Without the transposed lists the backward has nothing to walk.
  BlockMask forward_only = mask.device_view;
  forward_only.q_num_blocks = forward_only.q_indices = TensorView{};
  forward_only.full_q_num_blocks = forward_only.full_q_indices = TensorView{};
  p.block_mask = &forward_only;
  Status s = attention_backward(p);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  EXPECT_NE(s.message().find("q_num_blocks"), std::string::npos) << s.message();
  std::size_t bytes = 0;
  EXPECT_EQ(attention_backward_workspace_size(p, &bytes).code(), StatusCode::kInvalidArgument);
  p.block_mask = &mask.host_view;  // CPU views on the GPU op
  EXPECT_EQ(attention_backward(p).code(), StatusCode::kInvalidArgument);
  p.block_mask = &mask.device_view;
  p.deterministic = true;  // without the mask's plan
  s = attention_backward(p);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  EXPECT_NE(s.message().find("block_mask_dq_plan"), std::string::npos) << s.message();
  DqPlanOnDevice other;  // a plan made for other kv heads
  ASSERT_NE(c.attn.heads_kv, 1);
  ASSERT_TRUE(other.make(mask.host_view, c.attn.batch, c.attn.heads, 1, c.attn.seqlen_q, c.attn.seqlen_k).ok());
  other.attach(&p);
  s = attention_backward(p);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  EXPECT_NE(s.message().find("heads_kv"), std::string::npos) << s.message();
  p.block_mask_dq_plan = nullptr;
  p.deterministic = false;
  p.backend = Backend::kReference;
  EXPECT_EQ(attention_backward(p).code(), StatusCode::kNotSupported);
  // The Hopper backward names the block size it cannot take.
  c.kv_block = 64;
  SparseMask mask64;
  ASSERT_NO_FATAL_FAILURE(build_mask(c, &mask64));
  p.block_mask = &mask64.device_view;
  p.backend = Backend::kHopper;
  s = attention_backward(p);
  EXPECT_EQ(s.code(), StatusCode::kNotSupported) << s.message();
#ifdef FLARE_HAS_HOPPER
  // (A build whose head dim serving 128 is above 128 refuses the head dim first.)
  if (hopper_device() && portable::instantiated_head_dim(c.attn.head_dim) <= 128)
    EXPECT_NE(s.message().find("kv block size 64"), std::string::npos) << s.message();
#endif
}

// ---- the GPU builder against the host builder ----------------------------------------------------

struct GpuBuilt {
  std::vector<std::unique_ptr<IntTensor>> lists;  // kv, kv_idx, full_kv, full_kv_idx, q, q_idx, full_q, full_q_idx
  BlockMask mask;
};

// Builds `c`'s mask on the GPU (outputs poisoned first) and checks every list equal to the host
// builder's, tails included.
void check_gpu_builder(const SparseCase& c, bool transposed, GpuBuilt* out = nullptr) {
  SCOPED_TRACE(c.name());
  SparseMask ref_mask;
  ASSERT_NO_FATAL_FAILURE(build_mask(c, &ref_mask));
  const HostBlockMask& h = ref_mask.host;
  GpuBuilt local;
  GpuBuilt& g = out ? *out : local;
  const int64_t B = h.batch, H = h.heads, nq = h.num_q_blocks, nkv = h.num_kv_blocks;
  const std::vector<int64_t> shapes[] = {{B, H, nq}, {B, H, nq, nkv}, {B, H, nq}, {B, H, nq, nkv},
                                         {B, H, nkv}, {B, H, nkv, nq}, {B, H, nkv}, {B, H, nkv, nq}};
  TensorView* views[] = {&g.mask.kv_num_blocks, &g.mask.kv_indices, &g.mask.full_kv_num_blocks,
                         &g.mask.full_kv_indices, &g.mask.q_num_blocks, &g.mask.q_indices,
                         &g.mask.full_q_num_blocks, &g.mask.full_q_indices};
  for (int i = 0; i < (transposed ? 8 : 4); ++i) {
    auto t = std::make_unique<IntTensor>();
    t->make(shapes[i]);
    t->dev->poison();
    *views[i] = t->dev->view();
    g.lists.push_back(std::move(t));
  }
  BlockMaskBuildParams bp;
  bp.batch = h.batch;
  bp.heads = h.heads;
  bp.seqlen_q = c.attn.seqlen_q;
  bp.seqlen_k = c.attn.seqlen_k;
  bp.q_block_size = c.q_block;
  bp.kv_block_size = c.kv_block;
  bp.element = ref_mask.element.device;
  const Status s = build_block_mask(bp, &g.mask);
  ASSERT_TRUE(s.ok()) << s.message();
  FLARE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<int32_t>* expected[] = {&h.partial_kv.num_blocks, &h.partial_kv.indices, &h.full_kv.num_blocks,
                                            &h.full_kv.indices,       &h.partial_q.num_blocks, &h.partial_q.indices,
                                            &h.full_q.num_blocks,     &h.full_q.indices};
  const char* names[] = {"kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                         "q_num_blocks",  "q_indices",  "full_q_num_blocks",  "full_q_indices"};
  for (size_t i = 0; i < g.lists.size(); ++i) {
    g.lists[i]->download();
    const int32_t* got = g.lists[i]->data();
    ASSERT_EQ(static_cast<size_t>(g.lists[i]->host.numel()), expected[i]->size()) << names[i];
    for (size_t e = 0; e < expected[i]->size(); ++e)
      ASSERT_EQ(got[e], (*expected[i])[e]) << names[i] << " element " << e;
  }
}

TEST(BlockMaskBuilder, MatchesTheHostBuilder) {
  FLARE_REQUIRE_GPU();
  uint64_t seed = 7000;
  const std::pair<int, int> blocks[] = {{128, 128}, {64, 128}, {16, 48}, {256, 64}};
  for (int k = 0; k < static_cast<int>(MaskKind::kCount); ++k) {
    if (static_cast<MaskKind>(k) == MaskKind::kRandomBlocks) continue;  // not a predicate
    for (const auto& [qb, kb] : blocks) {
      SparseCase c = base_case(static_cast<MaskKind>(k), 128, seed++);
      c.attn.seqlen_q = 300 + static_cast<int>(seed % 7) * 37;
      c.attn.seqlen_k = 260 + static_cast<int>(seed % 5) * 61;
      c.q_block = qb;
      c.kv_block = kb;
      c.broadcast_heads = true;
      check_gpu_builder(c, /*transposed=*/seed % 2 == 0);
      if (reduced()) break;
    }
  }
}

TEST(BlockMaskBuilder, ItsMaskRunsTheForward) {
  FLARE_REQUIRE_GPU();
  SparseCase c = base_case(MaskKind::kDocuments, 128, 8000);
  c.attn.seqlen_q = c.attn.seqlen_k = 700;
  GpuBuilt built;
  check_gpu_builder(c, true, &built);
  run_sparse_forward(c, &built.mask);
}

// Times the builder at the issue's benchmark shape (informational: the forward's block mask
// must be cheap enough to rebuild per step).
TEST(BlockMaskBuilder, TimeAtSeqlen8k) {
  FLARE_REQUIRE_GPU();
  if (reduced()) GTEST_SKIP() << "reduced run";
  for (MaskKind kind : {MaskKind::kCausal, MaskKind::kDocuments, MaskKind::kBits}) {
    SparseCase c = base_case(kind, 128, 9000);
    c.attn.batch = 2;
    c.attn.heads = 16;
    c.attn.seqlen_q = c.attn.seqlen_k = 8192;
    c.broadcast_heads = true;
    std::mt19937_64 rng(1);
    ElementTensors el;
    const BlockMaskGeometry g = geometry_of(c);
    make_element_mask(c, g.batch, g.heads, rng, &el);
    std::vector<std::unique_ptr<IntTensor>> lists;
    BlockMask m;
    const int64_t nq = g.num_q_blocks(), nkv = g.num_kv_blocks();
    const std::vector<int64_t> shapes[] = {{g.batch, 1, nq}, {g.batch, 1, nq, nkv}, {g.batch, 1, nq},
                                           {g.batch, 1, nq, nkv}, {g.batch, 1, nkv}, {g.batch, 1, nkv, nq},
                                           {g.batch, 1, nkv}, {g.batch, 1, nkv, nq}};
    TensorView* views[] = {&m.kv_num_blocks, &m.kv_indices, &m.full_kv_num_blocks, &m.full_kv_indices,
                           &m.q_num_blocks, &m.q_indices, &m.full_q_num_blocks, &m.full_q_indices};
    for (int i = 0; i < 8; ++i) {
      lists.push_back(std::make_unique<IntTensor>());
      lists.back()->make(shapes[i]);
      *views[i] = lists.back()->dev->view();
    }
    BlockMaskBuildParams bp;
    bp.batch = g.batch;
    bp.heads = 1;
    bp.seqlen_q = bp.seqlen_k = 8192;
    bp.element = el.device;
    ASSERT_TRUE(build_block_mask(bp, &m).ok());  // warm-up
    cudaEvent_t start, stop;
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
    constexpr int kRepeats = 20;
    cudaEventRecord(start);
    for (int r = 0; r < kRepeats; ++r) ASSERT_TRUE(build_block_mask(bp, &m).ok());
    cudaEventRecord(stop);
    FLARE_CUDA_OK(cudaEventSynchronize(stop));
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    std::printf("build_block_mask %s, batch %d, seqlen 8192, 128x128 blocks: %.3f ms\n", mask_kind_name(kind),
                g.batch, ms / kRepeats);
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
}

// ---- the fuzzer ----------------------------------------------------------------------------------

uint64_t env_or(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v ? std::strtoull(v, nullptr, 10) : fallback;
}

SparseCase random_case(std::mt19937_64& rng, uint64_t case_seed) {
  auto pick = [&](int n) { return static_cast<int>(rng() % n); };
  const int block_sizes[] = {16, 32, 48, 64, 128, 128, 128, 256};
  SparseCase c;
  c.kind = static_cast<MaskKind>(pick(static_cast<int>(MaskKind::kCount)));
  c.q_block = block_sizes[pick(8)];
  c.kv_block = block_sizes[pick(8)];
  c.attn.head_dim = pick(2) ? 64 : 128;
  c.attn.batch = 1 + pick(2);
  c.attn.heads_kv = 1 + pick(3);
  c.attn.heads = c.attn.heads_kv * (1 + pick(3));
  c.attn.seqlen_q = 1 + pick(pick(4) ? 400 : 40);
  c.attn.seqlen_k = pick(3) ? c.attn.seqlen_q : 1 + pick(400);
  c.attn.dtype = pick(4) ? DType::kBFloat16 : DType::kFloat16;
  if (!instantiated(c.attn)) c.attn.dtype = c.attn.dtype == DType::kFloat16 ? DType::kBFloat16 : DType::kFloat16;
  if (pick(6) == 0) c.attn.mask.causal = true;
  if (pick(8) == 0) c.attn.mask.window_left = pick(200);
  if (pick(8) == 0) c.attn.softcap = 20.f;
  c.attn.sinks = pick(8) == 0;
  c.broadcast_batch = pick(3) == 0;
  c.broadcast_heads = pick(3) == 0;
  c.attn.seed = case_seed;
  return c;
}

TEST(BlockSparseFuzz, ForwardAgainstTheOracle) {
  FLARE_REQUIRE_GPU();
  const uint64_t seed = env_or("FLARE_BLOCK_SPARSE_SEED",
                               static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  const int cases = static_cast<int>(env_or("FLARE_BLOCK_SPARSE_CASES", reduced() ? 20 : 500));
  std::printf("block-sparse fuzzer: seed %llu, %d cases (FLARE_BLOCK_SPARSE_SEED=%llu replays)\n",
              static_cast<unsigned long long>(seed), cases, static_cast<unsigned long long>(seed));
  std::fflush(stdout);
  std::mt19937_64 rng(seed);
  for (int i = 0; i < cases; ++i) {
    const SparseCase c = random_case(rng, seed + static_cast<uint64_t>(i));
    SCOPED_TRACE("fuzzer seed " + std::to_string(seed) + " case " + std::to_string(i));
    run_sparse_forward(c);
    if (::testing::Test::HasFailure()) {
      std::printf("first failure: seed %llu case %d: %s\n", static_cast<unsigned long long>(seed), i,
                  c.name().c_str());
      break;
    }
  }
}

TEST(BlockSparseFuzz, BackwardAgainstTheOracle) {
  FLARE_REQUIRE_GPU();
  const uint64_t seed = env_or("FLARE_BLOCK_SPARSE_SEED",
                               static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  const int cases = static_cast<int>(env_or("FLARE_BLOCK_SPARSE_CASES", reduced() ? 10 : 150));
  std::printf("block-sparse backward fuzzer: seed %llu, %d cases (FLARE_BLOCK_SPARSE_SEED=%llu replays)\n",
              static_cast<unsigned long long>(seed), cases, static_cast<unsigned long long>(seed));
  std::fflush(stdout);
  std::mt19937_64 rng(seed);
  for (int i = 0; i < cases; ++i) {
    const SparseCase c = random_case(rng, seed + static_cast<uint64_t>(i));
    SCOPED_TRACE("fuzzer seed " + std::to_string(seed) + " case " + std::to_string(i));
    run_sparse_backward(c);
    if (::testing::Test::HasFailure()) {
      std::printf("first failure: seed %llu case %d: %s\n", static_cast<unsigned long long>(seed), i,
                  c.name().c_str());
      break;
    }
  }
}

}  // namespace
}  // namespace flare::test
