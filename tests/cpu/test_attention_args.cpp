// Every argument rule of the attention ops: each bad input gives an error naming the argument.
#include <gtest/gtest.h>

#include <functional>

#include "reference/host_tensor.h"
#include "src/attention/attention_args.h"
#include "tests/common/status_checks.h"

namespace flare::detail {
namespace {

using ref::HostTensor;

struct Fixture {
  HostTensor q{DType::kBFloat16, {2, 16, 8, 64}}, k{DType::kBFloat16, {2, 24, 2, 64}},
      v{DType::kBFloat16, {2, 24, 2, 64}}, out{DType::kBFloat16, {2, 16, 8, 64}}, lse{DType::kFloat32, {2, 8, 16}},
      sinks{DType::kFloat32, {8}};
  AttentionForwardParams params() const {
    AttentionForwardParams p;
    p.q = q;
    p.k = k;
    p.v = v;
    p.out = out;
    p.lse = lse;
    return p;
  }
};

// Expects an InvalidArgument status whose message names `arg` (and contains `what` if given).
void expect_rejects(const AttentionForwardParams& p, const std::string& arg, const std::string& what = "") {
  AttentionShape s;
  EXPECT_TRUE(test::rejects(validate_attention_forward(p, DeviceKind::kCPU, &s), arg, what));
}

TEST(AttentionArgs, ValidInputsAndDerivedShape) {
  Fixture f;
  AttentionShape s;
  ASSERT_TRUE(validate_attention_forward(f.params(), DeviceKind::kCPU, &s).ok());
  EXPECT_EQ(s.batch, 2);
  EXPECT_EQ(s.heads, 8);
  EXPECT_EQ(s.heads_kv, 2);
  EXPECT_EQ(s.seqlen_q, 16);
  EXPECT_EQ(s.seqlen_k, 24);
  EXPECT_FLOAT_EQ(s.softmax_scale, 0.125f);
}

TEST(AttentionArgs, NullPointer) {
  Fixture f;
  auto p = f.params();
  p.k.data = nullptr;
  expect_rejects(p, "k", "null");
}

TEST(AttentionArgs, Dtype) {
  Fixture f;
  auto p = f.params();
  p.q.dtype = DType::kFloat32;
  expect_rejects(p, "q", "dtype");
  p = f.params();
  p.v.dtype = DType::kFloat16;
  expect_rejects(p, "v", "differs");
  p = f.params();
  p.lse.dtype = DType::kBFloat16;
  expect_rejects(p, "lse", "dtype");
}

TEST(AttentionArgs, RankAndShapes) {
  Fixture f;
  auto p = f.params();
  p.q.rank = 3;
  expect_rejects(p, "q", "rank");
  p = f.params();
  p.out.shape[1] = 15;
  expect_rejects(p, "out", "shape");
  p = f.params();
  p.k.shape[0] = 1;
  p.v.shape[0] = 1;
  expect_rejects(p, "k", "batch");
  p = f.params();
  p.v.shape[1] = 23;
  expect_rejects(p, "v", "shape");
  p = f.params();
  p.lse.shape[2] = 17;
  expect_rejects(p, "lse", "shape");
}

TEST(AttentionArgs, HeadDimAndHeads) {
  Fixture f;
  auto p = f.params();
  p.q.shape[3] = p.k.shape[3] = p.v.shape[3] = p.out.shape[3] = 264;
  expect_rejects(p, "q", "head dim");
  p.q.shape[3] = p.k.shape[3] = p.v.shape[3] = p.out.shape[3] = 60;
  expect_rejects(p, "q", "multiple of 8");
  p = f.params();
  p.k.shape[3] = 32;
  expect_rejects(p, "k", "head dim");
  p = f.params();
  p.k.shape[2] = p.v.shape[2] = 3;
  expect_rejects(p, "k", "divide");
}

TEST(AttentionArgs, StridesAndAlignment) {
  Fixture f;
  auto p = f.params();
  p.q.stride[3] = 2;
  expect_rejects(p, "q", "contiguous");
  p = f.params();
  p.k.data = static_cast<char*>(p.k.data) + 2;
  expect_rejects(p, "k", "16-byte");
  p = f.params();
  p.v.stride[1] = 2 * 64 + 4;  // rows 8 bytes off a 16-byte multiple
  expect_rejects(p, "v", "16 bytes");
  p = f.params();
  p.q.stride[0] = -1;
  expect_rejects(p, "q", "negative");
}

TEST(AttentionArgs, SizesThatOverflow) {
  Fixture f;
  auto p = f.params();
  p.q.shape[1] = p.out.shape[1] = int64_t{1} << 33;
  expect_rejects(p, "q", "overflow");
  p = f.params();
  p.q.stride[0] = int64_t{1} << 62;
  expect_rejects(p, "q", "overflow");
  p = f.params();
  // 2^20 tokens x 4096 heads: each dim fits int32, the row count does not.
  p.q.shape[0] = p.out.shape[0] = 1;
  p.k.shape[0] = p.v.shape[0] = 1;
  p.q.shape[1] = p.out.shape[1] = 1 << 20;
  p.q.shape[2] = p.out.shape[2] = 4096;
  p.q.stride[2] = p.out.stride[2] = 64;
  p.q.stride[1] = p.out.stride[1] = 4096 * 64;
  p.lse = TensorView{};
  expect_rejects(p, "q", "32-bit");
}

TEST(AttentionArgs, Varlen) {
  HostTensor q{DType::kFloat16, {10, 4, 64}}, k{DType::kFloat16, {12, 4, 64}}, out{DType::kFloat16, {10, 4, 64}};
  HostTensor cq{DType::kInt32, {3}}, ck{DType::kInt32, {3}};
  auto set = [](HostTensor& t, std::initializer_list<int> v) {
    int i = 0;
    for (int x : v) t.set(i++, x);
  };
  set(cq, {0, 4, 10});
  set(ck, {0, 5, 12});
  AttentionForwardParams p;
  p.q = q;
  p.k = k;
  p.v = k;
  p.out = out;
  p.cu_seqlens_q = cq;
  p.cu_seqlens_k = ck;
  p.max_seqlen_q = 6;
  p.max_seqlen_k = 7;
  AttentionShape s;
  ASSERT_TRUE(validate_attention_forward(p, DeviceKind::kCPU, &s).ok());
  EXPECT_TRUE(s.varlen);
  EXPECT_EQ(s.batch, 2);
  auto bad = p;
  bad.cu_seqlens_k = TensorView{};
  expect_rejects(bad, "cu_seqlens_k", "together");
  bad = p;
  bad.max_seqlen_q = 0;
  expect_rejects(bad, "max_seqlen_q");
  bad = p;
  bad.max_seqlen_q = 5;
  expect_rejects(bad, "cu_seqlens_q", "max_seqlen");
  set(cq, {0, 7, 4});
  bad = p;
  bad.max_seqlen_q = 10;
  expect_rejects(bad, "cu_seqlens_q", "non-decreasing");
  set(cq, {1, 4, 10});
  expect_rejects(p, "cu_seqlens_q", "start at 0");
  set(cq, {0, 4, 11});
  bad = p;
  bad.max_seqlen_q = 7;
  expect_rejects(bad, "cu_seqlens_q", "exceeds");
  set(cq, {0, 4, 10});
  bad = p;
  bad.cu_seqlens_q.dtype = DType::kInt64;
  expect_rejects(bad, "cu_seqlens_q", "dtype");
  HostTensor lse{DType::kFloat32, {4, 10}}, lse_bad{DType::kFloat32, {2, 4, 5}};
  bad = p;
  bad.lse = lse;
  AttentionShape s2;
  EXPECT_TRUE(validate_attention_forward(bad, DeviceKind::kCPU, &s2).ok());
  bad.lse = lse_bad;
  expect_rejects(bad, "lse", "shape");
}

TEST(AttentionArgs, ScalarsMasksSinks) {
  Fixture f;
  auto p = f.params();
  p.softmax_scale = -1.f;
  expect_rejects(p, "softmax_scale");
  p.softmax_scale = std::nanf("");
  expect_rejects(p, "softmax_scale");
  p = f.params();
  p.softcap = -2.f;
  expect_rejects(p, "softcap");
  p = f.params();
  p.mask.window_left = -5;
  expect_rejects(p, "mask.window_left");
  p = f.params();
  p.mask.causal = true;
  p.mask.window_right = 4;
  expect_rejects(p, "mask.window_right", "causal");
  p = f.params();
  HostTensor short_sinks{DType::kFloat32, {4}};
  p.sinks = short_sinks;
  expect_rejects(p, "sinks", "shape");
  p.sinks = f.sinks;
  AttentionShape s;
  EXPECT_TRUE(validate_attention_forward(p, DeviceKind::kCPU, &s).ok());
}

TEST(AttentionArgs, Device) {
  Fixture f;
  auto p = f.params();
  AttentionShape s;
  Status st = validate_attention_forward(p, DeviceKind::kCUDA, &s);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("'q'"), std::string::npos);
  EXPECT_NE(st.message().find("CUDA"), std::string::npos);
}

TEST(AttentionArgs, Backward) {
  Fixture f;
  HostTensor dq{DType::kBFloat16, {2, 16, 8, 64}}, dk{DType::kBFloat16, {2, 24, 2, 64}},
      dv{DType::kBFloat16, {2, 24, 2, 64}}, dsinks{DType::kFloat32, {8}};
  AttentionBackwardParams p;
  p.q = f.q;
  p.k = f.k;
  p.v = f.v;
  p.out = f.out;
  p.dout = f.out;
  p.lse = f.lse;
  p.dq = dq;
  p.dk = dk;
  p.dv = dv;
  AttentionShape s;
  ASSERT_TRUE(validate_attention_backward(p, DeviceKind::kCPU, &s).ok());
  auto expect = [&](AttentionBackwardParams b, const std::string& arg) {
    Status st = validate_attention_backward(b, DeviceKind::kCPU, &s);
    ASSERT_FALSE(st.ok()) << arg;
    EXPECT_NE(st.message().find("'" + arg + "'"), std::string::npos) << st.message();
  };
  auto b = p;
  b.lse = TensorView{};
  expect(b, "lse");
  b = p;
  b.dk = dq;
  expect(b, "dk");
  b = p;
  b.dout.data = nullptr;
  expect(b, "dout");
  b = p;
  b.sinks = f.sinks;
  expect(b, "dsinks");
  b.dsinks = dsinks;
  EXPECT_TRUE(validate_attention_backward(b, DeviceKind::kCPU, &s).ok());
  b = p;
  b.workspace_bytes = 64;
  expect(b, "workspace");
}

}  // namespace
}  // namespace flare::detail
