#pragma once
/// @file
/// @brief RemoteSite: a place outside the session's threads where blocks run (a child worker
/// process, a worker on another host). The session routes; the site executes and reports back.

#include <blockflow/core/block_registry.hpp>
#include <blockflow/channel/channel.hpp>
#include <blockflow/core/kpi.hpp>

#include <absl/status/status.h>
#include <absl/status/statusor.h>
#include <absl/time/time.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace blockflow {

/// @brief What a site reports for each request it was given: outputs or an error, plus where the
/// time went inside the site, as local steady-clock times (sites on other hosts convert their
/// durations; 0 where unknown).
struct SiteCompletion {
  std::uint64_t request_id = 0;
  std::uint32_t node = 0;
  absl::StatusOr<Tensors> outputs;
  std::int64_t arrived_ns = 0;        ///< the site received it
  std::int64_t wait_ns = 0;           ///< time queued inside the site
  std::int64_t compute_start_ns = 0;
  std::int64_t compute_end_ns = 0;
};

/// @brief One direction of a zero-copy shared-memory edge: the producer's pool and what crossed it.
struct ShmEdgeStats {
  std::uint64_t handles = 0;         ///< tensors handed over as handles
  std::uint64_t releases = 0;        ///< slots given back by the consumer
  std::uint64_t leases = 0;          ///< slots the producer allocated its tensors in (no copy when sent)
  std::uint64_t slots_in_use = 0;    ///< leased, not yet released by the consumer
  std::uint64_t slots_total = 0;
  std::uint64_t credit_waits = 0;    ///< times the producer found no free slot at first
  std::uint64_t reclaims = 0;        ///< slots taken back from a consumer that died
  std::uint64_t stale_releases = 0;  ///< releases that matched no lease (ignored)
  std::uint64_t bytes_staged = 0;    ///< the producer's one copy into its slots
  std::uint64_t bytes_mapped = 0;    ///< size of the producer's pools
  std::uint64_t pools = 0;           ///< pools (one per slot size in use, more under bursts)
  std::uint64_t pools_trimmed = 0;   ///< pools removed after idling (ShmPoolOptions::idle_trim)
  std::uint64_t pools_created = 0;   ///< pools made so far (the first of each size class included)
  std::uint64_t forwarded = 0;       ///< handles passed on unchanged: tensors that lie in a third process's slot (counted in handles too)
};

/// @brief Counters of a site, for metrics.
struct SiteStats {
  std::string name;
  /// What the site is: "worker" (a WorkerSite's child process) or "joined-worker" (a WorkerSite
  /// whose worker joined over TCP, WorkerOptions::listen). Another RemoteSite names its own kind.
  std::string kind;
  std::int64_t pid = 0;      ///< current process id (0 when down)
  bool forked = false;       ///< the live process was forked from the fork server (WorkerOptions::fork)
  std::uint64_t restarts = 0;
  bool lost = false;         ///< gone for good: it died after its last restart (RemoteSite::on_lost)
  /// Requests the site failed itself: its worker died or could not be restarted, the site stopped,
  /// a request could not be sent, or its input parked in another worker was lost. Not errors that
  /// its blocks returned.
  std::uint64_t failed_requests = 0;
  std::uint64_t in_flight = 0;
  std::uint64_t malformed_frames = 0;
  /// Direct edges (WorkerOptions::direct_edges): results the worker kept for the next worker,
  /// and kept outputs this site told its worker to send to another worker.
  std::uint64_t parked_outputs = 0;
  std::uint64_t direct_forwards = 0;
  std::int64_t rss_idle_bytes = 0;  ///< resident memory of the process before it loaded any block
  std::int64_t rss_bytes = 0;       ///< resident memory at the last heartbeat
  /// The site's longest call into one of its blocks now in progress, as of its last heartbeat (""
  /// and 0: none runs); WorkerOptions::compute_timeout bounds it.
  std::string computing_block;
  double computing_s = 0;
  ChannelStats data;          ///< the channel that carries requests to the site
  /// With data.kind "shm": host -> site (the host's pool) and site -> host (the site's pool, as of
  /// its last heartbeat). Bytes copied in the hand-off itself: data.bytes_copied (0).
  ShmEdgeStats shm_requests, shm_results;
  /// With data.kind "cuda": the same for CUDA tensors, whose slots hold CUDA IPC records (the CPU
  /// tensors of that edge still cross in shm_requests / shm_results). bytes_staged stays 0.
  ShmEdgeStats cuda_requests, cuda_results;
  /// The site process's last KPI sample (empty, time_s 0, while sampling is off).
  KpiSample kpi;
  /// A site that loads on demand (RemoteSite::loads_on_demand()), as of its last heartbeat: the
  /// footprints of the blocks loaded now, loads, evictions, the footprints of every load, and the
  /// time spent loading; with swapping (SessionOptions::swap), the loads that were swap-ins and the
  /// weights waiting in swap files now; for "process", its growth beyond the loaded blocks
  /// (SiteMemory::unaccounted_bytes). `memory_measure`, what its budget bounds, is its
  /// configuration's (WorkerOptions::memory_measure), not a heartbeat's.
  std::int64_t blocks_resident_bytes = 0;
  std::uint64_t block_loads = 0, block_evictions = 0;
  std::int64_t block_bytes_loaded = 0;
  double block_load_s = 0;
  std::uint64_t block_swap_ins = 0;
  std::int64_t swapped_bytes = 0;
  std::string memory_measure;  ///< "blocks" or "process"; "" when the site does not load on demand
  std::int64_t unaccounted_bytes = 0;
  /// Per block with BlockOptions::cuda_graph in the site, as of its last heartbeat.
  std::map<std::string, CudaGraphStats> cuda_graphs;
};

/// @brief Contract between a session and a place where blocks run.
///
/// start() builds the given blocks there and returns once they are warmed up (or an error naming
/// the site and the block). run() hands over one request for one block; it may block for
/// backpressure. Every request given to run() is reported exactly once through the completion
/// callback: with outputs, or with an error naming the site and the cause (for instance
/// "worker w2 killed by signal 9"). stop() fails whatever is still inside, then returns; after it
/// returns the completion callback is never called again (the site drops it: the session that
/// gave it may be gone), and run() drops what it is given.
/// Implementations are thread-safe.
class RemoteSite {
 public:
  using CompletionFn = std::function<void(SiteCompletion&&)>;
  virtual ~RemoteSite() = default;

  [[nodiscard]] virtual const std::string& name() const = 0;
  virtual absl::Status start(const std::vector<BlockDescription>& blocks, CompletionFn done) = 0;
  virtual void run(const std::string& block, Envelope&& envelope) = 0;
  /// @brief run() without waiting, from whatever thread delivers a request (a completion callback
  /// included): true when the site took the envelope (it then reports it like any run()), false,
  /// with `envelope` untouched, when taking it now would mean waiting or queueing. The session then
  /// queues it for run(). It spares the session's forwarding thread a wake-up per hop. The default
  /// declines.
  virtual bool try_run(const std::string& block, Envelope& envelope) {
    (void)block;
    (void)envelope;
    return false;
  }
  /// @brief run() for a caller that may stop feeding `block`: while the site waits for room (for
  /// backpressure: a worker whose block never returns keeps it full), it checks `give_up` every
  /// few milliseconds and, once it is set, returns false with `envelope` untouched; the caller then
  /// owns the request again. true: taken, as by run(). The session sets `give_up` when it stops
  /// feeding a block (apply() removing it, shutdown()), so that neither waits on a site that makes
  /// no room. The default ignores `give_up` and calls run().
  virtual bool run_unless(const std::string& block, Envelope& envelope, const std::atomic<bool>& give_up) {
    (void)give_up;
    run(block, std::move(envelope));
    return true;
  }
  virtual void stop() = 0;
  /// Called before start() when the session starts `sites` sites at once (start(), apply()): a site
  /// that loads blocks in a process of its own may share the cores with the others while loading.
  virtual void starting_together(int sites) { (void)sites; }
  [[nodiscard]] virtual SiteStats stats() const = 0;
  /// @brief Called by the session before start(): the site calls `lost` once, from any thread of
  /// its own, when it is gone for good (it will run nothing again: a worker that used up its
  /// restarts), with the cause; never after stop() has returned. The default never calls it.
  using LostFn = std::function<void(const std::string& cause)>;
  virtual void on_lost(LostFn lost) { (void)lost; }
  /// @brief Makes the running site host exactly `blocks` from now on: it loads and warms up the
  /// ones it lacks before returning and unloads the ones no longer listed (the session has drained
  /// them), leaving the others untouched. On failure the site keeps the blocks it had, and the
  /// error names the site and the block. The default refuses: a site that cannot change.
  virtual absl::Status update(const std::vector<BlockDescription>& blocks) {
    (void)blocks;
    return absl::UnimplementedError("site '" + name() + "' cannot change its blocks while it runs");
  }
  /// @brief Makes an update() in progress on another thread return CancelledError now (the site
  /// may still load the blocks it was given; the session never routes to them). Does nothing when
  /// no update() runs. The default does nothing: that site's update() ends when it ends.
  virtual void cancel_update() {}
  /// @brief Where other sites of this host may send this site's requests directly (a site that
  /// keeps a block's outputs when Envelope::outputs_may_stay is set). Empty: nowhere, the default.
  /// The session asks once the site has started.
  [[nodiscard]] virtual std::string peer_endpoint() const { return {}; }
  /// @brief Bytes of resident memory the site's blocks may take, by their profiled
  /// BlockOptions::memory_bytes (the session refuses more at start() and apply()); 0: no budget.
  [[nodiscard]] virtual std::int64_t memory_budget() const { return 0; }
  /// @brief Whether the site loads its blocks on demand under memory_budget() (each block must then
  /// fit the budget alone, and SiteStats says what is loaded). The default: no.
  [[nodiscard]] virtual bool loads_on_demand() const { return false; }
  /// @brief Switches the site's own KPI sampler (its process's figures, reported in stats().kpi).
  /// The default does nothing: a site without a process of its own has nothing to sample.
  virtual void set_sampling(bool enabled, absl::Duration period) {
    (void)enabled;
    (void)period;
  }
};

}  // namespace blockflow
