// The session's entry: submit(), the entry window of each task (SessionOptions::
// max_in_flight_per_task, detail::EntryGate) and how a request starts along its path.

#include <blockflow/core/detail/clock.hpp>
#include <blockflow/core/detail/exception_text.hpp>
#include <blockflow/core/detail/log.hpp>
#include <blockflow/core/detail/session_core.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <deque>
#include <utility>

namespace blockflow::detail {

std::optional<EntryGate::Waiting> EntryGate::leave() {
  MutexLock lock(&mu_);
  while (!queue_.empty()) {
    Waiting next = std::move(queue_.front());
    queue_.pop_front();
    if (!next.state->resolved.load(std::memory_order_acquire)) return next;  // inherits the place
  }
  --taken_;
  return std::nullopt;
}

namespace {

// The admissions a thread is running for one session, one after the other: one that fails at once
// resolves, and so admits the next, without the stack growing with the queue.
struct AdmissionLoop {
  const SessionCore* owner;
  std::deque<EntryGate::Waiting> queue;
};
thread_local AdmissionLoop* admitting_here = nullptr;

}  // namespace

void SessionCore::submit(const std::string& task, Tensors inputs, std::function<void(Result&&)> done) {
  in_flight_.fetch_add(1, std::memory_order_acq_rel);  // before the check: shutdown waits on it
  if (!admitting_.load(std::memory_order_acquire)) {
    in_flight_.fetch_sub(1, std::memory_order_acq_rel);
    return reject_now(task, absl::FailedPreconditionError(
                                stopped_ ? "session is shut down" : "session is not started (call start() first)"),
                      done);
  }
  auto table = routing();
  auto it = table->plans.find(task);
  if (it == table->plans.end()) {
    in_flight_.fetch_sub(1, std::memory_order_acq_rel);
    std::vector<std::string> known;
    for (const auto& [name, plan] : table->plans) known.push_back(name);
    std::sort(known.begin(), known.end());
    return reject_now(task, absl::NotFoundError(fmt::format("unknown task '{}' (known: {})", task, fmt::join(known, ", "))),
                      done);
  }
  // Until the request is registered, a throw (out of memory) leaves submit() with nothing started;
  // after, the request resolves through `done` instead (never both).
  StatePtr state;
  try {
    state = std::make_shared<RequestState>();
    state->id = next_id_.fetch_add(1, std::memory_order_relaxed);
    state->path = it->second->metrics;
    state->submitted_ns = now_ns();
    state->done = std::move(done);  // before it is registered: a shutdown may fail it from then on
    blockflow::detail::MutexLock lock(&live_mu_);
    live_.emplace(state->id, state);
  } catch (...) {
    in_flight_.fetch_sub(1, std::memory_order_acq_rel);
    throw;
  }
  state->path->submitted.fetch_add(1, std::memory_order_relaxed);
  try {
    enter(state, it->second, std::move(inputs));
  } catch (...) {
    fail_unstarted(state);
  }
}

void SessionCore::fail_unstarted(const StatePtr& state) noexcept {
  try {
    fail(state, absl::ResourceExhaustedError(
                    fmt::format("task '{}': the request could not start: {}", state->path->task, current_exception_text())));
  } catch (...) {
    try {
      fail(state, absl::ResourceExhaustedError("the request could not start"));
    } catch (...) {  // no memory even for that: nothing more can be done here (shutdown fails it)
    }
  }
}

void SessionCore::enter(const StatePtr& state, std::shared_ptr<const PathPlan> plan, Tensors&& inputs) {
  const int limit = options_.max_in_flight_per_task;
  if (limit > 0) {
    EntryGate::Waiting request{state, std::move(inputs)};
    if (!state->path->gate.enter_or_wait(limit, request)) {
      state->path->waited_at_entry.fetch_add(1, std::memory_order_relaxed);
      return;  // a resolution of this task admits it (admit()), on the plan of that moment
    }
    inputs = std::move(request.inputs);
    if (!take_place(state)) return;
  }
  begin(state, std::move(plan), std::move(inputs), /*waited=*/false);
}

bool SessionCore::take_place(const StatePtr& state) {
  // A resolve() from now on gives the place back. One that came first (shutdown fails waiting
  // requests) found no place to give: give it back here, and start nothing.
  if (state->place.exchange(RequestState::kPlaceHeld, std::memory_order_acq_rel) != RequestState::kPlaceReturned) return true;
  hand_place_on(state);
  return false;
}

void SessionCore::begin(const StatePtr& state, std::shared_ptr<const PathPlan> plan_ptr, Tensors&& inputs, bool waited,
                        bool* handed_on) {
  state->plan = std::move(plan_ptr);
  const PathPlan& plan = *state->plan;
  state->hops.resize(plan.nodes.size());
  state->critical_pred.assign(plan.nodes.size(), -1);
  if (plan.num_joins > 0) {
    state->joins = std::make_unique<JoinState[]>(static_cast<std::size_t>(plan.num_joins));
    for (const auto& node : plan.nodes) {
      if (node.join_index < 0) continue;
      JoinState& join = state->joins[static_cast<std::size_t>(node.join_index)];
      join.remaining.store(static_cast<int>(node.inputs.size()), std::memory_order_relaxed);
      join.inputs.resize(node.inputs.size());
      join.ready_ns.resize(node.inputs.size());
    }
  }
  // A request that waited at the entry starts now: the wait is its entry hops' entry_wait_ns (wait,
  // in the trace), so the blocks' own wait and overhead do not count it.
  const std::int64_t started = waited ? now_ns() : state->submitted_ns;
  if (handed_on != nullptr) *handed_on = true;  // from here on a block may hold it
  for (std::size_t i = 0; i < plan.entries.size(); ++i) {
    const bool last = i + 1 == plan.entries.size();
    state->hops[static_cast<std::size_t>(plan.entries[i])].entry_wait_ns = started - state->submitted_ns;
    deliver(state, plan.entries[i], 0, last ? std::move(inputs) : Tensors(inputs), started);
  }
}

void SessionCore::admit(EntryGate::Waiting&& waiting, bool& handed_on) {
  const StatePtr& state = waiting.state;
  if (!take_place(state)) return;
  auto table = routing();
  auto it = table->plans.find(state->path->task);
  if (it == table->plans.end() || it->second->metrics != state->path) {
    // Removed (or removed, its counters freed, and added again: a task of the same name, not this one).
    handed_on = true;
    return fail(state, absl::NotFoundError(fmt::format(
                           "task '{}' was removed by an update while the request waited at its entry", state->path->task)));
  }
  begin(state, it->second, std::move(waiting.inputs), /*waited=*/true, &handed_on);  // the task's path as it is now
}

void SessionCore::leave_entry(const StatePtr& state) noexcept {
  if (options_.max_in_flight_per_task <= 0) return;  // no window: no place was taken
  if (state->place.exchange(RequestState::kPlaceReturned, std::memory_order_acq_rel) != RequestState::kPlaceHeld) return;
  hand_place_on(state);
}

void SessionCore::hand_place_on(const StatePtr& state) noexcept {
  std::optional<EntryGate::Waiting> next;
  try {
    next = state->path->gate.leave();
    if (next) schedule_admission(std::move(*next));
  } catch (...) {
    // Scheduling it failed (out of memory) before it was moved on: the waiting request fails
    // rather than wait for ever, and the place handed to it goes back (take_place() after resolve).
    try {
      if (next && next->state) {
        const StatePtr waiter = std::move(next->state);
        fail(waiter, absl::ResourceExhaustedError(fmt::format(
                         "task '{}': the request could not be started after waiting at its task's entry", state->path->task)));
        (void)take_place(waiter);
      }
      log(LogLevel::kError, fmt::format("task '{}': a request waiting at its entry could not be started", state->path->task));
    } catch (...) {
    }
  }
}

void SessionCore::schedule_admission(EntryGate::Waiting&& waiting) {
  if (admitting_here != nullptr && admitting_here->owner == this) {
    admitting_here->queue.push_back(std::move(waiting));
    return;
  }
  if (lanes_) {
    auto shared = std::make_shared<EntryGate::Waiting>(std::move(waiting));
    bool posted = false;
    try {
      posted = lanes_->post([this, shared] { run_admissions(std::move(*shared)); });
    } catch (...) {
      waiting = std::move(*shared);  // back to the caller, which fails it (leave_entry())
      throw;
    }
    if (posted) return;
    waiting = std::move(*shared);  // the lanes have stopped: run it here (every queue is closed)
  }
  run_admissions(std::move(waiting));
}

void SessionCore::run_admissions(EntryGate::Waiting&& first) {
  AdmissionLoop loop{this, {}};
  loop.queue.push_back(std::move(first));
  AdmissionLoop* const outer = std::exchange(admitting_here, &loop);
  struct Restore {
    AdmissionLoop* outer;
    ~Restore() { admitting_here = outer; }
  } restore{outer};
  while (!loop.queue.empty()) {
    EntryGate::Waiting next = std::move(loop.queue.front());
    loop.queue.pop_front();
    const StatePtr state = next.state;
    bool handed_on = false;
    try {
      admit(std::move(next), handed_on);
    } catch (...) {
      // (Out of memory, say.) The others still start; this one fails, even if it was on its way: the
      // throw may have come before any block queued it, and nobody would resolve it then (one that a
      // block did queue is skipped there, resolved already).
      try {
        log(LogLevel::kError, fmt::format("task '{}': starting a request that waited at its entry threw{}",
                                          state->path->task, handed_on ? " (after it was handed on)" : ""));
      } catch (...) {
      }
      fail_unstarted(state);
    }
  }
}

}  // namespace blockflow::detail
