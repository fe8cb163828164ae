#include "src/block_sparse/block_mask_build.h"

#include <algorithm>
#include <string>

namespace flare::block_sparse {
namespace {

size_t list_rows(int batch, int heads, int rows) { return static_cast<size_t>(batch) * heads * rows; }

// The sorted blocks of one row of a list.
struct ListRow {
  const int32_t* begin;
  const int32_t* end;
};

ListRow row_of_list(const BlockList& l, int mask_row, int row, int rows, int cols) {
  const size_t r = static_cast<size_t>(mask_row) * rows + row;
  const int32_t* first = l.indices.data() + r * cols;
  return {first, first + l.num_blocks[r]};
}

bool row_contains(const ListRow& r, int block) { return std::binary_search(r.begin, r.end, block); }

TensorView cpu_view(const std::vector<int32_t>& storage, std::initializer_list<int64_t> shape) {
  // Read-only by contract: flare never writes through a mask's views.
  return TensorView::contiguous(const_cast<int32_t*>(storage.data()), DType::kInt32, shape,
                                Device{DeviceKind::kCPU, 0});
}

int32_t load_int32(const TensorView& t, int64_t offset) { return t.ptr<const int32_t>()[offset]; }

// Rows (b, h, row) of a forward list out of a kind matrix.
void append_list_rows(const BlockKindGrid& kinds, int b, int h, int m, TileKind kind, BlockList* out) {
  const size_t r = (static_cast<size_t>(b) * kinds.heads + h) * kinds.num_q_blocks + m;
  int32_t* row = out->indices.data() + r * kinds.num_kv_blocks;
  int32_t count = 0;
  for (int n = 0; n < kinds.num_kv_blocks; ++n)
    if (kinds.at(b, h, m, n) == kind) row[count++] = n;
  out->num_blocks[r] = count;
}

void size_list(int batch, int heads, int rows, int cols, BlockList* l) {
  l->num_blocks.assign(list_rows(batch, heads, rows), 0);
  l->indices.assign(list_rows(batch, heads, rows) * cols, 0);
}

BlockList transpose(const BlockList& forward, int mask_rows, int rows, int cols) {
  BlockList t;
  size_list(mask_rows, 1, cols, rows, &t);
  for (int r = 0; r < mask_rows; ++r)
    for (int row = 0; row < rows; ++row) {
      const ListRow listed = row_of_list(forward, r, row, rows, cols);
      // Rows are visited ascending, so every transposed row comes out sorted.
      for (const int32_t* col = listed.begin; col != listed.end; ++col) {
        const size_t out_row = static_cast<size_t>(r) * cols + *col;
        t.indices[out_row * rows + t.num_blocks[out_row]++] = row;
      }
    }
  return t;
}

// The kinds come from one block's elements inside the sequence: none visible, all, or some.
TileKind classify_block(const ElementPredicate& visible, int b, int h, int64_t r0, int64_t r1, int64_t c0,
                        int64_t c1) {
  bool any_visible = false, any_masked = false;
  for (int64_t i = r0; i < r1; ++i)
    for (int64_t j = c0; j < c1; ++j) {
      (visible(b, h, i, j) ? any_visible : any_masked) = true;
      if (any_visible && any_masked) return TileKind::kPartial;
    }
  return any_visible ? TileKind::kFull : TileKind::kEmpty;
}

detail::BlockMaskProblem problem_of(const BlockMaskGeometry& g) { return {g.batch, g.heads, g.seqlen_q, g.seqlen_k}; }

Status check_geometry(const BlockMaskGeometry& g) {
  if (g.batch < 1) return Status::InvalidArgument("batch", "must be >= 1, got " + std::to_string(g.batch));
  if (g.heads < 1) return Status::InvalidArgument("heads", "must be >= 1, got " + std::to_string(g.heads));
  if (g.seqlen_q < 1) return Status::InvalidArgument("seqlen_q", "must be >= 1, got " + std::to_string(g.seqlen_q));
  if (g.seqlen_k < 1) return Status::InvalidArgument("seqlen_k", "must be >= 1, got " + std::to_string(g.seqlen_k));
  for (const auto& [size, name] : {std::pair{g.q_block_size, "q_block_size"}, {g.kv_block_size, "kv_block_size"}})
    if (size <= 0 || size % detail::kBlockSizeGranularity != 0)
      return Status::InvalidArgument(name, "must be a positive multiple of " +
                                               std::to_string(detail::kBlockSizeGranularity) + " (the MMA tile edge), got " +
                                               std::to_string(size));
  return Status::Ok();
}

// Inside every partial block the kernels evaluate `element`, so it must agree with `visible`.
Status check_partial_blocks_agree(const ElementPredicate& visible, const ElementMask& element,
                                  const BlockMaskGeometry& g, const BlockKindGrid& kinds) {
  for (int b = 0; b < g.batch; ++b)
    for (int h = 0; h < g.heads; ++h)
      for (int m = 0; m < kinds.num_q_blocks; ++m)
        for (int n = 0; n < kinds.num_kv_blocks; ++n) {
          if (kinds.at(b, h, m, n) != TileKind::kPartial) continue;
          const int64_t r1 = std::min<int64_t>(g.seqlen_q, int64_t{m + 1} * g.q_block_size);
          const int64_t c1 = std::min<int64_t>(g.seqlen_k, int64_t{n + 1} * g.kv_block_size);
          for (int64_t i = int64_t{m} * g.q_block_size; i < r1; ++i)
            for (int64_t j = int64_t{n} * g.kv_block_size; j < c1; ++j)
              if (visible(b, h, i, j) != element_mask_visible(element, b, h, i, j))
                return Status::InvalidArgument(
                    "element", "differs from the predicate at (b=" + std::to_string(b) + ", h=" + std::to_string(h) +
                                   ", q=" + std::to_string(i) + ", kv=" + std::to_string(j) + ") in partial block (" +
                                   std::to_string(m) + ", " + std::to_string(n) + "): the kernels evaluate it there");
        }
  return Status::Ok();
}

// Reads one list of a user's mask into [batch, heads, rows, cols] storage, broadcasting.
BlockList copy_list(const TensorView& counts, const TensorView& indices, int batch, int heads, int rows, int cols) {
  BlockList l;
  size_list(batch, heads, rows, cols, &l);
  if (!counts.defined()) return l;  // an absent optional list lists nothing
  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < heads; ++h) {
      const int64_t cb = counts.shape[0] == 1 ? 0 : b, ch = counts.shape[1] == 1 ? 0 : h;
      const int64_t ib = indices.shape[0] == 1 ? 0 : b, ih = indices.shape[1] == 1 ? 0 : h;
      for (int row = 0; row < rows; ++row) {
        const size_t r = (static_cast<size_t>(b) * heads + h) * rows + row;
        l.num_blocks[r] = load_int32(counts, cb * counts.stride[0] + ch * counts.stride[1] + row * counts.stride[2]);
        for (int k = 0; k < l.num_blocks[r]; ++k)
          l.indices[r * cols + k] = load_int32(indices, ib * indices.stride[0] + ih * indices.stride[1] +
                                                            row * indices.stride[2] + k * indices.stride[3]);
      }
    }
  return l;
}

// The largest batch (dim 0) or head (dim 1) size among the given lists: 1 or the problem's.
int covered_dim(const BlockMask& m, int dim) {
  int64_t size = 1;
  for (const TensorView* t : {&m.kv_num_blocks, &m.full_kv_num_blocks, &m.q_num_blocks, &m.full_q_num_blocks})
    if (t->defined()) size = std::max(size, t->shape[dim]);
  return static_cast<int>(size);
}

}  // namespace

BlockKindGrid BlockKindGrid::all_empty(int batch, int heads, int num_q_blocks, int num_kv_blocks) {
  BlockKindGrid g;
  g.batch = batch, g.heads = heads, g.num_q_blocks = num_q_blocks, g.num_kv_blocks = num_kv_blocks;
  g.kinds.assign(list_rows(batch, heads, num_q_blocks) * num_kv_blocks, TileKind::kEmpty);
  return g;
}

TileKind HostBlockMask::kind(int b, int h, int m, int n) const {
  const int r = row_of(b, h);
  if (row_contains(row_of_list(full_kv, r, m, num_q_blocks, num_kv_blocks), n)) return TileKind::kFull;
  if (row_contains(row_of_list(partial_kv, r, m, num_q_blocks, num_kv_blocks), n)) return TileKind::kPartial;
  return TileKind::kEmpty;
}

void HostBlockMask::q_blocks_of(int b, int h, int n, std::vector<int32_t>* q_blocks,
                                std::vector<int32_t>* is_full) const {
  const int r = row_of(b, h);
  ListRow partial = row_of_list(partial_q, r, n, num_kv_blocks, num_q_blocks);
  ListRow full = row_of_list(full_q, r, n, num_kv_blocks, num_q_blocks);
  q_blocks->clear();
  is_full->clear();
  while (partial.begin != partial.end || full.begin != full.end) {
    const bool take_full = partial.begin == partial.end || (full.begin != full.end && *full.begin < *partial.begin);
    q_blocks->push_back(take_full ? *full.begin++ : *partial.begin++);
    is_full->push_back(take_full);
  }
}

BlockMask HostBlockMask::view() const {
  BlockMask m;
  m.q_block_size = q_block_size;
  m.kv_block_size = kv_block_size;
  m.kv_num_blocks = cpu_view(partial_kv.num_blocks, {batch, heads, num_q_blocks});
  m.kv_indices = cpu_view(partial_kv.indices, {batch, heads, num_q_blocks, num_kv_blocks});
  m.full_kv_num_blocks = cpu_view(full_kv.num_blocks, {batch, heads, num_q_blocks});
  m.full_kv_indices = cpu_view(full_kv.indices, {batch, heads, num_q_blocks, num_kv_blocks});
  m.q_num_blocks = cpu_view(partial_q.num_blocks, {batch, heads, num_kv_blocks});
  m.q_indices = cpu_view(partial_q.indices, {batch, heads, num_kv_blocks, num_q_blocks});
  m.full_q_num_blocks = cpu_view(full_q.num_blocks, {batch, heads, num_kv_blocks});
  m.full_q_indices = cpu_view(full_q.indices, {batch, heads, num_kv_blocks, num_q_blocks});
  m.element = element;
  return m;
}

bool element_mask_visible(const ElementMask& e, int b, int h, int64_t q_idx, int64_t kv_idx) {
  if (e.causal && kv_idx > q_idx) return false;
  if (e.window_left >= 0 && q_idx - kv_idx > e.window_left) return false;
  if (e.window_right >= 0 && kv_idx - q_idx > e.window_right) return false;
  if (e.prefix_length >= 0 && kv_idx >= e.prefix_length && kv_idx > q_idx) return false;
  if (e.doc_ids_q.defined()) {
    const int32_t doc_q = load_int32(e.doc_ids_q, b * e.doc_ids_q.stride[0] + q_idx * e.doc_ids_q.stride[1]);
    const int32_t doc_k = load_int32(e.doc_ids_k, b * e.doc_ids_k.stride[0] + kv_idx * e.doc_ids_k.stride[1]);
    if (doc_q != doc_k) return false;
  }
  if (e.bits.defined()) {
    const TensorView& t = e.bits;
    const int64_t bb = t.shape[0] == 1 ? 0 : b, hh = t.shape[1] == 1 ? 0 : h;
    const uint32_t word = static_cast<const uint32_t*>(t.data)[bb * t.stride[0] + hh * t.stride[1] +
                                                               q_idx * t.stride[2] + (kv_idx / 32) * t.stride[3]];
    if (((word >> (kv_idx % 32)) & 1u) == 0) return false;
  }
  return true;
}

BlockKindGrid classify_blocks(const ElementPredicate& visible, const BlockMaskGeometry& g) {
  BlockKindGrid kinds = BlockKindGrid::all_empty(g.batch, g.heads, g.num_q_blocks(), g.num_kv_blocks());
  for (int b = 0; b < g.batch; ++b)
    for (int h = 0; h < g.heads; ++h)
      for (int m = 0; m < kinds.num_q_blocks; ++m)
        for (int n = 0; n < kinds.num_kv_blocks; ++n) {
          const int64_t r0 = int64_t{m} * g.q_block_size, c0 = int64_t{n} * g.kv_block_size;
          kinds.at(b, h, m, n) = classify_block(visible, b, h, r0, std::min<int64_t>(g.seqlen_q, r0 + g.q_block_size),
                                                c0, std::min<int64_t>(g.seqlen_k, c0 + g.kv_block_size));
        }
  return kinds;
}

Status build_from_kinds(const BlockKindGrid& kinds, const BlockMaskGeometry& g, const ElementMask& element,
                        HostBlockMask* out) {
  FLARE_RETURN_IF_ERROR(check_geometry(g));
  if (kinds.batch != g.batch || kinds.heads != g.heads || kinds.num_q_blocks != g.num_q_blocks() ||
      kinds.num_kv_blocks != g.num_kv_blocks() || kinds.kinds.size() != list_rows(g.batch, g.heads, g.num_q_blocks()) * g.num_kv_blocks())
    return Status::InvalidArgument("kinds", "dims [" + std::to_string(kinds.batch) + ", " + std::to_string(kinds.heads) +
                                                ", " + std::to_string(kinds.num_q_blocks) + ", " +
                                                std::to_string(kinds.num_kv_blocks) + "] do not match the geometry's [" +
                                                std::to_string(g.batch) + ", " + std::to_string(g.heads) + ", " +
                                                std::to_string(g.num_q_blocks()) + ", " +
                                                std::to_string(g.num_kv_blocks()) + "] (or the kind vector's size)");
  HostBlockMask mask;
  mask.batch = g.batch, mask.heads = g.heads;
  mask.num_q_blocks = g.num_q_blocks(), mask.num_kv_blocks = g.num_kv_blocks();
  mask.q_block_size = g.q_block_size, mask.kv_block_size = g.kv_block_size;
  mask.element = element;
  size_list(g.batch, g.heads, mask.num_q_blocks, mask.num_kv_blocks, &mask.partial_kv);
  size_list(g.batch, g.heads, mask.num_q_blocks, mask.num_kv_blocks, &mask.full_kv);
  for (int b = 0; b < g.batch; ++b)
    for (int h = 0; h < g.heads; ++h)
      for (int m = 0; m < mask.num_q_blocks; ++m) {
        append_list_rows(kinds, b, h, m, TileKind::kPartial, &mask.partial_kv);
        append_list_rows(kinds, b, h, m, TileKind::kFull, &mask.full_kv);
      }
  fill_transposed_lists(&mask);
  *out = std::move(mask);
  return Status::Ok();
}

Status build_from_element_mask(const ElementMask& element, const BlockMaskGeometry& g, HostBlockMask* out) {
  FLARE_RETURN_IF_ERROR(check_geometry(g));
  FLARE_RETURN_IF_ERROR(detail::validate_element_mask(element, problem_of(g), DeviceKind::kCPU));
  const ElementPredicate visible = [&element](int b, int h, int64_t i, int64_t j) {
    return element_mask_visible(element, b, h, i, j);
  };
  return build_from_kinds(classify_blocks(visible, g), g, element, out);
}

Status build_from_predicate(const ElementPredicate& visible, const ElementMask& partial_element,
                            const BlockMaskGeometry& g, HostBlockMask* out) {
  FLARE_RETURN_IF_ERROR(check_geometry(g));
  FLARE_RETURN_IF_ERROR(detail::validate_element_mask(partial_element, problem_of(g), DeviceKind::kCPU));
  const BlockKindGrid kinds = classify_blocks(visible, g);
  FLARE_RETURN_IF_ERROR(check_partial_blocks_agree(visible, partial_element, g, kinds));
  return build_from_kinds(kinds, g, partial_element, out);
}

void fill_transposed_lists(HostBlockMask* mask) {
  const int mask_rows = mask->batch * mask->heads;
  mask->partial_q = transpose(mask->partial_kv, mask_rows, mask->num_q_blocks, mask->num_kv_blocks);
  mask->full_q = transpose(mask->full_kv, mask_rows, mask->num_q_blocks, mask->num_kv_blocks);
}

Status copy_block_mask(const BlockMask& views, const detail::BlockMaskProblem& problem, HostBlockMask* out) {
  detail::BlockMaskShape shape;
  FLARE_RETURN_IF_ERROR(detail::validate_block_mask(views, problem, DeviceKind::kCPU, &shape));
  HostBlockMask mask;
  mask.batch = covered_dim(views, 0), mask.heads = covered_dim(views, 1);
  mask.num_q_blocks = shape.num_q_blocks, mask.num_kv_blocks = shape.num_kv_blocks;
  mask.q_block_size = views.q_block_size, mask.kv_block_size = views.kv_block_size;
  mask.element = views.element;  // still the caller's tensors
  mask.partial_kv = copy_list(views.kv_num_blocks, views.kv_indices, mask.batch, mask.heads, mask.num_q_blocks,
                              mask.num_kv_blocks);
  mask.full_kv = copy_list(views.full_kv_num_blocks, views.full_kv_indices, mask.batch, mask.heads,
                           mask.num_q_blocks, mask.num_kv_blocks);
  // Given transposed lists were validated equal to these.
  fill_transposed_lists(&mask);
  *out = std::move(mask);
  return Status::Ok();
}

}  // namespace flare::block_sparse
