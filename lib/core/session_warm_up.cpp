// How a session's new blocks of this process get ready to serve (docs/lanes.md, "Building and
// warming up"): built in parallel, the largest TorchScript file first, then warmed up on zeros of
// their input shapes, so that no request pays TorchScript's first runs.
#include <blockflow/channel/inproc_channel.hpp>
#include <blockflow/core/detail/mutex.hpp>
#include <blockflow/core/detail/build_scope.hpp>
#include <blockflow/core/detail/log.hpp>
#include <blockflow/core/detail/cuda_graph_block.hpp>
#include <blockflow/core/detail/exception_text.hpp>
#include <blockflow/core/detail/omp_width.hpp>
#include <blockflow/core/detail/session_core.hpp>
#include <blockflow/core/detail/weight_swap.hpp>
#include <blockflow/core/detail/warm_up_shapes.hpp>

#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>
#include <c10/core/InferenceMode.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <memory>
#include <mutex>
#include <numeric>
#include <set>
#include <system_error>
#include <thread>

namespace blockflow::detail {
namespace {
// The forward variants the table's plans run `runtime` with, one bit each: bit (2 * opaque input
// + opaque output) (detail::OpaqueLayout); a block no plan uses yet: its plain forward().
unsigned layouts_used(const RoutingTable& table, const BlockRuntime& runtime) {
  unsigned used = 0;
  for (const auto& [task, plan] : table.plans) {
    for (const auto& node : plan->nodes) {
      if (node.block != &runtime) continue;
      const bool in = node.inputs.size() == 1 && plan->nodes[static_cast<std::size_t>(node.inputs.front())].keep_layout;
      used |= 1U << ((in ? 2U : 0U) + (node.keep_layout ? 1U : 0U));
    }
  }
  return used == 0 ? 1U : used;
}

// Threads of their own for `tasks` when the lanes leave cores idle (fewer lanes than cores, each
// lane's team spanning several): a build is mostly one thread's work (deserialising, graph passes),
// and so is a warm-up run at one thread. 0: the lanes do it.
int core_threads_for(std::size_t tasks, const ComputeLanes* lanes) {
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const int threads = static_cast<int>(std::min<std::size_t>(tasks, static_cast<std::size_t>(cores)));
  return threads > 1 && threads > (lanes != nullptr ? lanes->size() : 0) ? threads : 0;
}

// Runs the tasks, in their order, on `threads` threads that each take the next one until none is
// left, then exit (their OpenMP teams with them). `one_thread`: each thread with an OpenMP team of
// one, so that the threads together hold the cores and no more.
void on_core_threads(const std::vector<std::function<void()>>& tasks, int threads, bool one_thread) {
  std::atomic<std::size_t> next{0};
  auto take = [&] {
    if (one_thread) {
      (void)at::get_num_threads();  // libtorch sets a thread's width at its first call: before ours
      set_thread_omp_width(1);
    }
    for (std::size_t i = next++; i < tasks.size(); i = next++) tasks[i]();
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    try {
      pool.emplace_back(take);
    } catch (const std::system_error&) {  // no thread to be had: the others (or this one) take the rest
      break;
    }
  }
  if (pool.empty()) {  // on the caller's thread, whose OpenMP width is given back
    const int width = one_thread ? at::get_num_threads() : 0;
    struct Restore {
      int width;
      ~Restore() {
        if (width > 0) set_thread_omp_width(width);
      }
    } restore{width};
    take();
  }
  for (auto& t : pool) t.join();
}

}  // namespace

std::vector<std::size_t> build_order(const std::vector<const BlockDescription*>& descriptions) {
  std::vector<std::uintmax_t> bytes(descriptions.size(), 0);
  for (std::size_t i = 0; i < descriptions.size(); ++i) {
    std::error_code ec;
    if (!descriptions[i]->torchscript.empty()) bytes[i] = std::filesystem::file_size(descriptions[i]->torchscript, ec);
    if (ec) bytes[i] = 0;  // make_block() names the file's problem
  }
  std::vector<std::size_t> order(descriptions.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return bytes[a] > bytes[b]; });
  return order;
}

Tensors warm_up_inputs(const BlockOptions& options, c10::Device device) {
  Tensors zeros;
  for (std::size_t i = 0; i < options.input_shapes.size(); ++i) {
    const auto dtype = options.input_dtypes.empty() ? at::kFloat : options.input_dtypes[i];
    zeros.push_back(at::zeros(warm_up_shape(options.input_shapes[i]), at::TensorOptions().dtype(dtype).device(device)));
  }
  return zeros;
}

Tensors warm_up_inputs(const Block& block) { return warm_up_inputs(block.options(), block.device()); }

absl::Status warm_up_loaded(Block& block) {
  const auto& options = block.options();
  if (options.input_shapes.empty()) return absl::OkStatus();
  const WeightSwap::Pause activations_are_not_weights;  // swapping captures what the build made
  c10::InferenceMode inference_mode;
  const Tensors zeros = warm_up_inputs(block);
  for (int run = 0; run < options.warmup_runs; ++run) {
    auto out = guarded_forward(block, Tensors(zeros));
    if (!out.ok()) return with_prefix(out.status(), "warm-up failed");
  }
  return capture_cuda_graph(block, zeros);
}

// Warms up every variant of forward() the plans will run, so that no request pays TorchScript's
// first-run optimisation. `runs` says which of the block's runs this call makes (WarmUpRuns);
// `one_thread`: a one-thread lane may run the block (its last run is also made with one thread).
absl::Status SessionCore::warm_up_block(BlockRuntime& runtime, unsigned layouts, WarmUpRuns runs, bool one_thread) {
  c10::InferenceMode inference_mode;
  Block& block = *runtime.block;
  const auto& options = block.options();
  const Tensors zeros = warm_up_inputs(block);
  const bool early = runs != WarmUpRuns::kLast, last = runs != WarmUpRuns::kEarly;
  for (unsigned v = 0; v < 4; ++v) {
    if ((layouts & (1U << v)) == 0) continue;
    Tensors inputs = zeros;
    if ((v & 2U) != 0 && inputs.size() == 1) inputs.front() = inputs.front().to_mkldnn();
    absl::Status status;
    auto run_once = [&] {
      if (!status.ok()) return;
      auto out = v == 0 ? guarded_forward(block, Tensors(inputs))
                        : guarded_forward(block, Tensors(inputs), runtime.layout, (v & 1U) != 0);
      if (!out.ok()) status = out.status();
    };
    // The runs before the last (TorchScript's profiling and optimising runs) with at most
    // SessionOptions::warm_up_threads threads: several worker processes warming up at once on a
    // few cores would otherwise each run a whole team on them.
    for (int run = 0; early && run + 1 < options.warmup_runs; ++run) {
      if (lanes_) lanes_->with_at_most(options_.warm_up_threads, run_once);
      else run_once();
    }
    // The last run once with each thread count the lanes may run the block with (the team's, and
    // one when `one_thread`), so that oneDNN's kernels for both exist before the first request.
    // kEarly runs on a thread of one OpenMP thread: the one-thread run; kLast on a team lane: the
    // team's.
    if (options.warmup_runs > 0 && lanes_) {
      // warm_up_last_narrow: start() only (apply()'s new blocks get no run from the caller), CPU
      // blocks that the caller's own run then finds optimised (warmup_runs >= 2).
      const bool narrow = options_.warm_up_last_narrow && options_.warm_up_threads > 0 && !admitting_.load() &&
                          block.device().is_cpu() && options.warmup_runs >= 2;
      if (runs == WarmUpRuns::kAll && narrow) {
        lanes_->with_at_most(options_.warm_up_threads, run_once);  // the caller's own run at the team's follows
        if (one_thread && options_.warm_up_threads > 1) lanes_->with_at_most(1, run_once);
      } else if (runs == WarmUpRuns::kAll) {
        lanes_->for_each_width(run_once, one_thread);
      } else if (last) {
        lanes_->for_each_width(run_once, /*one_thread=*/false);
      } else if (one_thread) {
        run_once();
      }
    }
    if (!status.ok()) return with_prefix(status, "warm-up failed");
  }
  return last ? capture_cuda_graph(block, zeros) : absl::OkStatus();
}

// Runs the tasks on the lanes, in parallel across them, and waits for all. On a lane already
// (apply() from a completion callback), or with the lanes stopped, they run here instead; and so do
// the tasks no lane has taken when none of them runs and none has started or ended for
// kLanesStuckAfter: every lane is then busy with something else that long, maybe a call that does
// not return, and a start or an update must not wait for it (the tasks get this thread's OpenMP
// team). Each task runs once, where it is taken first; a lane that comes to one taken here later
// drops it, touching nothing of this frame (the tasks live as long as the last such lane). Nothing a
// task throws leaves it (the tasks report through their own state, and a lane swallows it too).
void SessionCore::on_lanes(std::vector<std::function<void()>>& tasks, bool team_lanes, bool one_thread) {
  if (tasks.empty()) return;
  constexpr auto kLanesStuckAfter = std::chrono::seconds(5);
  struct Shared {
    std::vector<std::function<void()>> tasks;
    std::vector<std::atomic<bool>> taken;
    std::mutex mu;
    std::condition_variable changed;
    std::size_t finished = 0, running = 0;
    std::chrono::steady_clock::time_point last_change = std::chrono::steady_clock::now();
    explicit Shared(std::vector<std::function<void()>>& t) : tasks(std::move(t)), taken(tasks.size()) {}
    void note(bool ended) {
      std::lock_guard lock(mu);
      if (ended) {
        ++finished;
        --running;
      } else {
        ++running;
      }
      last_change = std::chrono::steady_clock::now();
      changed.notify_all();
    }
  };
  auto shared = std::make_shared<Shared>(tasks);
  auto run = [](const std::shared_ptr<Shared>& s, std::size_t i) {  // false: taken already, elsewhere
    if (s->taken[i].exchange(true)) return false;
    s->note(false);
    struct Ended {  // however the task ends: the wait must end
      Shared& s;
      ~Ended() { s.note(true); }
    } ended{*s};
    try {
      s->tasks[i]();
    } catch (...) {  // on this thread too: leaving early would leave queued tasks this frame's references
      log(LogLevel::kError, fmt::format("a task of a start or an update (a build, a warm-up) threw: {}",
                                        current_exception_text()));
    }
    return true;
  };
  for (std::size_t i = 0; i < shared->tasks.size(); ++i) {
    if (!lanes_ || lanes_->current_lane() >= 0 || !lanes_->post([shared, i, run] { (void)run(shared, i); }, team_lanes, one_thread)) {
      (void)run(shared, i);
    }
  }
  std::unique_lock lock(shared->mu);
  while (shared->finished < shared->tasks.size()) {
    if (shared->running > 0) {  // ours are moving on the lanes: their ends wake this up
      shared->changed.wait(lock);
      continue;
    }
    const auto quiet_until = shared->last_change + kLanesStuckAfter;
    if (shared->changed.wait_until(lock, quiet_until) == std::cv_status::no_timeout ||
        std::chrono::steady_clock::now() < quiet_until) {
      continue;  // a task started or ended: the lanes are moving
    }
    lock.unlock();
    std::size_t here = 0;
    for (std::size_t i = 0; i < shared->tasks.size(); ++i) here += run(shared, i) ? 1 : 0;
    if (here > 0) {
      log(LogLevel::kWarning, fmt::format("no compute lane took {} task(s) of a start or an update (builds, warm-ups) in "
                                          "{} s: every lane may be in a call that does not return; they ran on the "
                                          "calling thread", here, std::chrono::seconds(kLanesStuckAfter).count()));
    }
    lock.lock();
    if (here == 0) shared->last_change = std::chrono::steady_clock::now();  // a lane took the rest: no spin
  }
}

// Work that wants one core per task (builds, warm-up runs at one thread), spread over the cores: on
// the lanes when there are as many (elastic lanes: the team's and the one-thread lanes), each run
// with one thread when `one_thread`; with fewer lanes than cores, on a thread per core.
void SessionCore::on_cores(std::vector<std::function<void()>>& tasks, bool one_thread) {
  if (const int threads = core_threads_for(tasks.size(), lanes_.get()); threads > 0) {
    on_core_threads(tasks, threads, one_thread);
    return;
  }
  if (one_thread && lanes_) {  // a team lane books one core for it (elastic) and runs it with one thread
    for (auto& task : tasks) task = [this, run = std::move(task)] { lanes_->with_at_most(1, run); };
  }
  on_lanes(tasks, /*team_lanes=*/false, one_thread);
}

// Blocks of this process are built where they will run, on the lanes: libtorch's graph passes and
// weight prepacking use the lane's OpenMP team, and the caller's thread makes none of its own. With
// fewer lanes than cores, on a thread per core instead (on_cores()).
std::vector<absl::StatusOr<std::shared_ptr<Block>>> SessionCore::make_blocks(const std::vector<const BlockDescription*>& descriptions) {
  std::vector<absl::StatusOr<std::shared_ptr<Block>>> out(descriptions.size(), absl::UnknownError("not built"));
  std::vector<std::function<void()>> tasks;
  for (const std::size_t i : build_order(descriptions)) {
    tasks.emplace_back([this, &out, &descriptions, i] {
      const auto scope = enter_build_scope();
      auto build = [&] {
        try {
          out[i] = make_block(*descriptions[i]);
        } catch (...) {  // nothing may escape a builder thread or a lane
          out[i] = absl::InternalError(fmt::format("block '{}': {}", descriptions[i]->name, current_exception_text()));
        }
      };
      if (lanes_) lanes_->with_at_most(options_.warm_up_threads, build);  // on a lane: as its warm-up
      else build();
    });
  }
  on_cores(tasks, /*one_thread=*/false);
  return out;
}

// Each new in-process block with input shapes warms up as its requests will run, the blocks in
// parallel. The CPU blocks' runs at one thread (all but the team's last) are made first, spread over
// the cores (on_cores()); then the last on the team lanes. Sites warm theirs up themselves.
absl::Status SessionCore::warm_up(const std::vector<BlockRuntime*>& runtimes, const RoutingTable& table) {
  std::vector<BlockRuntime*> todo;
  for (auto* runtime : runtimes) {
    if (runtime->block && runtime->resident_id < 0 && !runtime->block->options().input_shapes.empty()) todo.push_back(runtime);
  }
  std::vector<absl::Status> statuses(todo.size());
  std::vector<WarmUpRuns> lane_runs(todo.size(), WarmUpRuns::kAll);
  // A one-thread lane runs a block only while every team lane is busy: with another block of this
  // process, or with this one when it may run on several lanes at once (BlockOptions::workers).
  // Otherwise (a worker process's one block) no request runs it with one thread: no such run.
  std::set<const BlockRuntime*> local;
  for (const auto& [task, plan] : table.plans) {
    for (const auto& node : plan->nodes) {
      if (node.block != nullptr && node.block->site == nullptr) local.insert(node.block);
    }
  }
  const auto one_thread = [&](const BlockRuntime& r) {
    return lanes_ && lanes_->elastic() && (local.size() > 1 || r.block->options().workers > 1);
  };
  // Nothing may escape a lane or a thread of on_cores(): a block's failure is its status.
  auto warm = [&](std::size_t i, WarmUpRuns runs) {
    try {
      const auto scope = enter_build_scope();
      statuses[i] = warm_up_block(*todo[i], layouts_used(table, *todo[i]), runs, one_thread(*todo[i]));
    } catch (const std::exception& e) {
      statuses[i] = absl::InternalError(fmt::format("block '{}': warm-up failed: {}", todo[i]->block->name(), e.what()));
    }
  };
  std::vector<std::function<void()>> early;
  for (std::size_t i = 0; i < todo.size(); ++i) {
    if (!todo[i]->block->device().is_cpu()) continue;  // a CUDA block's runs stay on its lane's stream
    lane_runs[i] = WarmUpRuns::kLast;
    early.emplace_back([&warm, i] { warm(i, WarmUpRuns::kEarly); });
  }
  const auto cores = static_cast<std::size_t>(std::max(1U, std::thread::hardware_concurrency()));
  // Spread only where SessionOptions::warm_up_threads leaves the choice (0): a worker starting
  // beside others (cores / workers threads) keeps its runs on its team lane, one after another.
  if (lanes_ && options_.warm_up_threads <= 0 && std::min(early.size(), cores) > 1) {
    on_cores(early, /*one_thread=*/true);
  } else {  // nothing to run side by side: each block's runs on a team lane, as they come
    std::fill(lane_runs.begin(), lane_runs.end(), WarmUpRuns::kAll);
  }
  std::vector<std::function<void()>> tasks;
  for (std::size_t i = 0; i < todo.size(); ++i) {
    if (!statuses[i].ok()) continue;
    tasks.emplace_back([&warm, &lane_runs, i] { warm(i, lane_runs[i]); });
  }
  on_lanes(tasks, /*team_lanes=*/true);  // each width a lane runs with is warmed up there
  for (const auto& status : statuses) {
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

}  // namespace blockflow::detail
