#include <blockflow/core/detail/compute_lanes.hpp>
#include <blockflow/core/detail/log.hpp>
#include <blockflow/core/detail/clock.hpp>

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <pthread.h>

#include <stdexcept>

namespace blockflow::detail {
namespace {

// Which executor and lane the calling thread is (a lane belongs to one executor for its life).
struct ThisLane {
  const ComputeLanes* owner = nullptr;
  int index = -1;
};
thread_local ThisLane this_lane;

}  // namespace

ComputeLanes::ComputeLanes(Options options) : options_(options) {
  if (options_.lanes < 1) throw std::invalid_argument("compute lanes: at least one lane");
  for (int i = 0; i < options_.lanes; ++i) lanes_.push_back(std::make_unique<Lane>());
}

ComputeLanes::~ComputeLanes() { stop(); }

void ComputeLanes::start() {
  if (started_.exchange(true)) return;
  for (int i = 0; i < options_.lanes; ++i) {
    lanes_[static_cast<std::size_t>(i)]->started_ns = now_ns();
    lanes_[static_cast<std::size_t>(i)]->thread = std::thread([this, i] { lane_main(i); });
  }
}

void ComputeLanes::stop() {
  {
    std::lock_guard lock(mu_);
    if (stopping_.exchange(true)) return;
    stopped_ns_.store(now_ns());
  }
  work_cv_.notify_all();
  for (auto& lane : lanes_) {
    if (lane->thread.joinable()) lane->thread.join();
  }
}

int ComputeLanes::current_lane() const { return this_lane.owner == this ? this_lane.index : -1; }

void ComputeLanes::enqueue_locked(LaneWork& work) {
  if (work.queued_ || work.closed_ || work.running_ >= work.max_lanes || !work.has_work()) return;
  work.queued_ = true;
  ready_.push_back(Entry{&work, {}});
  pending_.store(ready_.size(), std::memory_order_release);
}

void ComputeLanes::notify(LaneWork& work) {
  bool wake = false;
  {
    std::lock_guard lock(mu_);
    const std::size_t before = ready_.size();
    enqueue_locked(work);
    wake = ready_.size() > before && sleeping_ > 0;
  }
  if (wake) work_cv_.notify_one();
}

bool ComputeLanes::post(std::function<void()> task) {
  bool wake = false;
  {
    std::lock_guard lock(mu_);
    if (stopping_.load() || !started_.load()) return false;
    ready_.push_back(Entry{nullptr, std::move(task)});
    pending_.store(ready_.size(), std::memory_order_release);
    wake = sleeping_ > 0;
  }
  if (wake) work_cv_.notify_one();
  return true;
}

bool ComputeLanes::claim_next(LaneWork& work) {
  const int index = current_lane();
  if (index < 0 || lanes_[static_cast<std::size_t>(index)]->continuation_work != nullptr) return false;
  std::lock_guard lock(mu_);
  if (work.closed_ || work.running_ >= work.max_lanes) return false;
  ++work.running_;
  lanes_[static_cast<std::size_t>(index)]->continuation_work = &work;
  return true;
}

void ComputeLanes::run_next(std::function<void()> run) {
  lanes_[static_cast<std::size_t>(current_lane())]->continuation = std::move(run);
}

bool ComputeLanes::help(LaneWork& work) {
  if (current_lane() < 0) return false;
  {
    std::lock_guard lock(mu_);
    if (work.closed_ || work.running_ >= work.max_lanes) return false;
    ++work.running_;
  }
  Lane& lane = *lanes_[static_cast<std::size_t>(this_lane.index)];
  lane.runs.fetch_add(1, std::memory_order_relaxed);
  work.run_one();  // busy time: counted in the unit this help interrupts
  release(work);
  return true;
}

void ComputeLanes::release(LaneWork& work) {
  bool wake = false, idle = false;
  {
    std::lock_guard lock(mu_);
    --work.running_;
    const std::size_t before = ready_.size();
    enqueue_locked(work);
    wake = ready_.size() > before && sleeping_ > 0;
    idle = work.running_ == 0;
  }
  if (wake) work_cv_.notify_one();
  if (idle) idle_cv_.notify_all();
}

void ComputeLanes::quiesce(LaneWork& work) {
  std::unique_lock lock(mu_);
  work.closed_ = true;
  idle_cv_.wait(lock, [&] { return work.running_ == 0; });
  for (auto it = ready_.begin(); it != ready_.end();) {
    it = it->work == &work ? ready_.erase(it) : std::next(it);
  }
  work.queued_ = false;
  pending_.store(ready_.size(), std::memory_order_release);
}

void ComputeLanes::run_entry(Lane& lane, Entry&& entry) {
  const std::int64_t t0 = now_ns();
  if (entry.work != nullptr) {
    lane.runs.fetch_add(1, std::memory_order_relaxed);
    entry.work->run_one();
    release(*entry.work);
  } else {
    lane.tasks.fetch_add(1, std::memory_order_relaxed);
    try {
      entry.task();
    } catch (const std::exception& e) {  // tasks report through their own futures; never kill a lane
      detail::log(LogLevel::kError, fmt::format("a task on a compute lane raised: {}", e.what()));
    }
  }
  // Run-to-completion: the next block of the request, claimed while the unit above ran.
  while (lane.continuation) {
    auto run = std::move(lane.continuation);
    LaneWork* work = std::exchange(lane.continuation_work, nullptr);
    lane.continuation = nullptr;
    lane.inline_continuations.fetch_add(1, std::memory_order_relaxed);
    lane.runs.fetch_add(1, std::memory_order_relaxed);
    run();
    release(*work);
  }
  lane.busy_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
}

void ComputeLanes::lane_main(int index) {
  this_lane = ThisLane{this, index};
  pthread_setname_np(pthread_self(), fmt::format("bf-lane/{}", index % 1000).c_str());
  if (options_.intra_op_threads > 0) {
    // After the lazy initialisation, so that this thread's OpenMP team keeps this size.
    at::internal::lazy_init_num_threads();
    at::set_num_threads(options_.intra_op_threads);
  }
  Lane& lane = *lanes_[static_cast<std::size_t>(index)];
  for (;;) {
    if (options_.spin > absl::ZeroDuration() && pending_.load(std::memory_order_acquire) == 0) {
      // Poll briefly: a hand-off to an awake lane costs well under a microsecond, a wake-up tens.
      const std::int64_t until = now_ns() + absl::ToInt64Nanoseconds(options_.spin);
      while (pending_.load(std::memory_order_acquire) == 0 && !stopping_.load(std::memory_order_acquire) &&
             now_ns() < until) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      }
    }
    Entry entry;
    {
      std::unique_lock lock(mu_);
      // Stopping: posted tasks still run (their futures must resolve); block work stays queued.
      auto has_entry = [&] {
        if (!stopping_.load()) return !ready_.empty();
        for (const auto& e : ready_) {
          if (e.work == nullptr) return true;
        }
        return false;
      };
      while (!has_entry()) {
        if (stopping_.load()) return;
        ++sleeping_;
        work_cv_.wait(lock);
        --sleeping_;
      }
      auto it = ready_.begin();
      if (stopping_.load()) {
        while (it->work != nullptr) ++it;
      }
      entry = std::move(*it);
      ready_.erase(it);
      if (entry.work != nullptr) {
        entry.work->queued_ = false;
        ++entry.work->running_;
        // More than one lane may run it: leave it ready for the next free lane.
        enqueue_locked(*entry.work);
      }
      pending_.store(ready_.size(), std::memory_order_release);
    }
    run_entry(lane, std::move(entry));
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
    c.busy_ns = lane->busy_ns.load(std::memory_order_relaxed);
    c.alive_ns = lane->started_ns == 0 ? 0 : now - lane->started_ns;
    out.push_back(c);
  }
  return out;
}

}  // namespace blockflow::detail
