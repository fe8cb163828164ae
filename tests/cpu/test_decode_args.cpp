// Every argument rule of the decode op: each bad input gives an error naming the argument.
#include <gtest/gtest.h>

#include <cmath>
#include <initializer_list>
#include <string>

#include "reference/host_tensor.h"
#include "src/decode/decode_args.h"
#include "tests/common/status_checks.h"

namespace flare::detail {
namespace {

using ref::HostTensor;

void set_values(HostTensor& t, std::initializer_list<int> values) {
  int64_t i = 0;
  for (int x : values) t.set(i++, x);
}

// Two sequences, two new tokens each, 8 q heads over 2 kv heads, head dim 64.
struct Contiguous {
  HostTensor q{DType::kBFloat16, {2, 2, 8, 64}}, k{DType::kBFloat16, {2, 64, 2, 64}},
      v{DType::kBFloat16, {2, 64, 2, 64}}, seqlens{DType::kInt32, {2}}, out{DType::kBFloat16, {2, 2, 8, 64}},
      lse{DType::kFloat32, {2, 8, 2}};
  Contiguous() { set_values(seqlens, {10, 64}); }
  DecodeParams params() const {
    DecodeParams p;
    p.q = q;
    p.k_cache = k;
    p.v_cache = v;
    p.cache_seqlens = seqlens;
    p.out = out;
    p.lse = lse;
    return p;
  }
};

// The same problem over 8 pages of 16 tokens; sequence 0 uses 2 pages, sequence 1 all 4.
struct Paged {
  HostTensor q{DType::kFloat16, {2, 2, 8, 64}}, k{DType::kFloat16, {8, 16, 2, 64}},
      v{DType::kFloat16, {8, 16, 2, 64}}, page_table{DType::kInt32, {2, 4}}, seqlens{DType::kInt32, {2}},
      out{DType::kFloat16, {2, 2, 8, 64}};
  Paged() {
    set_values(page_table, {3, 1, -1, -1, 0, 2, 4, 7});  // unused entries may hold anything
    set_values(seqlens, {20, 64});
  }
  DecodeParams params() const {
    DecodeParams p;
    p.q = q;
    p.k_cache = k;
    p.v_cache = v;
    p.page_table = page_table;
    p.cache_seqlens = seqlens;
    p.out = out;
    return p;
  }
};

// Expects an InvalidArgument status whose message names `arg` (and contains `what` if given).
void expect_rejects(const DecodeParams& p, const std::string& arg, const std::string& what = "") {
  DecodeShape s;
  EXPECT_TRUE(test::rejects(validate_decode(p, DeviceKind::kCPU, &s), arg, what));
}

void expect_accepts(const DecodeParams& p) {
  DecodeShape s;
  Status st = validate_decode(p, DeviceKind::kCPU, &s);
  EXPECT_TRUE(st.ok()) << st.message();
}

TEST(DecodeArgs, ValidContiguousAndDerivedShape) {
  Contiguous f;
  DecodeShape s;
  Status st = validate_decode(f.params(), DeviceKind::kCPU, &s);
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(s.batch, 2);
  EXPECT_EQ(s.q_len, 2);
  EXPECT_EQ(s.heads_q, 8);
  EXPECT_EQ(s.heads_kv, 2);
  EXPECT_EQ(s.head_dim, 64);
  EXPECT_FALSE(s.paged);
  EXPECT_EQ(s.page_size, 0);
  EXPECT_EQ(s.num_pages, 0);
  EXPECT_EQ(s.max_pages_per_seq, 0);
  EXPECT_EQ(s.max_cache_len, 64);
  EXPECT_FLOAT_EQ(s.softmax_scale, 0.125f);
  auto p = f.params();
  p.softmax_scale = 0.5f;
  p.lse = TensorView{};  // optional
  ASSERT_TRUE(validate_decode(p, DeviceKind::kCPU, &s).ok());
  EXPECT_FLOAT_EQ(s.softmax_scale, 0.5f);
}

TEST(DecodeArgs, ValidPagedAndDerivedShape) {
  Paged f;
  DecodeShape s;
  Status st = validate_decode(f.params(), DeviceKind::kCPU, &s);
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(s.batch, 2);
  EXPECT_EQ(s.q_len, 2);
  EXPECT_EQ(s.heads_q, 8);
  EXPECT_EQ(s.heads_kv, 2);
  EXPECT_EQ(s.head_dim, 64);
  EXPECT_TRUE(s.paged);
  EXPECT_EQ(s.page_size, 16);
  EXPECT_EQ(s.num_pages, 8);
  EXPECT_EQ(s.max_pages_per_seq, 4);
  EXPECT_EQ(s.max_cache_len, 64);
  EXPECT_FLOAT_EQ(s.softmax_scale, 0.125f);
}

TEST(DecodeArgs, AllSupportedHeadDimsAndQueryLengths) {
  for (int d : {64, 128, 256}) {
    for (int len : {1, 8}) {
      HostTensor q{DType::kBFloat16, {1, len, 4, d}}, k{DType::kBFloat16, {1, 32, 4, d}},
          seqlens{DType::kInt32, {1}}, out{DType::kBFloat16, {1, len, 4, d}};
      seqlens.set(0, 32);
      DecodeParams p;
      p.q = q;
      p.k_cache = p.v_cache = k;
      p.cache_seqlens = seqlens;
      p.out = out;
      expect_accepts(p);
    }
  }
}

TEST(DecodeArgs, NullPointer) {
  Contiguous f;
  auto p = f.params();
  p.q.data = nullptr;
  expect_rejects(p, "q", "null");
  p = f.params();
  p.v_cache.data = nullptr;
  expect_rejects(p, "v_cache", "null");
  p = f.params();
  p.out = TensorView{};
  expect_rejects(p, "out", "null");
}

TEST(DecodeArgs, Dtypes) {
  Contiguous f;
  auto p = f.params();
  p.q.dtype = DType::kFloat32;
  expect_rejects(p, "q", "dtype");
  p = f.params();
  p.k_cache.dtype = DType::kFloat16;
  expect_rejects(p, "k_cache", "differs from q");
  p = f.params();
  p.v_cache.dtype = DType::kFloat16;
  expect_rejects(p, "v_cache", "differs from q");
  p = f.params();
  p.out.dtype = DType::kFloat16;
  expect_rejects(p, "out", "differs from q");
  p = f.params();
  p.lse.dtype = DType::kBFloat16;
  expect_rejects(p, "lse", "dtype");
}

TEST(DecodeArgs, QueryShape) {
  Contiguous f;
  auto p = f.params();
  p.q.rank = 3;
  expect_rejects(p, "q", "rank");
  for (int bad_len : {0, 9}) {
    p = f.params();
    p.q.shape[1] = p.out.shape[1] = bad_len;
    p.lse = TensorView{};
    expect_rejects(p, "q", "q_len");
  }
  p = f.params();
  p.q.shape[0] = p.out.shape[0] = 0;
  expect_rejects(p, "q", "batch");
}

TEST(DecodeArgs, HeadDim) {
  for (int d : {32, 96, 512}) {
    HostTensor q{DType::kBFloat16, {1, 1, 4, d}}, k{DType::kBFloat16, {1, 32, 4, d}}, seqlens{DType::kInt32, {1}},
        out{DType::kBFloat16, {1, 1, 4, d}};
    seqlens.set(0, 32);
    DecodeParams p;
    p.q = q;
    p.k_cache = p.v_cache = k;
    p.cache_seqlens = seqlens;
    p.out = out;
    expect_rejects(p, "q", "64, 128 or 256");
  }
  Contiguous f;
  auto p = f.params();
  p.k_cache.shape[3] = p.v_cache.shape[3] = 128;
  expect_rejects(p, "k_cache", "head dim");
}

TEST(DecodeArgs, CacheShapes) {
  Contiguous f;
  auto p = f.params();
  p.k_cache.rank = 3;
  expect_rejects(p, "k_cache", "rank");
  p = f.params();
  p.k_cache.shape[2] = p.v_cache.shape[2] = 3;
  expect_rejects(p, "k_cache", "divide");
  p = f.params();
  p.v_cache.shape[1] = 32;
  expect_rejects(p, "v_cache", "k_cache");
  p = f.params();
  p.k_cache.shape[0] = p.v_cache.shape[0] = 1;
  expect_rejects(p, "k_cache", "batch");
  p = f.params();
  p.k_cache.shape[1] = p.v_cache.shape[1] = 0;
  expect_rejects(p, "k_cache", "max_cache_len");
  p = f.params();
  p.out.shape[2] = 4;
  expect_rejects(p, "out", "shape");
}

TEST(DecodeArgs, PagedCaches) {
  Paged f;
  auto p = f.params();
  // Pages of 24 tokens: not a power of two.
  p.k_cache.shape[0] = p.v_cache.shape[0] = 4;
  p.k_cache.shape[1] = p.v_cache.shape[1] = 24;
  expect_rejects(p, "k_cache", "power of two");
  p.k_cache.shape[0] = p.v_cache.shape[0] = 16;
  p.k_cache.shape[1] = p.v_cache.shape[1] = 8;
  expect_rejects(p, "k_cache", ">= 16");
  p = f.params();
  p.k_cache.shape[0] = p.v_cache.shape[0] = 0;
  expect_rejects(p, "k_cache", "num_pages");
  p = f.params();
  p.v_cache.shape[0] = 4;
  expect_rejects(p, "v_cache", "k_cache");
  p = f.params();
  p.page_table.dtype = DType::kInt64;
  expect_rejects(p, "page_table", "dtype");
  p = f.params();
  p.page_table.rank = 1;
  expect_rejects(p, "page_table", "rank");
  p = f.params();
  p.page_table.shape[0] = 1;
  expect_rejects(p, "page_table", "batch");
  p = f.params();
  p.page_table.shape[1] = 0;
  expect_rejects(p, "page_table", "max_pages_per_seq");
  p = f.params();
  p.page_table.stride[1] = 2;
  p.page_table.shape[1] = 2;
  expect_rejects(p, "page_table", "contiguous");
  p = f.params();
  p.page_table.data = static_cast<char*>(p.page_table.data) + 2;
  expect_rejects(p, "page_table", "aligned");
}

TEST(DecodeArgs, CacheSeqlens) {
  Contiguous f;
  auto p = f.params();
  p.cache_seqlens = TensorView{};
  expect_rejects(p, "cache_seqlens", "null");
  p = f.params();
  p.cache_seqlens.dtype = DType::kInt64;
  expect_rejects(p, "cache_seqlens", "dtype");
  p = f.params();
  p.cache_seqlens.shape[0] = 3;
  expect_rejects(p, "cache_seqlens", "shape");
  p = f.params();
  p.cache_seqlens.rank = 2;
  p.cache_seqlens.shape[1] = 1;
  p.cache_seqlens.stride[1] = 1;
  expect_rejects(p, "cache_seqlens", "rank");
}

TEST(DecodeArgs, Lse) {
  Contiguous f;
  auto p = f.params();
  p.lse.shape[2] = 1;
  expect_rejects(p, "lse", "shape");
  p = f.params();
  p.lse.data = nullptr;
  expect_rejects(p, "lse", "null");
  p = f.params();
  HostTensor lse_t{DType::kFloat32, {2, 2, 8}};  // [batch, q_len, heads_q] transposed to the right shape
  p.lse = lse_t;
  p.lse.shape[1] = 8;
  p.lse.shape[2] = 2;
  p.lse.stride[1] = 1;
  p.lse.stride[2] = 8;
  expect_rejects(p, "lse", "contiguous");
}

TEST(DecodeArgs, StridesAlignmentAndOverflow) {
  Contiguous f;
  auto p = f.params();
  p.q.stride[3] = 2;
  expect_rejects(p, "q", "contiguous");
  p = f.params();
  p.k_cache.data = static_cast<char*>(p.k_cache.data) + 2;
  expect_rejects(p, "k_cache", "16-byte");
  p = f.params();
  p.v_cache.stride[2] = 64 + 4;  // heads 8 bytes off a 16-byte multiple
  expect_rejects(p, "v_cache", "16 bytes");
  p = f.params();
  p.out.stride[0] = -1;
  expect_rejects(p, "out", "negative");
  p = f.params();
  p.k_cache.shape[1] = p.v_cache.shape[1] = int64_t{1} << 33;
  expect_rejects(p, "k_cache", "overflow");
  p = f.params();
  p.k_cache.stride[0] = int64_t{1} << 62;
  expect_rejects(p, "k_cache", "overflow");
  p = f.params();
  // 2^16 sequences x 8 tokens x 2^13 heads: each dim fits int32, the row count does not.
  p.q.shape[0] = p.out.shape[0] = int64_t{1} << 16;
  p.q.shape[1] = p.out.shape[1] = 8;
  p.q.shape[2] = p.out.shape[2] = int64_t{1} << 13;
  p.q.stride[2] = p.out.stride[2] = 64;
  p.q.stride[1] = p.out.stride[1] = (int64_t{1} << 13) * 64;
  p.q.stride[0] = p.out.stride[0] = 8 * (int64_t{1} << 13) * 64;
  expect_rejects(p, "q", "32-bit");
}

TEST(DecodeArgs, Scalars) {
  Contiguous f;
  auto p = f.params();
  for (float bad : {-1.f, std::nanf(""), INFINITY}) {
    p.softmax_scale = bad;
    expect_rejects(p, "softmax_scale", "finite and >= 0");
  }
  p = f.params();
  p.window_left = -2;
  expect_rejects(p, "window_left", ">= -1");
  p.window_left = 0;
  expect_accepts(p);
}

TEST(DecodeArgs, Device) {
  Contiguous f;
  auto p = f.params();
  DecodeShape s;
  Status st = validate_decode(p, DeviceKind::kCUDA, &s);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("'q'"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("CUDA"), std::string::npos) << st.message();
  p.cache_seqlens.device.kind = DeviceKind::kCUDA;
  expect_rejects(p, "cache_seqlens", "CPU");
}

TEST(DecodeArgs, SeqlenValues) {
  Contiguous f;
  set_values(f.seqlens, {-1, 64});
  expect_rejects(f.params(), "cache_seqlens", "negative");
  set_values(f.seqlens, {10, 65});
  expect_rejects(f.params(), "cache_seqlens", "capacity 64");
  set_values(f.seqlens, {1, 64});
  expect_rejects(f.params(), "cache_seqlens", "< q_len");
  auto p = f.params();
  p.causal = false;
  expect_accepts(p);  // without causal a sequence may hold fewer keys than new queries
  set_values(f.seqlens, {0, 0});
  expect_accepts(p);
}

TEST(DecodeArgs, PagedValues) {
  Paged f;
  set_values(f.seqlens, {20, 65});
  expect_rejects(f.params(), "cache_seqlens", "max_pages_per_seq 4 x page_size 16");
  set_values(f.seqlens, {33, 64});  // sequence 0 now needs its third page, which holds -1
  expect_rejects(f.params(), "page_table", "page_table[0][2] = -1");
  set_values(f.seqlens, {20, 64});
  set_values(f.page_table, {3, 1, -1, -1, 0, 2, 4, 8});
  expect_rejects(f.params(), "page_table", "num_pages = 8");
  set_values(f.page_table, {3, 1, -1, -1, 0, 2, 4, 7});
  expect_accepts(f.params());
  // A strided (column-sliced) page table is read through its strides.
  HostTensor wide{DType::kInt32, {2, 8}};
  set_values(wide, {3, 1, 9, 9, 9, 9, 9, 9, 0, 2, 4, 7, 9, 9, 9, 9});
  auto p = f.params();
  p.page_table = wide;
  p.page_table.shape[1] = 4;
  expect_accepts(p);
  set_values(f.seqlens, {33, 64});
  expect_rejects(p, "page_table", "page_table[0][2] = 9");
}

TEST(DecodeArgs, DeviceValuesAreNotRead) {
  Paged f;
  set_values(f.seqlens, {-5, 1000});
  set_values(f.page_table, {-1, -1, -1, -1, 99, 99, 99, 99});
  auto p = f.params();
  for (TensorView* t : {&p.q, &p.k_cache, &p.v_cache, &p.page_table, &p.cache_seqlens, &p.out})
    t->device.kind = DeviceKind::kCUDA;
  DecodeShape s;
  Status st = validate_decode(p, DeviceKind::kCUDA, &s);
  EXPECT_TRUE(st.ok()) << st.message();
  EXPECT_TRUE(s.paged);
}

}  // namespace
}  // namespace flare::detail
