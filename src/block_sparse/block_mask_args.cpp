#include "src/block_sparse/block_mask_args.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "src/common/tensor_checks.h"

namespace flare::detail {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// One list family of a BlockMask: per row, `counts` blocks listed at the front of `indices`.
// Forward lists have a row per q block and list kv blocks; transposed lists the reverse.
struct BlockList {
  const TensorView& counts;
  const TensorView& indices;
  const char* counts_name;
  const char* indices_name;
  const char* row_kind;     // "q block" or "kv block"
  const char* listed_kind;  // the other one
  int64_t rows = 0, cols = 0;

  bool given() const { return counts.defined() || indices.defined(); }
  bool complete() const { return counts.defined() && indices.defined(); }
  int64_t batch_dim() const { return counts.shape[0]; }
  int64_t heads_dim() const { return counts.shape[1]; }

  // Reads with broadcast: a dim of size 1 serves every b (or h).
  int32_t count(int64_t b, int64_t h, int64_t row) const {
    const int64_t bb = counts.shape[0] == 1 ? 0 : b, hh = counts.shape[1] == 1 ? 0 : h;
    return counts.ptr<const int32_t>()[bb * counts.stride[0] + hh * counts.stride[1] + row * counts.stride[2]];
  }
  int32_t index(int64_t b, int64_t h, int64_t row, int64_t k) const {
    const int64_t bb = indices.shape[0] == 1 ? 0 : b, hh = indices.shape[1] == 1 ? 0 : h;
    return indices.ptr<const int32_t>()[bb * indices.stride[0] + hh * indices.stride[1] + row * indices.stride[2] +
                                        k * indices.stride[3]];
  }
  std::string where(int64_t b, int64_t h, int64_t row) const {
    return "at (b=" + str(b) + ", h=" + str(h) + ", " + row_kind + " " + str(row) + ")";
  }
};

Status check_block_size(int size, const char* name) {
  if (size <= 0 || size % kBlockSizeGranularity != 0)
    return Status::InvalidArgument(name, "must be a positive multiple of " + str(kBlockSizeGranularity) +
                                             " (the MMA tile edge), got " + str(size));
  return Status::Ok();
}

// A dim that is either the problem's size or 1 (broadcast).
Status check_broadcast_dim(const TensorView& t, const char* name, int dim, int64_t full, const char* what) {
  if (t.shape[dim] != 1 && t.shape[dim] != full)
    return Status::InvalidArgument(name, "dim " + str(dim) + " is " + str(t.shape[dim]) + ", expected 1 or the " +
                                             what + " " + str(full) + " (shape " + shape_string(t) + ")");
  return Status::Ok();
}

Status check_exact_dim(const TensorView& t, const char* name, int dim, int64_t want, const std::string& what) {
  if (t.shape[dim] != want)
    return Status::InvalidArgument(name, "dim " + str(dim) + " is " + str(t.shape[dim]) + ", expected " + what +
                                             " = " + str(want) + " (shape " + shape_string(t) + ")");
  return Status::Ok();
}

// Data present (unless empty), placement, dtype, rank, non-negative strides, contiguous last dim.
Status check_int32_layout(const TensorView& t, const char* name, int rank, DeviceKind device) {
  if (t.numel() != 0 || t.rank == 0) FLARE_RETURN_IF_ERROR(check_defined(t, name));
  FLARE_RETURN_IF_ERROR(check_device(t, name, device));
  FLARE_RETURN_IF_ERROR(check_dtype(t, name, {DType::kInt32}));
  FLARE_RETURN_IF_ERROR(check_rank(t, name, rank));
  FLARE_RETURN_IF_ERROR(check_index_range(t, name));
  return check_last_dim_contiguous(t, name);
}

Status check_list_tensor(const TensorView& t, const char* name, int rank, const BlockList& l,
                         const BlockMaskProblem& p, DeviceKind device) {
  FLARE_RETURN_IF_ERROR(check_int32_layout(t, name, rank, device));
  FLARE_RETURN_IF_ERROR(check_broadcast_dim(t, name, 0, p.batch, "batch"));
  FLARE_RETURN_IF_ERROR(check_broadcast_dim(t, name, 1, p.heads, "head count"));
  FLARE_RETURN_IF_ERROR(check_exact_dim(t, name, 2, l.rows, std::string("the number of ") + l.row_kind + "s"));
  if (rank == 4) FLARE_RETURN_IF_ERROR(check_exact_dim(t, name, 3, l.cols, std::string("the number of ") + l.listed_kind + "s"));
  return Status::Ok();
}

Status check_list_layout(const BlockList& l, const BlockMaskProblem& p, DeviceKind device) {
  FLARE_RETURN_IF_ERROR(check_list_tensor(l.counts, l.counts_name, 3, l, p, device));
  FLARE_RETURN_IF_ERROR(check_list_tensor(l.indices, l.indices_name, 4, l, p, device));
  // One broadcast per list, so a count and its row of indices are read at the same (b, h).
  if (l.indices.shape[0] != l.counts.shape[0] || l.indices.shape[1] != l.counts.shape[1])
    return Status::InvalidArgument(l.indices_name, "batch and head dims of " + shape_string(l.indices) +
                                                       " differ from " + l.counts_name + "'s " +
                                                       shape_string(l.counts));
  return Status::Ok();
}

// Counts and indices of a list are given together; the transposed lists mirror the forward ones.
Status check_presence(const BlockList& kv, const BlockList& full_kv, const BlockList& q, const BlockList& full_q) {
  if (!kv.counts.defined()) return Status::InvalidArgument(kv.counts_name, "required");
  for (const BlockList* l : {&kv, &full_kv, &q, &full_q}) {
    if (!l->given() || l->complete()) continue;
    const bool counts_missing = !l->counts.defined();
    return Status::InvalidArgument(counts_missing ? l->counts_name : l->indices_name,
                                   std::string("required with ") + (counts_missing ? l->indices_name : l->counts_name));
  }
  if (full_q.given() && !q.given())
    return Status::InvalidArgument(q.counts_name, std::string("required with ") + full_q.counts_name);
  if (full_q.given() && !full_kv.given())
    return Status::InvalidArgument(full_kv.counts_name, std::string("required with ") + full_q.counts_name);
  if (q.given() && full_kv.given() && !full_q.given())
    return Status::InvalidArgument(full_q.counts_name, std::string("required: with ") + full_kv.counts_name +
                                                           " given, the transposed lists must include the full blocks");
  return Status::Ok();
}

// Counts in [0, cols]; each row's listed indices in [0, cols) and strictly increasing.
Status check_list_values(const BlockList& l) {
  for (int64_t b = 0; b < l.batch_dim(); ++b)
    for (int64_t h = 0; h < l.heads_dim(); ++h)
      for (int64_t row = 0; row < l.rows; ++row) {
        const int32_t count = l.count(b, h, row);
        if (count < 0 || count > l.cols)
          return Status::InvalidArgument(l.counts_name, l.where(b, h, row) + ": count " + str(count) +
                                                            " outside [0, " + str(l.cols) + "]");
        int64_t previous = -1;
        for (int64_t k = 0; k < count; ++k) {
          const int32_t block = l.index(b, h, row, k);
          if (block < 0 || block >= l.cols)
            return Status::InvalidArgument(l.indices_name, l.where(b, h, row) + ": entry " + str(k) + " is " +
                                                               str(block) + ", outside [0, " + str(l.cols) + ")");
          if (block <= previous)
            return Status::InvalidArgument(l.indices_name, l.where(b, h, row) + ": entry " + str(k) + " (" +
                                                               str(block) + ") does not follow entry " + str(k - 1) +
                                                               " (" + str(previous) +
                                                               "): indices must be strictly increasing");
          previous = block;
        }
      }
  return Status::Ok();
}

// The (b, h) range covering every given list: the problem's size where any list has it, else 1.
int64_t covered_dim(std::initializer_list<int64_t> dims) { return std::max(dims); }

Status check_partial_full_disjoint(const BlockList& partial, const BlockList& full) {
  std::vector<uint8_t> listed(static_cast<size_t>(partial.cols), 0);
  const int64_t batch = covered_dim({partial.batch_dim(), full.batch_dim()});
  const int64_t heads = covered_dim({partial.heads_dim(), full.heads_dim()});
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t row = 0; row < partial.rows; ++row) {
        const int32_t partial_count = partial.count(b, h, row);
        for (int32_t k = 0; k < partial_count; ++k) listed[partial.index(b, h, row, k)] = 1;
        for (int32_t k = 0; k < full.count(b, h, row); ++k) {
          const int32_t block = full.index(b, h, row, k);
          if (listed[block])
            return Status::InvalidArgument(full.indices_name, full.where(b, h, row) + ": " + full.listed_kind + " " +
                                                                  str(block) + " is listed both partial (" +
                                                                  partial.indices_name + ") and full");
        }
        for (int32_t k = 0; k < partial_count; ++k) listed[partial.index(b, h, row, k)] = 0;
      }
  return Status::Ok();
}

// The transposed list names exactly the pairs of the forward list: every entry is a forward
// pair, and each row has as many entries as the forward lists name its block (the entries are
// distinct, so equal counts make the sets equal).
Status check_transposed(const BlockList& forward, const BlockList& transposed) {
  const int64_t num_q = forward.rows, num_kv = forward.cols;
  std::vector<uint8_t> pair(static_cast<size_t>(num_q * num_kv));
  std::vector<int64_t> column_count(static_cast<size_t>(num_kv));
  const int64_t batch = covered_dim({forward.batch_dim(), transposed.batch_dim()});
  const int64_t heads = covered_dim({forward.heads_dim(), transposed.heads_dim()});
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h) {
      std::fill(pair.begin(), pair.end(), 0);
      std::fill(column_count.begin(), column_count.end(), 0);
      for (int64_t m = 0; m < num_q; ++m)
        for (int32_t k = 0; k < forward.count(b, h, m); ++k) {
          const int32_t n = forward.index(b, h, m, k);
          pair[m * num_kv + n] = 1;
          ++column_count[n];
        }
      for (int64_t n = 0; n < num_kv; ++n) {
        const int32_t count = transposed.count(b, h, n);
        for (int32_t k = 0; k < count; ++k) {
          const int32_t m = transposed.index(b, h, n, k);
          if (!pair[m * num_kv + n])
            return Status::InvalidArgument(transposed.indices_name,
                                           transposed.where(b, h, n) + ": lists q block " + str(m) + ", but " +
                                               forward.indices_name + " of q block " + str(m) +
                                               " do not list kv block " + str(n));
        }
        if (count != column_count[n])
          return Status::InvalidArgument(transposed.counts_name,
                                         transposed.where(b, h, n) + ": count " + str(count) + ", but " +
                                             forward.indices_name + " list kv block " + str(n) + " in " +
                                             str(column_count[n]) + " q blocks");
      }
    }
  return Status::Ok();
}

Status check_window(int value, const char* name) {
  if (value < -1) return Status::InvalidArgument(name, "must be >= -1 (-1: off), got " + str(value));
  return Status::Ok();
}

Status check_doc_ids(const TensorView& t, const char* name, int64_t batch, int64_t seqlen, const char* length) {
  FLARE_RETURN_IF_ERROR(check_int32_layout(t, name, 2, t.device.kind));
  FLARE_RETURN_IF_ERROR(check_exact_dim(t, name, 0, batch, "the batch"));
  return check_exact_dim(t, name, 1, seqlen, length);
}

Status check_bits(const TensorView& t, const BlockMaskProblem& p) {
  const char* name = "element.bits";
  FLARE_RETURN_IF_ERROR(check_int32_layout(t, name, 4, t.device.kind));
  FLARE_RETURN_IF_ERROR(check_broadcast_dim(t, name, 0, p.batch, "batch"));
  FLARE_RETURN_IF_ERROR(check_broadcast_dim(t, name, 1, p.heads, "head count"));
  FLARE_RETURN_IF_ERROR(check_exact_dim(t, name, 2, p.seqlen_q, "seqlen_q"));
  return check_exact_dim(t, name, 3, ceil_div(p.seqlen_k, 32), "ceil(seqlen_k / 32)");
}

}  // namespace

Status validate_element_mask(const ElementMask& e, const BlockMaskProblem& p, DeviceKind device) {
  FLARE_RETURN_IF_ERROR(check_window(e.window_left, "element.window_left"));
  FLARE_RETURN_IF_ERROR(check_window(e.window_right, "element.window_right"));
  FLARE_RETURN_IF_ERROR(check_window(e.prefix_length, "element.prefix_length"));
  if (e.doc_ids_q.defined() != e.doc_ids_k.defined())
    return Status::InvalidArgument(e.doc_ids_q.defined() ? "element.doc_ids_k" : "element.doc_ids_q",
                                   "doc_ids_q and doc_ids_k must be given together");
  for (const auto& [t, name] : {std::pair{&e.doc_ids_q, "element.doc_ids_q"}, {&e.doc_ids_k, "element.doc_ids_k"},
                                {&e.bits, "element.bits"}})
    if (t->defined()) FLARE_RETURN_IF_ERROR(check_device(*t, name, device));
  if (e.doc_ids_q.defined()) {
    FLARE_RETURN_IF_ERROR(check_doc_ids(e.doc_ids_q, "element.doc_ids_q", p.batch, p.seqlen_q, "seqlen_q"));
    FLARE_RETURN_IF_ERROR(check_doc_ids(e.doc_ids_k, "element.doc_ids_k", p.batch, p.seqlen_k, "seqlen_k"));
  }
  if (e.bits.defined()) FLARE_RETURN_IF_ERROR(check_bits(e.bits, p));
  return Status::Ok();
}

Status validate_block_mask(const BlockMask& mask, const BlockMaskProblem& p, DeviceKind device, BlockMaskShape* shape) {
  FLARE_RETURN_IF_ERROR(check_block_size(mask.q_block_size, "q_block_size"));
  FLARE_RETURN_IF_ERROR(check_block_size(mask.kv_block_size, "kv_block_size"));
  const int64_t num_q = ceil_div(p.seqlen_q, mask.q_block_size), num_kv = ceil_div(p.seqlen_k, mask.kv_block_size);
  const BlockList kv{mask.kv_num_blocks, mask.kv_indices, "kv_num_blocks", "kv_indices", "q block", "kv block",
                     num_q, num_kv};
  const BlockList full_kv{mask.full_kv_num_blocks, mask.full_kv_indices, "full_kv_num_blocks", "full_kv_indices",
                          "q block", "kv block", num_q, num_kv};
  const BlockList q{mask.q_num_blocks, mask.q_indices, "q_num_blocks", "q_indices", "kv block", "q block",
                    num_kv, num_q};
  const BlockList full_q{mask.full_q_num_blocks, mask.full_q_indices, "full_q_num_blocks", "full_q_indices",
                         "kv block", "q block", num_kv, num_q};
  FLARE_RETURN_IF_ERROR(check_presence(kv, full_kv, q, full_q));
  for (const BlockList* l : {&kv, &full_kv, &q, &full_q})
    if (l->given()) FLARE_RETURN_IF_ERROR(check_list_layout(*l, p, device));
  FLARE_RETURN_IF_ERROR(validate_element_mask(mask.element, p, device));

  if (device == DeviceKind::kCPU) {
    for (const BlockList* l : {&kv, &full_kv, &q, &full_q})
      if (l->given()) FLARE_RETURN_IF_ERROR(check_list_values(*l));
    if (full_kv.given()) FLARE_RETURN_IF_ERROR(check_partial_full_disjoint(kv, full_kv));
    if (q.given()) FLARE_RETURN_IF_ERROR(check_transposed(kv, q));
    if (full_q.given()) FLARE_RETURN_IF_ERROR(check_transposed(full_kv, full_q));
  }
  shape->num_q_blocks = static_cast<int>(num_q);
  shape->num_kv_blocks = static_cast<int>(num_kv);
  shape->has_full_blocks = full_kv.given();
  shape->has_transposed_lists = q.given();
  return Status::Ok();
}

}  // namespace flare::detail
