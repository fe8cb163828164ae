// The CPU oracles' one form of parallelism: independent tasks (a sequence's head, or its KV head's
// group) spread over threads. Each task writes only its own outputs, so results do not depend on
// the thread count. FLARE_REF_THREADS=N sets the count (default: the hardware's, at most 32).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <thread>
#include <vector>

namespace flare::ref {

// A count set by a test (0: none); it takes precedence over FLARE_REF_THREADS.
inline int& reference_threads_override() {
  static int n = 0;
  return n;
}

inline int reference_threads() {
  if (reference_threads_override() > 0) return reference_threads_override();
  static const int n = [] {
    if (const char* e = std::getenv("FLARE_REF_THREADS")) {
      const int v = std::atoi(e);
      if (v > 0) return v;
    }
    const unsigned hw = std::thread::hardware_concurrency();
    return static_cast<int>(std::clamp(hw, 1u, 32u));
  }();
  return n;
}

// Calls task(i) once for every i in [0, n), on up to reference_threads() threads.
template <typename Task>
void parallel_tasks(int64_t n, const Task& task) {
  const int threads = static_cast<int>(std::min<int64_t>(reference_threads(), n));
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) task(i);
    return;
  }
  std::atomic<int64_t> next{0};
  auto worker = [&] {
    for (int64_t i = next++; i < n; i = next++) task(i);
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads - 1));
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
}

}  // namespace flare::ref
