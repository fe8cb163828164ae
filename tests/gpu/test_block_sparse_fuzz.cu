// The block-sparse fuzzer (issue 6): random shapes, GQA ratios, head dims, dtypes, block sizes and
// masks; the block-sparse forward and backward on the GPU (outputs poisoned) against the CPU oracle
// in fp64, judged by AttnProblem's checks as tests/gpu/test_block_sparse.cu judges them.
//
// A case is drawn from its own seed alone, and a failing case prints it:
//   FLARE_FUZZ_SEED=<case seed>     replays that one case (with FLARE_TEST_REDUCED=1 if the run had it)
//   FLARE_FUZZ_RUN_SEED=<run seed>  replays a whole run (the seeds of its cases derive from it)
//   FLARE_FUZZ_CASES=<n>            cases per run (default 500; FLARE_TEST_REDUCED=1: 20 smaller ones,
//                                   for compute-sanitizer)
//   FLARE_FUZZ_THREADS=<n>          threads of the oracle (default: every hardware thread)
//   FLARE_FUZZ_DETERMINISTIC=0      skips the deterministic-backward arm
// Cases go in batches: the main thread draws a batch and uploads its inputs, every core runs the
// oracle for it (std::thread, one case at a time each), then the main thread runs the GPU and
// checks. Case sizes are capped (kMaxCaseWork) so that a run stays well under a minute on the
// 16-core H100 machine, oracle included.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "flare_instantiated.h"
#include "tests/gpu/block_sparse_case.h"
#include "tests/gpu/instantiated_dims.h"

namespace flare::test {
namespace {

// ---- settings ------------------------------------------------------------------------------------

constexpr int kDefaultCases = 500;
constexpr int kReducedCases = 20;
// Oracle work of a case, batch * heads * seqlen_q * seqlen_k * head_dim; a larger draw is shrunk
// (batch, then heads, then lengths). About 1 s of one core for the four oracle runs at the cap.
constexpr double kMaxCaseWork = 1.0e8;
constexpr double kMaxReducedCaseWork = 1.5e7;
constexpr int kMaxSeqlen = 700;
constexpr int kMaxReducedSeqlen = 300;
constexpr int kMaxFailingCases = 5;    // the run stops after this many, so the log stays readable
constexpr int kDeterministicRuns = 3;  // the deterministic arm's runs per case, compared bitwise

uint64_t env_u64(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoull(v, nullptr, 10) : fallback;
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// ---- a case --------------------------------------------------------------------------------------

enum class MaskFamily {
  kBlockGrid,    // a random boolean block grid: visible blocks FULL, some made PARTIAL (element mask)
  kRandomKinds,  // every block EMPTY, PARTIAL or FULL at random, an element mask in the partial ones
  kPredicates,   // composed predicates (causal, window, documents, prefix-LM), classified by brute force
  kBits,         // a user bit-packed element mask (with a predicate sometimes), classified likewise
};

const char* family_name(MaskFamily f) {
  switch (f) {
    case MaskFamily::kBlockGrid: return "block-grid";
    case MaskFamily::kRandomKinds: return "random-kinds";
    case MaskFamily::kPredicates: return "predicates";
    case MaskFamily::kBits: return "bits";
  }
  return "?";
}

struct FuzzCase {
  uint64_t seed = 0;
  bool reduced = false;
  SparseCase sparse;          // shapes, dtype, dense mask, softcap, sinks, block sizes, broadcast
  MaskFamily family = MaskFamily::kPredicates;
  double density = 0;         // kBlockGrid: the fraction of visible blocks
  double partial = 0;         // kBlockGrid: the fraction of visible blocks made PARTIAL
  ElementMask predicates;     // causal, windows, prefix-LM (no tensors)
  int doc_length = 0;         // > 0: document ids, documents of about this many tokens
  bool shared_documents = false;  // one row of ids for the whole batch (stride 0), a batch-broadcast mask
  bool recurring_documents = false;  // ids that recur in separate runs (not sorted): the Hopper forward's lookups
  int bits_batch = 0, bits_heads = 0;  // > 0: bit words [bits_batch, bits_heads, seqlen_q, words]
  bool partial_only = false;  // no full lists: every visible block listed as partial

  int mask_batch() const { return sparse.broadcast_batch ? 1 : sparse.attn.batch; }
  int mask_heads() const { return sparse.broadcast_heads ? 1 : sparse.attn.heads; }

  std::string describe() const {
    const AttnCase& a = sparse.attn;
    std::ostringstream s;
    s << "case seed " << seed << (reduced ? " (reduced)" : "") << ": " << a.name() << " | blocks " << sparse.q_block
      << "x" << sparse.kv_block << " | " << family_name(family);
    if (family == MaskFamily::kBlockGrid) s << " density " << density << " partial " << partial;
    s << " element{";
    if (predicates.causal) s << " causal";
    if (predicates.window_left >= 0 || predicates.window_right >= 0)
      s << " window(" << predicates.window_left << "," << predicates.window_right << ")";
    if (predicates.prefix_length >= 0) s << " prefix " << predicates.prefix_length;
    if (doc_length > 0)
      s << " documents~" << doc_length << (shared_documents ? " shared" : "") << (recurring_documents ? " recurring" : "");
    if (bits_batch > 0) s << " bits[" << bits_batch << "," << bits_heads << "]";
    s << " }" << (sparse.broadcast_batch ? " bcast-b" : "") << (sparse.broadcast_heads ? " bcast-h" : "")
      << (partial_only ? " partial-only" : "");
    return s.str();
  }
};

// A random predicate set: `count` of causal, window, documents and prefix-LM (at least one).
void draw_predicates(std::mt19937_64& rng, int count, FuzzCase* f) {
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); };
  int order[4] = {0, 1, 2, 3};
  std::shuffle(order, order + 4, rng);
  for (int i = 0; i < std::clamp(count, 1, 4); ++i) {
    switch (order[i]) {
      case 0:
        f->predicates.causal = true;
        break;
      case 1:
        f->predicates.window_left = pick(5) ? pick(300) : -1;
        f->predicates.window_right = f->predicates.window_left < 0 || pick(2) ? pick(100) : -1;
        break;
      case 2:
        f->doc_length = 8 + pick(200);
        f->recurring_documents = pick(3) == 0;
        break;
      case 3:
        f->predicates.prefix_length = pick(f->sparse.attn.seqlen_k + 1);
        break;
    }
  }
}

FuzzCase draw_case(uint64_t seed, bool reduced) {
  std::mt19937_64 rng(seed);
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); };
  auto chance = [&](double p) { return std::uniform_real_distribution<double>(0.0, 1.0)(rng) < p; };
  FuzzCase f;
  f.seed = seed;
  f.reduced = reduced;
  AttnCase& a = f.sparse.attn;
  a.seed = seed;

  // Shapes: heads and the GQA ratio from {1, 2, 4, 8}, the ratio at most the heads.
  const int powers[] = {1, 2, 4, 8};
  a.batch = 1 + pick(3);
  a.heads = powers[pick(4)];
  int ratio = powers[pick(4)];
  while (ratio > a.heads) ratio /= 2;
  a.heads_kv = a.heads / ratio;
  // An instantiated head dim, or (a quarter of the cases) another multiple of 8 that the next
  // instantiated one up serves.
  const std::vector<int> dims = instantiated_head_dims();
  std::vector<int> served;
  for (int d = 8; d <= dims.back(); d += 8)
    if (std::find(dims.begin(), dims.end(), d) == dims.end()) served.push_back(d);
  a.head_dim = !served.empty() && chance(0.25) ? served[pick(static_cast<int>(served.size()))]
                                                : dims[pick(static_cast<int>(dims.size()))];
  a.dtype = chance(0.5) ? DType::kBFloat16 : DType::kFloat16;
  if (!instantiated(a)) a.dtype = a.dtype == DType::kFloat16 ? DType::kBFloat16 : DType::kFloat16;
  // Lengths: short, medium and long ones, some at a multiple of 128 or one off it.
  const int max_len = reduced ? kMaxReducedSeqlen : kMaxSeqlen;
  auto draw_len = [&]() {
    const int r = pick(20);
    int len = r < 2 ? 1 + pick(32) : (r < 11 ? 1 + pick(256) : 257 + pick(max_len - 256));
    if (chance(0.15)) len = std::clamp(128 * (1 + pick(max_len / 128)) + pick(3) - 1, 1, max_len);
    return len;
  };
  a.seqlen_q = draw_len();
  a.seqlen_k = chance(0.5) ? a.seqlen_q : draw_len();
  const double cap = reduced ? kMaxReducedCaseWork : kMaxCaseWork;
  auto work = [&] { return double(a.batch) * a.heads * a.seqlen_q * a.seqlen_k * a.head_dim; };
  while (work() > cap) {
    if (a.batch > 1) {
      --a.batch;
    } else if (a.heads > 1) {  // halve the heads, keeping the ratio while there are kv heads to halve
      if (a.heads_kv > 1) a.heads_kv /= 2;
      a.heads /= 2;
    } else {
      a.seqlen_q = std::max(1, a.seqlen_q * 4 / 5);
      a.seqlen_k = std::max(1, a.seqlen_k * 4 / 5);
    }
  }

  // Block sizes: mostly 128 and 64, sometimes another multiple of 16 up to 256.
  auto draw_block = [&]() {
    const int r = pick(20);
    return r < 9 ? 128 : (r < 16 ? 64 : 16 * (1 + pick(16)));
  };
  f.sparse.q_block = draw_block();
  f.sparse.kv_block = draw_block();

  // The dense mask (composed with the block mask), soft-capping and sinks, now and then.
  if (chance(0.08)) a.mask.causal = true;
  if (chance(0.08)) a.mask.window_left = pick(300);
  if (chance(0.1)) a.softcap = static_cast<float>(10 + pick(41));
  a.sinks = chance(0.1);

  // The mask.
  f.sparse.broadcast_batch = chance(0.3);
  f.sparse.broadcast_heads = chance(0.3);
  const int r = pick(20);
  f.family = r < 6 ? MaskFamily::kBlockGrid
                   : (r < 9 ? MaskFamily::kRandomKinds : (r < 16 ? MaskFamily::kPredicates : MaskFamily::kBits));
  bool bits = false;
  switch (f.family) {
    case MaskFamily::kBlockGrid:
      f.density = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
      if (chance(0.5)) {
        f.partial = std::uniform_real_distribution<double>(0.2, 1.0)(rng);
        if (chance(0.5)) bits = true;
        else draw_predicates(rng, 1 + pick(2), &f);
      }
      break;
    case MaskFamily::kRandomKinds:
      if (chance(0.5)) bits = true;
      else draw_predicates(rng, 1 + pick(2), &f);
      break;
    case MaskFamily::kPredicates:
      draw_predicates(rng, 1 + pick(3), &f);
      break;
    case MaskFamily::kBits:
      bits = true;
      if (chance(0.3)) draw_predicates(rng, 1, &f);
      break;
  }
  if (f.doc_length > 0 && f.sparse.broadcast_batch) {
    // Documents differ per batch entry unless the batch shares one row of ids (as flare.flex_attention
    // passes 1-D ids: expanded, stride 0).
    if (chance(0.5)) f.shared_documents = true;
    else f.sparse.broadcast_batch = false;
  }
  if (bits) {  // the words' batch and head dims: the mask's, or 1 (broadcast by the tensor itself)
    f.bits_batch = chance(0.5) ? 1 : f.mask_batch();
    f.bits_heads = chance(0.5) ? 1 : f.mask_heads();
  }
  f.partial_only = chance(0.1);
  return f;
}

// ---- its mask and inputs -------------------------------------------------------------------------

// Document ids of `rows` rows: runs of about doc_length tokens, the same boundaries for queries and
// keys (FlexAttention's document mask), different per row; sorted, or with recurring_documents
// three ids in turn (a document's keys in separate runs).
void fill_documents(const FuzzCase& f, int rows, std::mt19937_64& rng, ElementTensors* el) {
  const int sq = f.sparse.attn.seqlen_q, sk = f.sparse.attn.seqlen_k;
  el->doc_q.make({rows, sq});
  el->doc_k.make({rows, sk});
  std::vector<int32_t> ids(static_cast<size_t>(std::max(sq, sk)));
  for (int b = 0; b < rows; ++b) {
    int doc = 0;
    for (size_t t = 0; t < ids.size(); ++t) {
      if (t > 0 && rng() % static_cast<uint64_t>(f.doc_length) == 0) ++doc;
      ids[t] = f.recurring_documents ? doc % 3 : doc;
    }
    std::memcpy(el->doc_q.data() + int64_t{b} * sq, ids.data(), sizeof(int32_t) * sq);
    std::memcpy(el->doc_k.data() + int64_t{b} * sk, ids.data(), sizeof(int32_t) * sk);
  }
}

// Bit words with long runs of ones and zeros, so that some blocks come out full or empty.
void fill_bits(const FuzzCase& f, std::mt19937_64& rng, ElementTensors* el) {
  const int words = (f.sparse.attn.seqlen_k + 31) / 32;
  el->bits.make({f.bits_batch, f.bits_heads, f.sparse.attn.seqlen_q, words});
  const int64_t n = el->bits.host.numel();
  for (int64_t w = 0; w < n; ++w) {
    const int r = static_cast<int>(rng() % 8);
    el->bits.data()[w] = r < 3 ? 0 : (r < 6 ? -1 : static_cast<int32_t>(rng()));
  }
}

// A view of `t` ([1, S]) as [batch, S] with stride 0: one row of ids serving every batch entry.
TensorView batch_expanded(TensorView t, int batch) {
  t.shape[0] = batch;
  t.stride[0] = 0;
  return t;
}

// The element tensors, the host-built mask and their device copies.
void build_fuzz_mask(const FuzzCase& f, SparseMask* m) {
  std::mt19937_64 rng(splitmix64(f.seed ^ 0x6d61736bull));
  const SparseCase& c = f.sparse;
  const BlockMaskGeometry g = geometry_of(c);
  ElementTensors& el = m->element;
  if (f.doc_length > 0) fill_documents(f, f.shared_documents ? 1 : c.attn.batch, rng, &el);
  if (f.bits_batch > 0) fill_bits(f, rng, &el);
  ElementMask e = f.predicates;
  el.host = el.device = e;
  for (auto [t, host_view, dev_view] : {std::tuple{&el.doc_q, &el.host.doc_ids_q, &el.device.doc_ids_q},
                                        std::tuple{&el.doc_k, &el.host.doc_ids_k, &el.device.doc_ids_k},
                                        std::tuple{&el.bits, &el.host.bits, &el.device.bits}}) {
    if (!t->dev) continue;
    t->upload();
    *host_view = t->host.view();
    *dev_view = t->dev->view();
  }

  // Block kinds at random, or classified from the element mask.
  auto build_from_grid = [&](auto kind_of) {
    BlockKindGrid kinds = BlockKindGrid::all_empty(g.batch, g.heads, g.num_q_blocks(), g.num_kv_blocks());
    for (TileKind& k : kinds.kinds) k = kind_of();
    const Status s = block_sparse::build_from_kinds(kinds, g, el.host, &m->host);
    ASSERT_TRUE(s.ok()) << s.message();
  };
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  switch (f.family) {
    case MaskFamily::kBlockGrid:
      ASSERT_NO_FATAL_FAILURE(build_from_grid([&] {
        if (unit(rng) >= f.density) return TileKind::kEmpty;
        return unit(rng) < f.partial ? TileKind::kPartial : TileKind::kFull;
      }));
      break;
    case MaskFamily::kRandomKinds:
      ASSERT_NO_FATAL_FAILURE(build_from_grid([&] { return static_cast<TileKind>(rng() % 3); }));
      break;
    case MaskFamily::kPredicates:
    case MaskFamily::kBits: {
      const Status s = block_sparse::build_from_element_mask(el.host, g, &m->host);
      ASSERT_TRUE(s.ok()) << s.message();
      break;
    }
  }
  if (f.partial_only) {
    // FlexAttention's BlockMask without full lists: the full blocks listed as partial (the element
    // mask holds on every element of them only when they were classified from it; either way the
    // oracle reads the same lists).
    BlockKindGrid kinds = BlockKindGrid::all_empty(g.batch, g.heads, g.num_q_blocks(), g.num_kv_blocks());
    for (int b = 0; b < g.batch; ++b)
      for (int h = 0; h < g.heads; ++h)
        for (int qb = 0; qb < g.num_q_blocks(); ++qb)
          for (int kb = 0; kb < g.num_kv_blocks(); ++kb)
            kinds.at(b, h, qb, kb) = m->host.kind(b, h, qb, kb) == TileKind::kEmpty ? TileKind::kEmpty : TileKind::kPartial;
    const Status s = block_sparse::build_from_kinds(kinds, g, el.host, &m->host);
    ASSERT_TRUE(s.ok()) << s.message();
  }
  m->upload();
  if (f.shared_documents) {
    for (BlockMask* v : {&m->host_view, &m->device_view}) {
      v->element.doc_ids_q = batch_expanded(v->element.doc_ids_q, c.attn.batch);
      v->element.doc_ids_k = batch_expanded(v->element.doc_ids_k, c.attn.batch);
    }
  }
  if (f.partial_only) {
    for (BlockMask* v : {&m->host_view, &m->device_view}) {
      v->full_kv_num_blocks = v->full_kv_indices = TensorView{};
      v->full_q_num_blocks = v->full_q_indices = TensorView{};
    }
  }
}

// A case with everything the oracle and the GPU need.
struct CaseRun {
  int index = 0;
  FuzzCase fc;
  SparseMask mask;
  std::unique_ptr<AttnProblem> prob;
  int failures = 0;             // failed assertions of its GPU phases
  bool forward_ran = false;     // its GPU forward ran (its stored O feeds the backward and its oracle)
};

// Mask and inputs (host, uploaded), and dout (backward_params makes it; its outputs are poisoned
// again before the GPU runs).
void prepare_case(CaseRun* r) {
  ASSERT_NO_FATAL_FAILURE(build_fuzz_mask(r->fc, &r->mask));
  r->prob = std::make_unique<AttnProblem>(r->fc.sparse.attn);
  (void)r->prob->backward_params(Backend::kAuto, false);
}

// `work` for every prepared case of a batch accepted by `take`, on `threads` threads (CPU only: each
// case's own tensors).
template <class Take, class Work>
void on_threads(std::vector<std::unique_ptr<CaseRun>>& runs, int threads, Take take, Work work) {
  std::atomic<size_t> next{0};
  auto loop = [&] {
    for (size_t i = next++; i < runs.size(); i = next++) {
      CaseRun& r = *runs[i];
      if (!r.prob || !take(r)) continue;  // its preparation failed, or it is not for this phase
      SCOPED_TRACE(r.fc.describe());
      work(r);
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < std::min<int>(threads, static_cast<int>(runs.size())); ++t) pool.emplace_back(loop);
  loop();
  for (std::thread& t : pool) t.join();
}

// ---- the GPU against the oracle ------------------------------------------------------------------

struct FuzzStats {
  int cases = 0, failing = 0;
  int per_family[4] = {};
  int deterministic_run = 0;
  int hopper_forward = 0;   // cases whose forward ran on the Hopper kernel (kAuto picked it)
  int hopper_backward = 0;  // cases also run through the Hopper backward (kHopper)
  int hopper_deterministic = 0;  // deterministic arms also run on the Hopper backward
  double oracle_s = 0, gpu_s = 0;
};

// ---- the deterministic-backward arm ----
// attention_backward with deterministic = true and the mask's plan (make_block_sparse_dq_plan from
// its host copy): within the oracle's tolerance as the ordinary mode is, and bitwise identical
// over kDeterministicRuns runs; on the portable kernel (kAuto) and, where it applies, the Hopper
// one (kHopper).
void run_deterministic_arm(CaseRun& r, FuzzStats* stats) {
  AttnProblem& prob = *r.prob;
  const AttnCase& a = r.fc.sparse.attn;
  DqPlanOnDevice plan;
  const Status ps = plan.make(r.mask.host_view, a.batch, a.heads, a.heads_kv, a.seqlen_q, a.seqlen_k);
  ASSERT_TRUE(ps.ok()) << "deterministic backward's plan: " << ps.message();
  for (Backend backend : {Backend::kAuto, Backend::kHopper}) {
    if (backend == Backend::kHopper && !hopper_sparse_backward_runs(r.fc.sparse)) break;
    SCOPED_TRACE(backend == Backend::kHopper ? "hopper" : "auto");
    std::vector<unsigned char> first[3];
    for (int run = 0; run < kDeterministicRuns; ++run) {
      AttentionBackwardParams p = prob.backward_params(backend, /*deterministic=*/true);
      p.block_mask = &r.mask.device_view;
      plan.attach(&p);
      const Status s = attention_backward(p);
      ASSERT_TRUE(s.ok()) << "deterministic backward: " << s.message();
      FLARE_CUDA_OK(cudaDeviceSynchronize());
      prob.download_grads();
      const ref::HostTensor* grads[3] = {&prob.dq_host, &prob.dk_host, &prob.dv_host};
      const char* names[3] = {"dq", "dk", "dv"};
      for (int g = 0; g < 3; ++g) {
        const auto* bytes = static_cast<const unsigned char*>(grads[g]->data());
        if (run == 0) {
          first[g].assign(bytes, bytes + grads[g]->nbytes());
        } else {
          ASSERT_EQ(std::memcmp(first[g].data(), bytes, first[g].size()), 0)
              << "deterministic backward: " << names[g] << " of run " << run << " differs from run 0's";
        }
      }
      if (run == 0) prob.check_backward();
    }
    if (backend == Backend::kHopper) ++stats->hopper_deterministic;
  }
  ++stats->deterministic_run;
}
// ---- end of the deterministic-backward arm ----

// The forward on the GPU, checked against the oracle's.
void run_forward_on_gpu(CaseRun& r, FuzzStats* stats) {
  SCOPED_TRACE(r.fc.describe());
  AttnProblem& prob = *r.prob;
  AttentionForwardParams fwd = prob.forward_params(Backend::kAuto);  // out and lse poisoned
  fwd.block_mask = &r.mask.device_view;
  const Status fs = attention_forward(fwd);
  ASSERT_TRUE(fs.ok()) << "forward: " << fs.message();
  FLARE_CUDA_OK(cudaDeviceSynchronize());
  r.forward_ran = true;
  prob.check_forward();  // downloads the stored O into out_host
  if (hopper_sparse_runs(r.fc.sparse)) ++stats->hopper_forward;
}

// The ordinary backward (and the Hopper one where it applies) and the deterministic arm on the
// GPU, from the forward's stored O and LSE, checked against the oracle's.
void run_backward_on_gpu(CaseRun& r, bool deterministic_arm, FuzzStats* stats) {
  SCOPED_TRACE(r.fc.describe());
  AttnProblem& prob = *r.prob;
  AttentionBackwardParams bwd = prob.backward_params(Backend::kAuto, /*deterministic=*/false);  // grads poisoned
  bwd.block_mask = &r.mask.device_view;
  const Status bs = attention_backward(bwd);
  ASSERT_TRUE(bs.ok()) << "backward: " << bs.message();
  FLARE_CUDA_OK(cudaDeviceSynchronize());
  prob.check_backward();

  if (hopper_sparse_backward_runs(r.fc.sparse)) {  // the Hopper backward, grads poisoned again
    AttentionBackwardParams hb = prob.backward_params(Backend::kHopper, /*deterministic=*/false);
    hb.block_mask = &r.mask.device_view;
    const Status hs = attention_backward(hb);
    ASSERT_TRUE(hs.ok()) << "hopper backward: " << hs.message();
    FLARE_CUDA_OK(cudaDeviceSynchronize());
    prob.check_backward();
    ++stats->hopper_backward;
  }

  if (deterministic_arm) run_deterministic_arm(r, stats);
}

// Failed assertions of the running test so far.
int failed_parts() {
  const ::testing::TestResult* result = ::testing::UnitTest::GetInstance()->current_test_info()->result();
  int n = 0;
  for (int i = 0; i < result->total_part_count(); ++i) n += result->GetTestPartResult(i).failed();
  return n;
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

TEST(BlockSparseFuzzer, ForwardAndBackwardAgainstTheOracle) {
  FLARE_REQUIRE_GPU();
  const bool small = reduced();
  const bool replay = std::getenv("FLARE_FUZZ_SEED") != nullptr;
  const uint64_t replay_seed = env_u64("FLARE_FUZZ_SEED", 0);
  const uint64_t run_seed = env_u64(
      "FLARE_FUZZ_RUN_SEED",
      splitmix64(std::random_device{}() ^ static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count())));
  const int cases = replay ? 1 : static_cast<int>(env_u64("FLARE_FUZZ_CASES", small ? kReducedCases : kDefaultCases));
  const int threads = std::max(1, static_cast<int>(env_u64("FLARE_FUZZ_THREADS", std::thread::hardware_concurrency())));
  const bool deterministic_arm = env_u64("FLARE_FUZZ_DETERMINISTIC", 1) != 0;
  if (replay)
    std::printf("block-sparse fuzzer: replaying case seed %llu%s\n", static_cast<unsigned long long>(replay_seed),
                small ? " (reduced)" : "");
  else
    std::printf("block-sparse fuzzer: run seed %llu, %d cases%s, %d oracle threads (FLARE_FUZZ_RUN_SEED=%llu replays "
                "the run; a failing case prints its FLARE_FUZZ_SEED)\n",
                static_cast<unsigned long long>(run_seed), cases, small ? " (reduced)" : "", threads,
                static_cast<unsigned long long>(run_seed));
  std::fflush(stdout);
  auto case_seed = [&](int i) { return replay ? replay_seed : splitmix64(run_seed + static_cast<uint64_t>(i)); };
  auto report = [&](const CaseRun& r, FuzzStats* stats) {
    ++stats->failing;
    std::printf("FAILED case %d, %s\n  replay: %sFLARE_FUZZ_SEED=%llu tests/test_block_sparse_fuzz (in the build folder)\n", r.index,
                r.fc.describe().c_str(), small ? "FLARE_TEST_REDUCED=1 " : "",
                static_cast<unsigned long long>(r.fc.seed));
    std::fflush(stdout);
  };

  FuzzStats stats;
  const int batch = 2 * threads;
  bool stop = false;
  for (int first = 0; first < cases && !stop; first += batch) {
    std::vector<std::unique_ptr<CaseRun>> runs;
    for (int i = first; i < std::min(cases, first + batch); ++i) {
      auto r = std::make_unique<CaseRun>();
      r->index = i;
      r->fc = draw_case(case_seed(i), small);
      ++stats.per_family[static_cast<int>(r->fc.family)];
      const int before = failed_parts();
      {
        SCOPED_TRACE(r->fc.describe());
        prepare_case(r.get());
      }
      if (failed_parts() > before) {
        r->prob.reset();  // not run
        report(*r, &stats);
      }
      runs.push_back(std::move(r));
    }
    // Each GPU phase runs the batch's cases in order; a CUDA error or too many failing cases stop
    // the run (failing cases are reported once both phases are done).
    auto failing_so_far = [&] {
      int n = stats.failing;
      for (const std::unique_ptr<CaseRun>& r : runs) n += r->failures > 0;
      return n;
    };
    auto gpu_phase = [&](auto&& run_case) {
      const auto gpu_start = std::chrono::steady_clock::now();
      for (std::unique_ptr<CaseRun>& r : runs) {
        if (stop) break;
        if (!r->prob) continue;
        const int before = failed_parts();
        run_case(*r);
        r->failures += failed_parts() - before;
        const cudaError_t e = cudaDeviceSynchronize();
        if (e != cudaSuccess) {
          ADD_FAILURE() << "CUDA error after case " << r->index << " (seed " << r->fc.seed
                        << "), stopping: " << cudaGetErrorString(e);
          ++r->failures;
          stop = true;
        }
        if (failing_so_far() >= kMaxFailingCases) stop = true;
      }
      stats.gpu_s += seconds_since(gpu_start);
    };
    auto oracle_phase = [&](auto&& take, auto&& work) {
      const auto oracle_start = std::chrono::steady_clock::now();
      const int oracle_failures = failed_parts();
      on_threads(runs, threads, take, work);
      stats.oracle_s += seconds_since(oracle_start);
      return failed_parts() == oracle_failures;
    };
    auto all = [](const CaseRun&) { return true; };
    ASSERT_TRUE(oracle_phase(all, [](CaseRun& r) { run_sparse_forward_oracle(r.fc.sparse, r.mask, r.prob.get()); }))
        << "the oracle failed (see above)";
    gpu_phase([&](CaseRun& r) { run_forward_on_gpu(r, &stats); });
    // The backward in the input dtype reads D_i = dO_i . O_i from the forward kernel's stored O, as
    // the backward kernels do (an O of its own differs from it by an ulp here and there).
    ASSERT_TRUE(oracle_phase([](const CaseRun& r) { return r.forward_ran; },
                             [](CaseRun& r) { r.prob->run_backward_oracle(&r.mask.host_view, r.prob->out_host); }))
        << "the oracle failed (see above)";
    gpu_phase([&](CaseRun& r) {
      if (r.forward_ran) run_backward_on_gpu(r, deterministic_arm, &stats);
    });
    for (std::unique_ptr<CaseRun>& r : runs) {
      if (!r->prob || (!r->forward_ran && r->failures == 0)) continue;  // not prepared, or not reached
      ++stats.cases;
      if (r->failures > 0) report(*r, &stats);
    }
    if (stats.failing >= kMaxFailingCases) std::printf("stopping after %d failing cases\n", stats.failing);
  }

  std::printf("block-sparse fuzzer: %d cases run (block-grid %d, random-kinds %d, predicates %d, bits %d), %d failing; "
              "oracle %.1f s on %d threads, GPU and checks %.1f s; deterministic arm: %d cases%s; forward on the Hopper "
              "kernel: %d cases, backward also on the Hopper kernel: %d cases (deterministic: %d)\n",
              stats.cases, stats.per_family[0], stats.per_family[1], stats.per_family[2], stats.per_family[3],
              stats.failing, stats.oracle_s, threads, stats.gpu_s, stats.deterministic_run,
              deterministic_arm ? "" : " (arm off: FLARE_FUZZ_DETERMINISTIC=0)", stats.hopper_forward,
              stats.hopper_backward, stats.hopper_deterministic);
  EXPECT_EQ(stats.failing, 0);
}

}  // namespace
}  // namespace flare::test
