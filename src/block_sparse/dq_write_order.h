// The deterministic block-sparse backward's plan: which q blocks each (b, h, kv block n) tile
// visits and in which order, the turn of each of its dQ adds, and the order in which the
// persistent grid takes the tiles. Computed once per mask and attention shape on the host and
// reused by every layer that shares the mask; all of it is one int32 buffer (one upload).
//
// The protocol (as in dq_turns.h). The dQ of (b, h, q block m) is an fp32 accumulator with a
// semaphore counting finished adds. Tile (b, h, n) adds its contribution to m when the semaphore
// equals dq_write_order(n, m), then increments it. The turns at m are 0..dq_num_turns(m) - 1,
// one per kv block that sees m, so the adds happen in one fixed order: bitwise reproducible.
// With GQA the q heads of a kv head add their dK/dV of block n the same way (dkv_write_order);
// every q head's tile takes its turn, even one that visits no q block (it adds zeros).
//
// The rule: turns follow the schedule. At every q block, and every GQA dK/dV block, the turns
// rank the contributing tiles by their position in the schedule, so a tile only ever waits for
// tiles dispatched before it.
//
// Why it cannot deadlock, for P >= 1 resident CTAs, static dispatch (CTA c runs positions c,
// c + P, c + 2P, ...) or dynamic (the next position from a counter), any walk order and any
// schedule. Take the unfinished tile t at the lowest position.
//  - t is resident. Dynamic: positions are handed out in increasing order, so if t is not out yet
//    no later tile is, every tile out is finished, and a free CTA takes t. Static: t's CTA has
//    finished its earlier positions t - P, t - 2P, ... (all lower), so it holds t.
//  - t never waits forever. At each of its adds the lower turns belong exactly to the
//    contributors at lower positions, all finished; contributors at higher positions wait for
//    higher turns and have not added. So the semaphore shows t's turn.
// The lowest unfinished tile always advances; by induction every tile finishes. Unlike the
// rotated order of dq_turns.h, nothing here depends on the number of resident CTAs. The
// simulation (tests/cpu/test_dq_write_order.cpp) checks it on thousands of masks and shows that
// turns breaking the rule deadlock.
//
// Which order: waiting, not deadlock. A tile computes a block's contribution, then waits for its
// turn; it waits when the tile holding the previous turn has not added yet. Three choices, each
// measured with the grid simulation (8192 tokens, 128 x 128 blocks, 16 heads, 132 CTAs, dynamic
// dispatch; the table is printed by tests/cpu/test_dq_write_order.cpp), against the ordinary
// backward (all tiles longest first, atomic adds):
//  - Heads interleaved. The schedule takes the first tile of every (b, h), then the second of
//    every (b, h), and so on. Tiles of one head share semaphores, so the fewer of them run at
//    once the fewer waits: interleaved, about resident CTAs / (batch * heads) of them do. Keeping
//    a head's tiles consecutive (as dq_turns.h does for dense masks) costs 1.12x (causal) to
//    3.4x (random 25% of blocks).
//  - Longest first inside a head (most q blocks; ties: the earlier last q block, then the lower
//    kv block), so the short tiles fill the grid's tail, as in the ordinary backward.
//    kShortestFirst (ties: the later first q block, then the higher kv block) is the mirror
//    image; its tail is worse (causal: 1.12x against 1.00x).
//  - Planned walks. A tile's turns do not depend on the order it walks its q blocks, so the
//    walk is free. Every predecessor of a tile (at any of its q blocks) comes earlier in the
//    schedule, so one pass over the schedule, modelling the grid (dynamic dispatch onto
//    `resident_ctas` CTAs, nominal block costs), knows when each predecessor's add ends; the
//    tile walks its q blocks in that order (ties: the monotone order below) and its own adds
//    are recorded for its successors. kMonotone walks q blocks descending under longest first
//    (causal tiles then reach each q block at the same step; ties only queue the short adds)
//    and ascending under shortest first (the earlier, shorter tile gets there first). Monotone
//    walks serialize across document boundaries (a tile straddling two documents takes its
//    last turn at its first q block): 2.1x for one head of 8 documents, 1.04x planned.
// Result: 1.00-1.03x the ordinary backward for causal, sliding window, 8 documents and random 25%
// masks at 16 heads; 1.01-1.06x when every step cost is scaled by a random 0.5-1.5 the plan did
// not know; up to 1.12x under static dispatch, which the model does not plan for (take tiles
// from a counter, as dq_turns.h concludes). The weak case is a single head of a random mask
// (1.26x): its 64 tiles are all resident at once and each q block's adds chain through them.
// A broadcast mask has one walk per mask row; it is planned at the row's first tile in the
// schedule and kept for the other heads (their tiles of the same rank run alongside it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "flare/block_mask.h"
#include "flare/status.h"
#include "src/block_sparse/block_mask_build.h"
#include "src/scheduling/grid_sim.h"
#include "src/scheduling/mask_math.h"

namespace flare::block_sparse {

// Both interleave the heads (rank r of every (b, h) before rank r + 1).
enum class TileSchedule : int {
  kLongestFirst = 0,   // a head's tiles with the most q blocks first
  kShortestFirst = 1,  // the fewest first
};

enum class WalkOrder : int {
  kPlanned = 0,   // by the modelled end of the predecessor's add at each q block
  kMonotone = 1,  // q blocks descending (longest first) or ascending (shortest first)
};

struct DqPlanOptions {
  TileSchedule schedule = TileSchedule::kLongestFirst;
  WalkOrder walk = WalkOrder::kPlanned;
  // The planned walk's model of the launch: resident CTAs (SMs x CTAs per SM) and step costs in
  // units of a full block. Only the speed depends on them, never the deadlock freedom.
  int resident_ctas = 132;
  // Heads interleaved in groups of this many (b, h) (0: all of them): rank r of every head of a
  // group, then rank r + 1, group after group. Smaller groups keep fewer heads' Q and dO in
  // flight (L2 reuse) and make more tiles of one head run at once (more waits).
  int head_group = 0;
  double full_block_cost = 1.0, partial_block_cost = 1.0;
  double dq_add_cost = 0.05, dkv_add_cost = 0.1;
};

struct DqTile {
  int batch = 0, head = 0, kv_block = 0;
};

// Where each array starts in the plan's buffer, in int32 elements.
struct DqPlanLayout {
  int64_t walk_offsets = 0;     // [mask rows * num_kv_blocks + 1]: each walk's steps in the next three
  int64_t walk_q_blocks = 0;    // [steps]: each walk's q blocks in walk order
  int64_t walk_is_full = 0;     // [steps]: 1 where the block needs no element mask
  int64_t dq_write_order = 0;   // [steps]: the turn of the step's dQ add at its q block
  int64_t dq_num_turns = 0;     // [mask rows * num_q_blocks]: the adds into each q block
  int64_t schedule = 0;         // [num_tiles]: tile ids in dispatch order
  int64_t dkv_write_order = 0;  // [num_tiles] by tile id, GQA only (else 0 elements)
  int64_t size = 0;
};

// The plan as a kernel reads it: `data` is the plan's buffer, on the host or uploaded. Walks are
// per mask row (a broadcast mask has one set for every head); tiles and semaphores are per
// attention (b, h). Tile id: (b * heads + h) * num_kv_blocks + n.
struct DqPlanView {
  const int32_t* data = nullptr;
  DqPlanLayout layout;
  int batch = 1, heads = 1, group = 1;  // group: q heads per kv head
  int mask_batch = 1, mask_heads = 1;
  int num_q_blocks = 0, num_kv_blocks = 0;

  FLARE_HD int num_tiles() const { return batch * heads * num_kv_blocks; }
  FLARE_HD int tile_id(const DqTile& t) const { return (t.batch * heads + t.head) * num_kv_blocks + t.kv_block; }
  // The tile at dispatch position `position`.
  FLARE_HD DqTile tile_at(int position) const {
    const int id = data[layout.schedule + position];
    DqTile t;
    t.kv_block = id % num_kv_blocks;
    const int flat_head = id / num_kv_blocks;
    t.head = flat_head % heads;
    t.batch = flat_head / heads;
    return t;
  }
  FLARE_HD int mask_row(int b, int h) const {
    return (mask_batch == 1 ? 0 : b) * mask_heads + (mask_heads == 1 ? 0 : h);
  }
  // The tile's steps are [walk_begin, walk_end) of the step arrays.
  FLARE_HD int walk_begin(const DqTile& t) const {
    return data[layout.walk_offsets + mask_row(t.batch, t.head) * num_kv_blocks + t.kv_block];
  }
  FLARE_HD int walk_end(const DqTile& t) const {
    return data[layout.walk_offsets + mask_row(t.batch, t.head) * num_kv_blocks + t.kv_block + 1];
  }
  FLARE_HD int q_block(int step) const { return data[layout.walk_q_blocks + step]; }
  FLARE_HD bool is_full(int step) const { return data[layout.walk_is_full + step] != 0; }
  FLARE_HD int dq_turn(int step) const { return data[layout.dq_write_order + step]; }
  FLARE_HD int dq_num_turns(int b, int h, int m) const {
    return data[layout.dq_num_turns + mask_row(b, h) * num_q_blocks + m];
  }
  FLARE_HD int dkv_turn(const DqTile& t) const { return group == 1 ? 0 : data[layout.dkv_write_order + tile_id(t)]; }
  FLARE_HD int dkv_num_turns() const { return group; }

  // Semaphores: dQ of (b, h, m) first, then (GQA) dK/dV of (b, kv head, n).
  FLARE_HD int dq_semaphore(int b, int h, int m) const { return (b * heads + h) * num_q_blocks + m; }
  FLARE_HD int dkv_semaphore(int b, int kv_head, int n) const {
    return batch * heads * num_q_blocks + (b * (heads / group) + kv_head) * num_kv_blocks + n;
  }
  FLARE_HD int num_semaphores() const {
    return batch * heads * num_q_blocks + (group == 1 ? 0 : batch * (heads / group) * num_kv_blocks);
  }

  // The portable kernel's finer turns: it cuts a mask q block into `query_tiles` query tiles and a
  // kv block into `key_slices` CTAs (consecutive in its grid), each query tile j of block m with
  // its own dQ semaphore and each key slice with its own dK/dV one. Step `step`'s add into query
  // tile j by key slice `slice` takes turn dq_turn(step) * key_slices + slice there (0 .. the
  // block's dq_num_turns * key_slices - 1, in grid order); the dK/dV turns stay dkv_turn(tile).
  FLARE_HD int dq_slice_turn(int step, int slice, int key_slices) const { return dq_turn(step) * key_slices + slice; }
  FLARE_HD int64_t dq_tile_semaphore(int b, int h, int m, int j, int query_tiles) const {
    return (int64_t{b} * heads + h) * num_q_blocks * query_tiles + int64_t{m} * query_tiles + j;
  }
  FLARE_HD int64_t dkv_slice_semaphore(int b, int kv_head, int n, int slice, int key_slices) const {
    return (int64_t{b} * (heads / group) + kv_head) * num_kv_blocks * key_slices + int64_t{n} * key_slices + slice;
  }
};

struct DqWritePlan {
  int batch = 1, heads = 1, heads_kv = 1;
  int mask_batch = 1, mask_heads = 1;
  int num_q_blocks = 0, num_kv_blocks = 0;
  DqPlanOptions options;
  DqPlanLayout layout;
  std::vector<int32_t> data;

  std::size_t bytes() const { return data.size() * sizeof(int32_t); }
  // `base`: data.data(), or a device copy of data.
  DqPlanView view_at(const int32_t* base) const;
  DqPlanView view() const { return view_at(data.data()); }
};

// For an attention of `batch` x `heads` q heads (`heads_kv` kv heads) under `mask` (with its
// transposed lists, as every builder makes it). The mask's batch and heads are 1 or these.
Status make_dq_write_plan(const HostBlockMask& mask, int batch, int heads, int heads_kv, const DqPlanOptions& options,
                          DqWritePlan* plan);

// The grid's work under a plan, as the kernels follow it (for sched::simulate_grid): the tile at
// position p of the schedule, its q blocks in walk order, each an ordered add on the semaphore of
// (b, h, m) at its dq_write_order turn, then (GQA) the dK/dV add at its turn.
sched::SimWorkload dq_plan_workload(const DqPlanView& v, const sched::BackwardCosts& costs);

// The head group of the plan make_block_sparse_dq_plan makes (DqPlanOptions::head_group; 0: all
// heads interleaved). Interleaving every head spreads the grid's concurrent tiles over all of them,
// one to a few tiles a head: when a head's tiles read scattered q blocks (a random mask), their Q,
// dO and dQ adds then miss L2. On the H100 (batch 2, 16 heads, seqlen 8192, the Hopper backward)
// det/ordinary with all 32 heads interleaved, then in groups of 8/4/2/1: random 25 % of blocks
// 0.59, 0.76/0.85/0.74/0.70; groups of 4 also took causal 0.91 -> 0.96 and window 1024 0.90 -> 0.96,
// but 8 documents 0.93 -> 0.55 (a document's tiles all read the same q blocks: more of them at once
// queue at every semaphore). So the group is dq_plan_head_group's, rounded up to a divisor of the
// (b, h) count (even_head_group), when the planner's own grid model
// (nominal costs) puts its waits within 5 % of all heads interleaved, or when consecutive tiles of a
// head share under half their q blocks (L2 reuse needs the group); all heads otherwise.
//
// dq_plan_head_group: that group, the most heads whose q-side working set (Q and dO in 16 bits and
// the fp32 dQ accumulator: 8 bytes per query and head-dim column, at head dim 128) fits in 2/3 of
// an L2 of `l2_bytes` (0: the H100's 50 MiB), at least 1.
int dq_plan_head_group(int64_t seqlen_q, int64_t l2_bytes);
// even_head_group: the smallest group of at least `group` heads that divides `heads` (batch x q
// heads; `heads` itself when none smaller does), so every group has as many heads. A short last
// group runs its heads' tiles a few at a time, each q block's adds chained through them: on the
// H200 (60 MB of L2: dq_plan_head_group 5 at seqlen 8192, groups of 5 with a last one of 2 of the
// 32 (b, h)) the random mask's deterministic backward took 1.89 ms in groups of 5, 1.97 in groups
// of 3, 1.77 in groups of 4 and 1.69 in groups of 8 (ordinary 1.43-1.50; causal 2.78 -> 2.81,
// window level; bench/RESULTS.md, session 42). On the H100 the rule's 4 divides 32 and stays.
int even_head_group(int group, int heads);
// `chosen` (optional) receives the plan with the chosen group (empty data if planning failed).
int choose_dq_plan_head_group(const HostBlockMask& mask, int batch, int heads, int heads_kv, int64_t seqlen_q,
                              int64_t l2_bytes, DqWritePlan* chosen = nullptr);
// The fraction of a tile's q blocks that the previous tile of its head (schedule order) also
// visits, over all tiles: 1 for identical lists, about the density for random ones.
double dq_plan_list_overlap(const DqPlanView& v);



// The view of a public plan (flare/block_mask.h) over `device_data`, its uploaded copy.
DqPlanView dq_plan_view(const BlockSparseDqPlan& plan, const int32_t* device_data);

}  // namespace flare::block_sparse
