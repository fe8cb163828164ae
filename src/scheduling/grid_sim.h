// CPU simulation of a persistent grid whose tiles take turns on semaphores: the proof that a
// turn order cannot deadlock on a given residency, and the measure of what the ordering costs.
// Host only.
//
// Model. P resident CTAs. Each takes tiles in increasing tile index: statically (CTA c runs
// c, c + P, c + 2P, ...) or dynamically (the next index from a shared counter when it frees up).
// A tile is a list of steps; a step computes for `compute` time, then (if it has a semaphore)
// waits until the semaphore equals its turn, holds it for `add` time, and increments it. A waiting
// CTA does nothing else (as a kernel spinning on the semaphore). Events are processed in time
// order, equal times by CTA number, so a run is reproducible. When no event is left and some
// tile is still waiting, the grid is deadlocked.
#pragma once

#include <vector>

#include "src/scheduling/dq_turns.h"
#include "src/scheduling/tile_order.h"

namespace flare::sched {

enum class Dispatch : int { kStatic = 0, kDynamic = 1 };

struct SimStep {
  double compute = 1.0;  // work before the ordered add
  int semaphore = -1;    // -1: an unordered add (atomic), no wait
  int turn = 0;          // the add starts when semaphore == turn
  double add = 0.0;      // time inside the turn
};

struct SimWorkload {
  std::vector<std::vector<SimStep>> tiles;  // by tile index; each tile's steps in its order
  int num_semaphores = 0;
};

struct SimOptions {
  int resident_ctas = 132;
  Dispatch dispatch = Dispatch::kStatic;
  bool use_semaphores = true;  // false: every add unordered (what the ordinary kernel does)
  // Buffered adds (simulate_grid_buffered): a step's dQ goes into one of `add_slots` buffers of its
  // CTA, whose writer waits for the turn and adds, while the CTA computes on; a buffer is free again
  // `slot_read` after its add starts (the bulk add has read it), and the semaphore moves when the
  // add ends (SimStep::add after its start). A CTA whose buffers are all taken waits for one.
  int add_slots = 1;
  double slot_read = 0.0;
  // Writers per CTA (0: as many as adds). A CTA's steps go to its writers in turn (step i to writer
  // i mod W, counted over the CTA's steps); a writer takes its adds one at a time, from waiting for
  // the turn to the semaphore's move, as the kernels' writer threads do.
  int add_writers = 0;
  // Per tile (simulate_grid_buffered): `tile_start` added to a tile's first step (the CTA's set-up
  // and its K/V loads), and with `drain_adds` a CTA takes its next tile only once every add of the
  // last one is done (a CTA per tile whose writers finish their adds and hand-overs before it
  // exits, as the deterministic kernels' do; a persistent CTA would go on).
  double tile_start = 0.0;
  bool drain_adds = false;
  double compute_jitter = 0.0;  // every step's compute scaled by 1 + U(-j, j), drawn from `seed`
  unsigned seed = 1;
};

// One step on the critical path.
struct CriticalLink {
  int tile = 0, step = 0;
  double start = 0, end = 0;     // compute start, add end
  bool after_semaphore = false;  // reached from another tile's add through the semaphore
};

struct SimResult {
  bool completed = false;
  std::vector<int> stuck_tiles;  // deadlocked: resident tiles waiting for a turn that never comes
  double makespan = 0;           // end of the last step
  double total_wait = 0;         // CTA time spent waiting for turns
  double total_work = 0;         // compute + add time of all steps
  std::vector<int> final_semaphores;
  // The chain of steps that ends at the makespan: each link starts when the one before it ends,
  // on the same CTA or through a semaphore. Its semaphore links are the serialization.
  std::vector<CriticalLink> critical_path;

  int semaphore_links() const;
};

SimResult simulate_grid(const SimWorkload& work, const SimOptions& options);

// The same grid with buffered adds (SimOptions::add_slots >= 1): the kernels' form, where a CTA
// only waits when all its dQ buffers still wait for their turns. total_wait is the CTAs' time
// waiting for a free buffer; no critical path.
SimResult simulate_grid_buffered(const SimWorkload& work, const SimOptions& options);

// The workload with the accumulators of semaphores [0, replicated) in `replicas` copies
// (dq_replica_turn): the step of turn t on such a semaphore waits on copy t mod R's semaphore for
// turn t / R. Other ordered adds and unordered ones are unchanged.
SimWorkload with_dq_replicas(const SimWorkload& work, int replicas, int replicated);

// ---- backward workloads: one step per visited q-block, plus the GQA dK/dV add ------------------

struct BackwardCosts {
  double full_block = 1.0;     // a (q-block, kv-block) pair with no masked element
  double partial_block = 1.0;  // one that needs the element mask (diagonal, window edge, tail)
  double dq_add = 0.05;        // the dQ accumulation of one step
  double dkv_add = 0.1;        // the dK/dV accumulation of one tile (GQA only)
};

// Per batch entry lengths (varlen); empty: every sequence has the max lengths of the shape.
struct SeqLengths {
  std::vector<int> q, k;
};

// Semaphores: dQ of (b, h, m) at (b * heads + h) * max_q_blocks + m, then dK/dV of
// (b, kv head, n) at dq_semaphores + (b * heads_kv + kv_head) * max_kv_blocks + n.
int dq_semaphore(const TileShape& s, int b, int h, int m);
int num_dq_semaphores(const TileShape& s);  // the dQ ones come first: [0, num_dq_semaphores)
int dkv_semaphore(const TileShape& s, int b, int kv_head, int n);

// The deterministic backward of a plan: its tile order, walks and turns.
SimWorkload deterministic_backward_workload(const DqPlan& plan, const TileShape& shape, const SeqLengths& lengths,
                                            const BackwardCosts& costs);
// The ordinary backward: `order` (make_backward_order(..., false)), q-blocks ascending, atomic adds.
SimWorkload ordinary_backward_workload(const TileOrder& order, const TileShape& shape, const SeqLengths& lengths,
                                       const BackwardCosts& costs);

}  // namespace flare::sched
