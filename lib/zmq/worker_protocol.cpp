#include <blockflow/detail/worker_protocol.hpp>
#include <blockflow/detail/deployment_json.hpp>
#include <blockflow/detail/metrics_json.hpp>

#include <fmt/format.h>

namespace blockflow::detail {
ShmEdgeStats to_edge_stats(const ShmStats& s) {
  ShmEdgeStats e;
  e.handles = s.handles_sent;
  e.slots_in_use = s.slots_in_use;
  e.slots_total = s.slots_total;
  e.credit_waits = s.credit_waits;
  e.reclaims = s.reclaims;
  e.stale_releases = s.stale_releases;
  e.bytes_staged = s.bytes_staged;
  e.bytes_mapped = s.bytes_mapped;
  return e;
}

nlohmann::json to_json(const ShmStats& stats) { return nlohmann::json(to_edge_stats(stats)); }

ShmEdgeStats shm_edge_from_json(const nlohmann::json& json) {
  return json.is_object() ? json.get<ShmEdgeStats>() : ShmEdgeStats{};
}

nlohmann::json make_config(const std::vector<BlockDescription>& blocks, const WorkerOptions& options) {
  nlohmann::json list = nlohmann::json::array();
  for (const auto& b : blocks) list.push_back(block_to_json(b));
  return {{"type", kConfig},
          {"blocks", list},
          {"plugins", options.plugins},
          {"heartbeat_ms", absl::ToInt64Milliseconds(options.heartbeat_interval)},
          {"channel", options.channel},
          {"shm_slots_per_pool", options.shm_slots_per_pool},
          {"shm_max_bytes", options.shm_max_bytes}};
}

}  // namespace blockflow::detail
