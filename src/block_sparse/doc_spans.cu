// Document spans (doc_spans.h): a grid of (row chunks, batch); each CTA tests that its batch
// entry's key ids are sorted (a __syncthreads_and over every neighbouring pair), copying them into
// shared memory when they fit, then finds each of its rows' runs by binary search there (or in
// global memory for longer sequences).
#include "src/block_sparse/doc_spans.h"

#include "src/common/cuda_check.h"
#include "src/common/grid_dependency.h"

namespace flare::block_sparse {
namespace {

constexpr int kThreads = 512;
constexpr int kRowsPerCta = 4 * kThreads;
constexpr int kMaxSmemIds = 48 * 1024;  // 192 KB of ids in shared memory, beyond that global memory

__global__ void __launch_bounds__(kThreads) doc_spans_kernel(ElementMaskParams el, int seqlen_q, int seqlen_k,
                                                             bool in_smem, int2* spans) {
  device::allow_dependent_launch();  // the forward's setup runs under this kernel; it waits before reading
  extern __shared__ int32_t smem_ids[];
  const int b = blockIdx.y, t = threadIdx.x;
  const int32_t* ids = el.doc_k + b * el.doc_k_batch;
  const int64_t stride = el.doc_k_row;
  int sorted = 1;
  for (int j = t; j < seqlen_k; j += kThreads) {
    const int32_t v = ids[j * stride];
    if (in_smem) smem_ids[j] = v;
    if (j + 1 < seqlen_k && ids[(j + 1) * stride] < v) sorted = 0;
  }
  sorted = __syncthreads_and(sorted);
  const int first = blockIdx.x * kRowsPerCta;
  const int end = seqlen_q - first < kRowsPerCta ? seqlen_q : first + kRowsPerCta;
  for (int i = first + t; i < end; i += kThreads) {
    int2 span = make_int2(kNoDocSpan, kNoDocSpan);
    if (sorted) {
      const int32_t doc = el.doc_of_row(b, i);
      const IdRun run = in_smem ? sorted_run(smem_ids, 1, seqlen_k, doc) : sorted_run(ids, stride, seqlen_k, doc);
      span = make_int2(run.lo, run.hi);
    }
    spans[int64_t{b} * seqlen_q + i] = span;
  }
}

}  // namespace

Status launch_doc_spans(const ElementMaskParams& el, int batch, int seqlen_q, int seqlen_k, int2* spans,
                        cudaStream_t stream) {
  if (spans == nullptr) return Status::InvalidArgument("spans", "null pointer");
  if (el.doc_q == nullptr || el.doc_k == nullptr) return Status::InvalidArgument("element mask", "has no document ids");
  if (batch <= 0 || seqlen_q <= 0) return Status::Ok();
  const bool in_smem = seqlen_k <= kMaxSmemIds;
  const int smem = in_smem ? seqlen_k * static_cast<int>(sizeof(int32_t)) : 0;
  static const cudaError_t attr = [] {
    const cudaError_t e = cudaFuncSetAttribute(doc_spans_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               kMaxSmemIds * static_cast<int>(sizeof(int32_t)));
    if (e != cudaSuccess) (void)cudaGetLastError();
    return e;
  }();
  if (attr != cudaSuccess && smem > 48 * 1024) return detail::cuda_status(attr, "document spans: shared memory attribute");
  const dim3 grid((seqlen_q + kRowsPerCta - 1) / kRowsPerCta, batch);
  doc_spans_kernel<<<grid, kThreads, smem, stream>>>(el, seqlen_q, seqlen_k, in_smem, spans);
  return detail::cuda_status(cudaGetLastError(), "document spans");
}

}  // namespace flare::block_sparse
