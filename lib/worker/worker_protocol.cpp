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
          {"max_parked_bytes", options.max_parked_bytes},
          {"lanes", options.lanes},
          // On demand the worker's own session keeps its blocks under the budget (kAdmit: the
          // host's session admits by the profiles, and the worker needs no budget of its own).
          {"on_demand_budget", options.memory_policy == SessionOptions::MemoryPolicy::kOnDemand ? options.memory_budget : 0}};
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
