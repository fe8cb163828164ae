// The argument rules of the KDA recurrent step (flare::kda_recurrent_step), checked on CPU views:
// the pool `state`, `state_indices` (values too, since CPU views are readable) and `final_state`,
// plus the inputs it shares with the chunked forward; and the launch's value-slice width.
#include <gtest/gtest.h>

#include <initializer_list>
#include <string>

#include "reference/host_tensor.h"
#include "src/kda/kda_recurrent_params.h"
#include "tests/common/status_checks.h"

namespace flare::detail {
namespace {

using ref::HostTensor;

// N = 3 sequences of Tq = 2 tokens, H = 2, HV = 4, K = 64, V = 32; a pool of P = 5 slots.
struct Fixture {
  HostTensor q{DType::kBFloat16, {3, 2, 2, 64}}, k{DType::kBFloat16, {3, 2, 2, 64}},
      v{DType::kBFloat16, {3, 2, 4, 32}}, g{DType::kFloat32, {3, 2, 4, 64}}, beta{DType::kFloat32, {3, 2, 4}},
      out{DType::kBFloat16, {3, 2, 4, 32}}, pool{DType::kFloat32, {5, 4, 64, 32}},
      indices{DType::kInt32, {3}}, final_state{DType::kFloat32, {3, 4, 64, 32}};
  Fixture() {
    indices.set(0, 4), indices.set(1, -1), indices.set(2, 0);
  }
  KdaRecurrentParams params() const {
    KdaRecurrentParams p;
    p.q = q, p.k = k, p.v = v, p.g = g, p.beta = beta, p.out = out;
    p.state = pool;
    p.state_indices = indices;
    return p;
  }
};

Status validate(const KdaRecurrentParams& p, KdaRecurrentShape* s = nullptr) {
  KdaRecurrentShape local;
  return validate_kda_recurrent(p, DeviceKind::kCPU, s ? s : &local);
}

void expect_rejects(const KdaRecurrentParams& p, const std::string& arg, const std::string& what = "") {
  EXPECT_TRUE(test::rejects(validate(p), arg, what));
}

TEST(KdaRecurrentArgs, ValidPoolWithIndices) {
  Fixture f;
  KdaRecurrentShape s;
  const Status st = validate(f.params(), &s);
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(s.base.num_seqs, 3);
  EXPECT_EQ(s.base.seqlen, 2);
  EXPECT_EQ(s.base.heads_v, 4);
  EXPECT_EQ(s.num_slots, 5);
  EXPECT_TRUE(s.indexed);
  EXPECT_FLOAT_EQ(s.base.scale, 0.125f);
}

TEST(KdaRecurrentArgs, OptionalStates) {
  Fixture f;
  auto p = f.params();
  p.final_state = f.final_state;  // the pool is then only read
  EXPECT_TRUE(validate(p).ok());
  p.state = p.state_indices = TensorView{};  // no state at all: every sequence from zero
  EXPECT_TRUE(validate(p).ok());
  p.final_state = TensorView{};
  EXPECT_TRUE(validate(p).ok());
}

TEST(KdaRecurrentArgs, PoolWithoutIndicesHasOneSlotPerSequence) {
  Fixture f;
  auto p = f.params();
  p.state_indices = TensorView{};
  expect_rejects(p, "state", "P = N = 3");
  HostTensor three{DType::kFloat32, {3, 4, 64, 32}};
  p.state = three;
  EXPECT_TRUE(validate(p).ok());
}

TEST(KdaRecurrentArgs, PoolShapeDtypeAndLayout) {
  Fixture f;
  auto p = f.params();
  HostTensor wrong_heads{DType::kFloat32, {5, 2, 64, 32}}, wrong_dims{DType::kFloat32, {5, 4, 32, 64}},
      bf16{DType::kBFloat16, {5, 4, 64, 32}}, rank3{DType::kFloat32, {5, 4, 64}};
  p.state = wrong_heads;
  expect_rejects(p, "state", "HV = 4");
  p.state = wrong_dims;
  expect_rejects(p, "state", "K = 64");
  p.state = bf16;
  expect_rejects(p, "state", "dtype");
  p.state = rank3;
  expect_rejects(p, "state", "rank");
  p.state = f.pool;
  p.state.data = nullptr;
  expect_rejects(p, "state", "null");

  // Slots may sit further apart (a slice of a larger cache), but a slot must be dense.
  HostTensor wide{DType::kFloat32, {5 * 2, 4, 64, 32}};
  p.state = wide;
  p.state.shape[0] = 5;
  p.state.stride[0] *= 2;
  EXPECT_TRUE(validate(p).ok());
  p.state.stride[0] = 4 * 64 * 32 - 32;  // overlapping slots
  expect_rejects(p, "state", "overlap");
  p.state = f.pool;
  p.state.stride[1] = 2 * 64 * 32;
  expect_rejects(p, "state", "dense");
}

TEST(KdaRecurrentArgs, Indices) {
  Fixture f;
  auto p = f.params();
  HostTensor i64{DType::kInt64, {3}}, four{DType::kInt32, {4}};
  p.state_indices = i64;
  expect_rejects(p, "state_indices", "dtype");
  p.state_indices = four;
  expect_rejects(p, "state_indices", "[3]");
  p = f.params();
  p.state = TensorView{};
  expect_rejects(p, "state_indices", "without state");

  // Values: negative is "no state", P and beyond is an error naming the entry.
  Fixture g;
  g.indices.set(1, 5);
  expect_rejects(g.params(), "state_indices", "entry 1 is 5");
  g.indices.set(1, -7);
  EXPECT_TRUE(validate(g.params()).ok());
}

TEST(KdaRecurrentArgs, FinalState) {
  Fixture f;
  auto p = f.params();
  HostTensor pool_shaped{DType::kFloat32, {5, 4, 64, 32}}, bf16{DType::kBFloat16, {3, 4, 64, 32}};
  p.final_state = pool_shaped;
  expect_rejects(p, "final_state", "[3, 4, 64, 32]");
  p.final_state = bf16;
  expect_rejects(p, "final_state", "dtype");
}

TEST(KdaRecurrentArgs, SharedInputRules) {
  Fixture f;
  auto p = f.params();
  p.q.data = nullptr;
  expect_rejects(p, "q", "null");
  p = f.params();
  HostTensor v_wrong{DType::kBFloat16, {3, 2, 3, 32}};
  p.v = v_wrong;
  expect_rejects(p, "v", "multiple");
  p = f.params();
  HostTensor out_wrong{DType::kBFloat16, {3, 1, 4, 32}};
  p.out = out_wrong;
  expect_rejects(p, "out");
  p = f.params();
  p.options.allow_neg_eigval = true;
  expect_rejects(p, "options.allow_neg_eigval");
  p = f.params();
  p.options.gate_in_kernel = true;  // the default gate needs A_log
  expect_rejects(p, "A_log");
  p = f.params();
  HostTensor cu{DType::kInt32, {3}};
  cu.set(0, 0), cu.set(1, 1), cu.set(2, 2);
  p.cu_seqlens = cu;
  expect_rejects(p, "cu_seqlens", "B == 1");
}

TEST(KdaRecurrentArgs, VarlenSequencesIndexThePool) {
  // B = 1, 5 packed tokens in N = 3 sequences (lengths 2, 0, 3): indices and final_state are [N].
  HostTensor q{DType::kFloat16, {1, 5, 2, 64}}, v{DType::kFloat16, {1, 5, 4, 64}}, g{DType::kFloat16, {1, 5, 4}},
      beta{DType::kFloat16, {1, 5, 4}}, out{DType::kFloat16, {1, 5, 4, 64}}, cu{DType::kInt64, {4}},
      pool{DType::kFloat32, {8, 4, 64, 64}}, indices{DType::kInt32, {3}}, fin{DType::kFloat32, {3, 4, 64, 64}};
  cu.set(0, 0), cu.set(1, 2), cu.set(2, 2), cu.set(3, 5);
  indices.set(0, 7), indices.set(1, 2), indices.set(2, -1);
  KdaRecurrentParams p;
  p.q = p.k = q;
  p.v = v, p.g = g, p.beta = beta, p.out = out, p.cu_seqlens = cu;
  p.state = pool, p.state_indices = indices, p.final_state = fin;
  KdaRecurrentShape s;
  const Status st = validate(p, &s);
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(s.base.num_seqs, 3);
  EXPECT_TRUE(s.base.scalar_gate);
  cu.set(3, 4);
  expect_rejects(p, "cu_seqlens", "end at T = 5");
}

TEST(KdaRecurrentLaunch, SliceWidthFillsTheGpu) {
  constexpr int kSms = 132;
  EXPECT_EQ(recurrent_slice_width(256 * 32, 128, kSms), 64);  // large batch: two CTAs per head
  EXPECT_EQ(recurrent_slice_width(8 * 32, 128, kSms), 64);    // 512 CTAs
  EXPECT_EQ(recurrent_slice_width(4 * 32, 128, kSms), 32);    // 512 CTAs of 32 columns
  EXPECT_EQ(recurrent_slice_width(32, 128, kSms), 16);        // batch 1: 256 one-warp CTAs
  EXPECT_EQ(recurrent_slice_width(1000, 64, kSms), 64);
  EXPECT_EQ(recurrent_slice_width(200, 64, kSms), 32);
  EXPECT_EQ(recurrent_slice_width(100, 64, kSms), 16);
  for (int64_t heads : {1, 7, 100, 5000})
    for (int v : {64, 128}) {
      const int bv = recurrent_slice_width(heads, v, kSms);
      EXPECT_TRUE(bv == 16 || bv == 32 || bv == 64);
      EXPECT_EQ(v % bv, 0);
    }
}

}  // namespace
}  // namespace flare::detail
