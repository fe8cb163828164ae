// The argument rules every op shares. Each returns Status::InvalidArgument naming the argument.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "flare/status.h"
#include "flare/tensor.h"

namespace flare::detail {

Status check_defined(const TensorView& t, const char* name);
Status check_dtype(const TensorView& t, const char* name, std::initializer_list<DType> allowed);
Status check_same_dtype(const TensorView& t, const char* name, const TensorView& like, const char* like_name);
Status check_rank(const TensorView& t, const char* name, int rank);
Status check_shape(const TensorView& t, const char* name, std::initializer_list<int64_t> shape);
Status check_device(const TensorView& t, const char* name, DeviceKind kind);
// The last dimension is contiguous (stride 1), every stride is non-negative.
Status check_last_dim_contiguous(const TensorView& t, const char* name);
// The data pointer and every stride but the last are 16-byte multiples (vector loads, TMA).
Status check_aligned16(const TensorView& t, const char* name);
// Every dimension fits in int32 and the largest element offset fits in int64 without overflow.
Status check_index_range(const TensorView& t, const char* name);
// For a view on the CPU, the values: starts at 0, non-decreasing, ends at most at `total`,
// no length above `max_len` (when max_len > 0). Device views are not read here.
Status check_cu_seqlens(const TensorView& t, const char* name, int64_t batch, int64_t total, int64_t max_len);

// The usual bundle for a tile operand (loaded in 16-byte rows): defined, rank, device, index
// range, contiguous last dim, 16-byte alignment.
Status check_operand(const TensorView& t, const char* name, int rank, DeviceKind device);
// The bundle for a tensor read one element at a time (index tables, per-head scalars): as
// check_operand but with natural alignment only (16-byte rows would reject, e.g., a bf16 [T, 4]).
Status check_elementwise_operand(const TensorView& t, const char* name, int rank, DeviceKind device);
Status check_same_shape(const TensorView& t, const char* name, const TensorView& like, const char* like_name);
// A tile operand with the dtype and shape of `like` (out like q, dq like q, ...).
Status check_like(const TensorView& t, const char* name, const TensorView& like, const char* like_name,
                  DeviceKind device);

std::string shape_string(const TensorView& t);

}  // namespace flare::detail
