// The varlen chunk table: sequence n's tokens [cu[n], cu[n+1]) split into 64-token chunks,
// numbered in sequence order, so chunks never straddle sequences and sequence n owns chunks
// [seq_chunk_begin[n], seq_chunk_begin[n+1]). Entries past the last chunk get len = 0 (the chunk
// kernel, launched over the upper bound ceil(T / 64) + N, skips them). Also the state passes'
// order of the sequences, longest first (kda_chunk_prep.cuh's sequence_of_row).
#include <cub/block/block_scan.cuh>

#include "src/kda/kda_fwd_params.h"

namespace flare::kda {
namespace {

constexpr int kTableThreads = 1024;

__device__ int64_t cu_at(const detail::KdaFwdArgs& a, int n) {
  return a.cu_int64 ? static_cast<const int64_t*>(a.cu_seqlens)[n] : static_cast<const int32_t*>(a.cu_seqlens)[n];
}

// seq_order: the sequences by chunk count, longest first, ties in sequence order; sequence n's
// place is the number of sequences that go before it. Up to one sequence per thread (counts in
// shared memory, N reads each); longer batches keep their order (each of their many CTA rows is a
// small part of the pass).
__device__ void write_sequence_order(const detail::KdaFwdArgs& a) {
  __shared__ int counts[kTableThreads];
  const int n = static_cast<int>(threadIdx.x);
  if (a.num_seqs > kTableThreads) {
    for (int m = n; m < a.num_seqs; m += kTableThreads) a.seq_order[m] = m;
    return;
  }
  if (n < a.num_seqs) counts[n] = static_cast<int>((cu_at(a, n + 1) - cu_at(a, n) + detail::kKdaChunk - 1) / detail::kKdaChunk);
  __syncthreads();
  if (n >= a.num_seqs) return;
  const int mine = counts[n];
  int place = 0;
  for (int m = 0; m < a.num_seqs; ++m) place += counts[m] > mine || (counts[m] == mine && m < n);
  a.seq_order[place] = n;
}

__global__ void __launch_bounds__(kTableThreads) kda_chunk_table_kernel(const detail::KdaFwdArgs a) {
  using Scan = cub::BlockScan<int, kTableThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  int chunks_before = 0;  // chunks of the sequences of earlier rounds
  for (int base = 0; base < a.num_seqs; base += kTableThreads) {
    const int n = base + static_cast<int>(threadIdx.x);
    int64_t start = 0, len = 0;
    if (n < a.num_seqs) start = cu_at(a, n), len = cu_at(a, n + 1) - start;
    const int count = static_cast<int>((len + detail::kKdaChunk - 1) / detail::kKdaChunk);
    int offset = 0, round_total = 0;
    Scan(scan_storage).ExclusiveSum(count, offset, round_total);
    __syncthreads();
    if (n < a.num_seqs) {
      const int first = chunks_before + offset;
      a.seq_chunk_begin[n] = first;
      for (int j = 0; j < count; ++j) {
        const int t0 = static_cast<int>(start) + j * detail::kKdaChunk;
        const int clen = static_cast<int>(len < (j + 1) * detail::kKdaChunk ? len - j * detail::kKdaChunk : detail::kKdaChunk);
        a.chunks[first + j] = detail::KdaChunk{0, t0, clen, n};
      }
    }
    chunks_before += round_total;
  }
  if (threadIdx.x == 0) a.seq_chunk_begin[a.num_seqs] = chunks_before;
  for (int c = chunks_before + static_cast<int>(threadIdx.x); c < a.max_chunks; c += kTableThreads)
    a.chunks[c] = detail::KdaChunk{0, 0, 0, 0};
  write_sequence_order(a);
}

}  // namespace

cudaError_t launch_chunk_table(const detail::KdaFwdArgs& a, cudaStream_t stream) {
  kda_chunk_table_kernel<<<1, kTableThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace flare::kda
