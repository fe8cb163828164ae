// Every argument rule of the KDA / GDN ops: each bad input gives an error naming the argument.
#include <gtest/gtest.h>

#include <cmath>
#include <initializer_list>
#include <string>
#include <vector>

#include "reference/host_tensor.h"
#include "src/kda/kda_args.h"
#include "src/kda/kda_prep_order.h"
#include "src/kda/kda_state_segments.h"
#include "tests/common/status_checks.h"

namespace flare::detail {
namespace {

using ref::HostTensor;

void set_values(HostTensor& t, std::initializer_list<int> values) {
  int64_t i = 0;
  for (int x : values) t.set(i++, x);
}

// B = 2, T = 12, H = 2 q/k heads, HV = 4 value heads, K = 64, V = 32. beta is bf16 [B, T, 4]: its
// 8-byte rows are fine for a per-(token, head) scalar, unlike q's rows.
struct Fixture {
  HostTensor q{DType::kBFloat16, {2, 12, 2, 64}}, k{DType::kBFloat16, {2, 12, 2, 64}},
      v{DType::kBFloat16, {2, 12, 4, 32}}, g{DType::kFloat32, {2, 12, 4, 64}}, g_gdn{DType::kFloat32, {2, 12, 4}},
      beta{DType::kBFloat16, {2, 12, 4}}, A_log{DType::kFloat32, {4}}, dt_bias{DType::kFloat32, {4 * 64}},
      dt_bias_gdn{DType::kFloat32, {4}}, h0{DType::kFloat32, {2, 4, 64, 32}}, out{DType::kBFloat16, {2, 12, 4, 32}},
      hT{DType::kFloat32, {2, 4, 64, 32}};
  KdaForwardParams params() const {
    KdaForwardParams p;
    p.q = q;
    p.k = k;
    p.v = v;
    p.g = g;
    p.beta = beta;
    p.initial_state = h0;
    p.out = out;
    p.final_state = hT;
    return p;
  }
};

// Expects an InvalidArgument status whose message names `arg` (and contains `what` if given).
void expect_rejects(const KdaForwardParams& p, const std::string& arg, const std::string& what = "") {
  KdaShape s;
  EXPECT_TRUE(test::rejects(validate_kda_forward(p, DeviceKind::kCPU, &s), arg, what));
}

void expect_accepts(const KdaForwardParams& p) {
  KdaShape s;
  Status st = validate_kda_forward(p, DeviceKind::kCPU, &s);
  EXPECT_TRUE(st.ok()) << st.message();
}

TEST(KdaArgs, ValidInputsAndDerivedShape) {
  Fixture f;
  KdaShape s;
  Status st = validate_kda_forward(f.params(), DeviceKind::kCPU, &s);
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(s.batch, 2);
  EXPECT_EQ(s.seqlen, 12);
  EXPECT_EQ(s.num_seqs, 2);
  EXPECT_EQ(s.heads, 2);
  EXPECT_EQ(s.heads_v, 4);
  EXPECT_EQ(s.key_dim, 64);
  EXPECT_EQ(s.value_dim, 32);
  EXPECT_FALSE(s.varlen);
  EXPECT_FALSE(s.scalar_gate);
  EXPECT_FLOAT_EQ(s.scale, 0.125f);
  auto p = f.params();
  p.options.scale = 0.5f;
  p.initial_state = p.final_state = TensorView{};  // optional
  ASSERT_TRUE(validate_kda_forward(p, DeviceKind::kCPU, &s).ok());
  EXPECT_FLOAT_EQ(s.scale, 0.5f);
}

TEST(KdaArgs, GdnScalarGate) {
  Fixture f;
  auto p = f.params();
  p.g = f.g_gdn;
  KdaShape s;
  Status st = validate_kda_forward(p, DeviceKind::kCPU, &s);
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_TRUE(s.scalar_gate);
  EXPECT_EQ(s.heads_v, 4);
}

TEST(KdaArgs, SupportedHeadDims) {
  for (int kdim : {16, 64, 128, 256}) {
    HostTensor q{DType::kFloat16, {1, 3, 1, kdim}}, v{DType::kFloat16, {1, 3, 1, 256}},
        g{DType::kFloat16, {1, 3, 1, kdim}}, beta{DType::kFloat32, {1, 3, 1}}, out{DType::kFloat16, {1, 3, 1, 256}};
    KdaForwardParams p;
    p.q = p.k = q;
    p.v = v;
    p.g = g;  // a gate in q's dtype
    p.beta = beta;
    p.out = out;
    expect_accepts(p);
  }
}

TEST(KdaArgs, NullPointers) {
  Fixture f;
  for (auto [field, name] : {std::pair{&KdaForwardParams::q, "q"}, {&KdaForwardParams::k, "k"},
                             {&KdaForwardParams::v, "v"}, {&KdaForwardParams::g, "g"},
                             {&KdaForwardParams::beta, "beta"}, {&KdaForwardParams::out, "out"}}) {
    auto p = f.params();
    (p.*field).data = nullptr;
    expect_rejects(p, name, "null");
    p.*field = TensorView{};
    expect_rejects(p, name);
  }
}

TEST(KdaArgs, Dtypes) {
  Fixture f;
  auto p = f.params();
  p.q.dtype = p.k.dtype = DType::kFloat32;
  expect_rejects(p, "q", "dtype");
  p = f.params();
  p.k.dtype = DType::kFloat16;
  expect_rejects(p, "k", "differs from q");
  p = f.params();
  p.v.dtype = DType::kFloat16;
  expect_rejects(p, "v", "differs from q");
  p = f.params();
  p.g.dtype = DType::kFloat16;  // neither fp32 nor q's bf16
  expect_rejects(p, "g", "float32 or bfloat16");
  p.g.dtype = DType::kBFloat16;
  expect_accepts(p);
  p = f.params();
  p.beta.dtype = DType::kFloat16;
  expect_rejects(p, "beta", "float32 or bfloat16");
  p = f.params();
  p.out.dtype = DType::kFloat16;
  expect_rejects(p, "out", "differs from q");
}

TEST(KdaArgs, FloatBetaAccepted) {
  Fixture f;
  HostTensor beta32{DType::kFloat32, {2, 12, 4}};
  auto p = f.params();
  p.beta = beta32;
  expect_accepts(p);
}

TEST(KdaArgs, Shapes) {
  Fixture f;
  auto p = f.params();
  p.q.rank = 3;
  expect_rejects(p, "q", "rank");
  p = f.params();
  p.k.shape[1] = 11;
  expect_rejects(p, "k", "shape");
  p = f.params();
  p.v.shape[1] = 11;
  expect_rejects(p, "v", "T = 12");
  p = f.params();
  p.v.shape[0] = 1;
  expect_rejects(p, "v", "B = 2");
  p = f.params();
  p.v.shape[2] = p.out.shape[2] = 3;
  expect_rejects(p, "v", "multiple");
  p = f.params();
  p.g.rank = 2;
  expect_rejects(p, "g", "(GDN)");
  p = f.params();
  p.g.shape[3] = 32;
  expect_rejects(p, "g", "shape");
  p = f.params();
  p.g = f.g_gdn;
  p.g.shape[2] = 2;
  expect_rejects(p, "g", "shape");
  p = f.params();
  p.beta.shape[2] = 2;
  expect_rejects(p, "beta", "shape");
  p = f.params();
  p.beta.rank = 4;
  p.beta.shape[3] = 1;
  p.beta.stride[3] = 1;
  expect_rejects(p, "beta", "rank");
  p = f.params();
  p.out.shape[3] = 64;
  expect_rejects(p, "out", "shape");
  p = f.params();
  p.q.shape[0] = p.k.shape[0] = 0;
  expect_rejects(p, "q", "batch");
}

TEST(KdaArgs, HeadDims) {
  Fixture f;
  auto p = f.params();
  // Only the dims change; rejected before any other shape is compared.
  for (int bad : {0, 8, 72, 272}) {
    p.q.shape[3] = bad;
    expect_rejects(p, "q", "multiple of 16 in [16, 256]");
  }
  p = f.params();
  for (int bad : {40, 512}) {
    p.v.shape[3] = bad;
    expect_rejects(p, "v", "multiple of 16 in [16, 256]");
  }
}

TEST(KdaArgs, States) {
  Fixture f;
  for (auto [field, name] : {std::pair{&KdaForwardParams::initial_state, "initial_state"},
                             {&KdaForwardParams::final_state, "final_state"}}) {
    auto p = f.params();
    (p.*field).dtype = DType::kBFloat16;
    expect_rejects(p, name, "dtype");
    p = f.params();
    (p.*field).shape[0] = 1;
    expect_rejects(p, name, "shape");
    p = f.params();
    (p.*field).shape[2] = 32;
    expect_rejects(p, name, "shape");
    p = f.params();
    // Heads and sequences swapped in memory: last dim contiguous, 16-byte rows, yet not dense.
    (p.*field).stride[0] = 64 * 32;
    (p.*field).stride[1] = 2 * 64 * 32;
    expect_rejects(p, name, "contiguous");
  }
}

TEST(KdaArgs, StridesAlignmentAndOverflow) {
  Fixture f;
  auto p = f.params();
  p.q.stride[3] = 2;
  expect_rejects(p, "q", "contiguous");
  p = f.params();
  p.k.data = static_cast<char*>(p.k.data) + 2;
  expect_rejects(p, "k", "16-byte");
  p = f.params();
  p.g.stride[2] = 64 + 2;  // rows 8 bytes off a 16-byte multiple
  expect_rejects(p, "g", "16 bytes");
  p = f.params();
  p.beta.data = static_cast<char*>(p.beta.data) + 1;
  expect_rejects(p, "beta", "aligned");
  p = f.params();
  p.beta.stride[2] = 2;
  p.beta.shape[2] = 2;
  expect_rejects(p, "beta", "contiguous");
  p = f.params();
  p.v.stride[0] = -1;
  expect_rejects(p, "v", "negative");
  p = f.params();
  p.q.shape[1] = p.k.shape[1] = int64_t{1} << 33;
  expect_rejects(p, "q", "overflow");
  p = f.params();
  p.out.stride[0] = int64_t{1} << 62;
  expect_rejects(p, "out", "overflow");
  p = f.params();
  // 2^24 tokens x 256 value heads: each dim fits int32, the row count does not.
  for (TensorView* t : {&p.q, &p.k}) {
    t->shape[0] = 1;
    t->shape[1] = int64_t{1} << 24;
    t->stride[1] = 2 * 64;
  }
  p.v.shape[0] = 1;
  p.v.shape[1] = int64_t{1} << 24;
  p.v.shape[2] = 256;
  p.v.stride[2] = 32;
  p.v.stride[1] = 256 * 32;
  expect_rejects(p, "v", "32-bit");
}

TEST(KdaArgs, Device) {
  Fixture f;
  auto p = f.params();
  KdaShape s;
  Status st = validate_kda_forward(p, DeviceKind::kCUDA, &s);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("'q'"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("CUDA"), std::string::npos) << st.message();
  p.beta.device.kind = DeviceKind::kCUDA;
  expect_rejects(p, "beta", "CPU");
}

TEST(KdaArgs, Scale) {
  Fixture f;
  auto p = f.params();
  for (float bad : {-1.f, std::nanf(""), INFINITY}) {
    p.options.scale = bad;
    expect_rejects(p, "options.scale", "finite and >= 0");
  }
}

TEST(KdaArgs, GateOptions) {
  Fixture f;
  auto p = f.params();
  for (float bad : {0.5f, std::nanf(""), -INFINITY}) {
    p.options.lower_bound = bad;
    expect_rejects(p, "options.lower_bound", "<= 0");
  }
  // Any negative bound is allowed, with or without the in-kernel gate, with or without A_log.
  for (float lb : {-0.1f, -5.f, -100.f}) {
    p = f.params();
    p.options.lower_bound = lb;
    expect_accepts(p);
    p.options.gate_in_kernel = true;
    expect_accepts(p);
    p.A_log = f.A_log;
    p.dt_bias = f.dt_bias;
    expect_accepts(p);
  }

  p = f.params();
  p.options.gate_in_kernel = true;
  expect_rejects(p, "A_log", "unless options.lower_bound");
  p.A_log = f.A_log;
  expect_accepts(p);
  p.dt_bias = f.dt_bias;
  expect_accepts(p);

  auto bad = p;
  bad.A_log.dtype = DType::kBFloat16;
  expect_rejects(bad, "A_log", "dtype");
  bad = p;
  bad.A_log.shape[0] = 2;
  expect_rejects(bad, "A_log", "shape");
  bad = p;
  bad.options.gate_in_kernel = false;
  expect_rejects(bad, "A_log", "gate_in_kernel");
  bad.A_log = TensorView{};
  expect_rejects(bad, "dt_bias", "gate_in_kernel");
  bad = p;
  bad.dt_bias = f.dt_bias_gdn;  // [HV] with a per-channel gate
  expect_rejects(bad, "dt_bias", "shape");
  bad = p;
  bad.dt_bias.dtype = DType::kFloat16;
  expect_rejects(bad, "dt_bias", "dtype");

  // GDN: dt_bias is one value per head.
  p.g = f.g_gdn;
  p.dt_bias = f.dt_bias_gdn;
  expect_accepts(p);
  p.dt_bias = f.dt_bias;
  expect_rejects(p, "dt_bias", "shape");
}

TEST(KdaArgs, BetaOptions) {
  Fixture f;
  auto p = f.params();
  p.options.allow_neg_eigval = true;
  expect_rejects(p, "options.allow_neg_eigval", "beta_sigmoid");
  p.options.beta_sigmoid = true;
  expect_accepts(p);
  p.options.allow_neg_eigval = false;
  p.options.qk_l2norm = true;
  expect_accepts(p);
}

// B = 1, two sequences of 4 and 6 tokens packed along T = 10.
struct Varlen {
  HostTensor q{DType::kBFloat16, {1, 10, 2, 64}}, v{DType::kBFloat16, {1, 10, 2, 64}},
      g{DType::kFloat32, {1, 10, 2}}, beta{DType::kFloat32, {1, 10, 2}}, cu{DType::kInt32, {3}},
      cu64{DType::kInt64, {3}}, h0{DType::kFloat32, {2, 2, 64, 64}};
  Varlen() {
    set_values(cu, {0, 4, 10});
    set_values(cu64, {0, 4, 10});
  }
  KdaForwardParams params() const {
    KdaForwardParams p;
    p.q = p.k = q;
    p.v = p.out = v;
    p.g = g;
    p.beta = beta;
    p.cu_seqlens = cu;
    p.initial_state = p.final_state = h0;
    return p;
  }
};

TEST(KdaArgs, VarlenValidAndDerivedShape) {
  Varlen f;
  KdaShape s;
  Status st = validate_kda_forward(f.params(), DeviceKind::kCPU, &s);
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_TRUE(s.varlen);
  EXPECT_TRUE(s.scalar_gate);
  EXPECT_EQ(s.batch, 1);
  EXPECT_EQ(s.seqlen, 10);
  EXPECT_EQ(s.num_seqs, 2);
  auto p = f.params();
  p.cu_seqlens = f.cu64;
  expect_accepts(p);
  set_values(f.cu, {0, 0, 10});  // an empty sequence is fine
  expect_accepts(f.params());
}

TEST(KdaArgs, VarlenRules) {
  Varlen f;
  auto p = f.params();
  p.cu_seqlens.dtype = DType::kFloat32;
  expect_rejects(p, "cu_seqlens", "dtype");
  p = f.params();
  p.cu_seqlens.rank = 2;
  p.cu_seqlens.shape[1] = 1;
  p.cu_seqlens.stride[1] = 1;
  expect_rejects(p, "cu_seqlens", "rank");
  p = f.params();
  p.cu_seqlens.shape[0] = 1;
  expect_rejects(p, "cu_seqlens", "N >= 1");
  p = f.params();
  p.cu_seqlens.device.kind = DeviceKind::kCUDA;
  expect_rejects(p, "cu_seqlens", "CPU");
  p = f.params();
  p.cu_seqlens.data = static_cast<char*>(p.cu_seqlens.data) + 2;
  expect_rejects(p, "cu_seqlens", "aligned");
  // The states are [N, HV, K, V] with N sequences, not B.
  HostTensor h0_batch{DType::kFloat32, {1, 2, 64, 64}};
  p = f.params();
  p.initial_state = h0_batch;
  expect_rejects(p, "initial_state", "shape");

  Fixture batched;  // B = 2
  HostTensor cu{DType::kInt32, {2}};
  set_values(cu, {0, 12});
  auto b = batched.params();
  b.cu_seqlens = cu;
  b.initial_state = b.final_state = TensorView{};
  expect_rejects(b, "cu_seqlens", "B == 1");
}

TEST(KdaArgs, VarlenValues) {
  Varlen f;
  set_values(f.cu, {1, 4, 10});
  expect_rejects(f.params(), "cu_seqlens", "start at 0");
  set_values(f.cu, {0, 7, 4});
  expect_rejects(f.params(), "cu_seqlens", "non-decreasing");
  set_values(f.cu, {0, 4, 9});
  expect_rejects(f.params(), "cu_seqlens", "end at T = 10");
  set_values(f.cu, {0, 4, 11});
  expect_rejects(f.params(), "cu_seqlens", "end at T = 10");
  set_values(f.cu64, {0, 4, 9});
  auto p = f.params();
  p.cu_seqlens = f.cu64;
  expect_rejects(p, "cu_seqlens", "ends at 9");
}

TEST(KdaArgs, DeviceValuesAreNotRead) {
  Varlen f;
  set_values(f.cu, {5, 1, 99});
  auto p = f.params();
  for (TensorView* t : {&p.q, &p.k, &p.v, &p.g, &p.beta, &p.cu_seqlens, &p.initial_state, &p.out, &p.final_state})
    t->device.kind = DeviceKind::kCUDA;
  KdaShape s;
  Status st = validate_kda_forward(p, DeviceKind::kCUDA, &s);
  EXPECT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(s.num_seqs, 2);
}

// ---------------------------------------------------------------------------------------------
// Backward

struct Backward : Fixture {
  HostTensor dq{DType::kBFloat16, {2, 12, 2, 64}}, dk{DType::kBFloat16, {2, 12, 2, 64}},
      dv{DType::kBFloat16, {2, 12, 4, 32}}, dg{DType::kFloat32, {2, 12, 4, 64}}, dbeta{DType::kFloat32, {2, 12, 4}},
      dh0{DType::kFloat32, {2, 4, 64, 32}}, dA_log{DType::kFloat32, {4}}, ddt_bias{DType::kFloat32, {4 * 64}};
  KdaBackwardParams backward() const {
    KdaBackwardParams p;
    p.q = q;
    p.k = k;
    p.v = v;
    p.g = g;
    p.beta = beta;
    p.initial_state = h0;
    p.dout = out;
    p.d_final_state = hT;
    p.dq = dq;
    p.dk = dk;
    p.dv = dv;
    p.dg = dg;
    p.dbeta = dbeta;
    p.d_initial_state = dh0;
    return p;
  }
};

void expect_rejects(const KdaBackwardParams& p, const std::string& arg, const std::string& what = "") {
  KdaShape s;
  EXPECT_TRUE(test::rejects(validate_kda_backward(p, DeviceKind::kCPU, &s), arg, what));
}

void expect_accepts(const KdaBackwardParams& p) {
  KdaShape s;
  Status st = validate_kda_backward(p, DeviceKind::kCPU, &s);
  EXPECT_TRUE(st.ok()) << st.message();
}

TEST(KdaArgs, BackwardValidAndDerivedShape) {
  Backward f;
  KdaShape s;
  Status st = validate_kda_backward(f.backward(), DeviceKind::kCPU, &s);
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(s.num_seqs, 2);
  EXPECT_EQ(s.heads_v, 4);
  EXPECT_EQ(s.value_dim, 32);
  EXPECT_FLOAT_EQ(s.scale, 0.125f);
  auto p = f.backward();
  p.d_final_state = TensorView{};  // optional
  expect_accepts(p);
}

TEST(KdaArgs, BackwardChecksTheInputs) {
  Backward f;
  auto p = f.backward();
  p.q.dtype = p.k.dtype = DType::kFloat32;
  expect_rejects(p, "q", "dtype");
  p = f.backward();
  p.options.allow_neg_eigval = true;
  expect_rejects(p, "options.allow_neg_eigval");
}

TEST(KdaArgs, BackwardOutputGradients) {
  Backward f;
  auto p = f.backward();
  p.dout = TensorView{};
  expect_rejects(p, "dout", "null");
  p = f.backward();
  p.dout.dtype = DType::kFloat16;
  expect_rejects(p, "dout", "differs from q");
  p = f.backward();
  p.dout.shape[3] = 64;
  expect_rejects(p, "dout", "shape");
  p = f.backward();
  p.d_final_state.shape[1] = 2;
  expect_rejects(p, "d_final_state", "shape");
  p = f.backward();
  p.d_final_state.dtype = DType::kBFloat16;
  expect_rejects(p, "d_final_state", "dtype");
}

TEST(KdaArgs, BackwardInputGradients) {
  Backward f;
  auto p = f.backward();
  p.dq.shape[1] = 11;
  expect_rejects(p, "dq", "shape");
  p = f.backward();
  p.dq = TensorView{};
  expect_rejects(p, "dq", "null");
  p = f.backward();
  p.dk.dtype = DType::kFloat16;
  expect_rejects(p, "dk", "differs from k");
  p = f.backward();
  p.dv.shape[2] = 2;
  expect_rejects(p, "dv", "shape");
  p = f.backward();
  p.dv.data = static_cast<char*>(p.dv.data) + 4;
  expect_rejects(p, "dv", "16-byte");

  p = f.backward();
  p.dg.dtype = DType::kBFloat16;  // g is fp32: dg must be fp32
  expect_rejects(p, "dg", "float32");
  p = f.backward();
  p.dg.shape[3] = 32;
  expect_rejects(p, "dg", "shape");
  p = f.backward();
  p.dg = f.g_gdn;  // a GDN-shaped gradient for a KDA gate
  expect_rejects(p, "dg", "rank");
  // A bf16 gate may take its gradient in bf16 or fp32.
  HostTensor g16{DType::kBFloat16, {2, 12, 4, 64}}, dg16{DType::kBFloat16, {2, 12, 4, 64}};
  p = f.backward();
  p.g = g16;
  expect_accepts(p);
  p.dg = dg16;
  expect_accepts(p);
  // GDN: dg [B, T, HV].
  HostTensor dg_gdn{DType::kFloat32, {2, 12, 4}};
  p = f.backward();
  p.g = f.g_gdn;
  p.dg = dg_gdn;
  expect_accepts(p);
  p.dg.shape[2] = 2;
  expect_rejects(p, "dg", "shape");

  p = f.backward();
  p.dbeta.shape[1] = 6;
  expect_rejects(p, "dbeta", "shape");
  p = f.backward();
  p.dbeta.dtype = DType::kFloat16;  // beta is bf16: dbeta in bf16 or fp32
  expect_rejects(p, "dbeta", "float32 or bfloat16");
  p.dbeta.dtype = DType::kBFloat16;
  expect_accepts(p);
}

TEST(KdaArgs, BackwardStateGradient) {
  Backward f;
  auto p = f.backward();
  p.d_initial_state = TensorView{};
  expect_rejects(p, "d_initial_state", "required when initial_state");
  p = f.backward();
  p.initial_state = TensorView{};
  expect_rejects(p, "d_initial_state", "only allowed when initial_state");
  p.d_initial_state = TensorView{};
  expect_accepts(p);
  p = f.backward();
  p.d_initial_state.shape[3] = 64;
  expect_rejects(p, "d_initial_state", "shape");
}

TEST(KdaArgs, BackwardGateGradients) {
  Backward f;
  auto p = f.backward();
  p.options.gate_in_kernel = true;
  p.A_log = f.A_log;
  p.dt_bias = f.dt_bias;
  expect_rejects(p, "dA_log", "required when options.gate_in_kernel");
  p.dA_log = f.dA_log;
  expect_rejects(p, "ddt_bias", "required when options.gate_in_kernel");
  p.ddt_bias = f.ddt_bias;
  expect_accepts(p);

  auto bad = p;
  bad.dA_log.shape[0] = 8;
  expect_rejects(bad, "dA_log", "shape");
  bad = p;
  bad.ddt_bias.dtype = DType::kBFloat16;
  expect_rejects(bad, "ddt_bias", "dtype");
  bad = p;
  bad.ddt_bias.shape[0] = 4;
  expect_rejects(bad, "ddt_bias", "shape");

  // With lower_bound and no A_log / dt_bias, their gradients must be absent.
  bad = p;
  bad.options.lower_bound = -5.f;
  bad.A_log = bad.dt_bias = TensorView{};
  expect_rejects(bad, "dA_log", "only allowed when");
  bad.dA_log = TensorView{};
  expect_rejects(bad, "ddt_bias", "only allowed when");
  bad.ddt_bias = TensorView{};
  expect_accepts(bad);

  // Without the in-kernel gate there is nothing to differentiate.
  bad = f.backward();
  bad.dA_log = f.dA_log;
  expect_rejects(bad, "dA_log", "only allowed when");
}

}  // namespace
}  // namespace flare::detail

// The segmentation rule of the forward state pass (kda_state_segments.h), against brute force:
// every segment non-empty and at most `chunks` long, together exactly chunks_per_row; segments only
// where each phase (count - 1 CTAs per unsegmented CTA) fits in one wave, at least 3 of them, never
// shorter than the minimum, and the most that fit.
TEST(KdaStateSegments, Rule) {
  using flare::detail::kda_state_segments;
  using flare::detail::KdaStateSegments;
  // B1, 32 value heads, V 128, T 32768 on 132 SMs: 32 CTAs -> 5 segments of 103 chunks (phases of
  // 128 CTAs).
  KdaStateSegments s = kda_state_segments(32, 512, false, 132);
  EXPECT_EQ(s.count, 5);
  EXPECT_EQ(s.chunks, 103);
  EXPECT_EQ(kda_state_segments(64, 512, false, 132).count, 3);     // B2
  EXPECT_EQ(kda_state_segments(66, 512, false, 132).count, 3);     // phases of exactly 132 CTAs
  EXPECT_EQ(kda_state_segments(67, 512, false, 132).count, 1);     // 3 segments would need 134
  EXPECT_EQ(kda_state_segments(256, 64, false, 132).count, 1);     // B8: a CTA per SM already
  EXPECT_EQ(kda_state_segments(32, 512, true, 132).count, 1);      // varlen: not segmented
  EXPECT_EQ(kda_state_segments(32, 40, false, 132).count, 1);      // 2 segments at most: no gain
  EXPECT_EQ(kda_state_segments(32, 48, false, 132).count, 3);      // at most chunks / 16 segments
  EXPECT_EQ(kda_state_segments(32, 31, false, 132).count, 1);      // too short to cut
  EXPECT_EQ(kda_state_segments(32, 512, false, 0).count, 1);       // no device facts
  EXPECT_EQ(kda_state_segments(8, 4096, false, 132).count, 16);    // capped at 16 segments
  EXPECT_EQ(kda_state_segments(100, 4096, false, 132).count, 1);   // over half the SMs busy already
  for (int64_t cpr = 1; cpr <= 300; ++cpr)
    for (int forced : {0, 1, 2, 3, 7, 64})
      for (int64_t ctas : {1, 8, 33, 66, 100, 200}) {
        s = kda_state_segments(ctas, cpr, false, 132, forced);
        ASSERT_GE(s.count, 1);
        if (s.count == 1) {
          if (forced == 0)  // no count of 3 or more would have fitted
            ASSERT_TRUE(ctas * 2 > 132 || cpr / flare::detail::kKdaMinSegmentChunks < 3) << ctas << " " << cpr;
          continue;
        }
        ASSERT_GE(s.chunks, 1);
        ASSERT_LT(int64_t{s.count - 1} * s.chunks, cpr) << "empty last segment, cpr " << cpr;
        ASSERT_GE(int64_t{s.count} * s.chunks, cpr) << "chunks left over, cpr " << cpr;
        if (forced > 0) {
          ASSERT_EQ(s.chunks, (cpr + ((cpr + forced - 1) / forced) - 1) / ((cpr + forced - 1) / forced));
        } else {
          ASSERT_GE(s.count, 3);
          ASSERT_LE(ctas * (s.count - 1), 132);                                      // one wave a phase
          ASSERT_TRUE(ctas * s.count > 132 || s.count == flare::detail::kKdaMaxSegments ||
                      s.count >= cpr / flare::detail::kKdaMinSegmentChunks);         // the most that fit
          ASSERT_GE(s.chunks, cpr / s.count);
          ASSERT_LE(s.count, cpr / flare::detail::kKdaMinSegmentChunks);
        }
      }
}

// Segment 0 weighted against the others (kda_segments_weighted): 100 % is kda_segments_of; any
// weight covers exactly the chunks, with segment 0 and every later segment non-empty, the later
// ones at most `chunks` long, and no more segments than asked for.
TEST(KdaStateSegments, WeightedFirstSegment) {
  using flare::detail::kda_segments_of;
  using flare::detail::kda_segments_weighted;
  using flare::detail::KdaStateSegments;
  KdaStateSegments s = kda_segments_weighted(256, 3, 100);  // B2 T16384's rule
  EXPECT_EQ(s.count, 3);
  EXPECT_EQ(s.chunks, 86);
  EXPECT_EQ(s.first, 86);
  s = kda_segments_weighted(256, 3, 130);  // 101 = 256 x 130 / 330, then 78 and 77
  EXPECT_EQ(s.count, 3);
  EXPECT_EQ(s.first, 101);
  EXPECT_EQ(s.chunks, 78);
  EXPECT_EQ(kda_segments_weighted(256, 3, 50).first, 51);  // 256 x 50 / 250
  for (int64_t cpr = 1; cpr <= 300; ++cpr)
    for (int count = 2; count <= 16; ++count)
      for (int weight : {1, 37, 50, 100, 130, 200, 400}) {
        s = kda_segments_weighted(cpr, count, weight);
        if (weight == 100) {
          const KdaStateSegments e = kda_segments_of(cpr, count);
          ASSERT_TRUE(s.count == e.count && s.chunks == e.chunks && s.first == e.first);
        }
        if (s.count == 1) {
          ASSERT_TRUE(cpr <= 1) << cpr << " " << count << " " << weight;
          continue;
        }
        ASSERT_GE(s.first, 1);
        ASSERT_GE(s.chunks, 1);
        ASSERT_LE(s.count, count);
        ASSERT_LT(s.first + int64_t{s.count - 2} * s.chunks, cpr) << "empty last segment";
        ASSERT_GE(s.first + int64_t{s.count - 1} * s.chunks, cpr) << "chunks left over";
      }
}

// The chunk prep's CTA orders (kda_prep_order.h): each a bijection of the grid onto (chunk, value
// head); chunk-major as the earlier 2-D grid, head-major with a chunk's heads adjacent, reversed
// ending on chunk 0.
TEST(KdaPrepOrder, EveryCtaOnce) {
  using namespace flare::detail;
  for (int chunks : {1, 2, 7, 64})
    for (int heads : {1, 3, 32})
      for (int order : {kChunkMajor, kHeadMajor, kHeadMajorReversed}) {
        std::vector<int> seen(static_cast<size_t>(chunks) * heads, 0);
        for (int64_t i = 0; i < int64_t{chunks} * heads; ++i) {
          const KdaPrepCta c = kda_prep_cta(i, chunks, heads, order);
          ASSERT_TRUE(c.chunk >= 0 && c.chunk < chunks && c.hv >= 0 && c.hv < heads);
          ++seen[static_cast<size_t>(c.chunk) * heads + c.hv];
          if (order == kChunkMajor) ASSERT_TRUE(c.chunk == i % chunks && c.hv == i / chunks);
          if (order != kChunkMajor) ASSERT_EQ(c.hv, i % heads);
        }
        for (int n : seen) ASSERT_EQ(n, 1);
        const KdaPrepCta last = kda_prep_cta(int64_t{chunks} * heads - 1, chunks, heads, order);
        if (order == kHeadMajorReversed) EXPECT_EQ(last.chunk, 0);
        if (order == kHeadMajor) EXPECT_EQ(last.chunk, chunks - 1);
      }
}
