// Validation of the KDA / GDN params, and the shape facts the kernels need, derived once.
#pragma once

#include "flare/kda.h"

namespace flare::detail {

// K and V are tiled in 16-wide MMA steps, and a [K, V] fp32 state tile must fit on chip.
inline constexpr int kKdaHeadDimMultiple = 16;
inline constexpr int kKdaMaxHeadDim = 256;

struct KdaShape {
  int batch = 0;      // B (1 with cu_seqlens)
  int seqlen = 0;     // T: tokens per batch row (all packed tokens with cu_seqlens)
  int num_seqs = 0;   // N: sequences, i.e. states (B, or cu_seqlens entries - 1)
  int heads = 0;      // H: q/k heads
  int heads_v = 0;    // HV: value heads, a multiple of H
  int key_dim = 0;    // K
  int value_dim = 0;  // V
  bool varlen = false;
  bool scalar_gate = false;  // GDN: g [B, T, HV], one decay per head
  float scale = 0.f;         // resolved (never 0)
};

// `device`: where the tensors must live (kCUDA for the GPU ops, kCPU for the oracles and tests).
// With kCPU the values of cu_seqlens are checked too; device views are not read.
Status validate_kda_forward(const KdaForwardParams& p, DeviceKind device, KdaShape* s);
Status validate_kda_backward(const KdaBackwardParams& p, DeviceKind device, KdaShape* s);

}  // namespace flare::detail
