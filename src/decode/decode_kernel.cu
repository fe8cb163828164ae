// Decode entry points: decode_run (validate, resolve the device params once, launch the standard
// or the split-KV kernel and then, unless the attention kernel merged the splits itself, the
// combine) and merge_states (the combine, exposed). Both allocate nothing, so a decode step can be
// captured in a CUDA graph.
//
// The combine ("merge states"): one CTA of 4 warps per row n. Each warp reads the row's S partial
// LSEs and forms lse = M + log(sum_s exp(lse_s - M)) with M = max_s lse_s; then the warps share
// the S partial outputs (of each 32 states, 8 per warp with their loads in flight together), each
// weighed by exp(lse_s - lse) broadcast by shuffles, and add their sums through shared memory;
// states of weight 0 (LSE -inf, e.g. an empty split) are skipped, so their partial output is
// never read into the sum.
// After the split-KV kernel it is a programmatic dependent launch (sm_90+): its CTAs are launched
// once every attention CTA has started and wait (griddepcontrol.wait) for the attention grid's
// results, so the combine's launch latency overlaps the attention kernel's tail.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "flare/decode.h"
#include "flare/decode_plan.h"
#include "flare_instantiated.h"
#include "src/common/cuda_check.h"
#include "src/common/programmatic_launch.h"
#include "src/common/tensor_checks.h"
#include "src/decode/decode_args.h"
#include "src/decode/decode_launch.h"

namespace flare::decode {

// Defined in the generated per-(head dim, dtype) translation units.
#define FLARE_DECODE_EXTERN(D, T) \
  extern template Status launch_decode_attention<D, T>(const DecodeKernelParams&, const DecodeLaunch&, cudaStream_t, bool*);
FLARE_DECODE_EXTERN(64, __nv_bfloat16)
FLARE_DECODE_EXTERN(64, __half)
FLARE_DECODE_EXTERN(128, __nv_bfloat16)
FLARE_DECODE_EXTERN(128, __half)
FLARE_DECODE_EXTERN(256, __nv_bfloat16)
FLARE_DECODE_EXTERN(256, __half)
#undef FLARE_DECODE_EXTERN

namespace {

std::string str(int64_t x) { return std::to_string(x); }

// ---------------------------------------------------------------------------------------------
// Combine

struct MergeKernelParams {
  const float* partial_out = nullptr;  // contiguous [rows, num_states, dim]
  const float* partial_lse = nullptr;  // contiguous [rows, num_states]
  void* out = nullptr;
  float* lse = nullptr;                // optional
  int rows = 0, num_states = 0, dim = 0;
  // Row n = (i0 * size1 + i1) * size2 + i2 lives at i0 * stride[0] + i1 * stride[1] + i2 * stride[2].
  int size1 = 1, size2 = 1;
  int64_t out_stride[3] = {0, 0, 0};
  int64_t lse_stride[3] = {0, 0, 0};
  float all_empty_lse = -INFINITY;  // LSE of a row whose states all have LSE -inf
};

constexpr int kMergeThreads = 128;  // one row per CTA: its 4 warps share the row's states
constexpr int kMergeWarps = kMergeThreads / 32;
// Accumulators per lane: one pass covers kMergeColumnSteps * 32 * kVec columns (128 with float4
// loads: head dim 128 in one pass, 8 states' loads in flight without spilling).
template <int kVec>
constexpr int kMergeColumnSteps = kVec == 4 ? 1 : 2;
// Of each 32 states, warp w sums states [8 w, 8 w + 8), their loads in flight together: a row of
// up to 32 states costs one memory round trip, not one per state (or per 4), which is what the
// combine of a small batch split many ways waits on.
constexpr int kMergeStatesPerWarp = 32 / kMergeWarps;

template <typename OutT>
__device__ __forceinline__ OutT to_out(float x);
template <>
__device__ __forceinline__ float to_out<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 to_out<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half to_out<__half>(float x) { return __float2half_rn(x); }

// kVec = 4: dim % 4 == 0 and partial_out 16-byte aligned (float4 loads); else 1.
template <typename OutT, int kVec>
__global__ void __launch_bounds__(kMergeThreads) merge_states_kernel(const MergeKernelParams p) {
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr int kSteps = kMergeColumnSteps<kVec>;
  constexpr int kPassColumns = 32 * kVec * kSteps;
  __shared__ float warp_sums[kMergeWarps][kPassColumns];
  const int row = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  device::wait_for_prerequisite_grids();  // the partial states are complete and visible
  const int S = p.num_states, D = p.dim;
  const float* lse_in = p.partial_lse + int64_t{row} * S;
  const float* states = p.partial_out + int64_t{row} * S * D;
  const int i2 = row % p.size2, i1 = (row / p.size2) % p.size1, i0 = row / p.size2 / p.size1;
  OutT* out = static_cast<OutT*>(p.out) + i0 * p.out_stride[0] + i1 * p.out_stride[1] + i2 * p.out_stride[2];
  float* lse_out = p.lse != nullptr ? p.lse + i0 * p.lse_stride[0] + i1 * p.lse_stride[1] + i2 * p.lse_stride[2]
                                    : nullptr;

  // Every warp forms the row's LSE (S loads, shared through L1): no barrier before the sums.
  float m = -INFINITY;
  for (int s = lane; s < S; s += 32) m = fmaxf(m, lse_in[s]);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (m == -INFINITY || m == INFINITY) {  // no state weighs anything (+inf: ref::merge_states' convention)
    for (int c = threadIdx.x; c < D; c += kMergeThreads) out[c] = to_out<OutT>(0.f);
    if (lse_out != nullptr && threadIdx.x == 0) *lse_out = m == INFINITY ? INFINITY : p.all_empty_lse;
    return;  // the same m in every warp: the whole CTA returns
  }
  float sum = 0.f;
  for (int s = lane; s < S; s += 32) sum += exp2f((lse_in[s] - m) * kLog2e);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const float lse = m + logf(sum);
  if (lse_out != nullptr && threadIdx.x == 0) *lse_out = lse;

  for (int base = 0; base < D; base += kPassColumns) {
    float acc[kSteps][kVec] = {};
    for (int s0 = 0; s0 < S; s0 += 32) {
      const float w_lane = s0 + lane < S ? exp2f((lse_in[s0 + lane] - lse) * kLog2e) : 0.f;
      const int first = warp * kMergeStatesPerWarp;  // this warp's states s0 + first + i
      if constexpr (kVec == 4) {
        float w[kMergeStatesPerWarp];
        float4 x[kMergeStatesPerWarp][kSteps];
#pragma unroll
        for (int i = 0; i < kMergeStatesPerWarp; ++i) {
          w[i] = __shfl_sync(0xffffffffu, w_lane, first + i);  // 0 past the states and for -inf ones
          const float* state = states + int64_t{s0 + first + i} * D;
#pragma unroll
          for (int j = 0; j < kSteps; ++j) {
            const int c = base + (j * 32 + lane) * 4;
            x[i][j] = w[i] != 0.f && c < D ? *reinterpret_cast<const float4*>(state + c) : make_float4(0, 0, 0, 0);
          }
        }
#pragma unroll
        for (int i = 0; i < kMergeStatesPerWarp; ++i)
#pragma unroll
          for (int j = 0; j < kSteps; ++j) {
            acc[j][0] += w[i] * x[i][j].x, acc[j][1] += w[i] * x[i][j].y;
            acc[j][2] += w[i] * x[i][j].z, acc[j][3] += w[i] * x[i][j].w;
          }
      } else {
#pragma unroll 1
        for (int i = first; i < first + kMergeStatesPerWarp; ++i) {  // scalar path: one state at a time
          const float w = __shfl_sync(0xffffffffu, w_lane, i);
          if (w == 0.f) continue;  // warp-uniform
          const float* state = states + int64_t{s0 + i} * D;
#pragma unroll
          for (int j = 0; j < kSteps; ++j) {
            const int c = base + (j * 32 + lane) * kVec;
            if (c < D) acc[j][0] += w * state[c];
          }
        }
      }
    }
    // The warps' sums meet in shared memory; all threads write the pass's columns.
    __syncthreads();  // the previous pass's reads of warp_sums are done
#pragma unroll
    for (int j = 0; j < kSteps; ++j)
#pragma unroll
      for (int e = 0; e < kVec; ++e) warp_sums[warp][(j * 32 + lane) * kVec + e] = acc[j][e];
    __syncthreads();
    for (int idx = threadIdx.x; idx < kPassColumns && base + idx < D; idx += kMergeThreads) {
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < kMergeWarps; ++w) total += warp_sums[w][idx];
      out[base + idx] = to_out<OutT>(total);
    }
  }
}

// Whether the current device runs programmatic dependent launches (sm_90+).
bool device_has_programmatic_launch() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return major >= 9;
}

// `programmatic`: launched as a programmatic dependent of the kernel before it on the stream.
template <typename OutT>
Status launch_merge_typed(const MergeKernelParams& p, bool vec4, bool programmatic, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.rows));  // one row per CTA
  const cudaError_t e =
      vec4 ? detail::launch_maybe_programmatic(programmatic, merge_states_kernel<OutT, 4>, grid, dim3(kMergeThreads), 0,
                                               stream, p)
           : detail::launch_maybe_programmatic(programmatic, merge_states_kernel<OutT, 1>, grid, dim3(kMergeThreads), 0,
                                               stream, p);
  return detail::cuda_status(e, "merge states launch");
}

Status launch_merge(const MergeKernelParams& p, DType out_dtype, bool programmatic, cudaStream_t stream) {
  if (p.rows == 0) return Status::Ok();
  const bool vec4 = p.dim % 4 == 0 && reinterpret_cast<uintptr_t>(p.partial_out) % 16 == 0;
  switch (out_dtype) {
    case DType::kFloat32: return launch_merge_typed<float>(p, vec4, programmatic, stream);
    case DType::kBFloat16: return launch_merge_typed<__nv_bfloat16>(p, vec4, programmatic, stream);
    case DType::kFloat16: return launch_merge_typed<__half>(p, vec4, programmatic, stream);
    default: break;
  }
  return Status::InvalidArgument("out", std::string("dtype ") + dtype_name(out_dtype) + " not supported");
}

// ---------------------------------------------------------------------------------------------
// merge_states arguments

// t's dims [0, count) equal like's.
bool same_leading_dims(const TensorView& t, const TensorView& like, int count) {
  for (int d = 0; d < count; ++d)
    if (t.shape[d] != like.shape[d]) return false;
  return true;
}

std::string leading_shape_string(const TensorView& like, int count, int64_t last = -1) {
  std::string s = "[";
  for (int d = 0; d < count; ++d) s += (d ? ", " : "") + str(like.shape[d]);
  if (last >= 0) s += (count ? ", " : "") + str(last);
  return s + "]";
}

Status validate_merge_states(const MergeStatesParams& p) {
  using namespace detail;
  const TensorView& po = p.partial_out;
  FLARE_RETURN_IF_ERROR(check_defined(po, "partial_out"));
  FLARE_RETURN_IF_ERROR(check_dtype(po, "partial_out", {DType::kFloat32}));
  FLARE_RETURN_IF_ERROR(check_device(po, "partial_out", DeviceKind::kCUDA));
  if (po.rank < 2 || po.rank > 5)
    return Status::InvalidArgument("partial_out", "expected [rows..., num_states, dim] with at most 3 row dims, got " +
                                                      shape_string(po));
  FLARE_RETURN_IF_ERROR(check_index_range(po, "partial_out"));
  if (!po.is_contiguous()) return Status::InvalidArgument("partial_out", "must be contiguous");
  const int lead = po.rank - 2;
  const int64_t num_states = po.shape[lead], dim = po.shape[lead + 1];
  if (num_states < 1) return Status::InvalidArgument("partial_out", "num_states (dim " + str(lead) + ") must be >= 1");
  if (dim < 1) return Status::InvalidArgument("partial_out", "dim (last) must be >= 1");
  int64_t rows = 1;
  for (int d = 0; d < lead; ++d) rows *= po.shape[d];
  if (rows * num_states > INT_MAX)
    return Status::InvalidArgument("partial_out", "rows x num_states = " + str(rows * num_states) +
                                                      " overflows 32-bit indexing");

  const TensorView& pl = p.partial_lse;
  FLARE_RETURN_IF_ERROR(check_defined(pl, "partial_lse"));
  FLARE_RETURN_IF_ERROR(check_dtype(pl, "partial_lse", {DType::kFloat32}));
  FLARE_RETURN_IF_ERROR(check_device(pl, "partial_lse", DeviceKind::kCUDA));
  if (pl.rank != lead + 1 || !same_leading_dims(pl, po, lead + 1))
    return Status::InvalidArgument("partial_lse", "expected shape " + leading_shape_string(po, lead + 1) +
                                                      " (partial_out's without its last dim), got " + shape_string(pl));
  FLARE_RETURN_IF_ERROR(check_index_range(pl, "partial_lse"));
  if (!pl.is_contiguous()) return Status::InvalidArgument("partial_lse", "must be contiguous");

  const TensorView& out = p.out;
  FLARE_RETURN_IF_ERROR(check_dtype(out, "out", {DType::kFloat32, DType::kBFloat16, DType::kFloat16}));
  FLARE_RETURN_IF_ERROR(check_elementwise_operand(out, "out", lead + 1, DeviceKind::kCUDA));
  if (!same_leading_dims(out, po, lead) || out.shape[lead] != dim)
    return Status::InvalidArgument("out", "expected shape " + leading_shape_string(po, lead, dim) + ", got " +
                                              shape_string(out));

  if (p.lse.defined()) {
    const TensorView& lse = p.lse;
    FLARE_RETURN_IF_ERROR(check_defined(lse, "lse"));
    FLARE_RETURN_IF_ERROR(check_dtype(lse, "lse", {DType::kFloat32}));
    FLARE_RETURN_IF_ERROR(check_device(lse, "lse", DeviceKind::kCUDA));
    if (lse.rank != lead || !same_leading_dims(lse, po, lead))
      return Status::InvalidArgument("lse", "expected shape " + leading_shape_string(po, lead) + ", got " +
                                                shape_string(lse));
    FLARE_RETURN_IF_ERROR(check_index_range(lse, "lse"));
    for (int d = 0; d < lse.rank; ++d)
      if (lse.stride[d] < 0) return Status::InvalidArgument("lse", "negative stride in dim " + str(d));
    if (reinterpret_cast<uintptr_t>(lse.data) % sizeof(float) != 0)
      return Status::InvalidArgument("lse", "data pointer must be aligned to its 4-byte elements");
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// decode_run

DecodeKernelParams make_kernel_params(const DecodeParams& p, const detail::DecodeShape& s, const DecodePlan& plan,
                                      void* workspace) {
  DecodeKernelParams k;
  k.q = p.q.data;
  k.k = p.k_cache.data;
  k.v = p.v_cache.data;
  k.page_table = s.paged ? p.page_table.ptr<int32_t>() : nullptr;
  k.cache_seqlens = p.cache_seqlens.ptr<int32_t>();
  k.out = p.out.data;
  k.lse = p.lse.defined() ? p.lse.ptr<float>() : nullptr;
  if (plan.kernel == DecodeKernel::kSplitKv) {
    k.partial_out = static_cast<float*>(workspace);
    k.partial_lse = reinterpret_cast<float*>(static_cast<char*>(workspace) + plan.partial_lse_offset);
    k.counters = reinterpret_cast<int*>(static_cast<char*>(workspace) + plan.counters_offset);
  }
  k.q_stride_b = p.q.stride[0], k.q_stride_t = p.q.stride[1], k.q_stride_h = p.q.stride[2];
  k.out_stride_b = p.out.stride[0], k.out_stride_t = p.out.stride[1], k.out_stride_h = p.out.stride[2];
  k.k_stride_0 = p.k_cache.stride[0], k.k_stride_tok = p.k_cache.stride[1], k.k_stride_h = p.k_cache.stride[2];
  k.v_stride_0 = p.v_cache.stride[0], k.v_stride_tok = p.v_cache.stride[1], k.v_stride_h = p.v_cache.stride[2];
  k.k_extent_0 = p.k_cache.shape[0], k.k_extent_1 = p.k_cache.shape[1];
  k.v_extent_0 = p.v_cache.shape[0], k.v_extent_1 = p.v_cache.shape[1];
  k.page_table_stride = s.paged ? p.page_table.stride[0] : 0;
  k.seqlens_stride = p.cache_seqlens.stride[0];

  k.batch = s.batch;
  k.q_len = s.q_len;
  k.heads_q = s.heads_q;
  k.heads_kv = s.heads_kv;
  k.group = s.heads_q / s.heads_kv;
  k.rows = k.group * s.q_len;
  k.row_blocks = (k.rows + kDecodeRowsPerCta - 1) / kDecodeRowsPerCta;
  k.max_cache_len = static_cast<int>(s.max_cache_len);  // <= 2^30: the planner's limit
  k.page_shift = 0;
  while (s.paged && (1 << k.page_shift) < s.page_size) ++k.page_shift;
  k.causal = p.causal;
  // A window reaching back past the cache's capacity hides nothing: run it unbounded (which also
  // keeps every key position in int range on the device).
  k.window_left = p.window_left >= 0 && p.window_left < s.max_cache_len ? p.window_left : -1;
  k.scale_log2 = s.softmax_scale * 1.4426950408889634f;
  k.num_splits = plan.num_splits;
  k.kv_chunk = plan.kv_chunk;
  k.kv_align = plan.kv_align;
  k.l2_evict_first = plan.l2_evict_first;
  return k;
}

// FLARE_HEAD_DIMS and FLARE_DTYPES decide which kernels this build has. *combined: the split-KV
// states were merged in the attention kernel.
Status launch_attention(const DecodeKernelParams& k, const DecodeLaunch& how, int head_dim, DType dtype,
                        cudaStream_t stream, bool* combined) {
  [[maybe_unused]] const bool bf16 = dtype == DType::kBFloat16;
#if defined(FLARE_HAS_DTYPE_bf16)
#define FLARE_DECODE_BF16(D) \
  if (bf16) return launch_decode_attention<D, __nv_bfloat16>(k, how, stream, combined);
#else
#define FLARE_DECODE_BF16(D)
#endif
#if defined(FLARE_HAS_DTYPE_fp16)
#define FLARE_DECODE_FP16(D) \
  if (!bf16) return launch_decode_attention<D, __half>(k, how, stream, combined);
#else
#define FLARE_DECODE_FP16(D)
#endif
  switch (head_dim) {
#ifdef FLARE_HAS_HEAD_DIM_64
    case 64:
      FLARE_DECODE_BF16(64)
      FLARE_DECODE_FP16(64)
      break;
#endif
#ifdef FLARE_HAS_HEAD_DIM_128
    case 128:
      FLARE_DECODE_BF16(128)
      FLARE_DECODE_FP16(128)
      break;
#endif
#ifdef FLARE_HAS_HEAD_DIM_256
    case 256:
      FLARE_DECODE_BF16(256)
      FLARE_DECODE_FP16(256)
      break;
#endif
    default: break;
  }
#undef FLARE_DECODE_BF16
#undef FLARE_DECODE_FP16
  return Status::NotSupported("decode: no kernel for head dim " + str(head_dim) + " and dtype " + dtype_name(dtype) +
                              " in this build (see FLARE_HEAD_DIMS and FLARE_DTYPES)");
}

}  // namespace
}  // namespace flare::decode

namespace flare {

Status decode_run(const DecodePlan& plan, const DecodeParams& params, void* workspace, std::size_t workspace_bytes) {
  detail::DecodeShape shape;
  FLARE_RETURN_IF_ERROR(detail::validate_decode(params, DeviceKind::kCUDA, &shape));
  DecodeShapeKey key;
  FLARE_RETURN_IF_ERROR(decode_shape_key(params, &key));
  FLARE_RETURN_IF_ERROR(check_decode_plan(plan, key));
  const bool split = plan.kernel == DecodeKernel::kSplitKv;
  if (split) {
    const auto need = [&] { return std::to_string(plan.workspace_bytes) + " bytes (plan.workspace_bytes)"; };
    if (workspace == nullptr) return Status::InvalidArgument("workspace", "null, but the split-KV plan needs " + need());
    if (workspace_bytes < plan.workspace_bytes)
      return Status::InvalidArgument("workspace", "needs " + need() + ", got " + std::to_string(workspace_bytes));
    if (reinterpret_cast<uintptr_t>(workspace) % 16 != 0)
      return Status::InvalidArgument("workspace", "must be 16-byte aligned");
  }

  const decode::DecodeKernelParams k = decode::make_kernel_params(params, shape, plan, workspace);
  const cudaStream_t stream = params.stream;
  decode::DecodeLaunch how;
  how.engine = plan.engine;
  how.combine = plan.combine;
  how.heads_per_cta = plan.heads_per_cta;
  bool combined = false;
  FLARE_RETURN_IF_ERROR(decode::launch_attention(k, how, shape.head_dim, params.q.dtype, stream, &combined));
  if (!split || combined) return Status::Ok();

  // Combine: rows (b, h, t) of the workspace, into out [b, t, h] and lse [b, h, t].
  decode::MergeKernelParams m;
  m.partial_out = k.partial_out;
  m.partial_lse = k.partial_lse;
  m.out = params.out.data;
  m.lse = k.lse;
  m.rows = shape.batch * shape.heads_q * shape.q_len;
  m.num_states = plan.num_splits;
  m.dim = shape.head_dim;
  m.size1 = shape.heads_q;
  m.size2 = shape.q_len;
  m.out_stride[0] = params.out.stride[0];  // b
  m.out_stride[1] = params.out.stride[2];  // h
  m.out_stride[2] = params.out.stride[1];  // t
  m.lse_stride[0] = int64_t{shape.heads_q} * shape.q_len, m.lse_stride[1] = shape.q_len, m.lse_stride[2] = 1;
  m.all_empty_lse = INFINITY;  // a row that sees no key: as the standard kernel and ref::decode_forward
  return decode::launch_merge(m, params.q.dtype, decode::device_has_programmatic_launch(), stream);
}

Status merge_states(const MergeStatesParams& params) {
  FLARE_RETURN_IF_ERROR(decode::validate_merge_states(params));
  const TensorView& po = params.partial_out;
  const int lead = po.rank - 2;
  decode::MergeKernelParams m;
  m.partial_out = po.ptr<float>();
  m.partial_lse = params.partial_lse.ptr<float>();
  m.out = params.out.data;
  m.lse = params.lse.defined() ? params.lse.ptr<float>() : nullptr;
  int64_t rows = 1;
  for (int d = 0; d < lead; ++d) rows *= po.shape[d];
  m.rows = static_cast<int>(rows);
  m.num_states = static_cast<int>(po.shape[lead]);
  m.dim = static_cast<int>(po.shape[lead + 1]);
  // Leading dims right-aligned into (i0, i1, i2); missing ones have size 1.
  const int first = 3 - lead;
  int64_t size[3] = {1, 1, 1};
  for (int d = 0; d < lead; ++d) {
    size[first + d] = po.shape[d];
    m.out_stride[first + d] = params.out.stride[d];
    if (m.lse != nullptr) m.lse_stride[first + d] = params.lse.stride[d];
  }
  m.size1 = static_cast<int>(size[1]);
  m.size2 = static_cast<int>(size[2]);
  m.all_empty_lse = -INFINITY;  // ref::merge_states
  return decode::launch_merge(m, params.out.dtype, /*programmatic=*/false, params.stream);
}

}  // namespace flare
