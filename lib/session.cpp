#include <blockflow/session.hpp>
#include <blockflow/detail/mutex.hpp>
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
#include <c10/core/InferenceMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <pthread.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <future>
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

}  // namespace

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
    blockflow::detail::MutexLock lock(&state_mu_);
    for (auto& p : path_runtimes) paths_.push_back(std::move(p));
  }
  for (const auto& [task, plan] : (*table)->plans) published_plans_.push_back(plan);
  blockflow::detail::MutexLock lock(&routing_mu_);
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
  blockflow::detail::BlockingCounter done(static_cast<int>(tasks.size()));
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
    blockflow::detail::MutexLock lock(&live_mu_);
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
  blockflow::detail::MutexLock lock(&routing_mu_);
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
    blockflow::detail::MutexLock lock(&live_mu_);
    live_.emplace(state->id, state);
  }
  for (std::size_t i = 0; i < plan.entries.size(); ++i) {
    const bool last = i + 1 == plan.entries.size();
    deliver(state, plan.entries[i], 0, last ? std::move(inputs) : Tensors(inputs), state->submitted_ns);
  }
}


void SessionCore::shutdown(absl::Duration drain) {
  blockflow::detail::MutexLock serial(&shutdown_mu_);
  stopped_ = true;
  admitting_ = false;
  cancel_update();                      // an apply() in progress stops at its next step
  blockflow::detail::MutexLock update(&update_mu_);  // and is over once this is held
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
    blockflow::detail::MutexLock lock(&live_mu_);
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
  blockflow::detail::MutexLock lock(&state_mu_);
  for (const auto& site : sites_) site->site->set_sampling(enabled, period);
}

bool SessionCore::post_to_lane(std::function<void()> task) {
  return admitting_.load() && lanes_ && lanes_->post(std::move(task));
}

void SessionCore::set_site_factory(Session::SiteFactory factory) {
  blockflow::detail::MutexLock lock(&factory_mu_);  // never waits behind an update: apply() copies it at its start
  site_factory_ = std::move(factory);
}
}  // namespace detail

void Session::shutdown(absl::Duration drain) { core_->shutdown(drain); }

void Session::cancel_update() { core_->cancel_update(); }

bool Session::post_to_lane(std::function<void()> task) { return core_->post_to_lane(std::move(task)); }

}  // namespace blockflow
