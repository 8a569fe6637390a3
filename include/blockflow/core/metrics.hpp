#pragma once
/// @file
/// @brief Snapshot of a session's built-in measurements, serialisable to JSON.

#include <blockflow/channel/channel.hpp>
#include <blockflow/core/remote_site.hpp>

#include <absl/status/statusor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace blockflow {

/// @brief Distribution of a latency, in milliseconds (percentiles within ~1% relative error).
struct LatencyStats {
  std::uint64_t count = 0;
  double mean_ms = 0, p50_ms = 0, p90_ms = 0, p99_ms = 0, max_ms = 0;
  double sum_ms = 0;  ///< all of them together: only grows (a Prometheus summary's _sum)
};

/// @brief Per-block aggregates since the session started.
struct BlockMetrics {
  std::string name;
  std::string kind;    ///< "callable", "torchscript", or "factory" (a block a registry factory made)
  std::string device;
  std::string placement;  ///< "threads" or the name of the site (worker) running it
  int workers = 0;           ///< at most this many lanes run the block at once
  int intra_op_threads = 0;  ///< as asked for in its options (it runs with the lanes' setting)
  std::uint64_t processed = 0;  ///< forward() calls that returned outputs
  std::uint64_t failed = 0;     ///< requests that failed at this block
  std::uint64_t batches = 0;          ///< forward() calls that ran more than one request (batching)
  std::uint64_t batched_requests = 0; ///< requests that ran in those calls
  /// Outputs handed to the next block in oneDNN's layout, sparing a to_dense/to_mkldnn pair
  /// (docs/lanes.md, "Layouts between blocks").
  std::uint64_t layout_kept = 0;
  /// Requests that skipped the block's queue: handed straight to its site by the thread that had
  /// the previous block's result, or run at once by the lane that ran the previous block.
  std::uint64_t handed_directly = 0;
  /// How long the longest call into the block now in progress has run, in seconds (0: none runs):
  /// a block that never returns shows here, growing. For a block in a worker, see
  /// SiteStats::computing_s.
  double computing_s = 0;
  /// Loading on demand (SessionOptions::MemoryPolicy::kOnDemand, docs/memory.md): whether this block
  /// does, whether it is loaded now, its footprint (profiled, or measured at its first load), its
  /// loads and evictions, and the session's uptime at its last use (0: never used).
  bool on_demand = false;
  bool resident = true;
  std::int64_t footprint_bytes = 0;
  std::uint64_t loads = 0, evictions = 0;
  double last_use_s = 0;
  /// BlockOptions::cuda_graph: graphs captured, replays, eager runs (for a block in a worker, as
  /// of the worker's last heartbeat; for a block loaded on demand, since its last load); zeros for
  /// other blocks.
  CudaGraphStats cuda_graph;
  LatencyStats wait, compute, overhead;
  double throughput_per_s = 0;  ///< processed / uptime
  ChannelStats queue;           ///< the block's input queue (depth = current depth)
};

/// @brief One compute lane of the session (docs/lanes.md), since it started.
struct LaneMetrics {
  int index = 0;
  std::uint64_t runs = 0;                  ///< block work units run (a request, or a batch)
  std::uint64_t tasks = 0;                 ///< warm-ups and Session::run_on_lane() tasks run
  std::uint64_t inline_continuations = 0;  ///< next blocks run at once by the lane that ran the previous block
  /// Units and tasks run with one thread: every one of a one-thread lane's, and a team lane's while
  /// more work waited than the teams could take (SessionOptions::elastic_lanes).
  std::uint64_t one_thread_runs = 0;
  /// Times the lane slept waiting for work, each ended by a wake-up (0 for a lane that polls,
  /// SessionOptions::poll_lane).
  std::uint64_t sleeps = 0;
  int threads = 0;                         ///< its OpenMP team (1: a one-thread lane; 0: libtorch's default)
  double busy_s = 0;                       ///< seconds spent running work
  double utilisation = 0;                  ///< busy_s / the lane's lifetime
};

/// @brief A site's memory against its blocks' profiles (BlockOptions::memory_bytes), as of the
/// last start() or apply(). "threads" is the session's own process.
struct SiteMemory {
  std::string site;
  std::int64_t budget_bytes = 0;    ///< 0: no budget
  std::int64_t profiled_bytes = 0;  ///< the sum of its blocks' profiled memory (0: none profiled)
  /// What its resident memory grew by with its blocks: a worker's RSS over its RSS before it loaded
  /// any; the session's RSS over its RSS before start() built its blocks (0 also when a worker did
  /// not report its RSS).
  std::int64_t measured_bytes = 0;
  /// "admit" (start() and apply() refuse blocks over the budget) or "on_demand" (blocks load when a
  /// request needs them; the figures below are live).
  std::string policy = "admit";
  std::int64_t resident_bytes = 0;  ///< on demand: the footprints of the blocks loaded now
  std::uint64_t loads = 0, evictions = 0;
  std::int64_t bytes_loaded = 0;    ///< on demand: the footprints of every load
  double load_s = 0;                ///< on demand: time spent loading (and warming up) blocks
  std::uint64_t prefetches = 0;     ///< on demand: loads made ahead of their requests (SessionOptions::prefetch)
  /// On demand with swapping (SessionOptions::swap): loads that paged a block's weights back in
  /// instead of building it (counted in `loads` too), and the weights of unloaded blocks that wait
  /// in swap files now (a worker's as of its last heartbeat).
  std::uint64_t swap_ins = 0;
  std::int64_t swapped_bytes = 0;
  /// On demand: what the budget bounds (SessionOptions::memory_measure, WorkerOptions::memory_measure):
  /// "blocks" (the loaded blocks' footprints) or "process" (also what the process grew by beyond
  /// them since start()).
  std::string measure = "blocks";
  /// On demand, "process": what the process had grown by beyond the loaded blocks' footprints when
  /// it last decided a load (the working memory of running blocks, what swapping leaves behind,
  /// the application's own allocations); it takes room in the budget as the footprints do. 0 for
  /// "blocks".
  std::int64_t unaccounted_bytes = 0;
};

/// @brief Per-path (task) aggregates since the session started.
struct PathMetrics {
  std::string task;
  bool active = true;  ///< false once an update removed the task (its counters stay)
  std::uint64_t submitted = 0, completed = 0, failed = 0;
  LatencyStats e2e, wait, compute, overhead;  ///< per request, summed over its critical path
  double throughput_per_s = 0;                 ///< completed / uptime
  /// Start() called to the moment every block on the task's path had loaded (0: not yet). Without
  /// SessionOptions::serve_while_warming, start()'s duration; for a task added by apply(), when the
  /// update published it.
  double active_ms = 0;
  /// SessionOptions::max_in_flight_per_task: requests waiting at the task's entry now, and the
  /// requests that waited there since start (0 without a window).
  std::uint64_t waiting_at_entry = 0, waited_at_entry = 0;
};

/// @brief Where the last successful Session::apply() spent its time (version 0: none yet).
struct UpdateStats {
  std::uint64_t version = 0;
  std::uint32_t blocks_added = 0, blocks_removed = 0;  ///< a replaced block counts in both
  std::uint32_t sites_started = 0, sites_stopped = 0;  ///< worker processes started / stopped by it
  double load_ms = 0;   ///< building, loading and warming the new blocks, here and at sites
  double route_ms = 0;  ///< checking the paths and publishing the new routing table
  double drain_ms = 0;  ///< draining, stopping and unloading the removed blocks
  double total_ms = 0;  ///< the whole apply() call
  /// apply() called to the first request resolved with a result after it published (0: none yet).
  double time_to_first_result_ms = 0;
};

/// @brief How the session came up (its cold start), in milliseconds.
struct StartStats {
  double process_to_start_ms = 0;  ///< the process started (10 ms resolution) to Session::start() called
  double start_ms = 0;             ///< Session::start() itself: sites, blocks, warm-up
  /// The process started to the first request resolved with a result, any task (0: none yet).
  double time_to_first_result_ms = 0;
};

/// @brief Sites lost for good and the re-plans that followed (SessionOptions::on_site_lost).
struct ReplanStats {
  /// Lost now, in the order they were lost; a site an update starts again under a lost name leaves the list.
  std::vector<std::string> lost_sites;
  std::uint64_t losses = 0;             ///< sites lost so far (a name lost, started again and lost again counts twice)
  std::uint64_t applied = 0;            ///< re-planned deployments applied
  std::uint64_t failed = 0;             ///< re-plans that failed (the function's error or apply()'s)
  double last_ms = 0;                   ///< the last loss to its re-planned deployment applied (0: none)
  std::uint64_t last_version = 0;       ///< the deployment version the last re-plan made
  std::string last_error;               ///< why the last failed re-plan failed
};

/// @brief A consistent-enough copy of the counters (each counter is read atomically; the
/// snapshot as a whole is not a transaction).
struct MetricsSnapshot {
  double uptime_s = 0;
  std::uint64_t in_flight = 0;
  std::uint64_t version = 0;      ///< deployment version: 0 at start(), +1 per successful Session::apply()
  UpdateStats last_update;        ///< the timing of the apply() that made `version`
  StartStats start;               ///< the session's cold start
  /// Blocks removed by updates and still kept because a request in flight may reach them (freed
  /// by the next apply() once none can).
  std::uint64_t retired_blocks = 0;
  /// Peers this process refused on its CURVE endpoints since it started (unknown key, no key, a
  /// worker's name with another key, a wrong server key): curve.hpp. Process-wide, like `host`.
  std::uint64_t auth_failures = 0;
  bool sampling = false;          ///< KPI sampling on (Session::set_sampling)
  double sampling_period_s = 0;
  KpiSample host;                 ///< this process's last KPI sample (time_s 0 while sampling is off)
  std::vector<BlockMetrics> blocks;
  std::vector<PathMetrics> paths;
  std::vector<SiteStats> sites;  ///< worker processes and other remote sites
  std::vector<LaneMetrics> lanes;  ///< this process's compute lanes
  int lane_intra_op_threads = 0;   ///< each lane's OpenMP team (0: libtorch's default)
  std::vector<SiteMemory> memory;  ///< sites whose blocks carry a profiled memory_bytes, or with a budget
  ReplanStats replan;              ///< sites lost for good, and what the session did about it

  /// @brief JSON object; `indent` < 0 gives one line. Keys: docs/metrics.md.
  [[nodiscard]] std::string to_json(int indent = -1) const;
  /// @brief The inverse of to_json(): from_json(s.to_json()) equals s. InvalidArgument naming the
  /// problem for text that is not such a snapshot.
  [[nodiscard]] static absl::StatusOr<MetricsSnapshot> from_json(const std::string& json);
  /// @brief Prometheus text exposition (format 0.0.4) of the snapshot; docs/metrics.md lists every
  /// metric, its type, unit and labels.
  [[nodiscard]] std::string to_prometheus() const;
};

}  // namespace blockflow
