#pragma once
// Internal: the mutex BlockFlow's own code locks. absl::Mutex, except under ThreadSanitizer: Debian's
// Abseil is not built with TSan, so absl::Mutex locks and unlocks inside an uninstrumented library
// and TSan would see no happens-before between two critical sections of one lock (every access
// under it would be reported as a race, and a real race would drown among them). A TSan build gets
// a twin over std::mutex, which TSan sees through its pthread interceptors (docs/sanitizers.md).
// Only the subset BlockFlow uses: Lock, Unlock, Await, AwaitWithDeadline, MutexLock, BlockingCounter.

#include <absl/synchronization/blocking_counter.h>
#include <absl/synchronization/mutex.h>

#if defined(__SANITIZE_THREAD__)
#include <absl/time/clock.h>
#include <absl/time/time.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#endif

namespace blockflow::detail {

#if defined(__SANITIZE_THREAD__)

class Mutex {
 public:
  void Lock() { mu_.lock(); }
  void Unlock() {
    // A waiter in Await() or AwaitWithDeadline() re-checks its condition. Notified before the
    // unlock: once unlocked, a waiter may return and its caller destroy the object that holds us.
    changed_.notify_all();
    mu_.unlock();
  }
  /// Waits, the lock held, until `condition` holds or `deadline` passes; true if it holds.
  bool AwaitWithDeadline(const absl::Condition& condition, absl::Time deadline) {
    std::unique_lock<std::mutex> lock(mu_, std::adopt_lock);
    while (!condition.Eval()) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) break;
      changed_.wait_for(lock, absl::ToChronoNanoseconds(std::min(left, absl::Milliseconds(10))));
    }
    lock.release();  // still held, by the caller
    return condition.Eval();
  }
  /// Waits, the lock held, until `condition` holds.
  void Await(const absl::Condition& condition) {
    std::unique_lock<std::mutex> lock(mu_, std::adopt_lock);
    changed_.wait(lock, [&] { return condition.Eval(); });
    lock.release();  // still held, by the caller
  }

 private:
  std::mutex mu_;
  std::condition_variable changed_;
};

class MutexLock {
 public:
  explicit MutexLock(Mutex* mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* mu_;
};

class BlockingCounter {
 public:
  explicit BlockingCounter(int count) : count_(count) {}
  void DecrementCount() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--count_ == 0) zero_.notify_all();
  }
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    zero_.wait(lock, [this] { return count_ == 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable zero_;
  int count_;
};

#else

using Mutex = absl::Mutex;
using MutexLock = absl::MutexLock;
using BlockingCounter = absl::BlockingCounter;

#endif

}  // namespace blockflow::detail
