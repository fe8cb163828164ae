// Which decode attention kernel runs a plan, and its launch. The plan names an engine and a
// combine (flare/decode_plan.h); the engine runs where it applies, the portable kernel elsewhere:
//   kKeyGroups  decode_key_groups_kernel.h (sm_90), with the in-kernel combine for split plans
//               unless the plan asks for the separate combine kernel or the cluster combine
//               (up to kDecodeMaxClusterSplits splits where the device runs such clusters);
//   kHeadWarps  decode_bulk_kernel.h (sm_90), the kernel of 2026-11-22 (kept for comparisons);
//   kPortable   decode_kernel.h (sm_80+).
// FLARE_DECODE_PORTABLE=1 forces the portable kernel; FLARE_DECODE_ENGINE=key_groups|head_warps|
// portable overrides every plan's engine (both read once per process; an unknown name is ignored).
// Instantiated once per (head dim, dtype) in its own translation unit
// (instantiations/decode_kernel.cu.in); decode_kernel.cu sees only extern declarations.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <type_traits>

#include "flare/decode_plan.h"
#include "src/common/cuda_check.h"
#include "src/common/device_facts.h"
#include "src/common/programmatic_launch.h"
#include "src/decode/decode_bulk_kernel.h"
#include "src/decode/decode_key_groups_kernel.h"
#include "src/decode/decode_kernel.h"
#include "src/decode/decode_schedule.h"

namespace flare::decode {

static_assert(kCombineMaxStates == kMaxDecodeSplits, "the in-kernel combine holds every split's LSE");

// A run's choices, from its plan.
struct DecodeLaunch {
  DecodeEngine engine = DecodeEngine::kKeyGroups;
  DecodeCombine combine = DecodeCombine::kInKernel;
  int heads_per_cta = 0;  // 0: the engine's rule
};

// The engine the environment forces (read once), or -1.
inline int decode_engine_override() {
  static const int value = [] {
    const char* portable = std::getenv("FLARE_DECODE_PORTABLE");
    if (portable != nullptr && portable[0] == '1') return static_cast<int>(DecodeEngine::kPortable);
    const char* name = std::getenv("FLARE_DECODE_ENGINE");
    if (name == nullptr) return -1;
    const std::optional<DecodeEngine> e = decode_engine_from_name(name);
    return e ? static_cast<int>(*e) : -1;
  }();
  return value;
}

// Whether the current device runs this build's sm_90 decode code (once per kernel family).
template <int kHeadDim, typename T>
bool device_runs_sm90_decode() {
  static const bool ok = [] {
    cudaFuncAttributes attributes = {};
    const bool has =
        cudaFuncGetAttributes(&attributes, decode_key_groups_kernel<kHeadDim, T, false, false>) == cudaSuccess &&
        attributes.binaryVersion >= 90;
    if (!has) (void)cudaGetLastError();  // e.g. no sm_90 binary for this device
    return has;
  }();
  return ok;
}

// Whether `kernel` may run clusters of `splits` CTAs with the most shared memory a key-group CTA
// takes (then any layout fits): sizes up to 8 are portable; larger ones need the non-portable
// attribute and a device whose GPCs hold them, checked once.
// A template per kernel, each setting its attribute (kHeadMajor tells apart the two box orders'
// kernels, which share a type).
template <int kHeadDim, typename T, bool kHeadMajor, typename Kernel>
bool key_group_cluster_ready(Kernel kernel, int splits) {
  static const bool large_ok = [&] {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(kDecodeMaxClusterSplits);
    config.blockDim = dim3(32 * (key_group_consumer_warps(kHeadDim) + 1));
    config.dynamicSmemBytes = kKeyGroupSmemBudget;
    cudaLaunchAttribute attribute = detail::cluster_attribute(kDecodeMaxClusterSplits);
    config.attrs = &attribute;
    config.numAttrs = 1;
    int clusters = 0;
    const bool ok = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess &&
                    cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) == cudaSuccess && clusters > 0;
    if (!ok) (void)cudaGetLastError();
    return ok;
  }();
  return splits <= 8 || large_ok;
}

// The key-group kernel of one box order, with its layout and maps.
template <int kHeadDim, typename T, bool kHeadMajor>
Status launch_decode_key_groups_kernel(const DecodeKernelParams& p, const DecodeLaunch& how, const KeyGroupLayout& lay,
                                       const CUtensorMap& tmap_k, const CUtensorMap& tmap_v, cudaStream_t stream,
                                       bool* combined) {
  auto standard = decode_key_groups_kernel<kHeadDim, T, false, kHeadMajor>;
  auto split_kv = decode_key_groups_kernel<kHeadDim, T, true, kHeadMajor>;
  // Once per kernel (not a stream operation, so also fine while a graph is being captured).
  static const bool ready = [&] {
    const bool ok =
        cudaFuncSetAttribute(standard, cudaFuncAttributeMaxDynamicSharedMemorySize, kKeyGroupSmemBudget) ==
            cudaSuccess &&
        cudaFuncSetAttribute(split_kv, cudaFuncAttributeMaxDynamicSharedMemorySize, kKeyGroupSmemBudget) == cudaSuccess;
    if (!ok) (void)cudaGetLastError();  // the portable kernel runs
    return ok;
  }();
  if (!ready) return launch_decode_portable<kHeadDim, T>(p, stream);

  const int64_t ctas = int64_t{p.batch} * (p.heads_kv / lay.heads_per_cta) * p.num_splits;
  if (ctas > INT_MAX) return Status::NotSupported("decode: " + std::to_string(ctas) + " CTAs exceed the grid limit");
  const dim3 grid(static_cast<unsigned>(ctas)), block(32 * (lay.consumer_warps + 1));
  DecodeKernelParams kp = p;
#if FLARE_DECODE_TIMELINE
  kp.timeline = decode_timeline_buffer();
#endif
  if (p.num_splits == 1) {
    standard<<<grid, block, lay.smem_bytes, stream>>>(kp, lay, tmap_k, tmap_v);
    return detail::cuda_status(cudaGetLastError(), "decode attention launch");
  }
  if (how.combine == DecodeCombine::kCluster && p.num_splits <= kDecodeMaxClusterSplits &&
      key_group_cluster_ready<kHeadDim, T, kHeadMajor>(split_kv, p.num_splits)) {
    kp.counters = nullptr;
    kp.cluster_combine = true;
    FLARE_RETURN_IF_ERROR(detail::cuda_status(
        detail::launch_cluster(split_kv, grid, block, p.num_splits, static_cast<size_t>(lay.smem_bytes), stream, kp,
                               lay, tmap_k, tmap_v),
        "decode attention launch"));
    *combined = true;
    return Status::Ok();
  }
  const bool in_kernel = how.combine != DecodeCombine::kSeparateKernel && p.counters != nullptr;
  if (!in_kernel || how.combine == DecodeCombine::kInKernelPrezeroed) {
    if (!in_kernel) kp.counters = nullptr;  // the kernel writes the states; the caller merges them
    split_kv<<<grid, block, lay.smem_bytes, stream>>>(kp, lay, tmap_k, tmap_v);
    FLARE_RETURN_IF_ERROR(detail::cuda_status(cudaGetLastError(), "decode attention launch"));
    *combined = in_kernel;
    return Status::Ok();
  }
  // Counters zeroed by a one-CTA kernel; the attention kernel is its programmatic dependent, so it
  // launches at once and waits for the zeroes only before its first arrival.
  zero_arrival_counters_kernel<T><<<1, 256, 0, stream>>>(kp.counters, int64_t{p.batch} * p.heads_kv);
  FLARE_RETURN_IF_ERROR(detail::cuda_status(cudaGetLastError(), "decode counter reset launch"));
  const cudaError_t e = detail::launch_maybe_programmatic(true, split_kv, grid, block,
                                                         static_cast<size_t>(lay.smem_bytes), stream, kp, lay, tmap_k,
                                                         tmap_v);
  FLARE_RETURN_IF_ERROR(detail::cuda_status(e, "decode attention launch"));
  *combined = true;
  return Status::Ok();
}

// The key-group kernel; *combined tells whether the split-KV states were merged in the kernel.
template <int kHeadDim, typename T>
Status launch_decode_key_groups(const DecodeKernelParams& p, const DecodeLaunch& how, cudaStream_t stream,
                                bool* combined) {
  const int num_sms = detail::current_device_facts().num_sms;
  const int heads_per_cta = key_group_heads_per_cta(how.heads_per_cta, key_group_max_heads_per_cta(kHeadDim, p.heads_kv),
                                                    p.batch, p.heads_kv, p.num_splits, num_sms);
  const int64_t max_keys = p.num_splits > 1 ? int64_t{p.kv_chunk} : int64_t{p.max_cache_len};
  const KeyGroupLayout lay = key_group_layout(kHeadDim, static_cast<int>(sizeof(T)), heads_per_cta, max_keys);
  // The caches' TMA maps (decode_tensor_maps.h): boxes of heads_per_cta heads; the head-warp
  // kernel runs where the driver refuses them.
  const bool head_major = cache_boxes_head_major(heads_per_cta);
  CUtensorMap tmap_k, tmap_v;
  auto key_of = [&](const void* base, int64_t e0, int64_t e1, int64_t s0, int64_t s_tok, int64_t s_h) {
    CacheMapKey k;
    k.base = base, k.head_dim = kHeadDim, k.heads = p.heads_kv, k.extent_1 = e1, k.extent_0 = e0;
    k.stride_h = s_h, k.stride_tok = s_tok, k.stride_0 = s0;
    k.box_heads = heads_per_cta, k.elem_bytes = static_cast<int>(sizeof(T));
    k.box_tokens = cache_box_tokens(p.page_table == nullptr, lay.stage_keys);
    k.head_major = head_major;
    k.l2_promotion_bytes = cache_map_l2_promotion_bytes(max_keys);
    k.bf16 = std::is_same_v<T, __nv_bfloat16>;
    return k;
  };
  if (!cache_tensor_map(key_of(p.k, p.k_extent_0, p.k_extent_1, p.k_stride_0, p.k_stride_tok, p.k_stride_h), &tmap_k) ||
      !cache_tensor_map(key_of(p.v, p.v_extent_0, p.v_extent_1, p.v_stride_0, p.v_stride_tok, p.v_stride_h), &tmap_v))
    return launch_decode_head_warps<kHeadDim, T>(p, stream);
  if (head_major)
    return launch_decode_key_groups_kernel<kHeadDim, T, true>(p, how, lay, tmap_k, tmap_v, stream, combined);
  return launch_decode_key_groups_kernel<kHeadDim, T, false>(p, how, lay, tmap_k, tmap_v, stream, combined);
}

// Launches the plan's attention kernel (see the top of this file). *combined: the split-KV states
// were merged in the kernel (out and lse are written); otherwise a split plan's combine is the
// caller's.
template <int kHeadDim, typename T>
Status launch_decode_attention(const DecodeKernelParams& p, const DecodeLaunch& how, cudaStream_t stream,
                               bool* combined) {
  *combined = false;
  const int forced = decode_engine_override();
  const DecodeEngine engine = forced >= 0 ? static_cast<DecodeEngine>(forced) : how.engine;
  if (engine == DecodeEngine::kPortable || !device_runs_sm90_decode<kHeadDim, T>() ||
      !bulk_kernel_applies<kHeadDim, T>(p))
    return launch_decode_portable<kHeadDim, T>(p, stream);
  if (engine == DecodeEngine::kHeadWarps) return launch_decode_head_warps<kHeadDim, T>(p, stream);
  return launch_decode_key_groups<kHeadDim, T>(p, how, stream, combined);
}

}  // namespace flare::decode
