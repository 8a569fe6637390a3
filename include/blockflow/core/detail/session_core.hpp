#pragma once
// Internal: the machinery behind blockflow::Session.

#include <blockflow/core/block.hpp>
#include <blockflow/core/detail/warm_up_shapes.hpp>
#include <blockflow/core/block_registry.hpp>
#include <blockflow/core/remote_site.hpp>
#include <blockflow/core/kpi.hpp>
#include <blockflow/core/metrics.hpp>
#include <blockflow/core/path.hpp>
#include <blockflow/core/session.hpp>
#include <blockflow/channel/inproc_channel.hpp>
#include <blockflow/core/detail/compute_lanes.hpp>
#include <blockflow/core/detail/entry_gate.hpp>
#include <blockflow/core/detail/histogram.hpp>
#include <blockflow/core/detail/never_wait.hpp>
#include <blockflow/core/detail/loss_responder.hpp>
#include <blockflow/core/detail/opaque_layout.hpp>
#include <blockflow/core/detail/request_state.hpp>
#include <blockflow/core/detail/resident_set.hpp>
#include <blockflow/core/detail/routing.hpp>

#include <absl/container/flat_hash_map.h>
#include <blockflow/core/detail/mutex.hpp>

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace blockflow::detail {

struct SiteRuntime;

class SessionCore;


/// A block placed on a GPU this process cannot see is a configuration error (InvalidArgument).
absl::Status check_device(const Block& block);
/// Names the calling thread after a block ("bf-<block>/<index>", cut to 15 characters).
void name_thread(const std::string& block, int index);
/// `status` with its message prefixed ("<prefix>: <message>"), same code.
absl::Status with_prefix(const absl::Status& status, std::string_view prefix);
/// Runs block.forward(), turning exceptions into statuses that name the block. With `layout` (the
/// block's OpaqueLayout side), through forward_layout(): an opaque input is taken as it is, and the
/// output is opaque when `opaque_output`.
absl::StatusOr<Tensors> guarded_forward(Block& block, Tensors&& inputs, OpaqueLayout* layout = nullptr,
                                        bool opaque_output = false);

/// The order in which make_blocks() builds `descriptions` (indices): longest job first, so that no
/// builder is left alone with the largest block at the end. A block's build time grows with its
/// TorchScript file (deserialising, freezing, prepacking its weights): the largest file first; C++
/// blocks and unreadable files (make_block() names their problem) last, in their order.
std::vector<std::size_t> build_order(const std::vector<const BlockDescription*>& descriptions);
/// What a block's load ends with (on-demand blocks): its warm-up runs on zeros of its input shapes,
/// on this thread, then its CUDA graph if it has one.
absl::Status warm_up_loaded(Block& block);

struct PathPlan;
/// Sets PlanNode::keep_layout on the plan's edges that qualify (see there).
void mark_kept_layouts(PathPlan& plan);

/// A block as the session runs it: the block, its input queue, its counters. A block of this
/// process runs on the session's compute lanes (LaneWork: at most BlockOptions::workers lanes at
/// once); a block placed at a remote site has one thread that forwards its queue to the site.
struct BlockRuntime final : LaneWork {
  std::shared_ptr<Block> block;     ///< null for a block placed at a remote site
  OpaqueLayout* layout = nullptr;   ///< the block's, when it can keep oneDNN's layout across an edge
  BlockDescription description;     ///< name, options and placement (set for every block)
  SiteRuntime* site = nullptr;      ///< where it runs when not on this process's lanes
  int resident_id = -1;             ///< its id in the session's ResidentSet when it loads on demand
  SessionCore* core = nullptr;
  std::unique_ptr<InProcessChannel> inbox;
  std::thread forwarder;            ///< site blocks only
  /// Site blocks: requests queued for the forwarder and not yet handed to the site by it (queued,
  /// waiting in the hand-over line, or held while it waits for room). Only while there are none may
  /// a request bypass the queue (RemoteSite::try_run()): it would overtake them.
  std::atomic<std::int64_t> to_forward{0};
  /// Set when the session stops feeding the block (removed, shut down): a forwarder waiting for
  /// room at its site gives its request up (RemoteSite::run_unless()).
  std::atomic<bool> stop_feeding{false};
  Histogram wait, compute, overhead;
  std::atomic<std::uint64_t> processed{0};
  std::atomic<std::uint64_t> failed{0};
  std::atomic<std::uint64_t> batches{0}, batched_requests{0};
  std::atomic<std::uint64_t> layout_kept{0};  ///< outputs handed on in oneDNN's layout
  /// Taken without queueing: by the site (try_run()), or run at once by the lane that ran the
  /// request's previous block (an inline continuation).
  std::atomic<std::uint64_t> handed_directly{0};
  /// Why stop_runtime() closed the queue ("removed by update 3 ..."), for requests that find it closed.
  std::string removed_reason;
  std::atomic<const std::string*> removed_why{nullptr};
  /// When each call into the block now in progress began (BlockMetrics::computing_s).
  blockflow::detail::Mutex computing_mu;
  std::vector<std::int64_t> computing_since ABSL_GUARDED_BY(computing_mu);
  /// Requests a site's thread found no room for (policy block; a block of this process or at a
  /// site), and those delivered behind them while they wait: one posted task at a time queues them,
  /// in order, on a lane
  /// (SessionCore::queue_from_site()), so that a worker's results keep the worker's order.
  blockflow::detail::Mutex handover_mu;
  std::deque<Envelope> handover ABSL_GUARDED_BY(handover_mu);
  bool handover_posted ABSL_GUARDED_BY(handover_mu) = false;

  [[nodiscard]] const std::string& name() const { return description.name; }
  /// Set while a lane gathers a batch for the block (SessionCore::run_block()): that lane takes what
  /// is queued, so no other lane is sent to the block meanwhile (it would take part of the batch).
  std::atomic<bool> gathering{false};

  [[nodiscard]] bool has_work() const override {
    return inbox->depth() > 0 && !inbox->closed() && !gathering.load(std::memory_order_acquire);
  }
  [[nodiscard]] std::size_t backlog() const override { return has_work() ? inbox->depth() : 0; }
  void run_one() override;
};

/// A remote site and the requests the session has handed to it, keyed by (request id, node).
/// Shared, so that a completion a site reports while it is being stopped (from another site's
/// thread) finds it alive or not at all: the site's callback holds it weakly (start_site()).
struct SiteRuntime : std::enable_shared_from_this<SiteRuntime> {
  std::shared_ptr<RemoteSite> site;
  bool stop_when_empty = false;  ///< apply() stops it once it holds no block (factory and deployment sites)
  std::string peer_endpoint;     ///< RemoteSite::peer_endpoint() once started (direct edges)
  std::vector<BlockRuntime*> blocks;
  blockflow::detail::Mutex mu;
  absl::flat_hash_map<std::pair<std::uint64_t, std::uint32_t>, std::pair<std::shared_ptr<RequestState>, BlockRuntime*>>
      in_flight ABSL_GUARDED_BY(mu);
};

/// Per-task counters.
struct PathRuntime {
  std::string task;
  std::atomic<std::uint64_t> submitted{0}, completed{0}, failed{0};
  Histogram e2e, wait, compute, overhead;
  std::atomic<std::int64_t> active_ns{0};  ///< every block on its path loaded (0: not yet)
  EntryGate gate;                          ///< SessionOptions::max_in_flight_per_task
  std::atomic<std::uint64_t> waited_at_entry{0};  ///< requests that waited in the gate
};

class SessionCore {
 public:
  explicit SessionCore(SessionOptions options);
  ~SessionCore();

  void add_block(std::shared_ptr<Block> block);
  void add_block(BlockDescription description);
  void add_site(std::shared_ptr<RemoteSite> site, bool stop_when_empty);
  void add_path(Path path);
  absl::Status start();
  void submit(const std::string& task, Tensors inputs, std::function<void(Result&&)> done);
  MetricsSnapshot metrics() const;
  void set_sampling(bool enabled, absl::Duration period);
  absl::StatusOr<std::uint64_t> apply(const Deployment& wanted, absl::Duration drain);
  void cancel_update();
  bool cancel_update_from(std::thread::id caller);
  bool cancel_update_of(std::optional<std::thread::id> caller);  // nullopt: whoever's
  void set_site_factory(Session::SiteFactoryWithSettings factory);
  void shutdown(absl::Duration drain);
  /// How long shutdown() gives a call into a block of this process that is still running once
  /// the drain is over, before it fails the requests and returns without that call's lane.
  static constexpr absl::Duration kCallGrace = absl::Seconds(1);
  /// After shutdown(): whether every lane has been joined, waiting until `deadline` at most (a
  /// lane still in a call that does not return is not).
  bool lanes_joined(absl::Time deadline);
  bool post_to_lane(std::function<void()> task);
  /// True on a thread apply() and shutdown() would wait for: one of this session's lanes (a block,
  /// a completion callback run there), or any thread inside one of its completion callbacks (a
  /// site's receiving thread, say).
  [[nodiscard]] bool on_own_thread() const;
  /// Whether the calling thread is the one that re-plans after a site loss (SessionOptions::
  /// on_site_lost): it may shut the session down, not free it (that would join that thread).
  [[nodiscard]] bool on_loss_thread() const { return losses_->on_own_thread(); }

 private:
  using StatePtr = std::shared_ptr<RequestState>;

  absl::Status build();
  absl::Status add_runtime(std::unique_ptr<BlockRuntime> runtime);
  std::unique_ptr<BlockRuntime> make_runtime(std::shared_ptr<Block> block);
  // resident_, when blocks of this process load later (on demand, or serving while warming).
  void make_resident_set();
  // A block of this process that loads on demand (SessionOptions::MemoryPolicy::kOnDemand).
  absl::StatusOr<std::unique_ptr<BlockRuntime>> make_on_demand_runtime(const BlockDescription& description);
  // The first load of each on-demand block, one at a time on a lane (so that a block of unknown
  // footprint is measured alone); the last ones loaded stay.
  absl::Status load_on_demand(const std::vector<BlockRuntime*>& runtimes);
  // SessionOptions::serve_while_warming: loads the blocks in `order`, each in a task of its own on
  // the lanes, posted in that order (as many at once as there are lanes); none after shutdown.
  void warm_in_background(const std::vector<BlockRuntime*>& order);
  // Marks active (PathRuntime::active_ns) the tasks of the routing table whose every block has loaded.
  void note_active();
  std::unique_ptr<InProcessChannel> make_inbox(const BlockOptions& options) const;
  // Runs the tasks on the lanes and waits for all (here when on a lane or stopped). `one_thread`:
  // each is one thread's work (an elastic team lane books one core for it).
  void on_lanes(std::vector<std::function<void()>>& tasks, bool team_lanes = false, bool one_thread = false);
  void on_cores(std::vector<std::function<void()>>& tasks, bool one_thread);
  std::vector<absl::StatusOr<std::shared_ptr<Block>>> make_blocks(const std::vector<const BlockDescription*>& descriptions);
  absl::Status warm_up(const std::vector<BlockRuntime*>& runtimes, const RoutingTable& table);
  // Which of a block's warm-up runs a call makes: all; those at one thread (the runs before the last,
  // and the last with one thread when a one-thread lane may run the block); the last with the team's.
  enum class WarmUpRuns { kAll, kEarly, kLast };
  absl::Status warm_up_block(BlockRuntime& runtime, unsigned layouts, WarmUpRuns runs, bool one_thread);
  ComputeLanes::Options lane_options() const;
  bool stop_runtime(BlockRuntime& runtime, const std::string& why, absl::Time deadline = absl::InfiniteFuture());
  // apply(), step by step (lib/core/session_update.cpp).
  struct UpdateWork;
  absl::Status update_diff(UpdateWork& u);
  absl::Status update_load(UpdateWork& u);
  absl::Status update_route(UpdateWork& u);
  absl::Status update_start(UpdateWork& u);
  void update_undo(UpdateWork& u);
  void update_publish(UpdateWork& u);
  void update_drain(UpdateWork& u, absl::Duration drain);
  // What updates removed, freed once no live plan reaches it (lib/core/session_retire.cpp).
  void collect_retired();
  std::vector<std::shared_ptr<const PathPlan>> live_plans();
  bool update_cancelled() const;
  absl::Status at_site(SiteRuntime& site, bool is_new, const std::function<absl::Status()>& step,
                       bool even_if_cancelled = false);
  SiteRuntime* site_named(const std::string& name) const;
  absl::StatusOr<std::shared_ptr<RoutingTable>> compile_table(
      const std::vector<Path>& paths, const std::function<BlockRuntime*(const std::string&)>& lookup,
      std::vector<std::shared_ptr<PathRuntime>>* new_path_runtimes);
  friend struct BlockRuntime;
  // One unit of a block's work on a lane: `first` (an inline continuation) or the next queued
  // request, with what else waits when the block batches.
  void run_block(BlockRuntime& runtime, std::optional<Envelope> first);
  void queue_on_lanes(BlockRuntime& runtime, Envelope&& envelope, const PlanNode& target);
  // From a site's thread, into a block with policy block (of this process, or at a site: counted
  // in its to_forward by the caller): queues the request if there is room and nothing handed over
  // waits, else hands it over to a lane, behind the others.
  void queue_from_site(BlockRuntime& runtime, Envelope&& envelope, const PlanNode& target);
  // Into a site block's queue, the request counted in its to_forward by the caller: the forwarder
  // uncounts what it takes, and what comes back refused or displaced is uncounted here; a request
  // that finds no room before `deadline` comes back still counted (for the hand-over line).
  SendOutcome send_to_site_block(BlockRuntime& runtime, Envelope&& envelope, absl::Time deadline);
  // Queues the block's handed-over requests in order until none is left (a posted task).
  void queue_handed_over(BlockRuntime& runtime);
  // Queues now: helping a full queue on a lane (send_from_lane()), waiting for room elsewhere.
  void queue_now(BlockRuntime& runtime, Envelope&& envelope, const PlanNode& target);
  // On a lane, into a block's full queue (policy block): helps, waits, or queues past the bound
  // (docs/lanes.md, "Full queues"). The outcome as InProcessChannel::send()'s.
  SendOutcome send_from_lane(BlockRuntime& runtime, Envelope&& envelope);
  void process(BlockRuntime& runtime, Envelope&& envelope);
  // SessionOptions::prefetch: posts loads of the on-demand blocks after `node` on `plan`.
  void prefetch_next(const PathPlan& plan, std::uint32_t node);
  // Loads an on-demand block if it is not, and holds it: `compute` is then the loaded block.
  absl::Status hold_resident(BlockRuntime& runtime, ResidentSet::Hold& hold, Block*& compute);
  void process_batch(BlockRuntime& runtime, std::vector<Envelope>&& batch);
  // One group of a batch whose inputs stack, in one forward(); `settled` counts its requests handed
  // on or failed so far (an exception fails the others only).
  void process_group(BlockRuntime& runtime, std::vector<Envelope>&& group, std::size_t& settled);
  void forward_to_site(BlockRuntime& runtime);
  void on_site_completion(SiteRuntime& site, SiteCompletion&& completion);
  absl::Status start_sites();
  absl::Status start_site(SiteRuntime& site);
  static std::vector<BlockDescription> descriptions_of(const SiteRuntime& site);
  void forward_outputs(const StatePtr& state, int node, Tensors&& outputs, BlockRuntime* runtime);
  // forward_outputs() for a request `runtime` has processed; an exception (the next block's site
  // threw, out of memory) fails the request here: "block '<name>': the request could not hand its
  // output on: ...". Never throws.
  void hand_on(BlockRuntime& runtime, const StatePtr& state, int node, Tensors&& outputs) noexcept;
  void deliver(const StatePtr& state, int node, int slot, Tensors&& tensors, std::int64_t ready_ns);
  void run_join(const StatePtr& state, int node, std::vector<Tensors>&& inputs, std::int64_t ready_ns);
  // Fails the request a queue gave back (refused, or displaced by drop-oldest), if any.
  void handle_displaced(SendOutcome&& outcome, const PlanNode& target);
  // Why: the block and the queue's answer.
  absl::Status displaced_why(const absl::Status& status, const PlanNode& target) const;
  // Queues `envelope` for the target node's block, or hands it to the block's site at once.
  void hand_over(const PlanNode& target, Envelope&& envelope);
  bool try_site_now(BlockRuntime& runtime, Envelope& envelope);
  // Memory admission (lib/core/session_memory.cpp). A block's claim on a site: its profiled
  // BlockOptions::memory_bytes; "threads" is this process.
  struct MemoryClaim {
    std::string site;
    std::string block;
    std::int64_t bytes = 0;
  };
  // ResourceExhausted naming the first site whose claims exceed its budget (budget_of: 0, none);
  // on a site that loads on demand (on_demand_of, else loads_on_demand()), the first claim larger
  // than the whole budget.
  absl::Status check_memory(const std::vector<MemoryClaim>& claims,
                            const std::function<std::int64_t(const std::string& site)>& budget_of,
                            const std::function<bool(const std::string& site)>& on_demand_of = nullptr);
  std::int64_t memory_budget_of(const std::string& site) const;
  bool loads_on_demand(const std::string& site) const;  // "threads" or a site's name
  std::vector<MemoryClaim> memory_claims(const UpdateWork& u, bool with_removed = false) const;
  // After start() and apply(): each site's growth against its blocks' profiles, logged when off by
  // more than 20%, kept for metrics().
  void note_memory();
  void note_memory_baseline();  // start(), before its blocks are built
  // The entry (lib/core/session_entry.cpp). enter(): the request (state->path set) takes a place in
  // its task's entry window, or waits there; begin() starts it on `plan` (the task's current plan;
  // `waited`: it waited at the entry, which its trace then shows).
  void enter(const StatePtr& state, std::shared_ptr<const PathPlan> plan, Tensors&& inputs);
  // `handed_on` (if given) is set once the request is on its way (its blocks resolve it).
  void begin(const StatePtr& state, std::shared_ptr<const PathPlan> plan, Tensors&& inputs, bool waited,
             bool* handed_on = nullptr);
  // A waiting request inherited a place in its gate: routes it on the task's plan as it is now (an
  // update may have re-routed or removed the task while it waited) and begins it. `handed_on`: set
  // once it failed or is on its way (an exception after that is not its own).
  void admit(EntryGate::Waiting&& waiting, bool& handed_on);
  // After resolve()'s done(): gives the request's place back; the next waiting request is admitted.
  void leave_entry(const StatePtr& state) noexcept;
  // Marks the place held; false (and the place given back) when the request was resolved first.
  bool take_place(const StatePtr& state);
  // The place `state` held goes to the next request waiting at its task's entry, if any; one that
  // cannot be scheduled (out of memory) fails rather than wait for ever.
  void hand_place_on(const StatePtr& state) noexcept;
  // Admissions run as tasks posted to this session's lanes: never inside a block's unit (the lane
  // holds that block's claim, and the entry block's queue may be full), never on a site's or the
  // application's thread. Inside such a task, after the admissions it is already running (no
  // recursion); inline only once the lanes have stopped (shutdown: every queue is closed then).
  void schedule_admission(EntryGate::Waiting&& waiting);
  void run_admissions(EntryGate::Waiting&& first);
  void fail(const StatePtr& state, absl::Status status);
  // Counts a failure of `runtime` and fails the request: InternalError "block '<name>': <what>".
  void fail_in_block(BlockRuntime& runtime, const StatePtr& state, std::string_view what);
  // From a catch handler: fails a request of `runtime` that could not go on (`what` says why:
  // "could not be queued"), naming the block and the exception, and never throws; with no memory
  // for that message, `short_what` (a literal) instead. The caller counts the failure.
  void fail_noexcept(BlockRuntime& runtime, const StatePtr& state, absl::StatusCode code, const char* what,
                     const char* short_what) noexcept;
  // From a catch handler: fails a request that threw while starting (ResourceExhausted, naming the
  // task and the exception).
  void fail_unstarted(const StatePtr& state) noexcept;
  // Resolves the request once (later calls do nothing): its callback runs, whatever else fails.
  void resolve(const StatePtr& state, absl::Status status, Tensors outputs);
  // resolve()'s trace of the request (the critical path's hops) and the task's figures.
  void trace_result(const RequestState& state, bool ok, Result& result);
  // A completion callback threw: logged (rate-limited), never passed on to the resolving thread.
  static void callback_thrown(std::uint64_t id, const std::string& task, std::string_view what);
  void reject_now(const std::string& task, absl::Status status, const std::function<void(Result&&)>& done);
  std::shared_ptr<const RoutingTable> routing() const;

  const SessionOptions options_;
  std::vector<std::shared_ptr<Block>> pending_blocks_;
  std::vector<BlockDescription> pending_descriptions_;
  KpiSampler sampler_;  // this process's figures, off until set_sampling()
  std::unique_ptr<ComputeLanes> lanes_;  // made and started by start(), stopped by shutdown()
  // Changed by start() and apply() under state_mu_ too; read by metrics() and set_sampling().
  std::vector<std::shared_ptr<SiteRuntime>> sites_;
  // Sites stopped by apply() once their last block went: kept for late references.
  std::vector<std::shared_ptr<SiteRuntime>> retired_sites_;
  blockflow::detail::Mutex factory_mu_;
  Session::SiteFactoryWithSettings site_factory_ ABSL_GUARDED_BY(factory_mu_);
  std::vector<Path> pending_paths_;

  // Changed by start() and apply() (under shutdown_mu_ and state_mu_); read by metrics() under state_mu_.
  mutable blockflow::detail::Mutex state_mu_;
  std::vector<std::unique_ptr<BlockRuntime>> blocks_;
  absl::flat_hash_map<std::string, BlockRuntime*> block_by_name_;
  std::vector<std::shared_ptr<PathRuntime>> paths_;  // shared with the plans (PathPlan::metrics)
  // Blocks removed by apply(): stopped, their Block released, kept while a plan still held by a
  // late request may point at them (collect_retired() frees the others).
  std::vector<std::unique_ptr<BlockRuntime>> retired_;
  // The on-demand blocks of this process (MemoryPolicy::kOnDemand with a budget), made by start().
  // Declared after the runtimes, so destroyed before them.
  std::unique_ptr<ResidentSet> resident_;
  std::atomic<std::uint64_t> version_{0};
  UpdateStats last_update_;  // under state_mu_
  // Every plan published and maybe still held by a request (apply() drains removed blocks by them,
  // collect_retired() frees what none of them reaches). start() and apply() only.
  struct PublishedPlan {
    std::weak_ptr<const PathPlan> plan;
    std::shared_ptr<const std::atomic<bool>> gone;  // PathPlan::gone
    std::vector<const BlockRuntime*> blocks;        // what it reaches, readable once it is gone
  };
  std::vector<PublishedPlan> published_plans_;
  void publish(const RoutingTable& table);  // records its plans in published_plans_

  mutable blockflow::detail::Mutex routing_mu_;
  std::shared_ptr<const RoutingTable> routing_ ABSL_GUARDED_BY(routing_mu_);

  // Live requests, so shutdown can resolve anything no channel still holds.
  mutable blockflow::detail::Mutex live_mu_;
  absl::flat_hash_map<std::uint64_t, std::weak_ptr<RequestState>> live_ ABSL_GUARDED_BY(live_mu_);
  std::atomic<std::int64_t> in_flight_{0};

  std::atomic<std::uint64_t> next_id_{1};
  std::atomic<bool> admitting_{false};
  std::atomic<bool> started_{false};
  std::atomic<bool> stopped_{false};
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;  // shutdown() has run to its end
  std::atomic<std::int64_t> started_ns_{0};  // metrics() may read it while start() writes it
  // Cold start (StartStats): when the process started, start() was called and returned, in now_ns().
  std::atomic<std::int64_t> process_start_ns_{0}, start_called_ns_{0}, start_done_ns_{0};
  // The first request resolved with a result: since start(), and since the last apply() published.
  std::atomic<std::int64_t> first_result_ns_{0}, update_first_result_ns_{0};
  std::int64_t update_called_ns_ = 0;  // under state_mu_: the apply() that made last_update_
  std::int64_t rss_baseline_ = 0;         // this process's RSS before start() built its blocks
  std::vector<SiteMemory> memory_;        // under state_mu_: note_memory()'s last figures
  // Sites lost for good, and SessionOptions::on_site_lost's re-plans (a thread of its own that
  // calls apply()): stopped by shutdown() before it waits for update_mu_.
  std::unique_ptr<LossResponder> losses_;
  // Lock order: shutdown_mu_ (shutdown() only), then update_mu_ (one apply() at a time, and
  // shutdown() once it has cancelled it), then state_mu_ / busy_mu_ / routing_mu_ / live_mu_.
  blockflow::detail::Mutex shutdown_mu_;
  blockflow::detail::Mutex update_mu_;
  // The apply() in progress, for cancel_update(): whether one runs, whether it was cancelled, and
  // the sites it waits on (a new one is stopped to cancel it, a running one asked to cancel).
  mutable blockflow::detail::Mutex busy_mu_;
  bool updating_ ABSL_GUARDED_BY(busy_mu_) = false;
  std::thread::id updating_thread_ ABSL_GUARDED_BY(busy_mu_);  // the thread that called that apply()
  bool cancelled_ ABSL_GUARDED_BY(busy_mu_) = false;
  int cancelling_ ABSL_GUARDED_BY(busy_mu_) = 0;  // cancel_update() calls still reaching sites
  std::vector<std::pair<std::shared_ptr<RemoteSite>, bool>> busy_sites_ ABSL_GUARDED_BY(busy_mu_);  // (site, is new)
};

}  // namespace blockflow::detail
