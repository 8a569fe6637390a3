#include <blockflow/detail/worker_protocol.hpp>
#include <blockflow/detail/deployment_json.hpp>
#include <blockflow/detail/metrics_json.hpp>

#include <fmt/format.h>

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
          {"lanes", options.lanes}};
}

}  // namespace blockflow::detail
