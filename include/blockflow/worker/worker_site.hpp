#pragma once
/// @file
/// @brief WorkerSite: blocks in a child worker process (or a joined one on another host), reached
/// over a zero-copy data link (WorkerOptions::channel "shm", the default, or "cuda") or serialized
/// ZeroMQ ("zmq": `ipc://`, `tcp://`). Part of the optional `blockflow::workers` target.

#include <blockflow/channel/curve.hpp>
#include <blockflow/deploy/deployment.hpp>
#include <blockflow/core/remote_site.hpp>
#include <blockflow/core/session.hpp>
#include <blockflow/core/detail/malloc_settings.hpp>

#include <absl/time/time.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace blockflow {

/// @brief How a worker process is started and supervised.
struct WorkerOptions {
  std::string name;  ///< e.g. "w1"; names the worker in errors and metrics
  /// The worker executable; empty: $BLOCKFLOW_WORKER, else the `blockflow-worker` built or installed
  /// with this library.
  std::string executable;
  /// Shared libraries the worker dlopen()s before building blocks; each exports
  /// `extern "C" void blockflow_register_blocks(blockflow::BlockRegistry&)` (see BlockRegistry).
  std::vector<std::string> plugins;
  /// Extra "NAME=VALUE" environment entries for the worker (they override the inherited ones: the
  /// host's environment as it is when the site starts, which restarts use too).
  /// The default shortens GNU OpenMP's spin-wait: a worker whose block has finished would otherwise
  /// keep its OpenMP threads spinning for a while, taking a core from the next block's worker on a
  /// small machine (measured on 2 cores: the 4-worker ResNet50 pipeline went from 1.48x to 1.22x
  /// the monolithic model). Within a block, parallel regions follow each other closely enough to
  /// stay in the spin. The two glibc malloc settings keep a block's activation buffers (up to
  /// 32 MB each) in the process between requests instead of unmapping them and faulting them back
  /// in on the next one (measured on 2 cores: ResNet50's block1 computed in 20.2 ms instead of
  /// 24.7 ms in its worker; pipeline ratio 1.23 instead of 1.27). Memory freed stays with the worker
  /// up to 1 GB (detail::worker_malloc_environment(): the settings blockflow-profile measures blocks
  /// under): {"GOMP_SPINCOUNT=10000", "MALLOC_MMAP_THRESHOLD_=33554432",
  /// "MALLOC_TRIM_THRESHOLD_=1073741824"}.
  std::vector<std::string> environment = [] {
    std::vector<std::string> e = {"GOMP_SPINCOUNT=10000"};
    for (auto& setting : detail::worker_malloc_environment()) e.push_back(std::move(setting));
    return e;
  }();
  /// With a fork server running in this process (start_fork_server(), fork_server.hpp), fork the
  /// worker from it instead of starting blockflow-worker as a new program: its start then costs its
  /// own blocks, not libtorch's start as well. It applies when `executable` is empty (the default
  /// blockflow-worker) and `environment` keeps the variables libraries read when they load as the
  /// fork server has them; otherwise the worker is started as a new program and the session logs
  /// once why. SiteStats::forked says which way the live worker started.
  bool fork = true;
  /// Empty (the default): the session starts the worker as its child and reaches it over `ipc://`
  /// endpoints in a private 0700 directory. "tcp://ADDR:PORT": a worker on another host. The session
  /// starts nothing; it binds its control socket at this endpoint (and its two data sockets at
  /// ephemeral ports of the same address) and waits for a worker started there with
  /// `blockflow-worker --join tcp://THIS_HOST:PORT --name NAME`. A worker that goes silent is declared
  /// dead after heartbeat_timeout; "restart" then means waiting up to start_timeout for it to join
  /// again (blockflow-worker re-joins by itself). Name an address: 127.0.0.1 keeps it on this host.
  std::string listen;
  /// With `listen`: CURVE keys (curve.hpp). The session's key pair and the directory of the workers'
  /// public keys; the worker must hold the key named after it (`w1.key` for "w1"), on the control
  /// socket and on both data sockets, so no other process can join as it, take its requests or send
  /// results in its name. Without keys, `listen` beyond the loopback is refused unless
  /// `security.insecure`. The worker's side: `blockflow-worker --join ... --key w1.key_secret
  /// --session-key session.key`.
  ServerSecurity security;
  /// How tensors cross between the host and a worker. "shm" (what "" means for a child): the
  /// zero-copy channel; each side copies a tensor once into a slot of its own shared-memory pool and
  /// sends a 32-byte handle, the other side's tensor is a view of that slot, and the slot returns
  /// when the view dies (so a worker block's outputs that you keep hold its slots: clone() them to
  /// keep many). "zmq": the tensor bytes travel serialized over ipc://. A worker that joins over
  /// TCP (listen) uses "zmq" (what "" means there); asking for "shm" there is an error. "cuda":
  /// as "shm" for CPU tensors, and CUDA tensors cross as CUDA IPC handles to the producer's GPU
  /// memory, nothing copied (docs/gpu.md; needs cuda_channel_available()).
  std::string channel;
  std::size_t shm_slots_per_pool = 4;                 ///< slots per pool (one pool per power-of-two size class)
  std::size_t shm_max_bytes = std::size_t{1} << 30;   ///< bound on each side's pools for this worker
  /// Zero-copy channels: the worker allocates CPU tensors of at least half a slot directly in free
  /// slots of its result pools (not while it builds blocks: weights stay out of the slots), so that
  /// a block's output is shared as it lies instead of copied into a slot when it is sent
  /// (intermediate activations take free slots too while they live; when none is free, libtorch's
  /// allocator serves). Off by default: each output is copied into a slot once (~50 us for 3.2 MB),
  /// while blocks computing in slot memory ran 20-25% slower in a 4-worker pipeline on an AMD EPYC
  /// (docs/workers.md, "Outputs in slots"). Worth it for outputs of tens of MB and more.
  bool shm_outputs_in_slots = false;
  int max_restarts = 5;  ///< 0 or more, per session; then the worker stays down (start() refuses the options below when
                         ///< they cannot work: negative or infinite durations, a zero start_timeout, a heartbeat
                         ///< interval under 1 ms or a heartbeat_timeout not above it, max_in_flight 0)
  absl::Duration restart_backoff = absl::Milliseconds(100);  ///< doubled after each restart
  /// How often the session pings the worker; the worker answers each ping with a heartbeat (its
  /// resident memory, pool counters and KPI sample: stats()). Sent to the worker in its
  /// configuration: a joined worker (listen) takes the session for gone after 30 intervals without
  /// a message from it (at least 1 s; the worker bounds the interval to 1 ms .. 10 s) and joins again.
  absl::Duration heartbeat_interval = absl::Milliseconds(100);
  /// Silence that counts as death: the worker is killed and restarted, its requests fail with
  /// "missed heartbeats". A child whose exit has already begun (killed from outside, its address
  /// space still being torn down) is waited for, up to another timeout, and reported by how it died.
  absl::Duration heartbeat_timeout = absl::Milliseconds(800);
  absl::Duration start_timeout = absl::Seconds(120);           ///< spawn + load + warm-up
  /// Longest one call into a block may run in the worker (its heartbeats say what runs: they come
  /// from its control thread and go on while a block never returns). Beyond it the worker is killed
  /// and restarted (a joined worker declared dead), its requests failing with "ran block 'B' for
  /// more than T in one call (compute_timeout)". 0: never.
  absl::Duration compute_timeout = absl::Minutes(2);
  std::size_t max_in_flight = 64;  ///< requests sent and not answered (credits); run() waits beyond
  /// Zero-copy channels: how long the data link's receiving threads (the session's, the worker's)
  /// poll for the next packet before they sleep, while packets come in a stream (on average less
  /// than 4 x this apart). A packet that follows within the spin is taken without a wake-up (a
  /// sleeping thread's wake-up costs 20-50 us on the 2-core VM). A link whose packets come
  /// milliseconds apart, as in a pipeline of DNN blocks, never spins, so the spin takes no core from
  /// a block that starts computing. 0: never spin.
  absl::Duration receive_spin = absl::Microseconds(50);
  /// Zero-copy channels: the data link's receiving threads (the session's for this worker, and the
  /// worker's) poll for the next packet without ever sleeping, whatever the traffic: a packet is
  /// taken without a thread's wake-up, at the cost of one core per polling thread, all the time
  /// (three per worker: the worker's session polls with one lane too, SessionOptions::poll_lane,
  /// so that a request it receives starts on it without a wake-up). For hosts with cores to spare and a latency to keep, such as a GPU server
  /// whose blocks' kernels leave the CPU mostly idle (docs/gpu.md, "Busy polling"); never on a
  /// machine whose cores the blocks need. Channel "zmq" has no data link: refused there at start().
  bool busy_poll = false;
  /// Channel "zmq", a child worker: direct edges. When the next block of a request's path runs in
  /// another such worker (or this one), this worker keeps the block's outputs and the session gets
  /// references to them; the session then tells it to send them straight to that worker, so each
  /// tensor crosses one socket instead of two (worker -> session -> worker). A worker that dies
  /// with parked outputs fails the requests they were for, naming it. false: every output comes
  /// back to the session.
  bool direct_edges = true;
  /// Direct edges: bound on the bytes of outputs the worker keeps for other workers at a time (it
  /// also keeps at most 2 x max_in_flight of them); beyond it, outputs come back to the session.
  std::uint64_t max_parked_bytes = std::uint64_t{1} << 30;
  /// Bytes of resident memory this worker's blocks may take, by their profiled
  /// BlockOptions::memory_bytes; the session refuses more at start() and apply(). 0: no budget.
  std::int64_t memory_budget = 0;
  /// What the budget does, as SessionOptions::memory_policy does for the session's threads
  /// (docs/memory.md): kAdmit, the session refuses blocks whose profiles add up to more; kOnDemand
  /// (with a budget), the worker loads its blocks when requests need them, unloading idle ones,
  /// least recently used first, and each block must fit the budget alone.
  SessionOptions::MemoryPolicy memory_policy = SessionOptions::MemoryPolicy::kAdmit;
  /// kOnDemand: what the budget bounds, as SessionOptions::memory_measure does: the loaded blocks'
  /// footprints, or also what the worker process grew by beyond them (kProcess).
  SessionOptions::MemoryMeasure memory_measure = SessionOptions::MemoryMeasure::kBlocks;
  /// Compute lanes of the worker process (SessionOptions::lanes): 0, as many as its cores hold
  /// OpenMP teams of its blocks' intra-op threads.
  int lanes = 0;
};

/// @brief A RemoteSite that runs blocks in a child process started with posix_spawn (never fork) of
/// the worker executable, configured over a ROUTER/DEALER control channel, fed over PUSH/PULL data
/// sockets (channel "zmq") or a data link carrying handles (the zero-copy channels) in a private
/// 0700 directory; or, with WorkerOptions::listen, in a worker on another host
/// that joins over TCP.
///
/// Supervision: a worker that exits, is killed, or misses heartbeats for heartbeat_timeout is
/// detected (process status is polled every 50 ms); every request inside it fails with an error
/// naming the worker and the cause ("worker w2 killed by signal 9"); it is restarted with backoff,
/// and queued requests flow again (a restart that cannot spawn uses one of max_restarts and backs off
/// again). The worker dies with the host (parent-death signal). Thread-safe.
class WorkerSite final : public RemoteSite {
 public:
  explicit WorkerSite(WorkerOptions options);
  ~WorkerSite() override;

  const std::string& name() const override;
  absl::Status start(const std::vector<BlockDescription>& blocks, CompletionFn done) override;
  void run(const std::string& block, Envelope&& envelope) override;
  bool run_unless(const std::string& block, Envelope& envelope, const std::atomic<bool>& give_up) override;
  /// @brief Takes the envelope at once on a zero-copy channel when the worker is ready, nothing is
  /// queued before it, a credit is free and every tensor crosses without a copy (it lies in another
  /// worker's slot: a relay). The calling thread sends the handles itself.
  bool try_run(const std::string& block, Envelope& envelope) override;
  void stop() override;
  /// Its first start with `sites` > 1 warms its blocks up with cores / sites threads (at least 1)
  /// before the last warm-up run (SessionOptions::warm_up_threads); a restart uses its own.
  void starting_together(int sites) override;
  SiteStats stats() const override;
  void on_lost(LostFn lost) override;
  /// @brief Forwards the setting to the worker (now and after each restart); its samples come back
  /// with the heartbeats, in stats().kpi.
  void set_sampling(bool enabled, absl::Duration period) override;
  /// @brief Sends the new block list to the running worker, which loads and warms up the new
  /// blocks (next to the others, untouched) and unloads the ones no longer listed, then answers.
  /// Heartbeats go on meanwhile. Waits up to WorkerOptions::start_timeout; a restart later loads
  /// the new list. Errors name the worker and the block.
  absl::Status update(const std::vector<BlockDescription>& blocks) override;
  /// @brief Makes an update() in progress return Cancelled now (the worker may still load the
  /// blocks; a restart loads the list it had before that update).
  void cancel_update() override;

  /// @brief The worker's process id (0 while it is down, and for a worker on another host). For
  /// tests and tools.
  [[nodiscard]] std::int64_t pid() const;
  /// @brief The endpoint where the worker's replies arrive (in the private directory; the
  /// frames are validated like any other): a ZeroMQ endpoint for channel "zmq", the path of the
  /// data link (an AF_UNIX SOCK_SEQPACKET socket that only the worker's process may connect to)
  /// for the zero-copy channels. For tests and tools.
  [[nodiscard]] std::string result_endpoint() const;
  /// @brief Where the worker's requests leave (the same kind of endpoint as result_endpoint()).
  [[nodiscard]] std::string request_endpoint() const;
  /// @brief Where a worker joins (WorkerOptions::listen with the port resolved), empty for a child.
  [[nodiscard]] std::string join_endpoint() const;
  /// @brief Channel "zmq" with WorkerOptions::direct_edges, a child: the endpoint (in the private
  /// directory) where other workers of the session send this worker its requests' parked inputs.
  /// Empty otherwise.
  [[nodiscard]] std::string peer_endpoint() const override;
  [[nodiscard]] std::int64_t memory_budget() const override;
  [[nodiscard]] bool loads_on_demand() const override;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;  // shared with the placeholders of outputs parked in the worker
};

/// @brief `defaults` with what a deployment gives a site (Deployment::sites): its name, memory budget,
/// policy and measure, lanes. A site factory that starts workers for Session::apply() makes their
/// options with it, e.g.
/// @code
///   session.set_site_factory([](const blockflow::SiteSettings& s) {
///     return blockflow::make_worker(blockflow::worker_options_for({}, s));
///   });
/// @endcode
WorkerOptions worker_options_for(WorkerOptions defaults, const SiteSettings& settings);

/// @brief Adds a deployment's blocks and tasks to `session` (before start()), with one child worker
/// per placement named in it, each made from `defaults` with that name and the deployment's settings
/// for it (Deployment::sites: memory budget and policy, lanes). Also installs a site factory, so that
/// Session::apply() can start workers for placements that later updates name, with their settings.
void add_deployment(Session& session, const Deployment& deployment, const WorkerOptions& defaults = {});

/// @brief OK when WorkerOptions::channel "cuda" can be used here: BlockFlow built with the CUDA
/// toolkit (BLOCKFLOW_WITH_CUDA), a libtorch with CUDA, and a visible device. Otherwise the reason,
/// the same that WorkerSite::start() gives for such a worker. See docs/gpu.md.
absl::Status cuda_channel_available();

/// @brief Convenience: a shared WorkerSite for Session::add_site().
inline std::shared_ptr<WorkerSite> make_worker(WorkerOptions options) {
  return std::make_shared<WorkerSite>(std::move(options));
}

}  // namespace blockflow
