// The block-sparse forward's CTA order on the device (sched::SparseOrder, sparse_order.h): a
// kernel of one CTA per L2 group that sorts the group's tiles by the length of their list rows,
// longest first, stably; the forward then launches a 1-D grid whose CTA i runs order[i] (and
// issues that tile's first K and V before its list row is expanded).
#pragma once

#include <cuda_runtime.h>

#include "flare/status.h"
#include "src/block_sparse/block_sparse_params.h"
#include "src/scheduling/sparse_order.h"

namespace flare::block_sparse {

// Writes o.num_tiles() records to `order` on `stream`: {the encoded tile (SparseOrder::encode), its
// list row's first key tile of kv_tile keys (hopper::first_sparse_tile: index | PARTIAL flag, or -1)}.
// A tile's rows are `tile_rows` (the kernel's q tile); its list row is the mask's q block holding them.
// `counter` (or null): the persistent forward's two counters (tiles claimed, tiles done), zeroed by
// the kernel.
Status launch_sparse_forward_order(const sched::SparseOrder& o, const BlockSparseParams& bs, int tile_rows,
                                   int kv_tile, int seqlen_k, int2* order, int* counter, cudaStream_t stream);

}  // namespace flare::block_sparse
