// The block-sparse forward's CTA order on the device (sched::SparseOrder, sparse_order.h): a
// kernel of one CTA per L2 group that sorts the group's tiles by the length of their list rows,
// longest first, stably; the forward then launches a 1-D grid whose CTA i runs order[i].
#pragma once

#include <cuda_runtime.h>

#include "flare/status.h"
#include "src/block_sparse/block_sparse_params.h"
#include "src/scheduling/sparse_order.h"

namespace flare::block_sparse {

// Writes o.num_tiles() encoded tiles (SparseOrder::encode) to `order` on `stream`. A tile's
// rows are `tile_rows` (the kernel's q tile); its list row is the mask's q block holding them.
Status launch_sparse_forward_order(const sched::SparseOrder& o, const BlockSparseParams& bs, int tile_rows,
                                   int* order, cudaStream_t stream);

}  // namespace flare::block_sparse
