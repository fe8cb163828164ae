// The run of one value in sorted ids, by binary search: a documents mask's row span
// (doc_spans.h) on the device, tested on the CPU against a linear scan.
#pragma once

#include <cstdint>

#include "src/scheduling/mask_math.h"  // FLARE_HD

namespace flare::block_sparse {

// The half-open run [lo, hi) of `value` in ids[0], ids[stride], ..., ids[(n - 1) stride], which must
// be sorted (non-decreasing); lo == hi (the insertion point) when the value is absent.
struct IdRun {
  int lo = 0, hi = 0;
};
FLARE_HD IdRun sorted_run(const int32_t* ids, int64_t stride, int n, int32_t value) {
  int lo = 0, hi = n;  // first index with ids >= value
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (ids[mid * stride] < value) lo = mid + 1; else hi = mid;
  }
  int lo2 = lo, hi2 = n;  // first index with ids > value
  while (lo2 < hi2) {
    const int mid = lo2 + (hi2 - lo2) / 2;
    if (ids[mid * stride] <= value) lo2 = mid + 1; else hi2 = mid;
  }
  return IdRun{lo, lo2};
}

}  // namespace flare::block_sparse
