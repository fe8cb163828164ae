// The decode timeline's buffer and summary (decode_timeline.h); empty in default builds.
#include "src/decode/decode_timeline.h"

#if FLARE_DECODE_TIMELINE

#include <algorithm>
#include <cstdio>
#include <vector>

namespace flare::decode {
namespace {

constexpr size_t kBufferBytes = sizeof(unsigned long long) * kDecodeTimelineCtas * kDecodeMarks;

double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

unsigned long long* decode_timeline_buffer() {
  static unsigned long long* buffer = [] {
    void* p = nullptr;
    if (cudaMalloc(&p, kBufferBytes) != cudaSuccess || cudaMemset(p, 0, kBufferBytes) != cudaSuccess) {
      std::fprintf(stderr, "decode timeline: no buffer\n");
      return static_cast<unsigned long long*>(nullptr);
    }
    return static_cast<unsigned long long*>(p);
  }();
  return buffer;
}

void decode_timeline_reset(cudaStream_t stream) {
  if (unsigned long long* b = decode_timeline_buffer()) (void)cudaMemsetAsync(b, 0, kBufferBytes, stream);
}

std::string decode_timeline_summary() {
  unsigned long long* b = decode_timeline_buffer();
  if (b == nullptr || cudaDeviceSynchronize() != cudaSuccess) return "decode timeline: unavailable\n";
  std::vector<unsigned long long> h(static_cast<size_t>(kDecodeTimelineCtas) * kDecodeMarks);
  if (cudaMemcpy(h.data(), b, kBufferBytes, cudaMemcpyDeviceToHost) != cudaSuccess) return "decode timeline: copy failed\n";
  int device = 0, khz = 0;
  (void)cudaGetDevice(&device);
  (void)cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, device);
  const double cycles_per_us = khz > 0 ? khz / 1000.0 : 1.0;
  std::vector<double> setup, issued, landed, loop, merge, tail, total, start_ns, end_ns;
  for (int c = 0; c < kDecodeTimelineCtas; ++c) {
    const unsigned long long* m = &h[static_cast<size_t>(c) * kDecodeMarks];
    if (m[kDecodeMarkStart] == 0 || m[kDecodeMarkEnd] == 0) continue;
    auto d = [&](int a, int z) { return m[a] && m[z] ? (static_cast<double>(m[z]) - static_cast<double>(m[a])) / cycles_per_us : -1; };
    auto push = [](std::vector<double>& v, double x) { if (x >= 0) v.push_back(x); };
    push(setup, d(kDecodeMarkStart, kDecodeMarkSetup));
    push(issued, d(kDecodeMarkStart, kDecodeMarkIssued));
    push(landed, d(kDecodeMarkStart, kDecodeMarkLanded));
    push(loop, d(kDecodeMarkLanded, kDecodeMarkLoopDone));
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
                "timeline (%zu CTAs, us, medians; clock %.0f MHz): setup %.2f, first stage issued %.2f, landed %.2f, walk %.2f, "
                "merge %.2f, epilogue+combine %.2f, CTA %.2f | starts: median %.2f max %.2f; ends: median %.2f max %.2f\n",
                total.size(), cycles_per_us, median_of(setup), median_of(issued), median_of(landed), median_of(loop), median_of(merge),
                median_of(tail), median_of(total), median_of(starts), *std::max_element(starts.begin(), starts.end()),
                median_of(ends), *std::max_element(ends.begin(), ends.end()));
  return line;
}

}  // namespace flare::decode

#endif
