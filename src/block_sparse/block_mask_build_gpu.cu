// The GPU builder of block-sparse masks (include/flare/block_mask.h), three kernels in stream
// order, no scratch memory:
//   classify   one CTA per (b, h, q block, kv block): the block's kind, written into
//              kv_indices[b, h, m, n] (the kind matrix has exactly that shape)
//   transpose  one warp per (b, h, kv block): reads the kinds down the column, writes the
//              q_* lists (skipped when they are not asked for)
//   compact    one warp per (b, h, q block): reads the kinds along the row and compacts them in
//              place into kv_indices and into full_kv_indices
// The host builder (block_mask_build.h) is its oracle; tests/gpu/test_block_sparse.cu checks
// them equal.
#include <cuda_runtime.h>

#include <string>

#include "flare/block_mask.h"
#include "src/block_sparse/block_mask_args.h"
#include "src/block_sparse/block_sparse_params.h"
#include "src/common/cuda_check.h"

namespace flare {
namespace {

using block_sparse::ColumnInterval;
using block_sparse::ElementMaskParams;

constexpr int kClassifyThreads = 128;
constexpr int32_t kEmpty = static_cast<int32_t>(sched::TileKind::kEmpty);
constexpr int32_t kPartial = static_cast<int32_t>(sched::TileKind::kPartial);
constexpr int32_t kFull = static_cast<int32_t>(sched::TileKind::kFull);

// A list to write: counts [B, H, rows], indices [B, H, rows, cols] (strides in elements).
struct ListOut {
  int32_t* counts = nullptr;
  int32_t* indices = nullptr;
  int64_t counts_batch = 0, counts_head = 0, counts_row = 0;
  int64_t indices_batch = 0, indices_head = 0, indices_row = 0;

  __device__ int32_t* row(int b, int h, int r) const {
    return indices + b * indices_batch + h * indices_head + r * indices_row;
  }
  __device__ int32_t& count(int b, int h, int r) const {
    return counts[b * counts_batch + h * counts_head + r * counts_row];
  }
};

struct BuildGeometry {
  int batch, heads, seqlen_q, seqlen_k;
  int q_block_size, kv_block_size, num_q_blocks, num_kv_blocks;
};

// The kind of block (m, n) of mask row (b, h): rows are spread over the threads; a row's
// structural interval decides most elements at once, lookups go element by element and stop
// once the row has shown both a visible and a masked element.
__global__ void __launch_bounds__(kClassifyThreads)
    classify_blocks_kernel(BuildGeometry geo, ElementMaskParams el, ListOut kinds) {
  const int bh = blockIdx.x, m = blockIdx.y, n = blockIdx.z;
  const int b = bh / geo.heads, h = bh % geo.heads;
  const int r0 = m * geo.q_block_size, r1 = min(r0 + geo.q_block_size, geo.seqlen_q);
  const int c0 = n * geo.kv_block_size, c1 = min(c0 + geo.kv_block_size, geo.seqlen_k);
  bool any_visible = false, any_masked = false;
  const bool lookups = el.has_lookups();
  for (int i = r0 + static_cast<int>(threadIdx.x); i < r1; i += kClassifyThreads) {
    ColumnInterval in = el.row_interval(i);
    const int64_t lo = in.lo > c0 ? in.lo : c0, hi = in.hi < c1 - 1 ? in.hi : c1 - 1;
    if (lo > c0 || hi < c1 - 1) any_masked = true;  // the interval leaves some column out
    if (lo > hi) continue;
    if (!lookups) {
      any_visible = true;
      continue;
    }
    const int32_t row_doc = el.doc_q ? el.doc_of_row(b, i) : 0;
    const uint32_t* row_bits = el.bits ? el.bits_row_ptr(b, h, i) : nullptr;
    for (int64_t j = lo; j <= hi && !(any_visible && any_masked); ++j)
      (el.lookups_visible(b, row_doc, row_bits, j) ? any_visible : any_masked) = true;
  }
  any_visible = __syncthreads_or(any_visible);
  any_masked = __syncthreads_or(any_masked);
  if (threadIdx.x == 0) kinds.row(b, h, m)[n] = any_visible ? (any_masked ? kPartial : kFull) : kEmpty;
}

// Appends, in ascending order, the positions whose `kind` matches to `out_row` (32 at a time:
// a ballot and a prefix count), returns the count. Every lane holds the chunk's value before
// any lane writes, so the output may overwrite the input row in place (out position <= input).
template <typename Load>
__device__ int compact_row(int length, Load load, int32_t kind, int32_t* out_row) {
  const int lane = threadIdx.x % 32;
  int count = 0;
  for (int base = 0; base < length; base += 32) {
    const int pos = base + lane;
    const int32_t k = pos < length ? load(pos) : -1;
    __syncwarp();
    const unsigned hit = __ballot_sync(0xffffffffu, k == kind);
    if (k == kind) out_row[count + __popc(hit & ((1u << lane) - 1u))] = pos;
    count += __popc(hit);
  }
  return count;
}

__device__ void zero_tail(int32_t* row, int from, int length) {
  for (int pos = from + static_cast<int>(threadIdx.x % 32); pos < length; pos += 32) row[pos] = 0;
}

// One warp per (b, h, kv block n): the q blocks whose row lists n, partial and full.
__global__ void __launch_bounds__(32) transpose_kinds_kernel(BuildGeometry geo, ListOut kinds, ListOut partial_q,
                                                             ListOut full_q) {
  const int bh = blockIdx.x, n = blockIdx.y;
  const int b = bh / geo.heads, h = bh % geo.heads;
  auto load = [&](int m) { return kinds.row(b, h, m)[n]; };
  int32_t* p_row = partial_q.row(b, h, n);
  int32_t* f_row = full_q.row(b, h, n);
  const int np = compact_row(geo.num_q_blocks, load, kPartial, p_row);
  const int nf = compact_row(geo.num_q_blocks, load, kFull, f_row);
  __syncwarp();
  zero_tail(p_row, np, geo.num_q_blocks);
  zero_tail(f_row, nf, geo.num_q_blocks);
  if (threadIdx.x == 0) {
    partial_q.count(b, h, n) = np;
    full_q.count(b, h, n) = nf;
  }
}

// One warp per (b, h, q block m): the row of kinds becomes the partial list in place and the
// full list beside it. The full list is taken first, while the row still holds every kind.
__global__ void __launch_bounds__(32) compact_rows_kernel(BuildGeometry geo, ListOut partial_kv, ListOut full_kv) {
  const int bh = blockIdx.x, m = blockIdx.y;
  const int b = bh / geo.heads, h = bh % geo.heads;
  int32_t* row = partial_kv.row(b, h, m);
  int32_t* f_row = full_kv.row(b, h, m);
  auto load = [&](int n) { return row[n]; };
  const int nf = compact_row(geo.num_kv_blocks, load, kFull, f_row);
  __syncwarp();
  const int np = compact_row(geo.num_kv_blocks, load, kPartial, row);
  __syncwarp();
  zero_tail(row, np, geo.num_kv_blocks);
  zero_tail(f_row, nf, geo.num_kv_blocks);
  if (threadIdx.x == 0) {
    partial_kv.count(b, h, m) = np;
    full_kv.count(b, h, m) = nf;
  }
}

ListOut list_out(const TensorView& counts, const TensorView& indices) {
  ListOut l;
  l.counts = counts.ptr<int32_t>();
  l.indices = indices.ptr<int32_t>();
  l.counts_batch = counts.stride[0];
  l.counts_head = counts.stride[1];
  l.counts_row = counts.stride[2];
  l.indices_batch = indices.stride[0];
  l.indices_head = indices.stride[1];
  l.indices_row = indices.stride[2];
  return l;
}

Status check_positive(int value, const char* name) {
  if (value < 1) return Status::InvalidArgument(name, "must be >= 1, got " + std::to_string(value));
  return Status::Ok();
}

// The outputs have the mask's own dims: no broadcast on what is written.
Status check_output_dims(const TensorView& t, const char* name, int batch, int heads) {
  if (t.shape[0] != batch || t.shape[1] != heads)
    return Status::InvalidArgument(name, "batch and head dims must be the mask's (" + std::to_string(batch) + ", " +
                                             std::to_string(heads) + "), got (" + std::to_string(t.shape[0]) + ", " +
                                             std::to_string(t.shape[1]) + ")");
  return Status::Ok();
}

}  // namespace

Status build_block_mask(const BlockMaskBuildParams& p, BlockMask* mask) {
  if (mask == nullptr) return Status::InvalidArgument("mask", "null pointer");
  FLARE_RETURN_IF_ERROR(check_positive(p.batch, "batch"));
  FLARE_RETURN_IF_ERROR(check_positive(p.heads, "heads"));
  FLARE_RETURN_IF_ERROR(check_positive(p.seqlen_q, "seqlen_q"));
  FLARE_RETURN_IF_ERROR(check_positive(p.seqlen_k, "seqlen_k"));
  BlockMask out = *mask;
  out.q_block_size = p.q_block_size;
  out.kv_block_size = p.kv_block_size;
  out.element = p.element;
  if (!out.full_kv_num_blocks.defined()) return Status::InvalidArgument("full_kv_num_blocks", "required (an output)");
  if (!out.full_kv_indices.defined()) return Status::InvalidArgument("full_kv_indices", "required (an output)");
  const detail::BlockMaskProblem problem{p.batch, p.heads, p.seqlen_q, p.seqlen_k};
  detail::BlockMaskShape shape;
  // Layout rules (and the element mask's); a CUDA mask's values are not read.
  FLARE_RETURN_IF_ERROR(detail::validate_block_mask(out, problem, DeviceKind::kCUDA, &shape));
  const bool transposed = shape.has_transposed_lists;
  for (const auto& [t, name] :
       {std::pair{&out.kv_num_blocks, "kv_num_blocks"}, {&out.kv_indices, "kv_indices"},
        {&out.full_kv_num_blocks, "full_kv_num_blocks"}, {&out.full_kv_indices, "full_kv_indices"},
        {&out.q_num_blocks, "q_num_blocks"}, {&out.q_indices, "q_indices"},
        {&out.full_q_num_blocks, "full_q_num_blocks"}, {&out.full_q_indices, "full_q_indices"}})
    if (t->defined()) FLARE_RETURN_IF_ERROR(check_output_dims(*t, name, p.batch, p.heads));
  const long long rows = static_cast<long long>(p.batch) * p.heads;
  if (rows > 0x7fffffffLL) return Status::InvalidArgument("batch", "batch * heads exceeds 2^31 - 1");

  const BuildGeometry geo{p.batch, p.heads, p.seqlen_q, p.seqlen_k,
                          p.q_block_size, p.kv_block_size, shape.num_q_blocks, shape.num_kv_blocks};
  if (geo.num_q_blocks > 65535 || geo.num_kv_blocks > 65535)
    return Status::NotSupported("block counts above 65535 (grid dims)");
  const ElementMaskParams el = block_sparse::make_element_mask_params(p.element);
  const ListOut partial_kv = list_out(out.kv_num_blocks, out.kv_indices);
  const ListOut full_kv = list_out(out.full_kv_num_blocks, out.full_kv_indices);
  cudaStream_t stream = p.stream;

  classify_blocks_kernel<<<dim3(static_cast<unsigned>(rows), geo.num_q_blocks, geo.num_kv_blocks), kClassifyThreads, 0,
                           stream>>>(geo, el, partial_kv);
  FLARE_RETURN_IF_ERROR(detail::cuda_status(cudaGetLastError(), "block mask build: classify launch"));
  if (transposed) {
    transpose_kinds_kernel<<<dim3(static_cast<unsigned>(rows), geo.num_kv_blocks), 32, 0, stream>>>(
        geo, partial_kv, list_out(out.q_num_blocks, out.q_indices), list_out(out.full_q_num_blocks, out.full_q_indices));
    FLARE_RETURN_IF_ERROR(detail::cuda_status(cudaGetLastError(), "block mask build: transpose launch"));
  }
  compact_rows_kernel<<<dim3(static_cast<unsigned>(rows), geo.num_q_blocks), 32, 0, stream>>>(geo, partial_kv,
                                                                                             full_kv);
  FLARE_RETURN_IF_ERROR(detail::cuda_status(cudaGetLastError(), "block mask build: compact launch"));
  *mask = out;
  return Status::Ok();
}

}  // namespace flare
