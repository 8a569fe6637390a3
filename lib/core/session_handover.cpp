// A block's hand-over line: how a site's receiving thread queues a request for a block whose queue
// is full (policy block; a block of this process or at a site) without sleeping on it, and without
// letting the site's later requests for that block overtake it.
// And hand_on(): a processed request's output handed to the next block, or the request failed.
#include <blockflow/core/detail/clock.hpp>
#include <blockflow/core/detail/exception_text.hpp>
#include <blockflow/core/detail/session_core.hpp>

#include <fmt/format.h>

#include <deque>
#include <string>

namespace blockflow::detail {
void SessionCore::fail_noexcept(BlockRuntime& runtime, const StatePtr& state, absl::StatusCode code, const char* what,
                                const char* short_what) noexcept {
  try {
    fail(state, absl::Status(code, fmt::format("block '{}': the request {}: {}", runtime.name(), what,
                                               current_exception_text())));
  } catch (...) {
    try {
      fail(state, absl::Status(code, short_what));
    } catch (...) {
    }
  }
}

// Processed, not handed on: failed here, not counted as the block's failure too (a request resolves
// once, so a part already handed on is not failed twice).
void SessionCore::hand_on(BlockRuntime& runtime, const StatePtr& state, int node, Tensors&& outputs) noexcept {
  try {
    forward_outputs(state, node, std::move(outputs), &runtime);
  } catch (...) {
    fail_noexcept(runtime, state, absl::StatusCode::kInternal, "could not hand its output on",
                  "the request could not hand its output on");
  }
}

// A site's thread must not sleep on a full queue either: the lane that would empty it may be
// waiting for room at that very site. A request that finds the queue full is handed over to a lane,
// which helps the full block; the site's later requests for the block queue behind it until the
// lane has queued them all, so that none overtakes another (a block's results leave it in order).
void SessionCore::queue_from_site(BlockRuntime& runtime, Envelope&& envelope, const PlanNode& target) {
  {
    blockflow::detail::MutexLock lock(&runtime.handover_mu);
    if (runtime.handover_posted) {  // behind requests that found the queue full: it waits for room too
      if (envelope.offered_ns == 0) envelope.offered_ns = now_ns();
      runtime.handover.push_back(std::move(envelope));
      return;
    }
  }
  SendOutcome outcome = runtime.site != nullptr ? send_to_site_block(runtime, std::move(envelope), absl::Now())
                                                : runtime.inbox->send(std::move(envelope), absl::Now());
  if (!absl::IsDeadlineExceeded(outcome.status)) {
    if (runtime.site == nullptr) lanes_->notify(runtime);  // a site block's forwarder takes its own
    return handle_displaced(std::move(outcome), target);
  }
  {
    blockflow::detail::MutexLock lock(&runtime.handover_mu);
    runtime.handover.push_back(std::move(*outcome.displaced));
    if (runtime.handover_posted) return;  // another site's thread posted the task meanwhile
    runtime.handover_posted = true;
  }
  // The requests waiting in `handover` keep their plans, and so the runtime, alive until the task
  // has queued the last of them.
  try {
    if (lanes_->post([this, &runtime] { queue_handed_over(runtime); })) return;
  } catch (...) {
    // No task to queue the line (out of memory, say): its requests fail here, and the line is
    // free again for the site's next request, rather than waiting for a task that never comes.
    std::deque<Envelope> line;
    {
      blockflow::detail::MutexLock lock(&runtime.handover_mu);
      line.swap(runtime.handover);
      runtime.handover_posted = false;
    }
    for (auto& waiting : line) {
      if (runtime.site != nullptr) runtime.to_forward.fetch_sub(1, std::memory_order_acq_rel);  // not to forward
      runtime.failed.fetch_add(1, std::memory_order_relaxed);
      fail_noexcept(runtime, waiting.local, absl::StatusCode::kResourceExhausted, "could not be handed to a lane",
                    "the request could not be handed to a lane (out of memory)");
    }
    return;
  }
  queue_handed_over(runtime);  // lanes stopped (shutdown): the closed queue fails them here
}

void SessionCore::queue_handed_over(BlockRuntime& runtime) {
  // A few requests per turn, then the task goes back behind the other work that is ready: a worker
  // that keeps the block's queue full would otherwise hold this lane in one turn for as long as it
  // produces, and with one lane no other block would run meanwhile.
  constexpr int kPerTurn = 4;
  StatePtr keep;  // the request last queued keeps the runtime alive until the line is found empty
  for (int taken = 0;; ++taken) {
    Envelope next;
    {
      blockflow::detail::MutexLock lock(&runtime.handover_mu);
      if (runtime.handover.empty()) {
        runtime.handover_posted = false;
        return;
      }
      if (taken < kPerTurn) {
        next = std::move(runtime.handover.front());
        runtime.handover.pop_front();
      }
    }
    if (taken == kPerTurn) {  // the line (still posted) is queued on by the next task, in order
      bool posted = false;
      try {
        posted = lanes_->current_lane() >= 0 && lanes_->post([this, &runtime] { queue_handed_over(runtime); });
      } catch (...) {  // no task to be had (out of memory): this one goes on
      }
      if (posted) return;
      taken = -1;
      continue;
    }
    keep = next.local;
    const PlanNode& target = keep->plan->nodes[static_cast<std::size_t>(next.node)];
    try {
      if (runtime.site != nullptr) {  // the forwarder makes room as the site takes requests: waited for
        handle_displaced(send_to_site_block(runtime, std::move(next), absl::InfiniteFuture()), target);
      } else {
        queue_now(runtime, std::move(next), target);
      }
    } catch (...) {
      // (Out of memory, say.) This request fails; the line goes on, or the site's later requests for
      // the block would wait behind it for good.
      runtime.failed.fetch_add(1, std::memory_order_relaxed);
      fail_noexcept(runtime, keep, absl::StatusCode::kResourceExhausted, "could not be queued",
                    "the request could not be queued (out of memory)");
    }
  }
}

}  // namespace blockflow::detail
