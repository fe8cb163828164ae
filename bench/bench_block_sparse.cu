// Block-sparse attention in the C++ harness: issue 6's configuration (bf16, batch 2, 16 heads,
// head dim 128, seqlen 8192 or --seqlen N, 128 x 128 blocks) and masks (causal, causal sliding
// window 1024, 8 documents of random lengths, 25 % random full blocks), every block-sparse kernel
// this build and device have (forward portable / Hopper; backward portable / Hopper, ordinary and
// deterministic), beside the dense kernels on the masks a band expresses (causal, window). Masks
// are built on the GPU (build_block_mask); the deterministic plans from a host copy of the lists.
//
// What it is for: the kernels' own times (CUDA events, L2 flushed, median) without the Python
// binding's per-call overhead, and the sparse walk's cost against the dense kernel on the same
// mask. FLOPs on the visible pairs. Checks: the Hopper forward against the portable one, the
// Hopper backward's gradients against the portable backward's (relative L2), the deterministic
// modes bitwise over two runs.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "bench/common/bench_common.h"
#include "src/attention/hopper/fwd_timeline.h"  // FLARE_HOPPER_FWD_TIMELINE builds
#include "flare/attention.h"
#include "flare/block_mask.h"

namespace flare::bench {
namespace {

constexpr int kBatch = 2, kHeads = 16, kHeadDim = 128, kBlock = 128, kWindow = 1024, kDocuments = 8;
constexpr double kMaxRelError = 2e-2;

enum class MaskKind { kCausal, kWindow, kDocuments, kRandom };
const char* mask_name(MaskKind k) {
  switch (k) {
    case MaskKind::kCausal: return "causal";
    case MaskKind::kWindow: return "window";
    case MaskKind::kDocuments: return "documents";
    case MaskKind::kRandom: return "random";
  }
  return "?";
}

template <typename T>
T* device_alloc(int64_t n) {
  T* p = nullptr;
  FLARE_BENCH_CHECK(cudaMalloc(&p, std::max<int64_t>(n, 1) * sizeof(T)));
  return p;
}

// A mask built on the GPU, its lists' device storage, and (for the deterministic backward) a host
// copy of the lists, the plan made from it and the plan's device copy.
struct Mask {
  BlockMask device;
  std::vector<std::vector<int32_t>> host_lists;
  BlockSparseDqPlan plan;
  int32_t* plan_data = nullptr;
  int64_t visible_pairs = 0;  // per (batch, head)
  std::vector<void*> owned;
  ~Mask() {
    for (void* p : owned) cudaFree(p);
    if (plan_data) cudaFree(plan_data);
  }
};

// Lengths of `count` documents of at least 1 token summing to seqlen, cut at random points.
std::vector<int> document_lengths(int seqlen, int count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int> cuts;
  while (static_cast<int>(cuts.size()) < count - 1) {
    const int c = 1 + static_cast<int>(rng() % (seqlen - 1));
    if (std::find(cuts.begin(), cuts.end(), c) == cuts.end()) cuts.push_back(c);
  }
  std::sort(cuts.begin(), cuts.end());
  std::vector<int> lengths;
  int prev = 0;
  for (int c : cuts) lengths.push_back(c - prev), prev = c;
  lengths.push_back(seqlen - prev);
  return lengths;
}

void build_mask(MaskKind kind, int seqlen, cudaStream_t stream, Mask* m) {
  const int nb = (seqlen + kBlock - 1) / kBlock;
  BlockMaskBuildParams bp;
  bp.batch = kind == MaskKind::kDocuments ? kBatch : 1;  // documents need the real batch
  bp.heads = 1;
  bp.seqlen_q = bp.seqlen_k = seqlen;
  bp.q_block_size = bp.kv_block_size = kBlock;
  bp.stream = stream;
  const int64_t s = seqlen;
  switch (kind) {
    case MaskKind::kCausal:
      bp.element.causal = true;
      m->visible_pairs = s * (s + 1) / 2;
      break;
    case MaskKind::kWindow: {
      bp.element.causal = true;
      bp.element.window_left = kWindow;
      const int64_t w = std::min<int64_t>(kWindow, s - 1);
      m->visible_pairs = (w + 1) * (w + 2) / 2 + (s - w - 1) * (w + 1);
      break;
    }
    case MaskKind::kDocuments: {
      std::vector<int32_t> ids;
      const std::vector<int> lengths = document_lengths(seqlen, kDocuments, 0);
      for (int d = 0; d < static_cast<int>(lengths.size()); ++d) ids.insert(ids.end(), lengths[d], d);
      std::vector<int32_t> batch_ids;
      for (int b = 0; b < kBatch; ++b) batch_ids.insert(batch_ids.end(), ids.begin(), ids.end());
      int32_t* dev = device_alloc<int32_t>(batch_ids.size());
      m->owned.push_back(dev);
      FLARE_BENCH_CHECK(cudaMemcpy(dev, batch_ids.data(), batch_ids.size() * 4, cudaMemcpyHostToDevice));
      bp.element.doc_ids_q = bp.element.doc_ids_k = TensorView::contiguous(dev, DType::kInt32, {kBatch, seqlen});
      m->visible_pairs = 0;
      for (int n : lengths) m->visible_pairs += int64_t{n} * n;
      break;
    }
    case MaskKind::kRandom: {  // whole 128 x 128 blocks as bit words: the builder lists them FULL
      std::mt19937_64 rng(0);
      std::vector<uint8_t> on(static_cast<size_t>(nb) * nb, 0);
      const int count = static_cast<int>(std::lround(0.25 * nb * nb));
      for (int set = 0; set < count;) {
        uint8_t& b = on[rng() % on.size()];
        if (!b) b = 1, ++set;
      }
      const int words = (seqlen + 31) / 32;
      std::vector<uint32_t> bits(static_cast<size_t>(seqlen) * words, 0);
      m->visible_pairs = 0;
      for (int i = 0; i < seqlen; ++i)
        for (int j = 0; j < seqlen; ++j)
          if (on[static_cast<size_t>(i / kBlock) * nb + j / kBlock]) {
            bits[static_cast<size_t>(i) * words + j / 32] |= 1u << (j % 32);
            ++m->visible_pairs;
          }
      uint32_t* dev = device_alloc<uint32_t>(bits.size());
      m->owned.push_back(dev);
      FLARE_BENCH_CHECK(cudaMemcpy(dev, bits.data(), bits.size() * 4, cudaMemcpyHostToDevice));
      bp.element.bits = TensorView::contiguous(dev, DType::kInt32, {1, 1, seqlen, words});
      break;
    }
  }
  // The lists: counts [B, 1, rows], indices [B, 1, rows, cols], forward and transposed.
  TensorView* views[8] = {&m->device.kv_num_blocks, &m->device.kv_indices, &m->device.full_kv_num_blocks,
                          &m->device.full_kv_indices, &m->device.q_num_blocks, &m->device.q_indices,
                          &m->device.full_q_num_blocks, &m->device.full_q_indices};
  for (int i = 0; i < 8; ++i) {
    const bool counts = i % 2 == 0;
    const int64_t n = int64_t{bp.batch} * nb * (counts ? 1 : nb);
    int32_t* dev = device_alloc<int32_t>(n);
    m->owned.push_back(dev);
    *views[i] = counts ? TensorView::contiguous(dev, DType::kInt32, {bp.batch, 1, nb})
                       : TensorView::contiguous(dev, DType::kInt32, {bp.batch, 1, nb, nb});
  }
  check_ok(build_block_mask(bp, &m->device), std::string("build_block_mask ") + mask_name(kind));
  FLARE_BENCH_CHECK(cudaStreamSynchronize(stream));

  // The deterministic plan, from a host copy of the lists.
  BlockMask host = m->device;
  m->host_lists.resize(8);
  TensorView* host_views[8] = {&host.kv_num_blocks, &host.kv_indices, &host.full_kv_num_blocks, &host.full_kv_indices,
                               &host.q_num_blocks, &host.q_indices, &host.full_q_num_blocks, &host.full_q_indices};
  for (int i = 0; i < 8; ++i) {
    std::vector<int32_t>& v = m->host_lists[i];
    v.resize(views[i]->numel());
    FLARE_BENCH_CHECK(cudaMemcpy(v.data(), views[i]->data, v.size() * 4, cudaMemcpyDeviceToHost));
    host_views[i]->data = v.data();
    host_views[i]->device = Device{DeviceKind::kCPU, 0};
  }
  host.element = ElementMask{};  // the plan reads the lists only
  check_ok(make_block_sparse_dq_plan(host, kBatch, kHeads, kHeads, seqlen, seqlen, &m->plan), "dq plan");
  m->plan_data = device_alloc<int32_t>(m->plan.data.size());
  FLARE_BENCH_CHECK(cudaMemcpy(m->plan_data, m->plan.data.data(), m->plan.data.size() * 4, cudaMemcpyHostToDevice));
}

struct Buffers {
  __nv_bfloat16 *q, *k, *v, *out, *out2, *dout, *dq, *dk, *dv, *dq2, *dk2, *dv2;
  float* lse;
  GrowingDeviceBuffer workspace;
  int64_t n = 0;
};

// q, k, v, out and the gradients as [batch, seqlen, heads, head_dim] views. FLARE_BENCH_LAYOUT=bhsd
// lays each buffer out as FlexAttention's tensors are, [batch, heads, seqlen, head_dim] (the view
// is then strided, as flare.flex_attention passes it): whether the layout is what separates the
// Python-timed forward from this harness's (session 12: 5-25 %).
bool bhsd_layout() {
  static const bool bhsd = [] {
    const char* e = std::getenv("FLARE_BENCH_LAYOUT");
    return e != nullptr && std::string(e) == "bhsd";
  }();
  return bhsd;
}

TensorView view_of(void* p, int seqlen) {
  TensorView t = TensorView::contiguous(p, DType::kBFloat16, {kBatch, seqlen, kHeads, kHeadDim});
  if (bhsd_layout()) {
    t.stride[0] = int64_t{kHeads} * seqlen * kHeadDim;
    t.stride[1] = kHeadDim;
    t.stride[2] = int64_t{seqlen} * kHeadDim;
    t.stride[3] = 1;
  }
  return t;
}

AttentionForwardParams forward_params(const Buffers& b, int seqlen, const BlockMask* mask, const MaskParams& dense,
                                      Backend backend, void* out, cudaStream_t stream) {
  AttentionForwardParams p;
  p.q = view_of(b.q, seqlen);
  p.k = view_of(b.k, seqlen);
  p.v = view_of(b.v, seqlen);
  p.out = view_of(out, seqlen);
  p.lse = TensorView::contiguous(b.lse, DType::kFloat32, {kBatch, kHeads, seqlen});
  p.block_mask = mask;
  p.mask = dense;
  p.backend = backend;
  p.stream = stream;
  return p;
}

AttentionBackwardParams backward_params(Buffers& b, int seqlen, const AttentionForwardParams& f, const Mask* mask,
                                        Backend backend, bool deterministic, void* dq, void* dk, void* dv) {
  AttentionBackwardParams p;
  p.q = f.q, p.k = f.k, p.v = f.v, p.out = f.out, p.lse = f.lse;
  p.dout = view_of(b.dout, seqlen);
  p.dq = view_of(dq, seqlen);
  p.dk = view_of(dk, seqlen);
  p.dv = view_of(dv, seqlen);
  p.mask = f.mask;
  p.block_mask = mask ? &mask->device : nullptr;
  p.deterministic = deterministic;
  if (deterministic && mask) {
    p.block_mask_dq_plan = &mask->plan;
    p.block_mask_dq_plan_data = mask->plan_data;
  }
  p.backend = backend;
  p.stream = f.stream;
  size_t need = 0;
  if (attention_backward_workspace_size(p, &need).ok()) b.workspace.reserve(need);
  p.workspace = b.workspace.data;
  p.workspace_bytes = b.workspace.bytes;
  return p;
}

std::vector<uint16_t> download(const void* p, int64_t n) {
  std::vector<uint16_t> v(n);
  FLARE_BENCH_CHECK(cudaMemcpy(v.data(), p, n * 2, cudaMemcpyDeviceToHost));
  return v;
}

int run(int argc, char** argv) {
  Args args = parse_args_or_exit(argc, argv);
  require_cuda_device_or_exit();
  const int seqlen = args.seqlen.value_or(8192);
  cudaStream_t stream;
  FLARE_BENCH_CHECK(cudaStreamCreate(&stream));

  if (bhsd_layout()) std::printf("operands laid out [batch, heads, seqlen, head_dim] (FLARE_BENCH_LAYOUT=bhsd)\n");
  Buffers b;
  b.n = int64_t{kBatch} * seqlen * kHeads * kHeadDim;
  for (__nv_bfloat16** p : {&b.q, &b.k, &b.v, &b.out, &b.out2, &b.dout, &b.dq, &b.dk, &b.dv, &b.dq2, &b.dk2, &b.dv2})
    *p = device_alloc<__nv_bfloat16>(b.n);
  b.lse = device_alloc<float>(int64_t{kBatch} * kHeads * seqlen);
  fill_normal_bf16(b.q, b.n, 1, stream);
  fill_normal_bf16(b.k, b.n, 2, stream);
  fill_normal_bf16(b.v, b.n, 3, stream);
  fill_normal_bf16(b.dout, b.n, 4, stream);

  Table table;
  std::vector<Record> records;
  bool all_ok = true;
  const TimingOptions fwd_timing = args.timing({.warmup = 5, .repeats = 30});
  const TimingOptions bwd_timing = args.timing({.warmup = 3, .repeats = 20});
  for (MaskKind kind : {MaskKind::kCausal, MaskKind::kWindow, MaskKind::kDocuments, MaskKind::kRandom}) {
    const std::string mname = mask_name(kind);
    if (!args.selected(mname)) continue;
    Mask mask;
    build_mask(kind, seqlen, stream, &mask);
    const double flops = attention_flops_from_pairs(mask.visible_pairs, int64_t{kBatch} * kHeads, kHeadDim);
    MaskParams none;
    // The dense kernels on the same mask where a band expresses it (bottom-right = top-left here).
    MaskParams band;
    band.causal = true;
    if (kind == MaskKind::kWindow) band.window_left = kWindow;
    const bool has_dense = kind == MaskKind::kCausal || kind == MaskKind::kWindow;

    struct Variant {
      const char* name;
      const BlockMask* mask;
      MaskParams dense;
      Backend backend;
    };
    std::vector<Variant> variants = {{"sparse portable", &mask.device, none, Backend::kPortable},
                                     {"sparse hopper", &mask.device, none, Backend::kHopper}};
    if (has_dense) {
      variants.push_back({"dense portable", nullptr, band, Backend::kPortable});
      variants.push_back({"dense hopper", nullptr, band, Backend::kHopper});
    }
    // FLARE_BENCH_SKIP_PORTABLE=1: the Hopper kernels alone (A/B rounds); the first one left is the
    // others' reference.
    static const bool skip_portable = std::getenv("FLARE_BENCH_SKIP_PORTABLE") != nullptr;
    if (skip_portable)
      std::erase_if(variants, [](const Variant& v) { return v.backend == Backend::kPortable; });
    bool have_reference_fwd = false;
    for (const Variant& var : variants) {
      const std::string name = mname + " " + var.name;
      AttentionForwardParams f = forward_params(b, seqlen, var.mask, var.dense, var.backend, b.out2, stream);
      FLARE_BENCH_CHECK(cudaMemsetAsync(b.out2, 0xFF, b.n * 2, stream));
      Status s = attention_forward(f);
      if (!s.ok()) {
        std::printf("%s forward: %s\n", name.c_str(), s.message().c_str());
        if (var.backend == Backend::kPortable) all_ok = false;
        continue;
      }
      // The first forward (the portable sparse one, unless skipped) is the others' reference;
      // the backward below starts from the portable sparse forward's output.
      std::string check = "ref";
      double rel = 0;
      if (!have_reference_fwd) {
        FLARE_BENCH_CHECK(cudaMemcpyAsync(b.out, b.out2, b.n * 2, cudaMemcpyDeviceToDevice, stream));
        have_reference_fwd = true;
      } else {
        const ErrorStats err = compare_bf16(b.out2, b.out, b.n, stream);
        rel = err.rel_l2;
        const bool ok = rel < kMaxRelError && std::isfinite(err.max_abs);
        all_ok &= ok;
        check = ok ? "ok" : "FAIL";
      }
      const Timing t = time_kernel([&](cudaStream_t st) {
        f.stream = st;
        if (!attention_forward(f).ok()) std::abort();
      }, fwd_timing, stream);
      table.add_row({{"case", name + " fwd"}, {"ms", Table::Cell(t.median_ms, 3)},
                     {"TFLOP/s", Table::Cell(tflops(flops, t.median_ms), 1)}, {"rel vs portable", Table::Cell(rel, 5)},
                     {"check", check}});
      records.push_back({name + " fwd", {{"median_ms", t.median_ms}, {"tflops", tflops(flops, t.median_ms)}},
                         {{"mask", mname}, {"variant", var.name}, {"seqlen", std::to_string(seqlen)}}});
#if FLARE_HOPPER_FWD_TIMELINE
      if (var.backend == Backend::kHopper) {  // one more launch, stamped (src/attention/hopper/fwd_timeline.h)
        flare::hopper::fwd_timeline_reset(stream);
        f.stream = stream;
        if (!attention_forward(f).ok()) std::abort();
        std::printf("%s fwd %s", name.c_str(), flare::hopper::fwd_timeline_summary().c_str());
      }
#endif
    }
    // FLARE_BENCH_FWD_ONLY=1: the forwards alone (tools/block-sparse-check's A/B rounds).
    static const bool forward_only = std::getenv("FLARE_BENCH_FWD_ONLY") != nullptr;
    if (!have_reference_fwd || forward_only) continue;
    // The backward from the portable sparse forward's out and LSE (run it again: the LSE).
    AttentionForwardParams f = forward_params(b, seqlen, &mask.device, none, Backend::kPortable, b.out, stream);
    check_ok(attention_forward(f), "portable sparse forward");
    struct BwdVariant {
      const char* name;
      bool sparse;
      Backend backend;
      bool deterministic;
    };
    std::vector<BwdVariant> bwd = {{"sparse portable", true, Backend::kPortable, false},
                                   {"sparse portable det", true, Backend::kPortable, true},
                                   {"sparse hopper", true, Backend::kHopper, false},
                                   {"sparse hopper det", true, Backend::kHopper, true}};
    if (has_dense) {
      bwd.push_back({"dense hopper", false, Backend::kHopper, false});
      bwd.push_back({"dense hopper det", false, Backend::kHopper, true});
    }
    if (skip_portable) std::erase_if(bwd, [](const BwdVariant& v) { return v.backend == Backend::kPortable; });
    bool have_reference = false;
    double ordinary_ms[2] = {0, 0};  // portable, hopper: the det/ord ratios
    for (const BwdVariant& var : bwd) {
      const std::string name = mname + " " + var.name;
      AttentionForwardParams fv = f;
      if (!var.sparse) fv.block_mask = nullptr, fv.mask = band;
      AttentionBackwardParams p = backward_params(b, seqlen, fv, var.sparse ? &mask : nullptr, var.backend,
                                                  var.deterministic, b.dq2, b.dk2, b.dv2);
      Status s = attention_backward(p);
      if (!s.ok()) {
        std::printf("%s backward: %s\n", name.c_str(), s.message().c_str());
        if (var.backend == Backend::kPortable) all_ok = false;
        continue;
      }
      std::string check = "ref";
      double rel = 0;
      if (!have_reference) {
        for (auto [src, dst] : {std::pair{b.dq2, b.dq}, {b.dk2, b.dk}, {b.dv2, b.dv}})
          FLARE_BENCH_CHECK(cudaMemcpyAsync(dst, src, b.n * 2, cudaMemcpyDeviceToDevice, stream));
        have_reference = true;
      } else {
        for (auto [got, want] : {std::pair{b.dq2, b.dq}, {b.dk2, b.dk}, {b.dv2, b.dv}})
          rel = std::max(rel, compare_bf16(got, want, b.n, stream).rel_l2);
        const bool ok = rel < kMaxRelError;
        all_ok &= ok;
        check = ok ? "ok" : "FAIL";
      }
      if (var.deterministic) {  // a second run's dQ, bitwise equal to the first's
        const std::vector<uint16_t> first = download(b.dq2, b.n);
        check_ok(attention_backward(p), name);
        FLARE_BENCH_CHECK(cudaStreamSynchronize(stream));
        const bool same = download(b.dq2, b.n) == first;
        all_ok &= same;
        if (!same) check = "NOT BITWISE";
      }
      const Timing t = time_kernel([&](cudaStream_t st) {
        p.stream = st;
        if (!attention_backward(p).ok()) std::abort();
      }, bwd_timing, stream);
      const int which = var.backend == Backend::kHopper ? 1 : 0;
      if (var.sparse && !var.deterministic) ordinary_ms[which] = t.median_ms;
      const double det_ratio =
          var.sparse && var.deterministic && ordinary_ms[which] > 0 ? ordinary_ms[which] / t.median_ms : 0;
      table.add_row({{"case", name + " bwd"}, {"ms", Table::Cell(t.median_ms, 3)},
                     {"TFLOP/s", Table::Cell(tflops(2.5 * flops, t.median_ms), 1)},
                     {"rel vs portable", Table::Cell(rel, 5)}, {"det/ord", Table::Cell(det_ratio, 2)},
                     {"check", check}});
      records.push_back({name + " bwd",
                         {{"median_ms", t.median_ms}, {"tflops", tflops(2.5 * flops, t.median_ms)},
                          {"det_over_ordinary", det_ratio}},
                         {{"mask", mname}, {"variant", var.name}, {"seqlen", std::to_string(seqlen)}}});
    }
  }
  table.print();
  if (!args.json_path.empty()) write_json(args.json_path, records);
  std::printf(all_ok ? "all checks passed\n" : "SOME CHECKS FAILED\n");
  return all_ok ? 0 : 1;
}

}  // namespace
}  // namespace flare::bench

int main(int argc, char** argv) { return flare::bench::run(argc, argv); }
