// The decode timeline's buffer and summary (decode_timeline.h); empty in default builds.
#include "src/decode/decode_timeline.h"

#if FLARE_DECODE_TIMELINE

#include <algorithm>
#include <cstdio>
#include <vector>

#include "src/common/stamp_buffer.h"

namespace flare::decode {
namespace {

using detail::median_of;

double max_of(const std::vector<double>& v) { return v.empty() ? 0.0 : *std::max_element(v.begin(), v.end()); }

detail::StampBuffer& stamps() {
  static detail::StampBuffer buffer(static_cast<std::size_t>(kDecodeTimelineCtas) * kDecodeMarks, "decode timeline");
  return buffer;
}

}  // namespace

unsigned long long* decode_timeline_buffer() { return stamps().get(); }

void decode_timeline_reset(cudaStream_t stream) { stamps().reset(stream); }

std::string decode_timeline_summary() {
  std::vector<unsigned long long> h;
  if (!stamps().read(&h)) return "decode timeline: unavailable\n";
  const double cycles_per_us = detail::device_cycles_per_us();
  std::vector<double> setup, issued, landed, loop, walked, merge, tail, total, start_ns, end_ns, epi, bar1, cmerge, bar2;
  for (int c = 0; c < kDecodeTimelineCtas; ++c) {
    const unsigned long long* m = &h[static_cast<size_t>(c) * kDecodeMarks];
    if (m[kDecodeMarkStart] == 0 || m[kDecodeMarkEnd] == 0) continue;
    auto d = [&](int a, int z) {
      return m[a] && m[z] ? (static_cast<double>(m[z]) - static_cast<double>(m[a])) / cycles_per_us : -1.0;
    };
    auto push = [](std::vector<double>& v, double x) {
      if (x >= 0) v.push_back(x);
    };
    push(setup, d(kDecodeMarkStart, kDecodeMarkSetup));
    push(issued, d(kDecodeMarkStart, kDecodeMarkIssued));
    push(landed, d(kDecodeMarkStart, kDecodeMarkLanded));
    push(loop, d(kDecodeMarkLanded, kDecodeMarkLoopDone));
    push(walked, d(kDecodeMarkStart, kDecodeMarkLoopDone));
    push(epi, d(kDecodeMarkMerged, kDecodeMarkEpilogueDone));
    push(bar1, d(kDecodeMarkEpilogueDone, kDecodeMarkClusterIn));
    push(cmerge, d(kDecodeMarkClusterIn, kDecodeMarkClusterMerged));
    push(bar2, d(kDecodeMarkClusterMerged, kDecodeMarkEnd));
    push(merge, d(kDecodeMarkLoopDone, kDecodeMarkMerged));
    push(tail, d(kDecodeMarkMerged, kDecodeMarkEnd));
    push(total, d(kDecodeMarkStart, kDecodeMarkEnd));
    start_ns.push_back(static_cast<double>(m[kDecodeMarkStartNs]));
    end_ns.push_back(static_cast<double>(m[kDecodeMarkEndNs]));
  }
  if (total.empty()) return "decode timeline: no CTA stamped\n";
  const double t0 = *std::min_element(start_ns.begin(), start_ns.end());
  std::vector<double> starts, ends;
  for (double x : start_ns) starts.push_back((x - t0) / 1e3);
  for (double x : end_ns) ends.push_back((x - t0) / 1e3);
  char line[640];
  std::snprintf(line, sizeof line,
                "timeline (%zu CTAs, us, medians; clock %.0f MHz): setup %.2f, first stage issued %.2f, "
                "landed %.2f, walk %.2f, merge %.2f, epilogue+combine %.2f, CTA %.2f | starts: median %.2f "
                "max %.2f; ends: median %.2f max %.2f | landed max %.2f; walk done (from the CTA's start): "
                "median %.2f max %.2f\n",
                total.size(), cycles_per_us, median_of(setup), median_of(issued), median_of(landed), median_of(loop),
                median_of(merge), median_of(tail), median_of(total), median_of(starts),
                max_of(starts), median_of(ends), max_of(ends), max_of(landed), median_of(walked), max_of(walked));
  std::string out = line;
  if (!bar1.empty()) {
    std::snprintf(line, sizeof line,
                  "  cluster combine (us, medians / max): epilogue %.2f / %.2f, first barrier %.2f / %.2f, merge "
                  "%.2f / %.2f, last barrier %.2f / %.2f\n",
                  median_of(epi), max_of(epi), median_of(bar1), max_of(bar1), median_of(cmerge), max_of(cmerge),
                  median_of(bar2), max_of(bar2));
    out += line;
  }
  return out;
}

}  // namespace flare::decode

#endif
