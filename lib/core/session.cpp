#include <blockflow/core/session.hpp>
#include <blockflow/core/detail/mutex.hpp>
#include <blockflow/deploy/detail/deployment_json.hpp>
#include <blockflow/channel/inproc_channel.hpp>
#include <blockflow/core/detail/build_scope.hpp>
#include <blockflow/core/detail/cuda_graph_block.hpp>
#include <blockflow/core/detail/clock.hpp>
#include <blockflow/core/detail/log.hpp>
#include <blockflow/core/detail/session_core.hpp>
#include <blockflow/core/names.hpp>

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>
#include <c10/core/InferenceMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <pthread.h>

#include <algorithm>
#include <thread>
#include <numeric>
#include <set>
#include <future>
#include <map>

namespace blockflow {
namespace detail {
absl::Status with_prefix(const absl::Status& status, std::string_view prefix) {
  return absl::Status(status.code(), fmt::format("{}: {}", prefix, std::string(status.message())));
}

absl::StatusOr<Tensors> guarded_forward(Block& block, Tensors&& inputs, OpaqueLayout* layout, bool opaque_output) {
  try {
    if (layout == nullptr && is_opaque(inputs)) inputs.front() = inputs.front().to_dense();  // never expected
    auto out = layout != nullptr ? layout->forward_layout(std::move(inputs), opaque_output) : block.forward(std::move(inputs));
    if (!out.ok()) return with_prefix(out.status(), fmt::format("block '{}'", block.name()));
    return out;
  } catch (const c10::Error& e) {
    return absl::InternalError(fmt::format("block '{}': forward raised: {}", block.name(), e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InternalError(fmt::format("block '{}': forward raised: {}", block.name(), e.what()));
  } catch (...) {
    return absl::InternalError(fmt::format("block '{}': forward raised a non-standard exception", block.name()));
  }
}

// A block placed on a GPU this process cannot see is a configuration error, reported at start().
absl::Status check_device(const Block& block) {
  const c10::Device device = block.device();
  if (device.is_cpu()) return absl::OkStatus();
  if (device.is_cuda()) {
    const int count = at::hasCUDA() ? at::detail::getCUDAHooks().getNumGPUs() : 0;
    if (device.index() < count) return absl::OkStatus();
    return absl::InvalidArgumentError(fmt::format("block '{}': device '{}' is not present ({} CUDA device(s) visible)",
                                                  block.name(), device.str(), count));
  }
  return absl::InvalidArgumentError(
      fmt::format("block '{}': device '{}' is not supported (use cpu or cuda:N)", block.name(), device.str()));
}

void name_thread(const std::string& block, int index) {
  std::string name = fmt::format("bf-{}", block).substr(0, 12) + fmt::format("/{}", index % 100);
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
}

SessionCore::SessionCore(SessionOptions options)
    : options_(std::move(options)),
      losses_(std::make_unique<LossResponder>(options_.on_site_lost,
                                              [this](const Deployment& wanted) { return apply(wanted, absl::Seconds(30)); })) {}

SessionCore::~SessionCore() { shutdown(absl::ZeroDuration()); }

void SessionCore::add_block(std::shared_ptr<Block> block) {
  if (started_) throw std::logic_error("Session::add_block() after start()");
  if (!block) throw std::invalid_argument("Session::add_block(): null block");
  if (block->options().cuda_graph && dynamic_cast<detail::CudaGraphBlock*>(block.get()) == nullptr) {
    auto graphed = detail::make_cuda_graph_block(std::move(block));
    if (!graphed.ok()) throw std::invalid_argument(std::string(graphed.status().message()));
    block = *std::move(graphed);
  }
  pending_blocks_.push_back(std::move(block));
}

void SessionCore::add_block(BlockDescription description) {
  if (started_) throw std::logic_error("Session::add_block() after start()");
  pending_descriptions_.push_back(std::move(description));
}

void SessionCore::add_site(std::shared_ptr<RemoteSite> site, bool stop_when_empty) {
  if (started_) throw std::logic_error("Session::add_site() after start()");
  if (!site) throw std::invalid_argument("Session::add_site(): null site");
  // Sites are told apart by name: in placements, and in every metric's labels.
  if (auto status = check_site_name("site", site->name()); !status.ok()) {
    throw std::invalid_argument("Session::add_site(): " + std::string(status.message()));
  }
  for (const auto& other : sites_) {
    if (other->site->name() == site->name()) {
      throw std::invalid_argument(fmt::format("Session::add_site(): a site named '{}' was added already", site->name()));
    }
  }
  auto runtime = std::make_shared<SiteRuntime>();
  runtime->site = std::move(site);
  runtime->stop_when_empty = stop_when_empty;
  sites_.push_back(std::move(runtime));
}

void SessionCore::add_path(Path path) {
  if (started_) throw std::logic_error("Session::add_path() after start()");
  pending_paths_.push_back(std::move(path));
}

// A block's input queue: its bound and full policy, the session's receive spin.
std::unique_ptr<InProcessChannel> SessionCore::make_inbox(const BlockOptions& options) const {
  InProcessChannelOptions channel_options;
  channel_options.capacity = options.queue_capacity;
  channel_options.full_policy = options.full_policy;
  channel_options.receive_spin = options_.receive_spin;
  return std::make_unique<InProcessChannel>(channel_options);
}

absl::Status SessionCore::add_runtime(std::unique_ptr<BlockRuntime> runtime) {
  if (!runtime->inbox) runtime->inbox = make_inbox(runtime->description.options);
  blockflow::detail::MutexLock lock(&state_mu_);
  if (!block_by_name_.emplace(runtime->name(), runtime.get()).second) {
    return absl::InvalidArgumentError(fmt::format("two blocks are named '{}'", runtime->name()));
  }
  blocks_.push_back(std::move(runtime));
  return absl::OkStatus();
}

std::unique_ptr<BlockRuntime> SessionCore::make_runtime(std::shared_ptr<Block> block) {
  auto runtime = std::make_unique<BlockRuntime>();
  runtime->description.name = block->name();
  runtime->description.options = block->options();
  runtime->layout = dynamic_cast<OpaqueLayout*>(block.get());
  runtime->block = std::move(block);
  runtime->inbox = make_inbox(runtime->description.options);
  runtime->core = this;  // it runs on this session's lanes
  runtime->max_lanes = std::max(1, runtime->description.options.workers);
  return runtime;
}

namespace {
// A block on this process's lanes that runs requests one at a time through forward_layout().
bool keeps_layout(const BlockRuntime* runtime) {
  return runtime != nullptr && runtime->block != nullptr && runtime->layout != nullptr &&
         runtime->block->device().is_cpu() && runtime->description.options.max_batch == 1;
}
}  // namespace

// Marks the edges whose tensor may stay in oneDNN's layout (PlanNode::keep_layout): one successor,
// no join, both ends on the lanes, the producer able to give and the consumer to take it.
void mark_kept_layouts(PathPlan& plan) {
  for (std::size_t i = 0; i < plan.nodes.size(); ++i) {
    PlanNode& node = plan.nodes[i];
    if (static_cast<int>(i) == plan.sink || node.successors.size() != 1 || !keeps_layout(node.block)) continue;
    const PlanNode& next = plan.nodes[static_cast<std::size_t>(node.successors.front().node)];
    node.keep_layout = next.join_index < 0 && keeps_layout(next.block) && node.block->layout->gives_opaque() &&
                       next.block->layout->takes_opaque();
  }
}

absl::StatusOr<std::shared_ptr<RoutingTable>> SessionCore::compile_table(
    const std::vector<Path>& paths, const std::function<BlockRuntime*(const std::string&)>& lookup,
    std::vector<std::shared_ptr<PathRuntime>>* new_path_runtimes) {
  auto table = std::make_shared<RoutingTable>();
  const auto channel_of = [](BlockRuntime* runtime) { return runtime->inbox.get(); };
  for (const auto& path : paths) {
    auto plan = compile_path(path, lookup, channel_of);
    if (!plan.ok()) return plan.status();
    if (table->plans.contains(path.task())) {
      return absl::InvalidArgumentError(fmt::format("path '{}': the task has two paths", path.task()));
    }
    // A task keeps its counters across updates.
    std::shared_ptr<PathRuntime> metrics;
    for (const auto& existing : paths_) {
      if (existing->task == path.task()) metrics = existing;
    }
    for (const auto& fresh : *new_path_runtimes) {
      if (fresh->task == path.task()) metrics = fresh;
    }
    if (metrics == nullptr) {
      metrics = std::make_shared<PathRuntime>();
      metrics->task = path.task();
      new_path_runtimes->push_back(metrics);
    }
    auto owned = std::const_pointer_cast<PathPlan>(*plan);
    owned->metrics = metrics;
    mark_kept_layouts(*owned);
    table->plans.emplace(path.task(), std::move(owned));
  }
  return table;
}

absl::Status SessionCore::build() {
  const bool on_demand = options_.memory_policy == SessionOptions::MemoryPolicy::kOnDemand;
  if (on_demand && options_.memory_budget <= 0) {
    return absl::InvalidArgumentError("SessionOptions: memory_policy kOnDemand needs a memory_budget above 0 (bytes)");
  }
  make_resident_set();
  const bool lazy = resident_ != nullptr;
  for (auto& block : pending_blocks_) {
    if (auto status = check_device(*block); !status.ok()) return status;
    if (auto status = add_runtime(make_runtime(block)); !status.ok()) return status;
  }
  std::vector<MemoryClaim> claims;
  for (const auto& block : pending_blocks_) claims.push_back({"", block->name(), block->options().memory_bytes});
  for (const auto& d : pending_descriptions_) claims.push_back({d.placement, d.name, d.options.memory_bytes});
  pending_blocks_.clear();  // their runtimes hold them now: a block an update removes is freed
  if (auto status = check_memory(claims, [this](const std::string& site) { return memory_budget_of(site); }); !status.ok()) {
    return status;
  }
  std::vector<const BlockDescription*> local;
  for (const auto& description : pending_descriptions_) {
    if (!description.placement.empty()) continue;
    if (!lazy) {
      local.push_back(&description);
      continue;
    }
    auto runtime = make_on_demand_runtime(description);  // loaded by start(), after warm_up()
    if (!runtime.ok()) return runtime.status();
    if (auto status = add_runtime(*std::move(runtime)); !status.ok()) return status;
  }
  auto built = make_blocks(local);
  for (std::size_t i = 0; i < local.size(); ++i) {
    const BlockDescription& description = *local[i];
    auto& block = built[i];
    if (!block.ok()) return block.status();
    if (auto status = check_device(**block); !status.ok()) return status;
    auto runtime = make_runtime(*std::move(block));
    runtime->description = description;  // apply() compares descriptions
    if (auto status = add_runtime(std::move(runtime)); !status.ok()) return status;
  }
  for (auto& description : pending_descriptions_) {
    if (description.placement.empty()) continue;
    auto site = std::find_if(sites_.begin(), sites_.end(),
                             [&](const auto& s) { return s->site->name() == description.placement; });
    if (site == sites_.end()) {
      return absl::InvalidArgumentError(fmt::format("block '{}': placement '{}' names no site (add it with add_site())",
                                                    description.name, description.placement));
    }
    auto runtime = std::make_unique<BlockRuntime>();
    runtime->description = description;
    runtime->site = site->get();
    (*site)->blocks.push_back(runtime.get());
    if (auto status = add_runtime(std::move(runtime)); !status.ok()) return status;
  }
  const BlockLookup lookup = [this](const std::string& name) -> BlockRuntime* {
    auto it = block_by_name_.find(name);
    return it == block_by_name_.end() ? nullptr : it->second;
  };
  std::vector<std::shared_ptr<PathRuntime>> path_runtimes;
  auto table = compile_table(pending_paths_, lookup, &path_runtimes);
  if (!table.ok()) return table.status();
  {
    blockflow::detail::MutexLock lock(&state_mu_);
    for (auto& p : path_runtimes) paths_.push_back(std::move(p));
  }
  publish(**table);
  blockflow::detail::MutexLock lock(&routing_mu_);
  routing_ = *std::move(table);
  return absl::OkStatus();
}

absl::Status SessionCore::start() {
  if (started_.exchange(true)) return absl::FailedPreconditionError("Session::start() called twice");
  start_called_ns_ = now_ns();
  process_start_ns_ = start_called_ns_ - static_cast<std::int64_t>(process_age_seconds() * 1e9);
  {
    auto lanes = std::make_unique<ComputeLanes>(lane_options());
    lanes->start();
    blockflow::detail::MutexLock lock(&state_mu_);  // metrics() may look at them from now on
    lanes_ = std::move(lanes);
  }
  note_memory_baseline();
  if (auto status = build(); !status.ok()) {
    stopped_ = true;
    lanes_->stop();
    return status;
  }
  started_ns_ = now_ns();
  if (auto status = start_sites(); !status.ok()) {
    shutdown(absl::ZeroDuration());
    return status;
  }
  std::vector<BlockRuntime*> all;
  for (auto& runtime : blocks_) all.push_back(runtime.get());
  if (auto status = warm_up(all, *routing()); !status.ok()) {
    shutdown(absl::ZeroDuration());
    return status;
  }
  if (options_.serve_while_warming) {
    // The blocks load on a lane after start() returns, task by task in the order of the paths.
    std::vector<BlockRuntime*> order;
    for (const auto& path : pending_paths_) {
      for (const auto& node : path.nodes()) {
        auto it = block_by_name_.find(node.block);
        if (it == block_by_name_.end() || it->second->resident_id < 0) continue;
        if (std::find(order.begin(), order.end(), it->second) == order.end()) order.push_back(it->second);
      }
    }
    note_memory();
    note_active();  // the tasks with nothing to load
    start_done_ns_ = now_ns();
    admitting_ = true;
    warm_in_background(order);
    return absl::OkStatus();
  }
  if (auto status = load_on_demand(all); !status.ok()) {
    shutdown(absl::ZeroDuration());
    return status;
  }
  note_memory();
  note_active();
  start_done_ns_ = now_ns();
  admitting_ = true;
  return absl::OkStatus();
}

// Lanes: one OpenMP team size for the session (SessionOptions::intra_op_threads, else the largest
// of its in-process blocks', else libtorch's default), and as many lanes as the cores hold teams.
ComputeLanes::Options SessionCore::lane_options() const {
  ComputeLanes::Options o;
  o.intra_op_threads = options_.intra_op_threads;
  if (o.intra_op_threads <= 0) {
    o.intra_op_threads = 0;
    for (const auto& block : pending_blocks_) o.intra_op_threads = std::max(o.intra_op_threads, block->options().intra_op_threads);
    for (const auto& d : pending_descriptions_) {
      if (d.placement.empty()) o.intra_op_threads = std::max(o.intra_op_threads, d.options.intra_op_threads);
    }
  }
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  o.lanes = options_.lanes > 0 ? options_.lanes : std::max(1, cores / std::max(1, o.intra_op_threads > 0 ? o.intra_op_threads : cores));
  // Elastic (docs/lanes.md): a one-thread lane for each core the team lanes leave, so that under
  // load every core runs a unit of its own.
  if (options_.lanes == 0 && options_.elastic_lanes && o.intra_op_threads > 1) o.one_thread_lanes = std::max(0, cores - o.lanes);
  o.spin = options_.receive_spin;
  o.poll_first_lane = options_.poll_lane;
  return o;
}

void SessionCore::reject_now(const std::string& task, absl::Status status, const std::function<void(Result&&)>& done) {
  Result result;
  result.status = std::move(status);
  result.trace.task = task;
  result.trace.submitted_ns = result.trace.resolved_ns = now_ns();
  done(std::move(result));
}

std::shared_ptr<const RoutingTable> SessionCore::routing() const {
  blockflow::detail::MutexLock lock(&routing_mu_);
  return routing_;
}

void SessionCore::shutdown(absl::Duration drain) {
  if (on_own_thread()) {
    // It would join the lane (or stop the site) it runs on. Admissions stop; the rest is done by
    // the next shutdown() from another thread, or by the destructor.
    stopped_ = true;
    admitting_ = false;
    cancel_update();
    log(LogLevel::kError,
        "shutdown() was called from a completion callback or a block of this session: admissions are stopped; the "
        "session stops when shutdown() is called from another thread or it is destroyed");
    return;
  }
  stopped_ = true;
  admitting_ = false;
  cancel_update();  // an apply() in progress stops at its next step, a re-plan's included
  // No re-plan starts after this, and the one in progress is over (unless this is its thread):
  // before the lock, as a re-plan may itself call shutdown(). Every shutdown() waits for it, so
  // the destructor's too: nothing of the responder's outlives the session.
  losses_->stop();
  blockflow::detail::MutexLock serial(&shutdown_mu_);
  if (shut_down_) return;  // the lanes left in a call are lanes_joined()'s
  blockflow::detail::MutexLock update(&update_mu_);  // and is over once this is held
  const absl::Time deadline = absl::Now() + drain;
  while (in_flight_.load(std::memory_order_acquire) > 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  for (auto& runtime : blocks_) {
    runtime->stop_feeding.store(true, std::memory_order_release);  // a site that makes no room holds no one
    runtime->inbox->close();
  }
  // A call into a block of this process still running now is given kCallGrace more; one that has not
  // returned by then does not hold the other requests: they all fail below, and shutdown() returns.
  const absl::Time calls_deadline = std::max(deadline, absl::Now()) + kCallGrace;
  for (auto& runtime : blocks_) {
    if (runtime->forwarder.joinable()) runtime->forwarder.join();
    if (runtime->site == nullptr && lanes_) (void)lanes_->quiesce(*runtime, calls_deadline);
  }
  const bool lanes_joined = !lanes_ || lanes_->stop(calls_deadline);  // runs what run_on_lane() still had queued
  for (auto& site : sites_) site->site->stop();  // fails, through completions, what is still inside
  for (auto& runtime : blocks_) {
    for (auto& envelope : runtime->inbox->drain()) {
      runtime->failed.fetch_add(1, std::memory_order_relaxed);
      fail(envelope.local, absl::CancelledError(fmt::format(
                               "block '{}': session shut down while the request waited in its queue",
                               runtime->name())));
    }
  }
  std::vector<StatePtr> leftovers;
  {
    blockflow::detail::MutexLock lock(&live_mu_);
    for (auto& [id, weak] : live_) {
      if (auto state = weak.lock()) leftovers.push_back(std::move(state));
    }
  }
  // Requests still waiting at an entry window are among them: the gates let go of them (a waiting
  // request holds its task's counters, which hold the gate: a cycle).
  for (auto& state : leftovers) (void)state->path->gate.take_all();
  for (auto& state : leftovers) {
    fail(state, absl::CancelledError(
                    fmt::format("task '{}': session shut down while the request was in flight", state->path->task)));
  }
  shut_down_ = true;
  if (!lanes_joined) {
    std::vector<std::string> calling;
    for (const auto* list : {&blocks_, &retired_}) {  // removed by an update, still in its call
      for (const auto& runtime : *list) {
        blockflow::detail::MutexLock lock(&runtime->computing_mu);
        if (!runtime->computing_since.empty()) calling.push_back(fmt::format("'{}'", runtime->name()));
      }
    }
    log(LogLevel::kError,
        fmt::format("shutdown(): {} not returned {} ms after the drain; every request is resolved, and the lane "
                    "running it is joined once it returns (if the Session is destroyed before, {} ms later at most, "
                    "its internals are freed on a thread of their own once it returns)",
                    calling.empty() ? std::string("a run_on_lane() task has")
                                    : fmt::format("a call into block {} has", fmt::join(calling, ", ")),
                    absl::ToInt64Milliseconds(kCallGrace), absl::ToInt64Milliseconds(kCallGrace)));
  }
}

bool SessionCore::lanes_joined(absl::Time deadline) { return !lanes_ || lanes_->stop(deadline); }

}  // namespace detail

Session::Session(SessionOptions options) : core_(std::make_unique<detail::SessionCore>(options)) {}
namespace {

// Sessions whose lane was still in a call when the Session was destroyed, or destroyed on one of
// their own threads: kept here (reachable, and never destroyed at exit, where such a lane may still
// run) until a thread of their own has shut them down and joined their lanes, then freed by it.
struct ParkedCores {
  blockflow::detail::Mutex mu;
  std::vector<std::unique_ptr<detail::SessionCore>> cores ABSL_GUARDED_BY(mu);
};

ParkedCores& parked_cores() {
  static auto* parked = new ParkedCores;
  return *parked;
}

void park(std::unique_ptr<detail::SessionCore> core, bool shut_down) {
  detail::SessionCore* const raw = core.get();
  ParkedCores& parked = parked_cores();
  {
    blockflow::detail::MutexLock lock(&parked.mu);
    parked.cores.push_back(std::move(core));
  }
  try {
    std::thread([raw, shut_down] {
      if (!shut_down) raw->shutdown(absl::ZeroDuration());  // the whole of it: this is not the session's thread
      (void)raw->lanes_joined(absl::InfiniteFuture());
      std::unique_ptr<detail::SessionCore> done;
      {
        ParkedCores& parked = parked_cores();
        blockflow::detail::MutexLock lock(&parked.mu);
        auto it = std::find_if(parked.cores.begin(), parked.cores.end(), [raw](const auto& c) { return c.get() == raw; });
        done = std::move(*it);
        parked.cores.erase(it);
      }
    }).detach();  // `done` is freed on that thread, outside the lock
  } catch (const std::exception& e) {
    detail::log(LogLevel::kError, fmt::format("~Session(): no thread to free the session once its lanes return ({}): "
                                              "it stays in memory", e.what()));
  }
}

}  // namespace

Session::~Session() {
  if (core_->on_own_thread() || core_->on_loss_thread()) {
    // shutdown() here would wait for this very thread: a thread of its own does it once this returns.
    detail::log(LogLevel::kWarning, "~Session() on a thread of the session (a completion callback, a block or "
                                    "SessionOptions::on_site_lost): it is shut down and freed on a thread of its own "
                                    "once that thread is done");
    park(std::move(core_), /*shut_down=*/false);
    return;
  }
  core_->shutdown(absl::ZeroDuration());  // after an explicit one: returns at once
  // A call that has just returned (its lane not yet joined) is waited for, kCallGrace at most.
  if (core_->lanes_joined(absl::Now() + detail::SessionCore::kCallGrace)) return;
  detail::log(LogLevel::kError, "~Session(): a lane is still in a call that has not returned: the session's internals "
                                "(lanes, blocks, counters) are freed on a thread of their own once it returns");
  park(std::move(core_), /*shut_down=*/true);
}

Session& Session::add_block(std::shared_ptr<Block> block) {
  core_->add_block(std::move(block));
  return *this;
}

Session& Session::add_block(BlockDescription description) {
  core_->add_block(std::move(description));
  return *this;
}

Session& Session::add_site(std::shared_ptr<RemoteSite> site, SiteLifetime lifetime) {
  core_->add_site(std::move(site), lifetime == SiteLifetime::kStopWhenEmpty);
  return *this;
}

Session& Session::set_site_factory(SiteFactory factory) {
  core_->set_site_factory(factory ? SiteFactoryWithSettings([factory = std::move(factory)](const SiteSettings& s) {
    if (s.memory_budget != 0 || !s.memory_policy.empty() || !s.memory_measure.empty() || s.lanes != 0) {
      detail::log(LogLevel::kWarning,
                  fmt::format("site '{}': the deployment's settings for it (memory, lanes) are not applied: the site "
                              "factory takes a name only (Session::set_site_factory(SiteFactoryWithSettings) takes "
                              "them; blockflow::worker_options_for())", s.name));
    }
    return factory(s.name);
  }) : SiteFactoryWithSettings());
  return *this;
}

Session& Session::set_site_factory(SiteFactoryWithSettings factory) {
  core_->set_site_factory(std::move(factory));
  return *this;
}

Session& Session::add_path(Path path) {
  core_->add_path(std::move(path));
  return *this;
}

absl::Status Session::start() { return core_->start(); }

std::future<Result> Session::submit(const std::string& task, Tensors inputs) {
  auto promise = std::make_shared<std::promise<Result>>();
  auto future = promise->get_future();
  core_->submit(task, std::move(inputs), [promise](Result&& result) { promise->set_value(std::move(result)); });
  return future;
}

std::future<Result> Session::submit(const std::string& task, Tensor input) {
  return submit(task, Tensors{std::move(input)});
}

void Session::submit(const std::string& task, Tensors inputs, std::function<void(Result&&)> done) {
  if (!done) throw std::invalid_argument("Session::submit(): empty callback");
  core_->submit(task, std::move(inputs), std::move(done));
}

MetricsSnapshot Session::metrics() const { return core_->metrics(); }

absl::StatusOr<std::uint64_t> Session::apply(const Deployment& wanted, absl::Duration drain) {
  return core_->apply(wanted, drain);
}

void Session::set_sampling(bool enabled, absl::Duration period) { core_->set_sampling(enabled, period); }

namespace detail {
void SessionCore::set_sampling(bool enabled, absl::Duration period) {
  sampler_.set(enabled, period);
  blockflow::detail::MutexLock lock(&state_mu_);
  for (const auto& site : sites_) site->site->set_sampling(enabled, period);
}

bool SessionCore::post_to_lane(std::function<void()> task) {
  return admitting_.load() && lanes_ && lanes_->post(std::move(task));
}

void SessionCore::set_site_factory(Session::SiteFactoryWithSettings factory) {
  blockflow::detail::MutexLock lock(&factory_mu_);  // never waits behind an update: apply() copies it at its start
  site_factory_ = std::move(factory);
}
}  // namespace detail

void Session::shutdown(absl::Duration drain) { core_->shutdown(drain); }

void Session::cancel_update() { core_->cancel_update(); }
bool Session::cancel_update_from(std::thread::id caller) { return core_->cancel_update_from(caller); }

bool Session::post_to_lane(std::function<void()> task) { return core_->post_to_lane(std::move(task)); }

}  // namespace blockflow
