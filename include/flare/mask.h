// Mask descriptions shared by the attention ops.
#pragma once

#include "flare/tensor.h"

namespace flare {

// Dense masks. Positions are aligned bottom-right as in FlashAttention: query row i of a
// sequence lines up with key column i + (seqlen_k - seqlen_q). Key j is visible to query i when
//   j - (i + seqlen_k - seqlen_q) in [-window_left, window_right]
// where a negative window means unbounded on that side. `causal` is window_right = 0.
struct MaskParams {
  bool causal = false;
  int window_left = -1;
  int window_right = -1;
};

// Element-level predicate applied inside the *partial* blocks of a block-sparse mask.
// Positions are absolute (top-left aligned) as in FlexAttention's mask_mod(b, h, q_idx, kv_idx).
// Every enabled predicate must hold (logical AND).
struct ElementMask {
  bool causal = false;       // kv_idx <= q_idx
  int window_left = -1;      // q_idx - kv_idx <= window_left   (-1: off)
  int window_right = -1;     // kv_idx - q_idx <= window_right  (-1: off)
  int prefix_length = -1;    // prefix-LM: kv_idx < prefix_length || kv_idx <= q_idx (-1: off)
  TensorView doc_ids_q;      // optional int32 [batch, seqlen_q]: same document required
  TensorView doc_ids_k;      // optional int32 [batch, seqlen_k]
  TensorView bits;           // optional uint32 [batch|1, heads|1, seqlen_q, ceil(seqlen_k / 32)]:
                             // bit (kv_idx % 32) of word kv_idx / 32 set = visible
};

// FlexAttention-compatible block-sparse mask. For each (batch, head, q_block): `kv_num_blocks`
// partial KV blocks listed in `kv_indices` (need the element mask) and `full_kv_num_blocks`
// full blocks in `full_kv_indices` (no element mask). The transposed lists (per KV block: the
// q blocks that see it) drive the backward. Batch and head dims may be 1 (broadcast).
// All index tensors are int32:
//   kv_num_blocks [B, H, num_q_blocks], kv_indices [B, H, num_q_blocks, num_kv_blocks]
//   q_num_blocks  [B, H, num_kv_blocks], q_indices [B, H, num_kv_blocks, num_q_blocks]
struct BlockMask {
  int q_block_size = 128;
  int kv_block_size = 128;
  TensorView kv_num_blocks, kv_indices;
  TensorView full_kv_num_blocks, full_kv_indices;
  TensorView q_num_blocks, q_indices;
  TensorView full_q_num_blocks, full_q_indices;
  ElementMask element;
};

}  // namespace flare
