#pragma once
// Internal: the entry window of one task (SessionOptions::max_in_flight_per_task).
//
// At most `limit` requests of a task are inside the session's blocks at once; the others wait
// here, in submission order, holding only what the application gave (its input tensors), until a
// request of the task resolves and hands its place to the first of them. The backlog of a burst,
// or of a worker that restarts, therefore waits at the entry instead of as activations in the
// sites' queues and shared-memory pools.

#include <blockflow/core/detail/mutex.hpp>
#include <blockflow/core/tensor.hpp>

#include <cstddef>
#include <deque>
#include <memory>
#include <optional>
#include <utility>

namespace blockflow::detail {

struct RequestState;

class EntryGate {
 public:
  struct Waiting {
    std::shared_ptr<RequestState> state;
    Tensors inputs;
  };

  /// Takes a place when fewer than `limit` are taken (true: the caller starts the request);
  /// otherwise queues `request` (moved from) and returns false.
  bool enter_or_wait(int limit, Waiting& request) {
    MutexLock lock(&mu_);
    if (taken_ < limit && queue_.empty()) {
      ++taken_;
      return true;
    }
    queue_.push_back(std::move(request));
    return false;
  }

  /// Gives a place back. The first waiting request that has not been resolved meanwhile (shutdown
  /// fails waiting requests) inherits it and is returned; with none, the place is free again.
  std::optional<Waiting> leave();

  /// Empties the queue (shutdown), returning what waited; the places taken stay counted.
  std::deque<Waiting> take_all() {
    MutexLock lock(&mu_);
    return std::exchange(queue_, {});
  }

  /// Requests waiting now.
  [[nodiscard]] std::size_t waiting() const {
    MutexLock lock(&mu_);
    return queue_.size();
  }

 private:
  mutable Mutex mu_;
  int taken_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<Waiting> queue_ ABSL_GUARDED_BY(mu_);
};

}  // namespace blockflow::detail
