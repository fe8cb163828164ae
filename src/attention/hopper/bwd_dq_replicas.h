// How many copies of its dQ accumulator the deterministic dense Hopper backward adds into
// (sched::dq_replica_turn, BwdKernelParams::dq_replicas). Host and device agnostic; the planner
// (attention_api.cpp) asks once per call.
//
// Two copies let consecutive turns of a chain add at once, so a turn held longer than a step no
// longer paces the chain (the grid simulation's BufferedGridSim study predicted det = ordinary at
// d256). Measured on the H200 (bench/RESULTS.md, session 38; 3 alternating rounds, the
// deterministic backward with two copies / one), with the d256 writers at two and at three
// threads (bwd_config.h, FLARE_HOPPER_BWD_SPLIT_DQ_WRITERS; three is the default):
//
// | keys | d256, 2 writers | causal | d256, 3 writers | causal | d128 | causal | d64 | causal |
// |---|---|---|---|---|---|---|---|---|
// | 1k | 1.036 | 1.090 | 0.962 | 1.000 | | | | |
// | 2k | 0.965 | 1.006 | 0.892 | 0.899 | | | | |
// | 4k | 0.947 | 0.973 | 0.860 | 0.880 | 1.003 | 1.030 | 0.972 | 1.018 |
// | 8k | 0.978 | 1.073 | 0.904 | 0.955 | 0.997 | 1.012 | 0.987 | 0.984 |
// | 16k | 1.009 | 1.252 | 0.933 | 1.166 | 1.004 | 1.027 | 0.993 | 0.983 |
//
// Four copies lost everywhere (two writers: 1.12-1.85 at d256). A second A/B of d64 causal 8k / 16k
// read 0.997 / 1.002: d64's 1-2 % is within the runs' spread. The copies cost a second accumulator
// to read in the convert (58 -> 97 us at d256 4k, the zeroing included, which session 40's
// first-turn stores removed) and L2 room: a d256 step adds 64 KB of dQ, and at 16k keys one head's
// accumulator is 16 MB a copy (the walks of a causal grid spread over all of it). So two copies at
// d256 up to 16k keys, causal up to 8k; one at d64 and d128. Re-measured once no copy was zeroed
// (session 40, two copies / one): d128 0.999-1.015, causal 1.011-1.062; d64 0.992-1.010; d256 16k
// 0.927, causal 16k 1.141: the rule stands.
//
// Why the simulation overestimated the copies alone (ncu, d256 4k non-causal, two writers, one
// launch each): at locked base clocks the ordinary kernel takes 3.66 ms, det 4.19 (one copy) and
// 3.62 (two); at the SM's own 1.8 GHz 2.90, 3.56 and 3.31. The ordinary kernel speeds up with the
// clock, the turn chains (bulk adds performed in L2, flags polled) do not: their cost is in
// nanoseconds, not cycles, and a third writer keeps one more of them in flight.
#pragma once

namespace flare::hopper {

constexpr int hopper_bwd_dq_replicas(int head_dim, int seqlen_k, bool causal) {
  if (head_dim <= 128) return 1;
  return seqlen_k <= (causal ? 8192 : 16384) ? 2 : 1;
}

}  // namespace flare::hopper
