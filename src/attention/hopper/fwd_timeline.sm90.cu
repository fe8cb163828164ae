// The Hopper forward's timeline buffer and its summary (fwd_timeline.h); empty in default builds.
#include "src/attention/hopper/fwd_timeline.h"

#if FLARE_HOPPER_FWD_TIMELINE

#include <algorithm>
#include <cstdio>
#include <map>
#include <vector>

#include "src/common/stamp_buffer.h"

namespace flare::hopper {
namespace {

using detail::mean_of;
using detail::median_of;

detail::StampBuffer& stamps() {
  static detail::StampBuffer buffer(static_cast<std::size_t>(kTimelineCtas) * kMarks, "fwd timeline");
  return buffer;
}

}  // namespace

unsigned long long* fwd_timeline_buffer() { return stamps().get(); }

void fwd_timeline_reset(cudaStream_t stream) { stamps().reset(stream); }

std::string fwd_timeline_summary() {
  std::vector<unsigned long long> h;
  if (!stamps().read(&h)) return "fwd timeline: unavailable\n";
  const double cycles_per_us = detail::device_cycles_per_us();

  // Phases per CTA (cycles from its start), and each SM's CTAs by start for the gaps.
  const char* names[] = {"Q issued", "first K issued", "Q landed", "first K landed", "main loop", "epilogue",
                         "CTA total", "main loop per key tile"};
  std::vector<double> phase[8];
  std::map<unsigned long long, std::vector<std::pair<unsigned long long, unsigned long long>>> per_sm;
  // Warpgroup 0's tiles per SM (its epilogue and the wait for its next first GEMM, below), and its
  // step kTimelineStep's phases, from its turn to the next one.
  std::map<unsigned long long, std::vector<const unsigned long long*>> wg0_per_sm;
  const char* step_names[] = {"step: issue (turn to passed)", "step: S latency after issue", "step: softmax",
                              "step: PV wait after softmax", "step: to the next turn", "step: turn to turn"};
  std::vector<double> step_phase[6];
  int ctas = 0;
  for (int c = 0; c < kTimelineCtas; ++c) {
    const unsigned long long* m = &h[static_cast<size_t>(c) * kMarks];
    if (m[kMarkStart] == 0 || m[kMarkEnd] == 0) continue;
    ++ctas;
    const double s = static_cast<double>(m[kMarkStart]);
    auto since = [&](int mark) { return m[mark] ? static_cast<double>(m[mark]) - s : -1.0; };
    const double values[] = {since(kMarkQIssued), since(kMarkKIssued), since(kMarkQLanded), since(kMarkKLanded)};
    for (int i = 0; i < 4; ++i)
      if (values[i] >= 0) phase[i].push_back(values[i]);
    if (m[kMarkLoopDone] && m[kMarkKLanded]) {
      const double loop = static_cast<double>(m[kMarkLoopDone]) - static_cast<double>(m[kMarkKLanded]);
      phase[4].push_back(loop);
      if (m[kMarkTiles] > 0) phase[7].push_back(loop / static_cast<double>(m[kMarkTiles]));
      phase[5].push_back(static_cast<double>(m[kMarkEnd]) - static_cast<double>(m[kMarkLoopDone]));
    }
    phase[6].push_back(static_cast<double>(m[kMarkEnd]) - s);
    per_sm[m[kMarkSm]].push_back({m[kMarkStart], m[kMarkEnd]});
    if (m[kMarkFirstGemm] && m[kMarkLoopDone] && m[kMarkEpilogue0]) wg0_per_sm[m[kMarkSm]].push_back(m);
    if (m[kMarkStepTurn] && m[kMarkStepIssued] && m[kMarkStepSDone] && m[kMarkStepSoftmax] && m[kMarkStepPVDone] &&
        m[kMarkStepNext]) {
      auto d = [&](int a, int b) { return static_cast<double>(m[b]) - static_cast<double>(m[a]); };
      step_phase[0].push_back(d(kMarkStepTurn, kMarkStepIssued));
      step_phase[1].push_back(d(kMarkStepIssued, kMarkStepSDone));
      step_phase[2].push_back(d(kMarkStepSDone, kMarkStepSoftmax));
      step_phase[3].push_back(d(kMarkStepSoftmax, kMarkStepPVDone));
      step_phase[4].push_back(d(kMarkStepPVDone, kMarkStepNext));
      step_phase[5].push_back(d(kMarkStepTurn, kMarkStepNext));
    }
  }
  // Warpgroup 0 between consecutive tiles on an SM (by first GEMM): its epilogue, then the wait
  // until its next first S GEMM; and the share of the SM's span its main loops cover.
  std::vector<double> wg0_epi, wg0_wait, wg0_loop_share;
  for (auto& [sm, list] : wg0_per_sm) {
    std::sort(list.begin(), list.end(), [](auto a, auto b) { return a[kMarkFirstGemm] < b[kMarkFirstGemm]; });
    double loops = 0;
    for (size_t i = 0; i < list.size(); ++i) {
      loops += static_cast<double>(list[i][kMarkLoopDone]) - static_cast<double>(list[i][kMarkFirstGemm]);
      wg0_epi.push_back(static_cast<double>(list[i][kMarkEpilogue0]) - static_cast<double>(list[i][kMarkLoopDone]));
      if (i + 1 < list.size())
        wg0_wait.push_back(static_cast<double>(list[i + 1][kMarkFirstGemm]) -
                           static_cast<double>(list[i][kMarkEpilogue0]));
    }
    const double span = static_cast<double>(list.back()[kMarkLoopDone]) - static_cast<double>(list.front()[kMarkFirstGemm]);
    if (span > 0) wg0_loop_share.push_back(loops / span);
  }
  std::vector<double> gaps, busy;
  for (auto& [sm, list] : per_sm) {
    std::sort(list.begin(), list.end());
    double inside = 0;
    for (size_t i = 0; i < list.size(); ++i) {
      inside += static_cast<double>(list[i].second - list[i].first);
      if (i > 0) gaps.push_back(static_cast<double>(list[i].first) - static_cast<double>(list[i - 1].second));
    }
    const double span = static_cast<double>(list.back().second - list.front().first);
    if (span > 0) busy.push_back(inside / span);
  }
  // The grid on one clock (%globaltimer): its makespan, the SMs' busy share of it, and the share
  // lost after each SM's last CTA (the ragged last round a split of the last tiles would fill).
  std::map<unsigned long long, std::pair<double, unsigned long long>> sm_busy_last;  // busy ns, last end
  unsigned long long g0 = ~0ull, g1 = 0;
  for (int c = 0; c < kTimelineCtas; ++c) {
    const unsigned long long* m = &h[static_cast<size_t>(c) * kMarks];
    if (m[kMarkGlobalStart] == 0 || m[kMarkGlobalEnd] == 0) continue;
    g0 = std::min(g0, m[kMarkGlobalStart]);
    g1 = std::max(g1, m[kMarkGlobalEnd]);
    auto& e = sm_busy_last[m[kMarkSm]];
    e.first += static_cast<double>(m[kMarkGlobalEnd] - m[kMarkGlobalStart]);
    e.second = std::max(e.second, m[kMarkGlobalEnd]);
  }
  std::string out;
  char line[256];
  if (g1 > g0) {
    const double span = static_cast<double>(g1 - g0);
    double busy = 0, tail = 0;
    for (auto& [sm, e] : sm_busy_last) busy += e.first, tail += static_cast<double>(g1 - e.second);
    const double sms = static_cast<double>(sm_busy_last.size());
    std::snprintf(line, sizeof line,
                  "fwd grid: makespan %.2f us on %zu SMs; CTAs in flight %.1f%% of SM time, idle after each SM's "
                  "last CTA %.1f%% (mean %.2f us)\n",
                  span / 1e3, sm_busy_last.size(), 100 * busy / (sms * span), 100 * tail / (sms * span),
                  tail / sms / 1e3);
    out += line;
  }
  std::snprintf(line, sizeof line, "fwd timeline: %d CTAs on %zu SMs (clock %.0f MHz; cycles, then us)\n", ctas,
                per_sm.size(), cycles_per_us);
  out += line;
  for (int i = 0; i < 8; ++i) {
    std::snprintf(line, sizeof line, "  %-24s median %9.0f  mean %9.0f   (%7.2f / %7.2f us)\n", names[i],
                  median_of(phase[i]), mean_of(phase[i]), median_of(phase[i]) / cycles_per_us,
                  mean_of(phase[i]) / cycles_per_us);
    out += line;
  }
  std::snprintf(line, sizeof line,
                "  %-24s median %9.0f  mean %9.0f   (%7.2f / %7.2f us); CTAs in flight %.1f%% of each SM's span\n",
                "gap between CTAs on an SM", median_of(gaps), mean_of(gaps), median_of(gaps) / cycles_per_us,
                mean_of(gaps) / cycles_per_us, 100 * mean_of(busy));
  out += line;
  std::snprintf(line, sizeof line,
                "  %-24s median %9.0f  mean %9.0f   (%7.2f / %7.2f us)\n  %-24s median %9.0f  mean %9.0f   (%7.2f / "
                "%7.2f us); main loops %.1f%% of warpgroup 0's span on an SM\n",
                "wg0 epilogue", median_of(wg0_epi), mean_of(wg0_epi), median_of(wg0_epi) / cycles_per_us,
                mean_of(wg0_epi) / cycles_per_us, "wg0 to next first GEMM", median_of(wg0_wait), mean_of(wg0_wait),
                median_of(wg0_wait) / cycles_per_us, mean_of(wg0_wait) / cycles_per_us, 100 * mean_of(wg0_loop_share));
  out += line;
  for (int i = 0; i < 6; ++i) {
    if (step_phase[i].empty()) break;
    std::snprintf(line, sizeof line, "  %-30s median %7.0f  mean %7.0f cycles\n", step_names[i],
                  median_of(step_phase[i]), mean_of(step_phase[i]));
    out += line;
  }
  return out;
}

}  // namespace flare::hopper

#endif  // FLARE_HOPPER_FWD_TIMELINE
