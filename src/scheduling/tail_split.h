// Wave quantization of a grid of equal tiles, one CTA per SM slot: `tiles` tiles of `steps` steps
// on `slots` SMs run in ceil(tiles / slots) rounds, so a last round of a few tiles leaves most SMs
// idle for a whole tile's time (4,096 backward tiles on 132 SMs: 31.03 waves take 32 rounds, 3 %).
// Splitting each of the last tiles (the remainder tiles % slots) into `parts` step ranges spreads
// the last round over the idle SMs; each part pays a fixed cost (its K/V loads, its partial dK/dV
// added in fp32 and converted after the grid). tail_split picks the parts count that minimizes
// the last round's time in steps under that cost; CTA order: the whole tiles first (as the
// unsplit grid orders them), then the parts.
#pragma once

#include <cstdint>

#include "src/scheduling/mask_math.h"  // FLARE_HD

namespace flare::sched {

struct TailSplit {
  int64_t whole = 0;  // tiles run whole: CTAs [0, whole) are tiles [0, whole)
  int64_t tiles = 0;  // tiles split, tiles [whole, whole + tiles)
  int parts = 1;      // parts of each split tile (1: no split)
  FLARE_HD bool active() const { return parts > 1 && tiles > 0; }
  FLARE_HD int64_t ctas() const { return whole + tiles * parts; }
};

// A CTA's work: its tile and the steps [begin, end) of it; part >= 0 for a split tile's part
// (whose dK/dV are partial sums), -1 for a whole tile.
struct TailWork {
  int64_t tile = 0;
  int begin = 0, end = 0;
  int part = -1;
};

// The split for `tiles` uniform tiles of `steps` steps on `slots` CTA slots. A part costs
// `part_cost` steps beyond its share and keeps at least `min_part_steps` steps. Parts only where
// the last round gets shorter by more than one step's worth. `one_round`: only as many parts as
// fit the slots at once (tiles that do not end together make later rounds of parts ragged too).
FLARE_HD TailSplit tail_split(int64_t tiles, int steps, int slots, int part_cost = 2, int min_part_steps = 4,
                              bool one_round = false) {
  TailSplit s;
  s.whole = tiles;
  if (tiles <= 0 || steps <= 0 || slots <= 1 || min_part_steps < 1) return s;
  const int64_t tail = tiles % slots;
  if (tail == 0) return s;
  // The last round: unsplit, `steps`; with p parts, ceil(tail p / slots) rounds of steps / p + cost.
  int max_parts = steps / min_part_steps < slots ? steps / min_part_steps : slots;
  if (one_round && max_parts > slots / tail) max_parts = static_cast<int>(slots / tail);
  int best_parts = 1;
  double best_time = static_cast<double>(steps);
  for (int p = 2; p <= max_parts; ++p) {
    const int64_t rounds = (tail * p + slots - 1) / slots;
    const double time = static_cast<double>(rounds) * (static_cast<double>(steps) / p + part_cost);
    if (time + 1.0 < best_time) {
      best_time = time;
      best_parts = p;
    }
  }
  if (best_parts > 1) {
    s.whole = tiles - tail;
    s.tiles = tail;
    s.parts = best_parts;
  }
  return s;
}

// CTA `cta` (in [0, s.ctas())) of a split over tiles of `steps` steps. The parts of one tile are
// spread (part-major), so the tiles' first parts start together.
FLARE_HD TailWork tail_work(const TailSplit& s, int64_t cta, int steps) {
  TailWork w;
  if (cta < s.whole || !s.active()) {
    w.tile = cta;
    w.end = steps;
    return w;
  }
  const int64_t j = cta - s.whole;
  w.tile = s.whole + j % s.tiles;
  w.part = static_cast<int>(j / s.tiles);
  w.begin = static_cast<int>(int64_t{steps} * w.part / s.parts);
  w.end = static_cast<int>(int64_t{steps} * (w.part + 1) / s.parts);
  return w;
}

// The other quantization, along a tile's rows: the share of the rows that `extent` rows cut into
// blocks of `block` compute past the end (1,024 query rows in tiles of 192: 128 of 1,152, 11 %).
FLARE_HD double padded_share(int extent, int block) {
  if (extent <= 0 || block <= 0) return 0.0;
  const int64_t padded = (int64_t{extent} + block - 1) / block * block;
  return static_cast<double>(padded - extent) / static_cast<double>(padded);
}

}  // namespace flare::sched
