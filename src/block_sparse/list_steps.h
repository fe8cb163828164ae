// A block mask's list row walked in kernel steps, by index: the Hopper block-sparse backward's
// query steps (a kv block's transposed lists, or the deterministic plan's walk of it,
// dq_write_order.h; q blocks cut into 64-row steps). Its producer, its
// consumers and its dQ writers each visit the steps with their own stride, so a step is found by
// its index rather than by walking (sparse_block_walk.h walks instead).
//
// Step i is sub-block i % subs of the list's entry i / subs: the row's PARTIAL blocks first (their
// steps carry the element predicate), then its FULL ones; a planned walk lists its blocks in walk
// order with a flag per entry for the full ones. Entries are device values, not
// validated: a step of an entry out of [0, num_blocks), or past the sequence, is not `valid`
// (the kernel computes it fully masked and adds nothing) and names block 0, so that its loads
// stay inside the operands.
#pragma once

#include <cstdint>

#include "src/block_sparse/block_sparse_params.h"

namespace flare::block_sparse {

struct ListStep {
  int m = 0;             // the step's block of step_rows rows (or keys)
  bool valid = true;     // false: computed fully masked, its contributions not added
  bool element = false;  // a partial block's step: the element predicate applies
};

// A list entry: through the read-only path on the device (the lists do not change during a kernel).
FLARE_HD int32_t list_entry(const int32_t* p) {
#ifdef __CUDA_ARCH__
  return __ldg(p);
#else
  return *p;
#endif
}

struct ListSteps {
  const int32_t* partial = nullptr;     // a planned walk: every block, in walk order
  const int32_t* full = nullptr;
  const int32_t* full_flags = nullptr;  // a planned walk: nonzero for its full blocks; null for lists
  int num_partial = 0, num_listed = 0;
  int subs = 1;        // steps per listed block
  int num_blocks = 0;  // blocks of the mask on the listed side
  int num_m = 0;       // steps that fit the sequence: ceil(seqlen / step_rows)

  FLARE_HD int count() const { return num_listed * subs; }
  FLARE_HD ListStep at(int step) const {
    ListStep s;
    const int pos = step / subs;
    const int block = pos < num_partial ? list_entry(partial + pos) : list_entry(full + pos - num_partial);
    s.m = block * subs + step % subs;
    s.valid = block >= 0 && block < num_blocks && s.m < num_m;
    s.element = full_flags != nullptr ? list_entry(full_flags + pos) == 0 : pos < num_partial;
    if (!s.valid) s.m = 0;
    return s;
  }
};

// Row `row` of the lists (partial, full) of (b, h), whose blocks are block_size long on a side of
// `seqlen`, in steps of step_rows (block_size must be a multiple of it: the launcher checks).
FLARE_HD ListSteps list_steps(const BlockListParams& partial, const BlockListParams& full, int b, int h, int row,
                              int block_size, int num_blocks, int seqlen, int step_rows) {
  ListSteps s;
  s.num_partial = partial.count(b, h, row, num_blocks);
  s.num_listed = s.num_partial + full.count(b, h, row, num_blocks);
  s.partial = partial.counts ? partial.row(b, h, row) : nullptr;
  s.full = full.counts ? full.row(b, h, row) : nullptr;
  s.subs = block_size / step_rows;
  s.num_blocks = num_blocks;
  s.num_m = (seqlen + step_rows - 1) / step_rows;
  return s;
}

// A planned walk (DqPlanView's steps [begin, begin + count): blocks[i], full when is_full[i] != 0).
FLARE_HD ListSteps planned_list_steps(const int32_t* blocks, const int32_t* is_full, int count, int block_size,
                                      int num_blocks, int seqlen, int step_rows) {
  ListSteps s;
  s.partial = blocks;
  s.full_flags = is_full;
  s.num_partial = s.num_listed = count;
  s.subs = block_size / step_rows;
  s.num_blocks = num_blocks;
  s.num_m = (seqlen + step_rows - 1) / step_rows;
  return s;
}

}  // namespace flare::block_sparse
