// The host-only half of the benchmark harness: statistics over timing samples, FLOP and byte
// counting, the text table, JSON records and the command line. No CUDA here, so all of it is
// tested on the CPU (tests/cpu/test_bench_stats.cpp); the GPU half is bench_common.h.
#pragma once

#include <concepts>
#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace flare::bench {

// ---- timing options and summaries -------------------------------------------------------------

struct TimingOptions {
  int warmup = 10;          // untimed launches first (clocks, caches, lazy module loading)
  int repeats = 50;         // timed launches (or graph replays), one sample each
  bool flush_l2 = true;     // overwrite L2 before every sample, so inputs start in HBM
  bool cuda_graph = false;  // time replays of a captured graph instead of direct launches
  int graph_batch = 1;      // launches captured per graph; a sample is replay time / graph_batch
  int calls = 1;            // direct launches back to back per sample; a sample is their time / calls
};

struct Timing {
  double median_ms = 0, mean_ms = 0, min_ms = 0, max_ms = 0, stddev_ms = 0, p10_ms = 0, p90_ms = 0;
  int repeats = 0;  // number of samples summarized
};

// Percentile `p` in [0, 1] of sorted samples, interpolating linearly between the two nearest
// ranks (numpy's default), so the median of an even count is the mean of the middle two.
double percentile_of_sorted(const std::vector<double>& sorted, double p);

// Median, mean, extremes, sample standard deviation (n - 1; 0 for one sample), p10 and p90.
// Throws std::invalid_argument on an empty vector: a timing of nothing is a caller bug.
Timing summarize(std::vector<double> samples_ms);

// ---- FLOPs and rates ---------------------------------------------------------------------------
// Counted as FlashAttention counts them: the two GEMMs (S = Q·Kᵀ and O = P·V) are 2·sq·sk·d
// each, softmax is not counted, causal is half of the full square (whatever sq and sk are), and the
// backward pass (five GEMMs, one of them recomputing S) is 2.5 times the forward.

double attention_fwd_flops(int64_t batch, int64_t heads, int64_t seqlen_q, int64_t seqlen_k,
                           int64_t head_dim, bool causal);
double attention_bwd_flops(int64_t batch, int64_t heads, int64_t seqlen_q, int64_t seqlen_k,
                           int64_t head_dim, bool causal);
// For masks counted on their visible part (sliding window, block-sparse, varlen): the forward
// FLOPs of `visible_pairs` (query, key) pairs per (batch, head), over `heads_times_batch` heads:
// 4 · visible_pairs · heads_times_batch · head_dim.
double attention_flops_from_pairs(int64_t visible_pairs, int64_t heads_times_batch,
                                  int64_t head_dim);

// Rates from a time in milliseconds; NaN when ms is not positive.
double tflops(double flops, double ms);  // 1e12 FLOP/s
double gbps(double bytes, double ms);    // 1e9 B/s

// ---- text table --------------------------------------------------------------------------------

// Rows of named cells, printed with aligned columns. Columns appear in the order their names are
// first used; a row without some column leaves it blank. Text is left-aligned, numbers right.
class Table {
 public:
  static constexpr int kDefaultPrecision = 3;

  // Text, an integer, or a number printed with `precision` digits after the point.
  struct Cell {
    Cell(std::string s) : text(std::move(s)) {}
    Cell(const char* s) : text(s) {}
    template <std::integral I>
    Cell(I v) : text(std::to_string(v)), numeric(true) {}
    template <std::floating_point F>
    Cell(F v, int precision = kDefaultPrecision)
        : text(format_number(v, precision)), numeric(true) {}

    std::string text;
    bool numeric = false;
  };

  // table.add_row({{"shape", "b4 h16 s4096"}, {"ms", 1.234}, {"TFLOP/s", Table::Cell(612.3, 1)},
  //                {"repeats", 50}});
  void add_row(const std::vector<std::pair<std::string, Cell>>& cells);

  std::string str() const;
  void print(std::FILE* out = stdout) const;
  bool empty() const { return rows_.empty(); }

  static std::string format_number(double v, int precision);

 private:
  std::vector<std::string> columns_;
  std::vector<std::map<std::size_t, Cell>> rows_;  // column index -> cell
};

// ---- JSON records ------------------------------------------------------------------------------

struct Record {
  std::string name;
  std::map<std::string, double> metrics;     // "median_ms", "tflops", "fraction_of_ceiling", ...
  std::map<std::string, std::string> tags;   // "dtype", "head_dim", "device", ...
};

// The JSON string literal (with its quotes) for UTF-8 text: escapes '"', '\\' and control
// characters; other bytes pass through.
std::string json_string(std::string_view s);
// A JSON number as the shortest text that reads back to the same double; null when not finite
// (JSON has no NaN or infinity).
std::string json_number(double v);
// An array of {"name": ..., "metrics": {...}, "tags": {...}}, one record per line.
std::string to_json(const std::vector<Record>& records);
// Writes to_json(records) to `path`; prints the reason and exits(1) if the file cannot be written.
void write_json(const std::string& path, const std::vector<Record>& records);

// ---- command line ------------------------------------------------------------------------------

inline constexpr int kQuickRepeats = 10;  // --quick: fewer samples unless --repeats is given
inline constexpr int kQuickWarmup = 3;

struct Args {
  std::string json_path;       // --json PATH: also write the records there
  std::optional<int> repeats;  // --repeats N (N >= 1)
  std::optional<int> warmup;   // --warmup N (N >= 0)
  std::optional<int> seqlen;   // --seqlen N (N >= 1): the sequence length, for sweeps that take one
  std::optional<int> calls;    // --calls N (N >= 1): N back-to-back launches per sample (no flush between)
  bool graph = false;          // --graph: time CUDA-graph replays
  bool no_flush = false;       // --no-flush: keep L2 warm between samples
  std::string filter;          // --filter SUBSTR: run only cases whose name contains it
  bool quick = false;          // --quick: a smaller sweep and fewer samples
  bool forward_only = false;   // --forward-only: benchmarks of an op with a backward time the forward alone
  bool help = false;           // --help / -h

  // Whether a case named `name` passes --filter (everything passes an empty filter).
  bool selected(std::string_view name) const;
  // `defaults` with the command line's overrides applied.
  TimingOptions timing(TimingOptions defaults = {}) const;
};

// Parses argv[1..argc). Options take their value as the next argument or after '='
// (--repeats=20). Returns false with a message in *error on an unknown option, a missing value or
// a bad number; *args then holds what was parsed before it.
bool parse_args(int argc, const char* const* argv, Args* args, std::string* error);
std::string usage(std::string_view program);
// For a benchmark's main: prints the usage and exits(0) on --help, exits(2) on a bad command line.
Args parse_args_or_exit(int argc, char** argv);

}  // namespace flare::bench
