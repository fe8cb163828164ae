#include "src/common/tensor_checks.h"

#include <limits>
#include <sstream>

namespace flare::detail {

std::string shape_string(const TensorView& t) {
  std::ostringstream s;
  s << "[";
  for (int i = 0; i < t.rank; ++i) s << (i ? ", " : "") << t.shape[i];
  s << "]";
  return s.str();
}

Status check_defined(const TensorView& t, const char* name) {
  if (t.data == nullptr) return Status::InvalidArgument(name, "null data pointer");
  return Status::Ok();
}

Status check_dtype(const TensorView& t, const char* name, std::initializer_list<DType> allowed) {
  std::string names;
  for (DType d : allowed) {
    if (t.dtype == d) return Status::Ok();
    names += (names.empty() ? "" : " or ") + std::string(dtype_name(d));
  }
  return Status::InvalidArgument(name, "dtype " + std::string(dtype_name(t.dtype)) + " not supported, expected " + names);
}

Status check_same_dtype(const TensorView& t, const char* name, const TensorView& like, const char* like_name) {
  if (t.dtype != like.dtype)
    return Status::InvalidArgument(name, "dtype " + std::string(dtype_name(t.dtype)) + " differs from " +
                                             like_name + "'s " + dtype_name(like.dtype));
  return Status::Ok();
}

Status check_rank(const TensorView& t, const char* name, int rank) {
  if (t.rank != rank)
    return Status::InvalidArgument(name, "expected rank " + std::to_string(rank) + ", got rank " +
                                             std::to_string(t.rank) + " " + shape_string(t));
  return Status::Ok();
}

Status check_shape(const TensorView& t, const char* name, std::initializer_list<int64_t> shape) {
  bool ok = t.rank == static_cast<int>(shape.size());
  int i = 0;
  std::string want = "[";
  for (int64_t s : shape) {
    if (ok && t.shape[i] != s) ok = false;
    want += (i ? ", " : "") + std::to_string(s);
    ++i;
  }
  want += "]";
  if (!ok) return Status::InvalidArgument(name, "expected shape " + want + ", got " + shape_string(t));
  return Status::Ok();
}

Status check_device(const TensorView& t, const char* name, DeviceKind kind) {
  if (t.device.kind != kind)
    return Status::InvalidArgument(name, kind == DeviceKind::kCUDA ? "must be on a CUDA device, is on the CPU"
                                                                   : "must be on the CPU, is on a CUDA device");
  return Status::Ok();
}

Status check_last_dim_contiguous(const TensorView& t, const char* name) {
  for (int i = 0; i < t.rank; ++i)
    if (t.stride[i] < 0) return Status::InvalidArgument(name, "negative stride in dim " + std::to_string(i));
  if (t.rank > 0 && t.stride[t.rank - 1] != 1 && t.shape[t.rank - 1] != 1)
    return Status::InvalidArgument(name, "last dimension must be contiguous (stride 1), got stride " +
                                             std::to_string(t.stride[t.rank - 1]));
  return Status::Ok();
}

Status check_aligned16(const TensorView& t, const char* name) {
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0)
    return Status::InvalidArgument(name, "data pointer must be 16-byte aligned");
  const int64_t elem = static_cast<int64_t>(dtype_size(t.dtype));
  for (int i = 0; i + 1 < t.rank; ++i)
    if (t.shape[i] > 1 && (t.stride[i] * elem) % 16 != 0)
      return Status::InvalidArgument(name, "stride of dim " + std::to_string(i) + " (" + std::to_string(t.stride[i]) +
                                               " elements) must be a multiple of 16 bytes");
  return Status::Ok();
}

Status check_index_range(const TensorView& t, const char* name) {
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  int64_t last = 0;
  for (int i = 0; i < t.rank; ++i) {
    if (t.shape[i] < 0) return Status::InvalidArgument(name, "negative size in dim " + std::to_string(i));
    if (t.shape[i] > kInt32Max)
      return Status::InvalidArgument(name, "size " + std::to_string(t.shape[i]) + " of dim " + std::to_string(i) +
                                               " overflows 32-bit indexing");
    if (t.shape[i] == 0) return Status::Ok();
    int64_t term;
    if (__builtin_mul_overflow(t.shape[i] - 1, t.stride[i], &term) || __builtin_add_overflow(last, term, &last))
      return Status::InvalidArgument(name, "element offsets overflow 64-bit indexing");
  }
  int64_t bytes;
  if (__builtin_mul_overflow(last + 1, static_cast<int64_t>(dtype_size(t.dtype)), &bytes))
    return Status::InvalidArgument(name, "byte size overflows 64-bit indexing");
  return Status::Ok();
}

Status check_cu_seqlens(const TensorView& t, const char* name, int64_t batch, int64_t total, int64_t max_len) {
  FLARE_RETURN_IF_ERROR(check_defined(t, name));
  FLARE_RETURN_IF_ERROR(check_dtype(t, name, {DType::kInt32}));
  FLARE_RETURN_IF_ERROR(check_shape(t, name, {batch + 1}));
  if (t.device.kind != DeviceKind::kCPU) return Status::Ok();
  const int32_t* c = t.ptr<int32_t>();
  const int64_t s = t.stride[0];
  if (c[0] != 0) return Status::InvalidArgument(name, "must start at 0, starts at " + std::to_string(c[0]));
  for (int64_t b = 0; b < batch; ++b) {
    int64_t len = static_cast<int64_t>(c[(b + 1) * s]) - c[b * s];
    if (len < 0)
      return Status::InvalidArgument(name, "must be non-decreasing: entry " + std::to_string(b + 1) + " (" +
                                               std::to_string(c[(b + 1) * s]) + ") < entry " + std::to_string(b));
    if (max_len > 0 && len > max_len)
      return Status::InvalidArgument(name, "sequence " + std::to_string(b) + " has length " + std::to_string(len) +
                                               " > max_seqlen " + std::to_string(max_len));
  }
  if (c[batch * s] > total)
    return Status::InvalidArgument(name, "last entry " + std::to_string(c[batch * s]) + " exceeds the " +
                                             std::to_string(total) + " rows of the packed tensor");
  return Status::Ok();
}

Status check_operand(const TensorView& t, const char* name, int rank, DeviceKind device) {
  FLARE_RETURN_IF_ERROR(check_defined(t, name));
  FLARE_RETURN_IF_ERROR(check_rank(t, name, rank));
  FLARE_RETURN_IF_ERROR(check_device(t, name, device));
  FLARE_RETURN_IF_ERROR(check_index_range(t, name));
  FLARE_RETURN_IF_ERROR(check_last_dim_contiguous(t, name));
  return check_aligned16(t, name);
}

Status check_elementwise_operand(const TensorView& t, const char* name, int rank, DeviceKind device) {
  FLARE_RETURN_IF_ERROR(check_defined(t, name));
  FLARE_RETURN_IF_ERROR(check_rank(t, name, rank));
  FLARE_RETURN_IF_ERROR(check_device(t, name, device));
  FLARE_RETURN_IF_ERROR(check_index_range(t, name));
  FLARE_RETURN_IF_ERROR(check_last_dim_contiguous(t, name));
  if (reinterpret_cast<uintptr_t>(t.data) % dtype_size(t.dtype) != 0)
    return Status::InvalidArgument(name, "data pointer must be aligned to its " + std::to_string(dtype_size(t.dtype)) +
                                             "-byte elements");
  return Status::Ok();
}

Status check_same_shape(const TensorView& t, const char* name, const TensorView& like, const char* like_name) {
  bool same = t.rank == like.rank;
  for (int d = 0; same && d < like.rank; ++d) same = t.shape[d] == like.shape[d];
  if (!same)
    return Status::InvalidArgument(name, "shape " + shape_string(t) + " must equal " + like_name + "'s " +
                                             shape_string(like));
  return Status::Ok();
}

Status check_like(const TensorView& t, const char* name, const TensorView& like, const char* like_name,
                  DeviceKind device) {
  FLARE_RETURN_IF_ERROR(check_operand(t, name, like.rank, device));
  FLARE_RETURN_IF_ERROR(check_same_dtype(t, name, like, like_name));
  return check_same_shape(t, name, like, like_name);
}

}  // namespace flare::detail
