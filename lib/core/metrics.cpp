#include <blockflow/core/metrics.hpp>
#include <blockflow/core/detail/auth_failures.hpp>
#include <blockflow/core/detail/utf8_text.hpp>
#include <blockflow/observe/detail/metrics_json.hpp>

#include <fmt/format.h>

#include <map>
#include <sstream>

namespace blockflow {

std::string MetricsSnapshot::to_json(int indent) const {
  const nlohmann::json json = *this;
  return detail::dump_json(json, indent);
}

absl::StatusOr<MetricsSnapshot> MetricsSnapshot::from_json(const std::string& text) {
  const auto json = nlohmann::json::parse(text, nullptr, false);
  if (json.is_discarded()) return absl::InvalidArgumentError("metrics snapshot: not JSON");
  if (!json.is_object()) return absl::InvalidArgumentError("metrics snapshot: not a JSON object");
  try {
    return json.get<MetricsSnapshot>();
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(fmt::format("metrics snapshot: {}", e.what()));
  }
}

namespace {

// Prometheus text format 0.0.4: every family's HELP and TYPE once, then its samples together.
class Exposition {
 public:
  using Labels = std::vector<std::pair<std::string, std::string>>;

  void add(const std::string& name, const char* type, const char* help, const Labels& labels, double value) {
    auto [it, fresh] = families_.try_emplace(name);
    if (fresh) {
      order_.push_back(name);
      it->second = fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
    }
    it->second += fmt::format("{}{} {}\n", name, render(labels), number(value));
  }

  // A latency distribution in milliseconds as a summary in seconds: quantiles (NaN with no sample, as
  // Prometheus' clients write them; since the block or path was made, not over a window), _sum, _count.
  void summary(const std::string& name, const char* help, const Labels& labels, const LatencyStats& s) {
    auto [it, fresh] = families_.try_emplace(name);
    if (fresh) {
      order_.push_back(name);
      it->second = fmt::format("# HELP {} {}\n# TYPE {} summary\n", name, help, name);
    }
    for (const auto& [q, ms] : {std::pair{"0.5", s.p50_ms}, std::pair{"0.9", s.p90_ms}, std::pair{"0.99", s.p99_ms}}) {
      Labels with = labels;
      with.emplace_back("quantile", q);
      it->second += fmt::format("{}{} {}\n", name, render(with), s.count == 0 ? std::string("NaN") : number(ms / 1e3));
    }
    it->second += fmt::format("{}_sum{} {}\n", name, render(labels), number(s.sum_ms / 1e3));
    it->second += fmt::format("{}_count{} {}\n", name, render(labels), s.count);
  }

  std::string str() const {
    std::string out;
    for (const auto& name : order_) out += families_.at(name);
    return out;
  }

 private:
  static std::string escape(const std::string& value) {
    const std::string v = detail::utf8_or_replaced(value);  // Prometheus refuses a whole scrape for one bad label
    std::string out;
    for (char c : v) {
      if (c == '\\' || c == '"') out += '\\';
      if (c == '\n') {
        out += "\\n";
        continue;
      }
      out += c;
    }
    return out;
  }
  static std::string render(const Labels& labels) {
    if (labels.empty()) return "";
    std::string out = "{";
    for (std::size_t i = 0; i < labels.size(); ++i) {
      out += fmt::format("{}{}=\"{}\"", i == 0 ? "" : ",", labels[i].first, escape(labels[i].second));
    }
    return out + "}";
  }
  static std::string number(double v) { return fmt::format("{}", v); }

  std::map<std::string, std::string> families_;
  std::vector<std::string> order_;
};

// The process figures of one process ("host" or a worker's name), and its GPUs.
void add_process(Exposition& e, const std::string& process, const KpiSample& k) {
  if (k.time_s <= 0) return;  // not sampled (sampling off)
  const Exposition::Labels l = {{"process", process}};
  e.add("blockflow_process_resident_memory_bytes", "gauge", "Resident memory of the process.", l,
        static_cast<double>(k.process.rss_bytes));
  e.add("blockflow_process_cpu_seconds_total", "counter", "User and system CPU time of the process.", l, k.process.cpu_seconds);
  e.add("blockflow_process_cpu_utilisation_ratio", "gauge",
        "Cores kept busy by the process over the last sampling period (1 = one core).", l, k.process.cpu_utilisation);
  e.add("blockflow_process_threads", "gauge", "Threads of the process.", l, static_cast<double>(k.process.threads));
  for (const auto& [kind, n] : {std::pair{"voluntary", k.process.voluntary_context_switches},
                                std::pair{"involuntary", k.process.involuntary_context_switches}}) {
    e.add("blockflow_process_context_switches_total", "counter", "Context switches of the process, by kind.",
          {{"process", process}, {"kind", kind}}, static_cast<double>(n));
  }
  e.add("blockflow_gpu_available", "gauge", "1 when NVML reports GPUs to this process, 0 otherwise (see the JSON's gpu_status).",
        l, k.gpus.empty() ? 0 : 1);
  for (const auto& g : k.gpus) {
    const Exposition::Labels d = {{"process", process}, {"device", std::to_string(g.index)}, {"model", g.name}};
    e.add("blockflow_gpu_memory_used_bytes", "gauge", "Device memory in use (all processes).", d,
          static_cast<double>(g.memory_used_bytes));
    e.add("blockflow_gpu_memory_total_bytes", "gauge", "Device memory.", d, static_cast<double>(g.memory_total_bytes));
    e.add("blockflow_gpu_utilisation_ratio", "gauge", "Fraction of the last NVML interval the device was busy.", d, g.utilisation);
    e.add("blockflow_gpu_sm_clock_hertz", "gauge", "SM clock.", d, g.sm_clock_mhz * 1e6);
    e.add("blockflow_gpu_temperature_celsius", "gauge", "Device temperature.", d, g.temperature_c);
    e.add("blockflow_gpu_power_watts", "gauge", "Device power draw.", d, g.power_w);
    e.add("blockflow_gpu_process_memory_bytes", "gauge", "This process's memory on the device, as NVML counts it.", d,
          static_cast<double>(g.process_memory_bytes));
  }
  for (const auto& t : k.torch_cuda) {
    const Exposition::Labels d = {{"process", process}, {"device", "cuda:" + std::to_string(t.device)}};
    e.add("blockflow_torch_cuda_allocated_bytes", "gauge", "Bytes held by live tensors (libtorch CUDA caching allocator).",
          d, static_cast<double>(t.allocated_bytes));
    e.add("blockflow_torch_cuda_reserved_bytes", "gauge", "Bytes reserved by libtorch's CUDA caching allocator.", d,
          static_cast<double>(t.reserved_bytes));
    e.add("blockflow_torch_cuda_peak_allocated_bytes", "gauge", "High watermark of allocated bytes.", d,
          static_cast<double>(t.peak_allocated_bytes));
  }
  if (!k.gpus.empty()) {
    e.add("blockflow_gpu_energy_joules_total", "counter", "GPU energy integrated from power readings since sampling began.",
          l, k.energy_j);
  }
}

void add_shm(Exposition& e, const std::string& worker, const char* direction, const ShmEdgeStats& s,
             const char* memory = "host") {
  const Exposition::Labels l = {{"worker", worker}, {"direction", direction}, {"memory", memory}};
  e.add("blockflow_shm_handles_total", "counter", "Tensors handed over as shared-memory handles.", l, static_cast<double>(s.handles));
  e.add("blockflow_shm_slots_in_use", "gauge", "Shared-memory slots leased and not yet released.", l,
        static_cast<double>(s.slots_in_use));
  e.add("blockflow_shm_slots", "gauge", "Shared-memory slots in the producer's pools.", l, static_cast<double>(s.slots_total));
  e.add("blockflow_shm_credit_waits_total", "counter", "Times the producer found no free slot at first.", l,
        static_cast<double>(s.credit_waits));
  e.add("blockflow_shm_reclaims_total", "counter", "Slots taken back from a consumer that died.", l,
        static_cast<double>(s.reclaims));
  e.add("blockflow_shm_staged_bytes_total", "counter", "Bytes the producer copied into its slots (its one copy).", l,
        static_cast<double>(s.bytes_staged));
  e.add("blockflow_shm_mapped_bytes", "gauge", "Size of the producer's shared-memory pools.", l,
        static_cast<double>(s.bytes_mapped));
  e.add("blockflow_shm_pools_trimmed_total", "counter", "Shared-memory pools removed after idling.", l,
        static_cast<double>(s.pools_trimmed));
  e.add("blockflow_shm_pools_created_total", "counter", "Shared-memory pools made (the first of each size class included).", l,
        static_cast<double>(s.pools_created));
}

}  // namespace

std::string MetricsSnapshot::to_prometheus() const {
  Exposition e;
  e.add("blockflow_uptime_seconds", "gauge", "Seconds since the session started.", {}, uptime_s);
  e.add("blockflow_in_flight_requests", "gauge", "Requests submitted and not yet resolved.", {}, static_cast<double>(in_flight));
  e.add("blockflow_deployment_version", "gauge", "Deployment version: 0 at start, +1 per applied update.", {},
        static_cast<double>(version));
  e.add("blockflow_retired_blocks", "gauge", "Blocks removed by updates, kept while a request in flight may reach them.",
        {}, static_cast<double>(retired_blocks));
  e.add("blockflow_sites_lost_total", "counter", "Sites lost for good (a worker that died after its last restart).", {},
        static_cast<double>(replan.losses));
  for (const auto& [result, n] : {std::pair{"applied", replan.applied}, std::pair{"failed", replan.failed}}) {
    e.add("blockflow_replans_total", "counter", "Re-plans after a lost site, by result.", {{"result", result}},
          static_cast<double>(n));
  }
  e.add("blockflow_last_replan_seconds", "gauge", "The last loss to its re-planned deployment applied.", {},
        replan.last_ms / 1e3);
  e.add("blockflow_auth_failures_total", "counter", "Peers refused by this process's CURVE endpoints.", {},
        static_cast<double>(auth_failures));
  const auto phases = [&e](const char* name, const char* help, std::initializer_list<std::pair<const char*, double>> ms) {
    for (const auto& [phase, value] : ms) e.add(name, "gauge", help, {{"phase", phase}}, value / 1e3);
  };
  phases("blockflow_last_update_seconds", "Time the last applied update spent, by phase.",
         {{"load", last_update.load_ms}, {"route", last_update.route_ms}, {"drain", last_update.drain_ms},
          {"total", last_update.total_ms}, {"first_result", last_update.time_to_first_result_ms}});
  phases("blockflow_start_seconds", "The session's cold start, by phase (first_result: from the process start).",
         {{"process_to_start", start.process_to_start_ms}, {"start", start.start_ms},
          {"first_result", start.time_to_first_result_ms}});
  e.add("blockflow_sampling_enabled", "gauge", "1 while KPI sampling is on.", {}, sampling ? 1 : 0);
  e.add("blockflow_sampling_period_seconds", "gauge", "KPI sampling period.", {}, sampling_period_s);
  for (const auto& b : blocks) {
    const Exposition::Labels l = {{"block", b.name}, {"placement", b.placement}, {"device", b.device}};
    e.add("blockflow_block_processed_total", "counter", "Requests a block computed.", l, static_cast<double>(b.processed));
    e.add("blockflow_block_failed_total", "counter", "Requests that failed at a block.", l, static_cast<double>(b.failed));
    e.add("blockflow_block_batches_total", "counter", "forward() calls that ran several requests at once (batching).", l,
          static_cast<double>(b.batches));
    e.add("blockflow_block_batched_requests_total", "counter", "Requests that ran in a batch of several.", l,
          static_cast<double>(b.batched_requests));
    e.add("blockflow_block_layout_kept_total", "counter",
          "Outputs a block handed to the next one in oneDNN's layout (no reorder pair).", l,
          static_cast<double>(b.layout_kept));
    e.add("blockflow_block_handed_directly_total", "counter",
          "Requests that skipped a block's queue (handed straight to its site, or run at once by the lane of the previous block).",
          l, static_cast<double>(b.handed_directly));
    e.add("blockflow_block_computing_seconds", "gauge",
          "How long the longest call into a block now in progress has run (0: none); a block that never returns grows here.",
          l, b.computing_s);
    if (b.cuda_graph.graphs + b.cuda_graph.eager_runs > 0) {
      e.add("blockflow_block_cuda_graphs", "gauge", "cuda_graph: input shapes captured into CUDA graphs.", l,
            static_cast<double>(b.cuda_graph.graphs));
      e.add("blockflow_block_cuda_graph_replays_total", "counter", "cuda_graph: forward() calls served by a graph replay.",
            l, static_cast<double>(b.cuda_graph.replays));
      e.add("blockflow_block_cuda_graph_eager_runs_total", "counter",
            "cuda_graph: forward() calls whose input shapes had no graph (run eagerly).", l,
            static_cast<double>(b.cuda_graph.eager_runs));
    }
    if (b.on_demand) {
      e.add("blockflow_block_resident", "gauge", "On demand: 1 while the block is loaded.", l, b.resident ? 1 : 0);
      e.add("blockflow_block_loads_total", "counter", "On demand: times the block was loaded.", l, static_cast<double>(b.loads));
      e.add("blockflow_block_evictions_total", "counter", "On demand: times the block was unloaded to make room.", l,
            static_cast<double>(b.evictions));
    }
    e.summary("blockflow_block_wait_seconds", "Time requests waited in a block's queue.", l, b.wait);
    e.summary("blockflow_block_compute_seconds", "Time of a block's forward().", l, b.compute);
    e.summary("blockflow_block_overhead_seconds", "Hand-off, dispatch and routing time attributed to a block.", l, b.overhead);
    e.add("blockflow_block_queue_depth", "gauge", "Requests in a block's input queue.", l, static_cast<double>(b.queue.depth));
    e.add("blockflow_block_queue_capacity", "gauge", "Bound of a block's input queue.", l, static_cast<double>(b.queue.capacity));
    e.add("blockflow_block_queue_high_watermark", "gauge", "Deepest a block's queue has been.", l,
          static_cast<double>(b.queue.high_watermark));
    e.add("blockflow_block_queue_rejected_total", "counter", "Requests refused by a full queue (policy reject).", l,
          static_cast<double>(b.queue.rejected));
    e.add("blockflow_block_queue_dropped_total", "counter", "Requests evicted from a full queue (policy drop-oldest).", l,
          static_cast<double>(b.queue.dropped));
    e.add("blockflow_block_queue_past_capacity_total", "counter",
          "Requests a compute lane queued past a full queue's bound (lanes that would wait on each other).", l,
          static_cast<double>(b.queue.past_capacity));
  }
  for (const auto& m : memory) {
    const Exposition::Labels l = {{"site", m.site}};
    e.add("blockflow_site_memory_budget_bytes", "gauge", "Memory a site's blocks may take by their profiles (0: no budget).", l,
          static_cast<double>(m.budget_bytes));
    e.add("blockflow_site_memory_profiled_bytes", "gauge", "The sum of a site's blocks' profiled memory.", l,
          static_cast<double>(m.profiled_bytes));
    e.add("blockflow_site_memory_measured_bytes", "gauge", "What a site's resident memory grew by with its blocks.", l,
          static_cast<double>(m.measured_bytes));
    if (m.policy != "on_demand") continue;
    e.add("blockflow_site_memory_resident_bytes", "gauge", "On demand: the footprints of the blocks loaded now.", l,
          static_cast<double>(m.resident_bytes));
    e.add("blockflow_site_block_loads_total", "counter", "On demand: blocks loaded (and warmed up).", l, static_cast<double>(m.loads));
    e.add("blockflow_site_block_evictions_total", "counter", "On demand: blocks unloaded to make room.", l,
          static_cast<double>(m.evictions));
    e.add("blockflow_site_loaded_bytes_total", "counter", "On demand: the footprints of every load.", l,
          static_cast<double>(m.bytes_loaded));
    e.add("blockflow_site_load_seconds_total", "counter", "On demand: time spent loading blocks.", l, m.load_s);
    e.add("blockflow_site_block_prefetches_total", "counter", "On demand: blocks loaded ahead of their requests.", l,
          static_cast<double>(m.prefetches));
    e.add("blockflow_site_block_swap_ins_total", "counter", "On demand: loads that paged a block's weights back in from its swap file.", l,
          static_cast<double>(m.swap_ins));
    e.add("blockflow_site_swapped_bytes", "gauge", "On demand: the weights of unloaded blocks that wait in swap files.", l,
          static_cast<double>(m.swapped_bytes));
    e.add("blockflow_site_memory_unaccounted_bytes", "gauge",
          "On demand, measuring the process: its growth beyond the loaded blocks' footprints at the last load decision.", l,
          static_cast<double>(m.unaccounted_bytes));
  }
  for (const auto& lane : lanes) {
    const Exposition::Labels l = {{"lane", std::to_string(lane.index)}};
    e.add("blockflow_lane_runs_total", "counter", "Block work units (requests or batches) a compute lane ran.", l,
          static_cast<double>(lane.runs));
    e.add("blockflow_lane_tasks_total", "counter", "Warm-ups and run_on_lane() tasks a compute lane ran.", l,
          static_cast<double>(lane.tasks));
    e.add("blockflow_lane_inline_continuations_total", "counter",
          "Next blocks a compute lane ran at once after the previous block of the request.", l,
          static_cast<double>(lane.inline_continuations));
    e.add("blockflow_lane_one_thread_runs_total", "counter",
          "Units a compute lane ran with one thread (a one-thread lane, or a team lane under load).", l,
          static_cast<double>(lane.one_thread_runs));
    e.add("blockflow_lane_sleeps_total", "counter", "Times a compute lane slept waiting for work (each ended by a wake-up).",
          l, static_cast<double>(lane.sleeps));
    e.add("blockflow_lane_threads", "gauge", "OpenMP threads of a compute lane's team (1: a one-thread lane).", l,
          static_cast<double>(lane.threads));
    e.add("blockflow_lane_busy_seconds_total", "counter", "Time a compute lane spent running work.", l, lane.busy_s);
    e.add("blockflow_lane_utilisation", "gauge", "Busy time of a compute lane over its lifetime.", l, lane.utilisation);
  }
  for (const auto& p : paths) {
    const Exposition::Labels l = {{"path", p.task}};
    e.add("blockflow_path_submitted_total", "counter", "Requests submitted to a path (task).", l, static_cast<double>(p.submitted));
    e.add("blockflow_path_completed_total", "counter", "Requests of a path that returned outputs.", l,
          static_cast<double>(p.completed));
    e.add("blockflow_path_failed_total", "counter", "Requests of a path that resolved with an error.", l,
          static_cast<double>(p.failed));
    e.add("blockflow_path_waiting_at_entry", "gauge", "Requests of a path waiting at its entry window now.", l,
          static_cast<double>(p.waiting_at_entry));
    e.add("blockflow_path_waited_at_entry_total", "counter", "Requests of a path that waited at its entry window.", l,
          static_cast<double>(p.waited_at_entry));
    e.summary("blockflow_path_latency_seconds", "End-to-end latency of a path's requests.", l, p.e2e);
    e.summary("blockflow_path_wait_seconds", "Queue waiting along a request's critical path.", l, p.wait);
    e.summary("blockflow_path_compute_seconds", "Compute along a request's critical path.", l, p.compute);
    e.summary("blockflow_path_overhead_seconds", "Overhead (hand-offs, dispatch, routing) along a request's critical path.", l,
              p.overhead);
  }
  add_process(e, "host", host);
  for (const auto& s : sites) {
    const Exposition::Labels l = {{"worker", s.name}, {"kind", s.kind}};
    e.add("blockflow_worker_up", "gauge", "1 while a worker process is running.", l,
          (s.kind == "worker" ? s.pid > 0 : !s.lost) ? 1 : 0);  // a joined worker's pid is not ours to see
    e.add("blockflow_worker_lost", "gauge", "1 once a worker is gone for good (it died after its last restart).", l,
          s.lost ? 1 : 0);
    e.add("blockflow_worker_restarts_total", "counter", "Restarts of a worker after it died.", l, static_cast<double>(s.restarts));
    e.add("blockflow_worker_failed_requests_total", "counter",
          "Requests a site failed itself: its worker died, it stopped, or a request could not be sent.", l,
          static_cast<double>(s.failed_requests));
    e.add("blockflow_worker_in_flight_requests", "gauge", "Requests sent to a worker and not answered.", l,
          static_cast<double>(s.in_flight));
    e.add("blockflow_worker_malformed_frames_total", "counter", "Malformed frames received from a worker, dropped.", l,
          static_cast<double>(s.malformed_frames));
    e.add("blockflow_worker_computing_seconds", "gauge",
          "How long a worker's longest block call now in progress has run, at its last heartbeat (0: none).", l, s.computing_s);
    if (s.parked_outputs > 0 || s.direct_forwards > 0) {
      e.add("blockflow_worker_parked_outputs_total", "counter",
            "Results a worker kept for the next worker (direct edges).", l, static_cast<double>(s.parked_outputs));
      e.add("blockflow_worker_direct_forwards_total", "counter",
            "Kept outputs a worker was told to send straight to another worker (direct edges).", l,
            static_cast<double>(s.direct_forwards));
    }
    e.add("blockflow_worker_resident_memory_bytes", "gauge", "A worker's resident memory at its last heartbeat.", l,
          static_cast<double>(s.rss_bytes));
    e.add("blockflow_worker_idle_resident_memory_bytes", "gauge", "A worker's resident memory before it loaded any block.", l,
          static_cast<double>(s.rss_idle_bytes));
    const Exposition::Labels edge = {{"worker", s.name}, {"channel", s.data.kind}};
    e.add("blockflow_edge_sent_total", "counter", "Messages the host sent to a worker.", edge, static_cast<double>(s.data.sent));
    e.add("blockflow_edge_received_total", "counter", "Results the host received from a worker.", edge,
          static_cast<double>(s.data.received));
    e.add("blockflow_edge_copied_bytes_total", "counter",
          "Bytes copied in the hand-off to a worker (0 on the zero-copy channel).", edge,
          static_cast<double>(s.data.bytes_copied));
    e.add("blockflow_edge_queue_depth", "gauge", "Requests waiting to be sent to a worker.", edge, static_cast<double>(s.data.depth));
    if (s.data.kind == "shm" || s.data.kind == "cuda") {
      add_shm(e, s.name, "to_worker", s.shm_requests);
      add_shm(e, s.name, "from_worker", s.shm_results);
    }
    if (s.data.kind == "cuda") {
      add_shm(e, s.name, "to_worker", s.cuda_requests, "cuda");
      add_shm(e, s.name, "from_worker", s.cuda_results, "cuda");
    }
    add_process(e, s.name, s.kpi);
  }
  return e.str();
}

namespace detail {

std::atomic<std::uint64_t>& auth_failure_counter() {
  static std::atomic<std::uint64_t> counter{0};
  return counter;
}

}  // namespace detail

}  // namespace blockflow
