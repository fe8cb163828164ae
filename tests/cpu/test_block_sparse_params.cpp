// The element predicate as the kernels evaluate it (block_sparse_params.h: a structural interval
// per row, then per-element lookups) against the host builder's element_mask_visible, element by
// element, over random compositions of every predicate; and the list params' broadcast strides.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "src/block_sparse/block_mask_build.h"
#include "src/block_sparse/block_sparse_params.h"

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

}  // namespace
}  // namespace flare::block_sparse
