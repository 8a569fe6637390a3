// The session's remote sites: starting them, forwarding a block's queue to its site, and what
// the site reports back.
#include <blockflow/core/detail/clock.hpp>
#include <blockflow/core/detail/exception_text.hpp>
#include <blockflow/core/detail/log.hpp>
#include <blockflow/core/detail/mutex.hpp>
#include <blockflow/core/detail/run_in_threads.hpp>
#include <blockflow/core/detail/session_core.hpp>

#include <fmt/format.h>

#include <thread>

namespace blockflow::detail {

std::vector<BlockDescription> SessionCore::descriptions_of(const SiteRuntime& site) {
  std::vector<BlockDescription> out;
  for (const auto* runtime : site.blocks) out.push_back(runtime->description);
  return out;
}

absl::Status SessionCore::start_site(SiteRuntime& site) {
  // A site of a lost one's name (an update brought it back) is not lost: its own loss, even one
  // during start(), is reported anew. Should it not start, the name is listed as lost again.
  const bool was_lost = losses_->restored(site.site->name());
  site.site->on_lost([this, name = site.site->name()](const std::string& cause) { losses_->report(name, cause); });
  // Weakly: a site may still be reporting (a request another site's thread fails) as an update
  // retires it and collect_retired() frees it; such a late completion is then dropped.
  absl::Status status;
  try {  // on a thread of run_in_threads(), an exception would end the process
    status = site.site->start(descriptions_of(site), [this, weak = site.weak_from_this()](SiteCompletion&& c) {
      if (auto alive = weak.lock()) on_site_completion(*alive, std::move(c));
    });
  } catch (...) {
    status = absl::InternalError(fmt::format("site '{}': start() threw: {}", site.site->name(), current_exception_text()));
  }
  if (!status.ok()) {
    if (was_lost) losses_->relist(site.site->name());
    return status;
  }
  site.peer_endpoint = site.site->peer_endpoint();
  return status;
}

namespace {

// Direct edges: node `node` runs at a site that may keep its outputs, because every next node is a
// single-input block at a site reachable from it (RemoteSite::peer_endpoint()).
bool outputs_may_stay(const PathPlan& plan, std::uint32_t node) {
  const PlanNode& n = plan.nodes[node];
  if (n.block == nullptr || n.block->site == nullptr || n.block->site->peer_endpoint.empty() || n.successors.empty()) {
    return false;
  }
  for (const PlanEdge& e : n.successors) {
    const PlanNode& next = plan.nodes[static_cast<std::size_t>(e.node)];
    if (next.join_index >= 0 || next.block == nullptr || next.block->site == nullptr ||
        next.block->site->peer_endpoint.empty()) {
      return false;
    }
  }
  return true;
}

}  // namespace

// Every site at once (a worker's start is mostly waiting: process start, runtime and model load),
// each on a thread of its own. The first failure in site order is returned, the others logged; the
// caller stops everything started.
absl::Status SessionCore::start_sites() {
  std::vector<absl::Status> results(sites_.size());
  for (auto& site : sites_) site->site->starting_together(static_cast<int>(sites_.size()));
  run_in_threads(sites_.size(), [&](std::size_t i) { results[i] = start_site(*sites_[i]); });
  absl::Status first;
  for (const auto& status : results) {
    if (status.ok()) continue;
    if (first.ok()) first = status;
    else log(LogLevel::kWarning, fmt::format("start(): also failed: {}", std::string(status.message())));
  }
  if (!first.ok()) return first;
  for (auto& runtime : blocks_) {
    if (runtime->site == nullptr) continue;
    try {
      runtime->forwarder = std::thread([this, rt = runtime.get()] { forward_to_site(*rt); });
    } catch (const std::exception& e) {  // no thread to be had; start() shuts down what started
      return absl::ResourceExhaustedError(fmt::format("block '{}': no thread to feed its site: {}", runtime->name(), e.what()));
    }
  }
  return absl::OkStatus();
}

void SessionCore::forward_to_site(BlockRuntime& runtime) {
  name_thread(runtime.name(), 0);
  // A request this thread fails runs its callback here: a submit() it makes (a closed loop) into
  // this block's full queue must not wait for room that only this thread makes.
  NeverWaitHere never_wait;
  while (auto envelope = runtime.inbox->receive(absl::InfiniteFuture())) {
    struct Forwarded {  // handed to the site, or given up: a later request may bypass the queue
      BlockRuntime& runtime;
      ~Forwarded() { runtime.to_forward.fetch_sub(1, std::memory_order_acq_rel); }
    } forwarded{runtime};
    const std::int64_t dequeued = now_ns();
    StatePtr state = std::move(envelope->local);
    if (state->resolved.load(std::memory_order_acquire)) continue;
    HopTiming& hop = state->hops[envelope->node];
    hop.arrived_ns = envelope->arrived_ns();
    hop.dequeued_ns = dequeued;  // provisional: on completion it also absorbs the site's queueing
    bool handed = false, listed = false;
    try {
      {
        blockflow::detail::MutexLock lock(&runtime.site->mu);
        runtime.site->in_flight[{envelope->request_id, envelope->node}] = {state, &runtime};
        listed = true;
      }
      envelope->outputs_may_stay = outputs_may_stay(*state->plan, envelope->node);
      handed = runtime.site->site->run_unless(runtime.name(), *envelope, runtime.stop_feeding);
    } catch (...) {
      // The site threw (a RemoteSite's run(), out of memory): the request fails, unless the site
      // reported it first, and this thread goes on feeding the site.
      bool ours = !listed;  // never listed (no memory for that): nobody else can report it
      if (listed) {
        blockflow::detail::MutexLock lock(&runtime.site->mu);
        ours = runtime.site->in_flight.erase({envelope->request_id, envelope->node}) > 0;
      }
      if (ours) {
        runtime.failed.fetch_add(1, std::memory_order_relaxed);
        fail_noexcept(runtime, state, absl::StatusCode::kInternal, "could not be handed to its site",
                      "the request could not be handed to its site");
      }
      continue;
    }
    if (handed) continue;
    // The site made no room before the session stopped feeding the block: the request is ours again.
    // What still queues is failed by whoever set stop_feeding, once this thread is joined.
    {
      blockflow::detail::MutexLock lock(&runtime.site->mu);
      runtime.site->in_flight.erase({envelope->request_id, envelope->node});
    }
    const std::string* removed = runtime.removed_why.load(std::memory_order_acquire);
    runtime.failed.fetch_add(1, std::memory_order_relaxed);
    fail(state, absl::CancelledError(fmt::format(
                    "block '{}': {} (the request waited for room at site '{}', which made none)", runtime.name(),
                    removed != nullptr ? *removed : std::string("session shut down before the request reached it"),
                    runtime.site->site->name())));
    break;
  }
}

void SessionCore::on_site_completion(SiteRuntime& site, SiteCompletion&& c) {
  const std::int64_t received = now_ns();
  std::pair<StatePtr, BlockRuntime*> entry;
  {
    blockflow::detail::MutexLock lock(&site.mu);
    auto it = site.in_flight.find({c.request_id, c.node});
    if (it == site.in_flight.end()) return;  // already reported (exactly once)
    entry = std::move(it->second);
    site.in_flight.erase(it);
  }
  auto& [state, runtime] = entry;
  // A callback that this thread runs (for a failure too) must not wait for room either.
  NeverWaitHere delivering;
  if (!c.outputs.ok()) {
    runtime->failed.fetch_add(1, std::memory_order_relaxed);
    // Named by its block when the site did not ("worker w2 killed by signal 9" fails the requests
    // of every block the worker held).
    const absl::Status& why = c.outputs.status();
    absl::Status named = why;
    try {
      const std::string block = fmt::format("block '{}'", runtime->name());
      if (why.message().find(block) == std::string_view::npos) {
        named = absl::Status(why.code(), fmt::format("{}: {}", block, std::string(why.message())));
      }
    } catch (...) {  // no memory for the longer message: the site's own
    }
    return fail(state, std::move(named));
  }
  HopTiming& hop = state->hops[c.node];
  // Same host, same steady clock: wait = our queue + the site's queue; the transfers are overhead.
  const std::int64_t start = c.compute_start_ns != 0 ? c.compute_start_ns : received;
  const std::int64_t end = c.compute_end_ns != 0 ? c.compute_end_ns : received;
  hop.dequeued_ns = std::min(hop.dequeued_ns + c.wait_ns, start);
  hop.compute_start_ns = start;
  hop.compute_end_ns = end;
  runtime->processed.fetch_add(1, std::memory_order_relaxed);
  hand_on(*runtime, state, static_cast<int>(c.node), *std::move(c.outputs));
}

bool SessionCore::try_site_now(BlockRuntime& runtime, Envelope& envelope) {
  StatePtr state = envelope.local;
  if (state->resolved.load(std::memory_order_acquire)) return true;  // failed meanwhile: nothing to run
  const std::pair<std::uint64_t, std::uint32_t> key{envelope.request_id, envelope.node};
  HopTiming& hop = state->hops[envelope.node];
  hop.arrived_ns = hop.dequeued_ns = now_ns();
  {
    blockflow::detail::MutexLock lock(&runtime.site->mu);
    runtime.site->in_flight[key] = {state, &runtime};
  }
  envelope.outputs_may_stay = outputs_may_stay(*state->plan, envelope.node);
  bool taken = false;
  try {
    taken = runtime.site->site->try_run(runtime.name(), envelope);
  } catch (...) {  // the caller fails the request: nothing of it stays listed at the site
    blockflow::detail::MutexLock lock(&runtime.site->mu);
    runtime.site->in_flight.erase(key);
    throw;
  }
  if (taken) {
    runtime.handed_directly.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  blockflow::detail::MutexLock lock(&runtime.site->mu);
  runtime.site->in_flight.erase(key);
  return false;
}

}  // namespace blockflow::detail
