// Discrete-event simulation of the persistent grid (see grid_sim.h).
#include "src/scheduling/grid_sim.h"

#include <algorithm>
#include <cstdint>
#include <deque>
#include <queue>
#include <random>

namespace flare::sched {

int SimResult::semaphore_links() const {
  int links = 0;
  for (const CriticalLink& l : critical_path) links += l.after_semaphore;
  return links;
}

namespace {

// The tiles the CTAs take, each in increasing index: statically (CTA c runs c, c + P, ...) or the
// next index from a shared counter when it frees up.
class TileDispatcher {
 public:
  TileDispatcher(Dispatch dispatch, int num_tiles, int ctas) : dispatch_(dispatch), num_tiles_(num_tiles), ctas_(ctas) {}
  // CTA `cta`'s next tile, or -1; `taken` counts its tiles (static dispatch).
  int next(int cta, int& taken) {
    if (dispatch_ == Dispatch::kDynamic) return next_ < num_tiles_ ? next_++ : -1;
    const int64_t index = cta + (int64_t)taken++ * ctas_;
    return index < num_tiles_ ? (int)index : -1;
  }

 private:
  Dispatch dispatch_;
  int num_tiles_, ctas_, next_ = 0;
};

// One executed step, kept for the wait accounting and the critical path.
struct StepRecord {
  int tile = 0, step = 0;
  double start = 0, compute_end = 0, add_start = 0, end = 0;
  int previous_on_cta = -1;  // the record that ended when this one started, on the same CTA
  int released_by = -1;      // the add that gave this step its turn, when it had to wait
  bool finished = false;
};

enum class Phase { kFetch, kComputing, kWaiting, kAdding, kDone };

struct Cta {
  Phase phase = Phase::kFetch;
  int tile = -1, step = 0;
  int tiles_taken = 0;   // static dispatch: the next tile is cta + tiles_taken * P
  int record = -1;       // the step in flight
  int last_record = -1;  // the last finished step
};

struct Event {
  double time;
  int cta;  // equal times: lower CTA first, so a run is reproducible
  bool operator>(const Event& o) const { return time != o.time ? time > o.time : cta > o.cta; }
};

class GridSimulation {
 public:
  GridSimulation(const SimWorkload& work, const SimOptions& options)
      : work_(work), options_(options), ctas_(options.resident_ctas < 1 ? 1 : options.resident_ctas),
        semaphores_(work.num_semaphores, 0), waiters_(work.num_semaphores), last_add_(work.num_semaphores, -1),
        dispatcher_(options.dispatch, (int)work.tiles.size(), (int)ctas_.size()) {}

  SimResult run() {
    size_t steps = 0;
    for (const std::vector<SimStep>& tile : work_.tiles) steps += tile.size();
    records_.reserve(steps);
    for (int c = 0; c < (int)ctas_.size(); ++c) schedule(0.0, c);
    while (!events_.empty()) {
      const Event e = events_.top();
      events_.pop();
      advance(e.cta, e.time);
    }
    return result();
  }

 private:
  void schedule(double time, int cta) { events_.push(Event{time, cta}); }

  const SimStep& step_of(const Cta& c) const { return work_.tiles[c.tile][c.step]; }

  // Moves a CTA on from the event it was waiting for.
  void advance(int cta, double now) {
    Cta& c = ctas_[cta];
    switch (c.phase) {
      case Phase::kFetch: begin_step(cta, now); break;
      case Phase::kComputing: finish_compute(cta, now); break;
      case Phase::kAdding: finish_add(cta, now); break;
      case Phase::kWaiting:
      case Phase::kDone: break;  // woken by a semaphore, or nothing left
    }
  }


  void begin_step(int cta, double now) {
    Cta& c = ctas_[cta];
    while (c.tile < 0 || c.step >= (int)work_.tiles[c.tile].size()) {  // empty tiles exit at once
      c.tile = dispatcher_.next(cta, c.tiles_taken);
      c.step = 0;
      if (c.tile < 0) {
        c.phase = Phase::kDone;
        return;
      }
    }
    StepRecord r;
    r.tile = c.tile, r.step = c.step, r.start = now, r.previous_on_cta = c.last_record;
    c.record = (int)records_.size();
    const SimStep& s = step_of(c);
    if (s.semaphore < 0 || !options_.use_semaphores) {  // nothing to wait for: one event
      r.compute_end = r.add_start = now + s.compute;
      records_.push_back(r);
      c.phase = Phase::kAdding;
      schedule(r.compute_end + s.add, cta);
      return;
    }
    records_.push_back(r);
    c.phase = Phase::kComputing;
    schedule(now + s.compute, cta);
  }

  void finish_compute(int cta, double now) {
    Cta& c = ctas_[cta];
    records_[c.record].compute_end = now;
    const SimStep& s = step_of(c);
    if (s.semaphore >= 0 && options_.use_semaphores && semaphores_[s.semaphore] != s.turn) {
      c.phase = Phase::kWaiting;
      waiters_[s.semaphore].push_back(cta);
      return;
    }
    begin_add(cta, now, -1);
  }

  void begin_add(int cta, double now, int released_by) {
    Cta& c = ctas_[cta];
    StepRecord& r = records_[c.record];
    r.released_by = released_by;
    r.add_start = now;
    total_wait_ += now - r.compute_end;
    c.phase = Phase::kAdding;
    schedule(now + step_of(c).add, cta);
  }

  void finish_add(int cta, double now) {
    Cta& c = ctas_[cta];
    records_[c.record].end = now;
    records_[c.record].finished = true;
    const int semaphore = step_of(c).semaphore;
    c.last_record = c.record;
    ++c.step;
    c.phase = Phase::kFetch;
    if (semaphore >= 0) {
      ++semaphores_[semaphore];
      last_add_[semaphore] = c.record;
      wake_turn(semaphore, now);
    }
    begin_step(cta, now);
  }

  // Starts the add of the waiter whose turn the semaphore now shows (turns are distinct).
  void wake_turn(int semaphore, double now) {
    std::vector<int>& waiting = waiters_[semaphore];
    for (size_t i = 0; i < waiting.size(); ++i) {
      const int w = waiting[i];
      if (step_of(ctas_[w]).turn != semaphores_[semaphore]) continue;
      waiting.erase(waiting.begin() + (long)i);
      begin_add(w, now, last_add_[semaphore]);
      return;
    }
  }

  SimResult result() const {
    SimResult out;
    out.completed = true;
    for (const Cta& c : ctas_)
      if (c.phase != Phase::kDone) {
        out.completed = false;
        if (c.phase == Phase::kWaiting) out.stuck_tiles.push_back(c.tile);
      }
    std::sort(out.stuck_tiles.begin(), out.stuck_tiles.end());
    out.total_wait = total_wait_;
    out.final_semaphores = semaphores_;
    int last = -1;
    for (int i = 0; i < (int)records_.size(); ++i) {
      const StepRecord& r = records_[i];
      if (!r.finished) continue;  // stuck in a deadlock
      out.total_work += (r.compute_end - r.start) + (r.end - r.add_start);
      if (last < 0 || r.end > records_[last].end) last = i;
    }
    if (last >= 0) out.makespan = records_[last].end;
    if (out.completed) out.critical_path = critical_path_to(last);
    return out;
  }

  std::vector<CriticalLink> critical_path_to(int record) const {
    std::vector<CriticalLink> path;
    while (record >= 0) {
      const StepRecord& r = records_[record];
      CriticalLink link;
      link.tile = r.tile, link.step = r.step, link.start = r.start, link.end = r.end;
      link.after_semaphore = r.released_by >= 0;
      path.push_back(link);
      // A step that waited began its add when the releasing add ended; otherwise it followed
      // the previous step of its CTA.
      record = r.released_by >= 0 ? r.released_by : r.previous_on_cta;
    }
    std::reverse(path.begin(), path.end());
    return path;
  }

  const SimWorkload& work_;
  SimOptions options_;
  std::vector<Cta> ctas_;
  std::vector<int> semaphores_;
  std::vector<std::vector<int>> waiters_;
  std::vector<int> last_add_;  // per semaphore: the record of its latest add
  std::vector<StepRecord> records_;
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> events_;
  TileDispatcher dispatcher_;
  double total_wait_ = 0;
};

// Buffered adds: the consumer side of a CTA computes steps back to back and hands each add to a
// buffer; the adds wait for their turns independently, or through the CTA's writers (add_writers).
class BufferedGridSimulation {
 public:
  BufferedGridSimulation(const SimWorkload& work, const SimOptions& options)
      : work_(work), options_(options), ctas_(options.resident_ctas < 1 ? 1 : options.resident_ctas),
        semaphores_(work.num_semaphores, 0), waiters_(work.num_semaphores),
        dispatcher_(options.dispatch, (int)work.tiles.size(), (int)ctas_.size()) {
    std::mt19937 rng(options.seed);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    compute_.resize(work.tiles.size());
    for (size_t t = 0; t < work.tiles.size(); ++t)
      for (const SimStep& st : work.tiles[t])
        compute_[t].push_back(st.compute * (1.0 + options.compute_jitter * u(rng)));
    for (Cta& c : ctas_) {
      c.free_slots = options.add_slots < 1 ? 1 : options.add_slots;
      if (options.add_writers > 0) c.writers.resize(options.add_writers);
    }
  }

  SimResult run() {
    for (int c = 0; c < (int)ctas_.size(); ++c) begin_step(c, 0.0);
    while (!events_.empty()) {
      const Event e = events_.top();
      events_.pop();
      end_ = std::max(end_, e.time);
      switch (e.kind) {
        case kComputeDone: compute_done(e.who, e.time); break;
        case kSlotFree: slot_free(e.who, e.time); break;
        case kAddDone: add_done(e.who, e.time); break;
      }
    }
    SimResult out;
    out.completed = adds_done_ == (int)adds_.size();
    for (const Cta& c : ctas_) out.completed = out.completed && c.done;
    for (const Add& a : adds_)
      if (!a.done) out.stuck_tiles.push_back(a.tile);
    std::sort(out.stuck_tiles.begin(), out.stuck_tiles.end());
    out.stuck_tiles.erase(std::unique(out.stuck_tiles.begin(), out.stuck_tiles.end()), out.stuck_tiles.end());
    out.makespan = end_;
    out.total_wait = total_wait_;
    out.total_work = total_work_;
    out.final_semaphores = semaphores_;
    return out;
  }

 private:
  enum Kind { kComputeDone, kSlotFree, kAddDone };
  struct Event {
    double time;
    int64_t order;  // equal times: first scheduled first, so a run is reproducible
    Kind kind;
    int who;  // the CTA (compute, slot) or the add
    bool operator>(const Event& o) const { return time != o.time ? time > o.time : order > o.order; }
  };
  struct Writer {
    std::deque<int> queue;  // its adds not yet taken, in step order
    bool busy = false;      // an add taken: waiting for its turn or in flight
  };
  struct Cta {
    int tile = -1, step = 0, tiles_taken = 0;
    int free_slots = 1;
    int steps_handed = 0;
    int pending_adds = 0;  // handed over, not done
    std::vector<Writer> writers;  // empty: no writer limit
    bool stalled = false, done = false;
    bool draining = false;  // its tile's steps handed over, waiting for their adds (drain_adds)
    double stall_start = 0;
  };
  struct Add {
    int cta = 0, tile = 0, semaphore = -1, turn = 0, writer = -1;
    double hold = 0;
    bool done = false;
  };

  void schedule(double time, Kind kind, int who) { events_.push(Event{time, next_order_++, kind, who}); }
  bool ordered(const Add& a) const { return a.semaphore >= 0 && options_.use_semaphores; }

  void begin_step(int cta, double now) {
    Cta& c = ctas_[cta];
    while (c.tile < 0 || c.step >= (int)work_.tiles[c.tile].size()) {
      if (c.tile >= 0 && options_.drain_adds && c.pending_adds > 0) {
        c.draining = true;
        return;
      }
      c.tile = dispatcher_.next(cta, c.tiles_taken);
      c.step = 0;
      if (c.tile < 0) {
        c.done = true;
        return;
      }
    }
    const double t = compute_[c.tile][c.step] + (c.step == 0 ? options_.tile_start : 0.0);
    total_work_ += t;
    schedule(now + t, kComputeDone, cta);
  }

  void compute_done(int cta, double now) {
    Cta& c = ctas_[cta];
    if (c.free_slots == 0) {
      c.stalled = true;
      c.stall_start = now;
      return;
    }
    hand_over(cta, now);
  }

  // The finished step's add takes a buffer; the CTA goes on to its next step.
  void hand_over(int cta, double now) {
    Cta& c = ctas_[cta];
    const SimStep& s = work_.tiles[c.tile][c.step];
    --c.free_slots;
    Add a;
    a.cta = cta, a.tile = c.tile, a.semaphore = s.semaphore, a.turn = s.turn, a.hold = s.add;
    if (!c.writers.empty()) a.writer = c.steps_handed % (int)c.writers.size();
    const int id = (int)adds_.size();
    adds_.push_back(a);
    ++c.pending_adds;
    total_work_ += s.add;
    if (a.writer < 0) {
      take_add(id, now);
    } else {
      c.writers[a.writer].queue.push_back(id);
      next_for_writer(cta, a.writer, now);
    }
    ++c.steps_handed;
    ++c.step;
    begin_step(cta, now);
  }

  // The add waits for its turn (or starts).
  void take_add(int id, double now) {
    const Add& a = adds_[id];
    if (!ordered(a) || semaphores_[a.semaphore] == a.turn) {
      start_add(id, now);
    } else {
      waiters_[a.semaphore].push_back(id);
    }
  }

  void next_for_writer(int cta, int w, double now) {
    Writer& wr = ctas_[cta].writers[w];
    if (wr.busy || wr.queue.empty()) return;
    const int id = wr.queue.front();
    wr.queue.pop_front();
    wr.busy = true;
    take_add(id, now);
  }

  void start_add(int id, double now) {
    schedule(now + options_.slot_read, kSlotFree, adds_[id].cta);
    schedule(now + adds_[id].hold, kAddDone, id);
  }

  void slot_free(int cta, double now) {
    Cta& c = ctas_[cta];
    ++c.free_slots;
    if (c.stalled) {
      c.stalled = false;
      total_wait_ += now - c.stall_start;
      hand_over(cta, now);
    }
  }

  void add_done(int id, double now) {
    Add& a = adds_[id];
    a.done = true;
    ++adds_done_;
    Cta& c = ctas_[a.cta];
    --c.pending_adds;
    if (a.writer >= 0) {
      c.writers[a.writer].busy = false;
      next_for_writer(a.cta, a.writer, now);
    }
    if (c.draining && c.pending_adds == 0) {
      c.draining = false;
      begin_step(a.cta, now);
    }
    if (!ordered(a)) return;
    const int sem = a.semaphore;
    ++semaphores_[sem];
    std::vector<int>& waiting = waiters_[sem];
    for (size_t i = 0; i < waiting.size(); ++i) {
      if (adds_[waiting[i]].turn != semaphores_[sem]) continue;
      const int w = waiting[i];
      waiting.erase(waiting.begin() + (long)i);
      start_add(w, now);
      return;
    }
  }

  const SimWorkload& work_;
  SimOptions options_;
  std::vector<std::vector<double>> compute_;
  std::vector<Cta> ctas_;
  std::vector<int> semaphores_;
  std::vector<std::vector<int>> waiters_;
  std::vector<Add> adds_;
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> events_;
  int64_t next_order_ = 0;
  TileDispatcher dispatcher_;
  int adds_done_ = 0;
  double end_ = 0, total_wait_ = 0, total_work_ = 0;
};

int length_of(const std::vector<int>& lengths, int b, int max_length) {
  return lengths.empty() ? max_length : lengths[b];
}

// The cost of q-block m against kv-block n of one sequence.
double block_cost(const TileShape& s, const Band& band, int seqlen_q, int seqlen_k, int m, int n,
                  const BackwardCosts& costs) {
  const int r0 = m * s.q_block, r1 = std::min(seqlen_q, r0 + s.q_block);
  const int c0 = n * s.kv_block;
  const bool full = classify_tile(band, r0, r1, c0, c0 + s.kv_block, seqlen_k) == TileKind::kFull;
  return full ? costs.full_block : costs.partial_block;
}

}  // namespace

SimResult simulate_grid(const SimWorkload& work, const SimOptions& options) {
  return GridSimulation(work, options).run();
}

SimResult simulate_grid_buffered(const SimWorkload& work, const SimOptions& options) {
  return BufferedGridSimulation(work, options).run();
}

SimWorkload with_dq_replicas(const SimWorkload& work, int replicas, int replicated) {
  SimWorkload out = work;
  for (auto& tile : out.tiles)
    for (SimStep& st : tile) {
      if (st.semaphore < 0) continue;
      if (st.semaphore < replicated) {
        const DqReplicaTurn r = dq_replica_turn(st.turn, replicas);
        st.semaphore = st.semaphore * replicas + r.replica, st.turn = r.turn;
      } else {
        st.semaphore += replicated * (replicas - 1);
      }
    }
  out.num_semaphores = work.num_semaphores + replicated * (replicas - 1);
  return out;
}

int dq_semaphore(const TileShape& s, int b, int h, int m) { return (b * s.heads + h) * s.num_q_blocks() + m; }

int num_dq_semaphores(const TileShape& s) { return s.batch * s.heads * s.num_q_blocks(); }

int dkv_semaphore(const TileShape& s, int b, int kv_head, int n) {
  return num_dq_semaphores(s) + (b * s.heads_kv + kv_head) * s.num_kv_blocks() + n;
}

SimWorkload deterministic_backward_workload(const DqPlan& plan, const TileShape& shape, const SeqLengths& lengths,
                                            const BackwardCosts& costs) {
  SimWorkload w;
  w.num_semaphores = dkv_semaphore(shape, shape.batch, 0, 0);
  w.tiles.resize(plan.order.num_tiles);
  const int group = shape.group();
  for (int t = 0; t < plan.order.num_tiles; ++t) {
    const TileCoord c = tile_at(plan.order, t);
    const DqSequence seq = dq_sequence(plan, length_of(lengths.q, c.batch, shape.seqlen_q),
                                       length_of(lengths.k, c.batch, shape.seqlen_k), c.batch, c.head);
    if (c.block >= seq.num_kv_blocks) continue;  // past the sequence's end
    const DqWalk walk = dq_walk(plan, seq, c.block);
    std::vector<SimStep>& steps = w.tiles[t];
    steps.reserve(walk.count + 1);
    for (int k = 0; k < walk.count; ++k) {
      const int m = q_block_at(walk, k);
      SimStep s;
      s.compute = block_cost(shape, seq.band, seq.seqlen_q, seq.seqlen_k, m, c.block, costs);
      s.semaphore = dq_semaphore(shape, c.batch, c.head, m);
      s.turn = dq_turn(plan, seq, c.batch, c.head, c.block, m);
      s.add = costs.dq_add;
      steps.push_back(s);
    }
    if (group > 1) {
      SimStep s;
      s.compute = 0;
      s.semaphore = dkv_semaphore(shape, c.batch, c.head / group, c.block);
      s.turn = dkv_turn(c.head, group);
      s.add = costs.dkv_add;
      steps.push_back(s);
    }
  }
  return w;
}

SimWorkload ordinary_backward_workload(const TileOrder& order, const TileShape& shape, const SeqLengths& lengths,
                                       const BackwardCosts& costs) {
  SimWorkload w;
  w.tiles.resize(order.num_tiles);
  for (int t = 0; t < order.num_tiles; ++t) {
    const TileCoord c = tile_at(order, t);
    const int seqlen_q = length_of(lengths.q, c.batch, shape.seqlen_q);
    const int seqlen_k = length_of(lengths.k, c.batch, shape.seqlen_k);
    if (c.block * shape.kv_block >= seqlen_k) continue;
    const Band band = Band::make(shape.causal, shape.window_left, shape.window_right, seqlen_q, seqlen_k);
    const int col_end = std::min(seqlen_k, (c.block + 1) * shape.kv_block);
    const BlockRange r = q_block_range(band, c.block * shape.kv_block, col_end, seqlen_q, shape.q_block);
    std::vector<SimStep>& steps = w.tiles[t];
    steps.reserve(std::max(0, r.last - r.first) + 1);
    for (int m = r.first; m < r.last; ++m) {
      SimStep s;
      s.compute = block_cost(shape, band, seqlen_q, seqlen_k, m, c.block, costs);
      s.add = costs.dq_add;
      steps.push_back(s);
    }
    if (shape.group() > 1) {
      SimStep s;
      s.compute = 0;
      s.add = costs.dkv_add;
      steps.push_back(s);
    }
  }
  return w;
}

}  // namespace flare::sched
