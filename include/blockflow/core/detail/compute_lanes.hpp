#pragma once
// Internal: compute lanes, the executor every in-process block of a session runs on (docs/lanes.md).
//
// A session owns N lanes: long-lived threads, each with one OpenMP team of the session's intra-op
// thread count, so the process holds at most N x intra-op OpenMP threads whatever the number of
// blocks. Blocks own no threads: a block with queued work (a LaneWork) sits once in a ready queue;
// a free lane takes the oldest ready entry, runs one unit of it (a request, or a batch) and puts it
// back at the tail if more waits, so blocks take turns and no queue starves. When a unit's output
// goes to a block that has nothing queued and a free claim, the lane runs that next block itself
// at once (an inline continuation: no queue, no wake-up, warm caches), like Taskflow's executor.

#include <absl/time/time.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace blockflow::detail {

/// Work that lanes run: a block's input queue. At most max_lanes lanes run it at once (a block's
/// BlockOptions::workers). The executor's bookkeeping lives here, under the executor's lock.
class LaneWork {
 public:
  LaneWork() = default;
  virtual ~LaneWork() = default;
  LaneWork(const LaneWork&) = delete;
  LaneWork& operator=(const LaneWork&) = delete;

  /// True when a unit waits. Called under the executor's lock: must neither block nor call it.
  [[nodiscard]] virtual bool has_work() const = 0;
  /// Runs one unit if one is there. Called on a lane that holds a claim on this work.
  virtual void run_one() = 0;

  int max_lanes = 1;  ///< set before the work is first handed to an executor

 private:
  friend class ComputeLanes;
  int running_ = 0;      // lanes holding a claim (under ComputeLanes::mu_)
  bool queued_ = false;  // in the ready queue (under ComputeLanes::mu_)
  bool closed_ = false;  // quiesce()d: never claimed again (under ComputeLanes::mu_)
};

/// What one lane has done since it started.
struct LaneCounters {
  std::uint64_t runs = 0;                  ///< units of block work run (requests or batches)
  std::uint64_t tasks = 0;                 ///< posted tasks run (warm-ups, run_on_lane())
  std::uint64_t inline_continuations = 0;  ///< next blocks run at once by the lane that ran the previous one
  std::int64_t busy_ns = 0;                ///< time spent running work
  std::int64_t alive_ns = 0;               ///< time since the lane started
};

/// The executor. Thread-safe. Lanes sleep on a condition variable (after polling for `spin`) and
/// are woken by notify() and post().
class ComputeLanes {
 public:
  struct Options {
    int lanes = 1;             ///< at least 1
    int intra_op_threads = 0;  ///< each lane's OpenMP team; 0 keeps libtorch's default
    absl::Duration spin = absl::Microseconds(50);  ///< an idle lane polls this long before sleeping
  };

  explicit ComputeLanes(Options options);
  ~ComputeLanes();  // stop()
  ComputeLanes(const ComputeLanes&) = delete;
  ComputeLanes& operator=(const ComputeLanes&) = delete;

  /// Starts the lane threads. Once.
  void start();
  /// Runs the tasks still posted, lets each lane finish its unit, joins the lanes. Queued block
  /// work stays queued (its owner fails it). Idempotent. Must not be called on a lane.
  void stop();
  [[nodiscard]] int size() const { return options_.lanes; }
  [[nodiscard]] int intra_op_threads() const { return options_.intra_op_threads; }
  [[nodiscard]] bool running() const { return started_.load() && !stopping_.load(); }

  /// `work` has a new unit queued: it joins the ready queue unless it is there or fully claimed.
  void notify(LaneWork& work);
  /// Runs `task` on a lane (fairly among ready blocks). False once stopped (the task is not run).
  bool post(std::function<void()> task);
  /// Run-to-completion, step 1: on a lane of this executor with no continuation pending, claims
  /// `work` for the calling lane (the caller has checked that nothing is queued for it). False,
  /// nothing claimed, otherwise (not a lane, a continuation pending, fully claimed, quiesced).
  bool claim_next(LaneWork& work);
  /// Step 2, right after a successful claim_next(): the lane runs `run` once its current unit is
  /// done (no queue, no wake-up), then releases the claim.
  void run_next(std::function<void()> run);
  /// On a lane: runs one unit of `work` here if it can be claimed (a lane that would wait for room
  /// in a full queue helps empty it instead). False when it is fully claimed elsewhere.
  bool help(LaneWork& work);
  /// Refuses further claims of `work`, waits until no lane runs it and takes it off the ready queue.
  void quiesce(LaneWork& work);

  /// Entries (blocks with work, tasks) waiting in the ready queue now, read without the lock.
  [[nodiscard]] std::size_t pending() const { return pending_.load(std::memory_order_acquire); }
  /// The lane index of the calling thread in this executor, or -1.
  [[nodiscard]] int current_lane() const;
  [[nodiscard]] std::vector<LaneCounters> counters() const;

 private:
  struct Entry {
    LaneWork* work = nullptr;     // block work, or
    std::function<void()> task;   // a posted task
  };
  struct Lane {
    std::thread thread;
    LaneWork* continuation_work = nullptr;  // this lane only
    std::function<void()> continuation;
    std::atomic<std::uint64_t> runs{0}, tasks{0}, inline_continuations{0};
    std::atomic<std::int64_t> busy_ns{0};
    std::int64_t started_ns = 0;
  };

  void lane_main(int index);
  void run_entry(Lane& lane, Entry&& entry);
  void enqueue_locked(LaneWork& work);
  void release(LaneWork& work);

  const Options options_;
  std::vector<std::unique_ptr<Lane>> lanes_;
  std::mutex mu_;
  std::condition_variable work_cv_;   // lanes wait for entries
  std::condition_variable idle_cv_;   // quiesce() waits for a work's last claim to go
  std::deque<Entry> ready_;           // under mu_
  int sleeping_ = 0;                  // under mu_
  std::atomic<std::size_t> pending_{0};  // ready_.size(), for the lock-free spin
  std::atomic<bool> started_{false}, stopping_{false};
  std::atomic<std::int64_t> stopped_ns_{0};
};

}  // namespace blockflow::detail
