// Decode tile-shape sweep: the split-KV attention kernel alone (no combine) for head dim 128, bf16,
// heads 32 / 8, one query token, with several (keys per tile, pipeline stages) shapes, under
// CUDA-graph replay with L2 flushed before each sample. Prints time and KV GB/s, so the shape in
// DecodeConfigFor<128> (src/decode/decode_kernel.h) is chosen by measurement.
//
//   tune_decode_tiles [--quick] [--repeats N]
#include <cuda_bf16.h>

#include <cstdio>
#include <string>
#include <vector>

#include "bench/common/bench_common.h"
#include "flare/decode_plan.h"
#include "src/decode/decode_kernel.h"

namespace flare::bench {
namespace {

constexpr int kHeadsQ = 32, kHeadsKv = 8, kHeadDim = 128;
using T = __nv_bfloat16;

struct Shape {
  int batch, cache_len, num_splits;
};

// One tile shape's split-KV kernel, launched as decode_run launches it.
struct Variant {
  std::string name;
  void (*launch)(const decode::DecodeKernelParams&, cudaStream_t);
};

template <int kBlockN, int kStages>
Variant variant() {
  using Cfg = decode::DecodeTileConfig<kHeadDim, kBlockN, kStages>;
  constexpr int kSmem = Cfg::template smem_bytes<T>();
  FLARE_BENCH_CHECK(cudaFuncSetAttribute(decode::decode_attention_kernel<Cfg, T, true>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  return {"n" + std::to_string(kBlockN) + " stages" + std::to_string(kStages) + " (" + std::to_string(kSmem / 1024) +
              " KB)",
          [](const decode::DecodeKernelParams& p, cudaStream_t s) {
            const unsigned ctas = static_cast<unsigned>(p.batch * p.heads_kv * p.num_splits);
            decode::decode_attention_kernel<Cfg, T, true><<<ctas, Cfg::kThreads, kSmem, s>>>(p);
          }};
}

int run(int argc, char** argv) {
  const Args args = parse_args_or_exit(argc, argv);
  require_cuda_device_or_exit();
  cudaStream_t stream;
  FLARE_BENCH_CHECK(cudaStreamCreate(&stream));
  const std::vector<Variant> variants = {variant<64, 3>(), variant<64, 4>(), variant<32, 6>(), variant<32, 4>(),
                                         variant<16, 8>()};
  const std::vector<Shape> shapes = {{1, 1024, 8},   {1, 1024, 16},  {1, 4096, 16}, {1, 4096, 32},
                                     {1, 16384, 16}, {1, 16384, 32}, {1, 65536, 16}, {1, 65536, 32},
                                     {1, 65536, 64}, {8, 4096, 2},   {8, 4096, 4},  {8, 65536, 2},
                                     {8, 65536, 4}};
  Table table;
  for (const Shape& sh : shapes) {
    const int64_t cache_elems = int64_t{sh.batch} * sh.cache_len * kHeadsKv * kHeadDim;
    const int64_t q_elems = int64_t{sh.batch} * kHeadsQ * kHeadDim;
    T *q, *k, *v;
    float* partial;
    int32_t* seqlens;
    FLARE_BENCH_CHECK(cudaMalloc(&q, q_elems * sizeof(T)));
    FLARE_BENCH_CHECK(cudaMalloc(&k, cache_elems * sizeof(T)));
    FLARE_BENCH_CHECK(cudaMalloc(&v, cache_elems * sizeof(T)));
    FLARE_BENCH_CHECK(cudaMalloc(&partial, q_elems / kHeadDim * sh.num_splits * (kHeadDim + 1) * sizeof(float)));
    FLARE_BENCH_CHECK(cudaMalloc(&seqlens, sh.batch * sizeof(int32_t)));
    fill_normal_bf16(q, q_elems, 1, stream);
    fill_normal_bf16(k, cache_elems, 2, stream);
    fill_normal_bf16(v, cache_elems, 3, stream);
    std::vector<int32_t> lens(sh.batch, sh.cache_len);
    FLARE_BENCH_CHECK(cudaMemcpy(seqlens, lens.data(), lens.size() * sizeof(int32_t), cudaMemcpyHostToDevice));

    DecodeShapeKey key;
    key.batch = sh.batch, key.heads_q = kHeadsQ, key.heads_kv = kHeadsKv, key.head_dim = kHeadDim;
    key.max_cache_len = sh.cache_len;
    DecodePlan plan;
    if (!decode_plan_for_splits(key, sh.num_splits, &plan).ok()) return 1;

    decode::DecodeKernelParams p;
    p.q = q, p.k = k, p.v = v, p.cache_seqlens = seqlens;
    p.partial_out = partial;
    p.partial_lse = partial + q_elems * plan.num_splits;
    p.q_stride_b = p.q_stride_t = kHeadsQ * kHeadDim, p.q_stride_h = kHeadDim;
    p.k_stride_0 = p.v_stride_0 = int64_t{sh.cache_len} * kHeadsKv * kHeadDim;
    p.k_stride_tok = p.v_stride_tok = kHeadsKv * kHeadDim;
    p.k_stride_h = p.v_stride_h = kHeadDim;
    p.batch = sh.batch, p.q_len = 1, p.heads_q = kHeadsQ, p.heads_kv = kHeadsKv, p.group = kHeadsQ / kHeadsKv;
    p.rows = p.group, p.row_blocks = 1, p.max_cache_len = sh.cache_len;
    p.scale_log2 = 1.4426950408889634f / 11.313708498984761f;
    p.num_splits = plan.num_splits, p.kv_chunk = plan.kv_chunk, p.kv_align = plan.kv_align;

    const double kv_bytes = 2.0 * cache_elems * sizeof(T);
    for (const Variant& var : variants) {
      const Timing t = time_kernel([&](cudaStream_t s) { var.launch(p, s); },
                                   args.timing({.warmup = 5, .repeats = 30, .flush_l2 = true, .cuda_graph = true}),
                                   stream);
      table.add_row({{"batch", sh.batch}, {"cache", sh.cache_len}, {"splits", plan.num_splits},
                     {"tile", var.name}, {"us", Table::Cell(1e3 * t.median_ms, 2)},
                     {"KV GB/s", Table::Cell(gbps(kv_bytes, t.median_ms), 0)}});
    }
    for (void* ptr : {static_cast<void*>(q), static_cast<void*>(k), static_cast<void*>(v), static_cast<void*>(partial),
                      static_cast<void*>(seqlens)})
      FLARE_BENCH_CHECK(cudaFree(ptr));
  }
  table.print();
  return 0;
}

}  // namespace
}  // namespace flare::bench

int main(int argc, char** argv) { return flare::bench::run(argc, argv); }
