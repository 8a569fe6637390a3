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
//
// Elastic lanes (one_thread_lanes > 0): the executor's lanes are its cores. Beside the team lanes it
// has lanes of one thread that make no team, and it runs at most size() threads of work at once. A
// team lane runs a unit with its whole team when nothing else is ready and the cores are free
// (latency of a team for a request alone), and with one thread otherwise, so that under load every
// core runs a unit of its own (libtorch's kernels run closer to one core's full rate on one thread
// than on a team: throughput). One-thread lanes take work only beyond what idle team lanes take.

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
  /// Units waiting (requests queued), as has_work(): elastic lanes weigh the load by it.
  [[nodiscard]] virtual std::size_t backlog() const { return has_work() ? 1 : 0; }
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
  std::uint64_t one_thread_runs = 0;       ///< units and tasks run with one thread (elastic lanes)
  std::uint64_t sleeps = 0;                ///< times the lane slept waiting for work (each ended by a wake-up)
  int threads = 0;                         ///< the lane's OpenMP team (1: a one-thread lane; 0: libtorch's default)
  std::int64_t busy_ns = 0;                ///< time spent running work
  std::int64_t alive_ns = 0;               ///< time since the lane started
};

/// The executor. Thread-safe. Lanes sleep on a condition variable (after polling for `spin`) and
/// are woken by notify() and post().
class ComputeLanes {
 public:
  struct Options {
    int lanes = 1;             ///< lanes with a team of intra_op_threads; at least 1
    int intra_op_threads = 0;  ///< each team lane's OpenMP team; 0 keeps libtorch's default
    /// Lanes of one thread beside the team lanes; above 0 (with intra_op_threads > 1) the executor
    /// is elastic: at most lanes + one_thread_lanes threads of work at once (see above).
    int one_thread_lanes = 0;
    /// Elastic: a team lane runs a unit with one thread when at least this many units wait beside
    /// it. 2 (measured, docs/lanes.md): one unit waiting is often gone before a one-thread lane has
    /// finished, so running the team's unit narrow for it costs latency at moderate load and wins no
    /// throughput; from two, every core has work of its own.
    int one_thread_backlog = 2;
    absl::Duration spin = absl::Microseconds(50);  ///< an idle lane polls this long before sleeping
    /// Lane 0 polls for work whenever it is idle, never sleeping until stop() (unless the work that
    /// is ready is not for it): a unit handed to an idle executor starts without a thread's wake-up,
    /// at the cost of one core, all the time (SessionOptions::poll_lane).
    bool poll_first_lane = false;
  };

  explicit ComputeLanes(Options options);
  ~ComputeLanes();  // stop()
  ComputeLanes(const ComputeLanes&) = delete;
  ComputeLanes& operator=(const ComputeLanes&) = delete;

  /// Starts the lane threads. Once.
  void start();
  /// Runs the tasks still posted, lets each lane finish its unit, joins the lanes. Queued block
  /// work stays queued (its owner fails it). Waits until `deadline` at most: false when a lane has
  /// not finished by then (a call that does not return); a later call joins what has finished
  /// since. Idempotent. Must not be called on a lane.
  bool stop(absl::Time deadline = absl::InfiniteFuture());
  /// Every lane, team and one-thread lanes.
  [[nodiscard]] int size() const { return static_cast<int>(lanes_.size()); }
  [[nodiscard]] int intra_op_threads() const { return options_.intra_op_threads; }
  [[nodiscard]] bool elastic() const { return elastic_; }
  [[nodiscard]] bool running() const { return started_.load() && !stopping_.load(); }

  /// `work`'s has_work() may have changed: with a new unit queued it joins the ready queue unless it
  /// is there or fully claimed; with none (has_work() false: a batch being gathered takes them) its
  /// entry leaves the queue, so that pending() counts other work only.
  void notify(LaneWork& work);
  /// Runs `task` on a lane (fairly among ready blocks). False once stopped (the task is not run).
  /// `team_lane`: only a team lane may run it (work that must also run with the team's threads).
  /// `one_thread`: it is one thread's work (a warm-up run with one thread): an elastic team lane
  /// that takes it books one core, leaving the others to the lanes beside it.
  bool post(std::function<void()> task, bool team_lane = false, bool one_thread = false);
  /// On a team lane of an elastic executor: runs `fn` with the team's threads, then with one (a
  /// warm-up, so that neither width's first run falls on a request), and restores the lane's
  /// width. Elsewhere: runs `fn` once. `one_thread` false: the team's width only (the one-thread
  /// run made elsewhere, on a thread of one OpenMP thread).
  void for_each_width(const std::function<void()>& fn, bool one_thread = true);
  /// On a team lane: runs `fn` with at most `threads` of the team's threads, then restores the
  /// lane's width. Elsewhere: runs `fn`.
  void with_at_most(int threads, const std::function<void()>& fn);
  /// Run-to-completion, step 1: on a lane of this executor with no continuation pending, claims
  /// `work` for the calling lane (the caller has checked that nothing is queued for it). False,
  /// nothing claimed, otherwise (not a lane, a continuation pending, fully claimed, quiesced).
  bool claim_next(LaneWork& work);
  /// Step 2, right after a successful claim_next(): the lane runs `run` once its current unit is
  /// done (no queue, no wake-up), then releases the claim.
  void run_next(std::function<void()> run);
  /// Instead of step 2 when the continuation could not be made (out of memory): gives the claim back.
  void unclaim_next(LaneWork& work);
  /// On a lane: runs one unit of `work` here if it can be claimed (a lane that would wait for room
  /// in a full queue helps empty it instead): `run` under the claim (true when it ran a unit: the
  /// lane's runs count it), or work.run_one() without one. False, nothing run, when it is fully
  /// claimed elsewhere (or quiesced).
  bool help(LaneWork& work, const std::function<bool()>& run = nullptr);
  /// On a lane with a continuation pending (claim_next() + run_next()): runs it now, inside the
  /// current unit, and releases its claim. A lane about to wait for room in a full queue calls it
  /// first: another lane's progress (the one emptying that queue) may need the block it claimed.
  /// False when none is pending.
  bool run_claimed();
  /// On a lane that can neither queue into `work`'s full queue nor help empty it now (fully
  /// claimed; or, `may_help` false, its helping nested too deep): marks the lane as waiting for
  /// room in `work` and says whether the wait can end, i.e. whether some lane that could empty the
  /// queue, directly or through the lanes it waits for, is not waiting itself. A lane that may help
  /// counts as making progress once `work` is no longer fully claimed; a lane that may not, only
  /// through the lanes running a unit (an idle lane may not take the work at once: elastic lanes
  /// book cores). False: every such lane waits on another (tasks whose paths cross, x -> y and
  /// y -> x), and nobody would ever make room; the caller then queues past the capacity
  /// (InProcessChannel::send_past_capacity()). The mark stays until the lane helps (help(),
  /// run_claimed()) or calls stop_waiting().
  bool wait_can_end(const LaneWork& work, bool may_help);
  /// On a lane: clears wait_can_end()'s mark (the lane helps, or has queued).
  void stop_waiting();
  /// Refuses further claims of `work`, takes it off the ready queue and waits until no lane runs it,
  /// or until `deadline`: false when a lane still runs it then (a call that has not returned; the
  /// work must then live until idle() says so).
  bool quiesce(LaneWork& work, absl::Time deadline = absl::InfiniteFuture());
  /// True when no lane runs `work`.
  [[nodiscard]] bool idle(const LaneWork& work) const;

  /// Entries (blocks with work, tasks) waiting in the ready queue now, read without the lock (an
  /// entry of a block claimed meanwhile counts until a lane drops it).
  [[nodiscard]] std::size_t pending() const { return pending_.load(std::memory_order_acquire); }
  /// The lane index of the calling thread in this executor, or -1.
  [[nodiscard]] int current_lane() const;
  [[nodiscard]] std::vector<LaneCounters> counters() const;

 private:
  struct Entry {
    LaneWork* work = nullptr;     // block work, or
    std::function<void()> task;   // a posted task
    bool team_lane = false;       // the task runs on a team lane only
    bool one_thread = false;      // the task is one thread's work: a team lane books one core for it
  };
  struct Lane {
    bool team = true;  // a team lane (else a one-thread lane)
    int width = 0;     // cores its current unit holds (elastic), under mu_
    int threads = 0;   // the OpenMP threads it runs with now (elastic; this lane only)
    std::thread thread;
    LaneWork* continuation_work = nullptr;  // this lane only
    std::vector<const LaneWork*> claims;    // the works this lane holds a claim on (under mu_)
    const LaneWork* waiting_for = nullptr;  // wait_can_end()'s mark (under mu_)
    bool may_help = false;                  // and whether the lane may still help it (under mu_)
    bool busy = false;                      // running an entry of the ready queue (under mu_)
    std::function<void()> continuation;
    std::atomic<std::uint64_t> runs{0}, tasks{0}, inline_continuations{0}, one_thread_runs{0}, sleeps{0};
    std::atomic<std::int64_t> busy_ns{0};
    std::int64_t started_ns = 0;
    bool exited = false;  // lane_main() has returned (under mu_): join() will not wait
  };

  void lane_main(int index);
  void run_entry(Lane& lane, Entry&& entry);
  void enqueue_locked(LaneWork& work);
  void release(LaneWork& work);
  // Elastic: the entry of ready_ this lane may take now, or ready_.end().
  std::deque<Entry>::iterator takeable_locked(const Lane& lane);
  // Elastic: the cores `lane` takes for its next unit (its team, or one), booked under mu_.
  void book_width_locked(Lane& lane, bool one_thread);
  void set_threads(Lane& lane, int threads);
  std::size_t backlog_locked() const;  // units waiting in ready_
  // Whether lane `index` makes progress: it waits for nothing, or some lane that could make room
  // where it waits does (depth-first over the lanes not in `seen`).
  bool progresses_locked(int index, std::vector<char>& seen) const;
  // Wakes the lane that should take what is ready (a team lane first); call without mu_.
  void wake(bool team, bool one_thread);
  struct Wakes {
    bool team = false, one_thread = false;
  };
  Wakes wakes_locked() const;

  const Options options_;
  const bool elastic_;
  std::vector<std::unique_ptr<Lane>> lanes_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_;   // team lanes wait for entries
  std::condition_variable one_cv_;    // one-thread lanes wait for entries and a free core
  std::condition_variable idle_cv_;   // quiesce() waits for a work's last claim to go
  std::condition_variable exit_cv_;   // stop() waits for the lanes to leave lane_main()
  std::deque<Entry> ready_;           // under mu_
  int sleeping_ = 0, sleeping_one_ = 0;  // team and one-thread lanes asleep (under mu_)
  bool poller_asleep_ = false;            // Options::poll_first_lane: lane 0 sleeps (under mu_)
  int busy_team_ = 0;                 // team lanes running an entry (under mu_)
  int cores_used_ = 0;                // elastic: cores booked by running units (under mu_)
  std::atomic<std::size_t> pending_{0};  // ready_.size(), for the lock-free spin
  std::atomic<bool> started_{false}, stopping_{false};
  std::atomic<std::int64_t> stopped_ns_{0};
};

}  // namespace blockflow::detail
