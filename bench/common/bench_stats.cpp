#include "bench/common/bench_stats.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>

namespace flare::bench {

// ---- timing summaries --------------------------------------------------------------------------

double percentile_of_sorted(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) throw std::invalid_argument("percentile_of_sorted: no samples");
  p = std::clamp(p, 0.0, 1.0);
  const double rank = p * static_cast<double>(sorted.size() - 1);
  const std::size_t lo = static_cast<std::size_t>(std::floor(rank));
  const std::size_t hi = std::min(lo + 1, sorted.size() - 1);
  const double frac = rank - static_cast<double>(lo);
  return sorted[lo] + frac * (sorted[hi] - sorted[lo]);
}

Timing summarize(std::vector<double> samples_ms) {
  if (samples_ms.empty()) throw std::invalid_argument("summarize: no samples");
  std::sort(samples_ms.begin(), samples_ms.end());
  const double n = static_cast<double>(samples_ms.size());

  double sum = 0;
  for (double s : samples_ms) sum += s;
  const double mean = sum / n;
  double squares = 0;  // second pass around the mean: no cancellation for tightly spread samples
  for (double s : samples_ms) squares += (s - mean) * (s - mean);

  Timing t;
  t.repeats = static_cast<int>(samples_ms.size());
  t.mean_ms = mean;
  t.stddev_ms = samples_ms.size() > 1 ? std::sqrt(squares / (n - 1)) : 0.0;
  t.min_ms = samples_ms.front();
  t.max_ms = samples_ms.back();
  t.median_ms = percentile_of_sorted(samples_ms, 0.5);
  t.p10_ms = percentile_of_sorted(samples_ms, 0.1);
  t.p90_ms = percentile_of_sorted(samples_ms, 0.9);
  return t;
}

// ---- FLOPs and rates ---------------------------------------------------------------------------

namespace {
constexpr double kFlopsPerPairPerDim = 4.0;  // two GEMMs (Q·Kᵀ, P·V), a multiply-add each
constexpr double kBackwardOverForward = 2.5;
constexpr double kCausalFraction = 0.5;
}  // namespace

double attention_fwd_flops(int64_t batch, int64_t heads, int64_t seqlen_q, int64_t seqlen_k,
                           int64_t head_dim, bool causal) {
  // In doubles from the start: long sequences times many heads overflow nothing this way.
  const double full = kFlopsPerPairPerDim * static_cast<double>(batch) *
                      static_cast<double>(heads) * static_cast<double>(seqlen_q) *
                      static_cast<double>(seqlen_k) * static_cast<double>(head_dim);
  return causal ? full * kCausalFraction : full;
}

double attention_bwd_flops(int64_t batch, int64_t heads, int64_t seqlen_q, int64_t seqlen_k,
                           int64_t head_dim, bool causal) {
  return kBackwardOverForward *
         attention_fwd_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal);
}

double attention_flops_from_pairs(int64_t visible_pairs, int64_t heads_times_batch,
                                  int64_t head_dim) {
  return kFlopsPerPairPerDim * static_cast<double>(visible_pairs) *
         static_cast<double>(heads_times_batch) * static_cast<double>(head_dim);
}

double tflops(double flops, double ms) {
  if (!(ms > 0)) return std::numeric_limits<double>::quiet_NaN();
  return flops / (ms * 1e-3) / 1e12;
}

double gbps(double bytes, double ms) {
  if (!(ms > 0)) return std::numeric_limits<double>::quiet_NaN();
  return bytes / (ms * 1e-3) / 1e9;
}

// ---- text table --------------------------------------------------------------------------------

namespace {
constexpr const char* kColumnGap = "  ";

// Terminal width of UTF-8 text, counted in code points (so "µs" is two wide, not three).
std::size_t display_width(const std::string& s) {
  std::size_t width = 0;
  for (unsigned char c : s) width += (c & 0xC0) != 0x80;
  return width;
}

void append_padded(std::string* line, const std::string& text, std::size_t width,
                   bool right_align) {
  const std::string pad(width - display_width(text), ' ');
  *line += right_align ? pad + text : text + pad;
}
}  // namespace

std::string Table::format_number(double v, int precision) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", std::max(precision, 0), v);
  return buf;
}

void Table::add_row(const std::vector<std::pair<std::string, Cell>>& cells) {
  std::map<std::size_t, Cell> row;
  for (const auto& [column, cell] : cells) {
    auto it = std::find(columns_.begin(), columns_.end(), column);
    const std::size_t index = static_cast<std::size_t>(it - columns_.begin());
    if (it == columns_.end()) columns_.push_back(column);
    row.insert_or_assign(index, cell);
  }
  rows_.push_back(std::move(row));
}

std::string Table::str() const {
  const std::size_t n = columns_.size();
  if (n == 0) return "";
  std::vector<std::size_t> width(n);
  std::vector<bool> right_align(n, true);  // a column of numbers only
  for (std::size_t c = 0; c < n; ++c) width[c] = display_width(columns_[c]);
  for (const auto& row : rows_) {
    for (const auto& [c, cell] : row) {
      width[c] = std::max(width[c], display_width(cell.text));
      if (!cell.numeric) right_align[c] = false;
    }
  }

  auto finish_line = [](std::string* line, std::string* out) {
    line->erase(line->find_last_not_of(' ') + 1);
    *out += *line + "\n";
  };
  std::string out;
  std::string header, rule;
  for (std::size_t c = 0; c < n; ++c) {
    if (c > 0) header += kColumnGap, rule += kColumnGap;
    append_padded(&header, columns_[c], width[c], right_align[c]);
    rule += std::string(width[c], '-');
  }
  finish_line(&header, &out);
  finish_line(&rule, &out);
  for (const auto& row : rows_) {
    std::string line;
    for (std::size_t c = 0; c < n; ++c) {
      if (c > 0) line += kColumnGap;
      auto it = row.find(c);
      append_padded(&line, it == row.end() ? std::string() : it->second.text, width[c],
                    right_align[c]);
    }
    finish_line(&line, &out);
  }
  return out;
}

void Table::print(std::FILE* out) const {
  const std::string s = str();
  std::fwrite(s.data(), 1, s.size(), out);
  std::fflush(out);
}

// ---- JSON records ------------------------------------------------------------------------------

std::string json_string(std::string_view s) {
  std::string out = "\"";
  for (char ch : s) {
    const unsigned char c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {  // the other control characters have no short escape
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
          out += buf;
        } else {
          out += ch;
        }
    }
  }
  out += '"';
  return out;
}

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  const auto result = std::to_chars(buf, buf + sizeof buf, v);  // shortest round-trip form
  return std::string(buf, result.ptr);
}

namespace {
template <typename Value, typename Format>
std::string json_object(const std::map<std::string, Value>& m, Format format_value) {
  std::string out = "{";
  bool first = true;
  for (const auto& [key, value] : m) {
    if (!first) out += ", ";
    first = false;
    out += json_string(key) + ": " + format_value(value);
  }
  return out + "}";
}
}  // namespace

std::string to_json(const std::vector<Record>& records) {
  if (records.empty()) return "[]\n";
  std::string out = "[\n";
  for (std::size_t i = 0; i < records.size(); ++i) {
    const Record& r = records[i];
    out += "  {\"name\": " + json_string(r.name) +
           ", \"metrics\": " + json_object(r.metrics, json_number) +
           ", \"tags\": " + json_object(r.tags, json_string) + "}";
    out += i + 1 < records.size() ? ",\n" : "\n";
  }
  return out + "]\n";
}

void write_json(const std::string& path, const std::vector<Record>& records) {
  const std::string text = to_json(records);
  std::FILE* f = std::fopen(path.c_str(), "w");
  bool ok = f != nullptr;
  if (ok) ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if (f != nullptr && std::fclose(f) != 0) ok = false;
  if (!ok) {
    std::fprintf(stderr, "cannot write JSON to '%s': %s\n", path.c_str(), std::strerror(errno));
    std::exit(1);
  }
}

// ---- command line ------------------------------------------------------------------------------

bool Args::selected(std::string_view name) const {
  return name.find(filter) != std::string_view::npos;
}

TimingOptions Args::timing(TimingOptions defaults) const {
  TimingOptions t = defaults;
  if (quick) {
    t.repeats = std::min(t.repeats, kQuickRepeats);
    t.warmup = std::min(t.warmup, kQuickWarmup);
  }
  if (repeats) t.repeats = *repeats;
  if (warmup) t.warmup = *warmup;
  if (graph) t.cuda_graph = true;
  if (no_flush) t.flush_l2 = false;
  if (calls) t.calls = *calls;
  return t;
}

namespace {
bool parse_int(std::string_view text, int min_value, int* value) {
  int v = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || ptr != text.data() + text.size() || v < min_value) return false;
  *value = v;
  return true;
}
}  // namespace

bool parse_args(int argc, const char* const* argv, Args* args, std::string* error) {
  auto fail = [&](std::string message) {
    if (error != nullptr) *error = std::move(message);
    return false;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      args->help = true;
      continue;
    }
    if (!arg.starts_with("--")) return fail("unexpected argument '" + std::string(arg) + "'");

    // --name=value or --name [value]
    const std::size_t eq = arg.find('=');
    const std::string name(arg.substr(0, eq));
    std::optional<std::string> inline_value;
    if (eq != std::string_view::npos) inline_value = std::string(arg.substr(eq + 1));

    const bool is_flag = name == "--graph" || name == "--no-flush" || name == "--quick" || name == "--forward-only";
    const bool takes_value =
        name == "--json" || name == "--repeats" || name == "--warmup" || name == "--filter" || name == "--seqlen" ||
        name == "--calls";
    if (is_flag) {
      if (inline_value) return fail(name + " takes no value");
      if (name == "--graph") args->graph = true;
      if (name == "--no-flush") args->no_flush = true;
      if (name == "--quick") args->quick = true;
      if (name == "--forward-only") args->forward_only = true;
      continue;
    }
    if (!takes_value) return fail("unknown option '" + name + "'");

    std::string value;
    if (inline_value) {
      value = *inline_value;
    } else {
      // "--json --quick" is a forgotten path, not a file named "--quick".
      if (i + 1 >= argc || std::string_view(argv[i + 1]).starts_with("--")) {
        return fail(name + " needs a value");
      }
      value = argv[++i];
    }

    if (name == "--json") {
      if (value.empty()) return fail("--json needs a path");
      args->json_path = value;
    } else if (name == "--filter") {
      args->filter = value;
    } else {
      const int least = name == "--warmup" ? 0 : 1;
      int n = 0;
      if (!parse_int(value, least, &n)) {
        return fail(name + ": expected an integer >= " + std::to_string(least) + ", got '" + value + "'");
      }
      (name == "--repeats"  ? args->repeats
       : name == "--warmup" ? args->warmup
       : name == "--calls"  ? args->calls
                            : args->seqlen) = n;
    }
  }
  return true;
}

std::string usage(std::string_view program) {
  return "usage: " + std::string(program) +
         " [options]\n"
         "  --json PATH      also write the results to PATH as JSON records\n"
         "  --repeats N      timed samples per case (N >= 1)\n"
         "  --warmup N       untimed launches before the samples (N >= 0)\n"
         "  --graph          time CUDA-graph replays instead of direct launches\n"
         "  --no-flush       keep L2 warm between samples\n"
         "  --calls N        time N back-to-back launches per sample (a sample is their time / N), as\n"
         "                   the Python peers' --calls does; the L2 flush precedes the first only\n"
         "  --filter SUBSTR  run only the cases whose name contains SUBSTR\n"
         "  --seqlen N       the sequence length, for the sweeps that take one\n"
         "  --quick          a smaller sweep with fewer samples\n"
         "  --forward-only   (benchmarks of an op with a backward) time the forward alone\n"
         "  -h, --help       print this help\n";
}

Args parse_args_or_exit(int argc, char** argv) {
  const char* program = argc > 0 ? argv[0] : "bench";
  Args args;
  std::string error;
  if (!parse_args(argc, argv, &args, &error)) {
    std::fprintf(stderr, "%s: %s\n%s", program, error.c_str(), usage(program).c_str());
    std::exit(2);
  }
  if (args.help) {
    std::fputs(usage(program).c_str(), stdout);
    std::exit(0);
  }
  return args;
}

}  // namespace flare::bench
