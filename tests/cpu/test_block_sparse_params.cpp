// The element predicate as the kernels evaluate it (block_sparse_params.h: a structural interval
// per row, then per-element lookups) against the host builder's element_mask_visible, element by
// element, over random compositions of every predicate; the list params' broadcast strides; and the
// list rows walked by step index (list_steps.h, the Hopper block-sparse backward's query steps)
// against a plain expansion of the lists; the binary search of a value's run in sorted ids (the
// documents' row spans, doc_spans.h) against a linear scan.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "src/block_sparse/block_mask_build.h"
#include "src/block_sparse/block_sparse_params.h"
#include "src/block_sparse/list_steps.h"
#include "src/block_sparse/sorted_run.h"

namespace flare::block_sparse {
namespace {

TensorView cpu_view(std::vector<int32_t>& v, std::initializer_list<int64_t> shape) {
  return TensorView::contiguous(v.data(), DType::kInt32, shape, Device{DeviceKind::kCPU, 0});
}

TEST(ElementMaskParams, AgreesWithTheHostPredicate) {
  std::mt19937_64 rng(7);
  const int batch = 2, heads = 3, sq = 37, sk = 71;
  for (int trial = 0; trial < 300; ++trial) {
    ElementMask e;
    auto pick = [&](int n) { return static_cast<int>(rng() % n); };
    e.causal = pick(2);
    e.window_left = pick(3) ? -1 : pick(40);
    e.window_right = pick(3) ? -1 : pick(40);
    e.prefix_length = pick(3) ? -1 : pick(80);
    std::vector<int32_t> doc_q(batch * sq), doc_k(batch * sk), bits;
    if (pick(2)) {
      for (auto& d : doc_q) d = pick(3);
      for (auto& d : doc_k) d = pick(3);
      e.doc_ids_q = cpu_view(doc_q, {batch, sq});
      e.doc_ids_k = cpu_view(doc_k, {batch, sk});
    }
    const int words = (sk + 31) / 32;
    const int bits_batch = pick(2) ? 1 : batch, bits_heads = pick(2) ? 1 : heads;
    if (pick(2)) {
      bits.resize(static_cast<size_t>(bits_batch) * bits_heads * sq * words);
      for (auto& w : bits) w = static_cast<int32_t>(rng());
      e.bits = cpu_view(bits, {bits_batch, bits_heads, sq, words});
    }
    const ElementMaskParams p = make_element_mask_params(e);
    for (int b = 0; b < batch; ++b)
      for (int h = 0; h < heads; ++h)
        for (int i = 0; i < sq; ++i)
          for (int j = 0; j < sk; ++j)
            ASSERT_EQ(p.visible(b, h, i, j), element_mask_visible(e, b, h, i, j))
                << "trial " << trial << " b " << b << " h " << h << " q " << i << " kv " << j;
  }
}

// Without a prefix the structural predicates are a band of q - kv (the Hopper backward's partial
// steps test that): the same answer as row_interval for every pair.
TEST(ElementMaskParams, DiagonalBandMatchesTheRowIntervals) {
  std::mt19937_64 rng(13);
  auto pick = [&](int n) { return static_cast<int>(rng() % n); };
  int compared = 0;
  for (int trial = 0; trial < 400; ++trial) {
    ElementMask e;
    e.causal = pick(2);
    e.window_left = pick(3) ? -1 : pick(50);
    e.window_right = pick(3) ? -1 : pick(50);
    e.prefix_length = pick(4) ? -1 : pick(60);
    const ElementMaskParams p = make_element_mask_params(e);
    ASSERT_EQ(p.diagonal_band_applies(), e.prefix_length < 0);
    if (!p.diagonal_band_applies()) continue;
    const auto band = p.diagonal_band();
    for (int q = 0; q < 90; ++q)
      for (int k = 0; k < 90; ++k, ++compared)
        ASSERT_EQ(band.contains(q - k), p.row_interval(q).contains(k))
            << "trial " << trial << " causal " << e.causal << " left " << e.window_left << " right "
            << e.window_right << " q " << q << " kv " << k;
  }
  EXPECT_GT(compared, 100000);
}

TEST(BlockSparseParams, BroadcastDimsReadRowZero) {
  // kv lists broadcast over batch (dim 0 = 1), full lists over heads.
  std::vector<int32_t> counts(1 * 3 * 2), indices(1 * 3 * 2 * 4), full_counts(2 * 1 * 2), full_indices(2 * 1 * 2 * 4);
  for (size_t i = 0; i < counts.size(); ++i) counts[i] = static_cast<int32_t>(i);
  for (size_t i = 0; i < full_counts.size(); ++i) full_counts[i] = static_cast<int32_t>(10 + i);
  BlockMask m;
  m.q_block_size = m.kv_block_size = 16;
  m.kv_num_blocks = cpu_view(counts, {1, 3, 2});
  m.kv_indices = cpu_view(indices, {1, 3, 2, 4});
  m.full_kv_num_blocks = cpu_view(full_counts, {2, 1, 2});
  m.full_kv_indices = cpu_view(full_indices, {2, 1, 2, 4});
  const BlockSparseParams p = make_block_sparse_params(m, 20, 64);
  EXPECT_EQ(p.num_q_blocks, 2);
  EXPECT_EQ(p.num_kv_blocks, 4);
  for (int b = 0; b < 2; ++b)
    for (int h = 0; h < 3; ++h)
      for (int r = 0; r < 2; ++r) {
        EXPECT_EQ(p.partial_kv.count(b, h, r, 100), h * 2 + r);
        EXPECT_EQ(p.partial_kv.row(b, h, r), indices.data() + (h * 2 + r) * 4);
        EXPECT_EQ(p.full_kv.count(b, h, r, 100), 10 + b * 2 + r);
        EXPECT_EQ(p.full_kv.count(b, h, r, 11), std::min(11, 10 + b * 2 + r));  // clamped
      }
  BlockMask no_full = m;
  no_full.full_kv_num_blocks = TensorView{};
  no_full.full_kv_indices = TensorView{};
  EXPECT_EQ(make_block_sparse_params(no_full, 20, 64).full_kv.count(0, 0, 0, 4), 0);
}

// Every step of random list rows (bad entries included: negative, past the mask's blocks) against
// the rows expanded by hand: each entry's block in step_rows steps, partial entries first, steps
// past the sequence and of bad entries invalid (and naming block 0), valid ones in list order.
TEST(SortedRun, MatchesALinearScan) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 500; ++trial) {
    const int n = static_cast<int>(rng() % 40), stride = 1 + static_cast<int>(rng() % 3);
    std::vector<int32_t> ids(static_cast<size_t>(n) * stride + 1, 999);
    int32_t v = static_cast<int32_t>(rng() % 3);
    for (int j = 0; j < n; ++j) {
      v += static_cast<int32_t>(rng() % 4 == 0 ? 1 + rng() % 2 : 0);
      ids[static_cast<size_t>(j) * stride] = v;
    }
    for (int32_t value = -1; value <= v + 1; ++value) {
      int lo = 0;
      while (lo < n && ids[static_cast<size_t>(lo) * stride] < value) ++lo;
      int hi = lo;
      while (hi < n && ids[static_cast<size_t>(hi) * stride] == value) ++hi;
      const IdRun run = sorted_run(ids.data(), stride, n, value);
      ASSERT_EQ(run.lo, lo) << "trial " << trial << " value " << value;
      ASSERT_EQ(run.hi, hi) << "trial " << trial << " value " << value;
    }
  }
}

TEST(ListSteps, ExpandTheListsInOrder) {
  std::mt19937_64 rng(11);
  auto pick = [&](int n) { return static_cast<int>(rng() % n); };
  for (int trial = 0; trial < 500; ++trial) {
    const int step_rows = 64, subs = 1 << pick(3);  // blocks of 64, 128, 256 rows
    const int block_size = step_rows * subs;
    const int seqlen = 1 + pick(1000);
    const int num_blocks = (seqlen + block_size - 1) / block_size;
    const int batch = 2, heads = 3, rows = 4;
    const int cap = num_blocks + 2;  // room for bad entries
    std::vector<int32_t> counts[2], indices[2];
    BlockListParams lists[2];
    for (int k = 0; k < 2; ++k) {
      counts[k].assign(batch * heads * rows, 0);
      indices[k].assign(static_cast<size_t>(batch) * heads * rows * cap, 0);
      for (int r = 0; r < batch * heads * rows; ++r) {
        counts[k][r] = pick(num_blocks + 1);
        for (int i = 0; i < counts[k][r]; ++i)
          indices[k][static_cast<size_t>(r) * cap + i] = pick(9) == 0 ? (pick(2) ? -1 - pick(3) : num_blocks + pick(3))
                                                                       : pick(num_blocks);
      }
      lists[k].counts = counts[k].data();
      lists[k].indices = indices[k].data();
      lists[k].counts_batch = heads * rows, lists[k].counts_head = rows, lists[k].counts_row = 1;
      lists[k].indices_batch = int64_t{heads} * rows * cap, lists[k].indices_head = int64_t{rows} * cap;
      lists[k].indices_row = cap;
    }
    const int b = pick(batch), h = pick(heads), row = pick(rows);
    const ListSteps steps = list_steps(lists[0], lists[1], b, h, row, block_size, num_blocks, seqlen, step_rows);
    struct Expected {
      int m;
      bool valid, element;
    };
    std::vector<Expected> expected;
    const int num_m = (seqlen + step_rows - 1) / step_rows;
    for (int k = 0; k < 2; ++k) {
      const int r = (b * heads + h) * rows + row;
      for (int i = 0; i < counts[k][r]; ++i) {
        const int block = indices[k][static_cast<size_t>(r) * cap + i];
        for (int sub = 0; sub < subs; ++sub) {
          const int m = block * subs + sub;
          const bool valid = block >= 0 && block < num_blocks && m < num_m;
          expected.push_back({valid ? m : 0, valid, k == 0});
        }
      }
    }
    auto check = [&](const ListSteps& walk, const char* what) {
      ASSERT_EQ(walk.count(), static_cast<int>(expected.size())) << what << " trial " << trial;
      for (int i = 0; i < walk.count(); ++i) {
        const ListStep s = walk.at(i);
        EXPECT_EQ(s.m, expected[i].m) << what << " trial " << trial << " step " << i;
        EXPECT_EQ(s.valid, expected[i].valid) << what << " trial " << trial << " step " << i;
        EXPECT_EQ(s.element, expected[i].element) << what << " trial " << trial << " step " << i;
      }
    };
    check(steps, "lists");
    // The same walk as a plan lists it: every block in order, a flag per full one.
    std::vector<int32_t> blocks, is_full;
    for (int k = 0; k < 2; ++k) {
      const int r = (b * heads + h) * rows + row;
      for (int i = 0; i < counts[k][r]; ++i) {
        blocks.push_back(indices[k][static_cast<size_t>(r) * cap + i]);
        is_full.push_back(k);
      }
    }
    check(planned_list_steps(blocks.data(), is_full.data(), static_cast<int>(blocks.size()), block_size, num_blocks,
                             seqlen, step_rows),
          "planned");
  }
}

}  // namespace
}  // namespace flare::block_sparse
