// Session::metrics(): the snapshot of the session's counters.
#include <blockflow/core/detail/auth_failures.hpp>
#include <blockflow/core/detail/mutex.hpp>
#include <blockflow/core/detail/clock.hpp>
#include <blockflow/core/detail/cuda_graph_block.hpp>
#include <blockflow/core/detail/session_core.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <map>

namespace blockflow::detail {

MetricsSnapshot SessionCore::metrics() const {
  blockflow::detail::MutexLock lock(&state_mu_);
  MetricsSnapshot snapshot;
  snapshot.version = version_.load();
  snapshot.last_update = last_update_;
  snapshot.replan = losses_->stats();
  const auto ms_between = [](std::int64_t from, std::int64_t to) { return from > 0 && to > from ? ns_to_ms(to - from) : 0.0; };
  snapshot.last_update.time_to_first_result_ms =
      last_update_.version == 0 ? 0.0 : ms_between(update_called_ns_, update_first_result_ns_.load(std::memory_order_relaxed));
  snapshot.start.process_to_start_ms = ms_between(process_start_ns_, start_called_ns_);
  snapshot.start.start_ms = ms_between(start_called_ns_, start_done_ns_);
  snapshot.start.time_to_first_result_ms = ms_between(process_start_ns_, first_result_ns_.load(std::memory_order_relaxed));
  snapshot.retired_blocks = retired_.size();
  snapshot.auth_failures = auth_failure_counter().load(std::memory_order_relaxed);
  const std::int64_t started_ns = started_ns_.load();
  snapshot.uptime_s = started_ns == 0 ? 0.0 : static_cast<double>(now_ns() - started_ns) / 1e9;
  snapshot.in_flight = static_cast<std::uint64_t>(std::max<std::int64_t>(in_flight_.load(), 0));
  const double uptime = std::max(snapshot.uptime_s, 1e-9);
  // An update that replaces a block of the same name keeps the old one in blocks_ until its drain
  // ends: one entry per name (the later, the one requests reach now), or Prometheus would see two
  // series with the same labels and drop one.
  std::map<std::string, const BlockRuntime*> serving;
  for (const auto& runtime : blocks_) serving[runtime->name()] = runtime.get();
  for (const auto& runtime : blocks_) {
    if (serving.at(runtime->name()) != runtime.get()) continue;
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
    b.layout_kept = runtime->layout_kept.load();
    if (runtime->block) {
      if (auto graphs = detail::cuda_graph_stats(*runtime->block)) b.cuda_graph = *graphs;
    }
    {
      MutexLock lock(&runtime->computing_mu);
      const auto& since = runtime->computing_since;
      if (!since.empty()) b.computing_s = static_cast<double>(now_ns() - *std::min_element(since.begin(), since.end())) / 1e9;
    }
    if (runtime->resident_id >= 0) {
      const ResidentSet::BlockState r = resident_->state(runtime->resident_id);
      b.on_demand = options_.memory_policy == SessionOptions::MemoryPolicy::kOnDemand;
      b.resident = r.resident;
      b.footprint_bytes = r.footprint_bytes;
      b.loads = r.loads;
      b.evictions = r.evictions;
      if (r.cuda_graph) b.cuda_graph = *r.cuda_graph;  // the loaded block's, not the on-demand stand-in's
      b.last_use_s = r.last_use_ns > started_ns && started_ns > 0 ? static_cast<double>(r.last_use_ns - started_ns) / 1e9 : 0.0;
    }
    b.wait = runtime->wait.stats();
    b.compute = runtime->compute.stats();
    b.overhead = runtime->overhead.stats();
    b.throughput_per_s = static_cast<double>(b.processed) / uptime;
    b.queue = runtime->inbox->stats();
    // Requests a site took straight away passed through the queue in no time.
    const std::uint64_t direct = runtime->handed_directly.load(std::memory_order_relaxed);
    b.handed_directly = direct;
    b.queue.sent += direct;
    b.queue.received += direct;
    if (direct > 0) b.queue.high_watermark = std::max<std::size_t>(b.queue.high_watermark, 1);
    snapshot.blocks.push_back(std::move(b));
  }
  for (const auto& site : sites_) snapshot.sites.push_back(site->site->stats());
  for (auto& b : snapshot.blocks) {  // a worker's graph counters come with its heartbeats
    for (const auto& site : snapshot.sites) {
      if (site.name != b.placement) continue;
      if (auto it = site.cuda_graphs.find(b.name); it != site.cuda_graphs.end()) b.cuda_graph = it->second;
    }
  }
  if (lanes_) {
    snapshot.lane_intra_op_threads = lanes_->intra_op_threads();
    int index = 0;
    for (const auto& c : lanes_->counters()) {
      LaneMetrics lane;
      lane.index = index++;
      lane.runs = c.runs;
      lane.tasks = c.tasks;
      lane.inline_continuations = c.inline_continuations;
      lane.one_thread_runs = c.one_thread_runs;
      lane.sleeps = c.sleeps;
      lane.threads = c.threads;
      lane.busy_s = static_cast<double>(c.busy_ns) / 1e9;
      lane.utilisation = c.alive_ns > 0 ? static_cast<double>(c.busy_ns) / static_cast<double>(c.alive_ns) : 0.0;
      snapshot.lanes.push_back(lane);
    }
  }
  snapshot.memory = memory_;
  // The live figures of a site that loads on demand.
  const auto on_demand = [&snapshot](const std::string& site, std::int64_t budget) -> SiteMemory& {
    auto it = std::find_if(snapshot.memory.begin(), snapshot.memory.end(), [&](const SiteMemory& m) { return m.site == site; });
    if (it == snapshot.memory.end()) {
      it = snapshot.memory.emplace(snapshot.memory.end());
      it->site = site;
      it->budget_bytes = budget;
    }
    it->policy = "on_demand";
    return *it;
  };
  if (resident_ && options_.memory_policy == SessionOptions::MemoryPolicy::kOnDemand) {
    const ResidentSet::Totals t = resident_->totals();
    SiteMemory& threads = on_demand("threads", t.budget_bytes);
    threads.resident_bytes = t.resident_bytes;
    threads.loads = t.loads;
    threads.evictions = t.evictions;
    threads.bytes_loaded = t.bytes_loaded;
    threads.load_s = t.load_s;
    threads.prefetches = t.prefetches;
    threads.swap_ins = t.swap_ins;
    threads.swapped_bytes = t.swapped_bytes;
    threads.measure = options_.memory_measure == SessionOptions::MemoryMeasure::kProcess ? "process" : "blocks";
    threads.unaccounted_bytes = t.unaccounted_bytes;
  }
  for (std::size_t i = 0; i < sites_.size(); ++i) {
    if (!sites_[i]->site->loads_on_demand()) continue;
    const SiteStats& st = snapshot.sites[i];
    SiteMemory& m = on_demand(st.name, sites_[i]->site->memory_budget());
    m.resident_bytes = st.blocks_resident_bytes;
    m.loads = st.block_loads;
    m.evictions = st.block_evictions;
    m.bytes_loaded = st.block_bytes_loaded;
    m.load_s = st.block_load_s;
    m.swap_ins = st.block_swap_ins;
    m.swapped_bytes = st.swapped_bytes;
    if (!st.memory_measure.empty()) m.measure = st.memory_measure;
    m.unaccounted_bytes = st.unaccounted_bytes;
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
    p.waiting_at_entry = runtime->gate.waiting();
    p.waited_at_entry = runtime->waited_at_entry.load(std::memory_order_relaxed);
    p.active_ms = ms_between(start_called_ns_.load(std::memory_order_relaxed), runtime->active_ns.load(std::memory_order_acquire));
    snapshot.paths.push_back(std::move(p));
  }
  return snapshot;
}

}  // namespace blockflow::detail
