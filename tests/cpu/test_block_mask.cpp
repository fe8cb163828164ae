// Block-sparse masks on the host: every validation rule rejects a bad input naming its field, and
// the builders agree with the oracle (reference/attention_ref.h) element by element.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "reference/attention_ref.h"
#include "src/block_sparse/block_mask_args.h"
#include "src/block_sparse/block_mask_build.h"

namespace flare::block_sparse {
namespace {

using detail::BlockMaskProblem;
using detail::BlockMaskShape;

// ---- validation ---------------------------------------------------------------------------------

// A valid mask for batch 2, heads 3, 80 x 100 tokens in 32 x 32 blocks (3 x 4 blocks): per (b, h)
// a different mix of partial, full and empty blocks.
HostBlockMask valid_mask() {
  BlockMaskGeometry g;
  g.batch = 2, g.heads = 3, g.seqlen_q = 80, g.seqlen_k = 100, g.q_block_size = g.kv_block_size = 32;
  BlockKindGrid kinds = BlockKindGrid::all_empty(2, 3, g.num_q_blocks(), g.num_kv_blocks());
  const TileKind cycle[] = {TileKind::kPartial, TileKind::kPartial, TileKind::kFull, TileKind::kFull, TileKind::kEmpty};
  for (int b = 0; b < 2; ++b)
    for (int h = 0; h < 3; ++h)
      for (int m = 0; m < kinds.num_q_blocks; ++m)
        for (int n = 0; n < kinds.num_kv_blocks; ++n) kinds.at(b, h, m, n) = cycle[(b + h + m + 2 * n) % 5];
  HostBlockMask mask;
  EXPECT_TRUE(build_from_kinds(kinds, g, ElementMask{}, &mask).ok());
  return mask;
}

const BlockMaskProblem kProblem{2, 3, 80, 100};

Status validate(const BlockMask& m, DeviceKind device = DeviceKind::kCPU) {
  BlockMaskShape shape;
  return detail::validate_block_mask(m, kProblem, device, &shape);
}

// An InvalidArgument naming `field` (and saying `what`, when given).
void expect_rejects(const BlockMask& m, const std::string& field, const std::string& what = "",
                    DeviceKind device = DeviceKind::kCPU) {
  const Status s = validate(m, device);
  ASSERT_FALSE(s.ok()) << "accepted; expected an error about " << field;
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'" + field + "'"), std::string::npos) << s.message();
  if (!what.empty()) {
    EXPECT_NE(s.message().find(what), std::string::npos) << s.message();
  }
}

// The flat offset of (b, h, row, k) in a HostBlockMask list.
size_t at(const HostBlockMask& m, int b, int h, int row, int rows, int cols, int k = 0) {
  return ((static_cast<size_t>(b) * m.heads + h) * rows + row) * cols + k;
}

TEST(BlockMaskArgs, AcceptsBuiltMasksAndDerivesTheShape) {
  const HostBlockMask mask = valid_mask();
  BlockMaskShape shape;
  ASSERT_TRUE(detail::validate_block_mask(mask.view(), kProblem, DeviceKind::kCPU, &shape).ok());
  EXPECT_EQ(shape.num_q_blocks, 3);
  EXPECT_EQ(shape.num_kv_blocks, 4);
  EXPECT_TRUE(shape.has_full_blocks);
  EXPECT_TRUE(shape.has_transposed_lists);
  // The forward partial lists alone are a mask too (FlexAttention without full blocks).
  BlockMask partial_only;
  partial_only.q_block_size = partial_only.kv_block_size = 32;
  partial_only.kv_num_blocks = mask.view().kv_num_blocks;
  partial_only.kv_indices = mask.view().kv_indices;
  ASSERT_TRUE(detail::validate_block_mask(partial_only, kProblem, DeviceKind::kCPU, &shape).ok());
  EXPECT_FALSE(shape.has_full_blocks);
  EXPECT_FALSE(shape.has_transposed_lists);
}

TEST(BlockMaskArgs, BroadcastMaskServesEveryBatchAndHead) {
  BlockMaskGeometry g;
  g.seqlen_q = 80, g.seqlen_k = 100, g.q_block_size = g.kv_block_size = 32;
  ElementMask causal;
  causal.causal = true;
  HostBlockMask mask;
  ASSERT_TRUE(build_from_element_mask(causal, g, &mask).ok());
  EXPECT_TRUE(validate(mask.view()).ok());
  for (int b = 0; b < 2; ++b)
    for (int h = 0; h < 3; ++h) EXPECT_EQ(mask.kind(b, h, 1, 1), TileKind::kPartial);
}

TEST(BlockMaskArgs, EntriesPastTheCountAreNotRead) {
  HostBlockMask mask = valid_mask();
  const int count = mask.partial_kv.num_blocks[0];
  ASSERT_LT(count, 4);
  mask.partial_kv.indices[count] = -99;  // padding, as FlexAttention leaves it
  EXPECT_TRUE(validate(mask.view()).ok());
}

TEST(BlockMaskArgs, BlockSizesArePositiveMultiplesOf16) {
  BlockMask m = valid_mask().view();
  m.q_block_size = 24;
  expect_rejects(m, "q_block_size", "multiple of 16");
  m.q_block_size = 0;
  expect_rejects(m, "q_block_size", "multiple of 16");
  m = valid_mask().view();
  m.kv_block_size = -32;
  expect_rejects(m, "kv_block_size", "multiple of 16");
}

TEST(BlockMaskArgs, RequiredAndPairedLists) {
  const HostBlockMask mask = valid_mask();
  BlockMask m = mask.view();
  m.kv_num_blocks = TensorView{};
  expect_rejects(m, "kv_num_blocks", "required");
  m = mask.view();
  m.kv_indices = TensorView{};
  expect_rejects(m, "kv_indices", "required with kv_num_blocks");
  m = mask.view();
  m.full_kv_indices = TensorView{};
  expect_rejects(m, "full_kv_indices", "required with full_kv_num_blocks");
  m = mask.view();
  m.q_num_blocks = TensorView{};
  expect_rejects(m, "q_num_blocks", "required with q_indices");
  m = mask.view();
  m.full_q_num_blocks = m.full_q_indices = TensorView{};
  expect_rejects(m, "full_q_num_blocks", "must include the full blocks");
  m = mask.view();
  m.q_num_blocks = m.q_indices = TensorView{};
  expect_rejects(m, "q_num_blocks", "required with full_q_num_blocks");
  m = mask.view();
  m.full_kv_num_blocks = m.full_kv_indices = TensorView{};
  expect_rejects(m, "full_kv_num_blocks", "required with full_q_num_blocks");
}

TEST(BlockMaskArgs, DtypeRankAndShape) {
  const HostBlockMask mask = valid_mask();
  BlockMask m = mask.view();
  m.kv_num_blocks.dtype = DType::kInt64;
  expect_rejects(m, "kv_num_blocks", "int32");
  m = mask.view();
  m.kv_indices.rank = 3;
  expect_rejects(m, "kv_indices", "rank 4");
  m = mask.view();
  m.kv_num_blocks.shape[0] = 3;  // neither 1 nor the batch
  expect_rejects(m, "kv_num_blocks", "batch");
  m = mask.view();
  m.full_kv_num_blocks.shape[1] = 2;
  expect_rejects(m, "full_kv_num_blocks", "head count");
  m = mask.view();
  m.q_num_blocks.shape[2] = 3;  // kv blocks, not q blocks
  expect_rejects(m, "q_num_blocks", "number of kv blocks");
  m = mask.view();
  m.full_q_indices.shape[3] = 4;
  expect_rejects(m, "full_q_indices", "number of q blocks");
  m = mask.view();
  m.kv_indices.shape[0] = 1;  // broadcast indices under per-batch counts
  m.kv_indices.stride[0] = 0;
  expect_rejects(m, "kv_indices", "differ from kv_num_blocks");
}

TEST(BlockMaskArgs, PlacementAndLayout) {
  const HostBlockMask mask = valid_mask();
  BlockMask m = mask.view();
  m.kv_indices.device = Device{DeviceKind::kCUDA, 0};
  expect_rejects(m, "kv_indices", "CPU");
  m = mask.view();
  m.kv_num_blocks.data = nullptr;
  expect_rejects(m, "kv_num_blocks", "null");
  m = mask.view();
  m.kv_indices.stride[3] = 2;
  expect_rejects(m, "kv_indices", "contiguous");
  m = mask.view();
  m.full_q_num_blocks.stride[1] = -4;
  expect_rejects(m, "full_q_num_blocks", "negative stride");
}

// Device views are checked by shape and dtype only: nonsense values pass, a wrong dtype does not.
TEST(BlockMaskArgs, DeviceViewsAreNotRead) {
  HostBlockMask mask = valid_mask();
  std::fill(mask.partial_kv.num_blocks.begin(), mask.partial_kv.num_blocks.end(), 99);
  BlockMask m = mask.view();
  for (TensorView* t : {&m.kv_num_blocks, &m.kv_indices, &m.full_kv_num_blocks, &m.full_kv_indices, &m.q_num_blocks,
                        &m.q_indices, &m.full_q_num_blocks, &m.full_q_indices})
    t->device = Device{DeviceKind::kCUDA, 0};
  EXPECT_TRUE(validate(m, DeviceKind::kCUDA).ok());
  m.q_indices.dtype = DType::kFloat32;
  expect_rejects(m, "q_indices", "int32", DeviceKind::kCUDA);
}

TEST(BlockMaskArgs, CountsWithinTheRow) {
  HostBlockMask mask = valid_mask();
  mask.partial_kv.num_blocks[at(mask, 1, 2, 0, 3, 1)] = -1;
  expect_rejects(mask.view(), "kv_num_blocks", "outside [0, 4]");
  mask = valid_mask();
  mask.full_kv.num_blocks[at(mask, 0, 1, 2, 3, 1)] = 5;
  expect_rejects(mask.view(), "full_kv_num_blocks", "count 5");
  mask = valid_mask();
  mask.full_q.num_blocks[at(mask, 0, 0, 3, 4, 1)] = 4;  // 3 q blocks
  expect_rejects(mask.view(), "full_q_num_blocks", "outside [0, 3]");
}

// A row with two listed blocks, to corrupt.
struct Row {
  int b, h, row;
};
Row row_with_two(const BlockList& l, const HostBlockMask& m, int rows) {
  for (int b = 0; b < m.batch; ++b)
    for (int h = 0; h < m.heads; ++h)
      for (int r = 0; r < rows; ++r)
        if (l.num_blocks[at(m, b, h, r, rows, 1)] >= 2) return {b, h, r};
  ADD_FAILURE() << "no row with two blocks";
  return {0, 0, 0};
}

// Adds `block` to a list row, keeping the row sorted: the way to add a pair to a list.
void insert_block(BlockList* l, const HostBlockMask& m, const Row& r, int rows, int cols, int32_t block) {
  int32_t* row = l->indices.data() + at(m, r.b, r.h, r.row, rows, cols);
  int32_t& count = l->num_blocks[at(m, r.b, r.h, r.row, rows, 1)];
  row[count++] = block;
  std::sort(row, row + count);
}

// A row of a list with a block it does not list, and that block.
std::pair<Row, int32_t> row_missing_a_block(const BlockList& l, const HostBlockMask& m, int rows, int cols) {
  for (int b = 0; b < m.batch; ++b)
    for (int h = 0; h < m.heads; ++h)
      for (int r = 0; r < rows; ++r) {
        const int32_t* row = l.indices.data() + at(m, b, h, r, rows, cols);
        const int32_t count = l.num_blocks[at(m, b, h, r, rows, 1)];
        for (int32_t block = 0; block < cols; ++block)
          if (std::find(row, row + count, block) == row + count) return {{b, h, r}, block};
      }
  ADD_FAILURE() << "every row is complete";
  return {{0, 0, 0}, 0};
}

TEST(BlockMaskArgs, IndicesInRangeAndStrictlyIncreasing) {
  HostBlockMask mask = valid_mask();
  Row r = row_with_two(mask.partial_kv, mask, 3);
  mask.partial_kv.indices[at(mask, r.b, r.h, r.row, 3, 4, 1)] = 4;
  expect_rejects(mask.view(), "kv_indices", "outside [0, 4)");
  mask = valid_mask();
  r = row_with_two(mask.full_kv, mask, 3);
  mask.full_kv.indices[at(mask, r.b, r.h, r.row, 3, 4, 0)] = -1;
  expect_rejects(mask.view(), "full_kv_indices", "outside [0, 4)");
  mask = valid_mask();
  r = row_with_two(mask.partial_kv, mask, 3);
  mask.partial_kv.indices[at(mask, r.b, r.h, r.row, 3, 4, 1)] = mask.partial_kv.indices[at(mask, r.b, r.h, r.row, 3, 4, 0)];
  expect_rejects(mask.view(), "kv_indices", "strictly increasing");
  mask = valid_mask();
  r = row_with_two(mask.partial_q, mask, 4);
  std::swap(mask.partial_q.indices[at(mask, r.b, r.h, r.row, 4, 3, 0)],
            mask.partial_q.indices[at(mask, r.b, r.h, r.row, 4, 3, 1)]);
  expect_rejects(mask.view(), "q_indices", "strictly increasing");
}

TEST(BlockMaskArgs, NoBlockBothPartialAndFull) {
  HostBlockMask mask = valid_mask();
  const Row r = row_with_two(mask.full_kv, mask, 3);
  insert_block(&mask.partial_kv, mask, r, 3, 4, mask.full_kv.indices[at(mask, r.b, r.h, r.row, 3, 4, 0)]);
  expect_rejects(mask.view(), "full_kv_indices", "both partial");
}

TEST(BlockMaskArgs, TransposedListsMatchTheForwardLists) {
  HostBlockMask mask = valid_mask();
  const Row r = row_with_two(mask.partial_q, mask, 4);
  --mask.partial_q.num_blocks[at(mask, r.b, r.h, r.row, 4, 1)];  // drops a pair
  expect_rejects(mask.view(), "q_num_blocks", "list kv block");
  mask = valid_mask();
  const auto [row, block] = row_missing_a_block(mask.full_q, mask, 4, 3);
  insert_block(&mask.full_q, mask, row, 4, 3, block);  // a pair the forward lists do not have as full
  expect_rejects(mask.view(), "full_q_indices", "do not list kv block");
}

TEST(BlockMaskArgs, ElementMaskFields) {
  const HostBlockMask mask = valid_mask();
  BlockMask m = mask.view();
  m.element.window_left = -2;
  expect_rejects(m, "element.window_left", ">= -1");
  m = mask.view();
  m.element.prefix_length = -5;
  expect_rejects(m, "element.prefix_length");
  std::vector<int32_t> doc_q(2 * 80), doc_k(2 * 100);
  m = mask.view();
  m.element.doc_ids_q = TensorView::contiguous(doc_q.data(), DType::kInt32, {2, 80}, Device{DeviceKind::kCPU, 0});
  expect_rejects(m, "element.doc_ids_k", "together");
  m.element.doc_ids_k = TensorView::contiguous(doc_k.data(), DType::kInt32, {2, 100}, Device{DeviceKind::kCPU, 0});
  EXPECT_TRUE(validate(m).ok());
  m.element.doc_ids_q.shape[1] = 79;
  expect_rejects(m, "element.doc_ids_q", "seqlen_q");
  m.element.doc_ids_q.shape[1] = 80;
  m.element.doc_ids_k.dtype = DType::kInt64;
  expect_rejects(m, "element.doc_ids_k", "int32");
  std::vector<uint32_t> bits(2 * 1 * 80 * 4);
  m = mask.view();
  m.element.bits = TensorView::contiguous(bits.data(), DType::kInt32, {2, 1, 80, 4}, Device{DeviceKind::kCPU, 0});
  EXPECT_TRUE(validate(m).ok());
  m.element.bits.shape[3] = 3;  // ceil(100 / 32) words per row
  expect_rejects(m, "element.bits", "ceil(seqlen_k / 32)");
}

// ---- builders against the oracle ---------------------------------------------------------------

// An element predicate and the storage its views point into. Filled in place, never copied.
struct Scenario {
  std::string name;
  BlockMaskGeometry geometry;  // the mask's dims
  int batch = 2, heads = 3;    // the attention's
  std::vector<int32_t> doc_q, doc_k;
  std::vector<uint32_t> bits;
  ElementMask element;

  Scenario() = default;
  Scenario(const Scenario&) = delete;
  Scenario& operator=(const Scenario&) = delete;
};

enum class Pattern {
  kCausal,
  kSlidingWindow,   // causal with a left window
  kTwoSidedWindow,  // no causal
  kDocuments,       // 8 documents, causal inside each
  kPrefixLm,
  kRandomBits,
  kWindowAndPrefix,
  kDocumentsWindowBits,
};
const Pattern kPatterns[] = {Pattern::kCausal,    Pattern::kSlidingWindow, Pattern::kTwoSidedWindow,
                             Pattern::kDocuments, Pattern::kPrefixLm,      Pattern::kRandomBits,
                             Pattern::kWindowAndPrefix, Pattern::kDocumentsWindowBits};

int pick(std::mt19937& rng, int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

// 8 documents (some may be empty) over `length` positions for each batch entry: ids ascending.
std::vector<int32_t> document_ids(int batch, int length, std::mt19937& rng) {
  std::vector<int32_t> ids;
  for (int b = 0; b < batch; ++b) {
    std::vector<int> starts;
    for (int d = 0; d < 7; ++d) starts.push_back(pick(rng, 1, std::max(1, length - 1)));
    std::sort(starts.begin(), starts.end());
    for (int i = 0; i < length; ++i)
      ids.push_back(static_cast<int32_t>(std::upper_bound(starts.begin(), starts.end(), i) - starts.begin()));
  }
  return ids;
}

void add_documents(Scenario* s, std::mt19937& rng) {
  // Documents differ per batch entry, so the mask cannot broadcast over the batch.
  s->geometry.batch = s->batch;
  s->geometry.seqlen_k = s->geometry.seqlen_q;
  s->doc_q = document_ids(s->batch, s->geometry.seqlen_q, rng);
  s->doc_k = s->doc_q;
  const Device cpu{DeviceKind::kCPU, 0};
  s->element.doc_ids_q = TensorView::contiguous(s->doc_q.data(), DType::kInt32, {s->batch, s->geometry.seqlen_q}, cpu);
  s->element.doc_ids_k = TensorView::contiguous(s->doc_k.data(), DType::kInt32, {s->batch, s->geometry.seqlen_k}, cpu);
}

// Bits in granules of 16 rows x 32 columns (a word), each all ones, all zeros or random, so that
// small blocks come out full, empty and partial.
void add_random_bits(Scenario* s, std::mt19937& rng) {
  const BlockMaskGeometry& g = s->geometry;
  const int words = (g.seqlen_k + 31) / 32;
  s->bits.assign(static_cast<size_t>(g.batch) * g.heads * g.seqlen_q * words, 0);
  std::uniform_int_distribution<uint32_t> any_word;
  for (int bh = 0; bh < g.batch * g.heads; ++bh)
    for (int row_group = 0; row_group * 16 < g.seqlen_q; ++row_group)
      for (int w = 0; w < words; ++w) {
        const int state = pick(rng, 0, 9);  // 0-3 ones, 4-7 zeros, 8-9 random
        for (int i = row_group * 16; i < std::min(g.seqlen_q, (row_group + 1) * 16); ++i)
          s->bits[(static_cast<size_t>(bh) * g.seqlen_q + i) * words + w] =
              state < 4 ? ~0u : (state < 8 ? 0u : any_word(rng));
      }
  s->element.bits = TensorView::contiguous(s->bits.data(), DType::kInt32, {g.batch, g.heads, g.seqlen_q, words},
                                           Device{DeviceKind::kCPU, 0});
}

void make_scenario(Pattern p, std::mt19937& rng, Scenario* s) {
  const int sizes[] = {16, 32, 48, 64};
  BlockMaskGeometry& g = s->geometry;
  g.batch = pick(rng, 0, 1) ? s->batch : 1;
  g.heads = pick(rng, 0, 1) ? s->heads : 1;
  g.seqlen_q = pick(rng, 1, 100);
  g.seqlen_k = pick(rng, 1, 100);
  g.q_block_size = sizes[pick(rng, 0, 3)];
  g.kv_block_size = sizes[pick(rng, 0, 3)];
  ElementMask& e = s->element;
  switch (p) {
    case Pattern::kCausal: s->name = "causal", e.causal = true; break;
    case Pattern::kSlidingWindow: s->name = "sliding window", e.causal = true, e.window_left = pick(rng, 0, 40); break;
    case Pattern::kTwoSidedWindow:
      s->name = "two-sided window", e.window_left = pick(rng, 0, 30), e.window_right = pick(rng, 0, 30);
      break;
    case Pattern::kDocuments: s->name = "documents", e.causal = true, add_documents(s, rng); break;
    case Pattern::kPrefixLm: s->name = "prefix-LM", e.prefix_length = pick(rng, 0, g.seqlen_k); break;
    case Pattern::kRandomBits: s->name = "random bits", add_random_bits(s, rng); break;
    case Pattern::kWindowAndPrefix:
      s->name = "window and prefix", e.window_left = pick(rng, 0, 40), e.prefix_length = pick(rng, 0, 30);
      break;
    case Pattern::kDocumentsWindowBits:
      s->name = "documents, window and bits", e.window_left = pick(rng, 0, 50), e.window_right = pick(rng, 0, 10);
      add_documents(s, rng);
      add_random_bits(s, rng);
      break;
  }
}

using Truth = std::function<bool(int b, int h, int64_t i, int64_t j)>;

std::string describe(const Scenario& s) {
  const BlockMaskGeometry& g = s.geometry;
  return s.name + " mask [" + std::to_string(g.batch) + ", " + std::to_string(g.heads) + "] " +
         std::to_string(g.seqlen_q) + " x " + std::to_string(g.seqlen_k) + " in " + std::to_string(g.q_block_size) +
         " x " + std::to_string(g.kv_block_size) + " blocks";
}

// Through the oracle, every element of every attention (b, h) is visible exactly when `truth`
// says so, and every block's kind is exact (FULL only when all of it is visible, listed only
// when some of it is).
using KindCounts = std::array<int, 3>;  // by TileKind

void expect_matches(const HostBlockMask& mask, const Scenario& s, const Truth& truth, KindCounts* kinds) {
  const BlockMaskGeometry& g = s.geometry;
  BlockMaskShape shape;
  const Status valid = detail::validate_block_mask(mask.view(), {s.batch, s.heads, g.seqlen_q, g.seqlen_k},
                                                   DeviceKind::kCPU, &shape);
  ASSERT_TRUE(valid.ok()) << describe(s) << ": " << valid.message();
  const BlockMask view = mask.view();
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads; ++h)
      for (int m = 0; m < g.num_q_blocks(); ++m)
        for (int n = 0; n < g.num_kv_blocks(); ++n) {
          int visible = 0, elements = 0;
          for (int64_t i = int64_t{m} * g.q_block_size; i < std::min<int64_t>(g.seqlen_q, (m + 1LL) * g.q_block_size); ++i)
            for (int64_t j = int64_t{n} * g.kv_block_size; j < std::min<int64_t>(g.seqlen_k, (n + 1LL) * g.kv_block_size); ++j) {
              const bool expected = truth(b, h, i, j);
              ASSERT_EQ(ref::block_sparse_visible(view, b, h, i, j, g.seqlen_k), expected)
                  << describe(s) << " at b=" << b << " h=" << h << " q=" << i << " kv=" << j;
              visible += expected;
              ++elements;
            }
          const TileKind kind = visible == 0 ? TileKind::kEmpty
                                             : (visible == elements ? TileKind::kFull : TileKind::kPartial);
          ASSERT_EQ(mask.kind(b, h, m, n), kind) << describe(s) << " block (" << m << ", " << n << ")";
          ++(*kinds)[static_cast<int>(kind)];
        }
}

Truth oracle_of(const ElementMask& e, int seqlen_k) {
  return [&e, seqlen_k](int b, int h, int64_t i, int64_t j) { return ref::element_visible(e, b, h, i, j, seqlen_k); };
}

TEST(BlockMaskBuild, ElementMasksMatchTheOracle) {
  std::mt19937 rng(1);
  for (Pattern p : kPatterns) {
    KindCounts kinds{};
    for (int trial = 0; trial < 40; ++trial) {
      Scenario s;
      make_scenario(p, rng, &s);
      HostBlockMask mask;
      const Status st = build_from_element_mask(s.element, s.geometry, &mask);
      ASSERT_TRUE(st.ok()) << describe(s) << ": " << st.message();
      expect_matches(mask, s, oracle_of(s.element, s.geometry.seqlen_k), &kinds);
    }
    // Not degenerate: every pattern made blocks of every kind.
    EXPECT_GT(kinds[0], 0) << static_cast<int>(p);
    EXPECT_GT(kinds[1], 0) << static_cast<int>(p);
    EXPECT_GT(kinds[2], 0) << static_cast<int>(p);
  }
}

// A callable composed of an element mask and a block-level pattern (constant on blocks, so the
// element mask stands for it inside partial blocks): FlexAttention's mask_mod with a coarse part.
TEST(BlockMaskBuild, CallablePredicatesMatchTheOracle) {
  std::mt19937 rng(2);
  for (Pattern p : kPatterns) {
    KindCounts kinds{};
    for (int trial = 0; trial < 20; ++trial) {
      Scenario s;
      make_scenario(p, rng, &s);
      const BlockMaskGeometry g = s.geometry;
      std::vector<uint8_t> keep(static_cast<size_t>(g.batch) * g.heads * g.num_q_blocks() * g.num_kv_blocks());
      for (uint8_t& k : keep) k = pick(rng, 0, 3) != 0;
      auto kept = [&](int b, int h, int64_t i, int64_t j) {
        const int mb = g.batch == 1 ? 0 : b, mh = g.heads == 1 ? 0 : h;
        return keep[((static_cast<size_t>(mb) * g.heads + mh) * g.num_q_blocks() + i / g.q_block_size) *
                        g.num_kv_blocks() + j / g.kv_block_size] != 0;
      };
      const Truth truth = [&](int b, int h, int64_t i, int64_t j) {
        return kept(b, h, i, j) && ref::element_visible(s.element, b, h, i, j, g.seqlen_k);
      };
      HostBlockMask mask;
      const Status st = build_from_predicate(truth, s.element, g, &mask);
      ASSERT_TRUE(st.ok()) << describe(s) << ": " << st.message();
      expect_matches(mask, s, truth, &kinds);
    }
    EXPECT_GT(kinds[0] * kinds[1] * kinds[2], 0) << static_cast<int>(p);
  }
}

TEST(BlockMaskBuild, KindGridsGiveTheirKinds) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 20; ++trial) {
    BlockMaskGeometry g;
    g.batch = pick(rng, 1, 2), g.heads = pick(rng, 0, 1) ? 3 : 1;
    g.seqlen_q = pick(rng, 1, 200), g.seqlen_k = pick(rng, 1, 200);
    g.q_block_size = 16 * pick(rng, 1, 4), g.kv_block_size = 16 * pick(rng, 1, 4);
    BlockKindGrid kinds = BlockKindGrid::all_empty(g.batch, g.heads, g.num_q_blocks(), g.num_kv_blocks());
    for (TileKind& k : kinds.kinds) k = static_cast<TileKind>(pick(rng, 0, 2));
    HostBlockMask mask;
    ASSERT_TRUE(build_from_kinds(kinds, g, ElementMask{}, &mask).ok());
    BlockMaskShape shape;
    ASSERT_TRUE(detail::validate_block_mask(mask.view(), {2, 3, g.seqlen_q, g.seqlen_k}, DeviceKind::kCPU, &shape).ok());
    for (int b = 0; b < 2; ++b)
      for (int h = 0; h < 3; ++h)
        for (int m = 0; m < kinds.num_q_blocks; ++m)
          for (int n = 0; n < kinds.num_kv_blocks; ++n)
            ASSERT_EQ(mask.kind(b, h, m, n), kinds.at(g.batch == 1 ? 0 : b, g.heads == 1 ? 0 : h, m, n));
  }
}

TEST(BlockMaskBuild, TransposeRoundTripsAndListsTheSeeingQBlocks) {
  std::mt19937 rng(4);
  for (Pattern p : kPatterns) {
    Scenario s;
    make_scenario(p, rng, &s);
    HostBlockMask mask;
    ASSERT_TRUE(build_from_element_mask(s.element, s.geometry, &mask).ok());
    // Per kv block: exactly the q blocks whose kind is not empty, ascending, flagged full or not.
    std::vector<int32_t> q_blocks, is_full;
    for (int b = 0; b < mask.batch; ++b)
      for (int h = 0; h < mask.heads; ++h)
        for (int n = 0; n < mask.num_kv_blocks; ++n) {
          mask.q_blocks_of(b, h, n, &q_blocks, &is_full);
          std::vector<int32_t> want_blocks, want_full;
          for (int m = 0; m < mask.num_q_blocks; ++m)
            if (mask.kind(b, h, m, n) != TileKind::kEmpty) {
              want_blocks.push_back(m);
              want_full.push_back(mask.kind(b, h, m, n) == TileKind::kFull);
            }
          ASSERT_EQ(q_blocks, want_blocks) << describe(s);
          ASSERT_EQ(is_full, want_full) << describe(s);
        }
    // The transpose of the transpose is the forward lists, padding included.
    HostBlockMask flipped;
    flipped.batch = mask.batch, flipped.heads = mask.heads;
    flipped.num_q_blocks = mask.num_kv_blocks, flipped.num_kv_blocks = mask.num_q_blocks;
    flipped.partial_kv = mask.partial_q, flipped.full_kv = mask.full_q;
    fill_transposed_lists(&flipped);
    EXPECT_EQ(flipped.partial_q.num_blocks, mask.partial_kv.num_blocks) << describe(s);
    EXPECT_EQ(flipped.partial_q.indices, mask.partial_kv.indices) << describe(s);
    EXPECT_EQ(flipped.full_q.num_blocks, mask.full_kv.num_blocks) << describe(s);
    EXPECT_EQ(flipped.full_q.indices, mask.full_kv.indices) << describe(s);
  }
}

TEST(BlockMaskBuild, CopiesAUserMaskAndComputesItsTransposedLists) {
  const HostBlockMask mask = valid_mask();
  BlockMask user = mask.view();
  user.q_num_blocks = user.q_indices = user.full_q_num_blocks = user.full_q_indices = TensorView{};
  HostBlockMask copy;
  ASSERT_TRUE(copy_block_mask(user, kProblem, &copy).ok());
  EXPECT_EQ(copy.partial_kv.indices, mask.partial_kv.indices);
  EXPECT_EQ(copy.full_kv.num_blocks, mask.full_kv.num_blocks);
  EXPECT_EQ(copy.partial_q.indices, mask.partial_q.indices);
  EXPECT_EQ(copy.full_q.indices, mask.full_q.indices);
  // Lists with different broadcasts: partial blocks per (b, h), full blocks the same for all and
  // given once ([1, 1, ...] views of (0, 0)'s rows), expanded on copy.
  BlockMaskGeometry g;
  g.batch = 2, g.heads = 3, g.seqlen_q = 80, g.seqlen_k = 100, g.q_block_size = g.kv_block_size = 32;
  BlockKindGrid kinds = BlockKindGrid::all_empty(2, 3, 3, 4);
  for (int b = 0; b < 2; ++b)
    for (int h = 0; h < 3; ++h)
      for (int m = 0; m < 3; ++m)
        for (int n = 0; n < 4; ++n)
          kinds.at(b, h, m, n) = (m + n) % 3 == 0 ? TileKind::kFull
                                                  : ((b + h + m * n) % 2 ? TileKind::kPartial : TileKind::kEmpty);
  HostBlockMask per_head;
  ASSERT_TRUE(build_from_kinds(kinds, g, ElementMask{}, &per_head).ok());
  BlockMask mixed = per_head.view();
  const Device cpu{DeviceKind::kCPU, 0};
  mixed.full_kv_num_blocks = TensorView::contiguous(mixed.full_kv_num_blocks.data, DType::kInt32, {1, 1, 3}, cpu);
  mixed.full_kv_indices = TensorView::contiguous(mixed.full_kv_indices.data, DType::kInt32, {1, 1, 3, 4}, cpu);
  mixed.full_q_num_blocks = TensorView::contiguous(mixed.full_q_num_blocks.data, DType::kInt32, {1, 1, 4}, cpu);
  mixed.full_q_indices = TensorView::contiguous(mixed.full_q_indices.data, DType::kInt32, {1, 1, 4, 3}, cpu);
  const Status st = copy_block_mask(mixed, kProblem, &copy);
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(copy.batch, 2);
  EXPECT_EQ(copy.heads, 3);
  EXPECT_EQ(copy.partial_kv.indices, per_head.partial_kv.indices);
  EXPECT_EQ(copy.full_kv.indices, per_head.full_kv.indices);
  EXPECT_EQ(copy.full_q.indices, per_head.full_q.indices);
}

TEST(BlockMaskBuild, RejectsInconsistentInputs) {
  BlockMaskGeometry g;
  g.batch = 1, g.seqlen_q = g.seqlen_k = 64, g.q_block_size = g.kv_block_size = 32;
  std::vector<int32_t> docs(2 * 64, 0);
  ElementMask per_batch_documents;
  per_batch_documents.doc_ids_q = TensorView::contiguous(docs.data(), DType::kInt32, {2, 64}, Device{DeviceKind::kCPU, 0});
  per_batch_documents.doc_ids_k = per_batch_documents.doc_ids_q;
  HostBlockMask mask;
  Status s = build_from_element_mask(per_batch_documents, g, &mask);  // batch 1 cannot follow them
  EXPECT_NE(s.message().find("'element.doc_ids_q'"), std::string::npos) << s.message();

  ElementMask causal;
  causal.causal = true;
  const Truth not_causal = [](int, int, int64_t i, int64_t j) { return j <= i + 1; };
  s = build_from_predicate(not_causal, causal, g, &mask);
  EXPECT_NE(s.message().find("'element'"), std::string::npos) << s.message();

  BlockKindGrid small = BlockKindGrid::all_empty(1, 1, 1, 2);
  s = build_from_kinds(small, g, causal, &mask);
  EXPECT_NE(s.message().find("'kinds'"), std::string::npos) << s.message();

  g.kv_block_size = 40;
  s = build_from_element_mask(causal, g, &mask);
  EXPECT_NE(s.message().find("'kv_block_size'"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace flare::block_sparse
