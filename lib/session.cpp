#include <blockflow/session.hpp>
#include <blockflow/detail/deployment_json.hpp>
#include <blockflow/inproc_channel.hpp>
#include <blockflow/detail/build_scope.hpp>
#include <blockflow/detail/clock.hpp>
#include <blockflow/detail/session_core.hpp>

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>
#include <absl/synchronization/blocking_counter.h>
#include <c10/core/InferenceMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <pthread.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <future>
#include <iostream>
#include <map>

namespace blockflow {
namespace detail {
namespace {

absl::Status with_prefix(const absl::Status& status, std::string_view prefix) {
  return absl::Status(status.code(), fmt::format("{}: {}", prefix, std::string(status.message())));
}

// Runs forward(), turning exceptions into statuses that name the block.
absl::StatusOr<Tensors> guarded_forward(Block& block, Tensors&& inputs) {
  try {
    auto out = block.forward(std::move(inputs));
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

}  // namespace

SessionCore::~SessionCore() { shutdown(absl::ZeroDuration()); }

void SessionCore::add_block(std::shared_ptr<Block> block) {
  if (started_) throw std::logic_error("Session::add_block() after start()");
  if (!block) throw std::invalid_argument("Session::add_block(): null block");
  pending_blocks_.push_back(std::move(block));
}

void SessionCore::add_block(BlockDescription description) {
  if (started_) throw std::logic_error("Session::add_block() after start()");
  pending_descriptions_.push_back(std::move(description));
}

void SessionCore::add_site(std::shared_ptr<RemoteSite> site, bool stop_when_empty) {
  if (started_) throw std::logic_error("Session::add_site() after start()");
  if (!site) throw std::invalid_argument("Session::add_site(): null site");
  auto runtime = std::make_unique<SiteRuntime>();
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
  absl::MutexLock lock(&state_mu_);
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
  runtime->block = std::move(block);
  runtime->inbox = make_inbox(runtime->description.options);
  runtime->core = this;  // it runs on this session's lanes
  runtime->max_lanes = std::max(1, runtime->description.options.workers);
  return runtime;
}

absl::StatusOr<std::shared_ptr<RoutingTable>> SessionCore::compile_table(
    const std::vector<Path>& paths, const std::function<BlockRuntime*(const std::string&)>& lookup,
    std::vector<std::unique_ptr<PathRuntime>>* new_path_runtimes) {
  auto table = std::make_shared<RoutingTable>();
  const auto channel_of = [](BlockRuntime* runtime) { return runtime->inbox.get(); };
  for (const auto& path : paths) {
    auto plan = compile_path(path, lookup, channel_of);
    if (!plan.ok()) return plan.status();
    if (table->plans.contains(path.task())) {
      return absl::InvalidArgumentError(fmt::format("path '{}': the task has two paths", path.task()));
    }
    // A task keeps its counters across updates.
    PathRuntime* metrics = nullptr;
    for (const auto& existing : paths_) {
      if (existing->task == path.task()) metrics = existing.get();
    }
    for (const auto& fresh : *new_path_runtimes) {
      if (fresh->task == path.task()) metrics = fresh.get();
    }
    if (metrics == nullptr) {
      auto runtime = std::make_unique<PathRuntime>();
      runtime->task = path.task();
      metrics = runtime.get();
      new_path_runtimes->push_back(std::move(runtime));
    }
    auto owned = std::const_pointer_cast<PathPlan>(*plan);
    owned->metrics = metrics;
    table->plans.emplace(path.task(), std::move(owned));
  }
  return table;
}

absl::Status SessionCore::build() {
  for (auto& block : pending_blocks_) {
    if (auto status = check_device(*block); !status.ok()) return status;
    if (auto status = add_runtime(make_runtime(block)); !status.ok()) return status;
  }
  std::vector<const BlockDescription*> local;
  for (const auto& description : pending_descriptions_) {
    if (description.placement.empty()) local.push_back(&description);
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
  std::vector<std::unique_ptr<PathRuntime>> path_runtimes;
  auto table = compile_table(pending_paths_, lookup, &path_runtimes);
  if (!table.ok()) return table.status();
  {
    absl::MutexLock lock(&state_mu_);
    for (auto& p : path_runtimes) paths_.push_back(std::move(p));
  }
  for (const auto& [task, plan] : (*table)->plans) published_plans_.push_back(plan);
  absl::MutexLock lock(&routing_mu_);
  routing_ = *std::move(table);
  return absl::OkStatus();
}

absl::Status SessionCore::start() {
  if (started_.exchange(true)) return absl::FailedPreconditionError("Session::start() called twice");
  lanes_ = std::make_unique<ComputeLanes>(lane_options());
  lanes_->start();
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
  if (auto status = warm_up(all); !status.ok()) {
    shutdown(absl::ZeroDuration());
    return status;
  }
  admitting_ = true;
  return absl::OkStatus();
}

std::vector<BlockDescription> SessionCore::descriptions_of(const SiteRuntime& site) {
  std::vector<BlockDescription> out;
  for (const auto* runtime : site.blocks) out.push_back(runtime->description);
  return out;
}

absl::Status SessionCore::start_site(SiteRuntime& site) {
  SiteRuntime* raw = &site;
  auto status = site.site->start(descriptions_of(site),
                                 [this, raw](SiteCompletion&& c) { on_site_completion(*raw, std::move(c)); });
  if (status.ok()) site.peer_endpoint = site.site->peer_endpoint();
  return status;
}

namespace {

// Direct edges: node `node` runs at a site that may keep its outputs, because every next node is a
// single-input block at a site reachable from it (RemoteSite::peer_endpoint()).
bool outputs_may_stay(const PathPlan& plan, std::uint32_t node) {
  const PlanNode& n = plan.nodes[node];
  if (n.block == nullptr || n.block->site == nullptr || n.block->site->peer_endpoint.empty() || n.successors.empty()) {
    return false;
  }
  for (const PlanEdge& e : n.successors) {
    const PlanNode& next = plan.nodes[static_cast<std::size_t>(e.node)];
    if (next.join_index >= 0 || next.block == nullptr || next.block->site == nullptr ||
        next.block->site->peer_endpoint.empty()) {
      return false;
    }
  }
  return true;
}

}  // namespace

absl::Status SessionCore::start_sites() {
  for (auto& site : sites_) {
    if (auto status = start_site(*site); !status.ok()) return status;
  }
  for (auto& runtime : blocks_) {
    if (runtime->site != nullptr) runtime->forwarder = std::thread([this, rt = runtime.get()] { forward_to_site(*rt); });
  }
  return absl::OkStatus();
}

void SessionCore::forward_to_site(BlockRuntime& runtime) {
  name_thread(runtime.name(), 0);
  while (auto envelope = runtime.inbox->receive(absl::InfiniteFuture())) {
    const std::int64_t dequeued = now_ns();
    StatePtr state = std::move(envelope->local);
    if (state->resolved.load(std::memory_order_acquire)) continue;
    HopTiming& hop = state->hops[envelope->node];
    hop.arrived_ns = envelope->sent_ns;
    hop.dequeued_ns = dequeued;  // provisional: on completion it also absorbs the site's queueing
    {
      absl::MutexLock lock(&runtime.site->mu);
      runtime.site->in_flight[{envelope->request_id, envelope->node}] = {state, &runtime};
    }
    envelope->outputs_may_stay = outputs_may_stay(*state->plan, envelope->node);
    runtime.site->site->run(runtime.name(), std::move(*envelope));
  }
}

void SessionCore::on_site_completion(SiteRuntime& site, SiteCompletion&& c) {
  const std::int64_t received = now_ns();
  std::pair<StatePtr, BlockRuntime*> entry;
  {
    absl::MutexLock lock(&site.mu);
    auto it = site.in_flight.find({c.request_id, c.node});
    if (it == site.in_flight.end()) return;  // already reported (exactly once)
    entry = std::move(it->second);
    site.in_flight.erase(it);
  }
  auto& [state, runtime] = entry;
  if (!c.outputs.ok()) {
    runtime->failed.fetch_add(1, std::memory_order_relaxed);
    return fail(state, c.outputs.status());
  }
  HopTiming& hop = state->hops[c.node];
  // Same host, same steady clock: wait = our queue + the site's queue; the transfers are overhead.
  const std::int64_t start = c.compute_start_ns != 0 ? c.compute_start_ns : received;
  const std::int64_t end = c.compute_end_ns != 0 ? c.compute_end_ns : received;
  hop.dequeued_ns = std::min(hop.dequeued_ns + c.wait_ns, start);
  hop.compute_start_ns = start;
  hop.compute_end_ns = end;
  runtime->processed.fetch_add(1, std::memory_order_relaxed);
  forward_outputs(state, static_cast<int>(c.node), *std::move(c.outputs), runtime);
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
  o.spin = options_.receive_spin;
  return o;
}

absl::Status SessionCore::warm_up_block(BlockRuntime& runtime) {
  c10::InferenceMode inference_mode;
  Block& block = *runtime.block;
  const auto& options = block.options();
  Tensors zeros;
  for (auto shape : options.input_shapes) {
    for (auto& d : shape) d = d < 0 ? 1 : d;
    zeros.push_back(at::zeros(shape, at::TensorOptions().device(block.device())));
  }
  for (int run = 0; run < options.warmup_runs; ++run) {
    auto out = guarded_forward(block, Tensors(zeros));
    if (!out.ok()) return with_prefix(out.status(), "warm-up failed");
  }
  return absl::OkStatus();
}

// Runs the tasks on the lanes, in parallel across them, and waits for all. On a lane already
// (apply() from a completion callback), or with the lanes stopped, they run here instead.
void SessionCore::on_lanes(std::vector<std::function<void()>>& tasks) {
  if (tasks.empty()) return;
  absl::BlockingCounter done(static_cast<int>(tasks.size()));
  for (auto& task : tasks) {
    auto counted = [&task, &done] {
      task();
      done.DecrementCount();
    };
    if (!lanes_ || lanes_->current_lane() >= 0 || !lanes_->post(counted)) counted();
  }
  done.Wait();
}

// Blocks of this process are built where they will run, on the lanes: libtorch's graph passes and
// weight prepacking use the lane's OpenMP team, and the caller's thread makes none of its own.
std::vector<absl::StatusOr<std::shared_ptr<Block>>> SessionCore::make_blocks(const std::vector<const BlockDescription*>& descriptions) {
  std::vector<absl::StatusOr<std::shared_ptr<Block>>> out(descriptions.size(), absl::UnknownError("not built"));
  std::vector<std::function<void()>> tasks;
  for (std::size_t i = 0; i < descriptions.size(); ++i) {
    tasks.emplace_back([&out, &descriptions, i] {
      const auto scope = enter_build_scope();
      out[i] = make_block(*descriptions[i]);
    });
  }
  on_lanes(tasks);
  return out;
}

// Each new in-process block with input shapes warms up on a lane, as its requests will run, the
// blocks in parallel across lanes. Sites warm theirs up themselves.
absl::Status SessionCore::warm_up(const std::vector<BlockRuntime*>& runtimes) {
  std::vector<BlockRuntime*> todo;
  for (auto* runtime : runtimes) {
    if (runtime->block && !runtime->block->options().input_shapes.empty()) todo.push_back(runtime);
  }
  std::vector<absl::Status> statuses(todo.size());
  std::vector<std::function<void()>> tasks;
  for (std::size_t i = 0; i < todo.size(); ++i) {
    tasks.emplace_back([this, &statuses, &todo, i] {
      const auto scope = enter_build_scope();
      statuses[i] = warm_up_block(*todo[i]);
    });
  }
  on_lanes(tasks);
  for (const auto& status : statuses) {
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

void BlockRuntime::run_one() { core->run_block(*this, std::nullopt); }

void SessionCore::run_block(BlockRuntime& runtime, std::optional<Envelope> first) {
  if (!first) first = runtime.inbox->try_receive();
  if (!first) return;  // another lane took it
  c10::InferenceMode inference_mode;
  Block& block = *runtime.block;
  const auto& options = block.options();
  if (options.max_batch > 1) {
    // Take what else waits, up to max_batch. Wait for more (until max_batch_delay_ms after the first
    // arrived) only while no other block has work ready: a lane never idles on a short batch while
    // work it could run waits (with one lane, the next block's inputs come from this very lane).
    std::vector<Envelope> batch;
    const std::int64_t deadline_ns = first->sent_ns + static_cast<std::int64_t>(options.max_batch_delay_ms * 1e6);
    batch.push_back(std::move(*first));
    while (static_cast<int>(batch.size()) < options.max_batch) {
      if (auto more = runtime.inbox->try_receive()) {
        batch.push_back(std::move(*more));
        continue;
      }
      const std::int64_t left = deadline_ns - now_ns();
      if (left <= 0 || lanes_->pending() > 0) break;
      // In slices, so that work arriving for another block ends the wait.
      auto more = runtime.inbox->receive(absl::Now() + absl::Nanoseconds(std::min<std::int64_t>(left, 200'000)));
      if (more) batch.push_back(std::move(*more));
    }
    if (batch.size() > 1) {
      std::vector<StatePtr> states;
      for (const auto& e : batch) states.push_back(e.local);
      try {
        process_batch(runtime, std::move(batch));
      } catch (const std::exception& e) {
        for (auto& state : states) {
          runtime.failed.fetch_add(1, std::memory_order_relaxed);
          fail(state, absl::InternalError(fmt::format("block '{}': {}", block.name(), e.what())));
        }
      }
      return;
    }
    first = std::move(batch.front());
  }
  StatePtr state = first->local;
  try {
    process(runtime, std::move(*first));
  } catch (const std::exception& e) {
    // Nothing may escape a lane: the request fails, the lane keeps serving.
    runtime.failed.fetch_add(1, std::memory_order_relaxed);
    fail(state, absl::InternalError(fmt::format("block '{}': {}", block.name(), e.what())));
  }
}

// Runs compatible requests of a batch in one forward(): inputs stacked along dimension 0, outputs
// split back by each request's rows. Requests that fit with no other run alone.
void SessionCore::process_batch(BlockRuntime& runtime, std::vector<Envelope>&& batch) {
  Block& block = *runtime.block;
  // Requests agree when their inputs have the same count, dtypes, devices and sizes past dim 0.
  auto key = [](const Tensors& inputs) {
    std::string k = std::to_string(inputs.size());
    for (const auto& t : inputs) {
      if (!t.defined() || t.dim() == 0) return std::string();  // nothing to stack along
      k += fmt::format("|{}|{}", c10::toString(t.scalar_type()), t.device().str());
      for (std::int64_t d = 1; d < t.dim(); ++d) k += fmt::format(",{}", t.size(d));
    }
    return k;
  };
  std::vector<std::pair<std::string, std::vector<Envelope>>> groups;
  for (auto& envelope : batch) {
    const bool live = !envelope.local->resolved.load(std::memory_order_acquire) &&
                      check_inputs(block, envelope.tensors).ok();
    const std::string k = live ? key(envelope.tensors) : std::string();
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return !k.empty() && g.first == k; });
    if (it == groups.end()) {
      groups.emplace_back(k, std::vector<Envelope>{});
      it = std::prev(groups.end());
    }
    it->second.push_back(std::move(envelope));
  }
  for (auto& [k, group] : groups) {
    if (group.size() == 1 || k.empty()) {
      for (auto& envelope : group) process(runtime, std::move(envelope));
      continue;
    }
    const std::int64_t dequeued = now_ns();
    const std::size_t inputs_per_request = group.front().tensors.size();
    std::vector<std::int64_t> rows;
    Tensors stacked;
    for (std::size_t i = 0; i < inputs_per_request; ++i) {
      std::vector<at::Tensor> parts;
      for (const auto& envelope : group) parts.push_back(envelope.tensors[i]);
      stacked.push_back(at::cat(parts, 0).to(block.device()));
    }
    for (const auto& envelope : group) rows.push_back(envelope.tensors.front().size(0));
    const std::int64_t total = std::accumulate(rows.begin(), rows.end(), std::int64_t{0});
    const std::int64_t start = now_ns();
    absl::StatusOr<Tensors> outputs = guarded_forward(block, std::move(stacked));
    const std::int64_t end = now_ns();
    if (outputs.ok()) {
      for (const auto& t : *outputs) {
        if (!t.defined() || t.dim() == 0 || t.size(0) != total) {
          outputs = absl::InternalError(fmt::format(
              "block '{}': a batched output has {} rows for {} input rows; this block cannot batch (set max_batch 1)",
              block.name(), t.defined() && t.dim() > 0 ? t.size(0) : 0, total));
          break;
        }
      }
    }
    runtime.batches.fetch_add(1, std::memory_order_relaxed);
    runtime.batched_requests.fetch_add(group.size(), std::memory_order_relaxed);
    std::int64_t offset = 0;
    for (std::size_t r = 0; r < group.size(); ++r) {
      Envelope& envelope = group[r];
      StatePtr state = std::move(envelope.local);
      const int node = static_cast<int>(envelope.node);
      HopTiming& hop = state->hops[static_cast<std::size_t>(node)];
      hop.arrived_ns = envelope.sent_ns;
      hop.dequeued_ns = std::max(dequeued, envelope.sent_ns);  // waiting for the batch is waiting
      hop.compute_start_ns = start;
      hop.compute_end_ns = end;
      if (!outputs.ok()) {
        runtime.failed.fetch_add(1, std::memory_order_relaxed);
        fail(state, outputs.status());
        continue;
      }
      Tensors mine;
      for (const auto& t : *outputs) mine.push_back(t.narrow(0, offset, rows[r]));
      offset += rows[r];
      runtime.processed.fetch_add(1, std::memory_order_relaxed);
      forward_outputs(state, node, std::move(mine), &runtime);
    }
  }
}

void SessionCore::process(BlockRuntime& runtime, Envelope&& envelope) {
  const std::int64_t dequeued = now_ns();
  StatePtr state = std::move(envelope.local);
  if (state->resolved.load(std::memory_order_acquire)) return;  // a sibling branch failed it already
  const int node = static_cast<int>(envelope.node);
  HopTiming& hop = state->hops[static_cast<std::size_t>(node)];
  hop.arrived_ns = envelope.sent_ns;
  hop.dequeued_ns = dequeued;
  Block& block = *runtime.block;

  Tensors inputs = std::move(envelope.tensors);
  absl::Status status = check_inputs(block, inputs);
  if (status.ok()) {
    for (auto& t : inputs) {
      if (t.defined() && t.device() != block.device()) t = t.to(block.device());
    }
  }
  hop.compute_start_ns = now_ns();
  absl::StatusOr<Tensors> outputs = status.ok() ? guarded_forward(block, std::move(inputs)) : status;
  hop.compute_end_ns = now_ns();
  if (!outputs.ok()) {
    runtime.failed.fetch_add(1, std::memory_order_relaxed);
    fail(state, outputs.status());
    return;
  }
  runtime.processed.fetch_add(1, std::memory_order_relaxed);
  forward_outputs(state, node, std::move(*outputs), &runtime);
}

void SessionCore::forward_outputs(const StatePtr& state, int node, Tensors&& outputs, BlockRuntime* runtime) {
  const PathPlan& plan = *state->plan;
  HopTiming& hop = state->hops[static_cast<std::size_t>(node)];
  hop.done_ns = now_ns();
  if (runtime != nullptr) {
    // Recorded before the hand-off, so a caller woken by the result sees this hop counted.
    runtime->wait.record(hop.dequeued_ns - hop.arrived_ns);
    runtime->compute.record(hop.compute_end_ns - hop.compute_start_ns);
    runtime->overhead.record((hop.arrived_ns - hop.input_ready_ns) + (hop.compute_start_ns - hop.dequeued_ns) +
                             (hop.done_ns - hop.compute_end_ns));
  }
  if (node == plan.sink) return resolve(state, absl::OkStatus(), std::move(outputs));
  const auto& successors = plan.nodes[static_cast<std::size_t>(node)].successors;
  const std::int64_t ready = hop.done_ns;
  for (std::size_t i = 0; i < successors.size(); ++i) {
    const bool last = i + 1 == successors.size();
    deliver(state, successors[i].node, successors[i].slot, last ? std::move(outputs) : Tensors(outputs), ready);
  }
}

void SessionCore::deliver(const StatePtr& state, int node, int slot, Tensors&& tensors, std::int64_t ready_ns) {
  const PlanNode& target = state->plan->nodes[static_cast<std::size_t>(node)];
  if (target.join_index >= 0) {
    JoinState& join = state->joins[static_cast<std::size_t>(target.join_index)];
    join.inputs[static_cast<std::size_t>(slot)] = std::move(tensors);
    join.ready_ns[static_cast<std::size_t>(slot)] = ready_ns;
    if (join.remaining.fetch_sub(1, std::memory_order_acq_rel) != 1) return;  // siblings still running
    const auto last = std::max_element(join.ready_ns.begin(), join.ready_ns.end());
    const auto last_slot = static_cast<std::size_t>(last - join.ready_ns.begin());
    state->critical_pred[static_cast<std::size_t>(node)] = target.inputs[last_slot];
    run_join(state, node, std::move(join.inputs), *last);
    return;
  }
  state->critical_pred[static_cast<std::size_t>(node)] = target.inputs.empty() ? -1 : target.inputs.front();
  state->hops[static_cast<std::size_t>(node)].input_ready_ns = ready_ns;
  hand_over(target, Envelope{state->id, static_cast<std::uint32_t>(node), std::move(tensors), 0, state});
}

void SessionCore::hand_over(const PlanNode& target, Envelope&& envelope) {
  BlockRuntime* runtime = target.block;
  if (runtime->site != nullptr) {
    // A block at a site with nothing queued before this request: the site may take it from this
    // thread, sparing the forwarding thread's wake-up (RemoteSite::try_run()).
    if (runtime->inbox->depth() == 0 && try_site_now(*runtime, envelope)) return;
    return handle_displaced(runtime->inbox->send(std::move(envelope)), target);
  }
  // Run to completion: on a lane, a block with nothing queued before this request runs next on
  // this same lane, once the current block is done (no queue, no wake-up, warm caches).
  if (runtime->inbox->depth() == 0 && !runtime->inbox->closed() && lanes_->claim_next(*runtime)) {
    envelope.sent_ns = now_ns();
    runtime->handed_directly.fetch_add(1, std::memory_order_relaxed);
    lanes_->run_next([this, runtime, e = std::move(envelope)]() mutable { run_block(*runtime, std::move(e)); });
    return;
  }
  queue_on_lanes(*runtime, std::move(envelope), target);
}

void SessionCore::queue_on_lanes(BlockRuntime& runtime, Envelope&& envelope, const PlanNode& target) {
  // A lane must not sleep on a full queue (with one lane nobody would empty it): it runs the full
  // block's requests itself until there is room. Nested helping is bounded; beyond, it waits.
  thread_local int helping = 0;
  constexpr int kMaxHelpDepth = 8;
  if (lanes_->current_lane() >= 0 && runtime.inbox->full_policy() == FullPolicy::kBlock && helping < kMaxHelpDepth) {
    for (;;) {
      SendOutcome outcome = runtime.inbox->send(std::move(envelope), absl::Now() + absl::Milliseconds(1));
      if (!absl::IsDeadlineExceeded(outcome.status)) {
        lanes_->notify(runtime);
        return handle_displaced(std::move(outcome), target);
      }
      envelope = std::move(*outcome.displaced);
      ++helping;
      (void)lanes_->help(runtime);
      --helping;
    }
  }
  SendOutcome outcome = runtime.inbox->send(std::move(envelope));
  lanes_->notify(runtime);
  handle_displaced(std::move(outcome), target);
}

bool SessionCore::try_site_now(BlockRuntime& runtime, Envelope& envelope) {
  StatePtr state = envelope.local;
  if (state->resolved.load(std::memory_order_acquire)) return true;  // failed meanwhile: nothing to run
  const std::pair<std::uint64_t, std::uint32_t> key{envelope.request_id, envelope.node};
  HopTiming& hop = state->hops[envelope.node];
  hop.arrived_ns = hop.dequeued_ns = now_ns();
  {
    absl::MutexLock lock(&runtime.site->mu);
    runtime.site->in_flight[key] = {state, &runtime};
  }
  envelope.outputs_may_stay = outputs_may_stay(*state->plan, envelope.node);
  if (runtime.site->site->try_run(runtime.name(), envelope)) {
    runtime.handed_directly.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  absl::MutexLock lock(&runtime.site->mu);
  runtime.site->in_flight.erase(key);
  return false;
}

void SessionCore::run_join(const StatePtr& state, int node, std::vector<Tensors>&& inputs, std::int64_t ready_ns) {
  const PlanNode& target = state->plan->nodes[static_cast<std::size_t>(node)];
  HopTiming& hop = state->hops[static_cast<std::size_t>(node)];
  hop.input_ready_ns = ready_ns;
  if (target.block != nullptr) {
    // A block with several inputs: merge, then queue like any other hop (the merge is overhead).
    auto merged = target.combine.apply(std::move(inputs));
    if (!merged.ok()) {
      return fail(state, with_prefix(merged.status(), fmt::format("path '{}', inputs of block '{}'",
                                                                  state->plan->task, target.name)));
    }
    return hand_over(target, Envelope{state->id, static_cast<std::uint32_t>(node), std::move(*merged), 0, state});
  }
  // A block-less join runs the combine rule inline; it counts as the node's compute.
  hop.arrived_ns = hop.dequeued_ns = hop.compute_start_ns = now_ns();
  auto merged = target.combine.apply(std::move(inputs));
  hop.compute_end_ns = now_ns();
  if (!merged.ok()) {
    return fail(state, with_prefix(merged.status(), fmt::format("path '{}', join '{}'", state->plan->task, target.name)));
  }
  forward_outputs(state, node, std::move(*merged), nullptr);
}

void SessionCore::handle_displaced(SendOutcome&& outcome, const PlanNode& target) {
  if (!outcome.displaced) return;
  StatePtr victim = std::move(outcome.displaced->local);
  const std::string& block = target.block->name();
  absl::Status why;
  if (outcome.status.ok()) {
    why = absl::ResourceExhaustedError(fmt::format("block '{}': dropped from its full input queue (policy drop-oldest)", block));
  } else if (absl::IsCancelled(outcome.status)) {
    const std::string* removed = target.block->removed_why.load(std::memory_order_acquire);
    why = absl::CancelledError(stopped_.load() ? fmt::format("block '{}': session shut down before the request reached it", block)
                               : removed != nullptr ? fmt::format("block '{}': {}", block, *removed)
                                                    : fmt::format("block '{}': removed by an update before the request reached it", block));
  } else {
    why = with_prefix(outcome.status, fmt::format("block '{}': input", block));
  }
  target.block->failed.fetch_add(1, std::memory_order_relaxed);
  fail(victim, why);
}

void SessionCore::fail(const StatePtr& state, absl::Status status) { resolve(state, std::move(status), {}); }

void SessionCore::resolve(const StatePtr& state, absl::Status status, Tensors outputs) {
  if (state->resolved.exchange(true, std::memory_order_acq_rel)) return;
  Result result;
  result.trace.request_id = state->id;
  result.trace.task = state->plan->task;
  result.trace.submitted_ns = state->submitted_ns;
  result.trace.resolved_ns = now_ns();
  PathRuntime& path = *state->plan->metrics;
  if (status.ok()) {
    // Walk the critical path back from the sink.
    for (int node = state->plan->sink; node >= 0; node = state->critical_pred[static_cast<std::size_t>(node)]) {
      HopTiming hop = state->hops[static_cast<std::size_t>(node)];
      hop.node = state->plan->nodes[static_cast<std::size_t>(node)].name;
      const auto* block = state->plan->nodes[static_cast<std::size_t>(node)].block;
      if (block != nullptr) hop.block = block->name();
      result.trace.hops.push_back(std::move(hop));
    }
    std::reverse(result.trace.hops.begin(), result.trace.hops.end());
    // The last hop ends when the request resolves: its resolution cost is overhead too.
    result.trace.hops.back().done_ns = result.trace.resolved_ns;
    result.outputs = std::move(outputs);
    path.completed.fetch_add(1, std::memory_order_relaxed);
    auto ms_to_ns = [](double ms) { return static_cast<std::int64_t>(ms * 1e6); };
    path.e2e.record(result.trace.resolved_ns - result.trace.submitted_ns);
    path.wait.record(ms_to_ns(result.trace.wait_ms()));
    path.compute.record(ms_to_ns(result.trace.compute_ms()));
    path.overhead.record(ms_to_ns(result.trace.overhead_ms()));
  } else {
    path.failed.fetch_add(1, std::memory_order_relaxed);
  }
  result.status = std::move(status);
  {
    absl::MutexLock lock(&live_mu_);
    live_.erase(state->id);
  }
  auto done = std::move(state->done);
  in_flight_.fetch_sub(1, std::memory_order_acq_rel);  // before done(): its caller may read metrics
  done(std::move(result));
}

void SessionCore::reject_now(const std::string& task, absl::Status status, const std::function<void(Result&&)>& done) {
  Result result;
  result.status = std::move(status);
  result.trace.task = task;
  result.trace.submitted_ns = result.trace.resolved_ns = now_ns();
  done(std::move(result));
}

std::shared_ptr<const RoutingTable> SessionCore::routing() const {
  absl::MutexLock lock(&routing_mu_);
  return routing_;
}

void SessionCore::submit(const std::string& task, Tensors inputs, std::function<void(Result&&)> done) {
  in_flight_.fetch_add(1, std::memory_order_acq_rel);  // before the check: shutdown waits on it
  if (!admitting_.load(std::memory_order_acquire)) {
    in_flight_.fetch_sub(1, std::memory_order_acq_rel);
    return reject_now(task, absl::FailedPreconditionError(
                                stopped_ ? "session is shut down" : "session is not started (call start() first)"),
                      done);
  }
  auto table = routing();
  auto it = table->plans.find(task);
  if (it == table->plans.end()) {
    in_flight_.fetch_sub(1, std::memory_order_acq_rel);
    std::vector<std::string> known;
    for (const auto& [name, plan] : table->plans) known.push_back(name);
    std::sort(known.begin(), known.end());
    return reject_now(task, absl::NotFoundError(fmt::format("unknown task '{}' (known: {})", task, fmt::join(known, ", "))),
                      done);
  }
  auto state = std::make_shared<RequestState>();
  state->id = next_id_.fetch_add(1, std::memory_order_relaxed);
  state->plan = it->second;
  const PathPlan& plan = *state->plan;
  state->submitted_ns = now_ns();
  state->hops.resize(plan.nodes.size());
  state->critical_pred.assign(plan.nodes.size(), -1);
  if (plan.num_joins > 0) {
    state->joins = std::make_unique<JoinState[]>(static_cast<std::size_t>(plan.num_joins));
    for (const auto& node : plan.nodes) {
      if (node.join_index < 0) continue;
      JoinState& join = state->joins[static_cast<std::size_t>(node.join_index)];
      join.remaining.store(static_cast<int>(node.inputs.size()), std::memory_order_relaxed);
      join.inputs.resize(node.inputs.size());
      join.ready_ns.resize(node.inputs.size());
    }
  }
  state->done = std::move(done);
  plan.metrics->submitted.fetch_add(1, std::memory_order_relaxed);
  {
    absl::MutexLock lock(&live_mu_);
    live_.emplace(state->id, state);
  }
  for (std::size_t i = 0; i < plan.entries.size(); ++i) {
    const bool last = i + 1 == plan.entries.size();
    deliver(state, plan.entries[i], 0, last ? std::move(inputs) : Tensors(inputs), state->submitted_ns);
  }
}

MetricsSnapshot SessionCore::metrics() const {
  absl::MutexLock lock(&state_mu_);
  MetricsSnapshot snapshot;
  snapshot.version = version_.load();
  snapshot.last_update = last_update_;
  snapshot.uptime_s = started_ns_ == 0 ? 0.0 : static_cast<double>(now_ns() - started_ns_) / 1e9;
  snapshot.in_flight = static_cast<std::uint64_t>(std::max<std::int64_t>(in_flight_.load(), 0));
  const double uptime = std::max(snapshot.uptime_s, 1e-9);
  for (const auto& runtime : blocks_) {
    BlockMetrics b;
    const BlockOptions& options = runtime->description.options;
    b.name = runtime->name();
    b.kind = runtime->block ? std::string(runtime->block->kind())
                            : (runtime->description.torchscript.empty() ? "factory" : "torchscript");
    b.device = options.device;
    b.placement = runtime->site ? runtime->site->site->name() : "threads";
    b.workers = options.workers;
    b.intra_op_threads = options.intra_op_threads;
    b.processed = runtime->processed.load();
    b.failed = runtime->failed.load();
    b.batches = runtime->batches.load();
    b.batched_requests = runtime->batched_requests.load();
    b.wait = runtime->wait.stats();
    b.compute = runtime->compute.stats();
    b.overhead = runtime->overhead.stats();
    b.throughput_per_s = static_cast<double>(b.processed) / uptime;
    b.queue = runtime->inbox->stats();
    // Requests a site took straight away passed through the queue in no time.
    const std::uint64_t direct = runtime->handed_directly.load(std::memory_order_relaxed);
    b.queue.sent += direct;
    b.queue.received += direct;
    if (direct > 0) b.queue.high_watermark = std::max<std::size_t>(b.queue.high_watermark, 1);
    snapshot.blocks.push_back(std::move(b));
  }
  for (const auto& site : sites_) snapshot.sites.push_back(site->site->stats());
  if (lanes_) {
    snapshot.lane_intra_op_threads = lanes_->intra_op_threads();
    int index = 0;
    for (const auto& c : lanes_->counters()) {
      LaneMetrics lane;
      lane.index = index++;
      lane.runs = c.runs;
      lane.tasks = c.tasks;
      lane.inline_continuations = c.inline_continuations;
      lane.busy_s = static_cast<double>(c.busy_ns) / 1e9;
      lane.utilisation = c.alive_ns > 0 ? static_cast<double>(c.busy_ns) / static_cast<double>(c.alive_ns) : 0.0;
      snapshot.lanes.push_back(lane);
    }
  }
  snapshot.sampling = sampler_.enabled();
  snapshot.sampling_period_s = absl::ToDoubleSeconds(sampler_.period());
  if (snapshot.sampling) snapshot.host = sampler_.latest();
  const auto table = routing();
  for (const auto& runtime : paths_) {
    PathMetrics p;
    p.task = runtime->task;
    p.active = table && table->plans.contains(runtime->task);
    p.submitted = runtime->submitted.load();
    p.completed = runtime->completed.load();
    p.failed = runtime->failed.load();
    p.e2e = runtime->e2e.stats();
    p.wait = runtime->wait.stats();
    p.compute = runtime->compute.stats();
    p.overhead = runtime->overhead.stats();
    p.throughput_per_s = static_cast<double>(p.completed) / uptime;
    snapshot.paths.push_back(std::move(p));
  }
  return snapshot;
}

// Closes a block's queue, joins its threads and fails what was still queued, naming `why`.
void SessionCore::stop_runtime(BlockRuntime& runtime, const std::string& why) {
  runtime.removed_reason = why;  // before close(): whoever finds the queue closed reads it
  runtime.removed_why.store(&runtime.removed_reason, std::memory_order_release);
  runtime.inbox->close();
  if (runtime.forwarder.joinable()) runtime.forwarder.join();
  if (runtime.site == nullptr && lanes_) lanes_->quiesce(runtime);
  for (auto& envelope : runtime.inbox->drain()) {
    runtime.failed.fetch_add(1, std::memory_order_relaxed);
    fail(envelope.local, absl::CancelledError(fmt::format("block '{}': {}", runtime.name(), why)));
  }
}

absl::StatusOr<std::uint64_t> SessionCore::apply(const Deployment& wanted, absl::Duration drain) {
  absl::MutexLock serial(&shutdown_mu_);
  if (!admitting_.load() || stopped_.load()) {
    return absl::FailedPreconditionError("update: the session is not running (start() it first; not after shutdown())");
  }
  const std::uint64_t version = version_.load() + 1;
  const std::int64_t t_begin = now_ns();
  auto ms_since = [](std::int64_t t) { return static_cast<double>(now_ns() - t) / 1e6; };
  UpdateStats timing;
  timing.version = version;
  auto invalid = [&](const std::string& what) {
    return absl::InvalidArgumentError(fmt::format("update {} rejected, nothing changed: {}", version, what));
  };
  // 1. What stays, what comes, what goes.
  const std::set<std::string> bare(wanted.bare_names.begin(), wanted.bare_names.end());
  std::set<std::string> wanted_names;
  std::vector<BlockDescription> added;
  std::vector<BlockRuntime*> removed;
  for (const auto& d : wanted.blocks) {
    wanted_names.insert(d.name);
    auto it = block_by_name_.find(d.name);
    if (it != block_by_name_.end()) {
      const BlockRuntime& current = *it->second;
      const bool same = bare.count(d.name) != 0 ||
                        (current.description.torchscript == d.torchscript && current.description.factory == d.factory &&
                         block_to_json(current.description) == block_to_json(d));
      if (same) continue;
      removed.push_back(it->second);  // replaced
    }
    added.push_back(d);
  }
  for (const auto& runtime : blocks_) {
    if (wanted_names.count(runtime->name()) == 0) removed.push_back(runtime.get());
  }
  auto site_named = [&](const std::string& name) -> SiteRuntime* {
    for (const auto& site : sites_) {
      if (site->site->name() == name) return site.get();
    }
    return nullptr;
  };
  for (const auto& d : added) {
    if (d.placement.empty()) continue;
    auto current = block_by_name_.find(d.name);
    if (current != block_by_name_.end() && current->second->site != nullptr &&
        current->second->site->site->name() == d.placement) {
      return invalid(fmt::format("block '{}' in site '{}': changing a block in place inside the same site is not "
                                 "supported; give the new version another name or another placement",
                                 d.name, d.placement));
    }
    if (site_named(d.placement) == nullptr && !site_factory_) {
      return invalid(fmt::format("block '{}': placement '{}' names no site, and the session has no site factory to "
                                 "start one (add_deployment() installs one for worker processes)", d.name, d.placement));
    }
  }
  const std::int64_t t_load = now_ns();
  // 2. Build and load the new blocks of this process (nothing is routed to them yet); describe the
  // ones going to sites, making the sites the session lacks.
  std::vector<std::unique_ptr<BlockRuntime>> fresh;
  std::vector<std::unique_ptr<SiteRuntime>> new_sites;
  std::map<const BlockDescription*, absl::StatusOr<std::shared_ptr<Block>>> built;
  {
    std::vector<const BlockDescription*> local;
    for (const auto& d : added) {
      if (d.placement.empty()) local.push_back(&d);
    }
    auto blocks = make_blocks(local);  // in parallel, on the lanes
    for (std::size_t i = 0; i < local.size(); ++i) built.emplace(local[i], std::move(blocks[i]));
  }
  for (const auto& d : added) {
    if (!d.placement.empty()) {
      SiteRuntime* site = site_named(d.placement);
      for (const auto& made : new_sites) {
        if (made->site->name() == d.placement) site = made.get();
      }
      if (site == nullptr) {
        auto made = std::make_unique<SiteRuntime>();
        made->site = site_factory_(d.placement);
        made->stop_when_empty = true;
        if (!made->site) return invalid(fmt::format("block '{}': the site factory made no site '{}'", d.name, d.placement));
        site = made.get();
        new_sites.push_back(std::move(made));
      }
      auto runtime = std::make_unique<BlockRuntime>();
      runtime->description = d;
      runtime->site = site;
      runtime->inbox = make_inbox(d.options);
      fresh.push_back(std::move(runtime));
      continue;
    }
    auto& block = built.at(&d);
    if (!block.ok()) return invalid(std::string(block.status().message()));
    if (auto status = check_device(**block); !status.ok()) return invalid(std::string(status.message()));
    fresh.push_back(make_runtime(*std::move(block)));
    fresh.back()->description = d;
  }
  timing.load_ms = ms_since(t_load);  // this process's blocks built; sites and warm-up follow in 4
  const std::int64_t t_route = now_ns();
  // 3. The new routing table, against the blocks that stay and the new ones.
  absl::flat_hash_map<std::string, BlockRuntime*> next_by_name;
  for (const auto& runtime : blocks_) {
    if (std::find(removed.begin(), removed.end(), runtime.get()) == removed.end()) next_by_name[runtime->name()] = runtime.get();
  }
  for (const auto& runtime : fresh) next_by_name[runtime->name()] = runtime.get();
  std::vector<std::unique_ptr<PathRuntime>> new_paths;
  auto table = compile_table(wanted.paths(), [&](const std::string& name) -> BlockRuntime* {
    auto it = next_by_name.find(name);
    return it == next_by_name.end() ? nullptr : it->second;
  }, &new_paths);
  if (!table.ok()) return invalid(std::string(table.status().message()));
  timing.route_ms = ms_since(t_route);
  const std::int64_t t_warm = now_ns();
  // 4. Start and warm the new blocks up: this process's, then the sites' (new sites start with
  // theirs; running sites load theirs next to what they have).
  std::vector<BlockRuntime*> starting;
  for (auto& runtime : fresh) {
    if (runtime->site == nullptr) starting.push_back(runtime.get());
  }
  if (auto status = warm_up(starting); !status.ok()) {
    for (auto* runtime : starting) stop_runtime(*runtime, "update rejected");
    return invalid(std::string(status.message()));
  }
  std::vector<std::pair<SiteRuntime*, std::vector<BlockDescription>>> grown;  // running sites, their blocks before
  auto undo_sites = [&] {
    for (auto& site : new_sites) site->site->stop();
    for (auto& [site, before] : grown) {
      if (auto status = site->site->update(before); !status.ok()) {
        std::cerr << fmt::format("blockflow: update {} rejected; site '{}' could not unload what it loaded: {}\n",
                                 version, site->site->name(), std::string(status.message()));
      }
    }
    for (auto* runtime : starting) stop_runtime(*runtime, "update rejected");
  };
  {
    std::map<SiteRuntime*, std::vector<BlockRuntime*>> incoming;
    for (auto& runtime : fresh) {
      if (runtime->site != nullptr) incoming[runtime->site].push_back(runtime.get());
    }
    for (auto& [site, runtimes] : incoming) {
      const bool is_new = std::any_of(new_sites.begin(), new_sites.end(), [&](const auto& n) { return n.get() == site; });
      const auto before = descriptions_of(*site);
      auto after = before;
      for (const auto* runtime : runtimes) after.push_back(runtime->description);
      if (is_new) site->blocks = runtimes;
      const absl::Status status = is_new ? start_site(*site) : site->site->update(after);
      if (!status.ok()) {
        if (is_new) site->blocks.clear();
        // A worker that did not answer may load them yet; one that died restarts with its old list.
        else if (absl::IsDeadlineExceeded(status)) grown.emplace_back(site, before);
        undo_sites();
        // InvalidArgument for what could not be loaded (a new site that fails to start included);
        // a running worker that died or did not answer keeps its code (Unavailable, DeadlineExceeded).
        const bool invalid_update = is_new || absl::IsInvalidArgument(status);
        return absl::Status(invalid_update ? absl::StatusCode::kInvalidArgument : status.code(),
                            fmt::format("update {} rejected, nothing changed: {}", version, std::string(status.message())));
      }
      if (!is_new) grown.emplace_back(site, before);
    }
    for (auto& [site, runtimes] : incoming) {
      const bool is_new = std::any_of(new_sites.begin(), new_sites.end(), [&](const auto& n) { return n.get() == site; });
      if (!is_new) site->blocks.insert(site->blocks.end(), runtimes.begin(), runtimes.end());
      for (auto* runtime : runtimes) runtime->forwarder = std::thread([this, runtime] { forward_to_site(*runtime); });
    }
  }
  timing.load_ms += ms_since(t_warm);
  const std::int64_t t_publish = now_ns();
  timing.blocks_added = static_cast<std::uint32_t>(fresh.size());
  timing.blocks_removed = static_cast<std::uint32_t>(removed.size());
  timing.sites_started = static_cast<std::uint32_t>(new_sites.size());
  // 5. Publish: blocks, then the routing table, at once for every task.
  {
    absl::MutexLock lock(&state_mu_);
    for (auto& runtime : fresh) blocks_.push_back(std::move(runtime));
    for (auto& site : new_sites) {
      // set_sampling() holds state_mu_ too: a new site gets the setting of the moment.
      if (sampler_.enabled()) site->site->set_sampling(true, sampler_.period());
      sites_.push_back(std::move(site));
    }
    for (auto& p : new_paths) paths_.push_back(std::move(p));
    block_by_name_ = next_by_name;
    version_.store(version);
    timing.total_ms = ms_since(t_begin);
    last_update_ = timing;  // drain figures follow once it is done
  }
  for (const auto& [task, plan] : (*table)->plans) published_plans_.push_back(plan);
  std::shared_ptr<const RoutingTable> old;
  {
    absl::MutexLock lock(&routing_mu_);
    old = std::exchange(routing_, *std::move(table));
  }
  timing.route_ms += ms_since(t_publish);
  const std::int64_t t_drain = now_ns();
  // 6. Drain what is going: wait until no request holds a plan through a removed block, from the
  // table just replaced or from any earlier one.
  std::vector<std::shared_ptr<const PathPlan>> through_removed;
  for (auto it = published_plans_.begin(); it != published_plans_.end();) {
    auto plan = it->lock();
    if (!plan) {
      it = published_plans_.erase(it);
      continue;
    }
    ++it;
    for (const auto& node : plan->nodes) {
      if (std::find(removed.begin(), removed.end(), node.block) != removed.end()) {
        through_removed.push_back(plan);
        break;
      }
    }
  }
  // A submit() that read the old table just before the swap still holds it: wait for that too.
  const std::weak_ptr<const RoutingTable> old_table = old;
  old.reset();
  const absl::Time deadline = absl::Now() + drain;
  auto held = [&] {
    return !old_table.expired() ||
           std::any_of(through_removed.begin(), through_removed.end(), [](const auto& p) { return p.use_count() > 1; });
  };
  while (held() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  std::set<SiteRuntime*> shrinking;
  for (auto* runtime : removed) {
    stop_runtime(*runtime, fmt::format("removed by update {} before the request reached it", version));
    runtime->block.reset();  // its model's memory goes now; the runtime stays for late plans
    if (runtime->site != nullptr) {
      auto& list = runtime->site->blocks;
      list.erase(std::remove(list.begin(), list.end(), runtime), list.end());
      shrinking.insert(runtime->site);
    }
  }
  // Sites unload what was removed; a factory's or deployment's site left without blocks stops (its
  // process exits), one the user added stays, idle.
  std::vector<SiteRuntime*> emptied;
  for (auto* site : shrinking) {
    if (site->blocks.empty() && site->stop_when_empty) {
      site->site->stop();
      emptied.push_back(site);
    } else if (auto status = site->site->update(descriptions_of(*site)); !status.ok()) {
      // Drained and unrouted already: the site just keeps the model loaded.
      std::cerr << fmt::format("blockflow: update {}: site '{}' could not unload removed blocks: {}\n", version,
                               site->site->name(), std::string(status.message()));
    }
  }
  timing.sites_stopped = static_cast<std::uint32_t>(emptied.size());
  std::vector<std::shared_ptr<RemoteSite>> released_sites;  // destroyed outside state_mu_
  timing.drain_ms = ms_since(t_drain);
  timing.total_ms = ms_since(t_begin);
  {
    absl::MutexLock lock(&state_mu_);
    last_update_ = timing;
    for (auto it = sites_.begin(); it != sites_.end();) {
      if (std::find(emptied.begin(), emptied.end(), it->get()) != emptied.end()) {
        released_sites.push_back(std::move((*it)->site));  // stopped: no callback can come any more
        retired_sites_.push_back(std::move(*it));
        it = sites_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = blocks_.begin(); it != blocks_.end();) {
      if (std::find(removed.begin(), removed.end(), it->get()) != removed.end()) {
        retired_.push_back(std::move(*it));
        it = blocks_.erase(it);
      } else {
        ++it;
      }
    }
  }
  return version;
}

void SessionCore::shutdown(absl::Duration drain) {
  absl::MutexLock serial(&shutdown_mu_);
  stopped_ = true;
  admitting_ = false;
  const absl::Time deadline = absl::Now() + drain;
  while (in_flight_.load(std::memory_order_acquire) > 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  for (auto& runtime : blocks_) runtime->inbox->close();
  for (auto& runtime : blocks_) {
    if (runtime->forwarder.joinable()) runtime->forwarder.join();
    if (runtime->site == nullptr && lanes_) lanes_->quiesce(*runtime);
  }
  if (lanes_) lanes_->stop();  // runs what run_on_lane() still had queued
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
    absl::MutexLock lock(&live_mu_);
    for (auto& [id, weak] : live_) {
      if (auto state = weak.lock()) leftovers.push_back(std::move(state));
    }
  }
  for (auto& state : leftovers) fail(state, absl::CancelledError("session shut down while the request was in flight"));
}

}  // namespace detail

Session::Session(SessionOptions options) : core_(std::make_unique<detail::SessionCore>(options)) {}
Session::~Session() = default;

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
  absl::MutexLock lock(&state_mu_);
  for (const auto& site : sites_) site->site->set_sampling(enabled, period);
}

bool SessionCore::post_to_lane(std::function<void()> task) {
  return admitting_.load() && lanes_ && lanes_->post(std::move(task));
}

void SessionCore::set_site_factory(Session::SiteFactory factory) {
  absl::MutexLock serial(&shutdown_mu_);
  site_factory_ = std::move(factory);
}
}  // namespace detail

void Session::shutdown(absl::Duration drain) { core_->shutdown(drain); }

bool Session::post_to_lane(std::function<void()> task) { return core_->post_to_lane(std::move(task)); }

}  // namespace blockflow
