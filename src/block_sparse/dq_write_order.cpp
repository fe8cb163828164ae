#include "src/block_sparse/dq_write_order.h"

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <limits>
#include <numeric>
#include <queue>
#include <string>

#include "src/common/device_facts.h"

namespace flare::block_sparse {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// One kv block's tile of a mask row: its q blocks with their kinds and turns, in walk order once
// `walk_fixed`, ascending before.
struct TileWalk {
  std::vector<int32_t> q_blocks, is_full, turns;
  bool walk_fixed = false;
};

// A mask row's tiles and the order a head takes them in.
struct RowPlan {
  std::vector<TileWalk> tiles;      // by kv block
  std::vector<int32_t> head_order;  // kv blocks in dispatch order
  std::vector<int32_t> num_turns;   // by q block
};

// The key a head's tiles are sorted by: walk length, then the tie-breaks of the header.
std::vector<int32_t> head_order_of(const std::vector<TileWalk>& tiles, TileSchedule schedule) {
  std::vector<int32_t> order(tiles.size());
  std::iota(order.begin(), order.end(), 0);
  auto length = [&](int n) { return tiles[n].q_blocks.size(); };
  auto first = [&](int n) { return tiles[n].q_blocks.empty() ? -1 : tiles[n].q_blocks.front(); };
  auto last = [&](int n) { return tiles[n].q_blocks.empty() ? -1 : tiles[n].q_blocks.back(); };
  if (schedule == TileSchedule::kLongestFirst)
    std::sort(order.begin(), order.end(), [&](int a, int b) {
      if (length(a) != length(b)) return length(a) > length(b);
      if (last(a) != last(b)) return last(a) < last(b);
      return a < b;
    });
  else
    std::sort(order.begin(), order.end(), [&](int a, int b) {
      if (length(a) != length(b)) return length(a) < length(b);
      if (first(a) != first(b)) return first(a) > first(b);
      return a > b;
    });
  return order;
}

// The turn of each add is the number of the head's tiles adding into the same q block before it
// in dispatch order: turns follow the schedule, which is what rules out deadlock.
void assign_turns_in_head_order(int num_q_blocks, RowPlan* row) {
  row->num_turns.assign(num_q_blocks, 0);
  for (int32_t n : row->head_order) {
    TileWalk& tile = row->tiles[n];
    tile.turns.resize(tile.q_blocks.size());
    for (size_t step = 0; step < tile.q_blocks.size(); ++step) tile.turns[step] = row->num_turns[tile.q_blocks[step]]++;
  }
}

RowPlan plan_mask_row(const HostBlockMask& mask, int mask_b, int mask_h, TileSchedule schedule) {
  RowPlan row;
  row.tiles.resize(mask.num_kv_blocks);
  for (int n = 0; n < mask.num_kv_blocks; ++n)
    mask.q_blocks_of(mask_b, mask_h, n, &row.tiles[n].q_blocks, &row.tiles[n].is_full);
  row.head_order = head_order_of(row.tiles, schedule);
  assign_turns_in_head_order(mask.num_q_blocks, &row);
  return row;
}

// Rank r of every (b, h) of a group of head_group heads (0: all), then rank r + 1: a head's tiles
// keep their order (their turns were assigned in it) and as few of them as possible run at once.
std::vector<int32_t> interleaved_schedule(const DqPlanView& v, const std::vector<RowPlan>& rows, int head_group) {
  std::vector<int32_t> schedule;
  schedule.reserve(static_cast<size_t>(v.num_tiles()));
  const int heads = v.batch * v.heads, group = head_group > 0 ? std::min(head_group, heads) : heads;
  for (int first = 0; first < heads; first += group)
    for (int rank = 0; rank < v.num_kv_blocks; ++rank)
      for (int bh = first; bh < std::min(first + group, heads); ++bh) {
        const int b = bh / v.heads, h = bh % v.heads;
        schedule.push_back(v.tile_id(DqTile{b, h, rows[v.mask_row(b, h)].head_order[rank]}));
      }
  return schedule;
}

// The q heads of a kv head add their dK/dV of block n in dispatch order.
std::vector<int32_t> dkv_turns(const DqPlanView& v, const std::vector<int32_t>& schedule) {
  std::vector<int32_t> position(schedule.size()), turns(schedule.size());
  for (size_t i = 0; i < schedule.size(); ++i) position[schedule[i]] = static_cast<int32_t>(i);
  std::vector<int32_t> group_tiles(v.group);
  for (int b = 0; b < v.batch; ++b)
    for (int kv_head = 0; kv_head < v.heads / v.group; ++kv_head)
      for (int n = 0; n < v.num_kv_blocks; ++n) {
        for (int j = 0; j < v.group; ++j) group_tiles[j] = v.tile_id(DqTile{b, kv_head * v.group + j, n});
        std::sort(group_tiles.begin(), group_tiles.end(), [&](int32_t a, int32_t c) { return position[a] < position[c]; });
        for (int j = 0; j < v.group; ++j) turns[group_tiles[j]] = j;
      }
  return turns;
}

void reorder_walk(TileWalk* tile, const std::vector<size_t>& order) {
  TileWalk sorted;
  for (size_t i : order) {
    sorted.q_blocks.push_back(tile->q_blocks[i]);
    sorted.is_full.push_back(tile->is_full[i]);
    sorted.turns.push_back(tile->turns[i]);
  }
  sorted.walk_fixed = true;
  *tile = std::move(sorted);
}

// One pass over the schedule modelling the grid (dynamic dispatch, nominal costs, see the
// header). `add_end[s]` is when the latest add on semaphore s ends: for a tile, the end of its
// predecessor's add at each of its q blocks, since every predecessor comes earlier.
class WalkPlanner {
 public:
  WalkPlanner(const DqPlanView& v, const DqPlanOptions& o)
      : v_(v), o_(o), add_end_(static_cast<size_t>(v.num_semaphores()), 0.0) {
    for (int c = 0; c < std::max(1, o.resident_ctas); ++c) cta_free_.push(0.0);
  }

  // Fixes the walk of `tile`'s mask row on first sight, then runs the tile on the model.
  void visit(const DqTile& tile, TileWalk* walk) {
    if (!walk->walk_fixed) fix_walk(tile, walk);
    double now = cta_free_.top();
    cta_free_.pop();
    for (size_t step = 0; step < walk->q_blocks.size(); ++step) {
      const double cost = walk->is_full[step] ? o_.full_block_cost : o_.partial_block_cost;
      now = add(v_.dq_semaphore(tile.batch, tile.head, walk->q_blocks[step]), now + cost, o_.dq_add_cost);
    }
    if (v_.group > 1) now = add(v_.dkv_semaphore(tile.batch, tile.head / v_.group, tile.kv_block), now, o_.dkv_add_cost);
    cta_free_.push(now);
  }

 private:
  double add(int semaphore, double ready, double cost) {
    add_end_[semaphore] = std::max(ready, add_end_[semaphore]) + cost;
    return add_end_[semaphore];
  }

  // Monotone order first, so that equal predecessor ends keep it (a stable sort).
  void fix_walk(const DqTile& tile, TileWalk* walk) {
    std::vector<size_t> order(walk->q_blocks.size());
    std::iota(order.begin(), order.end(), 0);
    if (o_.schedule == TileSchedule::kLongestFirst) std::reverse(order.begin(), order.end());
    if (o_.walk == WalkOrder::kPlanned) {
      auto predecessor_end = [&](size_t i) { return add_end_[v_.dq_semaphore(tile.batch, tile.head, walk->q_blocks[i])]; };
      std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return predecessor_end(a) < predecessor_end(b); });
    }
    reorder_walk(walk, order);
  }

  const DqPlanView& v_;
  const DqPlanOptions& o_;
  std::vector<double> add_end_;
  std::priority_queue<double, std::vector<double>, std::greater<double>> cta_free_;
};

DqPlanLayout layout_for(int64_t mask_rows, int64_t steps, const DqWritePlan& p, int64_t num_tiles) {
  DqPlanLayout l;
  int64_t at = 0;
  auto take = [&at](int64_t count) {
    const int64_t begin = at;
    at += count;
    return begin;
  };
  l.walk_offsets = take(mask_rows * p.num_kv_blocks + 1);
  l.walk_q_blocks = take(steps);
  l.walk_is_full = take(steps);
  l.dq_write_order = take(steps);
  l.dq_num_turns = take(mask_rows * p.num_q_blocks);
  l.schedule = take(num_tiles);
  l.dkv_write_order = take(p.heads == p.heads_kv ? 0 : num_tiles);
  l.size = at;
  return l;
}

void pack_walks(const std::vector<RowPlan>& rows, const DqPlanLayout& l, std::vector<int32_t>* data) {
  int32_t* offsets = data->data() + l.walk_offsets;
  int32_t step = 0;
  for (const RowPlan& row : rows)
    for (const TileWalk& tile : row.tiles) {
      *offsets++ = step;
      std::copy(tile.q_blocks.begin(), tile.q_blocks.end(), data->begin() + l.walk_q_blocks + step);
      std::copy(tile.is_full.begin(), tile.is_full.end(), data->begin() + l.walk_is_full + step);
      std::copy(tile.turns.begin(), tile.turns.end(), data->begin() + l.dq_write_order + step);
      step += static_cast<int32_t>(tile.q_blocks.size());
    }
  *offsets = step;
  int32_t* num_turns = data->data() + l.dq_num_turns;
  for (const RowPlan& row : rows) num_turns = std::copy(row.num_turns.begin(), row.num_turns.end(), num_turns);
}

Status check_plan_args(const HostBlockMask& mask, int batch, int heads, int heads_kv) {
  if (batch < 1) return Status::InvalidArgument("batch", "must be >= 1, got " + std::to_string(batch));
  if (heads < 1 || heads_kv < 1 || heads % heads_kv != 0)
    return Status::InvalidArgument("heads_kv", "kv heads (" + std::to_string(heads_kv) + ") must divide q heads (" +
                                                   std::to_string(heads) + ")");
  if (mask.batch != 1 && mask.batch != batch)
    return Status::InvalidArgument("mask", "batch " + std::to_string(mask.batch) + ", expected 1 or " +
                                               std::to_string(batch));
  if (mask.heads != 1 && mask.heads != heads)
    return Status::InvalidArgument("mask", "heads " + std::to_string(mask.heads) + ", expected 1 or " +
                                               std::to_string(heads));
  const size_t transposed_rows = static_cast<size_t>(mask.batch) * mask.heads * mask.num_kv_blocks;
  if (mask.partial_q.num_blocks.size() != transposed_rows || mask.full_q.num_blocks.size() != transposed_rows)
    return Status::InvalidArgument("mask", "has no transposed lists (fill_transposed_lists makes them)");
  // Tile ids, semaphores and step offsets are int32 on the device.
  const int64_t per_head = std::max<int64_t>(mask.num_q_blocks, mask.num_kv_blocks);
  const int64_t steps = int64_t{mask.batch} * mask.heads * mask.num_q_blocks * mask.num_kv_blocks;
  if (int64_t{batch} * heads * per_head * 2 > kInt32Max || steps > kInt32Max)
    return Status::InvalidArgument("mask", "too many tiles or blocks for 32-bit plan indices");
  return Status::Ok();
}

}  // namespace

DqPlanView DqWritePlan::view_at(const int32_t* base) const {
  DqPlanView v;
  v.data = base;
  v.layout = layout;
  v.batch = batch, v.heads = heads, v.group = heads / heads_kv;
  v.mask_batch = mask_batch, v.mask_heads = mask_heads;
  v.num_q_blocks = num_q_blocks, v.num_kv_blocks = num_kv_blocks;
  return v;
}

Status make_dq_write_plan(const HostBlockMask& mask, int batch, int heads, int heads_kv, const DqPlanOptions& options,
                          DqWritePlan* out) {
  FLARE_RETURN_IF_ERROR(check_plan_args(mask, batch, heads, heads_kv));
  DqWritePlan p;
  p.batch = batch, p.heads = heads, p.heads_kv = heads_kv;
  p.mask_batch = mask.batch, p.mask_heads = mask.heads;
  p.num_q_blocks = mask.num_q_blocks, p.num_kv_blocks = mask.num_kv_blocks;
  p.options = options;

  std::vector<RowPlan> rows;
  int64_t steps = 0;
  for (int b = 0; b < mask.batch; ++b)
    for (int h = 0; h < mask.heads; ++h) {
      rows.push_back(plan_mask_row(mask, b, h, options.schedule));
      for (const TileWalk& tile : rows.back().tiles) steps += static_cast<int64_t>(tile.q_blocks.size());
    }
  const DqPlanView dims = p.view_at(nullptr);  // the index arithmetic, before there is data
  const std::vector<int32_t> schedule = interleaved_schedule(dims, rows, options.head_group);
  WalkPlanner planner(dims, options);
  for (int32_t id : schedule) {
    const DqTile tile{id / p.num_kv_blocks / heads, id / p.num_kv_blocks % heads, id % p.num_kv_blocks};
    planner.visit(tile, &rows[dims.mask_row(tile.batch, tile.head)].tiles[tile.kv_block]);
  }

  p.layout = layout_for(static_cast<int64_t>(rows.size()), steps, p, dims.num_tiles());
  p.data.assign(static_cast<size_t>(p.layout.size), 0);
  pack_walks(rows, p.layout, &p.data);
  std::copy(schedule.begin(), schedule.end(), p.data.begin() + p.layout.schedule);
  if (dims.group > 1) {
    const std::vector<int32_t> turns = dkv_turns(dims, schedule);
    std::copy(turns.begin(), turns.end(), p.data.begin() + p.layout.dkv_write_order);
  }
  *out = std::move(p);
  return Status::Ok();
}

DqPlanView dq_plan_view(const BlockSparseDqPlan& plan, const int32_t* device_data) {
  DqPlanView v;
  v.data = device_data;
  const int64_t* o = plan.offsets;
  v.layout = DqPlanLayout{o[0], o[1], o[2], o[3], o[4], o[5], o[6], static_cast<int64_t>(plan.data.size())};
  v.batch = plan.batch, v.heads = plan.heads, v.group = plan.heads / plan.heads_kv;
  v.mask_batch = plan.mask_batch, v.mask_heads = plan.mask_heads;
  v.num_q_blocks = plan.num_q_blocks, v.num_kv_blocks = plan.num_kv_blocks;
  return v;
}

sched::SimWorkload dq_plan_workload(const DqPlanView& v, const sched::BackwardCosts& costs) {
  sched::SimWorkload w;
  w.num_semaphores = v.num_semaphores();
  w.tiles.resize(v.num_tiles());
  for (int position = 0; position < v.num_tiles(); ++position) {
    const DqTile t = v.tile_at(position);
    std::vector<sched::SimStep>& steps = w.tiles[position];
    for (int s = v.walk_begin(t); s < v.walk_end(t); ++s) {
      sched::SimStep step;
      step.compute = v.is_full(s) ? costs.full_block : costs.partial_block;
      step.semaphore = v.dq_semaphore(t.batch, t.head, v.q_block(s));
      step.turn = v.dq_turn(s);
      step.add = costs.dq_add;
      steps.push_back(step);
    }
    if (v.group > 1) {
      sched::SimStep step;
      step.compute = 0;
      step.semaphore = v.dkv_semaphore(t.batch, t.head / v.group, t.kv_block);
      step.turn = v.dkv_turn(t);
      step.add = costs.dkv_add;
      steps.push_back(step);
    }
  }
  return w;
}

double dq_plan_list_overlap(const DqPlanView& v) {
  // Per (b, h): the q blocks of its previous tile in schedule order, as a mark per q block.
  std::vector<std::vector<char>> previous(static_cast<size_t>(v.batch) * v.heads);
  int64_t shared = 0, visits = 0;
  for (int position = 0; position < v.num_tiles(); ++position) {
    const DqTile t = v.tile_at(position);
    std::vector<char>& prev = previous[static_cast<size_t>(t.batch) * v.heads + t.head];
    std::vector<char> now(static_cast<size_t>(v.num_q_blocks), 0);
    for (int s = v.walk_begin(t); s < v.walk_end(t); ++s) {
      const int m = v.q_block(s);
      now[m] = 1;
      shared += !prev.empty() && prev[m];
    }
    if (!prev.empty()) visits += v.walk_end(t) - v.walk_begin(t);
    prev = std::move(now);
  }
  return visits > 0 ? static_cast<double>(shared) / static_cast<double>(visits) : 1.0;
}

int dq_plan_head_group(int64_t seqlen_q, int64_t l2_bytes) {
  const int64_t l2 = l2_bytes > 0 ? l2_bytes : int64_t{50} << 20;
  const int64_t per_head = std::max<int64_t>(seqlen_q, 1) * 128 * 8;
  return static_cast<int>(std::clamp<int64_t>(2 * l2 / 3 / per_head, 1, std::numeric_limits<int>::max()));
}

int even_head_group(int group, int heads) {
  if (heads <= 0) return group;
  for (int g = std::max(group, 1); g < heads; ++g)
    if (heads % g == 0) return g;
  return heads;
}

int choose_dq_plan_head_group(const HostBlockMask& mask, int batch, int heads, int heads_kv, int64_t seqlen_q,
                              int64_t l2_bytes, DqWritePlan* chosen) {
  DqPlanOptions grouped, interleaved;
  grouped.head_group = even_head_group(dq_plan_head_group(seqlen_q, l2_bytes), batch * heads);
  DqWritePlan a, b;
  const bool planned = make_dq_write_plan(mask, batch, heads, heads_kv, interleaved, &b).ok();
  int group = 0;
  if (planned && grouped.head_group < batch * heads && make_dq_write_plan(mask, batch, heads, heads_kv, grouped, &a).ok()) {
    if (dq_plan_list_overlap(a.view()) < 0.5) {
      group = grouped.head_group;
    } else {
      sched::SimOptions sim;
      sim.resident_ctas = grouped.resident_ctas;
      sim.dispatch = sched::Dispatch::kDynamic;
      const sched::BackwardCosts costs;
      const double t_grouped = sched::simulate_grid(dq_plan_workload(a.view(), costs), sim).makespan;
      const double t_interleaved = sched::simulate_grid(dq_plan_workload(b.view(), costs), sim).makespan;
      if (t_grouped <= 1.05 * t_interleaved) group = grouped.head_group;
    }
  }
  if (chosen != nullptr) *chosen = group > 0 ? std::move(a) : std::move(b);
  return group;
}

}  // namespace flare::block_sparse

namespace flare {

Status make_block_sparse_dq_plan(const BlockMask& host_mask, int batch, int heads, int heads_kv, int seqlen_q,
                                 int seqlen_k, BlockSparseDqPlan* plan) {
  if (plan == nullptr) return Status::InvalidArgument("plan", "null pointer");
  if (batch < 1 || heads < 1 || heads_kv < 1 || heads % heads_kv != 0)
    return Status::InvalidArgument("heads_kv", "batch, heads and heads_kv must be positive, heads a multiple of "
                                               "heads_kv; got batch " + std::to_string(batch) + ", heads " +
                                               std::to_string(heads) + ", heads_kv " + std::to_string(heads_kv));
  block_sparse::HostBlockMask mask;
  FLARE_RETURN_IF_ERROR(
      block_sparse::copy_block_mask(host_mask, detail::BlockMaskProblem{batch, heads, seqlen_q, seqlen_k}, &mask));
  block_sparse::DqWritePlan p;
  if (const char* env = std::getenv("FLARE_DQ_PLAN_HEAD_GROUP"); env != nullptr) {
    // Tuning knob (measurements): interleave the heads in groups of N (0: all of them).
    block_sparse::DqPlanOptions options;
    options.head_group = std::atoi(env);
    FLARE_RETURN_IF_ERROR(block_sparse::make_dq_write_plan(mask, batch, heads, heads_kv, options, &p));
  } else {
    block_sparse::choose_dq_plan_head_group(mask, batch, heads, heads_kv, seqlen_q,
                                            detail::current_device_facts().l2_bytes, &p);
    if (p.data.empty())  // the planner's error
      FLARE_RETURN_IF_ERROR(block_sparse::make_dq_write_plan(mask, batch, heads, heads_kv, {}, &p));
  }
  BlockSparseDqPlan out;
  out.batch = batch, out.heads = heads, out.heads_kv = heads_kv;
  out.mask_batch = p.mask_batch, out.mask_heads = p.mask_heads;
  out.num_q_blocks = p.num_q_blocks, out.num_kv_blocks = p.num_kv_blocks;
  out.q_block_size = mask.q_block_size, out.kv_block_size = mask.kv_block_size;
  const block_sparse::DqPlanLayout& l = p.layout;
  const int64_t offsets[7] = {l.walk_offsets, l.walk_q_blocks,  l.walk_is_full,   l.dq_write_order,
                              l.dq_num_turns, l.schedule,       l.dkv_write_order};
  std::copy(offsets, offsets + 7, out.offsets);
  out.data = std::move(p.data);
  *plan = std::move(out);
  return Status::Ok();
}

}  // namespace flare
