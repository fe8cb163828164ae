#include "src/decode/decode_args.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "src/common/tensor_checks.h"

namespace flare::detail {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

std::string str(int64_t x) { return std::to_string(x); }

// An index table (page_table, cache_seqlens): read one element at a time, so it needs a contiguous
// last dim and natural alignment, not the 16-byte rows check_operand asks of tiles loaded by TMA.
Status check_index_table(const TensorView& t, const char* name, int rank, DeviceKind device) {
  FLARE_RETURN_IF_ERROR(check_defined(t, name));
  FLARE_RETURN_IF_ERROR(check_dtype(t, name, {DType::kInt32}));
  return check_elementwise_operand(t, name, rank, device);
}

Status check_query(const TensorView& q, DeviceKind device, DecodeShape* s) {
  FLARE_RETURN_IF_ERROR(check_operand(q, "q", 4, device));
  FLARE_RETURN_IF_ERROR(check_dtype(q, "q", {DType::kFloat16, DType::kBFloat16}));
  s->batch = static_cast<int>(q.size(0));
  s->q_len = static_cast<int>(q.size(1));
  s->heads_q = static_cast<int>(q.size(2));
  s->head_dim = static_cast<int>(q.size(3));
  if (s->batch < 1) return Status::InvalidArgument("q", "batch must be >= 1, got " + shape_string(q));
  if (s->q_len < 1 || s->q_len > kMaxDecodeQueryLen)
    return Status::InvalidArgument("q", "q_len (dim 1) must be in [1, " + str(kMaxDecodeQueryLen) + "], got " +
                                            str(s->q_len));
  if (s->heads_q < 1) return Status::InvalidArgument("q", "heads_q must be >= 1, got " + shape_string(q));
  if (!is_decode_head_dim(s->head_dim))
    return Status::InvalidArgument("q", "head dim " + str(s->head_dim) + " not supported: must be 64, 128 or 256");
  // (batch, query, head) rows are indexed with 32-bit grid coordinates and LSE offsets.
  const int64_t rows = int64_t{s->batch} * s->q_len * s->heads_q;
  if (rows > kInt32Max)
    return Status::InvalidArgument("q", "batch x q_len x heads_q = " + str(rows) + " overflows 32-bit indexing");
  return Status::Ok();
}

// Both caches, contiguous or paged, and the page table.
Status check_caches(const DecodeParams& p, DeviceKind device, DecodeShape* s) {
  for (auto [t, name] : {std::pair{&p.k_cache, "k_cache"}, {&p.v_cache, "v_cache"}}) {
    FLARE_RETURN_IF_ERROR(check_operand(*t, name, 4, device));
    FLARE_RETURN_IF_ERROR(check_same_dtype(*t, name, p.q, "q"));
  }
  const TensorView& k = p.k_cache;
  if (k.size(3) != s->head_dim)
    return Status::InvalidArgument("k_cache", "head dim " + str(k.size(3)) + " differs from q's " + str(s->head_dim));
  s->heads_kv = static_cast<int>(k.size(2));
  if (s->heads_kv < 1 || s->heads_q % s->heads_kv != 0)
    return Status::InvalidArgument("k_cache", "kv heads (" + str(s->heads_kv) + ") must divide q heads (" +
                                                  str(s->heads_q) + ")");
  for (int d = 0; d < 4; ++d)
    if (p.v_cache.shape[d] != k.shape[d])
      return Status::InvalidArgument("v_cache", "shape " + shape_string(p.v_cache) + " must equal k_cache's " +
                                                    shape_string(k));

  s->paged = p.page_table.defined();
  if (!s->paged) {
    if (k.size(0) != s->batch)
      return Status::InvalidArgument("k_cache", "batch " + str(k.size(0)) + " differs from q's " + str(s->batch) +
                                                    " (contiguous caches are [batch, max_cache_len, heads_kv, "
                                                    "head_dim]; pass page_table for paged caches)");
    s->max_cache_len = k.size(1);
    if (s->max_cache_len < 1)
      return Status::InvalidArgument("k_cache", "max_cache_len (dim 1) must be >= 1, got " + shape_string(k));
    return Status::Ok();
  }

  s->num_pages = static_cast<int>(k.size(0));
  s->page_size = static_cast<int>(k.size(1));
  if (s->num_pages < 1)
    return Status::InvalidArgument("k_cache", "num_pages (dim 0) must be >= 1, got " + shape_string(k));
  if (s->page_size < kMinPageSize || (s->page_size & (s->page_size - 1)) != 0)
    return Status::InvalidArgument("k_cache", "page_size (dim 1) must be a power of two >= " + str(kMinPageSize) +
                                                  ", got " + str(s->page_size));
  FLARE_RETURN_IF_ERROR(check_index_table(p.page_table, "page_table", 2, device));
  if (p.page_table.size(0) != s->batch)
    return Status::InvalidArgument("page_table", "expected shape [batch = " + str(s->batch) +
                                                     ", max_pages_per_seq], got " + shape_string(p.page_table));
  s->max_pages_per_seq = static_cast<int>(p.page_table.size(1));
  if (s->max_pages_per_seq < 1)
    return Status::InvalidArgument("page_table", "max_pages_per_seq (dim 1) must be >= 1, got " +
                                                     shape_string(p.page_table));
  s->max_cache_len = int64_t{s->max_pages_per_seq} * s->page_size;
  return Status::Ok();
}

Status check_lse(const TensorView& lse, const DecodeShape& s, DeviceKind device) {
  FLARE_RETURN_IF_ERROR(check_defined(lse, "lse"));
  FLARE_RETURN_IF_ERROR(check_dtype(lse, "lse", {DType::kFloat32}));
  FLARE_RETURN_IF_ERROR(check_device(lse, "lse", device));
  FLARE_RETURN_IF_ERROR(check_shape(lse, "lse", {s.batch, s.heads_q, s.q_len}));
  if (!lse.is_contiguous()) return Status::InvalidArgument("lse", "must be contiguous");
  return Status::Ok();
}

// The values of cache_seqlens and page_table, for CPU views only.
Status check_cache_values(const DecodeParams& p, const DecodeShape& s) {
  const int32_t* seqlens = p.cache_seqlens.ptr<int32_t>();
  const std::string capacity =
      s.paged ? str(s.max_cache_len) + " (max_pages_per_seq " + str(s.max_pages_per_seq) + " x page_size " +
                    str(s.page_size) + ")"
              : str(s.max_cache_len) + " (max_cache_len)";
  for (int b = 0; b < s.batch; ++b) {
    const int64_t len = seqlens[b * p.cache_seqlens.stride[0]];
    const std::string entry = "cache_seqlens[" + str(b) + "] = " + str(len);
    if (len < 0) return Status::InvalidArgument("cache_seqlens", entry + " is negative");
    if (len > s.max_cache_len)
      return Status::InvalidArgument("cache_seqlens", entry + " exceeds the cache capacity " + capacity);
    if (p.causal && len < s.q_len)
      return Status::InvalidArgument("cache_seqlens", entry + " < q_len " + str(s.q_len) +
                                                          ": with causal the new tokens are the last q_len in the cache");
    if (!s.paged) continue;
    const int32_t* row = p.page_table.ptr<int32_t>() + b * p.page_table.stride[0];
    const int64_t pages_in_use = (len + s.page_size - 1) / s.page_size;
    for (int64_t j = 0; j < pages_in_use; ++j) {
      const int32_t page = row[j * p.page_table.stride[1]];
      if (page < 0 || page >= s.num_pages)
        return Status::InvalidArgument("page_table", "page_table[" + str(b) + "][" + str(j) + "] = " + str(page) +
                                                         " is outside [0, num_pages = " + str(s.num_pages) +
                                                         ") and in use (" + entry + ")");
    }
  }
  return Status::Ok();
}

}  // namespace

Status validate_decode(const DecodeParams& p, DeviceKind device, DecodeShape* s) {
  *s = DecodeShape{};
  FLARE_RETURN_IF_ERROR(check_query(p.q, device, s));
  FLARE_RETURN_IF_ERROR(check_caches(p, device, s));
  FLARE_RETURN_IF_ERROR(check_index_table(p.cache_seqlens, "cache_seqlens", 1, device));
  FLARE_RETURN_IF_ERROR(check_shape(p.cache_seqlens, "cache_seqlens", {s->batch}));

  FLARE_RETURN_IF_ERROR(check_operand(p.out, "out", 4, device));
  FLARE_RETURN_IF_ERROR(check_same_dtype(p.out, "out", p.q, "q"));
  FLARE_RETURN_IF_ERROR(check_shape(p.out, "out", {s->batch, s->q_len, s->heads_q, s->head_dim}));
  if (p.lse.defined()) FLARE_RETURN_IF_ERROR(check_lse(p.lse, *s, device));

  if (!(p.softmax_scale >= 0.f) || !std::isfinite(p.softmax_scale))
    return Status::InvalidArgument("softmax_scale", "must be finite and >= 0 (0 means 1/sqrt(head_dim))");
  s->softmax_scale = p.softmax_scale > 0.f ? p.softmax_scale : 1.f / std::sqrt(static_cast<float>(s->head_dim));
  if (p.window_left < -1) return Status::InvalidArgument("window_left", "must be >= -1 (-1: unbounded)");

  if (device == DeviceKind::kCPU) FLARE_RETURN_IF_ERROR(check_cache_values(p, *s));
  return Status::Ok();
}

}  // namespace flare::detail
