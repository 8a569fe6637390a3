#include <blockflow/core/detail/compute_lanes.hpp>
#include <blockflow/core/detail/exception_text.hpp>
#include <blockflow/core/detail/log.hpp>
#include <blockflow/core/detail/clock.hpp>
#include <blockflow/core/detail/omp_width.hpp>

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <pthread.h>

#include <algorithm>
#include <limits>
#include <stdexcept>

namespace blockflow::detail {
namespace {

// Which executor and lane the calling thread is (a lane belongs to one executor for its life).
struct ThisLane {
  const ComputeLanes* owner = nullptr;
  int index = -1;
};
thread_local ThisLane this_lane;

// A unit of block work (a block's own code catches what its requests raise): whatever still
// escapes it is logged, never allowed to end the lane (the process) or to skip the claim's release.
template <typename F>
void guarded(F&& run) noexcept {
  try {
    run();
  } catch (...) {
    try {
      detail::log(LogLevel::kError, fmt::format("a block's work on a compute lane raised: {}", current_exception_text()));
    } catch (...) {
    }
  }
}

}  // namespace

ComputeLanes::ComputeLanes(Options options)
    : options_(options), elastic_(options.one_thread_lanes > 0 && options.intra_op_threads > 1) {
  if (options_.lanes < 1) throw std::invalid_argument("compute lanes: at least one lane");
  const int total = options_.lanes + (elastic_ ? options_.one_thread_lanes : 0);
  for (int i = 0; i < total; ++i) {
    lanes_.push_back(std::make_unique<Lane>());
    lanes_.back()->team = i < options_.lanes;
    lanes_.back()->claims.reserve(32);  // a unit, its continuation, nested helps: no allocation on a lane
  }
}

ComputeLanes::~ComputeLanes() { (void)stop(); }

void ComputeLanes::start() {
  if (started_.exchange(true)) return;
  for (int i = 0; i < size(); ++i) {
    lanes_[static_cast<std::size_t>(i)]->started_ns = now_ns();
    lanes_[static_cast<std::size_t>(i)]->thread = std::thread([this, i] { lane_main(i); });
  }
}

bool ComputeLanes::stop(absl::Time deadline) {
  std::unique_lock lock(mu_);
  if (!stopping_.exchange(true)) {
    stopped_ns_.store(now_ns());
    work_cv_.notify_all();
    one_cv_.notify_all();
  }
  auto exited = [&] {
    return std::all_of(lanes_.begin(), lanes_.end(), [](const auto& lane) { return !lane->thread.joinable() || lane->exited; });
  };
  bool all = true;
  if (deadline == absl::InfiniteFuture()) {
    exit_cv_.wait(lock, exited);
  } else {
    all = exit_cv_.wait_for(lock, absl::ToChronoNanoseconds(std::max(absl::ZeroDuration(), deadline - absl::Now())), exited);
  }
  std::vector<std::thread> done;
  for (auto& lane : lanes_) {
    if (lane->thread.joinable() && lane->exited) done.push_back(std::move(lane->thread));
  }
  lock.unlock();
  for (auto& thread : done) thread.join();
  return all;
}

int ComputeLanes::current_lane() const { return this_lane.owner == this ? this_lane.index : -1; }

void ComputeLanes::enqueue_locked(LaneWork& work) {
  if (work.queued_ || work.closed_ || work.running_ >= work.max_lanes || !work.has_work()) return;
  work.queued_ = true;
  ready_.push_back(Entry{&work, {}});
  pending_.store(ready_.size(), std::memory_order_release);
}

ComputeLanes::Wakes ComputeLanes::wakes_locked() const {
  if (ready_.empty()) return {};
  // The polling lane, idle and awake, takes a unit alone at once (or, when every core is taken,
  // the lane that frees one does): waking another lane for it would only cost a futex call here
  // and a thread that finds nothing.
  if (options_.poll_first_lane && !poller_asleep_ && !lanes_[0]->busy && ready_.size() == 1) return {};
  if (sleeping_ > 0) return {true, false};  // a team lane first: a unit alone runs on its team
  if (!elastic_ || sleeping_one_ == 0 || cores_used_ >= size()) return {};
  // A one-thread lane only for what the idle team lanes leave.
  const int idle_team = options_.lanes - busy_team_;
  if (static_cast<int>(ready_.size()) <= idle_team) return {};
  for (const auto& e : ready_) {
    if (!e.team_lane) return {false, true};
  }
  return {};
}

void ComputeLanes::wake(bool team, bool one_thread) {
  if (team) work_cv_.notify_one();
  if (one_thread) one_cv_.notify_one();
}

void ComputeLanes::notify(LaneWork& work) {
  Wakes w;
  {
    std::lock_guard lock(mu_);
    if (work.queued_ && !work.has_work()) {  // nothing for a lane now (a batch being gathered)
      ready_.erase(std::find_if(ready_.begin(), ready_.end(), [&](const Entry& e) { return e.work == &work; }));
      work.queued_ = false;
      pending_.store(ready_.size(), std::memory_order_release);
      return;
    }
    const std::size_t before = ready_.size();
    enqueue_locked(work);
    if (ready_.size() > before) w = wakes_locked();
  }
  wake(w.team, w.one_thread);
}

bool ComputeLanes::post(std::function<void()> task, bool team_lane, bool one_thread) {
  Wakes w;
  {
    std::lock_guard lock(mu_);
    if (stopping_.load() || !started_.load()) return false;
    ready_.push_back(Entry{nullptr, std::move(task), team_lane, one_thread});
    pending_.store(ready_.size(), std::memory_order_release);
    w = wakes_locked();
  }
  wake(w.team, w.one_thread);
  return true;
}

void ComputeLanes::set_threads(Lane& lane, int threads) {
  if (lane.threads == threads) return;
  set_thread_omp_width(threads);  // this thread's setting only (at::set_num_threads is process-wide)
  lane.threads = threads;
}

std::size_t ComputeLanes::backlog_locked() const {
  std::size_t n = 0;
  for (const auto& e : ready_) n += e.work != nullptr ? std::max<std::size_t>(1, e.work->backlog()) : 1;
  return n;
}

void ComputeLanes::book_width_locked(Lane& lane, bool one_thread) {
  cores_used_ -= lane.width;
  const int team = options_.intra_op_threads;
  const auto threshold = static_cast<std::size_t>(options_.one_thread_backlog);
  lane.width = lane.team && !one_thread && backlog_locked() < threshold && cores_used_ + team <= size() ? team : 1;
  cores_used_ += lane.width;
}

void ComputeLanes::with_at_most(int threads, const std::function<void()>& fn) {
  const int index = current_lane();
  if (index < 0 || threads <= 0 || !lanes_[static_cast<std::size_t>(index)]->team) {
    fn();
    return;
  }
  Lane& lane = *lanes_[static_cast<std::size_t>(index)];
  const int before = lane.threads;  // 0: libtorch's default, the thread's OpenMP setting
  // at::get_num_threads() first sets a thread's OpenMP width to libtorch's (once per thread): done
  // here, it cannot undo the narrower width below at the block's first op.
  const int width = before > 0 ? before : at::get_num_threads();
  if (threads >= width) {
    fn();
    return;
  }
  struct Restore {  // also when fn throws
    ComputeLanes& lanes;
    Lane& lane;
    int before, width;
    ~Restore() {
      if (before > 0) {
        lanes.set_threads(lane, before);
      } else {
        set_thread_omp_width(width);
        lane.threads = 0;
      }
    }
  } restore{*this, lane, before, width};
  set_threads(lane, threads);
  fn();
}

void ComputeLanes::for_each_width(const std::function<void()>& fn, bool one_thread) {
  const int index = current_lane();
  if (!elastic_ || index < 0 || !lanes_[static_cast<std::size_t>(index)]->team) {
    fn();
    return;
  }
  Lane& lane = *lanes_[static_cast<std::size_t>(index)];
  const int before = lane.threads;
  set_threads(lane, options_.intra_op_threads);
  fn();
  if (one_thread) {
    set_threads(lane, 1);
    fn();
  }
  set_threads(lane, before);
}

bool ComputeLanes::claim_next(LaneWork& work) {
  const int index = current_lane();
  if (index < 0 || lanes_[static_cast<std::size_t>(index)]->continuation_work != nullptr) return false;
  std::lock_guard lock(mu_);
  if (work.closed_ || work.running_ >= work.max_lanes) return false;
  lanes_[static_cast<std::size_t>(index)]->claims.push_back(&work);  // first: if it throws, nothing is claimed
  ++work.running_;
  lanes_[static_cast<std::size_t>(index)]->continuation_work = &work;
  return true;
}

void ComputeLanes::run_next(std::function<void()> run) {
  lanes_[static_cast<std::size_t>(current_lane())]->continuation = std::move(run);
}

void ComputeLanes::unclaim_next(LaneWork& work) {
  lanes_[static_cast<std::size_t>(current_lane())]->continuation_work = nullptr;
  release(work);
}

bool ComputeLanes::help(LaneWork& work, const std::function<bool()>& run) {
  if (current_lane() < 0) return false;
  Lane& lane = *lanes_[static_cast<std::size_t>(this_lane.index)];
  {
    std::lock_guard lock(mu_);
    if (work.closed_ || work.running_ >= work.max_lanes) return false;
    lane.claims.push_back(&work);  // first: if it throws, nothing is claimed
    ++work.running_;
    lane.waiting_for = nullptr;  // a lane that helps waits for nothing
  }
  struct Release {  // also when `run` throws: the claim must go, or quiesce() waits for ever
    ComputeLanes& lanes;
    LaneWork& work;
    ~Release() { lanes.release(work); }
  } release_claim{*this, work};
  // Busy time: counted in the unit this help interrupts.
  bool ran = true;
  if (run) {
    ran = run();
  } else {
    work.run_one();
  }
  if (ran) lane.runs.fetch_add(1, std::memory_order_relaxed);
  return true;
}

bool ComputeLanes::run_claimed() {
  const int index = current_lane();
  if (index < 0) return false;
  Lane& lane = *lanes_[static_cast<std::size_t>(index)];
  if (!lane.continuation) return false;
  {
    std::lock_guard lock(mu_);
    lane.waiting_for = nullptr;  // a lane that runs work waits for nothing
  }
  auto run = std::move(lane.continuation);
  lane.continuation = nullptr;
  LaneWork* work = std::exchange(lane.continuation_work, nullptr);
  lane.inline_continuations.fetch_add(1, std::memory_order_relaxed);
  lane.runs.fetch_add(1, std::memory_order_relaxed);
  guarded(run);  // busy time: counted in the unit it runs inside
  release(*work);
  return true;
}

bool ComputeLanes::progresses_locked(int index, std::vector<char>& seen) const {
  if (seen[static_cast<std::size_t>(index)] != 0) return false;
  seen[static_cast<std::size_t>(index)] = 1;
  const Lane& lane = *lanes_[static_cast<std::size_t>(index)];
  const LaneWork* work = lane.waiting_for;
  if (work == nullptr) return true;
  const bool claimed = work->running_ >= work->max_lanes;
  if (!claimed && lane.may_help) return true;  // it claims the work at its next try
  // Fully claimed: only the lanes holding a claim can empty it. Else a lane running a unit takes it
  // from the ready queue once done (this one may not: it helps no deeper).
  for (int i = 0; i < size(); ++i) {
    if (i == index) continue;
    const Lane& other = *lanes_[static_cast<std::size_t>(i)];
    if (claimed ? std::find(other.claims.begin(), other.claims.end(), work) == other.claims.end() : !other.busy) continue;
    if (progresses_locked(i, seen)) return true;
  }
  return false;
}

bool ComputeLanes::wait_can_end(const LaneWork& work, bool may_help) {
  const int index = current_lane();
  if (index < 0) return true;
  std::vector<char> seen(lanes_.size(), 0);
  std::lock_guard lock(mu_);
  Lane& lane = *lanes_[static_cast<std::size_t>(index)];
  lane.waiting_for = &work;
  lane.may_help = may_help;
  return progresses_locked(index, seen);
}

void ComputeLanes::stop_waiting() {
  const int index = current_lane();
  if (index < 0) return;
  std::lock_guard lock(mu_);
  lanes_[static_cast<std::size_t>(index)]->waiting_for = nullptr;
}

void ComputeLanes::release(LaneWork& work) {
  Wakes w;
  bool idle = false;
  {
    std::lock_guard lock(mu_);
    --work.running_;
    // Always called on the lane that holds the claim.
    auto& claims = lanes_[static_cast<std::size_t>(this_lane.index)]->claims;
    if (auto it = std::find(claims.begin(), claims.end(), &work); it != claims.end()) claims.erase(it);
    const std::size_t before = ready_.size();
    enqueue_locked(work);
    if (ready_.size() > before) w = wakes_locked();
    idle = work.running_ == 0;
  }
  wake(w.team, w.one_thread);
  if (idle) idle_cv_.notify_all();
}

bool ComputeLanes::quiesce(LaneWork& work, absl::Time deadline) {
  std::unique_lock lock(mu_);
  work.closed_ = true;
  for (auto it = ready_.begin(); it != ready_.end();) {
    it = it->work == &work ? ready_.erase(it) : std::next(it);
  }
  work.queued_ = false;
  pending_.store(ready_.size(), std::memory_order_release);
  auto idle = [&] { return work.running_ == 0; };
  if (deadline == absl::InfiniteFuture()) {
    idle_cv_.wait(lock, idle);
    return true;
  }
  return idle_cv_.wait_for(lock, absl::ToChronoNanoseconds(std::max(absl::ZeroDuration(), deadline - absl::Now())), idle);
}

bool ComputeLanes::idle(const LaneWork& work) const {
  std::lock_guard lock(mu_);
  return work.running_ == 0;
}

void ComputeLanes::run_entry(Lane& lane, Entry&& entry) {
  const std::int64_t t0 = now_ns();
  if (elastic_ && lane.threads == 1) lane.one_thread_runs.fetch_add(1, std::memory_order_relaxed);
  if (entry.work != nullptr) {
    lane.runs.fetch_add(1, std::memory_order_relaxed);
    guarded([&] { entry.work->run_one(); });
    release(*entry.work);
  } else {
    lane.tasks.fetch_add(1, std::memory_order_relaxed);
    try {
      entry.task();
    } catch (...) {  // tasks report through their own futures; never kill a lane
      try {
        detail::log(LogLevel::kError, fmt::format("a task on a compute lane raised: {}", current_exception_text()));
      } catch (...) {  // no memory for the message
      }
    }
  }
  // Run-to-completion: the next block of the request, claimed while the unit above ran.
  while (lane.continuation) {
    auto run = std::move(lane.continuation);
    LaneWork* work = std::exchange(lane.continuation_work, nullptr);
    lane.continuation = nullptr;
    if (elastic_ && lane.team) {
      // The next unit's width: its team only if nothing else waits for a core.
      Wakes w;
      {
        std::lock_guard lock(mu_);
        book_width_locked(lane, false);
        w = wakes_locked();
      }
      wake(w.team, w.one_thread);
      set_threads(lane, lane.width == 1 ? 1 : options_.intra_op_threads);
    }
    if (elastic_ && lane.threads == 1) lane.one_thread_runs.fetch_add(1, std::memory_order_relaxed);
    lane.inline_continuations.fetch_add(1, std::memory_order_relaxed);
    lane.runs.fetch_add(1, std::memory_order_relaxed);
    guarded(run);
    release(*work);
  }
  lane.busy_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
}

std::deque<ComputeLanes::Entry>::iterator ComputeLanes::takeable_locked(const Lane& lane) {
  const bool stopping = stopping_.load();
  if (elastic_) {
    if (cores_used_ >= size()) return ready_.end();
    // A one-thread lane takes only what the idle team lanes leave (a unit alone runs on a team).
    if (!lane.team && !stopping && static_cast<int>(ready_.size()) <= options_.lanes - busy_team_) return ready_.end();
  }
  for (auto it = ready_.begin(); it != ready_.end();) {
    if (it->work != nullptr && it->work->running_ >= it->work->max_lanes) {
      // Fully claimed since it was queued (help(), claim_next()): release() queues it again.
      it->work->queued_ = false;
      it = ready_.erase(it);
      pending_.store(ready_.size(), std::memory_order_release);
      continue;
    }
    // Stopping: posted tasks still run (their futures must resolve); block work stays queued.
    if ((stopping && it->work != nullptr) || (!lane.team && it->team_lane)) {
      ++it;
      continue;
    }
    return it;
  }
  return ready_.end();
}

void ComputeLanes::lane_main(int index) {
  this_lane = ThisLane{this, index};
  Lane& lane = *lanes_[static_cast<std::size_t>(index)];
  struct Exit {  // however lane_main() ends: stop() then joins without waiting
    ComputeLanes& lanes;
    Lane& lane;
    ~Exit() {
      {
        std::lock_guard lock(lanes.mu_);
        lane.exited = true;
      }
      lanes.exit_cv_.notify_all();
    }
  } exit_mark{*this, lane};
  pthread_setname_np(pthread_self(), fmt::format("bf-lane/{}", index % 1000).c_str());
  if (options_.intra_op_threads > 0) {
    // After libtorch's lazy initialisation of this thread's width, so that its team keeps this size.
    // Through at::get_num_threads(), not the inline at::internal::lazy_init_num_threads(): where
    // libtorch keeps its own copy of that function's per-thread flag (a PyTorch wheel's libtorch),
    // ours would not set it, and libtorch's first op on this thread would reset the width.
    (void)at::get_num_threads();
    if (lane.team) {
      at::set_num_threads(options_.intra_op_threads);
      lane.threads = options_.intra_op_threads;
    } else {
      set_threads(lane, 1);  // never makes a team
    }
  }
  // Options::poll_first_lane: this lane polls until work comes (or the executor stops).
  const bool polls = options_.poll_first_lane && index == 0;
  for (;;) {
    if ((polls || options_.spin > absl::ZeroDuration()) && pending_.load(std::memory_order_acquire) == 0) {
      // Poll briefly: a hand-off to an awake lane costs well under a microsecond, a wake-up tens.
      const std::int64_t until =
          polls ? std::numeric_limits<std::int64_t>::max() : now_ns() + absl::ToInt64Nanoseconds(options_.spin);
      while (pending_.load(std::memory_order_acquire) == 0 && !stopping_.load(std::memory_order_acquire) &&
             now_ns() < until) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      }
    }
    Entry entry;
    Wakes w;
    {
      std::unique_lock lock(mu_);
      auto it = takeable_locked(lane);
      // The polling lane sleeps only on work ready that is not for it (elastic): when another lane
      // took what it saw, it polls again.
      if (it == ready_.end() && polls && ready_.empty() && !stopping_.load()) continue;
      while (it == ready_.end()) {
        if (stopping_.load()) return;
        int& sleeping = lane.team ? sleeping_ : sleeping_one_;
        ++sleeping;
        lane.sleeps.fetch_add(1, std::memory_order_relaxed);
        if (polls) poller_asleep_ = true;
        (lane.team ? work_cv_ : one_cv_).wait(lock);
        if (polls) poller_asleep_ = false;
        --sleeping;
        it = takeable_locked(lane);
      }
      entry = std::move(*it);
      ready_.erase(it);
      if (entry.work != nullptr) {
        entry.work->queued_ = false;
        ++entry.work->running_;
        lane.claims.push_back(entry.work);
        // More than one lane may run it: leave it ready for the next free lane.
        enqueue_locked(*entry.work);
      }
      pending_.store(ready_.size(), std::memory_order_release);
      lane.busy = true;
      if (lane.team) ++busy_team_;
      if (elastic_) book_width_locked(lane, entry.work == nullptr && entry.one_thread);
      w = wakes_locked();  // more is ready: another lane may take it
    }
    wake(w.team, w.one_thread);
    if (elastic_ && lane.team) set_threads(lane, lane.width == 1 ? 1 : options_.intra_op_threads);
    run_entry(lane, std::move(entry));
    {
      std::lock_guard lock(mu_);
      lane.busy = false;
      if (lane.team) --busy_team_;
      cores_used_ -= lane.width;
      lane.width = 0;
      w = wakes_locked();
    }
    wake(w.team, w.one_thread);
  }
}

std::vector<LaneCounters> ComputeLanes::counters() const {
  std::vector<LaneCounters> out;
  const std::int64_t stopped = stopped_ns_.load();
  const std::int64_t now = stopped != 0 ? stopped : now_ns();
  for (const auto& lane : lanes_) {
    LaneCounters c;
    c.runs = lane->runs.load(std::memory_order_relaxed);
    c.tasks = lane->tasks.load(std::memory_order_relaxed);
    c.inline_continuations = lane->inline_continuations.load(std::memory_order_relaxed);
    c.one_thread_runs = lane->one_thread_runs.load(std::memory_order_relaxed);
    c.sleeps = lane->sleeps.load(std::memory_order_relaxed);
    c.threads = lane->team ? options_.intra_op_threads : 1;
    c.busy_ns = lane->busy_ns.load(std::memory_order_relaxed);
    c.alive_ns = lane->started_ns == 0 ? 0 : now - lane->started_ns;
    out.push_back(c);
  }
  return out;
}

}  // namespace blockflow::detail
