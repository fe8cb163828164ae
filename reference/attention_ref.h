// CPU oracle for softmax attention (forward and backward), fp64 accumulation.
//
// Takes the same params structs as the GPU ops, with CPU views of any float dtype; outputs are
// written in their views' dtype (tests pass fp64 views). Covers every mask flare supports:
// none, causal (bottom-right aligned), sliding window, block-sparse (partial + full block lists
// with the element predicates), GQA/MQA, varlen, soft-capping and attention sinks.
#pragma once

#include <cstdint>

#include "flare/attention.h"
#include "flare/decode.h"

namespace flare::ref {

struct AttentionRefOptions {
  // Round the intermediates (scaled scores, P, dP, dS) and outputs to the input dtype, as a
  // straightforward implementation in that dtype would: the error of "the same math in the
  // input dtype" that a kernel's error is judged against.
  bool emulate_input_dtype = false;
};

Status attention_forward(const AttentionForwardParams& p, const AttentionRefOptions& opt = {});
Status attention_backward(const AttentionBackwardParams& p, const AttentionRefOptions& opt = {});

// Decode against a contiguous or paged cache (DecodeParams with CPU views).
Status decode_forward(const DecodeParams& p);

// Merge partial attention states by their log-sum-exp:
// out = sum_s exp(lse_s - lse) out_s, lse = log(sum_s exp(lse_s)). out_s: num_states x dim,
// lse_s: num_states. States with lse = -inf contribute nothing.
void merge_states(int num_states, int dim, const double* outs, const double* lses, double* out,
                  double* lse);

// Visibility predicates, brute force (the oracle's definition).
// Dense mask: query row i, key column j of a sequence with seqlen_q x seqlen_k.
bool dense_visible(const MaskParams& m, int64_t i, int64_t j, int64_t seqlen_q, int64_t seqlen_k);
// Element predicate of a block-sparse mask's partial blocks (absolute positions).
bool element_visible(const ElementMask& m, int64_t b, int64_t h, int64_t i, int64_t j,
                     int64_t seqlen_k);
// Block-sparse mask: full block -> visible; partial block -> element predicate; else masked.
bool block_sparse_visible(const BlockMask& m, int64_t b, int64_t h, int64_t i, int64_t j,
                          int64_t seqlen_k);

}  // namespace flare::ref
