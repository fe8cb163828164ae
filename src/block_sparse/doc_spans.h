// A documents mask's rows as key intervals. When a batch entry's key document ids are sorted
// (non-decreasing: documents packed one after another, the usual case), the keys of any one id
// are a single run, so row i sees exactly the keys [lo, hi) of its id's run. The Hopper forward
// then narrows a partial tile's rows to their spans, as it does for causal's diagonal, instead of
// looking up and comparing every key's id (element_lookups.h): a documents partial step cost about
// 1,700 cycles more than a full one (bench/RESULTS.md, session 45).
//
// Spans are redundant with the ids: they are computed on the device before each forward
// (launch_doc_spans), never supplied by the caller, and a batch entry whose key ids are not sorted
// gets the marker {-1, -1} in every row, which sends the kernel back to the lookups.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "flare/status.h"
#include "src/block_sparse/block_sparse_params.h"
#include "src/block_sparse/sorted_run.h"

namespace flare::block_sparse {

// The marker of a batch entry whose key ids are not sorted: its rows have no span.
inline constexpr int kNoDocSpan = -1;

// Bytes of the spans of every row, int2 [batch, seqlen_q], rounded to 16.
inline std::size_t doc_spans_bytes(int batch, int seqlen_q) {
  return (static_cast<std::size_t>(batch) * static_cast<std::size_t>(seqlen_q) * sizeof(int2) + 15) / 16 * 16;
}

// Writes spans[b * seqlen_q + i] = {lo, hi} for every row (or {kNoDocSpan, kNoDocSpan} throughout a
// batch entry whose key ids are not sorted) on `stream`. `el` must have document ids. The kernel lets
// its programmatic dependent start (the forward waits for it before reading the spans).
Status launch_doc_spans(const ElementMaskParams& el, int batch, int seqlen_q, int seqlen_k, int2* spans,
                        cudaStream_t stream);

}  // namespace flare::block_sparse
