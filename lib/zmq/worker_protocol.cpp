#include <blockflow/detail/worker_protocol.hpp>
#include <blockflow/detail/metrics_json.hpp>

#include <fmt/format.h>

namespace blockflow::detail {
namespace {

absl::StatusOr<FullPolicy> policy_from(const std::string& name) {
  for (auto p : {FullPolicy::kBlock, FullPolicy::kReject, FullPolicy::kDropOldest}) {
    if (to_string(p) == name) return p;
  }
  return absl::InvalidArgumentError(fmt::format("unknown full_policy '{}' (block, reject, drop-oldest)", name));
}

}  // namespace

nlohmann::json to_json(const BlockDescription& d) {
  const BlockOptions& o = d.options;
  return {{"name", d.name},
          {"torchscript", d.torchscript},
          {"factory", d.factory},
          {"placement", d.placement},
          {"options",
           {{"device", o.device},
            {"intra_op_threads", o.intra_op_threads},
            {"workers", o.workers},
            {"queue_capacity", o.queue_capacity},
            {"full_policy", std::string(to_string(o.full_policy))},
            {"input_shapes", o.input_shapes},
            {"warmup_runs", o.warmup_runs}}}};
}

absl::StatusOr<BlockDescription> block_from_json(const nlohmann::json& json) {
  BlockDescription d;
  try {
    d.name = json.at("name").get<std::string>();
    d.torchscript = json.value("torchscript", "");
    d.factory = json.value("factory", "");
    d.placement = json.value("placement", "");
    if (json.contains("options")) {
      const auto& o = json.at("options");
      d.options.device = o.value("device", d.options.device);
      d.options.intra_op_threads = o.value("intra_op_threads", d.options.intra_op_threads);
      d.options.workers = o.value("workers", d.options.workers);
      d.options.queue_capacity = o.value("queue_capacity", d.options.queue_capacity);
      d.options.warmup_runs = o.value("warmup_runs", d.options.warmup_runs);
      d.options.input_shapes = o.value("input_shapes", d.options.input_shapes);
      auto policy = policy_from(o.value("full_policy", std::string("block")));
      if (!policy.ok()) return absl::InvalidArgumentError(fmt::format("block '{}': {}", d.name, std::string(policy.status().message())));
      d.options.full_policy = *policy;
    }
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(fmt::format("block '{}': bad description: {}", d.name, e.what()));
  }
  if (d.name.empty()) return absl::InvalidArgumentError("a block description needs a name");
  return d;
}

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
  for (const auto& b : blocks) list.push_back(to_json(b));
  return {{"type", kConfig},
          {"blocks", list},
          {"plugins", options.plugins},
          {"heartbeat_ms", absl::ToInt64Milliseconds(options.heartbeat_interval)},
          {"channel", options.channel},
          {"shm_slots_per_pool", options.shm_slots_per_pool},
          {"shm_max_bytes", options.shm_max_bytes}};
}

}  // namespace blockflow::detail
