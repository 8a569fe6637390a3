#include <blockflow/worker/detail/worker_protocol.hpp>
#include <blockflow/deploy/detail/deployment_json.hpp>
#include <blockflow/observe/detail/metrics_json.hpp>

#include <fmt/format.h>

#include <algorithm>

namespace blockflow::detail {
nlohmann::json make_config(const std::vector<BlockDescription>& blocks, const WorkerOptions& options) {
  nlohmann::json list = nlohmann::json::array();
  for (const auto& b : blocks) list.push_back(block_to_json(b));
  return {{"type", kConfig},
          {"blocks", list},
          {"plugins", options.plugins},
          {"heartbeat_ms", absl::ToInt64Milliseconds(options.heartbeat_interval)},
          {"channel", options.channel},
          {"shm_slots_per_pool", options.shm_slots_per_pool},
          {"shm_max_bytes", options.shm_max_bytes},
          {"shm_outputs_in_slots", options.shm_outputs_in_slots},
          {"receive_spin_us", absl::ToInt64Microseconds(options.receive_spin)},
          {"busy_poll", options.busy_poll},
          {"max_parked_bytes", options.max_parked_bytes},
          {"lanes", options.lanes},
          // On demand the worker's own session keeps its blocks under the budget (kAdmit: the
          // host's session admits by the profiles, and the worker needs no budget of its own).
          {"on_demand_budget", options.memory_policy == SessionOptions::MemoryPolicy::kOnDemand ? options.memory_budget : 0},
          {"on_demand_measure", options.memory_measure == SessionOptions::MemoryMeasure::kProcess ? "process" : "blocks"}};
}

namespace {

// What a heartbeat tells the host of a session whose blocks load on demand (SiteStats' fields).
nlohmann::json on_demand_totals(const MetricsSnapshot& m) {
  for (const auto& site : m.memory) {
    if (site.site != "threads") continue;
    return {{"blocks_resident_bytes", site.resident_bytes}, {"block_loads", site.loads}, {"block_evictions", site.evictions},
            {"block_bytes_loaded", site.bytes_loaded}, {"block_load_s", site.load_s}, {"block_swap_ins", site.swap_ins},
            {"swapped_bytes", site.swapped_bytes}, {"unaccounted_bytes", site.unaccounted_bytes}};
  }
  return nlohmann::json::object();
}

// The longest call into one of the blocks now in progress, for the host's compute_timeout: {"block",
// "s"}; null when none runs.
nlohmann::json longest_call(const MetricsSnapshot& m) {
  const BlockMetrics* longest = nullptr;
  for (const auto& b : m.blocks) {
    if (b.computing_s > 0 && (longest == nullptr || b.computing_s > longest->computing_s)) longest = &b;
  }
  if (longest == nullptr) return nullptr;
  return {{"block", longest->name}, {"s", longest->computing_s}};
}

}  // namespace

void add_session_figures(nlohmann::json& beat, const MetricsSnapshot& m, bool on_demand) {
  if (on_demand) beat["on_demand"] = on_demand_totals(m);
  if (auto call = longest_call(m); !call.is_null()) beat["computing"] = std::move(call);
  for (const auto& b : m.blocks) {
    if (b.cuda_graph.graphs + b.cuda_graph.eager_runs > 0) beat["cuda_graphs"][b.name] = b.cuda_graph;
  }
}

HeartbeatSettings heartbeat_settings(const nlohmann::json& config) {
  absl::Duration interval = WorkerOptions{}.heartbeat_interval;
  const auto it = config.find("heartbeat_ms");
  if (it != config.end() && it->is_number() && it->get<double>() > 0) {
    interval = std::clamp(absl::Milliseconds(it->get<double>()), kMinHeartbeat, kMaxHeartbeat);
  }
  return {interval, std::max(kHostSilenceBeats * interval, kMinHostSilence)};
}

}  // namespace blockflow::detail
