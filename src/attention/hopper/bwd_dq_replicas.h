// How many copies of its dQ accumulator the deterministic dense Hopper backward adds into
// (sched::dq_replica_turn, BwdKernelParams::dq_replicas). Host and device agnostic; the planner
// (attention_api.cpp) asks once per call.
//
// Two copies let consecutive turns of a chain add at once, so a turn held longer than a step no
// longer paces the chain (the grid simulation's BufferedGridSim study predicted det = ordinary at
// d256). Measured on the H200 (bench/RESULTS.md, session 38; 3 alternating rounds, the
// deterministic backward with two copies / one):
//
// | keys | d256 | d256 causal | d128 | d128 causal | d64 | d64 causal |
// |---|---|---|---|---|---|---|
// | 1k | 1.036 | 1.090 | | | | |
// | 2k | 0.965 | 1.006 | | | | |
// | 4k | 0.947 | 0.973 | 1.003 | 1.030 | 0.972 | 1.018 |
// | 8k | 0.978 | 1.073 | 0.997 | 1.012 | 0.987 | 0.984 |
// | 16k | 1.009 | 1.252 | 1.004 | 1.027 | 0.993 | 0.983 |
//
// Four copies lost 1-85 %. A second A/B of d64 causal 8k / 16k read 0.997 / 1.002 (the first
// 0.984 / 0.983): d64's 1-2 % is within the runs' spread. The copies cost a second accumulator to
// zero and to read in the convert (58 -> 97 us at d256 4k) and L2 room: a d256 step adds 64 KB of
// dQ, and at 16k keys one head's accumulator is 16 MB a copy (the walks of a causal grid spread
// over all of it). So two copies where they won: d256 non-causal 2k-8k keys and causal 4k.
//
// Why the deterministic d256 kernel stays behind (ncu, 4k non-causal, one launch each): at locked
// base clocks the ordinary kernel takes 3.66 ms, det 4.19 (one copy) and 3.62 (two); at the SM's
// own 1.8 GHz 2.90, 3.56 and 3.31. The ordinary kernel speeds up with the clock, the turn chains
// (bulk adds performed in L2, flags polled) do not: their cost is in nanoseconds, not cycles.
#pragma once

namespace flare::hopper {

constexpr int hopper_bwd_dq_replicas(int head_dim, int seqlen_k, bool causal) {
  if (head_dim <= 128) return 1;
  const bool won = causal ? seqlen_k > 2048 && seqlen_k <= 4096 : seqlen_k >= 2048 && seqlen_k <= 8192;
  return won ? 2 : 1;
}

}  // namespace flare::hopper
