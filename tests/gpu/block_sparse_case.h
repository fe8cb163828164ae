// Block-sparse GPU test cases, shared by test_block_sparse.cu and test_block_sparse_fuzz.cu: a
// case (shapes, dtype, mask kind, block sizes, broadcast), its element predicates and host-built
// block mask with their device copies, and the forward oracle over that mask.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "flare/block_mask.h"
#include "flare_instantiated.h"
#include "src/attention/portable/head_dims.h"
#include "src/block_sparse/block_mask_build.h"
#include "tests/gpu/attention_case.h"

namespace flare::test {

using block_sparse::BlockKindGrid;
using block_sparse::BlockMaskGeometry;
using block_sparse::HostBlockMask;
using block_sparse::TileKind;

// ---- masks ---------------------------------------------------------------------------------------

enum class MaskKind { kRandomBlocks, kCausal, kWindow, kDocuments, kPrefixLm, kBits, kCount };

inline const char* mask_kind_name(MaskKind k) {
  switch (k) {
    case MaskKind::kRandomBlocks: return "random-blocks";
    case MaskKind::kCausal: return "causal";
    case MaskKind::kWindow: return "window";
    case MaskKind::kDocuments: return "documents";
    case MaskKind::kPrefixLm: return "prefix-lm";
    case MaskKind::kBits: return "bits";
    case MaskKind::kCount: break;
  }
  return "?";
}

struct SparseCase {
  AttnCase attn;  // shapes, dtype, dense mask (composed with the block mask), softcap, sinks, seed
  MaskKind kind = MaskKind::kCausal;
  int q_block = 128, kv_block = 128;
  bool broadcast_batch = false, broadcast_heads = false;  // the mask's dims 1
  // kDocuments: odd batch entries' ids recur in separate runs (not sorted: the Hopper forward looks
  // them up there, and narrows the even entries' rows to their document spans).
  bool recurring_documents = false;

  std::string name() const {
    std::ostringstream s;
    s << mask_kind_name(kind) << (recurring_documents ? " recurring" : "") << " blocks " << q_block << "x" << kv_block << (broadcast_batch ? " bcast-b" : "")
      << (broadcast_heads ? " bcast-h" : "") << " | " << attn.name();
    return s.str();
  }
};

// The Hopper block-sparse forward takes a case when this build has it, the device is an sm_90 and
// the mask's blocks suit its tiles (q blocks of 128 rows or a multiple, kv blocks a multiple of its
// key tile: 128 up to head dim 128, 64 above); it refuses the others.
inline bool hopper_sparse_runs(const SparseCase& c) {
#ifdef FLARE_HAS_HOPPER
  const int kv_tile = portable::instantiated_head_dim(c.attn.head_dim) <= 128 ? 128 : 64;
  return hopper_device() && c.q_block % 128 == 0 && c.kv_block % kv_tile == 0;
#else
  (void)c;
  return false;
#endif
}

// The Hopper block-sparse backward (asked for with Backend::kHopper; kAuto keeps block masks on
// the portable kernel), ordinary and deterministic: head dims up to 128, q blocks a multiple of 64
// rows, kv blocks a multiple of 128 keys, no soft-capping.
inline bool hopper_sparse_backward_runs(const SparseCase& c) {
#ifdef FLARE_HAS_HOPPER
  return hopper_device() && portable::instantiated_head_dim(c.attn.head_dim) <= 128 && c.q_block % 64 == 0 &&
         c.kv_block % 128 == 0 && c.attn.softcap == 0.f;
#else
  (void)c;
  return false;
#endif
}

// A CPU int32 tensor with its device copy.
struct IntTensor {
  ref::HostTensor host;
  std::unique_ptr<DeviceTensor> dev;

  void make(std::vector<int64_t> shape) {
    host.reset(DType::kInt32, std::move(shape));
    dev = std::make_unique<DeviceTensor>(host);
  }
  int32_t* data() { return static_cast<int32_t*>(host.data()); }
  void upload() { dev->upload(host); }
  void download() { dev->download(host); }
};

// The deterministic backward's plan of a mask (made from its host copy) and the plan's data on
// the device.
struct DqPlanOnDevice {
  BlockSparseDqPlan plan;
  IntTensor data;

  Status make(const BlockMask& host_mask, int batch, int heads, int heads_kv, int seqlen_q, int seqlen_k) {
    const Status s = make_block_sparse_dq_plan(host_mask, batch, heads, heads_kv, seqlen_q, seqlen_k, &plan);
    if (!s.ok()) return s;
    data.make({static_cast<int64_t>(plan.data.size())});
    std::copy(plan.data.begin(), plan.data.end(), data.data());
    data.upload();
    return Status::Ok();
  }
  void attach(AttentionBackwardParams* p) const {
    p->block_mask_dq_plan = &plan;
    p->block_mask_dq_plan_data = static_cast<const int32_t*>(data.dev->view().data);
  }
};

// The element predicates of a mask kind and the tensors they read (host and device copies).
struct ElementTensors {
  ElementMask host, device;
  IntTensor doc_q, doc_k, bits;
};

inline void make_element_mask(const SparseCase& c, int mask_batch, int mask_heads, std::mt19937_64& rng,
                              ElementTensors* out) {
  const int sq = c.attn.seqlen_q, sk = c.attn.seqlen_k;
  ElementMask e;
  switch (c.kind) {
    case MaskKind::kCausal:
      e.causal = true;
      break;
    case MaskKind::kWindow:
      e.window_left = static_cast<int>(rng() % 300);
      e.window_right = rng() % 2 ? 0 : static_cast<int>(rng() % 100);
      break;
    case MaskKind::kPrefixLm:
      e.prefix_length = static_cast<int>(rng() % (sk + 1));
      break;
    case MaskKind::kDocuments: {
      // Sorted documents of random lengths, the same boundaries on both sides (FlexAttention's
      // document mask); per batch entry different ones.
      out->doc_q.make({c.attn.batch, sq});
      out->doc_k.make({c.attn.batch, sk});
      for (int b = 0; b < c.attn.batch; ++b) {
        int doc = 0;
        std::vector<int32_t> ids(std::max(sq, sk));
        for (int t = 0; t < static_cast<int>(ids.size()); ++t) {
          if (t > 0 && rng() % 97 == 0) ++doc;
          ids[t] = c.recurring_documents && b % 2 == 1 ? doc % 3 : doc;
        }
        std::memcpy(out->doc_q.data() + int64_t{b} * sq, ids.data(), sizeof(int32_t) * sq);
        std::memcpy(out->doc_k.data() + int64_t{b} * sk, ids.data(), sizeof(int32_t) * sk);
      }
      e.causal = rng() % 2;
      break;
    }
    case MaskKind::kBits:
    case MaskKind::kRandomBlocks: {
      const int words = (sk + 31) / 32;
      out->bits.make({mask_batch, mask_heads, sq, words});
      // A random pattern with long runs, so that some blocks come out full or empty.
      const int64_t n = out->bits.host.numel();
      for (int64_t w = 0; w < n; ++w) {
        const int r = static_cast<int>(rng() % 8);
        out->bits.data()[w] = r < 3 ? 0 : (r < 6 ? -1 : static_cast<int32_t>(rng()));
      }
      break;
    }
    case MaskKind::kCount:
      break;
  }
  out->host = e;
  out->device = e;
  for (auto [t, host_view, dev_view] :
       {std::tuple{&out->doc_q, &out->host.doc_ids_q, &out->device.doc_ids_q},
        std::tuple{&out->doc_k, &out->host.doc_ids_k, &out->device.doc_ids_k},
        std::tuple{&out->bits, &out->host.bits, &out->device.bits}}) {
    if (!t->dev) continue;
    t->upload();
    *host_view = t->host.view();
    *dev_view = t->dev->view();
  }
}

// A host-built mask (the oracle reads its CPU views) and its device copy.
struct SparseMask {
  ElementTensors element;
  HostBlockMask host;
  std::vector<std::unique_ptr<IntTensor>> lists;
  BlockMask host_view, device_view;

  void upload() {
    host_view = host.view();
    host_view.element = element.host;
    device_view = host_view;
    device_view.element = element.device;
    for (auto [src, dst] : {std::pair{&host_view.kv_num_blocks, &device_view.kv_num_blocks},
                            {&host_view.kv_indices, &device_view.kv_indices},
                            {&host_view.full_kv_num_blocks, &device_view.full_kv_num_blocks},
                            {&host_view.full_kv_indices, &device_view.full_kv_indices},
                            {&host_view.q_num_blocks, &device_view.q_num_blocks},
                            {&host_view.q_indices, &device_view.q_indices},
                            {&host_view.full_q_num_blocks, &device_view.full_q_num_blocks},
                            {&host_view.full_q_indices, &device_view.full_q_indices}}) {
      auto t = std::make_unique<IntTensor>();
      t->make(std::vector<int64_t>(src->shape, src->shape + src->rank));
      std::memcpy(t->data(), src->data, t->host.nbytes());
      t->upload();
      *dst = t->dev->view();
      lists.push_back(std::move(t));
    }
  }
};

inline BlockMaskGeometry geometry_of(const SparseCase& c) {
  BlockMaskGeometry g;
  g.batch = c.broadcast_batch ? 1 : c.attn.batch;
  g.heads = c.broadcast_heads ? 1 : c.attn.heads;
  g.seqlen_q = c.attn.seqlen_q;
  g.seqlen_k = c.attn.seqlen_k;
  g.q_block_size = c.q_block;
  g.kv_block_size = c.kv_block;
  return g;
}

// Random block kinds (about a third each), the bits as the partial blocks' predicate.
inline void build_random_blocks(const SparseCase& c, std::mt19937_64& rng, SparseMask* m) {
  const BlockMaskGeometry g = geometry_of(c);
  BlockKindGrid kinds = BlockKindGrid::all_empty(g.batch, g.heads, g.num_q_blocks(), g.num_kv_blocks());
  for (TileKind& k : kinds.kinds) k = static_cast<TileKind>(rng() % 3);
  ASSERT_TRUE(block_sparse::build_from_kinds(kinds, g, m->element.host, &m->host).ok());
}

inline void build_mask(const SparseCase& c, SparseMask* m) {
  std::mt19937_64 rng(c.attn.seed * 7919 + 13);
  // Documents are per batch entry; a batch-broadcast mask cannot follow them.
  SparseCase cc = c;
  if (c.kind == MaskKind::kDocuments) cc.broadcast_batch = false;
  const BlockMaskGeometry g = geometry_of(cc);
  make_element_mask(cc, g.batch, g.heads, rng, &m->element);
  if (c.kind == MaskKind::kRandomBlocks) {
    build_random_blocks(cc, rng, m);
  } else {
    const Status s = block_sparse::build_from_element_mask(m->element.host, g, &m->host);
    ASSERT_TRUE(s.ok()) << s.message();
  }
  m->upload();
}

// Whether this build has the case's kernels: its dtype (FLARE_DTYPES) and a head dim at least as
// large as the case's (FLARE_HEAD_DIMS; the library serves a head dim with the smallest
// instantiated one that holds it). A full build has them all.
inline bool instantiated(const AttnCase& c) {
#ifndef FLARE_HAS_DTYPE_fp16
  if (c.dtype == DType::kFloat16) return false;
#endif
#ifndef FLARE_HAS_DTYPE_bf16
  if (c.dtype == DType::kBFloat16) return false;
#endif
  return portable::instantiated_head_dim(c.head_dim) != 0;
}

// The oracle's forward (exact, and in the input dtype) of `prob` with the case's dense mask,
// softcap and sinks and `mask`'s CPU views, into prob->out_ref / out_lowp / lse_ref / lse_lowp.
// CPU only: safe to run for different problems on different threads.
inline void run_sparse_forward_oracle(const SparseCase& c, const SparseMask& mask, AttnProblem* prob) {
  prob->out_ref.reset(DType::kFloat64, prob->q_shape);
  prob->out_lowp.reset(DType::kFloat64, prob->q_shape);
  prob->lse_ref.reset(DType::kFloat64, prob->lse_shape);
  prob->lse_lowp.reset(DType::kFloat64, prob->lse_shape);
  AttentionForwardParams r;
  r.q = prob->q;
  r.k = prob->k;
  r.v = prob->v;
  r.mask = c.attn.mask;
  r.softcap = c.attn.softcap;
  if (c.attn.sinks) r.sinks = prob->sinks;
  r.block_mask = &mask.host_view;
  r.out = prob->out_ref;
  r.lse = prob->lse_ref;
  ASSERT_TRUE(ref::attention_forward(r).ok());
  r.out = prob->out_lowp;
  r.lse = prob->lse_lowp;
  ASSERT_TRUE(ref::attention_forward(r, {true}).ok());
}

}  // namespace flare::test
