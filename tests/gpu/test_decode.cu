// The decode kernels (standard, split-KV + combine) and merge_states against the CPU oracles:
// every head dim x dtype x cache layout (contiguous, pages of 16 and 64) x q_len {1, 4, 8} x
// window on/off x GQA ratio {1, 4, 8}, each problem run with the standard kernel, forced split
// counts and the heuristic's plan; batches of different cache lengths (1, 15, 16, 17, 4095,
// page-crossing ends); large and odd query groups (several row blocks); non-causal rows with
// empty caches; strided caches; a CUDA graph replayed with changing cache lengths; bad inputs.
// Every plan runs on each engine (key groups with the in-kernel, the separate and the cluster
// combine, head warps, portable); the key-group kernel's heads per CTA, split counts up to 128
// and the four combines have their own test (the cluster combine in clusters of 2, 7 and 16 CTAs,
// the in-kernel combine past 16 splits).
//
// Outputs and the workspace are poisoned (NaN), cache rows past each sequence's length are NaN
// and unused page-table entries point far outside the cache, so a kernel that writes too little
// or reads too much fails. Error rule (tests/gpu/gpu_harness.h): |out - oracle| <= 2 x the error
// of the same math in the input dtype (exact scores, P rounded to the dtype for P V, output
// rounded) + a small absolute term; LSEs within fp32 accuracy.
// FLARE_TEST_REDUCED=1 runs a small subset (for compute-sanitizer).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "flare/decode.h"
#include "flare/decode_plan.h"
#include "flare_instantiated.h"
#include "reference/attention_ref.h"
#include "reference/host_tensor.h"
#include "tests/gpu/gpu_harness.h"

namespace flare::test {
namespace {

using ref::HostTensor;


bool instantiated(int head_dim, DType dtype) {
  bool dim = false, type = false;
#ifdef FLARE_HAS_HEAD_DIM_64
  dim |= head_dim == 64;
#endif
#ifdef FLARE_HAS_HEAD_DIM_128
  dim |= head_dim == 128;
#endif
#ifdef FLARE_HAS_HEAD_DIM_256
  dim |= head_dim == 256;
#endif
#ifdef FLARE_HAS_DTYPE_bf16
  type |= dtype == DType::kBFloat16;
#endif
#ifdef FLARE_HAS_DTYPE_fp16
  type |= dtype == DType::kFloat16;
#endif
  return dim && type;
}

int num_sms() {
  int device = 0, n = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
  return n > 0 ? n : 1;
}

// Raw device memory (the workspace), poisoned on request.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0 && cudaMalloc(&ptr_, bytes_) != cudaSuccess) ptr_ = nullptr;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  void poison() {
    if (ptr_) cudaMemset(ptr_, 0xFF, bytes_);
  }
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// A page id far outside any test cache: a kernel that follows an unused page-table entry faults.
constexpr int32_t kUnusedPage = 1 << 28;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

struct DecodeCase {
  int head_dim = 128;
  DType dtype = DType::kBFloat16;
  int heads_kv = 2, group = 4, q_len = 1;
  int page_size = 0;  // 0: contiguous cache
  bool causal = true;
  int window_left = -1;
  std::vector<int> seqlens;    // cache_seqlens, one per sequence
  std::vector<int> allocated;  // tokens backed by cache storage per sequence (default: seqlens)
  int extra_capacity = 0;      // contiguous: extra rows past the longest; paged: extra page-table columns
  float softmax_scale = 0.f;
  bool with_lse = true;
  bool interleaved_kv = false;  // contiguous K and V as slices of one [batch, len, 2, heads_kv, d] buffer
  uint64_t seed = 1;

  int batch() const { return static_cast<int>(seqlens.size()); }
  int heads_q() const { return heads_kv * group; }
  std::string name() const {
    std::ostringstream s;
    s << "d" << head_dim << (dtype == DType::kBFloat16 ? " bf16" : " fp16") << " hkv" << heads_kv << " group"
      << group << " q_len" << q_len << (page_size ? " page" + std::to_string(page_size) : std::string(" contiguous"))
      << (causal ? " causal" : " non-causal") << " window " << window_left << " scale " << softmax_scale << " lens {";
    for (size_t i = 0; i < seqlens.size(); ++i) s << (i ? "," : "") << seqlens[i];
    s << "}" << (interleaved_kv ? " interleaved" : "") << (with_lse ? "" : " no-lse") << " seed " << seed;
    return s.str();
  }
};

// Random inputs on the host and the device, the oracle's outputs (exact and in the input dtype).
class DecodeProblem {
 public:
  explicit DecodeProblem(const DecodeCase& c) : c_(c), lens_(c.seqlens) {
    std::mt19937_64 rng(c.seed);
    const int64_t B = c.batch(), T = c.q_len, Hq = c.heads_q(), Hkv = c.heads_kv, D = c.head_dim;
    const std::vector<int> alloc = c.allocated.empty() ? c.seqlens : c.allocated;
    const int longest = std::max(1, *std::max_element(alloc.begin(), alloc.end()));
    q.reset(c.dtype, {B, T, Hq, D});
    q.fill_normal(rng);
    if (c.page_size == 0 && c.interleaved_kv) {
      capacity_ = longest + c.extra_capacity;
      kv_storage_.reset(c.dtype, {B, capacity_, 2, Hkv, D});
      kv_storage_.fill_normal(rng);
      k_view_ = strided_kv_view(kv_storage_, 0);
      v_view_ = strided_kv_view(kv_storage_, 1);
    } else if (c.page_size == 0) {
      capacity_ = longest + c.extra_capacity;
      kv_storage_.reset(c.dtype, {B, capacity_, Hkv, D});
      v_storage_.reset(c.dtype, {B, capacity_, Hkv, D});
      kv_storage_.fill_normal(rng);
      v_storage_.fill_normal(rng);
      separate_v_ = true;
      k_view_ = kv_storage_.view();
      v_view_ = v_storage_.view();
    } else {
      const int P = c.page_size;
      max_pages_ = (longest + P - 1) / P + c.extra_capacity;
      capacity_ = max_pages_ * P;
      int total_pages = 2;  // two spare pages nobody uses
      for (int a : alloc) total_pages += (a + P - 1) / P;
      std::vector<int32_t> ids(static_cast<size_t>(total_pages));
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
      kv_storage_.reset(c.dtype, {total_pages, P, Hkv, D});
      v_storage_.reset(c.dtype, {total_pages, P, Hkv, D});
      separate_v_ = true;
      kv_storage_.fill(kNaN);  // spare pages stay NaN
      v_storage_.fill(kNaN);
      page_table.reset(DType::kInt32, {B, max_pages_});
      page_table.fill(kUnusedPage);
      size_t next = 0;
      std::normal_distribution<double> normal;
      for (int64_t b = 0; b < B; ++b)
        for (int j = 0; j < (alloc[b] + P - 1) / P; ++j) {
          const int32_t page = ids[next++];
          page_table.set(b * max_pages_ + j, page);
          for (int64_t e = 0; e < int64_t{P} * Hkv * D; ++e) {
            kv_storage_.set(page * P * Hkv * D + e, normal(rng));
            v_storage_.set(page * P * Hkv * D + e, normal(rng));
          }
        }
      k_view_ = kv_storage_.view();
      v_view_ = v_storage_.view();
    }
    // Rows past each sequence's length in its storage (up to the capacity, or to the end of its
    // last page) are NaN: the kernels must not read them.
    for (int64_t b = 0; b < B; ++b) {
      const int64_t storage_end =
          c.page_size ? int64_t{(alloc[b] + c.page_size - 1) / c.page_size} * c.page_size : capacity_;
      for (int64_t j = lens_[b]; j < storage_end; ++j)
        for (int64_t h = 0; h < Hkv; ++h)
          for (int64_t d = 0; d < D; ++d) {
            ref::store(k_view_, cache_index(k_view_, b, j, h, d), kNaN);
            ref::store(v_view_, cache_index(v_view_, b, j, h, d), kNaN);
          }
    }
    seqlens.reset(DType::kInt32, {B});
    for (int64_t b = 0; b < B; ++b) seqlens.set(b, lens_[b]);

    dq_ = std::make_unique<DeviceTensor>(q);
    dq_->upload(q);
    dkv_ = std::make_unique<DeviceTensor>(kv_storage_);
    dkv_->upload(kv_storage_);
    if (separate_v_) {
      dv_ = std::make_unique<DeviceTensor>(v_storage_);
      dv_->upload(v_storage_);
    }
    if (c.page_size) {
      dpage_table_ = std::make_unique<DeviceTensor>(page_table);
      dpage_table_->upload(page_table);
    }
    dseqlens_ = std::make_unique<DeviceTensor>(seqlens);
    dseqlens_->upload(seqlens);
    out_host.reset(c.dtype, {B, T, Hq, D});
    lse_host.reset(DType::kFloat32, {B, Hq, T});
    dout_ = std::make_unique<DeviceTensor>(out_host);
    dlse_ = std::make_unique<DeviceTensor>(lse_host);
  }

  // The GPU op's params (outputs not poisoned: see poison_outputs).
  DecodeParams device_params() const {
    DecodeParams p;
    p.q = *dq_;
    p.k_cache = device_view(k_view_, dkv_->view().data, kv_storage_);
    p.v_cache = dv_ ? device_view(v_view_, dv_->view().data, v_storage_)
                    : device_view(v_view_, dkv_->view().data, kv_storage_);
    if (dpage_table_) p.page_table = *dpage_table_;
    p.cache_seqlens = *dseqlens_;
    p.out = *dout_;
    if (c_.with_lse) p.lse = *dlse_;
    fill_common(p);
    return p;
  }

  DecodeShapeKey key() const {
    DecodeShapeKey k;
    Status s = decode_shape_key(device_params(), &k);
    EXPECT_TRUE(s.ok()) << s.message();
    return k;
  }

  void poison_outputs() {
    dout_->poison();
    dlse_->poison();
  }

  // New cache lengths (within the allocated storage): uploaded, and the oracle rerun.
  void set_seqlens(const std::vector<int>& lens) {
    lens_ = lens;
    for (size_t b = 0; b < lens.size(); ++b) seqlens.set(static_cast<int64_t>(b), lens[b]);
    dseqlens_->upload(seqlens);
  }

  void run_oracle() {
    const int64_t B = c_.batch(), T = c_.q_len, Hq = c_.heads_q(), D = c_.head_dim;
    out_ref.reset(DType::kFloat64, {B, T, Hq, D});
    lse_ref.reset(DType::kFloat64, {B, Hq, T});
    DecodeParams p;
    p.q = q;
    p.k_cache = k_view_;
    p.v_cache = v_view_;
    if (c_.page_size) p.page_table = page_table;
    p.cache_seqlens = seqlens;
    p.out = out_ref;
    p.lse = lse_ref;
    fill_common(p);
    Status s = ref::decode_forward(p);
    ASSERT_TRUE(s.ok()) << s.message();
    emulate_input_dtype();
  }

  // Downloads out (and lse) and checks them against the oracle.
  void check(const std::string& label) {
    SCOPED_TRACE(label);
    dout_->download(out_host);
    ErrorReport r = compare(out_host, out_ref, &out_lowp);
    // The baseline itself must be close to the oracle, or the tolerance would mean nothing.
    EXPECT_LT(r.lowp_err, c_.dtype == DType::kBFloat16 ? 0.05 : 0.01) << "the low-precision baseline is off";
    const double atol = c_.dtype == DType::kBFloat16 ? 1.0 / 2048 : 1.0 / 16384;  // fp32 accumulation
    EXPECT_TRUE(within_tolerance(r, "out", 2.0, atol)) << c_.name();
    if (!c_.with_lse) return;
    dlse_->download(lse_host);
    ErrorReport rl = compare(lse_host, lse_ref, nullptr);
    double scale = 1.0;
    for (int64_t i = 0; i < lse_ref.numel(); ++i)
      if (std::isfinite(lse_ref.get(i))) scale = std::max(scale, std::abs(lse_ref.get(i)));
    rl.lowp_err = 2e-5 * scale;  // fp32: the LSE has no low-precision rounding
    EXPECT_TRUE(within_tolerance(rl, "lse", 2.0, 1e-5)) << c_.name();
  }

  HostTensor q, page_table, seqlens;
  HostTensor out_host, lse_host, out_ref, lse_ref, out_lowp;

 private:
  // K or V (slot 0 or 1) of an interleaved [batch, len, 2, heads_kv, d] buffer.
  static TensorView strided_kv_view(const HostTensor& storage, int slot) {
    const TensorView& s = storage.view();
    TensorView t = s;
    t.rank = 4;
    t.data = static_cast<char*>(s.data) + slot * s.stride[2] * dtype_size(s.dtype);
    t.shape[0] = s.shape[0], t.shape[1] = s.shape[1], t.shape[2] = s.shape[3], t.shape[3] = s.shape[4];
    t.stride[0] = s.stride[0], t.stride[1] = s.stride[1], t.stride[2] = s.stride[3], t.stride[3] = s.stride[4];
    return t;
  }
  // The same view over the device copy of `storage`.
  static TensorView device_view(const TensorView& host_view, void* device_base, const HostTensor& storage) {
    TensorView t = host_view;
    t.data = static_cast<char*>(device_base) + (static_cast<const char*>(host_view.data) -
                                                static_cast<const char*>(storage.data()));
    t.device = Device{DeviceKind::kCUDA, 0};
    return t;
  }

  int64_t cache_index(const TensorView& t, int64_t b, int64_t j, int64_t h, int64_t d) const {
    if (c_.page_size == 0) return b * t.stride[0] + j * t.stride[1] + h * t.stride[2] + d;
    const int64_t page = page_table.get(b * max_pages_ + j / c_.page_size);
    return page * t.stride[0] + (j % c_.page_size) * t.stride[1] + h * t.stride[2] + d;
  }

  template <typename P>
  void fill_common(P& p) const {
    p.softmax_scale = c_.softmax_scale;
    p.causal = c_.causal;
    p.window_left = c_.window_left;
  }

  // The kernels' math in the input dtype: exact scores; P = exp(s - max) rounded to the dtype
  // for the P V product, the denominator from the unrounded P; the output rounded to the dtype.
  void emulate_input_dtype() {
    const int64_t B = c_.batch(), T = c_.q_len, Hq = c_.heads_q(), Hkv = c_.heads_kv, D = c_.head_dim;
    const int64_t G = c_.group;
    const double scale = c_.softmax_scale > 0 ? c_.softmax_scale : 1.0 / std::sqrt(static_cast<double>(D));
    out_lowp.reset(DType::kFloat64, {B, T, Hq, D});
    std::vector<double> kk, vv, s, acc(static_cast<size_t>(D)), qrow(static_cast<size_t>(D));
    for (int64_t b = 0; b < B; ++b) {
      const int64_t L = lens_[b];
      for (int64_t hk = 0; hk < Hkv; ++hk) {
        kk.assign(static_cast<size_t>(L * D), 0.0);
        vv.assign(static_cast<size_t>(L * D), 0.0);
        for (int64_t j = 0; j < L; ++j)
          for (int64_t d = 0; d < D; ++d) {
            kk[j * D + d] = ref::load(k_view_, cache_index(k_view_, b, j, hk, d));
            vv[j * D + d] = ref::load(v_view_, cache_index(v_view_, b, j, hk, d));
          }
        for (int64_t h = hk * G; h < (hk + 1) * G; ++h)
          for (int64_t t = 0; t < T; ++t) {
            const int64_t last = c_.causal ? L - T + t : L - 1;
            const int64_t lo = std::max<int64_t>(0, c_.window_left >= 0 ? last - c_.window_left : 0);
            std::fill(acc.begin(), acc.end(), 0.0);
            double denom = 0, mx = -INFINITY;
            s.assign(static_cast<size_t>(std::max<int64_t>(L, 1)), -INFINITY);
            for (int64_t d = 0; d < D; ++d) qrow[d] = q.get(((b * T + t) * Hq + h) * D + d);
            for (int64_t j = lo; j <= last; ++j) {
              double dot = 0;
              for (int64_t d = 0; d < D; ++d) dot += qrow[d] * kk[j * D + d];
              s[j] = scale * dot;
              mx = std::max(mx, s[j]);
            }
            for (int64_t j = lo; j <= last; ++j) {
              const double pj = std::exp(s[j] - mx);
              const double pr = ref::round_to(c_.dtype, pj);
              denom += pj;
              for (int64_t d = 0; d < D; ++d) acc[d] += pr * vv[j * D + d];
            }
            for (int64_t d = 0; d < D; ++d)
              out_lowp.set(((b * T + t) * Hq + h) * D + d, denom > 0 ? ref::round_to(c_.dtype, acc[d] / denom) : 0.0);
          }
      }
    }
  }

  DecodeCase c_;
  std::vector<int> lens_;
  int capacity_ = 0, max_pages_ = 0;
  bool separate_v_ = false;
  HostTensor kv_storage_, v_storage_;  // K (or K and V interleaved), V (when separate)
  TensorView k_view_{}, v_view_{};
  std::unique_ptr<DeviceTensor> dq_, dkv_, dv_, dpage_table_, dseqlens_, dout_, dlse_;
};

std::string plan_label(const DecodePlan& plan) {
  return std::string(decode_kernel_name(plan.kernel)) + " splits " + std::to_string(plan.num_splits) + " kv_chunk " +
         std::to_string(plan.kv_chunk) + " engine " + decode_engine_name(plan.engine) + " combine " +
         decode_combine_name(plan.combine) + " heads_per_cta " + std::to_string(plan.heads_per_cta) +
         (plan.l2_evict_first ? " l2 evict_first" : "");
}

// The workspace of a split plan: poisoned (NaN partial states, counters 0xFFFFFFFF), except that
// DecodeCombine::kInKernelPrezeroed gets the zero counters its caller owes it.
void prepare_workspace(DeviceBuffer& workspace, const DecodePlan& plan) {
  workspace.poison();
  if (plan.kernel == DecodeKernel::kSplitKv && plan.combine == DecodeCombine::kInKernelPrezeroed)
    FLARE_CUDA_OK(cudaMemset(static_cast<char*>(workspace.get()) + plan.counters_offset, 0,
                             plan.workspace_bytes - plan.counters_offset));
}

// Runs `plan` on the problem (outputs and workspace poisoned) and checks the result.
void run_plan(DecodeProblem& prob, const DecodePlan& plan) {
  const std::string label = plan_label(plan);
  SCOPED_TRACE(label);
  DeviceBuffer workspace(plan.workspace_bytes);
  prepare_workspace(workspace, plan);
  prob.poison_outputs();
  FLARE_CUDA_OK(cudaDeviceSynchronize());
  Status s = decode_run(plan, prob.device_params(), workspace.get(), workspace.bytes());
  ASSERT_TRUE(s.ok()) << s.message();
  FLARE_CUDA_OK(cudaDeviceSynchronize());
  prob.check(label);
}

// `plan` as each engine and combine runs it: key groups with the in-kernel combine, the combine
// kernel and the cluster combine, the head-warp kernel and the portable kernel (each with the
// combine kernel); each sm_90 engine's loads also with the evict-first L2 policy (the cluster
// combine's, and the in-kernel one's where the plan has no splits). Where the sm_90 engines do
// not apply (head dims other than 128, more than 16 packed rows, ...) all of them run the
// portable kernel.
std::vector<DecodePlan> engine_variants(const DecodePlan& plan) {
  std::vector<DecodePlan> plans;
  auto add = [&](DecodeEngine e, DecodeCombine c, bool l2_evict_first) {
    DecodePlan v = plan;
    v.engine = e;
    v.combine = c;
    v.l2_evict_first = l2_evict_first;
    plans.push_back(v);
  };
  const bool split = plan.kernel == DecodeKernel::kSplitKv;
  add(DecodeEngine::kKeyGroups, DecodeCombine::kInKernel, /*l2_evict_first=*/!split);
  if (split) {
    add(DecodeEngine::kKeyGroups, DecodeCombine::kSeparateKernel, false);
    add(DecodeEngine::kKeyGroups, DecodeCombine::kCluster, false);  // as kInKernel past 16 splits
    add(DecodeEngine::kKeyGroups, DecodeCombine::kCluster, true);
  } else {
    add(DecodeEngine::kKeyGroups, DecodeCombine::kInKernel, false);
  }
  add(DecodeEngine::kHeadWarps, DecodeCombine::kSeparateKernel, false);
  add(DecodeEngine::kHeadWarps, DecodeCombine::kSeparateKernel, true);
  add(DecodeEngine::kPortable, DecodeCombine::kSeparateKernel, false);
  return plans;
}

// The standard kernel, the (fitted) forced split counts and the heuristic's plan, each once per
// engine variant.
void run_case(const DecodeCase& c, std::initializer_list<int> split_counts = {1, 3, 7}) {
  if (!instantiated(c.head_dim, c.dtype)) return;
  SCOPED_TRACE(c.name());
  DecodeProblem prob(c);
  prob.run_oracle();
  if (::testing::Test::HasFatalFailure()) return;
  const DecodeShapeKey key = prob.key();
  std::vector<DecodePlan> plans;
  for (int s : split_counts) {
    DecodePlan plan;
    Status st = decode_plan_for_splits(key, s, &plan);
    ASSERT_TRUE(st.ok()) << st.message();
    plans.push_back(plan);
  }
  DecodePlan heuristic;
  ASSERT_TRUE(decode_plan(key, nullptr, num_sms(), &heuristic).ok());
  plans.push_back(heuristic);
  std::vector<int> done;
  for (const DecodePlan& plan : plans) {
    if (std::find(done.begin(), done.end(), plan.num_splits) != done.end()) continue;
    done.push_back(plan.num_splits);
    for (const DecodePlan& variant : engine_variants(plan)) {
      run_plan(prob, variant);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

// Cache lengths that end just before, on and just past 16- and 64-key page and tile boundaries.
const int kShortLens[] = {1, 15, 16, 17, 2, 31, 33};
const int kMidLens[] = {63, 64, 65, 127, 129, 1000};
const int kLongLens[] = {4095, 2049, 4096};
const int kWindows[] = {0, 17, 100, 1000};

TEST(Decode, Sweep) {
  FLARE_REQUIRE_GPU();
  int index = 0, count = 0;
  for (int d : {64, 128, 256})
    for (DType dtype : {DType::kBFloat16, DType::kFloat16})
      for (int page_size : {0, 16, 64})
        for (int q_len : {1, 4, 8})
          for (bool window : {false, true})
            for (int ratio : {1, 4, 8}) {
              const int i = index++;
              if (reduced() && i % 29 != 0) continue;
              DecodeCase c;
              c.head_dim = d;
              c.dtype = dtype;
              c.page_size = page_size;
              c.q_len = q_len;
              c.group = ratio;
              c.heads_kv = ratio == 8 ? 1 : 2;
              c.window_left = window ? kWindows[i % 4] : -1;
              c.seqlens = {kShortLens[i % 7], kShortLens[(i + 3) % 7], kMidLens[i % 6]};
              if (i % 3 == 0) c.seqlens.push_back(kLongLens[(i / 3) % 3]);
              for (int& len : c.seqlens) len = std::max(len, q_len);  // causal: the new tokens are cached
              c.extra_capacity = i % 2;
              c.softmax_scale = i % 5 == 0 ? 0.3f : 0.f;
              c.with_lse = i % 4 != 3;
              c.seed = 1000 + i;
              run_case(c);
              ++count;
              if (HasFatalFailure()) return;
            }
  EXPECT_GT(count, 0);
}

// Query groups of any size: odd groups, several row blocks (rows = group x q_len > 64), partly
// filled m-tiles.
TEST(Decode, LargeAndOddGroups) {
  FLARE_REQUIRE_GPU();
  struct Shape {
    int group, q_len;
  };
  const Shape shapes[] = {{3, 5}, {5, 4}, {40, 1}, {12, 7}, {16, 8}, {32, 3}};
  uint64_t seed = 2000;
  for (const Shape& sh : shapes)
    for (int page_size : {0, 16}) {
      DecodeCase c;
      c.head_dim = sh.group % 2 ? 64 : 128;
      c.heads_kv = 1;
      c.group = sh.group;
      c.q_len = sh.q_len;
      c.page_size = page_size;
      c.window_left = page_size ? 50 : -1;
      c.seqlens = {1000, std::max(17, sh.q_len), 300};
      c.seed = seed++;
      run_case(c, {1, 5});
      if (HasFatalFailure() || reduced()) return;
    }
}

// Without causal every query sees the whole cache (or its window), which may be empty.
TEST(Decode, NonCausalAndEmptyCaches) {
  FLARE_REQUIRE_GPU();
  uint64_t seed = 3000;
  for (int d : {64, 128})
    for (int window : {-1, 10})
      for (int page_size : {0, 16}) {
        DecodeCase c;
        c.head_dim = d;
        c.dtype = d == 64 ? DType::kFloat16 : DType::kBFloat16;
        c.causal = false;
        c.q_len = 4;
        c.group = 4;
        c.window_left = window;
        c.page_size = page_size;
        c.seqlens = {0, 1, 3, 100, 700};
        c.seed = seed++;
        run_case(c, {1, 3});
        if (HasFatalFailure() || reduced()) return;
      }
}

// K and V as strided slices of one interleaved buffer (different base pointers, row strides of
// 2 x heads_kv x head_dim).
TEST(Decode, InterleavedKvCache) {
  FLARE_REQUIRE_GPU();
  for (int d : {64, 256}) {
    DecodeCase c;
    c.head_dim = d;
    c.interleaved_kv = true;
    c.q_len = 2;
    c.seqlens = {777, 2, 64};
    c.extra_capacity = 3;
    c.seed = 4000 + d;
    run_case(c, {1, 4});
    if (HasFatalFailure() || reduced()) return;
  }
}

// The key-group kernel's head blocks and the in-kernel combine: 8 KV heads (so 1, 2, 4 and 8
// heads per CTA all occur), split counts from 2 to 128 (many CTAs per head block; more splits
// than a short sequence fills: empty splits), every combine, contiguous and paged caches, windows,
// 1 and 4 query tokens (4 and 16 packed rows), cache lengths around tile, sub-tile and stage
// boundaries (16 keys per key group: 16..128 per stage), and an empty non-causal cache.
TEST(Decode, KeyGroupsHeadBlocksAndInKernelCombine) {
  FLARE_REQUIRE_GPU();
  uint64_t seed = 7000;
  int index = 0;
  for (int page_size : {0, 16, 64})
    for (int q_len : {1, 4})
      for (int window : {-1, 100}) {
        const int i = index++;
        if (reduced() && i != 7) continue;  // paged (16), 4 tokens (16 rows), a window, causal
        DecodeCase c;
        c.head_dim = 128;
        c.heads_kv = 8;
        c.group = 4;
        c.q_len = q_len;
        c.page_size = page_size;
        c.window_left = window;
        c.causal = i % 3 != 2;
        c.seqlens = {4095, 17, 129, 1000};
        if (!c.causal) c.seqlens.push_back(0);
        c.extra_capacity = i % 2;
        c.with_lse = i % 4 != 1;
        c.seed = seed++;
        if (!instantiated(c.head_dim, c.dtype)) return;
        SCOPED_TRACE(c.name());
        DecodeProblem prob(c);
        prob.run_oracle();
        if (HasFatalFailure()) return;
        const DecodeShapeKey key = prob.key();
        const std::vector<int> split_counts = reduced() ? std::vector<int>{1, 7, 64} : std::vector<int>{1, 2, 7, 16, 64, 128};
        const std::vector<int> head_counts = reduced() ? std::vector<int>{1, 4} : std::vector<int>{1, 2, 4, 8};
        for (int splits : split_counts)
          for (int heads : head_counts) {
            DecodePlan plan;
            ASSERT_TRUE(decode_plan_for_splits(key, splits, &plan).ok());
            plan.engine = DecodeEngine::kKeyGroups;
            plan.heads_per_cta = heads;
            plan.l2_evict_first = (splits + heads) % 2 == 1;  // both load paths, across the sweep
            for (DecodeCombine combine : {DecodeCombine::kInKernel, DecodeCombine::kSeparateKernel,
                                          DecodeCombine::kInKernelPrezeroed, DecodeCombine::kCluster}) {
              if (plan.kernel == DecodeKernel::kStandard && combine != DecodeCombine::kInKernel) continue;
              plan.combine = combine;
              run_plan(prob, plan);
              if (HasFatalFailure()) return;
            }
          }
      }
}

// One decode step captured in a CUDA graph with a fixed plan and workspace, replayed with new
// cache lengths written to the device between replays. The in-kernel combine's counters: with the
// zeroing kernel the workspace is poisoned before every replay; with kInKernelPrezeroed it is
// zeroed once before the capture and never touched again, so every replay after the first passes
// only if the previous one left its counters at 0.
TEST(Decode, GraphReplayWithChangingLengths) {
  FLARE_REQUIRE_GPU();
  const std::vector<std::vector<int>> steps = {
      {2048, 17, 1000}, {5, 2047, 64}, {1024, 1024, 1024}, {2, 300, 1999}, {16, 15, 2048}, {2048, 2048, 1}};
  for (int heads_kv : {2, 8})
    for (int page_size : {0, 16}) {
      if (reduced() && heads_kv == 2) continue;
      DecodeCase c;
      c.head_dim = 128;
      c.heads_kv = heads_kv;
      c.group = 4;
      c.q_len = 2;
      c.page_size = page_size;
      c.seqlens = {2048, 2048, 2048};  // the capacity; each replay uses a prefix
      c.seed = 5000 + page_size + heads_kv;
      if (!instantiated(c.head_dim, c.dtype)) return;
      SCOPED_TRACE(c.name());
      DecodeProblem prob(c);
      const DecodeShapeKey key = prob.key();
      for (int splits : reduced() ? std::vector<int>{7} : std::vector<int>{1, 7, 16, 32})
        for (DecodeCombine combine : {DecodeCombine::kInKernel, DecodeCombine::kInKernelPrezeroed,
                                      DecodeCombine::kSeparateKernel, DecodeCombine::kCluster}) {
          DecodePlan plan;
          ASSERT_TRUE(decode_plan_for_splits(key, splits, &plan).ok());
          if (plan.kernel == DecodeKernel::kStandard && combine != DecodeCombine::kInKernel) continue;
          plan.combine = combine;
          plan.engine = combine == DecodeCombine::kSeparateKernel ? DecodeEngine::kHeadWarps  // the old path
                                                                  : DecodeEngine::kKeyGroups;
          SCOPED_TRACE(plan_label(plan));
          const bool prezeroed = combine == DecodeCombine::kInKernelPrezeroed;
          DeviceBuffer workspace(plan.workspace_bytes);
          prepare_workspace(workspace, plan);
          cudaStream_t stream = nullptr;
          FLARE_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
          DecodeParams params = prob.device_params();
          params.stream = stream;
          prob.set_seqlens(c.seqlens);
          FLARE_CUDA_OK(cudaDeviceSynchronize());
          ASSERT_TRUE(decode_run(plan, params, workspace.get(), workspace.bytes()).ok());  // warm-up
          FLARE_CUDA_OK(cudaStreamSynchronize(stream));

          cudaGraph_t graph = nullptr;
          cudaGraphExec_t exec = nullptr;
          FLARE_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
          const Status captured = decode_run(plan, params, workspace.get(), workspace.bytes());
          FLARE_CUDA_OK(cudaStreamEndCapture(stream, &graph));
          ASSERT_TRUE(captured.ok()) << captured.message();
          FLARE_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

          for (size_t step = 0; step < steps.size(); ++step) {
            prob.set_seqlens(steps[step]);
            prob.run_oracle();
            prob.poison_outputs();
            if (!prezeroed) {
              workspace.poison();
            } else if (plan.kernel == DecodeKernel::kSplitKv) {  // the partial states only
              FLARE_CUDA_OK(cudaMemset(workspace.get(), 0xFF, plan.counters_offset));
            }
            FLARE_CUDA_OK(cudaDeviceSynchronize());  // the uploads and poison land before the replay
            FLARE_CUDA_OK(cudaGraphLaunch(exec, stream));
            FLARE_CUDA_OK(cudaStreamSynchronize(stream));
            prob.check("replay " + std::to_string(step));
            if (HasFailure() && reduced()) break;
          }
          if (prezeroed && plan.kernel == DecodeKernel::kSplitKv) {  // and the counters are back at 0
            std::vector<int32_t> counters((plan.workspace_bytes - plan.counters_offset) / sizeof(int32_t));
            FLARE_CUDA_OK(cudaMemcpy(counters.data(), static_cast<char*>(workspace.get()) + plan.counters_offset,
                                     counters.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
            for (int32_t v : counters) EXPECT_EQ(v, 0);
          }
          cudaGraphExecDestroy(exec);
          cudaGraphDestroy(graph);
          cudaStreamDestroy(stream);
        }
    }
}

// merge_states against ref::merge_states: leading dims of rank 0 to 3, state counts past a warp,
// dims not a multiple of 4, -inf states (whose partial outputs are NaN: never read), a row of
// -inf states only, a +inf state, strided outputs.
TEST(MergeStates, AgainstOracle) {
  FLARE_REQUIRE_GPU();
  struct Shape {
    std::vector<int64_t> rows;
    int64_t states, dim;
    bool lse;
  };
  const Shape shapes[] = {{{3, 5}, 7, 64, true},  {{2}, 1, 100, true},  {{4, 2, 3}, 40, 3, false},
                          {{}, 3, 256, true},     {{6}, 130, 128, true}, {{2, 2}, 33, 7, true}};
  uint64_t seed = 6000;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
    for (const Shape& sh : shapes) {
      std::mt19937_64 rng(seed++);
      int64_t rows = 1;
      for (int64_t r : sh.rows) rows *= r;
      std::vector<int64_t> po_shape = sh.rows, pl_shape = sh.rows, out_shape = sh.rows;
      po_shape.push_back(sh.states);
      po_shape.push_back(sh.dim);
      pl_shape.push_back(sh.states);
      const int64_t pad = 5;  // out rows are dim + pad apart: the pad must stay untouched
      out_shape.push_back(sh.dim + pad);
      HostTensor po(DType::kFloat32, po_shape), pl(DType::kFloat32, pl_shape);
      po.fill_normal(rng);
      pl.fill_normal(rng, 0.0, 3.0);
      HostTensor po_oracle(DType::kFloat32, po_shape);  // -inf states' outputs: NaN on the device, 0 here
      for (int64_t i = 0; i < po.numel(); ++i) po_oracle.set(i, po.get(i));
      for (int64_t n = 0; n < rows; ++n)
        for (int64_t s = 0; s < sh.states; ++s) {
          const bool all_empty = rows > 2 && n == 1;
          if (all_empty || (sh.states > 1 && s % 3 == 1)) {
            pl.set(n * sh.states + s, -INFINITY);
            for (int64_t d = 0; d < sh.dim; ++d) {
              po.set((n * sh.states + s) * sh.dim + d, kNaN);
              po_oracle.set((n * sh.states + s) * sh.dim + d, 0.0);
            }
          }
        }
      if (rows > 3) pl.set(2 * sh.states, INFINITY);  // row 2: a state of a row that saw no key
      HostTensor out_storage(dtype, out_shape);
      HostTensor lse_host(DType::kFloat32, sh.rows.empty() ? std::vector<int64_t>{1} : sh.rows);
      DeviceTensor dpo(po), dpl(pl), dout(out_storage), dlse(lse_host);
      dpo.upload(po);
      dpl.upload(pl);
      dout.poison();
      dlse.poison();

      MergeStatesParams p;
      p.partial_out = dpo;
      p.partial_lse = dpl;
      p.out = dout.view();
      p.out.shape[p.out.rank - 1] = sh.dim;  // a view of the first dim columns of each row
      if (sh.lse) {
        p.lse = dlse.view();
        p.lse.rank = static_cast<int>(sh.rows.size());  // rank 0 for no leading dims
      }
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " rows " + std::to_string(rows) + " states " +
                   std::to_string(sh.states) + " dim " + std::to_string(sh.dim));
      Status st = merge_states(p);
      ASSERT_TRUE(st.ok()) << st.message();
      FLARE_CUDA_OK(cudaDeviceSynchronize());
      dout.download(out_storage);
      dlse.download(lse_host);

      HostTensor got(DType::kFloat64, {rows, sh.dim}), want(DType::kFloat64, {rows, sh.dim}),
          lowp(DType::kFloat64, {rows, sh.dim}), got_lse(DType::kFloat64, {rows}), want_lse(DType::kFloat64, {rows});
      std::vector<double> outs(static_cast<size_t>(sh.states * sh.dim)), lses(static_cast<size_t>(sh.states)),
          merged(static_cast<size_t>(sh.dim));
      int64_t pad_touched = 0;
      for (int64_t n = 0; n < rows; ++n) {
        for (int64_t s = 0; s < sh.states; ++s) {
          lses[s] = pl.get(n * sh.states + s);
          for (int64_t d = 0; d < sh.dim; ++d) outs[s * sh.dim + d] = po_oracle.get((n * sh.states + s) * sh.dim + d);
        }
        double merged_lse = 0;
        ref::merge_states(static_cast<int>(sh.states), static_cast<int>(sh.dim), outs.data(), lses.data(),
                          merged.data(), &merged_lse);
        for (int64_t d = 0; d < sh.dim; ++d) {
          got.set(n * sh.dim + d, out_storage.get(n * (sh.dim + pad) + d));
          want.set(n * sh.dim + d, merged[d]);
          lowp.set(n * sh.dim + d, ref::round_to(dtype, merged[d]));
        }
        for (int64_t d = sh.dim; d < sh.dim + pad; ++d)
          pad_touched += !std::isnan(out_storage.get(n * (sh.dim + pad) + d));
        got_lse.set(n, lse_host.get(n));
        want_lse.set(n, merged_lse);
      }
      EXPECT_EQ(pad_touched, 0) << "merge_states wrote outside the out view";
      ErrorReport r = compare(got, want, &lowp);
      r.lowp_err = std::max(r.lowp_err, 1e-6);  // fp32 output: exp/log rounding only
      EXPECT_TRUE(within_tolerance(r, "out", 2.0, 1e-5));
      if (sh.lse) {
        ErrorReport rl = compare(got_lse, want_lse, nullptr);
        rl.lowp_err = 1e-5;
        EXPECT_TRUE(within_tolerance(rl, "lse", 2.0, 1e-5));
      }
    }
}

// ---------------------------------------------------------------------------------------------
// Bad inputs: each gives an InvalidArgument naming the argument. Views carry fake device
// pointers: every case must fail before anything is launched (no GPU needed).

TensorView fake_device(DType dtype, std::initializer_list<int64_t> shape, uintptr_t address = 0x100000) {
  return TensorView::contiguous(reinterpret_cast<void*>(address), dtype, shape, Device{DeviceKind::kCUDA, 0});
}

void expect_invalid(const Status& s, const std::string& arg) {
  ASSERT_FALSE(s.ok()) << "accepted; expected an error about " << arg;
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  EXPECT_NE(s.message().find("'" + arg + "'"), std::string::npos) << s.message();
}

TEST(Decode, BadInputsNameTheArgument) {
  DecodeParams p;
  p.q = fake_device(DType::kBFloat16, {2, 1, 8, 128});
  p.k_cache = fake_device(DType::kBFloat16, {2, 4096, 2, 128});
  p.v_cache = fake_device(DType::kBFloat16, {2, 4096, 2, 128});
  p.cache_seqlens = fake_device(DType::kInt32, {2});
  p.out = fake_device(DType::kBFloat16, {2, 1, 8, 128});
  p.lse = fake_device(DType::kFloat32, {2, 8, 1});
  DecodeShapeKey key;
  ASSERT_TRUE(decode_shape_key(p, &key).ok());
  DecodePlan split, standard;
  ASSERT_TRUE(decode_plan_for_splits(key, 4, &split).ok());
  ASSERT_TRUE(decode_plan_for_splits(key, 1, &standard).ok());
  ASSERT_EQ(split.kernel, DecodeKernel::kSplitKv);
  void* ws = reinterpret_cast<void*>(0x200000);

  expect_invalid(decode_run(split, p, nullptr, 0), "workspace");
  expect_invalid(decode_run(split, p, ws, split.workspace_bytes - 1), "workspace");
  expect_invalid(decode_run(split, p, static_cast<char*>(ws) + 4, split.workspace_bytes), "workspace");
  DecodeShapeKey other = key;
  other.batch = 3;
  DecodePlan wrong_shape;
  ASSERT_TRUE(decode_plan_for_splits(other, 1, &wrong_shape).ok());
  expect_invalid(decode_run(wrong_shape, p, nullptr, 0), "plan");
  DecodePlan edited = split;
  edited.kv_chunk += 64;
  expect_invalid(decode_run(edited, p, ws, split.workspace_bytes), "plan");

  DecodeParams bad = p;
  bad.q = fake_device(DType::kFloat32, {2, 1, 8, 128});
  expect_invalid(decode_run(standard, bad, nullptr, 0), "q");
  bad = p;
  bad.q = fake_device(DType::kBFloat16, {2, 1, 8, 96});
  expect_invalid(decode_run(standard, bad, nullptr, 0), "q");
  bad = p;
  bad.lse = fake_device(DType::kFloat32, {2, 1, 8});
  expect_invalid(decode_run(standard, bad, nullptr, 0), "lse");
  bad = p;
  bad.cache_seqlens = fake_device(DType::kInt32, {3});
  expect_invalid(decode_run(standard, bad, nullptr, 0), "cache_seqlens");
  bad = p;
  bad.out.device.kind = DeviceKind::kCPU;
  expect_invalid(decode_run(standard, bad, nullptr, 0), "out");
}

TEST(MergeStates, BadInputsNameTheArgument) {
  MergeStatesParams p;
  p.partial_out = fake_device(DType::kFloat32, {4, 3, 64});
  p.partial_lse = fake_device(DType::kFloat32, {4, 3});
  p.out = fake_device(DType::kBFloat16, {4, 64});
  p.lse = fake_device(DType::kFloat32, {4});

  MergeStatesParams bad = p;
  bad.partial_out = fake_device(DType::kFloat16, {4, 3, 64});
  expect_invalid(merge_states(bad), "partial_out");
  bad = p;
  bad.partial_out = fake_device(DType::kFloat32, {64});
  expect_invalid(merge_states(bad), "partial_out");
  bad = p;
  bad.partial_out.device.kind = DeviceKind::kCPU;
  expect_invalid(merge_states(bad), "partial_out");
  bad = p;
  bad.partial_lse = fake_device(DType::kFloat32, {4, 2});
  expect_invalid(merge_states(bad), "partial_lse");
  bad = p;
  bad.partial_lse = TensorView{};
  expect_invalid(merge_states(bad), "partial_lse");
  bad = p;
  bad.out = fake_device(DType::kBFloat16, {4, 63});
  expect_invalid(merge_states(bad), "out");
  bad = p;
  bad.out = fake_device(DType::kInt32, {4, 64});
  expect_invalid(merge_states(bad), "out");
  bad = p;
  bad.lse = fake_device(DType::kFloat32, {4, 1});
  expect_invalid(merge_states(bad), "lse");
  bad = p;
  bad.lse = fake_device(DType::kFloat64, {4});
  expect_invalid(merge_states(bad), "lse");
}

}  // namespace
}  // namespace flare::test
