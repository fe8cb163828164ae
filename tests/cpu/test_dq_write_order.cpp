// The deterministic block-sparse backward's plan: walks and turns against brute force, the
// deadlock freedom by simulation of the persistent grid on thousands of masks (and a broken
// order caught as deadlock), and what the ordering costs at 8192 tokens.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "src/block_sparse/dq_write_order.h"
#include "src/scheduling/grid_sim.h"

namespace flare::block_sparse {
namespace {

using sched::BackwardCosts;
using sched::Dispatch;
using sched::SimOptions;
using sched::SimResult;
using sched::SimStep;
using sched::SimWorkload;

int pick(std::mt19937& rng, int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

SimWorkload workload_of(const DqPlanView& v, const BackwardCosts& costs) { return dq_plan_workload(v, costs); }

// ---- random masks and attention shapes ----------------------------------------------------------

struct Case {
  HostBlockMask mask;
  int batch = 1, heads = 1, heads_kv = 1;
  DqPlanOptions options;
  std::string name;
  std::vector<int32_t> doc_ids;  // the storage of a document mask's views
};

// Per-block kinds at a random density (5%..100% of blocks visible), partial or full at random.
void random_kinds(Case* c, int mask_batch, int mask_heads, std::mt19937& rng) {
  BlockMaskGeometry g;
  g.batch = mask_batch, g.heads = mask_heads;
  g.q_block_size = g.kv_block_size = 16;
  g.seqlen_q = 16 * pick(rng, 1, 16), g.seqlen_k = 16 * pick(rng, 1, 16);
  const double density = std::uniform_real_distribution<double>(0.05, 1.0)(rng);
  const double full_share = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
  BlockKindGrid kinds = BlockKindGrid::all_empty(g.batch, g.heads, g.num_q_blocks(), g.num_kv_blocks());
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (TileKind& k : kinds.kinds)
    k = u(rng) >= density ? TileKind::kEmpty : (u(rng) < full_share ? TileKind::kFull : TileKind::kPartial);
  ASSERT_TRUE(build_from_kinds(kinds, g, ElementMask{}, &c->mask).ok());
  c->name = "random density " + std::to_string(density);
}

// Causal, a window, or causal documents, over a random length in 16- or 32-token blocks.
void structured(Case* c, int mask_heads, std::mt19937& rng) {
  BlockMaskGeometry g;
  g.heads = mask_heads;
  g.q_block_size = g.kv_block_size = pick(rng, 0, 1) ? 16 : 32;
  g.seqlen_q = g.seqlen_k = pick(rng, 1, 400);
  ElementMask e;
  switch (pick(rng, 0, 2)) {
    case 0: e.causal = true, c->name = "causal"; break;
    case 1: e.causal = pick(rng, 0, 1), e.window_left = pick(rng, 0, 64), e.window_right = pick(rng, 0, 8); c->name = "window"; break;
    default: {
      g.batch = c->batch;  // documents differ per batch entry
      e.causal = true;
      c->doc_ids.resize(static_cast<size_t>(g.batch) * g.seqlen_q);
      for (int b = 0; b < g.batch; ++b) {
        int doc = 0;
        for (int i = 0; i < g.seqlen_q; ++i) c->doc_ids[b * g.seqlen_q + i] = doc += pick(rng, 0, 20) == 0;
      }
      e.doc_ids_q = TensorView::contiguous(c->doc_ids.data(), DType::kInt32, {g.batch, g.seqlen_q},
                                           Device{DeviceKind::kCPU, 0});
      e.doc_ids_k = e.doc_ids_q;
      c->name = "documents";
    }
  }
  const Status s = build_from_element_mask(e, g, &c->mask);
  ASSERT_TRUE(s.ok()) << s.message();
}

// A random attention shape (GQA groups 1..8), a mask of it or broadcast, random plan options.
void random_case(Case* c, std::mt19937& rng) {
  c->batch = pick(rng, 1, 2);
  c->heads = 1 << pick(rng, 0, 3);
  c->heads_kv = c->heads >> pick(rng, 0, 3);
  c->heads_kv = std::max(1, c->heads_kv);
  const int mask_batch = pick(rng, 0, 1) ? c->batch : 1;
  const int mask_heads = pick(rng, 0, 1) ? c->heads : 1;
  if (pick(rng, 0, 2) == 0)
    structured(c, mask_heads, rng);
  else
    random_kinds(c, mask_batch, mask_heads, rng);
  c->options.schedule = pick(rng, 0, 1) ? TileSchedule::kLongestFirst : TileSchedule::kShortestFirst;
  c->options.walk = pick(rng, 0, 3) ? WalkOrder::kPlanned : WalkOrder::kMonotone;
  const int hints[] = {1, 7, 132};
  c->options.resident_ctas = hints[pick(rng, 0, 2)];
}

std::string describe(const Case& c) {
  return c.name + " mask [" + std::to_string(c.mask.batch) + ", " + std::to_string(c.mask.heads) + "] " +
         std::to_string(c.mask.num_q_blocks) + " x " + std::to_string(c.mask.num_kv_blocks) + " blocks, attention " +
         std::to_string(c.batch) + " x " + std::to_string(c.heads) + " heads (" + std::to_string(c.heads_kv) +
         " kv), schedule " + std::to_string(static_cast<int>(c.options.schedule)) + " walk " +
         std::to_string(static_cast<int>(c.options.walk)) + " hint " + std::to_string(c.options.resident_ctas);
}

DqWritePlan plan_of(const Case& c) {
  DqWritePlan plan;
  const Status s = make_dq_write_plan(c.mask, c.batch, c.heads, c.heads_kv, c.options, &plan);
  EXPECT_TRUE(s.ok()) << s.message();
  return plan;
}

// ---- the plan against brute force ---------------------------------------------------------------

// Every property the kernel and the deadlock proof rely on.
void check_plan(const Case& c, const DqWritePlan& plan) {
  const DqPlanView v = plan.view();
  ASSERT_EQ(plan.bytes(), static_cast<size_t>(plan.layout.size) * sizeof(int32_t));
  // The schedule is a permutation of the tiles.
  std::vector<int> position(v.num_tiles(), -1);
  for (int p = 0; p < v.num_tiles(); ++p) {
    const int id = v.tile_id(v.tile_at(p));
    ASSERT_EQ(position[id], -1) << describe(c) << ": tile " << id << " scheduled twice";
    position[id] = p;
  }
  for (int b = 0; b < c.batch; ++b)
    for (int h = 0; h < c.heads; ++h) {
      // Per q block: the contributors, as (position, turn).
      std::vector<std::vector<std::pair<int, int>>> adds(v.num_q_blocks);
      std::vector<int32_t> want_blocks, want_full;
      for (int n = 0; n < v.num_kv_blocks; ++n) {
        const DqTile t{b, h, n};
        c.mask.q_blocks_of(b, h, n, &want_blocks, &want_full);
        std::vector<std::pair<int32_t, int32_t>> walk;  // (q block, full)
        for (int s = v.walk_begin(t); s < v.walk_end(t); ++s) {
          walk.push_back({v.q_block(s), v.is_full(s)});
          adds[v.q_block(s)].push_back({position[v.tile_id(t)], v.dq_turn(s)});
        }
        if (c.options.walk == WalkOrder::kMonotone) {
          const bool descending = c.options.schedule == TileSchedule::kLongestFirst;
          for (size_t k = 1; k < walk.size(); ++k)
            ASSERT_EQ(walk[k - 1].first > walk[k].first, descending) << describe(c) << ": walk not monotone";
        }
        std::sort(walk.begin(), walk.end());
        ASSERT_EQ(walk.size(), want_blocks.size()) << describe(c) << ": walk of kv block " << n;
        for (size_t k = 0; k < walk.size(); ++k) {
          ASSERT_EQ(walk[k].first, want_blocks[k]) << describe(c);
          ASSERT_EQ(walk[k].second, want_full[k]) << describe(c);
        }
      }
      // The rule of the proof: at every q block the turns are 0, 1, ... in schedule order.
      for (int m = 0; m < v.num_q_blocks; ++m) {
        std::sort(adds[m].begin(), adds[m].end());
        ASSERT_EQ(v.dq_num_turns(b, h, m), static_cast<int>(adds[m].size())) << describe(c);
        for (size_t k = 0; k < adds[m].size(); ++k)
          ASSERT_EQ(adds[m][k].second, static_cast<int>(k)) << describe(c) << ": turns at q block " << m;
      }
    }
  // The same rule for the GQA dK/dV adds of every (b, kv head, n).
  for (int b = 0; b < c.batch; ++b)
    for (int kv_head = 0; kv_head < c.heads_kv; ++kv_head)
      for (int n = 0; n < v.num_kv_blocks; ++n) {
        std::vector<std::pair<int, int>> adds;
        for (int j = 0; j < v.group; ++j) {
          const DqTile t{b, kv_head * v.group + j, n};
          adds.push_back({position[v.tile_id(t)], v.dkv_turn(t)});
        }
        std::sort(adds.begin(), adds.end());
        for (size_t k = 0; k < adds.size(); ++k) ASSERT_EQ(adds[k].second, static_cast<int>(k)) << describe(c);
      }
}

TEST(DqWriteOrder, PlansMatchBruteForce) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    Case c;
    random_case(&c, rng);
    check_plan(c, plan_of(c));
  }
}

// The portable kernel's finer turns (DqPlanView::dq_slice_turn, dq_tile_semaphore,
// dkv_slice_semaphore): walking the grid as the kernel launches it (schedule position, then key
// slice), every dQ semaphore of a query tile sees the turns 0, 1, 2, ... in grid order, as many as
// the q block's contributors times the key slices, and every dK/dV semaphore of a key slice the
// turns 0 .. group - 1; distinct tiles and slices never share a semaphore.
TEST(DqWriteOrder, KernelTileTurnsFollowTheGrid) {
  std::mt19937 rng(23);
  for (int trial = 0; trial < 200; ++trial) {
    Case c;
    random_case(&c, rng);
    const DqWritePlan plan = plan_of(c);
    const DqPlanView v = plan.view();
    const int query_tiles = pick(rng, 1, 3), key_slices = 1 << pick(rng, 0, 2);
    std::map<int64_t, int> dq_next, dkv_next;  // semaphore -> the turn it shows
    std::map<int64_t, std::tuple<int, int, int, int>> dq_owner;
    std::map<int64_t, std::tuple<int, int, int, int>> dkv_owner;
    for (int position = 0; position < v.num_tiles(); ++position)
      for (int slice = 0; slice < key_slices; ++slice) {
        const DqTile t = v.tile_at(position);
        for (int step = v.walk_begin(t); step < v.walk_end(t); ++step)
          for (int j = 0; j < query_tiles; ++j) {
            const int m = v.q_block(step);
            const int64_t sem = v.dq_tile_semaphore(t.batch, t.head, m, j, query_tiles);
            ASSERT_GE(sem, 0);
            ASSERT_LT(sem, int64_t{c.batch} * c.heads * v.num_q_blocks * query_tiles);
            const auto owner = std::make_tuple(t.batch, t.head, m, j);
            ASSERT_TRUE(dq_owner.emplace(sem, owner).first->second == owner) << describe(c);
            ASSERT_EQ(v.dq_slice_turn(step, slice, key_slices), dq_next[sem]++) << describe(c);
          }
        if (v.group > 1) {
          const int64_t sem = v.dkv_slice_semaphore(t.batch, t.head / v.group, t.kv_block, slice, key_slices);
          ASSERT_LT(sem, int64_t{c.batch} * c.heads_kv * v.num_kv_blocks * key_slices);
          const auto owner = std::make_tuple(t.batch, t.head / v.group, t.kv_block, slice);
          ASSERT_TRUE(dkv_owner.emplace(sem, owner).first->second == owner) << describe(c);
          ASSERT_EQ(v.dkv_turn(t), dkv_next[sem]++) << describe(c);
        }
      }
    for (const auto& [sem, turns] : dq_next) {
      const auto [b, h, m, j] = dq_owner[sem];
      ASSERT_EQ(turns, v.dq_num_turns(b, h, m) * key_slices) << describe(c);
    }
    for (const auto& [sem, turns] : dkv_next) ASSERT_EQ(turns, v.group) << describe(c);
  }
}

// The kernel reads an uploaded copy of the buffer through the same view.
TEST(DqWriteOrder, HeadGroupKeepsTheQSideInL2) {
  const int64_t h100 = int64_t{50} << 20;
  EXPECT_EQ(dq_plan_head_group(8192, h100), 4);  // 8 MiB a head: 4 fit in 2/3 of 50 MiB
  EXPECT_EQ(dq_plan_head_group(8192, 0), 4);     // no device: the H100's L2
  EXPECT_EQ(dq_plan_head_group(1024, h100), 33);
  EXPECT_EQ(dq_plan_head_group(int64_t{1} << 20, h100), 1);
  EXPECT_EQ(dq_plan_head_group(0, h100), 34133);  // as one query
  EXPECT_EQ(even_head_group(4, 32), 4);
  EXPECT_EQ(even_head_group(5, 32), 8);  // the H200's 5 heads a group, of 2 x 16: no short last group
  EXPECT_EQ(even_head_group(3, 30), 3);
  EXPECT_EQ(even_head_group(7, 30), 10);
  EXPECT_EQ(even_head_group(33, 32), 32);  // all of them
  EXPECT_EQ(even_head_group(0, 12), 1);
  EXPECT_EQ(even_head_group(5, 7), 7);
}

// The head-group rule on issue 6's masks (batch 2, 16 heads, seqlen 8192, 128 x 128 blocks, broadcast
// masks): the choices measured best on the H100 and the H200 (dq_write_order.h).
TEST(DqWriteOrder, HeadGroupFollowsTheMask) {
  const int seqlen = 8192, blocks = 64;
  BlockMaskGeometry g;
  g.seqlen_q = g.seqlen_k = seqlen, g.q_block_size = g.kv_block_size = 128;
  std::vector<int32_t> docs;
  for (int d = 0, lengths[] = {332, 1790, 1034, 290, 2764, 708, 375, 899}; d < 8; ++d)
    docs.insert(docs.end(), lengths[d], d);
  const int64_t h100 = int64_t{50} << 20;
  for (int kind = 0; kind < 4; ++kind) {
    HostBlockMask mask;
    if (kind == 3) {
      std::mt19937 rng(7);
      std::uniform_real_distribution<double> u(0.0, 1.0);
      BlockKindGrid kinds = BlockKindGrid::all_empty(1, 1, blocks, blocks);
      for (TileKind& k : kinds.kinds) k = u(rng) < 0.25 ? TileKind::kFull : TileKind::kEmpty;
      ASSERT_TRUE(build_from_kinds(kinds, g, ElementMask{}, &mask).ok());
    } else {
      ElementMask e;
      e.causal = kind < 2;
      if (kind == 1) e.window_left = 1024;
      if (kind == 2) {
        e.doc_ids_q = TensorView::contiguous(docs.data(), DType::kInt32, {1, seqlen}, Device{DeviceKind::kCPU, 0});
        e.doc_ids_k = e.doc_ids_q;
      }
      ASSERT_TRUE(build_from_element_mask(e, g, &mask).ok());
    }
    DqWritePlan plan;
    ASSERT_TRUE(make_dq_write_plan(mask, 2, 16, 16, DqPlanOptions{}, &plan).ok());
    const double overlap = dq_plan_list_overlap(plan.view());
    EXPECT_EQ(overlap < 0.5, kind == 3) << kind << ": overlap " << overlap;
    EXPECT_EQ(choose_dq_plan_head_group(mask, 2, 16, 16, seqlen, h100), kind == 2 ? 0 : 4) << kind;
    // The H200's 60 MB: 5 heads fit, rounded up to 8, a divisor of the 32 (b, h) (even_head_group).
    const int64_t h200 = int64_t{60} << 20;
    EXPECT_EQ(choose_dq_plan_head_group(mask, 2, 16, 16, seqlen, h200), kind == 2 ? 0 : 8) << kind;
  }
  // Few enough heads for one group: interleaving them all is the same schedule.
  HostBlockMask causal;
  ElementMask e;
  e.causal = true;
  ASSERT_TRUE(build_from_element_mask(e, g, &causal).ok());
  EXPECT_EQ(choose_dq_plan_head_group(causal, 1, 4, 4, seqlen, h100), 0);
}

TEST(DqWriteOrder, ViewOfACopyReadsTheSame) {
  std::mt19937 rng(12);
  Case c;
  random_case(&c, rng);
  const DqWritePlan plan = plan_of(c);
  const std::vector<int32_t> uploaded = plan.data;
  const DqPlanView original = plan.view(), copy = plan.view_at(uploaded.data());
  for (int p = 0; p < original.num_tiles(); ++p) {
    const DqTile t = original.tile_at(p), u = copy.tile_at(p);
    ASSERT_EQ(original.tile_id(t), copy.tile_id(u));
    ASSERT_EQ(original.walk_begin(t), copy.walk_begin(u));
    ASSERT_EQ(original.walk_end(t), copy.walk_end(u));
    ASSERT_EQ(original.dkv_turn(t), copy.dkv_turn(u));
  }
}

TEST(DqWriteOrder, RejectsMismatchedShapes) {
  BlockMaskGeometry g;
  g.heads = 2, g.seqlen_q = g.seqlen_k = 64, g.q_block_size = g.kv_block_size = 32;
  ElementMask causal;
  causal.causal = true;
  HostBlockMask mask;
  ASSERT_TRUE(build_from_element_mask(causal, g, &mask).ok());
  DqWritePlan plan;
  EXPECT_NE(make_dq_write_plan(mask, 1, 4, 4, {}, &plan).message().find("'mask'"), std::string::npos);
  EXPECT_NE(make_dq_write_plan(mask, 1, 2, 3, {}, &plan).message().find("'heads_kv'"), std::string::npos);
  mask.partial_q = BlockList{};
  EXPECT_NE(make_dq_write_plan(mask, 1, 2, 2, {}, &plan).message().find("transposed"), std::string::npos);
}

// ---- deadlock freedom by simulation ---------------------------------------------------------------

const int kResidentCtas[] = {1, 2, 7, 132};

// Completes, every semaphore ends at its number of turns, and a single CTA never waits (a wait
// there could never end).
void expect_completes(const Case& c, const DqWritePlan& plan, int ctas, Dispatch dispatch) {
  const DqPlanView v = plan.view();
  SimOptions o;
  o.resident_ctas = ctas, o.dispatch = dispatch;
  const SimResult r = simulate_grid(workload_of(v, BackwardCosts{}), o);
  const std::string what = describe(c) + ", P=" + std::to_string(ctas) + (dispatch == Dispatch::kStatic ? " static" : " dynamic");
  ASSERT_TRUE(r.completed) << what << ": deadlock, " << r.stuck_tiles.size() << " tiles stuck";
  if (ctas == 1) {
    EXPECT_EQ(r.total_wait, 0.0) << what;
  }
  for (int b = 0; b < c.batch; ++b)
    for (int h = 0; h < c.heads; ++h)
      for (int m = 0; m < v.num_q_blocks; ++m)
        ASSERT_EQ(r.final_semaphores[v.dq_semaphore(b, h, m)], v.dq_num_turns(b, h, m)) << what;
  if (v.group == 1) return;
  for (int b = 0; b < c.batch; ++b)
    for (int kv_head = 0; kv_head < c.heads_kv; ++kv_head)
      for (int n = 0; n < v.num_kv_blocks; ++n)
        ASSERT_EQ(r.final_semaphores[v.dkv_semaphore(b, kv_head, n)], v.dkv_num_turns()) << what;
}

TEST(DqWriteOrder, EveryPlanCompletesOnEveryResidencyAndDispatch) {
  std::mt19937 rng(13);
  const int kMasks = 3000;
  int runs = 0, runs_short_of_ctas = 0;  // the latter: more tiles than resident CTAs
  for (int trial = 0; trial < kMasks; ++trial) {
    Case c;
    random_case(&c, rng);
    const DqWritePlan plan = plan_of(c);
    for (int ctas : kResidentCtas)
      for (Dispatch d : {Dispatch::kStatic, Dispatch::kDynamic}) {
        expect_completes(c, plan, ctas, d);
        ++runs;
        runs_short_of_ctas += plan.view().num_tiles() > ctas;
      }
    if (HasFatalFailure()) return;
  }
  EXPECT_EQ(runs, kMasks * 8);
  EXPECT_GT(runs_short_of_ctas, runs / 2);  // residency binds in most runs
  std::printf("%d runs, %d with more tiles than resident CTAs\n", runs, runs_short_of_ctas);
}

// A causal mask with more tiles than CTAs: 2 heads of 16 kv blocks.
Case causal_case(int heads, int heads_kv) {
  Case c;
  BlockMaskGeometry g;
  g.seqlen_q = g.seqlen_k = 512, g.q_block_size = g.kv_block_size = 32;
  ElementMask causal;
  causal.causal = true;
  EXPECT_TRUE(build_from_element_mask(causal, g, &c.mask).ok());
  c.heads = heads, c.heads_kv = heads_kv, c.name = "causal";
  return c;
}

// Turns that break the rule must be caught: reversed at every q block, a tile waits for tiles
// after it, which never start while it holds the only CTAs.
TEST(DqWriteOrder, ReversedTurnsDeadlock) {
  const Case c = causal_case(2, 2);
  const DqWritePlan plan = plan_of(c);
  const DqPlanView v = plan.view();
  SimWorkload w = workload_of(v, BackwardCosts{});
  for (int p = 0; p < v.num_tiles(); ++p) {
    const DqTile t = v.tile_at(p);
    for (size_t k = 0; k < w.tiles[p].size(); ++k) {
      const int m = v.q_block(v.walk_begin(t) + static_cast<int>(k));
      w.tiles[p][k].turn = v.dq_num_turns(t.batch, t.head, m) - 1 - w.tiles[p][k].turn;
    }
  }
  for (int ctas : {1, 2, 7})
    for (Dispatch d : {Dispatch::kStatic, Dispatch::kDynamic}) {
      SimOptions o;
      o.resident_ctas = ctas, o.dispatch = d;
      const SimResult r = simulate_grid(w, o);
      EXPECT_FALSE(r.completed) << "P=" << ctas;
      EXPECT_FALSE(r.stuck_tiles.empty()) << "P=" << ctas;
    }
  SimOptions all_resident;  // 32 tiles on 132 CTAs: every tile runs, the reversed order only waits
  all_resident.resident_ctas = 132;
  EXPECT_TRUE(simulate_grid(w, all_resident).completed);
}

// The turns belong to their schedule: a longest-first plan's turns run in the shortest-first
// order deadlock, and so do reversed GQA dK/dV turns.
TEST(DqWriteOrder, TurnsOfAnotherScheduleOrReversedDkvTurnsDeadlock) {
  Case longest = causal_case(2, 2), shortest = causal_case(2, 2);
  shortest.options.schedule = TileSchedule::kShortestFirst;
  const DqWritePlan plan = plan_of(longest), other = plan_of(shortest);
  const SimWorkload by_id = [&] {  // the longest-first plan's tiles, indexed by tile id
    const SimWorkload w = workload_of(plan.view(), BackwardCosts{});
    SimWorkload out = w;
    for (int p = 0; p < plan.view().num_tiles(); ++p) out.tiles[plan.view().tile_id(plan.view().tile_at(p))] = w.tiles[p];
    return out;
  }();
  SimWorkload mixed = by_id;
  for (int p = 0; p < other.view().num_tiles(); ++p) mixed.tiles[p] = by_id.tiles[other.view().tile_id(other.view().tile_at(p))];
  SimOptions one;
  one.resident_ctas = 1;
  EXPECT_FALSE(simulate_grid(mixed, one).completed);

  const Case gqa = causal_case(4, 1);
  const DqWritePlan gqa_plan = plan_of(gqa);
  const DqPlanView v = gqa_plan.view();
  SimWorkload w = workload_of(v, BackwardCosts{});
  ASSERT_TRUE(simulate_grid(w, one).completed);
  for (std::vector<SimStep>& tile : w.tiles) tile.back().turn = v.dkv_num_turns() - 1 - tile.back().turn;
  EXPECT_FALSE(simulate_grid(w, one).completed);
}

// ---- what the order costs ---------------------------------------------------------------------------

constexpr int kH100Ctas = 132;

double makespan(const SimWorkload& w, Dispatch d, bool semaphores, SimResult* out = nullptr) {
  SimOptions o;
  o.resident_ctas = kH100Ctas, o.dispatch = d, o.use_semaphores = semaphores;
  SimResult r = simulate_grid(w, o);
  EXPECT_TRUE(r.completed);
  if (out != nullptr) *out = r;
  return r.makespan;
}

// The ordinary (non-deterministic) backward: the same tiles, longest first, atomic adds.
SimWorkload ordinary_of(const SimWorkload& det) {
  SimWorkload w;
  w.tiles = det.tiles;
  std::stable_sort(w.tiles.begin(), w.tiles.end(), [](const auto& a, const auto& b) { return a.size() > b.size(); });
  for (std::vector<SimStep>& tile : w.tiles)
    for (SimStep& s : tile) s.semaphore = -1;
  return w;
}

// The plan's tiles re-sorted head-major (each head's tiles consecutive, in their order): the turns
// stay valid, only the interleaving is gone.
SimWorkload head_major_of(const DqPlanView& v, const SimWorkload& det) {
  std::vector<int> positions(det.tiles.size());
  for (size_t p = 0; p < positions.size(); ++p) positions[p] = static_cast<int>(p);
  std::stable_sort(positions.begin(), positions.end(), [&](int a, int b) {
    const DqTile ta = v.tile_at(a), tb = v.tile_at(b);
    return ta.batch * v.heads + ta.head < tb.batch * v.heads + tb.head;
  });
  SimWorkload w = det;
  for (size_t p = 0; p < positions.size(); ++p) w.tiles[p] = det.tiles[positions[p]];
  return w;
}

// Step costs scaled by U(0.5, 1.5): the plan was made for nominal costs.
SimWorkload noisy(SimWorkload w) {
  std::mt19937 rng(21);
  std::uniform_real_distribution<double> scale(0.5, 1.5);
  for (std::vector<SimStep>& tile : w.tiles)
    for (SimStep& s : tile) s.compute *= scale(rng);
  return w;
}

SimWorkload without_semaphores(SimWorkload w) {
  for (std::vector<SimStep>& tile : w.tiles)
    for (SimStep& s : tile) s.semaphore = -1;
  return w;
}

// 8192 tokens in 128 x 128 blocks, one batch entry, 132 CTAs, a block 1 unit, a dQ add 0.05.
// "ordinary": no semaphores, all tiles longest first. "free": the plan's order without semaphores.
// "det": the plan (longest first, planned walks) with semaphores; /free is the cost of the
// ordering itself; path = semaphore links / steps of the critical path (the serialization).
// "noisy": det / free with every step cost scaled by U(0.5, 1.5). The last three columns are det /
// ordinary for the alternatives: shortest first, monotone walks, head-major tiles.
TEST(DqWriteOrder, ReportsTheCostOfTheOrderAt8192Tokens) {
  const int seqlen = 8192, block = 128, blocks = seqlen / block;
  BlockMaskGeometry g;
  g.seqlen_q = g.seqlen_k = seqlen, g.q_block_size = g.kv_block_size = block;
  std::vector<int32_t> docs(seqlen);
  std::mt19937 rng(3);
  std::vector<int> starts;
  for (int d = 0; d < 7; ++d) starts.push_back(pick(rng, 1, seqlen - 1));
  std::sort(starts.begin(), starts.end());
  for (int i = 0; i < seqlen; ++i)
    docs[i] = static_cast<int32_t>(std::upper_bound(starts.begin(), starts.end(), i) - starts.begin());

  struct Mask {
    const char* name;
    ElementMask element;
    bool random = false;
  };
  std::vector<Mask> masks(4);
  masks[0].name = "causal", masks[0].element.causal = true;
  masks[1].name = "window 1024", masks[1].element.causal = true, masks[1].element.window_left = 1024;
  masks[2].name = "8 documents", masks[2].element.causal = true;
  masks[2].element.doc_ids_q = TensorView::contiguous(docs.data(), DType::kInt32, {1, seqlen}, Device{DeviceKind::kCPU, 0});
  masks[2].element.doc_ids_k = masks[2].element.doc_ids_q;
  masks[3].name = "random 25%", masks[3].random = true;

  std::printf("%-11s %5s | %8s %8s | %8s %6s %6s %5s %9s | %6s %6s | %6s %6s %6s %6s %6s\n", "mask", "heads", "ordinary",
              "free", "det dyn", "/free", "/ord", "wait", "path", "static", "noisy", "SPT", "monot", "h-major", "grp 2", "grp 4");
  for (const Mask& m : masks)
    for (int heads : {16, 1}) {
      HostBlockMask mask;
      if (m.random) {  // a different random 25% of blocks per head, half of them partial
        BlockMaskGeometry per_head = g;
        per_head.heads = heads;
        BlockKindGrid kinds = BlockKindGrid::all_empty(1, heads, blocks, blocks);
        std::uniform_real_distribution<double> u(0.0, 1.0);
        for (TileKind& k : kinds.kinds) {
          const double x = u(rng);
          k = x < 0.125 ? TileKind::kPartial : (x < 0.25 ? TileKind::kFull : TileKind::kEmpty);
        }
        ASSERT_TRUE(build_from_kinds(kinds, per_head, ElementMask{}, &mask).ok());
      } else {
        ASSERT_TRUE(build_from_element_mask(m.element, g, &mask).ok());
      }
      auto det_workload = [&](DqPlanOptions options, DqWritePlan* plan) {
        EXPECT_TRUE(make_dq_write_plan(mask, 1, heads, heads, options, plan).ok());
        return workload_of(plan->view(), BackwardCosts{});
      };
      DqWritePlan plan, spt_plan, monotone_plan;
      const SimWorkload det = det_workload(DqPlanOptions{}, &plan);
      DqPlanOptions spt, monotone;
      spt.schedule = TileSchedule::kShortestFirst;
      monotone.walk = WalkOrder::kMonotone;
      const SimWorkload det_spt = det_workload(spt, &spt_plan), det_monotone = det_workload(monotone, &monotone_plan);

      const double ordinary = makespan(ordinary_of(det), Dispatch::kDynamic, false);
      const double free = makespan(det, Dispatch::kDynamic, false);
      SimResult r;
      const double dynamic = makespan(det, Dispatch::kDynamic, true, &r);
      const double static_ratio = makespan(det, Dispatch::kStatic, true) / free;
      const SimWorkload shaken = noisy(det);
      const double noisy_ratio =
          makespan(shaken, Dispatch::kDynamic, true) / makespan(without_semaphores(shaken), Dispatch::kDynamic, false);
      const double spt_ratio = makespan(det_spt, Dispatch::kDynamic, true) / ordinary;
      const double monotone_ratio = makespan(det_monotone, Dispatch::kDynamic, true) / ordinary;
      const double head_major_ratio = makespan(head_major_of(plan.view(), det), Dispatch::kDynamic, true) / ordinary;
      double group_ratio[2];
      for (int i = 0; i < 2; ++i) {
        DqPlanOptions grouped;
        grouped.head_group = 2 << i;
        DqWritePlan grouped_plan;
        group_ratio[i] = makespan(det_workload(grouped, &grouped_plan), Dispatch::kDynamic, true) / ordinary;
      }
      std::printf("%-11s %5d | %8.1f %8.1f | %8.1f %6.3f %6.3f %5.1f %4d/%-4d | %6.3f %6.3f | %6.3f %6.3f %6.3f %6.3f %6.3f\n",
                  m.name, heads, ordinary, free, dynamic, dynamic / free, dynamic / ordinary, r.total_wait / kH100Ctas,
                  r.semaphore_links(), static_cast<int>(r.critical_path.size()), static_ratio, noisy_ratio, spt_ratio,
                  monotone_ratio, head_major_ratio, group_ratio[0], group_ratio[1]);
      // With many heads the ordering costs a few percent. A single head's tiles are all resident
      // at once and every q block's adds chain through them in schedule order: a random mask
      // pays for that chain (the GPU is a third idle there anyway: 64 tiles on 132 CTAs).
      EXPECT_LT(dynamic / free, heads > 1 ? 1.05 : 1.3) << m.name;
    }
}

}  // namespace
}  // namespace flare::block_sparse
