// How a session runs requests: a block's unit of work on a lane (one request or a batch), the
// hand-off to the next block (inline on the same lane, or queued), joins of DAG paths, full
// queues, and the resolution of each request exactly once.
#include <blockflow/core/detail/clock.hpp>
#include <blockflow/core/detail/exception_text.hpp>
#include <blockflow/core/detail/log.hpp>
#include <blockflow/core/detail/session_core.hpp>

#include <ATen/ops/cat.h>
#include <c10/core/InferenceMode.h>
#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <optional>

namespace blockflow::detail {
namespace {

// The session whose completion callback this thread is running, if any.
thread_local const SessionCore* calling_back = nullptr;
// While a lane runs a forward() of a batch with more to run after it: hand-offs queue, not claim the
// next block for this lane (which would keep it from every other lane until the batch is done).
thread_local bool forwards_follow = false;

}  // namespace

// Set while a site's thread hands a result on (SessionCore::on_site_completion()).
thread_local bool delivering_for_site = false;

namespace {

// A call into a block in progress, listed for BlockMetrics::computing_s while it runs.
class ComputingCall {
 public:
  ComputingCall(BlockRuntime& runtime, std::int64_t start) : runtime_(runtime), start_(start) {
    MutexLock lock(&runtime_.computing_mu);
    runtime_.computing_since.push_back(start_);
  }
  ~ComputingCall() {
    MutexLock lock(&runtime_.computing_mu);
    auto& since = runtime_.computing_since;
    since.erase(std::find(since.begin(), since.end(), start_));
  }
  ComputingCall(const ComputingCall&) = delete;
  ComputingCall& operator=(const ComputingCall&) = delete;

 private:
  BlockRuntime& runtime_;
  const std::int64_t start_;
};

}  // namespace

void BlockRuntime::run_one() { core->run_block(*this, std::nullopt); }

void SessionCore::run_block(BlockRuntime& runtime, std::optional<Envelope> first) {
  const auto& options = runtime.block->options();
  std::vector<Envelope> batch;
  std::vector<StatePtr> states;
  bool batching = options.max_batch > 1;
  if (batching) {
    try {  // room for the whole batch first: nothing taken below can then be lost to an exception
      batch.reserve(static_cast<std::size_t>(options.max_batch));
      states.reserve(static_cast<std::size_t>(options.max_batch));
    } catch (...) {
      batching = false;  // out of memory: this one runs alone
    }
  }
  // One lane at a time gathers the block's batch (BlockRuntime::gathering): with workers >= 2, a
  // second lane would take part of it, and the block's own ready entry would count as other work
  // waiting and end the wait. It ends before the batch runs: other lanes take what comes meanwhile.
  struct Gathering {
    SessionCore& core;
    BlockRuntime& runtime;
    // workers 1: no entry is queued while claimed and the release queues the rest (no lock taken).
    Gathering(SessionCore& c, BlockRuntime& r) : core(c), runtime(r) {
      try {  // its stale ready entry leaves the queue (if this throws, a lane taking it finds it gathered)
        if (runtime.max_lanes > 1) core.lanes_->notify(runtime);
      } catch (...) {
      }
    }
    ~Gathering() {
      runtime.gathering.store(false, std::memory_order_release);
      try {
        if (runtime.max_lanes > 1) core.lanes_->notify(runtime);  // what is left queued is a lane's again
      } catch (...) {  // out of memory: the claim's release queues it
      }
    }
    Gathering(const Gathering&) = delete;
    Gathering& operator=(const Gathering&) = delete;
  };
  std::optional<Gathering> gathering;
  if (batching) {
    if (!runtime.gathering.exchange(true, std::memory_order_acq_rel)) {
      gathering.emplace(*this, runtime);  // its ready entry leaves the queue: this lane takes the work
    } else if (!first) {
      return;  // another lane gathers: it takes what is queued
    } else {
      batching = false;  // a request handed to this lane directly (helping a full queue) runs now
    }
  }
  if (!first) first = runtime.inbox->try_receive();
  if (!first) return;  // another lane took it
  c10::InferenceMode inference_mode;
  if (batching) {
    // Take what else waits, up to max_batch. Wait for more (until max_batch_delay_ms after the first
    // arrived) only while no other block has work ready: a lane never idles on a short batch while
    // work it could run waits (with one lane, the next block's inputs come from this very lane).
    const std::int64_t deadline_ns = first->sent_ns + static_cast<std::int64_t>(options.max_batch_delay_ms * 1e6);
    batch.push_back(std::move(*first));
    while (static_cast<int>(batch.size()) < options.max_batch) {
      if (auto more = runtime.inbox->try_receive()) {
        batch.push_back(std::move(*more));
        continue;
      }
      const std::int64_t left = deadline_ns - now_ns();
      if (left <= 0 || lanes_->pending() > 0 || runtime.inbox->closed()) break;
      // In slices, so that work arriving for another block ends the wait.
      auto more = runtime.inbox->receive(absl::Now() + absl::Nanoseconds(std::min<std::int64_t>(left, 200'000)));
      if (more) batch.push_back(std::move(*more));
    }
    gathering.reset();
    if (batch.size() > 1) {
      for (const auto& e : batch) states.push_back(e.local);
      try {
        process_batch(runtime, std::move(batch));
      } catch (...) {  // nothing may escape a lane: the batch's requests fail, the lane keeps serving
        const std::string what = current_exception_text();
        for (auto& state : states) fail_in_block(runtime, state, what);
      }
      return;
    }
    first = std::move(batch.front());
  }
  StatePtr state = first->local;
  try {
    process(runtime, std::move(*first));
  } catch (...) {  // nothing may escape a lane: the request fails, the lane keeps serving
    fail_in_block(runtime, state, current_exception_text());
  }
}

// Runs compatible requests of a batch in one forward(): inputs stacked along dimension 0, outputs
// split back by each request's rows. Requests that fit with no other run alone.
void SessionCore::process_batch(BlockRuntime& runtime, std::vector<Envelope>&& batch) {
  Block& block = *runtime.block;
  // Requests agree when their inputs have the same count, dtypes, devices and sizes past dim 0.
  auto key = [](const Tensors& inputs) {
    // Rows are counted on the first input: every input must have as many.
    if (inputs.empty()) return std::string();
    std::string k = std::to_string(inputs.size());
    for (const auto& t : inputs) {
      if (!t.defined() || t.dim() == 0) return std::string();  // nothing to stack along
      if (t.size(0) != inputs.front().size(0)) return std::string();
      k += fmt::format("|{}|{}", c10::toString(t.scalar_type()), t.device().str());
      for (std::int64_t d = 1; d < t.dim(); ++d) k += fmt::format(",{}", t.size(d));
    }
    return k;
  };
  std::vector<std::pair<std::string, std::vector<Envelope>>> groups;
  for (auto& envelope : batch) {
    const bool live = !envelope.local->resolved.load(std::memory_order_acquire) &&
                      check_inputs(block, envelope.tensors).ok();
    const std::string k = live ? key(envelope.tensors) : std::string();
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return !k.empty() && g.first == k; });
    if (it == groups.end()) {
      groups.emplace_back(k, std::vector<Envelope>{});
      it = std::prev(groups.end());
    }
    it->second.push_back(std::move(envelope));
  }
  struct Reset { bool was = forwards_follow; ~Reset() { forwards_follow = was; } } reset;  // a batch inside one (helping)
  for (std::size_t g = 0; g < groups.size(); ++g) {
    auto& [k, group] = groups[g];
    const bool last_group = g + 1 == groups.size();
    // Each request of the group is settled (handed on, or failed) in turn: an exception fails the
    // ones not settled yet, never one that has gone on to its next block.
    std::vector<StatePtr> states;
    std::size_t settled = 0;
    try {
      states.reserve(group.size());  // none of the group has gone on before this holds them all
      for (const auto& envelope : group) states.push_back(envelope.local);
      if (group.size() == 1 || k.empty()) {
        for (auto& envelope : group) {
          forwards_follow = !last_group || settled + 1 < group.size();
          process(runtime, std::move(envelope));
          ++settled;
        }
      } else {
        forwards_follow = !last_group;
        process_group(runtime, std::move(group), settled);
      }
    } catch (...) {  // only the requests not yet handed on fail here (a request resolves once)
      const std::string what = current_exception_text();
      if (states.size() < group.size()) {  // no room for `states`: nothing of the group started
        for (const auto& envelope : group) fail_in_block(runtime, envelope.local, what);
      }
      for (std::size_t i = settled; i < states.size(); ++i) fail_in_block(runtime, states[i], what);
    }
  }
}

// One group of a batch whose inputs stack: one forward() for all.
void SessionCore::process_group(BlockRuntime& runtime, std::vector<Envelope>&& group, std::size_t& settled) {
  Block& block = *runtime.block;
  const std::int64_t dequeued = now_ns();
  const std::size_t inputs_per_request = group.front().tensors.size();
  std::vector<std::int64_t> rows;
  Tensors stacked;
  for (std::size_t i = 0; i < inputs_per_request; ++i) {
    std::vector<at::Tensor> parts;
    for (const auto& envelope : group) parts.push_back(envelope.tensors[i]);
    stacked.push_back(at::cat(parts, 0).to(block.device()));
  }
  for (const auto& envelope : group) rows.push_back(envelope.tensors.front().size(0));
  const std::int64_t total = std::accumulate(rows.begin(), rows.end(), std::int64_t{0});
  Block* compute = &block;
  ResidentSet::Hold hold;
  std::int64_t load_start = 0, load_end = 0;  // a load span only for a block that loads on demand
  absl::Status held = absl::OkStatus();
  if (runtime.resident_id >= 0) {
    if (options_.prefetch) prefetch_next(*group.front().local->plan, group.front().node);
    load_start = now_ns();
    held = hold_resident(runtime, hold, compute);
    load_end = now_ns();
  }
  const std::int64_t start = now_ns();
  absl::StatusOr<Tensors> outputs = [&]() -> absl::StatusOr<Tensors> {
    if (!held.ok()) return held;
    const ComputingCall call(runtime, start);
    return guarded_forward(*compute, std::move(stacked));
  }();
  const std::int64_t end = now_ns();
  hold.reset();
  if (outputs.ok()) {
    for (const auto& t : *outputs) {
      if (!t.defined() || t.dim() == 0 || t.size(0) != total) {
        outputs = absl::InternalError(fmt::format(
            "block '{}': a batched output has {} rows for {} input rows; this block cannot batch (set max_batch 1)",
            block.name(), t.defined() && t.dim() > 0 ? t.size(0) : 0, total));
        break;
      }
    }
  }
  runtime.batches.fetch_add(1, std::memory_order_relaxed);
  runtime.batched_requests.fetch_add(group.size(), std::memory_order_relaxed);
  std::int64_t offset = 0;
  for (std::size_t r = 0; r < group.size(); ++r) {
    Envelope& envelope = group[r];
    StatePtr state = std::move(envelope.local);
    const int node = static_cast<int>(envelope.node);
    HopTiming& hop = state->hops[static_cast<std::size_t>(node)];
    hop.arrived_ns = envelope.arrived_ns();
    hop.dequeued_ns = std::max(dequeued, envelope.sent_ns);  // waiting for the batch is waiting
    if (runtime.resident_id >= 0) {
      hop.load_start_ns = load_start;
      hop.load_end_ns = load_end;
    }
    hop.compute_start_ns = start;
    hop.compute_end_ns = end;
    if (!outputs.ok()) {
      runtime.failed.fetch_add(1, std::memory_order_relaxed);
      fail(state, outputs.status());
      ++settled;
      continue;
    }
    Tensors mine;
    for (const auto& t : *outputs) mine.push_back(t.narrow(0, offset, rows[r]));
    offset += rows[r];
    runtime.processed.fetch_add(1, std::memory_order_relaxed);
    ++settled;  // from here on, it is the next block's
    hand_on(runtime, state, node, std::move(mine));
  }
}

absl::Status SessionCore::hold_resident(BlockRuntime& runtime, ResidentSet::Hold& hold, Block*& compute) {
  auto held = resident_->hold_named(runtime.resident_id, runtime.name());
  if (!held.ok()) return held.status();
  hold = *std::move(held);
  compute = hold.block();
  if (hold.loaded_now()) note_active();  // a request loaded it before the background warm-up did
  return absl::OkStatus();
}

void SessionCore::process(BlockRuntime& runtime, Envelope&& envelope) {
  const std::int64_t dequeued = now_ns();
  StatePtr state = std::move(envelope.local);
  if (state->resolved.load(std::memory_order_acquire)) return;  // a sibling branch failed it already
  const int node = static_cast<int>(envelope.node);
  HopTiming& hop = state->hops[static_cast<std::size_t>(node)];
  hop.arrived_ns = envelope.arrived_ns();
  hop.dequeued_ns = dequeued;
  Block& block = *runtime.block;

  Tensors inputs = std::move(envelope.tensors);
  absl::Status status = check_inputs(block, inputs);
  if (status.ok()) {
    for (auto& t : inputs) {
      if (t.defined() && t.device() != block.device()) t = t.to(block.device());
    }
  }
  Block* compute = &block;
  ResidentSet::Hold hold;  // an on-demand block stays loaded while it computes
  if (status.ok() && runtime.resident_id >= 0) {
    if (options_.prefetch) prefetch_next(*state->plan, envelope.node);
    hop.load_start_ns = now_ns();
    status = hold_resident(runtime, hold, compute);
    hop.load_end_ns = now_ns();
  }
  hop.compute_start_ns = now_ns();
  const bool keep_layout = state->plan->nodes[static_cast<std::size_t>(node)].keep_layout;
  OpaqueLayout* layout = keep_layout || is_opaque(inputs) ? runtime.layout : nullptr;
  absl::StatusOr<Tensors> outputs = [&]() -> absl::StatusOr<Tensors> {
    if (!status.ok()) return status;
    const ComputingCall call(runtime, hop.compute_start_ns);
    return guarded_forward(*compute, std::move(inputs), layout, keep_layout);
  }();
  hop.compute_end_ns = now_ns();
  hold.reset();  // before the hand-off: the next block may need the room
  if (!outputs.ok()) {
    runtime.failed.fetch_add(1, std::memory_order_relaxed);
    fail(state, outputs.status());
    return;
  }
  runtime.processed.fetch_add(1, std::memory_order_relaxed);
  if (keep_layout && is_opaque(*outputs)) runtime.layout_kept.fetch_add(1, std::memory_order_relaxed);
  hand_on(runtime, state, node, std::move(*outputs));
}

void SessionCore::forward_outputs(const StatePtr& state, int node, Tensors&& outputs, BlockRuntime* runtime) {
  const PathPlan& plan = *state->plan;
  HopTiming& hop = state->hops[static_cast<std::size_t>(node)];
  hop.done_ns = now_ns();
  if (runtime != nullptr) {
    // Recorded before the hand-off, so a caller woken by the result sees this hop counted.
    runtime->wait.record(hop.dequeued_ns - hop.arrived_ns);
    runtime->compute.record(hop.compute_end_ns - hop.compute_start_ns);
    runtime->overhead.record((hop.arrived_ns - hop.input_ready_ns) + (hop.compute_start_ns - hop.dequeued_ns) -
                             (hop.load_end_ns - hop.load_start_ns) + (hop.done_ns - hop.compute_end_ns));
  }
  if (node == plan.sink) return resolve(state, absl::OkStatus(), std::move(outputs));
  const auto& successors = plan.nodes[static_cast<std::size_t>(node)].successors;
  const std::int64_t ready = hop.done_ns;
  for (std::size_t i = 0; i < successors.size(); ++i) {
    const bool last = i + 1 == successors.size();
    deliver(state, successors[i].node, successors[i].slot, last ? std::move(outputs) : Tensors(outputs), ready);
  }
}

void SessionCore::deliver(const StatePtr& state, int node, int slot, Tensors&& tensors, std::int64_t ready_ns) {
  const PlanNode& target = state->plan->nodes[static_cast<std::size_t>(node)];
  if (target.join_index >= 0) {
    JoinState& join = state->joins[static_cast<std::size_t>(target.join_index)];
    join.inputs[static_cast<std::size_t>(slot)] = std::move(tensors);
    join.ready_ns[static_cast<std::size_t>(slot)] = ready_ns;
    if (join.remaining.fetch_sub(1, std::memory_order_acq_rel) != 1) return;  // siblings still running
    const auto last = std::max_element(join.ready_ns.begin(), join.ready_ns.end());
    const auto last_slot = static_cast<std::size_t>(last - join.ready_ns.begin());
    state->critical_pred[static_cast<std::size_t>(node)] = target.inputs[last_slot];
    run_join(state, node, std::move(join.inputs), *last);
    return;
  }
  state->critical_pred[static_cast<std::size_t>(node)] = target.inputs.empty() ? -1 : target.inputs.front();
  state->hops[static_cast<std::size_t>(node)].input_ready_ns = ready_ns;
  hand_over(target, Envelope{state->id, static_cast<std::uint32_t>(node), std::move(tensors), 0, state});
}

void SessionCore::hand_over(const PlanNode& target, Envelope&& envelope) {
  BlockRuntime* runtime = target.block;
  if (runtime->site != nullptr) {
    // A block at a site with nothing queued before this request: the site may take it from this
    // thread, sparing the forwarding thread's wake-up (RemoteSite::try_run()).
    // A closed inbox (the block was removed by an update) fails the request in send() below.
    if (runtime->to_forward.load(std::memory_order_acquire) == 0 && !runtime->inbox->closed() &&
        try_site_now(*runtime, envelope)) {
      return;
    }
    runtime->to_forward.fetch_add(1, std::memory_order_acq_rel);
    if (delivering_for_site && runtime->inbox->full_policy() == FullPolicy::kBlock) {
      // A site's thread may not wait for room here either: the forwarder makes room only as the
      // site takes requests, and a site takes them only as its thread takes results in (this
      // thread, when both blocks run at one site). A full queue hands the request over to a lane.
      return queue_from_site(*runtime, std::move(envelope), target);
    }
    return handle_displaced(send_to_site_block(*runtime, std::move(envelope), absl::InfiniteFuture()), target);
  }
  // Run to completion: on a lane, a block with nothing queued before this request runs next on
  // this same lane, once the current block is done (no queue, no wake-up, warm caches). Not for a
  // submit() from a completion callback (a closed loop resubmitting as each result comes): claimed
  // here, its requests would follow one another on this lane for as long as the loop goes on, ahead
  // of every other block's work; through the queue they take their turns.
  if (calling_back == nullptr && !forwards_follow && runtime->inbox->depth() == 0 && !runtime->inbox->closed() &&
      !runtime->gathering.load(std::memory_order_acquire) && lanes_->claim_next(*runtime)) {
    envelope.sent_ns = now_ns();
    runtime->handed_directly.fetch_add(1, std::memory_order_relaxed);
    try {
      lanes_->run_next([this, runtime, e = std::move(envelope)]() mutable { run_block(*runtime, std::move(e)); });
    } catch (...) {  // out of memory: the claim goes back (the caller fails the request)
      lanes_->unclaim_next(*runtime);
      throw;
    }
    return;
  }
  queue_on_lanes(*runtime, std::move(envelope), target);
}

SendOutcome SessionCore::send_to_site_block(BlockRuntime& runtime, Envelope&& envelope, absl::Time deadline) {
  const auto uncount = [&runtime] { runtime.to_forward.fetch_sub(1, std::memory_order_acq_rel); };
  SendOutcome outcome;
  try {
    outcome = runtime.inbox->send(std::move(envelope), deadline);
  } catch (...) {
    uncount();
    throw;
  }
  // None stays when one comes back refused (a closed queue) or displaced (the oldest, by this one);
  // one that found no room in time comes back still counted: it waits in the hand-over line.
  if (outcome.displaced.has_value() && !absl::IsDeadlineExceeded(outcome.status)) uncount();
  return outcome;
}

void SessionCore::queue_on_lanes(BlockRuntime& runtime, Envelope&& envelope, const PlanNode& target) {
  if (delivering_for_site && runtime.inbox->full_policy() == FullPolicy::kBlock && lanes_->current_lane() < 0) {
    return queue_from_site(runtime, std::move(envelope), target);
  }
  queue_now(runtime, std::move(envelope), target);
}

void SessionCore::queue_now(BlockRuntime& runtime, Envelope&& envelope, const PlanNode& target) {
  SendOutcome outcome = lanes_->current_lane() >= 0 && runtime.inbox->full_policy() == FullPolicy::kBlock
                            ? send_from_lane(runtime, std::move(envelope))
                            : runtime.inbox->send(std::move(envelope));
  lanes_->notify(runtime);
  handle_displaced(std::move(outcome), target);
}

// A lane must not sleep on a full queue (with one lane nobody would empty it): it helps, queueing
// its request as it takes the oldest out (no application thread takes the room it makes), and runs
// the one it took. Helping nests up to kMaxHelpDepth; beyond, or when other lanes hold the block,
// the lane waits for them, unless they wait too, directly or through others: then nobody ever
// would make room (tasks whose paths cross), and it queues past the bound, up to a limit.
SendOutcome SessionCore::send_from_lane(BlockRuntime& runtime, Envelope&& envelope) {
  thread_local int helping = 0;
  constexpr int kMaxHelpDepth = 8;
  struct ClearMark {  // the lane waits for nothing once this returns
    ComputeLanes& lanes;
    explicit ClearMark(ComputeLanes& l) : lanes(l) {}
    ClearMark(const ClearMark&) = delete;
    ClearMark& operator=(const ClearMark&) = delete;
    ~ClearMark() { lanes.stop_waiting(); }
  };
  // Made at the first wait_can_end(), which marks what the lane waits for: a send that finds room
  // (the usual case) takes no lock of the lanes'.
  std::optional<ClearMark> clear;
  absl::Duration wait = absl::ZeroDuration();  // 1 ms once the lane can do nothing for the queue
  for (;;) {
    SendOutcome outcome = runtime.inbox->send(std::move(envelope), absl::Now() + wait);
    if (!absl::IsDeadlineExceeded(outcome.status)) return outcome;
    envelope = std::move(*outcome.displaced);
    const bool may_help = helping < kMaxHelpDepth;
    if (may_help) {
      struct Nested {  // the depth is restored however this block is left (a throw included)
        int& depth;
        explicit Nested(int& d) : depth(++d) {}
        ~Nested() { --depth; }
      } nested(helping);
      // The next block of a request this lane claimed may be what the lane emptying this queue
      // waits for (its own full queue, whose block only our claim lets run): run it first.
      const bool ran_claimed = lanes_->run_claimed();
      std::optional<SendOutcome> queued;
      if (!ran_claimed) {
        (void)lanes_->help(runtime, [&] {
          std::optional<Envelope> oldest;
          queued = runtime.inbox->exchange(std::move(envelope), oldest);
          if (!oldest) return false;  // room came meanwhile: queued, nothing to run
          run_block(runtime, std::move(oldest));
          return true;
        });
      }
      if (queued) return std::move(*queued);
      if (ran_claimed) {
        wait = absl::ZeroDuration();
        continue;
      }
    }
    wait = absl::Milliseconds(1);
    if (!clear) clear.emplace(*lanes_);
    if (lanes_->wait_can_end(runtime, may_help)) continue;
    // Past the bound by at most what every lane could hold at every depth: beyond, the request
    // fails rather than grow the queue without limit.
    const std::size_t limit = runtime.inbox->capacity() + static_cast<std::size_t>(lanes_->size() * kMaxHelpDepth);
    SendOutcome past = runtime.inbox->send_past_capacity(std::move(envelope), limit);
    if (absl::IsResourceExhausted(past.status)) {
      past.status = absl::ResourceExhaustedError(
          fmt::format("queue full ({} queued past its capacity of {}) and no lane that could empty it is free: each waits "
                      "for room itself (tasks whose paths cross, or a request handed back to a block its lane holds)",
                      limit, runtime.inbox->capacity()));
    }
    return past;
  }
}

void SessionCore::run_join(const StatePtr& state, int node, std::vector<Tensors>&& inputs, std::int64_t ready_ns) {
  const PlanNode& target = state->plan->nodes[static_cast<std::size_t>(node)];
  HopTiming& hop = state->hops[static_cast<std::size_t>(node)];
  hop.input_ready_ns = ready_ns;
  if (target.block != nullptr) {
    // A block with several inputs: merge, then queue like any other hop (the merge is overhead).
    auto merged = target.combine.apply(std::move(inputs));
    if (!merged.ok()) {
      return fail(state, with_prefix(merged.status(), fmt::format("path '{}', inputs of block '{}'",
                                                                  state->plan->task, target.name)));
    }
    return hand_over(target, Envelope{state->id, static_cast<std::uint32_t>(node), std::move(*merged), 0, state});
  }
  // A block-less join runs the combine rule inline; it counts as the node's compute.
  hop.arrived_ns = hop.dequeued_ns = hop.compute_start_ns = now_ns();
  auto merged = target.combine.apply(std::move(inputs));
  hop.compute_end_ns = now_ns();
  if (!merged.ok()) {
    return fail(state, with_prefix(merged.status(), fmt::format("path '{}', join '{}'", state->plan->task, target.name)));
  }
  forward_outputs(state, node, std::move(*merged), nullptr);
}

void SessionCore::handle_displaced(SendOutcome&& outcome, const PlanNode& target) {
  if (!outcome.displaced) return;
  StatePtr victim = std::move(outcome.displaced->local);
  target.block->failed.fetch_add(1, std::memory_order_relaxed);
  absl::Status why;
  try {
    why = displaced_why(outcome.status, target);
  } catch (...) {  // out of memory for the message: the request fails all the same
    why = absl::ResourceExhaustedError("a block's input queue refused the request (no memory to say more)");
  }
  fail(victim, why);
}

absl::Status SessionCore::displaced_why(const absl::Status& status, const PlanNode& target) const {
  const std::string& block = target.block->name();
  absl::Status why;
  if (status.ok()) {
    why = absl::ResourceExhaustedError(fmt::format("block '{}': dropped from its full input queue (policy drop-oldest)", block));
  } else if (absl::IsCancelled(status)) {
    const std::string* removed = target.block->removed_why.load(std::memory_order_acquire);
    why = absl::CancelledError(stopped_.load() ? fmt::format("block '{}': session shut down before the request reached it", block)
                               : removed != nullptr ? fmt::format("block '{}': {}", block, *removed)
                                                    : fmt::format("block '{}': removed by an update before the request reached it", block));
  } else {
    why = with_prefix(status, fmt::format("block '{}': input", block));
  }
  return why;
}

void SessionCore::fail(const StatePtr& state, absl::Status status) { resolve(state, std::move(status), {}); }

void SessionCore::fail_in_block(BlockRuntime& runtime, const StatePtr& state, std::string_view what) {
  runtime.failed.fetch_add(1, std::memory_order_relaxed);
  fail(state, absl::InternalError(fmt::format("block '{}': {}", runtime.name(), what)));
}

void SessionCore::resolve(const StatePtr& state, absl::Status status, Tensors outputs) {
  if (state->resolved.exchange(true, std::memory_order_acq_rel)) return;
  // From here on the request must reach done(), whatever happens: nobody resolves it again.
  Result result;
  PathRuntime& path = *state->path;
  try {
    trace_result(*state, status.ok(), result);
  } catch (...) {
    // Out of memory for its trace (strings, hops): it resolves all the same, with no trace.
    result.trace = RequestTrace{};
    result.trace.request_id = state->id;
  }
  if (status.ok()) result.outputs = std::move(outputs);
  result.status = std::move(status);
  {
    blockflow::detail::MutexLock lock(&live_mu_);
    live_.erase(state->id);
  }
  auto done = std::move(state->done);
  in_flight_.fetch_sub(1, std::memory_order_acq_rel);  // before done(): its caller may read metrics
  const SessionCore* outer = std::exchange(calling_back, this);
  // A callback on a site's thread keeps the thread's rule: a submit() it makes (a closed loop)
  // into a full queue goes to the block's hand-over line rather than wait for room that may depend
  // on this very thread (the worker's next results). Elsewhere it waits as the application's do.
  const bool outer_delivering = delivering_for_site;
  struct Restore {
    SessionCore* core;
    const StatePtr& state;
    const SessionCore* outer;
    bool outer_delivering;
    ~Restore() {
      calling_back = outer;
      delivering_for_site = outer_delivering;
      core->leave_entry(state);  // after done(), thrown or not: the next request waiting at the entry starts
    }
  } restore{this, state, outer, outer_delivering};
  // The application's callback: whatever it throws stays here, so that a caller resolving several
  // requests (a shutdown, an update's drain, a batch, an evicted request) resolves the others too.
  try {
    done(std::move(result));
  } catch (...) {
    callback_thrown(state->id, path.task, current_exception_text());
  }
}

void SessionCore::trace_result(const RequestState& state, bool ok, Result& result) {
  result.trace.request_id = state.id;
  result.trace.task = state.path->task;
  result.trace.submitted_ns = state.submitted_ns;
  result.trace.resolved_ns = now_ns();
  PathRuntime& path = *state.path;
  if (ok) {
    // Walk the critical path back from the sink.
    for (int node = state.plan->sink; node >= 0; node = state.critical_pred[static_cast<std::size_t>(node)]) {
      HopTiming hop = state.hops[static_cast<std::size_t>(node)];
      hop.node = state.plan->nodes[static_cast<std::size_t>(node)].name;
      const auto* block = state.plan->nodes[static_cast<std::size_t>(node)].block;
      if (block != nullptr) hop.block = block->name();
      result.trace.hops.push_back(std::move(hop));
    }
    std::reverse(result.trace.hops.begin(), result.trace.hops.end());
    for (auto* first : {&first_result_ns_, &update_first_result_ns_}) {
      std::int64_t none = 0;
      if (first->load(std::memory_order_relaxed) == 0) first->compare_exchange_strong(none, result.trace.resolved_ns, std::memory_order_relaxed);
    }
    // The last hop ends when the request resolves: its resolution cost is overhead too.
    result.trace.hops.back().done_ns = result.trace.resolved_ns;
    path.completed.fetch_add(1, std::memory_order_relaxed);
    auto ms_to_ns = [](double ms) { return static_cast<std::int64_t>(ms * 1e6); };
    path.e2e.record(result.trace.resolved_ns - result.trace.submitted_ns);
    path.wait.record(ms_to_ns(result.trace.wait_ms()));
    path.compute.record(ms_to_ns(result.trace.compute_ms()));
    path.overhead.record(ms_to_ns(result.trace.overhead_ms()));
  } else {
    path.failed.fetch_add(1, std::memory_order_relaxed);
  }
}

void SessionCore::callback_thrown(std::uint64_t id, const std::string& task, std::string_view what) {
  static RateLimitedLog noisy;
  noisy.log(LogLevel::kWarning,
            fmt::format("request {} of task '{}': its completion callback threw ({}); dropped, the session goes on", id,
                        task, what));
}

bool SessionCore::on_own_thread() const { return calling_back == this || (lanes_ && lanes_->current_lane() >= 0); }

}  // namespace blockflow::detail
