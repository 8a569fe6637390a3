#pragma once
/// @file
/// @brief Session: owns blocks and paths, runs blocks on compute lanes, routes requests.

#include <blockflow/core/block.hpp>
#include <blockflow/core/block_registry.hpp>
#include <blockflow/core/remote_site.hpp>
#include <blockflow/deploy/deployment.hpp>
#include <blockflow/core/metrics.hpp>
#include <blockflow/core/path.hpp>
#include <blockflow/core/result.hpp>
#include <blockflow/core/site_loss.hpp>

#include <absl/status/status.h>
#include <absl/time/time.h>

#include <cstddef>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>

namespace blockflow {

/// @brief Session-wide settings.
struct SessionOptions {
  /// Compute lanes: the threads that run every block of this process (docs/lanes.md). 0: as many
  /// as the cores hold teams of intra_op_threads (hardware threads / intra_op_threads, at least 1),
  /// plus, with elastic_lanes, one lane of one thread per core beyond the team lanes' count (cores -
  /// team lanes: on 16 cores with teams of 2, 8 team lanes and 8 one-thread lanes). Above 0: that many
  /// lanes, each with a team.
  int lanes = 0;
  /// With lanes 0 and intra_op_threads above 1: a unit of work runs with its lane's whole team only
  /// when nothing else waits for a core, and with one thread otherwise, so that under load every
  /// core runs a unit of its own (throughput of one thread per core; latency of a team for a
  /// request alone). The process holds at most lanes x intra-op + one-thread lanes OpenMP threads.
  bool elastic_lanes = true;
  /// libtorch intra-op threads of each lane (its one OpenMP team). 0: the largest
  /// BlockOptions::intra_op_threads among the blocks this process runs at start(), or libtorch's
  /// default when none sets one. Every block runs with the lanes' setting.
  int intra_op_threads = 0;
  /// Intra-op threads of the warm-up runs before the last one (TorchScript's profiling and
  /// optimising runs, BlockOptions::warmup_runs), at most the lanes', each block's runs one after
  /// another on a team lane. 0: the session chooses: with several CPU blocks and cores, those runs
  /// are made with one thread each, the blocks' side by side on the cores (docs/lanes.md, "Warm-up
  /// and loading"). The last run is made with the team's threads, and with one where a one-thread
  /// lane may run the block, so that oneDNN's kernels for those exist before the first request. A
  /// worker process gets cores / workers when the session starts several at once (docs/workers.md,
  /// "Cold start"): their warm-ups then share the cores instead of each running a whole team on them.
  int warm_up_threads = 0;
  /// With warm_up_threads set: in start(), the last warm-up run of each CPU block with
  /// warmup_runs >= 2 too is made with that many threads, not the team's. For a caller that runs
  /// each such block once with the team's threads itself before serving, as a worker process does
  /// (its priming run, docs/workers.md, "Cold start"): that run then makes oneDNN's kernels for the
  /// team's width, and several workers warming up at once never run whole teams on the same cores.
  /// Blocks that apply() adds warm up as usual.
  bool warm_up_last_narrow = false;
  /// How long an idle lane polls for work before it sleeps.
  absl::Duration receive_spin = absl::Microseconds(50);
  /// One lane polls for work whenever it is idle and never sleeps: a request that reaches an idle
  /// session starts on it without a thread's wake-up (tens of microseconds, more on a busy host), at
  /// the cost of one core all the time. A worker with WorkerOptions::busy_poll sets it in its own
  /// session. For hosts with a core to spare and a latency to keep (docs/gpu.md, "Busy polling").
  bool poll_lane = false;
  /// Bytes of resident memory the blocks of this process (the "threads" site) may take. 0: no budget.
  std::int64_t memory_budget = 0;
  /// What the budget does (docs/memory.md).
  enum class MemoryPolicy {
    /// start() and apply() refuse blocks whose profiled BlockOptions::memory_bytes add up to more.
    kAdmit,
    /// Blocks built from descriptions load when a request needs them: to make room, idle blocks are
    /// unloaded, least recently used first (a running block never; one with queued requests only
    /// when no idle block is left). Requests wait for the load (a `load` span in their trace); a
    /// block larger than the whole budget is refused, naming it. A block of unknown footprint
    /// (memory_bytes 0) is measured by its first load, at start() or apply(). Blocks added as objects
    /// (add_block(std::shared_ptr<Block>)) stay loaded and are not counted.
    kOnDemand,
  };
  MemoryPolicy memory_policy = MemoryPolicy::kAdmit;
  /// kOnDemand: what the budget bounds (docs/memory.md, "What the budget bounds").
  enum class MemoryMeasure {
    /// The footprints of the blocks loaded now (each measured at its first load, or profiled).
    kBlocks,
    /// The process's resident memory grown since start(): what no loaded block accounts for (the
    /// activations and caches of running blocks, the part of an unloaded block that stays) takes
    /// room too, so idle blocks are unloaded sooner. Sampled at each load. Never a reason to wait:
    /// when unloading every idle block is not enough, the block loads all the same (its footprint
    /// fits the budget). In the process of an application, what the application allocates after
    /// start() counts too.
    kProcess,
  };
  MemoryMeasure memory_measure = MemoryMeasure::kBlocks;
  /// kOnDemand: how an unloaded TorchScript block on the CPU comes back (docs/memory.md, "Swapping").
  struct Swap {
    /// true: its load captures the memory it allocates through libtorch (its weights); unloading it
    /// writes that memory to a file (the first time; later only what changed) and drops its pages,
    /// keeping the module, and loading it again pages the weights back in: milliseconds instead of
    /// a new build. false: unloading frees the block and loading builds it again. Other blocks
    /// (callables, CUDA) are always built again.
    bool enabled = true;
    /// Where the swap files go (made unlinked, 0600): "" is $TMPDIR, else /var/tmp. A disk, not a
    /// tmpfs: a tmpfs file's pages stay in memory (a warning says so).
    std::string directory;
    /// Unloading also drops the weights from the page cache, so that loading reads the disk: what a
    /// machine short of memory sees once the kernel has reclaimed the cache.
    bool drop_page_cache = false;
  };
  Swap swap;
  /// kOnDemand: when a lane takes a request for a block, the next blocks of the request's path that
  /// are not loaded start loading on another lane, when room can be made from idle blocks of other
  /// paths without waiting (docs/memory.md, "Prefetch"). Off by default.
  bool prefetch = false;
  /// start() returns once the sites are up and the paths are checked, before the blocks of this
  /// process built from descriptions are loaded: they load and warm up in the background on the
  /// lanes (as many at once as there are lanes), task by task in the order the paths were added, so
  /// the first task serves before the last is loaded. A task is active (PathMetrics::active_ms) once every block on its path has loaded; a
  /// request for a task that is not active yet waits for the loads it needs (its trace shows them as
  /// `load`) rather than failing. A block that fails to load fails its requests, naming it.
  bool serve_while_warming = false;
  /// At most this many requests of one task inside the session's blocks at once; 0: no limit. The
  /// others wait at the task's entry, in submission order, holding only the inputs they were given,
  /// and start as requests of the task resolve (their wait shows in the trace as the first hop's
  /// `wait`). The backlog of a burst, or of a worker that restarts, then waits there instead of as
  /// activations in the sites' queues and shared-memory pools, so what the sites hold stays within
  /// this many requests per task (docs/lanes.md, "Entry window"). A request that waited is routed
  /// when it starts: on the task's path as it is then (one an update removed fails, naming the task).
  int max_in_flight_per_task = 0;
  /// When a site is lost for good (a worker that used up its restarts), the session asks this
  /// function for a deployment of the sites that remain and applies it (blockflow::replanner() makes
  /// one from the planner's inputs: docs/replan.md). Unset: the loss shows in metrics()
  /// (MetricsSnapshot::replan, SiteStats::lost) and the deployment stays as it is.
  SiteLostFn on_site_lost;
};

namespace detail {
class SessionCore;
}

/// @brief Runs blocks on compute lanes and routes each task's requests along its path.
///
/// Lifecycle: add_block()/add_path() describe the session; start() validates everything (unknown
/// blocks, cycles, empty paths, ... are reported with the path and the problem), starts one input
/// queue per block and the compute lanes, and warms blocks up on the lanes; submit() may then be
/// called from any number of threads; shutdown() (also run by the destructor) stops admissions,
/// lets in-flight requests finish for up to `drain`, then fails whatever is left with Cancelled.
///
/// Guarantee: every submit() resolves exactly once, with outputs or with an error status naming the
/// block or path and the cause. Thread-safety: submit(), metrics(), set_sampling(), apply(),
/// cancel_update() and shutdown() may be called from any thread; add_block(), add_path() and start()
/// must not race with each other.
///
/// @code
/// blockflow::Session session;
/// session.add_block(blockflow::Block::callable("twice", twice_fn))
///        .add_path(blockflow::Path::chain("task", {"twice"}));
/// if (auto status = session.start(); !status.ok()) { /* names the problem */ }
/// blockflow::Result r = session.submit("task", torch::ones({2})).get();
/// @endcode
class Session {
 public:
  explicit Session(SessionOptions options = {});
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  /// @brief Adds a block (before start()). Names must be unique; a duplicate fails start().
  Session& add_block(std::shared_ptr<Block> block);
  /// @brief Adds a block by description (before start()): built in this process at start() when
  /// `placement` is empty, otherwise shipped to the site of that name (see add_site()).
  Session& add_block(BlockDescription description);
  /// @brief What apply() does with a site once an update has removed its last block.
  enum class SiteLifetime {
    kKeep,          ///< the site stays, idle, for later updates (what a site you add yourself does)
    kStopWhenEmpty  ///< the site is stopped (a worker process exits): sites of deployments and factories
  };
  /// @brief Adds a site where blocks can be placed, e.g. a blockflow::WorkerSite (a child process).
  /// Throws std::invalid_argument for a null site, a name check_site_name() refuses ("threads" and
  /// "host" are the session's own in metrics) or the name of a site added already.
  Session& add_site(std::shared_ptr<RemoteSite> site, SiteLifetime lifetime = SiteLifetime::kKeep);
  /// @brief Makes a site of the given name (for instance a blockflow::WorkerSite).
  using SiteFactory = std::function<std::shared_ptr<RemoteSite>(const std::string& name)>;
  /// @brief How apply() starts a site that a new block's placement names and the session does not
  /// have yet (add_deployment() installs one that starts worker processes). Without a factory such
  /// an update is rejected, naming the placement. Call before start() or between apply() calls.
  /// This form takes a name only: the deployment's settings for the site (Deployment::sites: memory
  /// budget and policy, lanes) are not applied, and apply() logs a warning naming the site when
  /// there are any; the form below takes them.
  Session& set_site_factory(SiteFactory factory);
  /// @brief The same, given the settings the deployment being applied has for the site
  /// (Deployment::site(): defaults, only the name set, when it gives none).
  using SiteFactoryWithSettings = std::function<std::shared_ptr<RemoteSite>(const SiteSettings& settings)>;
  Session& set_site_factory(SiteFactoryWithSettings factory);
  /// @brief Removes the factory.
  Session& set_site_factory(std::nullptr_t) { return set_site_factory(SiteFactoryWithSettings()); }
  /// @brief Adds a path for `path.task()` (before start()).
  Session& add_path(Path path);

  /// @brief Validates the blocks and paths and starts the workers. Returns InvalidArgument naming
  /// the offending path/block, or the first warm-up failure. Call once.
  [[nodiscard]] absl::Status start();

  /// @brief Submits one request. The future always becomes ready: see the class comment.
  [[nodiscard]] std::future<Result> submit(const std::string& task, Tensors inputs);
  [[nodiscard]] std::future<Result> submit(const std::string& task, Tensor input);
  /// @brief Callback flavour: `done` runs exactly once, on a compute lane or a site's
  /// thread (or inline when the request is refused at once). It must not block for long: it holds a lane.
  /// Nor may it wait for apply() or shutdown() to return, or for anything its caller does after
  /// them: an apply() may need a lane (to warm new blocks up) or stop the worker whose thread runs
  /// the callback, and shutdown() joins the session's threads. A callback running on a lane holds
  /// shutdown() up as a block call does (see there); one running on a worker site's thread (a
  /// request that site failed) is waited for without a limit, as its captures may be the caller's.
  /// submit() throws only for an empty `done` (std::invalid_argument) and when it cannot even
  /// register the request (std::bad_alloc): `done` then never runs. Anything thrown later (by a RemoteSite taking the request, say) resolves it instead,
  /// ResourceExhausted naming the task and the exception.
  void submit(const std::string& task, Tensors inputs, std::function<void(Result&&)> done);

  /// @brief A snapshot of the built-in measurements.
  [[nodiscard]] MetricsSnapshot metrics() const;

  /// @brief Moves a running session to the wanted state while traffic flows, and returns the new
  /// version number (also in metrics().version; start() is version 0).
  ///
  /// Blocks in `wanted` that do not run yet are built, loaded and warmed up before any request is
  /// routed to them; then every task is re-routed at once (new requests take the new paths, a
  /// request in flight finishes on the path it started with); then blocks no longer wanted are
  /// drained (up to `drain`: requests still holding them after that fail with an error naming the
  /// removed block) and stopped. A call into a removed block that has not returned by then is waited
  /// for 100 ms more, not for ever: its lane stays with it, and the block's memory is freed by the
  /// first apply() after it returns. (shutdown() gives such a call 1 s: see there.)
  /// A forwarder waiting for room at a site that makes none (a worker whose block never returns)
  /// gives its request up, failed with an error naming the block and the site. Blocks that stay the
  /// same (same file or factory, placement and options; or listed by bare name) are left untouched:
  /// no reload, no restart. A block whose
  /// description changed is replaced. Tasks not in `wanted` are removed.
  ///
  /// An invalid update (a model that does not load, an unknown block in a task, a cycle, a device
  /// that is not present) is rejected as a whole with a message naming the problem, and the
  /// running state stays as it was.
  ///
  /// Blocks placed at sites (worker processes) follow the same rules. A new block goes to the site
  /// its placement names: a running site loads and warms it up next to its other blocks, which are
  /// not touched; a site the session lacks is made by the site factory (set_site_factory()) and
  /// started. A removed block is drained, then unloaded from its site; a site left without blocks
  /// is stopped (its process exits) when it was made by the factory or added with
  /// SiteLifetime::kStopWhenEmpty (as add_deployment() does), and otherwise stays, idle. Changing a block in place inside the same site is refused
  /// (give the new version another name, or another placement). A site that fails to load a block
  /// rejects the update as a whole: new sites are stopped, the others unload what they loaded.
  ///
  /// A task left out of an update is removed, except one whose graph merges with a C++ rule
  /// (Combine::custom()): no deployment can describe it, so such an update is refused, naming the
  /// task (it would be dropped without anyone asking); with
  /// Deployment::keep_code_blocks (the control endpoint's deployments) so is an update that leaves
  /// out a block added as a C++ object with add_block(), as no deployment could bring it back: list
  /// it by name to keep it, or give a block of its name to replace it. Blocks and sites
  /// an update removed are freed once no request in flight can reach them any more.
  ///
  /// apply() calls run one at a time. metrics(), submit(), set_site_factory() and set_sampling()
  /// never wait for one. shutdown() and cancel_update() end one early: before the new routing is
  /// published it returns Cancelled and nothing changed; while it drains, the drain ends at once.
  /// Called from a completion callback or a block of this session, apply() returns
  /// FailedPrecondition at once (it would wait for the very thread it runs on).
  absl::StatusOr<std::uint64_t> apply(const Deployment& wanted, absl::Duration drain = absl::Seconds(30));
  /// @brief Cancels the apply() in progress, if any (see apply()); returns at once. A site busy
  /// loading the update's blocks is asked to stop waiting (RemoteSite::cancel_update()); a site the
  /// update was starting is stopped. Building a block in this process is not interrupted: the
  /// update ends when that build returns.
  void cancel_update();
  /// @brief As cancel_update(), but only when the apply() in progress is the one thread `caller`
  /// called: whoever gives up its own update (a ControlEndpoint being destroyed) leaves another
  /// thread's apply() or a re-plan alone. Returns whether it cancelled one.
  bool cancel_update_from(std::thread::id caller);

  /// @brief Switches KPI sampling (process figures from /proc, GPU figures through NVML where
  /// present) on or off, in this process and in every site (worker), at any time, with the given
  /// period. Off by default. The samples appear in metrics(): `host` and each site's `kpi`.
  void set_sampling(bool enabled, absl::Duration period = absl::Milliseconds(100));

  /// @brief Stops admissions, cancels an apply() in progress, waits up to `drain` for in-flight
  /// requests, then cancels the rest (each fails with Cancelled naming the block it was at), stops
  /// the lanes and the sites. A call into a block of this process still running after `drain` is
  /// given 1 s more; if it has not returned by then, its request fails like the others, an error is
  /// logged naming the block, and shutdown() returns without that call's lane, which is joined once
  /// the call returns. The destructor does the same with no drain; if the call has still not
  /// returned 1 s later, it returns too, and the session's internals (lanes, blocks, counters) are
  /// freed on a thread of their own once the call returns: a thread cannot be stopped from outside.
  /// (Destroyed on one of its own threads, a completion callback or a block, the session is shut
  /// down and freed on a thread of its own once that thread is done.)
  /// Idempotent. Called from a completion callback or a block of this session, it only stops
  /// admissions (logged as an error: it would join the thread it runs on); the rest is done by the
  /// next call from another thread, or by the destructor.
  void shutdown(absl::Duration drain = absl::Seconds(5));

  /// @brief Runs `fn` on one of the session's compute lanes, taking turns with the blocks, and
  /// returns its result (or exception) through the future. For the application's own libtorch
  /// work: on a lane it uses the lane's OpenMP team instead of making one more, so the process
  /// stays within its cores (docs/lanes.md). Before start() or after shutdown() the future holds a
  /// std::logic_error. `fn` must not wait on the session's requests (it would hold a lane).
  /// @code
  /// double ms = session.run_on_lane([&] { return my_model.forward({x}).toTensor().sum().item<double>(); }).get();
  /// @endcode
  template <class F>
  [[nodiscard]] auto run_on_lane(F&& fn) -> std::future<std::invoke_result_t<std::decay_t<F>&>> {
    using R = std::invoke_result_t<std::decay_t<F>&>;
    auto promise = std::make_shared<std::promise<R>>();
    auto future = promise->get_future();
    auto task = [promise, f = std::make_shared<std::decay_t<F>>(std::forward<F>(fn))] {
      try {
        if constexpr (std::is_void_v<R>) {
          (*f)();
          promise->set_value();
        } else {
          promise->set_value((*f)());
        }
      } catch (...) {
        promise->set_exception(std::current_exception());
      }
    };
    if (!post_to_lane(std::move(task))) {
      promise->set_exception(std::make_exception_ptr(std::logic_error("Session::run_on_lane(): the session is not running")));
    }
    return future;
  }

 private:
  bool post_to_lane(std::function<void()> task);

  std::unique_ptr<detail::SessionCore> core_;
};

}  // namespace blockflow
