// The session's entry: submit(), the entry window of each task (SessionOptions::
// max_in_flight_per_task, detail::EntryGate) and how a request starts along its path.

#include <blockflow/core/detail/clock.hpp>
#include <blockflow/core/detail/session_core.hpp>

#include <fmt/format.h>

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

// Admissions that a resolution triggers run on the resolving thread, one after the other: one that
// fails at once resolves, and so admits the next, without the stack growing with the queue.
struct PendingAdmission {
  SessionCore* core;
  EntryGate::Waiting waiting;
};
thread_local std::deque<PendingAdmission>* admitting_here = nullptr;

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
  auto state = std::make_shared<RequestState>();
  state->id = next_id_.fetch_add(1, std::memory_order_relaxed);
  state->plan = it->second;
  state->submitted_ns = now_ns();
  state->done = std::move(done);
  state->plan->metrics->submitted.fetch_add(1, std::memory_order_relaxed);
  {
    blockflow::detail::MutexLock lock(&live_mu_);
    live_.emplace(state->id, state);
  }
  enter(state, std::move(inputs));
}

void SessionCore::enter(const StatePtr& state, Tensors&& inputs) {
  const int limit = options_.max_in_flight_per_task;
  if (limit > 0) {
    PathRuntime& task = *state->plan->metrics;
    EntryGate::Waiting request{state, std::move(inputs)};
    if (!task.gate.enter_or_wait(limit, request)) {
      task.waited_at_entry.fetch_add(1, std::memory_order_relaxed);
      return;  // a resolution of this task admits it (admit())
    }
    inputs = std::move(request.inputs);
    if (!take_place(state)) return;
  }
  begin(state, std::move(inputs));
}

bool SessionCore::take_place(const StatePtr& state) {
  // A resolve() from now on gives the place back. One that came first (shutdown fails waiting
  // requests) found no place to give: give it back here, and start nothing.
  if (state->place.exchange(RequestState::kPlaceHeld, std::memory_order_acq_rel) != RequestState::kPlaceReturned) return true;
  if (auto next = state->plan->metrics->gate.leave()) schedule_admission(std::move(*next));
  return false;
}

void SessionCore::begin(const StatePtr& state, Tensors&& inputs) {
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
  // The time it waited at the entry is the first hop's wait (its input was ready at submit()).
  for (std::size_t i = 0; i < plan.entries.size(); ++i) {
    const bool last = i + 1 == plan.entries.size();
    deliver(state, plan.entries[i], 0, last ? std::move(inputs) : Tensors(inputs), state->submitted_ns);
  }
}

void SessionCore::admit(EntryGate::Waiting&& waiting) {
  const StatePtr& state = waiting.state;
  if (!take_place(state)) return;
  const std::shared_ptr<PathRuntime> gate_owner = state->plan->metrics;  // the place is in its gate
  auto table = routing();
  auto it = table->plans.find(gate_owner->task);
  if (it == table->plans.end()) {
    return fail(state, absl::NotFoundError(fmt::format(
                           "task '{}' was removed by an update while the request waited at its entry", gate_owner->task)));
  }
  if (it->second->metrics != gate_owner) {
    // Removed and added again: the task has a new gate. Give this place back and enter that one
    // (unless a resolve() took the place first: then it gave it back, and the request is over).
    int held = RequestState::kPlaceHeld;
    if (!state->place.compare_exchange_strong(held, RequestState::kNoPlace, std::memory_order_acq_rel)) return;
    if (auto next = gate_owner->gate.leave()) schedule_admission(std::move(*next));
    state->plan = it->second;
    return enter(state, std::move(waiting.inputs));
  }
  state->plan = it->second;  // the task's current path (an update may have re-routed it)
  begin(state, std::move(waiting.inputs));
}

void SessionCore::leave_entry(const StatePtr& state) {
  if (state->place.exchange(RequestState::kPlaceReturned, std::memory_order_acq_rel) != RequestState::kPlaceHeld) return;
  if (auto next = state->plan->metrics->gate.leave()) schedule_admission(std::move(*next));
}

void SessionCore::schedule_admission(EntryGate::Waiting&& waiting) {
  if (admitting_here != nullptr) {
    admitting_here->push_back({this, std::move(waiting)});
    return;
  }
  std::deque<PendingAdmission> queue;
  queue.push_back({this, std::move(waiting)});
  admitting_here = &queue;
  while (!queue.empty()) {
    PendingAdmission admission = std::move(queue.front());
    queue.pop_front();
    admission.core->admit(std::move(admission.waiting));
  }
  admitting_here = nullptr;
}

}  // namespace blockflow::detail
