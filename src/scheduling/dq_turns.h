// Deterministic dQ (and GQA dK/dV) accumulation order of the attention backward.
//
// A backward tile (b, h, kv-block n) visits the q-blocks m that see its keys and adds a dQ
// contribution for each into an fp32 accumulator (b, h, m). For bitwise reproducibility the adds
// into one accumulator happen in a fixed order: a semaphore per (b, h, m) counts finished adds,
// and tile n adds into m only when the semaphore equals dq_turn(n, m), then increments it.
// The final value, dq_num_turns(m), is the number of kv blocks that touch m.
//
// Which order. Two things decide it: waiting and deadlock.
// - Waiting. A tile computes its contribution to m, then waits for its turn, then adds. If it
//   finishes computing before the tile whose turn precedes it has added, it stalls, holding its
//   CTA. With the dynamic scheduler tiles start in tile-index order, so an order is free of
//   waits when at every m the turns follow arrival: the earlier tile (lower index) has its turn
//   first and reaches m in fewer steps.
// - Deadlock. If the turn a tile waits for belongs to a tile that is not resident yet, and that
//   tile can only become resident after the waiting one finishes, nothing moves.
//
// The orders. The deterministic tile order (tile_order.h) is head-major with n descending
// (longest first: the L2-grouped order with n ascending).
// - Tile order (shortest first): every tile walks its q-blocks ascending and the turns at m
//   follow the tile index: the largest n adds first. The first q-block of kv block n never
//   decreases with n, so the earlier tile reaches m in no more steps: no waits, except that
//   tiles whose walks start at the same q-block tie and their adds queue (a stagger of one add
//   per tile). For causal attention this is shortest first: kv blocks in descending n, each
//   walking m ascending, so the tile that reaches m first (the largest n) adds first. It is
//   deadlock-free on any residency, because every wait points to a lower tile index.
// - Diagonal (rotated): tile n walks its q-blocks in increasing T(n, m) = (m - n) mod Q, with
//   Q = max(q-blocks, kv-blocks) of the sequence: its range rotated to start at the first
//   m = n (mod Q). The touching tiles of one m are consecutive n, at most Q of them, so their T
//   differ: the turn at m is the rank of T. When every kv block sees every q block (a
//   rectangle: full attention, or a window wider than the sequence), all walks would start
//   together at m = 0 and tie; rotated, they form a Latin square and in lockstep never wait.
//   Where walks have a staircase (causal, windows) the rotation would wrap some walks and make
//   early tiles wait for later ones, which the simulation shows costs more than the stagger.
// - Auto (default): diagonal for rectangle sequences, tile order otherwise. Decided per
//   sequence from its own lengths, so every tile of a head agrees.
// - Longest first: the tile order is head-major with n ascending (for causal attention the
//   longest tile of a head first, as the ordinary grid runs), every tile walks its q-blocks
//   descending and the turns at m follow the tile index: the smallest n adds first. The last
//   q-block of kv block n never decreases with n, so the earlier tile reaches m in no more steps
//   (for causal attention every tile of a head reaches m at the same step: they tie, and a head's
//   tiles started together drift apart by one add each, once). Every wait points to a lower tile
//   index, so it is deadlock-free on any residency, as tile order is. What it buys: tile order
//   starts a head's longest tile last, so under the dynamic scheduler the last heads' longest
//   tiles run alone at the end of the grid, the tail the ordinary grid does not have.
//   Measured (session 53) it took 1.09-1.14x tile order's time at d256 and 0.98-1.05x at d128:
//   not the default.
// - Shortest first, the last heads longest first (kShortestTail): tile order for every flat head
//   b * heads + h but the last G; those come after the others, interleaved (block rank outer,
//   heads inner, as the ordinary grid is), with their kv blocks ascending (the longest first), their
//   walks descending and their turns in ascending n, as in longest first. Tile order's tail is its
//   last heads' longest tiles, started in the last wave and running alone; here the last waves'
//   tiles go longest first. G = 2 ceil(P / kv blocks) for P resident CTAs: the heads of the last
//   two waves (or G = 1, the last head: kShortestTailWaves says where each measured faster). The
//   turns still follow the tile index within each head (a reversed head's ascending n are at
//   ascending indices) and the dQ waits stay within a head; the GQA dK/dV turns go in
//   q-head order, at lower indices for a lower q-head of one kv head (the interleaving keeps heads
//   ascending within a rank). So it is deadlock-free on any residency, as tile order is. The grid
//   model (test_grid_sim, causal d128 and d256, 4k-16k) puts it at 0.95-0.99 of the ordinary
//   backward's speed where tile order is at 0.89-0.93 and the last head alone at 0.92-0.99.
//
// Deadlock freedom of the rotation. Residency is cut into rounds of R = resident CTAs
// consecutive tile indices. Turns follow the rotation only within a round; across rounds they
// follow the tile index (all earlier-round tiles touching m add before any later-round tile).
// With tiles taken in increasing index (statically t = c, c + P, ... or from a counter), by
// induction over rounds: every tile of earlier rounds finishes; then all tiles of round r are
// resident together (at most P consecutive indices: each is next in line on its own CTA, or is
// handed out while no later tile is); within the round the tile whose current T is smallest
// never waits, since every contributor with a smaller T at its m is already past m. The GQA
// dK/dV turns (q-head order: lower tile index) only point backwards, and a tile's dQ waits stay
// within its own head, so together they form no cycle either. The rule a kernel must keep:
// round_tiles <= resident CTAs; a plan made for more CTAs than are resident can deadlock (the
// simulation shows it does). Rounds align with the static scheduler's waves (tile t runs in
// wave t / P), so rotated tiles also start at about the same time.
//
// Dispatch. Every order here is deadlock-free under both schedulers, but only the dynamic one
// (tiles from a counter) starts tiles in index order; under static round-robin a CTA that is
// behind its neighbour (its earlier tiles were longer) makes the next tile of the head wait.
// The simulation (test_grid_sim) puts causal at 1.3-1.6x the ordinary backward with static
// dispatch and at 1.01-1.13x with dynamic dispatch, so the deterministic backward takes its tiles
// from a counter.
#pragma once

#include "src/scheduling/tile_order.h"

namespace flare::sched {

enum class DqScheme : int {
  kAuto = 0,       // diagonal for rectangle sequences, tile order otherwise
  kDiagonal = 1,   // rotated walks, turns by rotation within a residency round
  kTileOrder = 2,  // ascending walks, turns in tile-index order (shortest first)
  kLongestFirst = 3,  // n ascending tiles, descending walks, turns in tile-index order
  kShortestTail = 4,  // tile order, but the last waves' heads interleaved as kLongestFirst
};

// kShortestTail reverses the heads of this many last waves of resident CTAs (the grid model: two
// gain 1-2 % over one, three less than 1 % more); a plan made with 0 waves reverses the last head
// alone. On the H200 (session 55) two waves took 0.93-0.98 of shortest first's time at d128 causal
// 4k-16k, where the last head alone took 0.96-1.01; at d256 (64-key tiles, short steps, two dQ
// copies) two waves took 1.02-1.09, the last head alone 0.95-0.99.
inline constexpr int kShortestTailWaves = 2;

// kShortestTail's reversed heads capped by the L2 budget instead (a lead, session 55: the heads that
// run together share the L2, and a d256 head's backward operands are 16.8 MB at 8k): as many heads as
// the budget holds, at least one, at most every head.
inline int shortest_tail_heads_in_l2(const TileShape& s, int64_t l2_budget_bytes) {
  const int64_t unit = backward_unit_bytes(s) / order_detail::max_int(1, s.group());  // one q-head's
  const int64_t fit = unit > 0 ? l2_budget_bytes / unit : s.batch * s.heads;
  return (int)(fit < 1 ? 1 : (fit > s.batch * s.heads ? s.batch * s.heads : fit));
}

struct DqPlan {
  TileOrder order;  // make_backward_order(..., deterministic=true): head-major, n descending
                    // (n ascending for kLongestFirst; kShortestTail's last heads interleaved after
                    // the others, n ascending)
  DqScheme scheme = DqScheme::kAuto;
  int round_tiles = 1;  // tiles resident together: the rotation never crosses a round
  int q_block = 128, kv_block = 128;
  bool causal = false;
  int window_left = -1, window_right = -1;
};

// round_tiles = resident CTAs (num_SMs * ctas_per_sm of the launch). tail_waves: kShortestTail's.
inline DqPlan make_dq_plan(const TileShape& s, int64_t l2_budget_bytes, int resident_ctas,
                           DqScheme scheme = DqScheme::kAuto, int tail_waves = kShortestTailWaves) {
  DqPlan p;
  p.order = make_backward_order(s, l2_budget_bytes, /*deterministic=*/true,
                                /*longest_first=*/scheme == DqScheme::kLongestFirst);
  if (scheme == DqScheme::kShortestTail) {
    const int blocks = order_detail::max_int(1, s.num_kv_blocks());
    const int per_wave = order_detail::ceil_div(order_detail::max_int(1, resident_ctas), blocks);
    p.order.reversed_heads = order_detail::min_int(s.batch * s.heads, tail_waves > 0 ? tail_waves * per_wave : 1);
  }
  p.scheme = scheme;
  p.round_tiles = resident_ctas < 1 ? 1 : resident_ctas;
  p.q_block = s.q_block, p.kv_block = s.kv_block;
  p.causal = s.causal, p.window_left = s.window_left, p.window_right = s.window_right;
  return p;
}

// One sequence's geometry: its own lengths (varlen), or the batch lengths, and how head (b, h)
// walks it. Built once per tile.
struct DqSequence {
  Band band;
  int seqlen_q = 0, seqlen_k = 0;
  int num_q_blocks = 0, num_kv_blocks = 0;
  int period = 1;       // Q of the rotation: >= any walk's length and any q-block's contributor count
  // The walks and turns: tile order (ascending walks), rotated (diagonal walks and turns) or
  // descending (kLongestFirst, kShortestTail's last heads: descending walks, turns in ascending n).
  // One field, not two flags: the deterministic d128 kernel's dQ writer keeps it live across its
  // loop, and a second byte there cost a spill (session 54).
  enum class Walks : unsigned char { kTileOrder, kRotated, kDescending } walks = Walks::kTileOrder;
  FLARE_HD bool rotate() const { return walks == Walks::kRotated; }
  FLARE_HD bool descending() const { return walks == Walks::kDescending; }
};

// The kv blocks touching q-block m (those whose tile adds into its dQ), and the reverse.
FLARE_HD BlockRange kv_blocks_touching(const DqPlan& p, const DqSequence& s, int m) {
  const int row_end = order_detail::min_int(s.seqlen_q, (m + 1) * p.q_block);
  return kv_block_range(s.band, m * p.q_block, row_end, s.seqlen_k, p.kv_block);
}
FLARE_HD BlockRange q_blocks_touching(const DqPlan& p, const DqSequence& s, int n) {
  const int col_end = order_detail::min_int(s.seqlen_k, (n + 1) * p.kv_block);
  return q_block_range(s.band, n * p.kv_block, col_end, s.seqlen_q, p.q_block);
}

// Every kv block sees every q block. The first q-block and the end of the range never decrease
// with n, so the last kv block starting at 0 and the first one reaching the end decide.
FLARE_HD bool is_rectangle(const DqPlan& p, const DqSequence& s) {
  if (s.num_q_blocks == 0 || s.num_kv_blocks == 0) return false;
  const BlockRange last = q_blocks_touching(p, s, s.num_kv_blocks - 1);
  const BlockRange first = q_blocks_touching(p, s, 0);
  return last.first == 0 && last.last > 0 && first.last == s.num_q_blocks;
}

FLARE_HD DqSequence dq_sequence(const DqPlan& p, int seqlen_q, int seqlen_k, int b, int h) {
  DqSequence s;
  s.band = Band::make(p.causal, p.window_left, p.window_right, seqlen_q, seqlen_k);
  s.seqlen_q = seqlen_q, s.seqlen_k = seqlen_k;
  s.num_q_blocks = order_detail::ceil_div(seqlen_q, p.q_block);
  s.num_kv_blocks = order_detail::ceil_div(seqlen_k, p.kv_block);
  s.period = order_detail::max_int(1, order_detail::max_int(s.num_q_blocks, s.num_kv_blocks));
  // kShortestTail's reversed heads (no other scheme has any).
  if (p.scheme == DqScheme::kLongestFirst || b * p.order.heads + h >= first_reversed_head(p.order))
    s.walks = DqSequence::Walks::kDescending;
  else if (p.scheme == DqScheme::kDiagonal || (p.scheme == DqScheme::kAuto && is_rectangle(p, s)))
    s.walks = DqSequence::Walks::kRotated;
  return s;
}

FLARE_HD int positive_mod(int a, int b) {
  const int r = a % b;
  return r < 0 ? r + b : r;
}

// A tile's walk over its q-blocks: [first, first + count), beginning at `start` and wrapping, or
// (descending) from the last down to `first`.
// A descending walk has start kDescending (no flag of its own: the tile keeps its walk live through
// the whole kernel, and the d128 deterministic kernel had no register left for one, session 54).
struct DqWalk {
  static constexpr int kDescending = -1;
  int first = 0, count = 0, start = 0;
  FLARE_HD bool descending() const { return start == kDescending; }
};

FLARE_HD DqWalk dq_walk(const DqPlan& p, const DqSequence& s, int n) {
  DqWalk w;
  const BlockRange r = q_blocks_touching(p, s, n);
  if (r.first >= r.last || n >= s.num_kv_blocks) return w;
  w.first = r.first;
  w.count = r.last - r.first;
  w.start = s.descending() ? DqWalk::kDescending : r.first;
  if (s.rotate()) {
    // The smallest T(n, m) = (m - n) mod Q is 0 at the first m = n (mod Q), if the range has one;
    // otherwise T grows along the whole range (count <= Q) and the walk starts at `first`.
    const int zero_at = r.first + positive_mod(n - r.first, s.period);
    if (zero_at < r.last) w.start = zero_at;
  }
  return w;
}

// The q-block of a walk's step in [0, count).
FLARE_HD int q_block_at(const DqWalk& w, int step) {
  if (w.descending()) return w.first + w.count - 1 - step;
  const int m = w.start + step;
  return m < w.first + w.count ? m : m - w.count;
}

// Adds into q-block m's dQ: the semaphore's final value.
FLARE_HD int dq_num_turns(const DqPlan& p, const DqSequence& s, int m) {
  const BlockRange r = kv_blocks_touching(p, s, m);
  return r.last > r.first ? r.last - r.first : 0;
}

// The turn of tile (b, h, n) at q-block m (n must touch m): the value of semaphore (b, h, m)
// when its add may start.
FLARE_HD int dq_turn(const DqPlan& p, const DqSequence& s, int b, int h, int n, int m) {
  const BlockRange touching = kv_blocks_touching(p, s, m);
  if (s.descending()) return n - touching.first;  // the touching tiles in tile-index order: n ascending
  // The touching tiles in tile-index order are n = last-1, last-2, ..., first (n descending),
  // at consecutive indices; `position` is n's place among them.
  const int count = touching.last - touching.first;
  const int position = touching.last - 1 - n;
  if (!s.rotate()) return position;

  TileCoord leader;
  leader.batch = b, leader.head = h, leader.block = touching.last - 1;
  const int first_index = tile_index_of(p.order, leader);
  const int round_begin = (first_index + position) / p.round_tiles * p.round_tiles;
  // Touching tiles of earlier rounds all go first; those of n's round go by T.
  const int in_round_begin = order_detail::max_int(0, round_begin - first_index);
  const int in_round_end = order_detail::min_int(count, round_begin + p.round_tiles - first_index);
  const int in_round = in_round_end - in_round_begin;
  const int j = position - in_round_begin;
  // Along the positions T(n', m) = (m - n') mod Q climbs by one from t0 and wraps to 0 at most
  // once (in_round <= count <= Q): the wrapped positions have the smallest T.
  const int t0 = positive_mod(m - (touching.last - 1 - in_round_begin), s.period);
  if (t0 + in_round <= s.period) return in_round_begin + j;
  const int wrap = s.period - t0;  // first wrapped position
  return in_round_begin + (j >= wrap ? j - wrap : in_round - wrap + j);
}

// A tile's dQ turns, for a writer that asks once per step: what dq_turn computes from the tile
// alone (its rank among the touching tiles, its residency round) is done once here. Rotated
// rectangles, where the touching tiles are the same for every q-block, need one modulo per step;
// tile order needs the touching range's end. Only for plans that rotate rectangles alone
// (kAuto, kTileOrder): rotated staircases (kDiagonal) take dq_turn.
struct DqTurnCursor {
  int b = 0, h = 0, n = 0;
  bool rect = false;          // rotated rectangle: the fields below hold
  int in_round_begin = 0;     // touching positions of earlier rounds
  int in_round = 0;           // touching positions in n's round
  int j = 0;                  // n's position within its round
  int lead_position = 0;      // n' of the round's first position: T = (m - lead_position) mod Q
};

FLARE_HD DqTurnCursor dq_turn_cursor(const DqPlan& p, const DqSequence& s, int b, int h, int n) {
  DqTurnCursor c;
  c.b = b, c.h = h, c.n = n;
  if (!s.rotate() || !is_rectangle(p, s)) return c;
  const int count = s.num_kv_blocks;
  const int position = count - 1 - n;
  TileCoord leader;
  leader.batch = b, leader.head = h, leader.block = count - 1;
  const int first_index = tile_index_of(p.order, leader);
  const int round_begin = (first_index + position) / p.round_tiles * p.round_tiles;
  c.in_round_begin = order_detail::max_int(0, round_begin - first_index);
  const int in_round_end = order_detail::min_int(count, round_begin + p.round_tiles - first_index);
  c.in_round = in_round_end - c.in_round_begin;
  c.j = position - c.in_round_begin;
  c.lead_position = count - 1 - c.in_round_begin;
  c.rect = true;
  return c;
}

// Equals dq_turn(p, s, c.b, c.h, c.n, m) when p.scheme is not kDiagonal (s built for c.b, c.h).
FLARE_HD int dq_turn_at(const DqTurnCursor& c, const DqPlan& p, const DqSequence& s, int m) {
  if (!c.rect) {
    const BlockRange touching = kv_blocks_touching(p, s, m);
    return s.descending() ? c.n - touching.first : touching.last - 1 - c.n;
  }
  const int t0 = positive_mod(m - c.lead_position, s.period);
  if (t0 + c.in_round <= s.period) return c.in_round_begin + c.j;
  const int wrap = s.period - t0;
  return c.in_round_begin + (c.j >= wrap ? c.j - wrap : c.in_round - wrap + c.j);
}

// Replicated accumulators. A turn is held from its add's start until the add is performed and
// the next writer sees the semaphore move; where that hold outlasts a step, consecutive turns of
// one chain queue behind it (the grid simulation's BufferedGridSim study). With R replicas of the
// accumulator (and of its semaphore), turn t adds into replica t mod R as that replica's turn
// t / R: each chain is the original order's every R-th link, so R writers of one q-block add at
// once, and the final sum of the replicas, in replica order, is as reproducible as one chain. A
// replica's chain keeps the original's order, so it waits on a subset of what the original did:
// it cannot deadlock where the original does not.
struct DqReplicaTurn {
  int replica = 0;
  int turn = 0;
};
FLARE_HD DqReplicaTurn dq_replica_turn(int turn, int replicas) {
  DqReplicaTurn r;
  r.replica = turn % replicas;
  r.turn = turn / replicas;
  return r;
}

// A CTA's steps dealt to its W dQ writers in turn, counted from step0 (the steps before the
// current tile's; 0 for a CTA of one tile): writer j takes the steps g = j (mod W), so its first
// step of the tile is step0's next such step, and step g is writer (g mod W)'s (g / W)-th. (Written
// for the persistent deterministic grid, deleted in session 40; the d <= 128 writers still call it
// with step0 = 0: bwd_write_dq.)
FLARE_HD int writer_first_step(int writer, int step0, int writers) {
  const int first = writer - step0 % writers;
  return first < 0 ? first + writers : first;
}

// GQA: dK/dV of kv head h / group are summed over its q-heads in q-head order. The semaphore
// (b, kv head, n) counts finished adds; tile (b, h, n) adds when it equals dkv_turn and the final
// value is the group size. Each q-head's tile of an existing kv block takes its turn, even when
// it visits no q-block (it adds zeros), so the count is the same for every kv block.
FLARE_HD int dkv_turn(int head, int group) { return head % group; }
FLARE_HD int dkv_num_turns(int group) { return group; }

}  // namespace flare::sched
