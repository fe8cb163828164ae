// The block-sparse forward's CTA order (sparse_fwd_order.h): per L2 group, a counting sort of the
// tiles by list-row length (descending buckets), stable: each warp of a chunk of tiles takes its
// places in turn, and inside a warp a tile's place among its bucket's peers is its lane rank.
#include "src/block_sparse/sparse_fwd_order.h"

#include <cub/block/block_scan.cuh>

#include "src/attention/hopper/sparse_tiles.h"
#include "src/common/cuda_check.h"
#include "src/common/grid_dependency.h"

namespace flare::block_sparse {
namespace {

constexpr int kThreads = 1024;
static_assert(sched::kSparseOrderBuckets == 2 * kThreads, "two buckets a thread in the scan");

// Tile i of group g's list row (its q block's).
__device__ __forceinline__ hopper::SparseListRow tile_list_row(const sched::SparseOrder& o, const BlockSparseParams& bs,
                                                               int tile_rows, int g, int i) {
  const sched::TileCoord c = o.group_tile(g, i);
  return hopper::sparse_list_row(bs, c.batch, c.head, c.block * tile_rows / bs.q_block_size);
}

__global__ void __launch_bounds__(kThreads)
    sparse_forward_order_kernel(sched::SparseOrder o, BlockSparseParams bs, int tile_rows, int kv_tile, int seqlen_k,
                                int2* order, int* counter) {
  device::allow_dependent_launch();  // the forward starts its setup under this kernel and waits for it
  if (counter != nullptr && blockIdx.x == 0 && threadIdx.x < 2) counter[threadIdx.x] = 0;
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ int place[sched::kSparseOrderBuckets];  // a bucket's count, then its next place
  __shared__ typename Scan::TempStorage scan;
  const int g = blockIdx.x, n = o.group_tiles(g), t = threadIdx.x;
  const int lane = t % 32, warp = t / 32;
  for (int k = t; k < sched::kSparseOrderBuckets; k += kThreads) place[k] = 0;
  __syncthreads();
  for (int i = t; i < n; i += kThreads)
    atomicAdd(&place[sched::sparse_order_bucket(tile_list_row(o, bs, tile_rows, g, i).num_listed)], 1);
  __syncthreads();
  // Places in descending bucket order: thread t holds buckets B-1-2t and B-2-2t.
  const int hi = sched::kSparseOrderBuckets - 1 - 2 * t;
  int counts[2] = {place[hi], place[hi - 1]};
  __syncthreads();
  Scan(scan).ExclusiveSum(counts, counts);
  place[hi] = counts[0], place[hi - 1] = counts[1];
  __syncthreads();
  int2* const out = order + o.group_first_tile(g);
  for (int base = 0; base < n; base += kThreads) {
    const int i = base + t;
    const bool valid = i < n;
    const hopper::SparseListRow row = valid ? tile_list_row(o, bs, tile_rows, g, i) : hopper::SparseListRow{};
    const int bucket = valid ? sched::sparse_order_bucket(row.num_listed) : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, bucket);
    const int leader = __ffs(peers) - 1;
    const int rank = __popc(peers & ((1u << lane) - 1u));
    int first = 0;
    for (int w = 0; w < kThreads / 32; ++w) {  // warps in turn: lower tiles take lower places
      if (w == warp && valid && lane == leader) first = atomicAdd(&place[bucket], __popc(peers));
      __syncthreads();
    }
    first = __shfl_sync(0xffffffffu, first, leader);
    if (valid) out[first + rank] = make_int2(o.encode(o.group_tile(g, i)), hopper::first_sparse_tile(bs, row, seqlen_k, kv_tile));
  }
}

}  // namespace

Status launch_sparse_forward_order(const sched::SparseOrder& o, const BlockSparseParams& bs, int tile_rows,
                                   int kv_tile, int seqlen_k, int2* order, int* counter, cudaStream_t stream) {
  if (order == nullptr) return Status::InvalidArgument("order", "null pointer");
  if (o.num_tiles() <= 0) return Status::Ok();
  sparse_forward_order_kernel<<<o.num_groups(), kThreads, 0, stream>>>(o, bs, tile_rows, kv_tile, seqlen_k, order,
                                                                        counter);
  return detail::cuda_status(cudaGetLastError(), "block-sparse forward order");
}

}  // namespace flare::block_sparse
