// Runs CUDA kernel code on the CPU, for tests on machines without a GPU: one OS thread per CUDA
// thread, blocks one after another, __syncthreads and the warp-collective operations (shuffles,
// and ldmatrix / mma.sync in the warp_mma.h beside this file) on barriers. Slow (a test sized
// problem takes seconds) but exact in the fragment layouts, so index and layout mistakes of a
// kernel show on the CPU. Shared memory is one buffer, poisoned (NaN) before every block, so a
// read of shared memory no thread wrote shows as well. Kernels must exit uniformly per block
// (a barrier waits for every thread of the block or warp).
//
// Include this first, then the kernel headers (with this folder before the repository root on the
// include path, so the emulated warp_mma.h replaces the real one).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_types.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <semaphore>
#include <thread>
#include <vector>

#define __launch_bounds__(...)
#define FLARE_CUDA_EMU 1  // kernel headers leave out what only the GPU compiles (wgmma)
using std::max;
using std::min;

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

namespace cuda_emu {

// The barriers and the per-warp exchange slots of the running block.
struct Block {
  explicit Block(int threads) : all(threads), exchange((threads + 31) / 32) {
    for (int w = 0; w * 32 < threads; ++w) warps.push_back(std::make_unique<std::barrier<>>(std::min(32, threads - 32 * w)));
  }
  struct Exchange {
    const void* addr[32];
    uint32_t a[32][4];
    uint32_t b[32][2];
    float f[32];
  };
  std::barrier<> all;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<Exchange> exchange;
};

inline thread_local Block* block = nullptr;

inline int lane() { return static_cast<int>(threadIdx.x % 32); }
inline void warp_barrier() { block->warps[threadIdx.x / 32]->arrive_and_wait(); }
inline Block::Exchange& exchange() { return block->exchange[threadIdx.x / 32]; }

// The `extern __shared__` buffer of the kernels' namespace is defined by the test
// (CUDA_EMU_SHARED_MEMORY) and handed to launch, which poisons it before every block.
constexpr size_t kSharedBytes = 232448;  // an sm_90 block's opt-in maximum

// The OS threads that run a block's CUDA threads, kept from block to block and launch to launch:
// creating and joining a thread per CUDA thread of every block cost about 35 us each on a 2-core
// CI machine (2.6 s for 600 blocks of 128 threads, which the attention backward's conversions
// launch at seqlen 150; the pool takes 0.06 s). A block's threads all run at once (they meet at
// barriers): run(n, job) starts job(0) .. job(n - 1) on the first n workers, adding workers as
// needed, and returns when every one has finished.
class Workers {
 public:
  Workers() = default;
  Workers(const Workers&) = delete;
  Workers& operator=(const Workers&) = delete;
  ~Workers() {
    stop_ = true;
    for (auto& w : workers_) w->start.release();
    for (auto& w : workers_) w->thread.join();
  }

  template <typename Job>
  void run(int n, Job& job) {
    while (static_cast<int>(workers_.size()) < n) {
      auto w = std::make_unique<Worker>();
      w->thread = std::thread([this, w = w.get(), index = static_cast<int>(workers_.size())] { loop(*w, index); });
      workers_.push_back(std::move(w));
    }
    job_ = &job;
    call_ = [](void* j, int t) { (*static_cast<Job*>(j))(t); };
    for (int t = 0; t < n; ++t) workers_[t]->start.release();  // publishes job_ and call_
    for (int t = 0; t < n; ++t) done_.acquire();               // and the workers' writes back
  }

 private:
  struct Worker {
    std::binary_semaphore start{0};
    std::thread thread;
  };
  void loop(Worker& w, int index) {
    for (;;) {
      w.start.acquire();
      if (stop_) return;
      call_(job_, index);
      done_.release();
    }
  }

  std::vector<std::unique_ptr<Worker>> workers_;
  std::counting_semaphore<> done_{0};
  void* job_ = nullptr;
  void (*call_)(void*, int) = nullptr;
  bool stop_ = false;
};

inline Workers& workers() {
  static Workers pool;
  return pool;
}

// kernel() on every thread of every block of `grid` (blocks of `threads` x 1 x 1); `shared`: the
// kernels' shared memory (kSharedBytes), set to 0xFF (NaN in every float type) before each block.
template <typename Kernel>
void launch(dim3 grid, int threads, unsigned char* shared, Kernel kernel) {
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        std::memset(shared, 0xFF, kSharedBytes);
        Block b(threads);
        auto thread = [&](int t) {
          threadIdx = uint3{static_cast<unsigned>(t), 0, 0};
          blockIdx = uint3{x, y, z};
          blockDim = dim3(threads);
          gridDim = grid;
          block = &b;
          kernel();
        };
        workers().run(threads, thread);
      }
}

}  // namespace cuda_emu

// Defines the `extern __shared__` array `name` of namespace `ns` over the emulated shared memory.
#define CUDA_EMU_SHARED_MEMORY(ns, name) \
  namespace ns {                         \
  alignas(16) unsigned char name[cuda_emu::kSharedBytes];  \
  }

inline void __syncthreads() { cuda_emu::block->all.arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { cuda_emu::warp_barrier(); }
template <typename X>  // 4-byte values (float, int, unsigned)
inline X __shfl_xor_sync(unsigned, X v, int offset) {
  static_assert(sizeof(X) == sizeof(float), "4-byte shuffles only");
  auto& e = cuda_emu::exchange();
  std::memcpy(&e.f[cuda_emu::lane()], &v, sizeof(X));
  cuda_emu::warp_barrier();
  X r;
  std::memcpy(&r, &e.f[cuda_emu::lane() ^ offset], sizeof(X));
  cuda_emu::warp_barrier();
  return r;
}
// Whether `pred` holds in any thread of the calling thread's warp (every thread of it takes part).
inline int __any_sync(unsigned, int pred) {
  auto& e = cuda_emu::exchange();
  const float v = pred != 0 ? 1.f : 0.f;
  e.f[cuda_emu::lane()] = v;
  cuda_emu::warp_barrier();
  const int first = static_cast<int>(threadIdx.x) / 32 * 32;
  const int lanes = std::min(32, static_cast<int>(blockDim.x) - first);
  int any = 0;
  for (int l = 0; l < lanes; ++l) any |= e.f[l] != 0.f;
  cuda_emu::warp_barrier();
  return any;
}
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __log2f(float x) { return std::log2(x); }
inline float __fdividef(float x, float y) { return x / y; }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
