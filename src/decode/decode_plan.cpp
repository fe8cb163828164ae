// The decode planner: table lookup, the wave-efficiency fallback, the tuner's candidates, and the
// tuning table's text format. Host-only and pure; see include/flare/decode_plan.h for the rules.
#include "flare/decode_plan.h"

#include <charconv>
#include <fstream>
#include <istream>
#include <limits>
#include <ostream>
#include <sstream>
#include <string_view>

#include "src/decode/decode_args.h"

namespace flare {
namespace {

// Key positions are 32-bit on the device; the margin keeps every rounded chunk end in range.
constexpr int64_t kMaxDecodeCacheLen = int64_t{1} << 30;
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr const char* kTableFormat = "flare-decode-tuning";
constexpr int kTableVersion = 1;

std::string str(int64_t x) { return std::to_string(x); }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t align_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }
bool is_power_of_two(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

int64_t floor_power_of_two(int64_t x) {
  int64_t p = 1;
  while (p * 2 <= x) p *= 2;
  return p;
}

// ---------------------------------------------------------------------------------------------
// Shapes

Status check_key(const DecodeShapeKey& k) {
  if (k.batch < 1) return Status::InvalidArgument("key.batch", "must be >= 1, got " + str(k.batch));
  if (k.heads_q < 1) return Status::InvalidArgument("key.heads_q", "must be >= 1, got " + str(k.heads_q));
  if (k.heads_kv < 1 || k.heads_q % k.heads_kv != 0)
    return Status::InvalidArgument("key.heads_kv", str(k.heads_kv) + " must divide heads_q " + str(k.heads_q));
  if (!detail::is_decode_head_dim(k.head_dim))
    return Status::InvalidArgument("key.head_dim", "must be 64, 128 or 256, got " + str(k.head_dim));
  if (k.q_len < 1 || k.q_len > detail::kMaxDecodeQueryLen)
    return Status::InvalidArgument("key.q_len", "must be in [1, " + str(detail::kMaxDecodeQueryLen) + "], got " +
                                                    str(k.q_len));
  if (k.max_cache_len < 1 || k.max_cache_len > kMaxDecodeCacheLen)
    return Status::InvalidArgument("key.max_cache_len", "must be in [1, 2^30], got " + str(k.max_cache_len));
  if (k.page_size != 0 && (k.page_size < detail::kMinPageSize || !is_power_of_two(k.page_size)))
    return Status::InvalidArgument("key.page_size", "must be 0 (contiguous) or a power of two >= " +
                                                        str(detail::kMinPageSize) + ", got " + str(k.page_size));
  if (k.window_left < -1)
    return Status::InvalidArgument("key.window_left", "must be >= -1 (-1: unbounded), got " + str(k.window_left));
  if (k.dtype != DType::kFloat16 && k.dtype != DType::kBFloat16)
    return Status::InvalidArgument("key.dtype", std::string("must be float16 or bfloat16, got ") + dtype_name(k.dtype));
  const int64_t rows = int64_t{k.batch} * k.heads_q * k.q_len;
  if (rows > kInt32Max)
    return Status::InvalidArgument("key", "batch x heads_q x q_len = " + str(rows) + " overflows 32-bit indexing");
  return Status::Ok();
}

Status check_num_sms(int num_sms) {
  if (num_sms < 1) return Status::InvalidArgument("num_sms", "must be >= 1, got " + str(num_sms));
  return Status::Ok();
}

int kv_align_of(const DecodeShapeKey& k) { return k.page_size > kDecodeKvAlign ? k.page_size : kDecodeKvAlign; }

// The most keys one sequence's splits must cover, counted from the split origin. With a window,
// the origin is the span start rounded down to kv_align, which adds up to kv_align - 1 keys.
int64_t planned_span(const DecodeShapeKey& k) {
  if (k.window_left < 0) return k.max_cache_len;
  const int64_t window_span = int64_t{k.window_left} + k.q_len + kv_align_of(k) - 1;
  return window_span < k.max_cache_len ? window_span : k.max_cache_len;
}

int64_t kv_ctas_per_split(const DecodeShapeKey& k) { return int64_t{k.batch} * k.heads_kv; }

// A split count fitted to the span: chunks rounded up to kv_align, then only as many splits as
// the chunks need, so none is empty. Fitting a fitted count returns it unchanged (the chunk is
// the same), so fitted counts can be requested back through decode_plan_for_splits.
struct FittedSplits {
  int num_splits = 1;
  int64_t kv_chunk = 0;
};

FittedSplits fit_splits(int64_t span, int64_t kv_align, int requested) {
  FittedSplits f;
  f.kv_chunk = align_up(ceil_div(span, requested), kv_align);
  f.num_splits = static_cast<int>(ceil_div(span, f.kv_chunk));
  return f;
}

// Visits each distinct fitted split count in increasing order, from 1, while the splits average
// at least kv_align keys and the grid stays within kDecodeMaxWaves waves. Allocation-free, so
// decode_plan can search it.
template <typename Visit>
void for_each_split_count(const DecodeShapeKey& k, int num_sms, Visit&& visit) {
  const int64_t span = planned_span(k), kv_align = kv_align_of(k);
  const int64_t max_ctas = int64_t{kDecodeMaxWaves} * num_sms;
  int previous = 0;
  for (int requested = 1; requested <= kMaxDecodeSplits; ++requested) {
    const FittedSplits f = fit_splits(span, kv_align, requested);
    if (f.num_splits == previous) continue;
    if (f.num_splits > 1 && (span < f.num_splits * kv_align || kv_ctas_per_split(k) * f.num_splits > max_ctas))
      return;  // fitted counts only grow from here
    visit(f.num_splits);
    previous = f.num_splits;
  }
}

// The fallback rule of the header: fewest splits within the slack of the best efficiency, over
// split counts whose splits average kDecodeMinKvPerSplit keys.
int heuristic_split_count(const DecodeShapeKey& k, int num_sms) {
  const int64_t span = planned_span(k), n = kv_ctas_per_split(k);
  const int slots = decode_heuristic_slots(num_sms);
  auto eligible = [&](int s) { return s == 1 || span >= int64_t{s} * kDecodeMinKvPerSplit; };
  double best = 0.0;
  for_each_split_count(k, num_sms, [&](int s) {
    if (eligible(s) && decode_wave_efficiency(n * s, slots) > best) best = decode_wave_efficiency(n * s, slots);
  });
  int chosen = 0;
  for_each_split_count(k, num_sms, [&](int s) {
    if (chosen == 0 && eligible(s) && decode_wave_efficiency(n * s, slots) >= best - kDecodeWaveEfficiencySlack)
      chosen = s;
  });
  return chosen;
}

// Builds the plan of a valid key and a split count in [1, kMaxDecodeSplits] (engine and combine:
// the defaults).
DecodePlan make_plan(const DecodeShapeKey& k, int requested_splits, DecodePlanSource source, int heads_per_cta = 0) {
  DecodePlan p;
  p.shape = k;
  p.source = source;
  p.heads_per_cta = heads_per_cta;
  p.kv_align = kv_align_of(k);
  const FittedSplits f = fit_splits(planned_span(k), p.kv_align, requested_splits);
  p.num_splits = f.num_splits;
  p.kv_chunk = static_cast<int>(f.kv_chunk);
  p.kernel = f.num_splits > 1 ? DecodeKernel::kSplitKv : DecodeKernel::kStandard;
  if (p.kernel == DecodeKernel::kSplitKv) {
    const std::size_t partial_rows = std::size_t(k.batch) * k.heads_q * k.q_len * p.num_splits;
    p.partial_lse_offset = partial_rows * k.head_dim * sizeof(float);
    p.counters_offset = p.partial_lse_offset + align_up(static_cast<int64_t>(partial_rows * sizeof(float)), 16);
    p.workspace_bytes = p.counters_offset + std::size_t(k.batch) * k.heads_kv * sizeof(int32_t);
  }
  return p;
}

// Empty when heads_per_cta is 0 or a power of two dividing heads_kv within the head dim's cap.
std::string heads_per_cta_problem(int heads_per_cta, int heads_kv, int head_dim) {
  if (heads_per_cta == 0) return {};
  const int cap = decode_max_heads_per_cta(head_dim);
  if (heads_per_cta < 0 || heads_per_cta > cap || !is_power_of_two(heads_per_cta) || heads_kv % heads_per_cta != 0)
    return "heads_per_cta must be 0 or a power of two up to " + str(cap) + " (head dim " + str(head_dim) +
           ") dividing heads_kv " + str(heads_kv) + ", got " + str(heads_per_cta);
  return {};
}

// Empty when the kernel and split count agree, else what is wrong.
std::string split_count_problem(DecodeKernel kernel, int num_splits) {
  if (kernel == DecodeKernel::kStandard && num_splits != 1)
    return "the standard kernel has num_splits 1, got " + str(num_splits);
  if (kernel == DecodeKernel::kSplitKv && (num_splits < 2 || num_splits > kMaxDecodeSplits))
    return "split_kv needs num_splits in [2, " + str(kMaxDecodeSplits) + "], got " + str(num_splits);
  return {};
}

Status check_split_count(const char* arg, DecodeKernel kernel, int num_splits) {
  if (std::string problem = split_count_problem(kernel, num_splits); !problem.empty())
    return Status::InvalidArgument(arg, problem);
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// Tuning table text format

const char* layout_name(bool paged) { return paged ? "paged" : "contiguous"; }
const char* l2_policy_name(bool evict_first) { return evict_first ? "evict_first" : "normal"; }

// One "name=value" line being parsed; errors carry "<source>:<line>: ".
class EntryLine {
 public:
  EntryLine(const std::string& source, int line_number) : where_(source + ":" + str(line_number) + ": ") {}

  Status error(const std::string& what) const { return {StatusCode::kInvalidArgument, where_ + what}; }

  Status parse(std::string_view text, DecodeShapeClass* c, DecodeTuningEntry* e) const {
    bool seen[kNumFields] = {};
    std::istringstream words{std::string(text)};
    std::string word;
    while (words >> word) {
      const size_t eq = word.find('=');
      if (eq == std::string::npos) return error("expected name=value, got '" + word + "'");
      const std::string_view name = std::string_view(word).substr(0, eq), value = std::string_view(word).substr(eq + 1);
      const int field = field_index(name);
      if (field < 0) return error("unknown field '" + std::string(name) + "'");
      if (seen[field]) return error("field '" + std::string(name) + "' given twice");
      seen[field] = true;
      FLARE_RETURN_IF_ERROR(set_field(field, word, value, c, e));
    }
    for (int f = 0; f < kNumRequiredFields; ++f)
      if (!seen[f]) return error("missing field '" + std::string(kFieldNames[f]) + "'");
    if (std::string problem = split_count_problem(e->kernel, e->num_splits); !problem.empty()) return error(problem);
    if (std::string problem = heads_per_cta_problem(e->heads_per_cta, c->heads_kv, c->head_dim); !problem.empty())
      return error(problem);
    return Status::Ok();
  }

 private:
  // The required fields, then the optional ones.
  enum Field {
    kBatch, kHeadsKv, kGroup, kHeadDim, kQLen, kKvLen, kLayout, kKernel, kSplits, kHeadsPerCta, kEngine, kCombine,
    kL2, kNumFields
  };
  static constexpr int kNumRequiredFields = kHeadsPerCta;
  static constexpr const char* kFieldNames[kNumFields] = {"batch",  "heads_kv", "group",         "head_dim",
                                                          "q_len",  "kv_len",   "layout",        "kernel",
                                                          "splits", "heads_per_cta", "engine", "combine",
                                                          "l2"};

  static int field_index(std::string_view name) {
    for (int f = 0; f < kNumFields; ++f)
      if (name == kFieldNames[f]) return f;
    return -1;
  }

  Status parse_int(const std::string& word, std::string_view value, int64_t lo, int64_t hi, int64_t* out) const {
    const char* end = value.data() + value.size();
    auto [stop, ec] = std::from_chars(value.data(), end, *out);
    if (ec != std::errc() || stop != end || value.empty()) return error("'" + word + "': not an integer");
    if (*out < lo || *out > hi) return error("'" + word + "': must be in [" + str(lo) + ", " + str(hi) + "]");
    return Status::Ok();
  }

  Status parse_bucket(const std::string& word, std::string_view value, int64_t hi, int64_t* out) const {
    FLARE_RETURN_IF_ERROR(parse_int(word, value, 1, hi, out));
    if (!is_power_of_two(*out)) return error("'" + word + "': a bucket value must be a power of two");
    return Status::Ok();
  }

  Status set_field(int field, const std::string& word, std::string_view value, DecodeShapeClass* c,
                   DecodeTuningEntry* e) const {
    int64_t x = 0;
    switch (field) {
      case kBatch:
        FLARE_RETURN_IF_ERROR(parse_bucket(word, value, kInt32Max, &x));
        c->batch_bucket = static_cast<int>(x);
        return Status::Ok();
      case kHeadsKv:
        FLARE_RETURN_IF_ERROR(parse_int(word, value, 1, kInt32Max, &x));
        c->heads_kv = static_cast<int>(x);
        return Status::Ok();
      case kGroup:
        FLARE_RETURN_IF_ERROR(parse_int(word, value, 1, kInt32Max, &x));
        c->group = static_cast<int>(x);
        return Status::Ok();
      case kHeadDim:
        FLARE_RETURN_IF_ERROR(parse_int(word, value, 1, kInt32Max, &x));
        if (!detail::is_decode_head_dim(static_cast<int>(x))) return error("'" + word + "': must be 64, 128 or 256");
        c->head_dim = static_cast<int>(x);
        return Status::Ok();
      case kQLen:
        FLARE_RETURN_IF_ERROR(parse_int(word, value, 1, detail::kMaxDecodeQueryLen, &x));
        c->q_len = static_cast<int>(x);
        return Status::Ok();
      case kKvLen:
        FLARE_RETURN_IF_ERROR(parse_bucket(word, value, kMaxDecodeCacheLen, &x));
        c->kv_len_bucket = x;
        return Status::Ok();
      case kLayout:
        if (value != layout_name(false) && value != layout_name(true))
          return error("'" + word + "': layout must be contiguous or paged");
        c->paged = value == layout_name(true);
        return Status::Ok();
      case kKernel:
        if (value != decode_kernel_name(DecodeKernel::kStandard) && value != decode_kernel_name(DecodeKernel::kSplitKv))
          return error("'" + word + "': kernel must be standard or split_kv");
        e->kernel = value == decode_kernel_name(DecodeKernel::kStandard) ? DecodeKernel::kStandard
                                                                         : DecodeKernel::kSplitKv;
        return Status::Ok();
      case kSplits:
        FLARE_RETURN_IF_ERROR(parse_int(word, value, 1, kMaxDecodeSplits, &x));
        e->num_splits = static_cast<int>(x);
        return Status::Ok();
      case kHeadsPerCta:
        FLARE_RETURN_IF_ERROR(parse_int(word, value, 0, kDecodeMaxHeadsPerCta, &x));
        e->heads_per_cta = static_cast<int>(x);
        return Status::Ok();
      case kEngine:
        e->engine = decode_engine_from_name(value);
        if (!e->engine) return error("'" + word + "': engine must be key_groups, head_warps or portable");
        return Status::Ok();
      case kCombine:
        e->combine = decode_combine_from_name(value);
        if (!e->combine) return error("'" + word + "': combine must be in_kernel, separate_kernel or cluster");
        if (e->combine == DecodeCombine::kInKernelPrezeroed)  // its counters are the caller's duty: never from a table
          return error("'" + word + "': a table may not choose in_kernel_prezeroed");
        return Status::Ok();
      case kL2:
        if (value != l2_policy_name(false) && value != l2_policy_name(true))
          return error("'" + word + "': l2 must be normal or evict_first");
        e->l2_evict_first = value == l2_policy_name(true);
        return Status::Ok();
    }
    return error("internal: unhandled field");
  }

  std::string where_;
};

std::string_view trimmed(std::string_view s) {
  const size_t begin = s.find_first_not_of(" \t\r");
  if (begin == std::string_view::npos) return {};
  return s.substr(begin, s.find_last_not_of(" \t\r") - begin + 1);
}

Status check_version_line(std::string_view line, const std::string& source) {
  const std::string expected = std::string(kTableFormat) + " " + str(kTableVersion);
  const Status wrong{StatusCode::kInvalidArgument,
                     source + ":1: expected the version line '" + expected + "', got '" + std::string(line) + "'"};
  std::istringstream words{std::string(line)};
  std::string format, extra;
  int version = 0;
  if (!(words >> format >> version) || format != kTableFormat || (words >> extra)) return wrong;
  if (version != kTableVersion)
    return {StatusCode::kInvalidArgument,
            source + ":1: " + kTableFormat + " version " + str(version) + " is not supported (this build reads " +
                str(kTableVersion) + ")"};
  return Status::Ok();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Public API

const char* decode_kernel_name(DecodeKernel k) {
  switch (k) {
    case DecodeKernel::kStandard: return "standard";
    case DecodeKernel::kSplitKv: return "split_kv";
  }
  return "unknown";
}

const char* decode_engine_name(DecodeEngine e) {
  switch (e) {
    case DecodeEngine::kKeyGroups: return "key_groups";
    case DecodeEngine::kHeadWarps: return "head_warps";
    case DecodeEngine::kPortable: return "portable";
  }
  return "unknown";
}

std::optional<DecodeEngine> decode_engine_from_name(std::string_view name) {
  for (DecodeEngine e : {DecodeEngine::kKeyGroups, DecodeEngine::kHeadWarps, DecodeEngine::kPortable})
    if (name == decode_engine_name(e)) return e;
  return std::nullopt;
}

std::optional<DecodeCombine> decode_combine_from_name(std::string_view name) {
  for (DecodeCombine c : {DecodeCombine::kInKernel, DecodeCombine::kSeparateKernel, DecodeCombine::kInKernelPrezeroed,
                          DecodeCombine::kCluster})
    if (name == decode_combine_name(c)) return c;
  return std::nullopt;
}

const char* decode_combine_name(DecodeCombine c) {
  switch (c) {
    case DecodeCombine::kInKernel: return "in_kernel";
    case DecodeCombine::kSeparateKernel: return "separate_kernel";
    case DecodeCombine::kInKernelPrezeroed: return "in_kernel_prezeroed";
    case DecodeCombine::kCluster: return "cluster";
  }
  return "unknown";
}

int decode_heuristic_slots(int num_sms) { return num_sms / 2 > 1 ? num_sms / 2 : 1; }

double decode_wave_efficiency(int64_t num_ctas, int num_sms) {
  if (num_ctas < 1 || num_sms < 1) return 0.0;
  return static_cast<double>(num_ctas) / static_cast<double>(ceil_div(num_ctas, num_sms) * num_sms);
}

Status decode_shape_key(const DecodeParams& params, DecodeShapeKey* key) {
  detail::DecodeShape s;
  FLARE_RETURN_IF_ERROR(detail::validate_decode(params, params.q.device.kind, &s));
  *key = DecodeShapeKey{};
  key->batch = s.batch;
  key->heads_q = s.heads_q;
  key->heads_kv = s.heads_kv;
  key->head_dim = s.head_dim;
  key->q_len = s.q_len;
  key->max_cache_len = s.max_cache_len;
  key->page_size = s.page_size;
  key->window_left = params.window_left;
  key->dtype = params.q.dtype;
  return check_key(*key);  // the cache-length limit is the planner's, not validate_decode's
}

DecodeShapeClass decode_shape_class(const DecodeShapeKey& key) {
  DecodeShapeClass c;
  c.batch_bucket = static_cast<int>(floor_power_of_two(key.batch));
  c.heads_kv = key.heads_kv;
  c.group = key.heads_q / key.heads_kv;
  c.head_dim = key.head_dim;
  c.q_len = key.q_len;
  c.kv_len_bucket = floor_power_of_two(planned_span(key));
  c.paged = key.paged();
  return c;
}

std::optional<DecodeTuningEntry> DecodeTuningTable::lookup(const DecodeShapeKey& key) const {
  if (!check_key(key).ok()) return std::nullopt;
  const auto it = entries_.find(decode_shape_class(key));
  if (it == entries_.end()) return std::nullopt;
  return it->second;
}

Status DecodeTuningTable::insert(const DecodeShapeKey& key, const DecodeTuningEntry& winner) {
  FLARE_RETURN_IF_ERROR(check_key(key));
  FLARE_RETURN_IF_ERROR(check_split_count("winner", winner.kernel, winner.num_splits));
  if (std::string problem = heads_per_cta_problem(winner.heads_per_cta, key.heads_kv, key.head_dim); !problem.empty())
    return Status::InvalidArgument("winner", problem);
  if (winner.combine == DecodeCombine::kInKernelPrezeroed)
    return Status::InvalidArgument("winner",
                                   "a table may not choose in_kernel_prezeroed (its counters are the caller's)");
  entries_[decode_shape_class(key)] = winner;
  return Status::Ok();
}

void DecodeTuningTable::write(std::ostream& out) const {
  out << kTableFormat << ' ' << kTableVersion << '\n'
      << "# decode winners by shape class; batch and kv_len are power-of-two buckets (see flare/decode_plan.h)\n";
  for (const auto& [c, e] : entries_) {
    out << "batch=" << c.batch_bucket << " heads_kv=" << c.heads_kv << " group=" << c.group
        << " head_dim=" << c.head_dim << " q_len=" << c.q_len << " kv_len=" << c.kv_len_bucket
        << " layout=" << layout_name(c.paged) << " kernel=" << decode_kernel_name(e.kernel)
        << " splits=" << e.num_splits;
    if (e.heads_per_cta != 0) out << " heads_per_cta=" << e.heads_per_cta;
    if (e.engine) out << " engine=" << decode_engine_name(*e.engine);
    if (e.combine) out << " combine=" << decode_combine_name(*e.combine);
    if (e.l2_evict_first) out << " l2=" << l2_policy_name(true);
    out << '\n';
  }
}

Status DecodeTuningTable::read(std::istream& in, const std::string& source_name) {
  std::string line;
  if (!std::getline(in, line)) return {StatusCode::kInvalidArgument, source_name + ":1: empty file, expected the version line"};
  FLARE_RETURN_IF_ERROR(check_version_line(trimmed(line), source_name));

  std::map<DecodeShapeClass, DecodeTuningEntry> parsed;
  std::map<DecodeShapeClass, int> line_of_class;  // for naming the first line of a duplicate
  for (int line_number = 2; std::getline(in, line); ++line_number) {
    const std::string_view text = trimmed(line);
    if (text.empty() || text.front() == '#') continue;
    const EntryLine entry_line(source_name, line_number);
    DecodeShapeClass c;
    DecodeTuningEntry e;
    FLARE_RETURN_IF_ERROR(entry_line.parse(text, &c, &e));
    if (auto [it, fresh] = line_of_class.emplace(c, line_number); !fresh)
      return entry_line.error("the same shape class as line " + str(it->second));
    parsed.emplace(c, e);
  }
  if (in.bad()) return {StatusCode::kInvalidArgument, source_name + ": read error"};
  entries_ = std::move(parsed);
  return Status::Ok();
}

Status DecodeTuningTable::save(const std::string& path) const {
  std::ofstream out(path);
  if (!out) return Status::InvalidArgument("path", "cannot open '" + path + "' for writing");
  write(out);
  out.close();
  if (!out) return Status::InvalidArgument("path", "writing '" + path + "' failed");
  return Status::Ok();
}

Status DecodeTuningTable::load(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::InvalidArgument("path", "cannot open '" + path + "' for reading");
  return read(in, path);
}

Status decode_plan(const DecodeShapeKey& key, const DecodeTuningTable* table, int num_sms, DecodePlan* plan) {
  FLARE_RETURN_IF_ERROR(check_key(key));
  FLARE_RETURN_IF_ERROR(check_num_sms(num_sms));
  if (table != nullptr) {
    if (const std::optional<DecodeTuningEntry> winner = table->lookup(key)) {
      *plan = make_plan(key, winner->num_splits, DecodePlanSource::kTuningTable, winner->heads_per_cta);
      if (winner->engine) plan->engine = *winner->engine;
      if (winner->combine) plan->combine = *winner->combine;
      plan->l2_evict_first = winner->l2_evict_first;
      return Status::Ok();
    }
  }
  *plan = make_plan(key, heuristic_split_count(key, num_sms), DecodePlanSource::kHeuristic);
  return Status::Ok();
}

Status decode_plan_for_splits(const DecodeShapeKey& key, int num_splits, DecodePlan* plan) {
  FLARE_RETURN_IF_ERROR(check_key(key));
  if (num_splits < 1 || num_splits > kMaxDecodeSplits)
    return Status::InvalidArgument("num_splits", "must be in [1, " + str(kMaxDecodeSplits) + "], got " +
                                                     str(num_splits));
  *plan = make_plan(key, num_splits, DecodePlanSource::kForced);
  return Status::Ok();
}

std::vector<DecodePlan> decode_candidates(const DecodeShapeKey& key, int num_sms) {
  std::vector<DecodePlan> plans;
  if (!check_key(key).ok() || !check_num_sms(num_sms).ok()) return plans;
  for_each_split_count(key, num_sms,
                       [&](int s) { plans.push_back(make_plan(key, s, DecodePlanSource::kForced)); });
  return plans;
}

std::vector<DecodePlan> decode_candidates_with_heads_per_cta(const DecodeShapeKey& key, int num_sms) {
  std::vector<DecodePlan> plans;
  if (!check_key(key).ok() || !check_num_sms(num_sms).ok()) return plans;
  for_each_split_count(key, num_sms, [&](int s) {
    for (int h = decode_max_heads_per_cta(key.head_dim); h >= 1; h /= 2)
      if (key.heads_kv % h == 0) plans.push_back(make_plan(key, s, DecodePlanSource::kForced, h));
  });
  return plans;
}

Status check_decode_plan(const DecodePlan& plan, const DecodeShapeKey& key) {
  FLARE_RETURN_IF_ERROR(check_key(key));
  if (!(plan.shape == key))
    return Status::InvalidArgument("plan", "was made for another shape: re-plan when batch, heads, head_dim, q_len, "
                                           "max_cache_len, page_size, window_left or dtype change");
  FLARE_RETURN_IF_ERROR(check_split_count("plan", plan.kernel, plan.num_splits));
  const DecodePlan expected = make_plan(key, plan.num_splits, plan.source);
  if (plan.num_splits != expected.num_splits || plan.kv_chunk != expected.kv_chunk || plan.kv_align != expected.kv_align ||
      plan.workspace_bytes != expected.workspace_bytes || plan.partial_lse_offset != expected.partial_lse_offset ||
      plan.counters_offset != expected.counters_offset)
    return Status::InvalidArgument("plan", "num_splits, kv_chunk, kv_align or the workspace layout differ from "
                                           "what the planner gives for " + str(plan.num_splits) +
                                               " splits: was the plan edited?");
  if (plan.engine != DecodeEngine::kKeyGroups && plan.engine != DecodeEngine::kHeadWarps &&
      plan.engine != DecodeEngine::kPortable)
    return Status::InvalidArgument("plan", "engine " + str(static_cast<int>(plan.engine)) + " is not a DecodeEngine");
  if (plan.combine != DecodeCombine::kInKernel && plan.combine != DecodeCombine::kSeparateKernel &&
      plan.combine != DecodeCombine::kInKernelPrezeroed && plan.combine != DecodeCombine::kCluster)
    return Status::InvalidArgument("plan", "combine " + str(static_cast<int>(plan.combine)) + " is not a DecodeCombine");
  if (std::string problem = heads_per_cta_problem(plan.heads_per_cta, key.heads_kv, key.head_dim); !problem.empty())
    return Status::InvalidArgument("plan", problem);
  return Status::Ok();
}

}  // namespace flare
