#pragma once
// Internal: everything a session knows about one request while it is in flight.

#include <blockflow/core/result.hpp>
#include <blockflow/core/detail/routing.hpp>

#include <atomic>
#include <functional>
#include <future>
#include <memory>
#include <vector>

namespace blockflow::detail {

/// Fan-in buffer of one node with several inputs. Each predecessor writes its own slot, then
/// decrements `remaining`; the thread that brings it to zero owns every slot (acq_rel ordering).
struct JoinState {
  std::atomic<int> remaining{0};
  std::vector<Tensors> inputs;
  std::vector<std::int64_t> ready_ns;
};

/// Shared by the envelopes of one request. Each node's HopTiming is written by the one thread that
/// runs that node; resolution is guarded by `resolved` (exactly once).
struct RequestState {
  std::uint64_t id = 0;
  /// The task's counters and entry window, set by submit() and never changed: what resolve() counts
  /// in, and all a request waiting at the entry holds of its task (no plan: an update that re-routes
  /// the task does not wait for it).
  std::shared_ptr<PathRuntime> path;
  /// The plan it runs on, set when it starts (null while it waits at the entry).
  std::shared_ptr<const PathPlan> plan;
  std::int64_t submitted_ns = 0;
  std::vector<HopTiming> hops;       ///< per plan node
  std::vector<int> critical_pred;    ///< per plan node: the predecessor that arrived last (-1: input)
  std::unique_ptr<JoinState[]> joins;
  std::atomic<bool> resolved{false};
  std::function<void(Result&&)> done;
  /// Its place in the task's entry window (EntryGate), with SessionOptions::max_in_flight_per_task:
  /// kNoPlace while it waits, kPlaceHeld once admitted, kPlaceReturned once resolve() gave the
  /// place back (or found none to give: the admitting thread then gives it back itself).
  static constexpr int kNoPlace = 0, kPlaceHeld = 1, kPlaceReturned = 2;
  std::atomic<int> place{kNoPlace};
};

}  // namespace blockflow::detail
