// The Hopper backward's dQ writers: threads of the producer warpgroup that add each step's dQ tile
// (written to shared memory by the consumers) into dq_accum with one bulk reduction, in
// deterministic mode at the query block's turn (a dense chain's, on its copy: DqReplica; or the
// block-sparse plan's: DqTurn), handing the turn on once the add is performed.
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>

#include "src/attention/hopper/bwd_tile.h"
#include "src/attention/portable/bwd_kernel.h"
#include "src/common/bulk_copy.h"
#include "src/common/turn_semaphore.h"

namespace flare::hopper {

// One dQ writer's share: the steps it adds (first, first + stride, ...), the barrier the consumers
// fill its steps' tiles on, and the shared tiles (step it's is it % tiles, tile_floats apart) with
// the barriers it frees them on.
struct DqWriterPart {
  const float* smem;
  uint64_t* full;
  uint64_t* empty;  // one per tile
  int tiles = 1, tile_floats = 0;
  int first_step = 0, step_stride = 1;
  uint32_t bytes = 0;
};

// The block-sparse deterministic mode's semaphore and turn for step `it` of a tile's planned walk:
// the semaphore of the step's 64-row part of its q block, the plan's turn of the tile's walk
// entry (key slices of one kv block take consecutive turns).
struct DqTurn {
  int* sem = nullptr;
  int turn = 0;
};
template <typename Params, typename Tile>
__device__ __forceinline__ DqTurn sparse_dq_turn(const Params& hp, const Tile& t, int it) {
  const block_sparse::DqPlanView& plan = hp.dq_plan;
  const int subs = t.sparse.subs, entry = t.step0 + it / subs;
  DqTurn d;
  d.sem = hp.p.dq_semaphore + plan.dq_tile_semaphore(t.b, t.h, plan.q_block(entry), it % subs, subs);
  d.turn = plan.dq_slice_turn(entry, t.slice, t.key_slices);
  return d;
}

// A CTA of the block-sparse deterministic mode without keys (a key slice past seqlen_k): it adds
// nothing but takes each of its turns, dQ and (GQA) dK/dV, so later CTAs do not wait for it.
template <typename Params, typename Tile>
__device__ __forceinline__ void pass_sparse_turns(const Params& hp, const Tile& t) {
  for (int it = 0; it < t.steps(); ++it) {
    const DqTurn d = sparse_dq_turn(hp, t, it);
    device_sync::wait_for_turn(d.sem, d.turn);
    device_sync::pass_turn(d.sem);
  }
  if (t.dkv_sem != nullptr) {
    device_sync::wait_for_turn(t.dkv_sem, t.dkv_turn);
    device_sync::pass_turn(t.dkv_sem);
  }
}

// A dQ writer's turn (deterministic mode): wait for it, then let the bulk adds (async proxy) see
// the earlier writers' adds; and, after its own adds, hand `count` adjacent chains' turns on once
// those adds are performed.
__device__ __forceinline__ void wait_for_dq_turn(const int* sem, int turn) {
#if FLARE_HOPPER_BWD_EXPERIMENT != 4
  device_sync::wait_for_turn(sem, turn);
#else
  (void)sem, (void)turn;
#endif
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
__device__ __forceinline__ void pass_dq_turns(int* sem, int count = 1) {
  sm90::bulk_wait_all();
  __threadfence();
  for (int i = 0; i < count; ++i) device_sync::pass_turn(sem + i);
}

// A dQ tile (`bytes` of shared memory at src) into dq_accum at dst: added, or stored where it is
// its chain's first turn on its copy (BwdKernelParams::dq_first_stores: nothing zeroed the copy).
__device__ __forceinline__ void dq_tile_put(float* dst, const float* src, uint32_t bytes, bool store) {
  if (store)
    sm90::bulk_store_s2g(dst, src, bytes);
  else
    sm90::bulk_reduce_add_f32_s2g(dst, src, bytes);
}

// Deterministic dense grids: where turn `turn` of a dQ chain adds (sched::dq_replica_turn): its
// copy's offsets from the first copy's semaphore and tile, and its turn on that copy.
struct DqReplica {
  int64_t semaphores = 0, floats = 0;
  int turn = 0;
};
__device__ __forceinline__ DqReplica dq_replica(const detail::BwdKernelParams& P, int turn) {
  const sched::DqReplicaTurn r = sched::dq_replica_turn(turn, P.dq_replicas);
  DqReplica d;
  d.semaphores = r.replica * P.dq_replica_semaphores;
  d.floats = r.replica * P.dq_replica_floats;
  d.turn = r.turn;
  return d;
}

// A dQ writer (one thread of a producer warp other than 0): adds each of its steps' dQ tiles into
// dq_accum with one bulk reduction (a 128-row step's two 64-row blocks, or the first alone where
// the second lies past the sequence; their turn is the first block's semaphore). Several writers
// keep several adds (and, in deterministic mode, their turn handoffs) in flight. A block mask's
// step that adds nothing still takes its turn.
template <typename Cfg, typename Params, typename Tile>
__device__ __forceinline__ void bwd_write_dq(const Params& hp, const Tile& t, const DqWriterPart& part) {
  const detail::BwdKernelParams& P = hp.p;
  const sched::DqSequence dq_seq = sched::dq_sequence(hp.plan, t.seq.seqlen_q, t.seq.seqlen_k, t.b, t.h);
  const sched::DqTurnCursor turns = sched::dq_turn_cursor(hp.plan, dq_seq, t.b, t.h, t.n);
  // writer_first_step(first_step, 0, ..) is first_step; written plainly, ptxas allocates the d128
  // writer's registers differently (5 more spill instructions, session 40), so the call stays.
  for (int it = sched::writer_first_step(part.first_step, 0, part.step_stride); it < t.steps();
       it += part.step_stride) {
    const int k = it / part.step_stride;  // this writer's k-th step
    const QStep step = t.step_at(it);
    const int m = step.m;
    DqTurn d;
    if constexpr (Tile::kSparse) {
      if (P.deterministic) d = sparse_dq_turn(hp, t, it);
    } else {
      d.sem = portable::dq_turn_semaphore(P, t.b, t.h, m * Cfg::kRowBlocks);
    }
    int* sem = FLARE_HOPPER_BWD_EXPERIMENT == 5 ? nullptr : d.sem;
    float* tile = step.valid ? hopper_dq_tile<Cfg>(P, t.seq.q_start, t.b, t.h, m * Cfg::kRowBlocks) : nullptr;
    if constexpr (!Tile::kSparse) {
      if (sem != nullptr) {
        const DqReplica r = dq_replica(P, sched::dq_turn_at(turns, hp.plan, dq_seq, m));
        sem += r.semaphores, d.turn = r.turn;
        if (tile != nullptr) tile += r.floats;
      }
    }
    cutlass::arch::ClusterBarrier::wait(part.full, k & 1);
    if (sem != nullptr) wait_for_dq_turn(sem, d.turn);
    uint32_t bytes = part.bytes;
    if constexpr (Cfg::kRowBlocks == 2) {
      if (m * Cfg::kBlockM + detail::kRowStatsBlockM >= t.seq.seqlen_q) bytes /= 2;
    }
    const int buf = it % part.tiles;
    const bool store = !Tile::kSparse && sem != nullptr && P.dq_first_stores && d.turn == 0;
    if (tile != nullptr) dq_tile_put(tile, part.smem + buf * part.tile_floats, bytes, store);
    sm90::bulk_commit_group();
    // The tile is free once read: the consumers go on with the next step while the add completes.
    sm90::bulk_wait_read_all();
    cutlass::arch::ClusterBarrier::arrive(&part.empty[buf]);
    if (sem != nullptr) pass_dq_turns(sem);
  }
}

}  // namespace flare::hopper
