// PyTorch bindings of flare's C++ API: torch.library ops in the namespace `flare`, each running on
// the current CUDA stream of its tensors' device. This file (with python/flare/) is the only place
// torch appears; it turns tensors into TensorViews, allocates outputs and workspaces with torch's
// caching allocator (so every op is capturable in a CUDA graph) and turns a flare::Status into the
// Python exception a PyTorch user expects:
//   InvalidArgument -> ValueError (TypeError when the dtype is wrong), NotSupported ->
//   NotImplementedError, anything else -> RuntimeError.
// The fake (meta) implementations and the autograd formulas live in python/flare/ops.py.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <execinfo.h>

#include <array>
#include <csignal>
#include <cstdlib>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "flare/attention.h"
#include "flare/block_mask.h"
#include "flare/decode.h"
#include "flare/decode_plan.h"
#include "flare/kda.h"

namespace flare_torch {
namespace {

using OptTensor = std::optional<at::Tensor>;

// ---- errors -----------------------------------------------------------------------------------

// flare names arguments as its C++ structs do; a Python caller knows them by FlashAttention's
// names. Each op passes the renames that apply to it.
using Renames = std::vector<std::pair<std::string, std::string>>;

std::string python_names(std::string message, const Renames& renames) {
  for (const auto& [from, to] : renames) {
    const std::string quoted = "'" + from + "'";
    for (std::size_t at = message.find(quoted); at != std::string::npos; at = message.find(quoted, at + to.size()))
      message.replace(at, quoted.size(), "'" + to + "'");
  }
  return message;
}

void throw_if_error(const flare::Status& s, const Renames& renames = {}) {
  if (s.ok()) return;
  const std::string message = python_names(s.message(), renames);
  switch (s.code()) {
    case flare::StatusCode::kInvalidArgument:
      TORCH_CHECK_TYPE(message.find(": dtype ") == std::string::npos, message);
      TORCH_CHECK_VALUE(false, message);
      return;
    case flare::StatusCode::kNotSupported:
      TORCH_CHECK_NOT_IMPLEMENTED(false, message);
      return;
    default:
      TORCH_CHECK(false, "flare: ", flare::status_code_name(s.code()), ": ", message);
  }
}

// ---- tensors ----------------------------------------------------------------------------------

flare::DType flare_dtype(at::ScalarType t, const char* name) {
  switch (t) {
    case at::kHalf: return flare::DType::kFloat16;
    case at::kBFloat16: return flare::DType::kBFloat16;
    case at::kFloat: return flare::DType::kFloat32;
    case at::kDouble: return flare::DType::kFloat64;
    case at::kInt: return flare::DType::kInt32;
    case at::kLong: return flare::DType::kInt64;
    case at::kByte: return flare::DType::kUInt8;
    default: break;
  }
  TORCH_CHECK_TYPE(false, "argument '", name, "': dtype ", t, " is not supported by flare");
  return flare::DType::kFloat32;  // not reached
}

flare::TensorView view(const at::Tensor& t, const char* name) {
  flare::TensorView v;
  if (!t.defined()) return v;
  TORCH_CHECK_VALUE(t.dim() <= flare::kMaxRank, "argument '", name, "': rank ", t.dim(), " is above ",
                    flare::kMaxRank);
  v.data = t.data_ptr();
  v.dtype = flare_dtype(t.scalar_type(), name);
  v.rank = static_cast<int>(t.dim());
  for (int i = 0; i < v.rank; ++i) {
    v.shape[i] = t.size(i);
    v.stride[i] = t.stride(i);
  }
  v.device = t.is_cuda() ? flare::Device{flare::DeviceKind::kCUDA, t.get_device()}
                         : flare::Device{flare::DeviceKind::kCPU, 0};
  return v;
}

flare::TensorView view(const OptTensor& t, const char* name) {
  return t.has_value() ? view(*t, name) : flare::TensorView{};
}

// The kernels read rows with 16-byte vector loads: the last dimension contiguous, the base and
// every other stride 16-byte aligned. A view that breaks this (a stride-0 expanded gradient, an
// odd slice) is copied, as FlashAttention does, instead of being rejected.
at::Tensor loadable(const at::Tensor& t) {
  if (!t.defined() || t.dim() == 0) return t;
  const int64_t elem = static_cast<int64_t>(t.element_size());
  bool ok = t.stride(-1) == 1 || t.size(-1) == 1;
  ok = ok && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t i = 0; ok && i + 1 < t.dim(); ++i) ok = t.size(i) <= 1 || (t.stride(i) * elem) % 16 == 0;
  return ok ? t : t.contiguous();
}

void check_cuda(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK_VALUE(t.is_cuda(), "argument '", name, "': must be a CUDA tensor, is on ", t.device());
  TORCH_CHECK_VALUE(t.device() == device, "argument '", name, "': is on ", t.device(), ", expected ", device,
                    " (where q is)");
}

void check_cuda(const OptTensor& t, const char* name, const at::Device& device) {
  if (t.has_value()) check_cuda(*t, name, device);
}

void check_half(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, "argument '", name,
                   "': expected dtype torch.float16 or torch.bfloat16, got ", t.scalar_type());
}

void check_int32(const OptTensor& t, const char* name) {
  if (t.has_value())
    TORCH_CHECK_TYPE(t->scalar_type() == at::kInt, "argument '", name, "': expected dtype torch.int32, got ",
                     t->scalar_type());
}

flare::Stream current_stream(const at::Device& device) {
  return reinterpret_cast<flare::Stream>(at::cuda::getCurrentCUDAStream(device.index()).stream());
}

// Outputs and workspaces come straight from the CUDA caching allocator, without a round trip through
// the dispatcher (a decode step is short enough for that to show): every caller has checked that its
// tensors are CUDA tensors first.
at::Tensor empty_cuda(at::IntArrayRef sizes, at::ScalarType dtype, const at::Device& device) {
  return at::Tensor(at::detail::empty_cuda(sizes, dtype, device, std::nullopt));
}

at::Tensor empty_like_cuda(const at::Tensor& t) { return empty_cuda(t.sizes(), t.scalar_type(), t.device()); }

at::Tensor workspace_tensor(std::size_t bytes, const at::Device& device) {
  return empty_cuda({static_cast<int64_t>(bytes)}, at::kByte, device);
}

// attention_forward with the scratch it asks for (attention_forward_workspace_size: the dense Hopper
// grid's split tiles, a block mask's CTA order and document spans; most problems none) taken from
// torch's allocator.
void run_attention_forward(flare::AttentionForwardParams& p, const at::Device& device, const Renames& renames) {
  std::size_t bytes = 0;
  throw_if_error(flare::attention_forward_workspace_size(p, &bytes), renames);
  const at::Tensor workspace = workspace_tensor(bytes, device);
  p.workspace = bytes > 0 ? workspace.data_ptr() : nullptr;
  p.workspace_bytes = bytes;
  throw_if_error(flare::attention_forward(p), renames);
}

// ---- attention --------------------------------------------------------------------------------

const Renames kAttentionNames = {{"mask.window_left", "window_size"}, {"mask.window_right", "window_size"},
                                 {"mask.causal", "causal"}};

// The log-sum-exp's shape: [batch, heads, seqlen_q], or [heads, total_q] with cu_seqlens.
std::vector<int64_t> lse_shape(const at::Tensor& q, bool varlen) {
  if (varlen && q.dim() == 3) return {q.size(1), q.size(0)};
  if (!varlen && q.dim() == 4) return {q.size(0), q.size(2), q.size(1)};
  TORCH_CHECK_VALUE(false, "argument 'q': expected rank ", varlen ? 3 : 4,
                    varlen ? " [total_q, heads, head_dim] with cu_seqlens" : " [batch, seqlen, heads, head_dim]",
                    ", got rank ", q.dim());
  return {};  // not reached
}

// `t` (named `name`) must have q's dtype.
void check_same_dtype(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK_TYPE(t.scalar_type() == q.scalar_type(), "argument '", name, "': dtype ", t.scalar_type(),
                   " differs from q's ", q.scalar_type());
}

void check_attention_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& cu_q,
                            const OptTensor& cu_k, const OptTensor& sinks) {
  const at::Device device = q.device();
  check_cuda(q, "q", device);
  check_cuda(k, "k", device);
  check_cuda(v, "v", device);
  check_cuda(cu_q, "cu_seqlens_q", device);
  check_cuda(cu_k, "cu_seqlens_k", device);
  check_cuda(sinks, "sinks", device);
  check_half(q, "q");
  check_same_dtype(k, "k", q);
  check_same_dtype(v, "v", q);
  check_int32(cu_q, "cu_seqlens_q");
  check_int32(cu_k, "cu_seqlens_k");
  if (sinks.has_value())
    TORCH_CHECK_TYPE(sinks->scalar_type() == at::kFloat, "argument 'sinks': expected dtype torch.float32, got ",
                     sinks->scalar_type());
}

flare::MaskParams mask_params(bool causal, int64_t window_left, int64_t window_right) {
  flare::MaskParams m;
  m.causal = causal;
  m.window_left = static_cast<int>(window_left);
  m.window_right = causal ? 0 : static_cast<int>(window_right);
  return m;
}

// The fields the attention forward and backward share: inputs, output, lengths, scalars, mask.
template <typename Params>
void fill_attention_args(Params& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& out, const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k,
                         int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, double softcap, bool causal,
                         int64_t window_left, int64_t window_right) {
  p.q = view(q, "q");
  p.k = view(k, "k");
  p.v = view(v, "v");
  p.out = view(out, "out");
  p.cu_seqlens_q = view(cu_seqlens_q, "cu_seqlens_q");
  p.cu_seqlens_k = view(cu_seqlens_k, "cu_seqlens_k");
  p.max_seqlen_q = static_cast<int>(max_seqlen_q);
  p.max_seqlen_k = static_cast<int>(max_seqlen_k);
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.softcap = static_cast<float>(softcap);
  p.mask = mask_params(causal, window_left, window_right);
  p.stream = current_stream(q.device());
}

std::tuple<at::Tensor, at::Tensor> attention_fwd(const at::Tensor& q_in, const at::Tensor& k_in,
                                                 const at::Tensor& v_in, const OptTensor& cu_seqlens_q,
                                                 const OptTensor& cu_seqlens_k, int64_t max_seqlen_q,
                                                 int64_t max_seqlen_k, const OptTensor& sinks, double softmax_scale,
                                                 bool causal, int64_t window_left, int64_t window_right,
                                                 double softcap, bool /*deterministic: the backward's*/) {
  check_attention_inputs(q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k, sinks);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = loadable(q_in), k = loadable(k_in), v = loadable(v_in);
  const bool varlen = cu_seqlens_q.has_value() || cu_seqlens_k.has_value();
  at::Tensor out = empty_like_cuda(q);
  at::Tensor lse = empty_cuda(lse_shape(q, varlen), at::kFloat, q.device());

  flare::AttentionForwardParams p;
  fill_attention_args(p, q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, softcap,
                      causal, window_left, window_right);
  p.lse = view(lse, "lse");
  p.sinks = view(sinks, "sinks");
  run_attention_forward(p, q.device(), kAttentionNames);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_bwd(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse, const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, const OptTensor& sinks, double softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, double softcap, bool deterministic) {
  check_attention_inputs(q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k, sinks);
  check_cuda(dout_in, "dout", q_in.device());
  check_cuda(out_in, "out", q_in.device());
  check_cuda(lse, "lse", q_in.device());
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = loadable(q_in), k = loadable(k_in), v = loadable(v_in);
  const at::Tensor out = loadable(out_in), dout = loadable(dout_in.to(q.scalar_type()));
  at::Tensor dq = empty_like_cuda(q);
  at::Tensor dk = empty_like_cuda(k);
  at::Tensor dv = empty_like_cuda(v);
  at::Tensor dsinks = sinks.has_value() ? empty_like_cuda(*sinks) : empty_cuda({0}, at::kFloat, q.device());

  flare::AttentionBackwardParams p;
  fill_attention_args(p, q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, softcap,
                      causal, window_left, window_right);
  p.dout = view(dout, "dout");
  const at::Tensor lse_c = lse.contiguous();
  p.lse = view(lse_c, "lse");
  p.dq = view(dq, "dq");
  p.dk = view(dk, "dk");
  p.dv = view(dv, "dv");
  if (sinks.has_value()) {
    p.sinks = view(*sinks, "sinks");
    p.dsinks = view(dsinks, "dsinks");
  }
  p.deterministic = deterministic;
  std::size_t bytes = 0;
  throw_if_error(flare::attention_backward_workspace_size(p, &bytes), kAttentionNames);
  const at::Tensor workspace = workspace_tensor(bytes, q.device());
  p.workspace = workspace.data_ptr();
  p.workspace_bytes = bytes;
  throw_if_error(flare::attention_backward(p), kAttentionNames);
  return {dq, dk, dv, dsinks};
}

// ---- merge_states -----------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> merge_states(const at::Tensor& partial_out_in, const at::Tensor& partial_lse_in,
                                                std::optional<at::ScalarType> out_dtype) {
  check_cuda(partial_out_in, "partial_out", partial_out_in.device());
  check_cuda(partial_lse_in, "partial_lse", partial_out_in.device());
  TORCH_CHECK_VALUE(partial_out_in.dim() >= 2, "argument 'partial_out': expected [rows..., num_states, dim], got rank ",
                    partial_out_in.dim());
  const c10::cuda::CUDAGuard guard(partial_out_in.device());
  const at::Tensor partial_out = partial_out_in.contiguous(), partial_lse = partial_lse_in.contiguous();
  std::vector<int64_t> out_shape(partial_out.sizes().begin(), partial_out.sizes().end());
  out_shape.erase(out_shape.end() - 2);
  std::vector<int64_t> lse_shape(out_shape.begin(), out_shape.end() - 1);
  at::Tensor out = empty_cuda(out_shape, out_dtype.value_or(partial_out.scalar_type()), partial_out.device());
  at::Tensor lse = empty_cuda(lse_shape, at::kFloat, partial_out.device());

  flare::MergeStatesParams p;
  p.partial_out = view(partial_out, "partial_out");
  p.partial_lse = view(partial_lse, "partial_lse");
  p.out = view(out, "out");
  p.lse = view(lse, "lse");
  p.stream = current_stream(partial_out.device());
  throw_if_error(flare::merge_states(p), {{"out", "out_dtype"}});
  return {out, lse};
}

// ---- decode -----------------------------------------------------------------------------------

const Renames kDecodeNames = {{"page_table", "block_table"}, {"window_left", "window_size"}};

// A measured table of decode split counts (bench_decode --tune), loaded from Python.
std::mutex g_table_mutex;
std::shared_ptr<const flare::DecodeTuningTable> g_tuning_table;

std::shared_ptr<const flare::DecodeTuningTable> tuning_table() {
  const std::lock_guard<std::mutex> lock(g_table_mutex);
  return g_tuning_table;
}

void load_decode_tuning_table(const std::string& path) {
  auto table = std::make_shared<flare::DecodeTuningTable>();
  if (!path.empty()) throw_if_error(table->load(path));
  const std::lock_guard<std::mutex> lock(g_table_mutex);
  g_tuning_table = path.empty() ? nullptr : std::move(table);
}

int num_sms(int device) {
  static std::array<int, 64> cached{};
  TORCH_CHECK(device >= 0 && device < static_cast<int>(cached.size()), "flare: device index ", device);
  if (cached[device] == 0) cached[device] = at::cuda::getDeviceProperties(device)->multiProcessorCount;
  return cached[device];
}

// num_splits > 0 forces that split count (1: the standard kernel); 0 asks the planner. A forced
// count that is the planner's own choice takes the planner's whole plan (its engine, combine and
// heads per CTA from the tuning table), so plan_kvcache() followed by num_splits=plan.num_splits
// runs exactly the planned kernel.
flare::DecodePlan plan_for(const flare::DecodeShapeKey& key, int64_t num_splits, int device) {
  flare::DecodePlan plan;
  const auto table = tuning_table();
  throw_if_error(flare::decode_plan(key, table.get(), num_sms(device), &plan), {});
  if (num_splits > 0 && plan.num_splits != num_splits)
    throw_if_error(flare::decode_plan_for_splits(key, static_cast<int>(num_splits), &plan), {});
  return plan;
}

flare::DecodeShapeKey decode_key(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t head_dim, int64_t q_len,
                                 int64_t max_cache_len, int64_t page_size, int64_t window_left, bool bf16) {
  flare::DecodeShapeKey key;
  key.batch = static_cast<int>(batch);
  key.heads_q = static_cast<int>(heads_q);
  key.heads_kv = static_cast<int>(heads_kv);
  key.head_dim = static_cast<int>(head_dim);
  key.q_len = static_cast<int>(q_len);
  key.max_cache_len = max_cache_len;
  key.page_size = static_cast<int>(page_size);
  key.window_left = static_cast<int>(window_left);
  key.dtype = bf16 ? flare::DType::kBFloat16 : flare::DType::kFloat16;
  return key;
}

const char* plan_source_name(flare::DecodePlanSource source) {
  switch (source) {
    case flare::DecodePlanSource::kTuningTable: return "tuning_table";
    case flare::DecodePlanSource::kForced: return "forced";
    default: return "heuristic";
  }
}

// A plan as Python's KVCachePlan takes it.
py::dict plan_dict(const flare::DecodePlan& plan) {
  py::dict d;
  d["kernel"] = flare::decode_kernel_name(plan.kernel);
  d["num_splits"] = plan.num_splits;
  d["kv_chunk"] = plan.kv_chunk;
  d["workspace_bytes"] = plan.workspace_bytes;
  d["source"] = plan_source_name(plan.source);
  return d;
}

// The plan of a decode shape, for Python to size a workspace once (CUDA graphs): a dict with
// kernel, num_splits, kv_chunk, workspace_bytes and source.
py::dict decode_plan_info(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t head_dim, int64_t q_len,
                          int64_t max_cache_len, int64_t page_size, int64_t window_left, bool bf16,
                          int64_t num_splits, int64_t device) {
  const flare::DecodeShapeKey key =
      decode_key(batch, heads_q, heads_kv, head_dim, q_len, max_cache_len, page_size, window_left, bf16);
  return plan_dict(plan_for(key, num_splits, static_cast<int>(device)));
}

// A split-KV plan's workspace: the caller's (checked: contiguous, large enough), else a new one.
at::Tensor plan_workspace(const flare::DecodePlan& plan, const OptTensor& workspace, const at::Device& device) {
  if (!workspace.has_value()) return workspace_tensor(plan.workspace_bytes, device);
  const auto bytes = static_cast<std::size_t>(workspace->numel()) * workspace->element_size();
  TORCH_CHECK_VALUE(workspace->is_contiguous() && bytes >= plan.workspace_bytes, "argument 'workspace': the plan (",
                    plan.num_splits, " splits) needs a contiguous buffer of ", plan.workspace_bytes, " bytes, got ",
                    bytes, " bytes");
  return *workspace;
}

std::size_t tensor_bytes(const at::Tensor& t) { return static_cast<std::size_t>(t.numel()) * t.element_size(); }

// The plan depends on the shapes only; a decode loop asks for the same one every step. The last
// shapes seen (per thread) and their plan are kept, so a repeated call skips the validation pass
// and the planner (decode_run validates every call anyway). The table pointer is part of the key:
// loading a table re-plans.
struct DecodePlanMemo {
  std::array<int64_t, 16> dims{};
  const void* table = nullptr;
  bool valid = false;
  flare::DecodePlan plan;
};

flare::DecodePlan memoized_plan(const flare::DecodeParams& p, const OptTensor& page_table, int64_t num_splits,
                                int device) {
  thread_local DecodePlanMemo memo;
  const auto table = tuning_table();
  std::array<int64_t, 16> dims{};
  for (int i = 0; i < 4; ++i) dims[i] = p.q.shape[i], dims[4 + i] = p.k_cache.shape[i];
  dims[8] = page_table.has_value() ? page_table->size(0) : -1;
  dims[9] = page_table.has_value() ? page_table->size(1) : -1;
  dims[10] = p.window_left;
  dims[11] = static_cast<int64_t>(p.q.dtype);
  dims[12] = num_splits;
  dims[13] = device;
  dims[14] = p.causal;
  dims[15] = p.v_cache.shape[3];
  if (memo.valid && memo.dims == dims && memo.table == table.get()) return memo.plan;
  flare::DecodeShapeKey key;
  throw_if_error(flare::decode_shape_key(p, &key), kDecodeNames);
  memo.plan = plan_for(key, num_splits, device);
  memo.dims = dims;
  memo.table = table.get();
  memo.valid = true;
  return memo.plan;
}

std::tuple<at::Tensor, at::Tensor> decode(const at::Tensor& q_in, const at::Tensor& k_cache,
                                          const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                                          const OptTensor& page_table, const OptTensor& workspace,
                                          double softmax_scale, bool causal, int64_t window_left,
                                          int64_t num_splits, bool return_lse) {
  const at::Device device = q_in.device();
  check_cuda(q_in, "q", device);
  check_cuda(k_cache, "k_cache", device);
  check_cuda(v_cache, "v_cache", device);
  check_cuda(cache_seqlens, "cache_seqlens", device);
  check_cuda(page_table, "block_table", device);
  check_cuda(workspace, "workspace", device);
  check_half(q_in, "q");
  check_same_dtype(k_cache, "k_cache", q_in);
  check_same_dtype(v_cache, "v_cache", q_in);
  check_int32(cache_seqlens, "cache_seqlens");
  check_int32(page_table, "block_table");
  TORCH_CHECK_VALUE(q_in.dim() == 4, "argument 'q': expected rank 4 [batch, q_len, heads, head_dim], got rank ",
                    q_in.dim());
  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor q = loadable(q_in);
  at::Tensor out = empty_like_cuda(q);
  // Not asked for: undefined here (None from the direct call), an empty tensor from the op.
  at::Tensor lse = return_lse ? empty_cuda({q.size(0), q.size(2), q.size(1)}, at::kFloat, device) : at::Tensor();

  flare::DecodeParams p;
  p.q = view(q, "q");
  p.k_cache = view(k_cache, "k_cache");
  p.v_cache = view(v_cache, "v_cache");
  p.page_table = view(page_table, "page_table");
  p.cache_seqlens = view(cache_seqlens, "cache_seqlens");
  p.out = view(out, "out");
  if (return_lse) p.lse = view(lse, "lse");
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.causal = causal;
  p.window_left = static_cast<int>(window_left);
  p.stream = current_stream(device);

  const flare::DecodePlan plan = memoized_plan(p, page_table, num_splits, device.index());
  const at::Tensor ws = plan.workspace_bytes > 0 ? plan_workspace(plan, workspace, device) : at::Tensor();
  throw_if_error(flare::decode_run(plan, p, ws.defined() ? ws.data_ptr() : nullptr, ws.defined() ? tensor_bytes(ws) : 0),
                 kDecodeNames);
  return {out, lse};
}

// The eager fast path of a decode loop (flare.KVCacheDecoder): everything that depends on shapes only
// (validation of the shapes, the plan, the workspace) happens once, at construction; run() checks
// that the step's tensors have the planned shapes and sit on the planned device, and hands them to
// flare::decode_run (which validates dtypes, strides and alignment on every call, as it does for a
// C++ caller). An out= (and lse=) buffer makes a step allocate nothing.
class DecodeRunner {
 public:
  DecodeRunner(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
               const OptTensor& page_table, const OptTensor& workspace, double softmax_scale, bool causal,
               int64_t window_left, int64_t num_splits, bool return_lse)
      : device_(q.device()), return_lse_(return_lse), paged_(page_table.has_value()) {
    check_cuda(q, "q", device_);
    check_cuda(k_cache, "k_cache", device_);
    check_cuda(v_cache, "v_cache", device_);
    check_cuda(page_table, "block_table", device_);
    check_cuda(workspace, "workspace", device_);
    TORCH_CHECK_VALUE(q.dim() == 4, "argument 'q': expected rank 4 [batch, q_len, heads, head_dim], got rank ",
                      q.dim());
    const c10::cuda::CUDAGuard guard(device_);
    q_sizes_ = q.sizes().vec();
    k_sizes_ = k_cache.sizes().vec();
    v_sizes_ = v_cache.sizes().vec();
    if (paged_) table_sizes_ = page_table->sizes().vec();
    params_.softmax_scale = static_cast<float>(softmax_scale);
    params_.causal = causal;
    params_.window_left = static_cast<int>(window_left);
    // The shape key of these tensors (validated as a call would be: a throwaway out and lengths).
    const at::Tensor out = empty_like_cuda(q);
    const at::Tensor lengths = empty_cuda({q.size(0)}, at::kInt, device_);
    flare::DecodeParams p = step_params(loadable(q), k_cache, v_cache, lengths, page_table, out, std::nullopt);
    flare::DecodeShapeKey key;
    throw_if_error(flare::decode_shape_key(p, &key), kDecodeNames);
    plan_ = plan_for(key, num_splits, device_.index());
    if (plan_.workspace_bytes > 0) {
      workspace_ = plan_workspace(plan_, workspace, device_);
      workspace_bytes_ = tensor_bytes(workspace_);
    }
  }

  // out [batch, q_len, heads, head_dim] (and lse [batch, heads, q_len] when return_lse).
  py::object run(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& cache_seqlens, const OptTensor& page_table, const OptTensor& out_in,
                 const OptTensor& lse_in) {
    check_step(q_in, "q", q_sizes_);
    check_step(k_cache, "k_cache", k_sizes_);
    check_step(v_cache, "v_cache", v_sizes_);
    TORCH_CHECK_VALUE(cache_seqlens.device() == device_, "argument 'cache_seqlens': is on ", cache_seqlens.device(),
                      ", expected ", device_, " (the decoder's device)");
    TORCH_CHECK_VALUE(page_table.has_value() == paged_, "argument 'block_table': the decoder was planned ",
                      paged_ ? "for a paged cache: pass its block_table" : "for a contiguous cache: pass None");
    if (paged_) check_step(*page_table, "block_table", table_sizes_);
    const c10::cuda::CUDAGuard guard(device_);
    const at::Tensor q = loadable(q_in);
    at::Tensor out = out_in.has_value() ? *out_in : empty_like_cuda(q);
    if (out_in.has_value()) check_step(out, "out", q_sizes_);
    at::Tensor lse;
    if (return_lse_) {
      lse = lse_in.has_value() ? *lse_in : empty_cuda({q.size(0), q.size(2), q.size(1)}, at::kFloat, device_);
      if (lse_in.has_value()) check_step(lse, "lse", {q.size(0), q.size(2), q.size(1)});
    } else {
      TORCH_CHECK_VALUE(!lse_in.has_value(), "argument 'lse': the decoder was made with return_softmax_lse=False");
    }
    flare::DecodeParams p = step_params(q, k_cache, v_cache, cache_seqlens, page_table, out, lse);
    throw_if_error(flare::decode_run(plan_, p, workspace_.defined() ? workspace_.data_ptr() : nullptr,
                                     workspace_bytes_),
                   kDecodeNames);
    if (!return_lse_) return py::cast(out);
    return py::cast(std::make_tuple(out, lse));
  }

  py::dict plan_info() const { return plan_dict(plan_); }

 private:
  void check_step(const at::Tensor& t, const char* name, at::IntArrayRef sizes) const {
    TORCH_CHECK_VALUE(t.device() == device_, "argument '", name, "': is on ", t.device(), ", expected ", device_,
                      " (the decoder's device)");
    TORCH_CHECK_VALUE(t.sizes() == sizes, "argument '", name, "': shape ", t.sizes(), " differs from the ", sizes,
                      " the decoder was planned for");
  }

  flare::DecodeParams step_params(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& cache_seqlens, const OptTensor& page_table,
                                  const at::Tensor& out, const OptTensor& lse) const {
    flare::DecodeParams p = params_;
    p.q = view(q, "q");
    p.k_cache = view(k_cache, "k_cache");
    p.v_cache = view(v_cache, "v_cache");
    p.page_table = view(page_table, "page_table");
    p.cache_seqlens = view(cache_seqlens, "cache_seqlens");
    p.out = view(out, "out");
    p.lse = view(lse, "lse");
    p.stream = current_stream(device_);
    return p;
  }

  at::Device device_;
  bool return_lse_;
  bool paged_;
  std::vector<int64_t> q_sizes_, k_sizes_, v_sizes_, table_sizes_;
  flare::DecodeParams params_;  // the scalars of every step
  flare::DecodePlan plan_;
  at::Tensor workspace_;
  std::size_t workspace_bytes_ = 0;
};

// The C++ side of the Python-overhead benchmark (python/bench_overhead.py): `iters` decode launches
// of one plan straight through flare::decode_run, no torch in the loop; the host seconds per call.
double bench_decode_run_loop(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& cache_seqlens, const at::Tensor& workspace, int64_t num_splits,
                             int64_t iters) {
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = empty_like_cuda(q);
  flare::DecodeParams p;
  p.q = view(q, "q");
  p.k_cache = view(k_cache, "k_cache");
  p.v_cache = view(v_cache, "v_cache");
  p.cache_seqlens = view(cache_seqlens, "cache_seqlens");
  p.out = view(out, "out");
  p.stream = current_stream(q.device());
  flare::DecodeShapeKey key;
  throw_if_error(flare::decode_shape_key(p, &key));
  const flare::DecodePlan plan = plan_for(key, num_splits, q.device().index());
  const std::size_t bytes = static_cast<std::size_t>(workspace.numel());
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) throw_if_error(flare::decode_run(plan, p, workspace.data_ptr(), bytes));
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  return elapsed.count() / static_cast<double>(iters);
}

// The op's form: a Tensor for every output (an empty one for the LSE not asked for).
std::tuple<at::Tensor, at::Tensor> decode_op(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                             const at::Tensor& cache_seqlens, const OptTensor& page_table,
                                             const OptTensor& workspace, double softmax_scale, bool causal,
                                             int64_t window_left, int64_t num_splits, bool return_lse) {
  auto [out, lse] = decode(q, k_cache, v_cache, cache_seqlens, page_table, workspace, softmax_scale, causal,
                           window_left, num_splits, return_lse);
  if (!lse.defined()) lse = empty_cuda({0}, at::kFloat, q.device());
  return {out, lse};
}

// ---- KDA --------------------------------------------------------------------------------------

// The in-kernel options of every KDA op, from the schema's scalars.
flare::KdaOptions kda_options(double scale, bool qk_l2norm, bool beta_sigmoid, bool allow_neg_eigval,
                              bool gate_in_kernel, double lower_bound) {
  flare::KdaOptions o;
  o.scale = static_cast<float>(scale);
  o.qk_l2norm = qk_l2norm;
  o.beta_sigmoid = beta_sigmoid;
  o.allow_neg_eigval = allow_neg_eigval;
  o.gate_in_kernel = gate_in_kernel;
  o.lower_bound = static_cast<float>(lower_bound);
  return o;
}

// The inputs every KDA op takes: checked first (device, 16-bit q), then q/k/v made loadable and
// g/beta contiguous on q's device.
struct KdaInputs {
  at::Tensor q, k, v, g, beta;
};
KdaInputs kda_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                     const at::Tensor& beta, const OptTensor& A_log, const OptTensor& dt_bias, const OptTensor& cu_seqlens) {
  const at::Device device = q.device();
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&g, "g"}, {&beta, "beta"}})
    check_cuda(*t, name, device);
  check_cuda(A_log, "A_log", device);
  check_cuda(dt_bias, "dt_bias", device);
  check_cuda(cu_seqlens, "cu_seqlens", device);
  check_half(q, "q");
  const c10::cuda::CUDAGuard guard(device);
  return {loadable(q), loadable(k), loadable(v), g.contiguous(), beta.contiguous()};
}

// The fields every KDA op's params share (KdaForwardParams, KdaBackwardParams, KdaRecurrentParams).
template <typename Params>
void fill_kda_args(Params& p, const KdaInputs& in, const OptTensor& A_log, const OptTensor& dt_bias,
                   const OptTensor& cu_seqlens, const flare::KdaOptions& options) {
  p.q = view(in.q, "q");
  p.k = view(in.k, "k");
  p.v = view(in.v, "v");
  p.g = view(in.g, "g");
  p.beta = view(in.beta, "beta");
  p.A_log = view(A_log, "A_log");
  p.dt_bias = view(dt_bias, "dt_bias");
  p.cu_seqlens = view(cu_seqlens, "cu_seqlens");
  p.options = options;
  p.stream = current_stream(in.q.device());
}

std::tuple<at::Tensor, at::Tensor> kda_fwd(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                           const at::Tensor& g_in, const at::Tensor& beta_in, const OptTensor& A_log,
                                           const OptTensor& dt_bias, const OptTensor& initial_state,
                                           const OptTensor& cu_seqlens, double scale, bool qk_l2norm,
                                           bool beta_sigmoid, bool allow_neg_eigval, bool gate_in_kernel,
                                           double lower_bound, bool output_final_state) {
  const at::Device device = q_in.device();
  const KdaInputs in = kda_inputs(q_in, k_in, v_in, g_in, beta_in, A_log, dt_bias, cu_seqlens);
  check_cuda(initial_state, "initial_state", device);
  TORCH_CHECK_VALUE(q_in.dim() == 4 && v_in.dim() == 4,
                    "arguments 'q' and 'v': expected rank 4 [B, T, H, K] and [B, T, HV, V]");
  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor &q = in.q, &v = in.v;
  const OptTensor h0 = initial_state.has_value() ? OptTensor(initial_state->contiguous()) : std::nullopt;
  const int64_t num_seqs = cu_seqlens.has_value() ? cu_seqlens->size(0) - 1 : q.size(0);
  at::Tensor out = empty_cuda(v.sizes(), q.scalar_type(), device);
  at::Tensor final_state =
      output_final_state ? empty_cuda({num_seqs, v.size(2), q.size(3), v.size(3)}, at::kFloat, device)
                         : empty_cuda({0}, at::kFloat, device);

  flare::KdaForwardParams p;
  fill_kda_args(p, in, A_log, dt_bias, cu_seqlens,
                kda_options(scale, qk_l2norm, beta_sigmoid, allow_neg_eigval, gate_in_kernel, lower_bound));
  p.initial_state = view(h0, "initial_state");
  p.out = view(out, "out");
  if (output_final_state) p.final_state = view(final_state, "final_state");
  const Renames names = {{"options.scale", "scale"}, {"options.lower_bound", "lower_bound"}};
  std::size_t bytes = 0;
  throw_if_error(flare::kda_forward_workspace_size(p, &bytes), names);
  const at::Tensor workspace = workspace_tensor(bytes, device);
  p.workspace = workspace.data_ptr();
  p.workspace_bytes = bytes;
  throw_if_error(flare::kda_forward(p), names);
  return {out, final_state};
}

// The chunked KDA backward: gradients w.r.t. the raw inputs (through the in-kernel options), as
// flare::kda_backward gives them. Absent gradients come back as empty tensors: d_initial_state
// without initial_state, dA_log / ddt_bias without gate_in_kernel (or without A_log / dt_bias).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> kda_bwd(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& g_in, const at::Tensor& beta_in, const OptTensor& A_log, const OptTensor& dt_bias,
    const OptTensor& initial_state, const OptTensor& d_final_state, const OptTensor& cu_seqlens, double scale,
    bool qk_l2norm, bool beta_sigmoid, bool allow_neg_eigval, bool gate_in_kernel, double lower_bound) {
  const at::Device device = q_in.device();
  const KdaInputs in = kda_inputs(q_in, k_in, v_in, g_in, beta_in, A_log, dt_bias, cu_seqlens);
  check_cuda(dout_in, "dout", device);
  check_cuda(initial_state, "initial_state", device);
  check_cuda(d_final_state, "d_final_state", device);
  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor dout = loadable(dout_in);
  const OptTensor h0 = initial_state.has_value() ? OptTensor(initial_state->contiguous()) : std::nullopt;
  const OptTensor dht = d_final_state.has_value() ? OptTensor(d_final_state->contiguous()) : std::nullopt;
  at::Tensor dq = empty_like_cuda(in.q), dk = empty_like_cuda(in.k), dv = empty_like_cuda(in.v);
  at::Tensor dg = empty_like_cuda(in.g), dbeta = empty_like_cuda(in.beta);
  const at::Tensor none = empty_cuda({0}, at::kFloat, device);
  at::Tensor dh0 = h0.has_value() ? empty_like_cuda(*h0) : none;
  const bool gate_grads = gate_in_kernel;
  at::Tensor dA_log = gate_grads && A_log.has_value() ? empty_like_cuda(*A_log) : none;
  at::Tensor ddt_bias = gate_grads && dt_bias.has_value() ? empty_like_cuda(*dt_bias) : none;

  flare::KdaBackwardParams p;
  fill_kda_args(p, in, A_log, dt_bias, cu_seqlens,
                kda_options(scale, qk_l2norm, beta_sigmoid, allow_neg_eigval, gate_in_kernel, lower_bound));
  p.initial_state = view(h0, "initial_state");
  p.dout = view(dout, "dout");
  p.d_final_state = view(dht, "d_final_state");
  p.dq = view(dq, "dq");
  p.dk = view(dk, "dk");
  p.dv = view(dv, "dv");
  p.dg = view(dg, "dg");
  p.dbeta = view(dbeta, "dbeta");
  if (h0.has_value()) p.d_initial_state = view(dh0, "d_initial_state");
  if (dA_log.numel() > 0) p.dA_log = view(dA_log, "dA_log");
  if (ddt_bias.numel() > 0) p.ddt_bias = view(ddt_bias, "ddt_bias");
  const Renames names = {{"options.scale", "scale"}, {"options.lower_bound", "lower_bound"}};
  std::size_t bytes = 0;
  throw_if_error(flare::kda_backward_workspace_size(p, &bytes), names);
  const at::Tensor workspace = workspace_tensor(bytes, device);
  p.workspace = workspace.data_ptr();
  p.workspace_bytes = bytes;
  throw_if_error(flare::kda_backward(p), names);
  return {dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias};
}

// ---- KDA recurrent step (decode) --------------------------------------------------------------

// flare's names -> the Python API's (flare.fused_recurrent_kda): the pool is FLA's initial_state.
const Renames kKdaRecurrentNames = {{"options.scale", "scale"},
                                    {"options.lower_bound", "lower_bound"},
                                    {"state_indices", "ssm_state_indices"},
                                    {"state", "initial_state"}};

// One call of flare::kda_recurrent_step. `state` is used as given (never copied): the step
// updates it in place unless `final_state` is given.
at::Tensor kda_recurrent_run(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                             const at::Tensor& g_in, const at::Tensor& beta_in, const OptTensor& A_log,
                             const OptTensor& dt_bias, const OptTensor& state, const OptTensor& state_indices,
                             const OptTensor& final_state, const OptTensor& cu_seqlens, double scale, bool qk_l2norm,
                             bool beta_sigmoid, bool allow_neg_eigval, bool gate_in_kernel, double lower_bound) {
  const at::Device device = q_in.device();
  const KdaInputs in = kda_inputs(q_in, k_in, v_in, g_in, beta_in, A_log, dt_bias, cu_seqlens);
  check_cuda(state, "initial_state", device);
  check_cuda(state_indices, "ssm_state_indices", device);
  TORCH_CHECK_VALUE(q_in.dim() == 4 && v_in.dim() == 4,
                    "arguments 'q' and 'v': expected rank 4 [B, T, H, K] and [B, T, HV, V]");
  const c10::cuda::CUDAGuard guard(device);
  at::Tensor out = empty_cuda(in.v.sizes(), in.q.scalar_type(), device);

  flare::KdaRecurrentParams p;
  fill_kda_args(p, in, A_log, dt_bias, cu_seqlens,
                kda_options(scale, qk_l2norm, beta_sigmoid, allow_neg_eigval, gate_in_kernel, lower_bound));
  p.state = view(state, "initial_state");
  p.state_indices = view(state_indices, "ssm_state_indices");
  p.final_state = view(final_state, "final_state");
  p.out = view(out, "out");
  throw_if_error(flare::kda_recurrent_step(p), kKdaRecurrentNames);
  return out;
}

// The pool form (FLA's fused_recurrent_kda_fwd with ssm_state_indices / inplace_final_state):
// `state` [P, HV, K, V] is updated in place; returns the output.
at::Tensor kda_recurrent_inplace(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                 const at::Tensor& beta, const OptTensor& A_log, const OptTensor& dt_bias,
                                 const at::Tensor& state, const OptTensor& state_indices, const OptTensor& cu_seqlens,
                                 double scale, bool qk_l2norm, bool beta_sigmoid, bool allow_neg_eigval,
                                 bool gate_in_kernel, double lower_bound) {
  return kda_recurrent_run(q, k, v, g, beta, A_log, dt_bias, state, state_indices, std::nullopt, cu_seqlens, scale,
                           qk_l2norm, beta_sigmoid, allow_neg_eigval, gate_in_kernel, lower_bound);
}

// The functional form (FLA's fused_recurrent_kda): initial_state [N, HV, K, V] is only read; the
// final states go to a new tensor (an empty one when not asked for).
std::tuple<at::Tensor, at::Tensor> kda_recurrent(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const at::Tensor& g, const at::Tensor& beta, const OptTensor& A_log,
                                                 const OptTensor& dt_bias, const OptTensor& initial_state,
                                                 const OptTensor& cu_seqlens, double scale, bool qk_l2norm,
                                                 bool beta_sigmoid, bool allow_neg_eigval, bool gate_in_kernel,
                                                 double lower_bound, bool output_final_state) {
  check_cuda(q, "q", q.device());
  check_cuda(v, "v", q.device());
  check_cuda(cu_seqlens, "cu_seqlens", q.device());
  TORCH_CHECK_VALUE(q.dim() == 4 && v.dim() == 4,
                    "arguments 'q' and 'v': expected rank 4 [B, T, H, K] and [B, T, HV, V]");
  TORCH_CHECK_VALUE(!cu_seqlens.has_value() || (cu_seqlens->dim() == 1 && cu_seqlens->size(0) >= 2),
                    "argument 'cu_seqlens': expected shape [N + 1] with N >= 1, got ",
                    cu_seqlens.has_value() ? cu_seqlens->sizes() : at::IntArrayRef{});
  const int64_t num_seqs = cu_seqlens.has_value() ? cu_seqlens->size(0) - 1 : q.size(0);
  // With an initial state and no final state asked for, the states still need somewhere to go
  // that is not initial_state.
  const bool sink = output_final_state || initial_state.has_value();
  const at::Tensor final_state = sink ? empty_cuda({num_seqs, v.size(2), q.size(3), v.size(3)}, at::kFloat, q.device())
                                      : empty_cuda({0}, at::kFloat, q.device());
  const OptTensor h0 = initial_state.has_value() ? OptTensor(initial_state->contiguous()) : std::nullopt;
  at::Tensor out = kda_recurrent_run(q, k, v, g, beta, A_log, dt_bias, h0, std::nullopt,
                                     sink ? OptTensor(final_state) : std::nullopt, cu_seqlens, scale, qk_l2norm,
                                     beta_sigmoid, allow_neg_eigval, gate_in_kernel, lower_bound);
  return {out, output_final_state ? final_state : empty_cuda({0}, at::kFloat, q.device())};
}

// ---- flex attention: FlexAttention's layout and block masks -----------------------------------
//
// q/k/v come in FlexAttention's [batch, heads, seqlen, head_dim] and reach flare as transposed views
// ([batch, seqlen, heads, head_dim], no copy); out and the gradients are allocated in FlexAttention's
// layout, contiguous. The block mask is flare::BlockMask (mask.h) over the BlockMask's own tensors
// (python/flare/flex.py converts a torch BlockMask into these arguments once and caches them); no
// kv_num_blocks means no mask (dense attention, every key visible).

// Errors name FlexAttention's arguments and the BlockMask's fields.
const Renames kFlexNames = {
    {"q", "query"}, {"k", "key"}, {"v", "value"}, {"softmax_scale", "scale"},
    {"kv_num_blocks", "block_mask.kv_num_blocks"}, {"kv_indices", "block_mask.kv_indices"},
    {"full_kv_num_blocks", "block_mask.full_kv_num_blocks"}, {"full_kv_indices", "block_mask.full_kv_indices"},
    {"q_num_blocks", "block_mask.q_num_blocks"}, {"q_indices", "block_mask.q_indices"},
    {"full_q_num_blocks", "block_mask.full_q_num_blocks"}, {"full_q_indices", "block_mask.full_q_indices"},
    {"q_block_size", "block_mask.BLOCK_SIZE"}, {"kv_block_size", "block_mask.BLOCK_SIZE"},
    {"element.window_left", "element_mask.window_left"}, {"element.window_right", "element_mask.window_right"},
    {"element.prefix_length", "element_mask.prefix_length"}, {"element.doc_ids_q", "element_mask.doc_ids_q"},
    {"element.doc_ids_k", "element_mask.doc_ids_k"}, {"element.bits", "element_mask.bits"}};

// The block-mask arguments of flex_fwd and flex_bwd, in schema order (FLARE_FLEX_MASK_SCHEMA).
struct FlexMaskArgs {
  const OptTensor &kv_num_blocks, &kv_indices, &full_kv_num_blocks, &full_kv_indices;
  const OptTensor &q_num_blocks, &q_indices, &full_q_num_blocks, &full_q_indices;
  int64_t q_block_size, kv_block_size;
  bool causal;
  int64_t window_left, window_right, prefix_length;
  const OptTensor &doc_ids_q, &doc_ids_k, &bits;
  // The deterministic backward's plan (block_sparse_dq_plan's data on the device, its meta).
  const OptTensor& dq_plan;
  c10::IntArrayRef dq_plan_meta;

  bool sparse() const { return kv_num_blocks.has_value(); }
};

#define FLARE_FLEX_MASK_PARAMS                                                                                     \
  const OptTensor &kv_num_blocks, const OptTensor &kv_indices, const OptTensor &full_kv_num_blocks,                \
      const OptTensor &full_kv_indices, const OptTensor &q_num_blocks, const OptTensor &q_indices,                 \
      const OptTensor &full_q_num_blocks, const OptTensor &full_q_indices, int64_t q_block_size,                   \
      int64_t kv_block_size, bool causal, int64_t window_left, int64_t window_right, int64_t prefix_length,        \
      const OptTensor &doc_ids_q, const OptTensor &doc_ids_k, const OptTensor &bits, const OptTensor &dq_plan,     \
      c10::IntArrayRef dq_plan_meta
#define FLARE_FLEX_MASK_ARGS                                                                                       \
  FlexMaskArgs {                                                                                                   \
    kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, q_num_blocks, q_indices, full_q_num_blocks,    \
        full_q_indices, q_block_size, kv_block_size, causal, window_left, window_right, prefix_length, doc_ids_q,  \
        doc_ids_k, bits, dq_plan, dq_plan_meta                                                                     \
  }

// The mask tensors' device and dtype (their shapes and layouts are flare's validate_block_mask's).
void check_flex_mask(const FlexMaskArgs& m, const at::Device& device) {
  const std::pair<const OptTensor*, const char*> tensors[] = {
      {&m.kv_num_blocks, "block_mask.kv_num_blocks"}, {&m.kv_indices, "block_mask.kv_indices"},
      {&m.full_kv_num_blocks, "block_mask.full_kv_num_blocks"}, {&m.full_kv_indices, "block_mask.full_kv_indices"},
      {&m.q_num_blocks, "block_mask.q_num_blocks"}, {&m.q_indices, "block_mask.q_indices"},
      {&m.full_q_num_blocks, "block_mask.full_q_num_blocks"}, {&m.full_q_indices, "block_mask.full_q_indices"},
      {&m.doc_ids_q, "element_mask.doc_ids_q"}, {&m.doc_ids_k, "element_mask.doc_ids_k"},
      {&m.bits, "element_mask.bits"}, {&m.dq_plan, "dq_plan"}};
  for (const auto& [t, name] : tensors) {
    check_cuda(*t, name, device);
    check_int32(*t, name);
  }
  TORCH_CHECK_VALUE(m.sparse() || !(m.kv_indices.has_value() || m.full_kv_num_blocks.has_value() ||
                                    m.q_num_blocks.has_value() || m.bits.has_value() || m.doc_ids_q.has_value()),
                    "argument 'block_mask.kv_num_blocks': required with the other block-mask tensors");
}

// flare's BlockMask over the arguments' memory (valid while they live).
flare::BlockMask flex_block_mask(const FlexMaskArgs& m) {
  flare::BlockMask mask;
  mask.q_block_size = static_cast<int>(m.q_block_size);
  mask.kv_block_size = static_cast<int>(m.kv_block_size);
  mask.kv_num_blocks = view(m.kv_num_blocks, "kv_num_blocks");
  mask.kv_indices = view(m.kv_indices, "kv_indices");
  mask.full_kv_num_blocks = view(m.full_kv_num_blocks, "full_kv_num_blocks");
  mask.full_kv_indices = view(m.full_kv_indices, "full_kv_indices");
  mask.q_num_blocks = view(m.q_num_blocks, "q_num_blocks");
  mask.q_indices = view(m.q_indices, "q_indices");
  mask.full_q_num_blocks = view(m.full_q_num_blocks, "full_q_num_blocks");
  mask.full_q_indices = view(m.full_q_indices, "full_q_indices");
  flare::ElementMask& e = mask.element;
  e.causal = m.causal;
  e.window_left = static_cast<int>(m.window_left);
  e.window_right = static_cast<int>(m.window_right);
  e.prefix_length = static_cast<int>(m.prefix_length);
  e.doc_ids_q = view(m.doc_ids_q, "doc_ids_q");
  e.doc_ids_k = view(m.doc_ids_k, "doc_ids_k");
  e.bits = view(m.bits, "bits");
  return mask;
}

void check_flex_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value) {
  const at::Device device = query.device();
  check_cuda(query, "query", device);
  check_cuda(key, "key", device);
  check_cuda(value, "value", device);
  check_half(query, "query");
  check_same_dtype(key, "key", query);
  check_same_dtype(value, "value", query);
  for (const auto& [t, name] : {std::pair{&query, "query"}, {&key, "key"}, {&value, "value"}})
    TORCH_CHECK_VALUE(t->dim() == 4, "argument '", name, "': expected rank 4 [batch, heads, seqlen, head_dim], got rank ",
                      t->dim());
}

// The deterministic block-sparse backward's plan as Python keeps it: its data (int32) and 16 ints
// of meta (dq_plan_meta): batch, heads, heads_kv, mask batch, mask heads, q blocks, kv blocks,
// q block size, kv block size, the 7 array offsets.
constexpr std::size_t kDqPlanMeta = 16;

std::vector<int64_t> dq_plan_meta_of(const flare::BlockSparseDqPlan& p) {
  std::vector<int64_t> meta = {p.batch,        p.heads,         p.heads_kv,     p.mask_batch,   p.mask_heads,
                               p.num_q_blocks, p.num_kv_blocks, p.q_block_size, p.kv_block_size};
  meta.insert(meta.end(), p.offsets, p.offsets + 7);
  return meta;
}

flare::BlockSparseDqPlan dq_plan_of_meta(c10::IntArrayRef meta) {
  TORCH_CHECK_VALUE(meta.size() == kDqPlanMeta, "argument 'dq_plan_meta': expected ", kDqPlanMeta,
                    " ints (from flare._C.block_sparse_dq_plan), got ", meta.size());
  flare::BlockSparseDqPlan p;
  int* dims[] = {&p.batch,        &p.heads,         &p.heads_kv,     &p.mask_batch,   &p.mask_heads,
                 &p.num_q_blocks, &p.num_kv_blocks, &p.q_block_size, &p.kv_block_size};
  for (std::size_t i = 0; i < 9; ++i) *dims[i] = static_cast<int>(meta[i]);
  for (std::size_t i = 0; i < 7; ++i) p.offsets[i] = meta[9 + i];
  return p;
}

// The plan for a mask's forward lists (CPU tensors) and an attention's shapes: (data, meta), data
// an int32 CPU tensor for the caller to move to the device (flex.py keeps both per mask and shape).
std::tuple<at::Tensor, std::vector<int64_t>> block_sparse_dq_plan(
    const at::Tensor& kv_num_blocks, const at::Tensor& kv_indices, const OptTensor& full_kv_num_blocks,
    const OptTensor& full_kv_indices, int64_t q_block_size, int64_t kv_block_size, int64_t batch, int64_t heads,
    int64_t heads_kv, int64_t seqlen_q, int64_t seqlen_k) {
  flare::BlockMask mask;
  mask.q_block_size = static_cast<int>(q_block_size);
  mask.kv_block_size = static_cast<int>(kv_block_size);
  mask.kv_num_blocks = view(kv_num_blocks, "kv_num_blocks");
  mask.kv_indices = view(kv_indices, "kv_indices");
  mask.full_kv_num_blocks = view(full_kv_num_blocks, "full_kv_num_blocks");
  mask.full_kv_indices = view(full_kv_indices, "full_kv_indices");
  flare::BlockSparseDqPlan plan;
  throw_if_error(flare::make_block_sparse_dq_plan(mask, static_cast<int>(batch), static_cast<int>(heads),
                                                  static_cast<int>(heads_kv), static_cast<int>(seqlen_q),
                                                  static_cast<int>(seqlen_k), &plan),
                 kFlexNames);
  at::Tensor data = at::empty({static_cast<int64_t>(plan.data.size())}, at::kInt);
  std::copy(plan.data.begin(), plan.data.end(), data.data_ptr<int32_t>());
  return {data, dq_plan_meta_of(plan)};
}

// FlexAttention's [batch, heads, seqlen, head_dim] as flare's [batch, seqlen, heads, head_dim].
at::Tensor flare_layout(const at::Tensor& t) { return t.transpose(1, 2); }

std::tuple<at::Tensor, at::Tensor> flex_fwd(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                            FLARE_FLEX_MASK_PARAMS, double scale,
                                            bool /*deterministic: the backward's*/) {
  const FlexMaskArgs m = FLARE_FLEX_MASK_ARGS;
  check_flex_inputs(query, key, value);
  check_flex_mask(m, query.device());
  const c10::cuda::CUDAGuard guard(query.device());
  const at::Tensor q = loadable(flare_layout(query)), k = loadable(flare_layout(key)), v = loadable(flare_layout(value));
  at::Tensor out = empty_cuda({query.size(0), query.size(1), query.size(2), value.size(3)}, query.scalar_type(),
                              query.device());
  at::Tensor lse = empty_cuda({query.size(0), query.size(1), query.size(2)}, at::kFloat, query.device());
  const flare::BlockMask mask = flex_block_mask(m);

  flare::AttentionForwardParams p;
  p.q = view(q, "q");
  p.k = view(k, "k");
  p.v = view(v, "v");
  p.out = view(flare_layout(out), "out");
  p.lse = view(lse, "lse");
  p.softmax_scale = static_cast<float>(scale);
  p.block_mask = m.sparse() ? &mask : nullptr;
  p.stream = current_stream(query.device());
  run_attention_forward(p, query.device(), kFlexNames);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flex_bwd(const at::Tensor& dout_in, const at::Tensor& query,
                                                        const at::Tensor& key, const at::Tensor& value,
                                                        const at::Tensor& out_in, const at::Tensor& lse,
                                                        FLARE_FLEX_MASK_PARAMS, double scale, bool deterministic) {
  const FlexMaskArgs m = FLARE_FLEX_MASK_ARGS;
  check_flex_inputs(query, key, value);
  check_flex_mask(m, query.device());
  check_cuda(dout_in, "dout", query.device());
  check_cuda(out_in, "out", query.device());
  check_cuda(lse, "lse", query.device());
  const c10::cuda::CUDAGuard guard(query.device());
  const at::Tensor q = loadable(flare_layout(query)), k = loadable(flare_layout(key)), v = loadable(flare_layout(value));
  const at::Tensor out = loadable(flare_layout(out_in));
  const at::Tensor dout = loadable(flare_layout(dout_in.to(query.scalar_type())));
  const at::Tensor lse_c = lse.contiguous();
  // Gradients in FlexAttention's layout, contiguous, written through flare-layout views.
  at::Tensor dq = empty_cuda(query.sizes(), query.scalar_type(), query.device());
  at::Tensor dk = empty_cuda(key.sizes(), key.scalar_type(), query.device());
  at::Tensor dv = empty_cuda(value.sizes(), value.scalar_type(), query.device());
  const flare::BlockMask mask = flex_block_mask(m);

  flare::AttentionBackwardParams p;
  p.q = view(q, "q");
  p.k = view(k, "k");
  p.v = view(v, "v");
  p.out = view(out, "out");
  p.dout = view(dout, "dout");
  p.lse = view(lse_c, "lse");
  p.dq = view(flare_layout(dq), "dq");
  p.dk = view(flare_layout(dk), "dk");
  p.dv = view(flare_layout(dv), "dv");
  p.softmax_scale = static_cast<float>(scale);
  p.block_mask = m.sparse() ? &mask : nullptr;
  p.deterministic = deterministic;
  flare::BlockSparseDqPlan plan;
  if (deterministic && m.sparse() && m.dq_plan.has_value()) {
    plan = dq_plan_of_meta(m.dq_plan_meta);
    p.block_mask_dq_plan = &plan;
    p.block_mask_dq_plan_data = m.dq_plan->data_ptr<int32_t>();
  }
  p.stream = current_stream(query.device());
  std::size_t bytes = 0;
  throw_if_error(flare::attention_backward_workspace_size(p, &bytes), kFlexNames);
  const at::Tensor workspace = workspace_tensor(bytes, query.device());
  p.workspace = workspace.data_ptr();
  p.workspace_bytes = bytes;
  throw_if_error(flare::attention_backward(p), kFlexNames);
  return {dq, dk, dv};
}

#undef FLARE_FLEX_MASK_PARAMS
#undef FLARE_FLEX_MASK_ARGS

}  // namespace
}  // namespace flare_torch

TORCH_LIBRARY(flare, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, "
      "int max_seqlen_k, Tensor? sinks, float softmax_scale, bool causal, int window_left, int window_right, "
      "float softcap, bool deterministic) -> (Tensor out, Tensor lse)");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? cu_seqlens_q, "
      "Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, Tensor? sinks, float softmax_scale, bool causal, "
      "int window_left, int window_right, float softcap, bool deterministic) "
      "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dsinks)");
  m.def("merge_states(Tensor partial_out, Tensor partial_lse, ScalarType? out_dtype) -> (Tensor out, Tensor lse)");
  m.def(
      "decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor? page_table, "
      "Tensor? workspace, float softmax_scale, bool causal, int window_left, int num_splits, bool return_lse) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "kda_fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "Tensor? initial_state, Tensor? cu_seqlens, float scale, bool qk_l2norm, bool beta_sigmoid, "
      "bool allow_neg_eigval, bool gate_in_kernel, float lower_bound, bool output_final_state) "
      "-> (Tensor out, Tensor final_state)");
  m.def(
      "kda_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "Tensor? initial_state, Tensor? d_final_state, Tensor? cu_seqlens, float scale, bool qk_l2norm, "
      "bool beta_sigmoid, bool allow_neg_eigval, bool gate_in_kernel, float lower_bound) "
      "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dg, Tensor dbeta, Tensor d_initial_state, Tensor dA_log, "
      "Tensor ddt_bias)");
  m.def(
      "kda_recurrent_inplace(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "Tensor(a!) state, Tensor? state_indices, Tensor? cu_seqlens, float scale, bool qk_l2norm, bool beta_sigmoid, "
      "bool allow_neg_eigval, bool gate_in_kernel, float lower_bound) -> Tensor out");
  m.def(
      "kda_recurrent(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "Tensor? initial_state, Tensor? cu_seqlens, float scale, bool qk_l2norm, bool beta_sigmoid, "
      "bool allow_neg_eigval, bool gate_in_kernel, float lower_bound, bool output_final_state) "
      "-> (Tensor out, Tensor final_state)");
}

// CPU tensors reach the same functions, which reject them with a ValueError naming the argument
// (rather than the dispatcher's "could not run with arguments from the 'CPU' backend").
#define FLARE_TORCH_IMPLS(m)                               \
  m.impl("fwd", &flare_torch::attention_fwd);             \
  m.impl("bwd", &flare_torch::attention_bwd);             \
  m.impl("merge_states", &flare_torch::merge_states);     \
  m.impl("decode", &flare_torch::decode_op);              \
  m.impl("kda_fwd", &flare_torch::kda_fwd);              \
  m.impl("kda_bwd", &flare_torch::kda_bwd);              \
  m.impl("kda_recurrent_inplace", &flare_torch::kda_recurrent_inplace); \
  m.impl("kda_recurrent", &flare_torch::kda_recurrent)

TORCH_LIBRARY_IMPL(flare, CUDA, m) { FLARE_TORCH_IMPLS(m); }
TORCH_LIBRARY_IMPL(flare, CPU, m) { FLARE_TORCH_IMPLS(m); }

// ---- flex attention's ops (python/flare/flex.py) ------------------------------------------------

// The block mask as flex_fwd and flex_bwd take it: the BlockMask's lists (all optional: no
// kv_num_blocks is no mask), its block sizes and the element mask of its partial blocks.
#define FLARE_FLEX_MASK_SCHEMA                                                                                 \
  "Tensor? kv_num_blocks, Tensor? kv_indices, Tensor? full_kv_num_blocks, Tensor? full_kv_indices, "           \
  "Tensor? q_num_blocks, Tensor? q_indices, Tensor? full_q_num_blocks, Tensor? full_q_indices, "               \
  "int q_block_size, int kv_block_size, bool causal, int window_left, int window_right, int prefix_length, "   \
  "Tensor? doc_ids_q, Tensor? doc_ids_k, Tensor? bits, Tensor? dq_plan, int[] dq_plan_meta"

TORCH_LIBRARY_FRAGMENT(flare, m) {
  m.def("flex_fwd(Tensor query, Tensor key, Tensor value, " FLARE_FLEX_MASK_SCHEMA
        ", float scale, bool deterministic) -> (Tensor out, Tensor lse)");
  m.def("flex_bwd(Tensor dout, Tensor query, Tensor key, Tensor value, Tensor out, Tensor lse, " FLARE_FLEX_MASK_SCHEMA
        ", float scale, bool deterministic) -> (Tensor dq, Tensor dk, Tensor dv)");
}

TORCH_LIBRARY_IMPL(flare, CUDA, m) {
  m.impl("flex_fwd", &flare_torch::flex_fwd);
  m.impl("flex_bwd", &flare_torch::flex_bwd);
}

TORCH_LIBRARY_IMPL(flare, CPU, m) {
  m.impl("flex_fwd", &flare_torch::flex_fwd);
  m.impl("flex_bwd", &flare_torch::flex_bwd);
}

namespace {
// FLARE_SEGV_BACKTRACE=1: a crash inside the extension prints its native frames (debugging aid;
// Python's faulthandler shows only the Python ones).
void print_native_backtrace(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  if (const char* e = std::getenv("FLARE_SEGV_BACKTRACE"); e != nullptr && e[0] == '1') signal(SIGSEGV, print_native_backtrace);
  m.doc() = "flare's torch.library ops (torch.ops.flare.*) and host-side planning helpers";
  // The same functions without the dispatcher: the eager fast path of the Python API (plain CUDA
  // tensors, no autograd, no tracing, no dispatch mode), which saves the dispatcher's per-call cost.
  m.def("fwd", &flare_torch::attention_fwd);
  m.def("bwd", &flare_torch::attention_bwd);
  m.def("decode", &flare_torch::decode);
  m.def("merge_states", &flare_torch::merge_states);
  m.def("kda_fwd", &flare_torch::kda_fwd);
  m.def("kda_bwd", &flare_torch::kda_bwd);
  m.def("kda_recurrent_inplace", &flare_torch::kda_recurrent_inplace);
  m.def("flex_fwd", &flare_torch::flex_fwd);
  m.def("flex_bwd", &flare_torch::flex_bwd);
  m.def("block_sparse_dq_plan", &flare_torch::block_sparse_dq_plan,
        "The deterministic block-sparse backward's plan of a mask (CPU lists) and shapes: (int32 data, meta)");
  m.def("decode_plan_info", &flare_torch::decode_plan_info, "The decode plan of a shape (a dict)");
  py::class_<flare_torch::DecodeRunner>(m, "DecodeRunner", "A planned decode step (flare.KVCacheDecoder)")
      .def(py::init<const at::Tensor&, const at::Tensor&, const at::Tensor&, const flare_torch::OptTensor&,
                    const flare_torch::OptTensor&, double, bool, int64_t, int64_t, bool>())
      .def("run", &flare_torch::DecodeRunner::run, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
           py::arg("cache_seqlens"), py::arg("block_table") = py::none(), py::kw_only(),
           py::arg("out") = py::none(), py::arg("lse") = py::none())
      .def("plan_info", &flare_torch::DecodeRunner::plan_info);
  m.def("load_decode_tuning_table", &flare_torch::load_decode_tuning_table,
        "Use a measured decode tuning table (bench_decode --tune); an empty path clears it");
  m.def("bench_decode_run_loop", &flare_torch::bench_decode_run_loop,
        "Host seconds per flare::decode_run call, `iters` calls of one plan (overhead benchmark)");
}
