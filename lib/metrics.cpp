#include <blockflow/metrics.hpp>

#include <nlohmann/json.hpp>

namespace blockflow {
namespace {

nlohmann::json to_json(const LatencyStats& s) {
  return {{"count", s.count}, {"mean_ms", s.mean_ms}, {"p50_ms", s.p50_ms},
          {"p90_ms", s.p90_ms}, {"p99_ms", s.p99_ms}, {"max_ms", s.max_ms}};
}

nlohmann::json to_json(const ChannelStats& s) {
  return {{"kind", s.kind},         {"depth", s.depth},       {"capacity", s.capacity},
          {"high_watermark", s.high_watermark}, {"sent", s.sent}, {"received", s.received},
          {"rejected", s.rejected}, {"dropped", s.dropped},   {"bytes_copied", s.bytes_copied}};
}

nlohmann::json to_json(const ShmEdgeStats& s) {
  return {{"handles", s.handles},         {"slots_in_use", s.slots_in_use},   {"slots_total", s.slots_total},
          {"credit_waits", s.credit_waits}, {"reclaims", s.reclaims},         {"stale_releases", s.stale_releases},
          {"bytes_staged", s.bytes_staged}, {"bytes_mapped", s.bytes_mapped}};
}

}  // namespace

std::string MetricsSnapshot::to_json(int indent) const {
  nlohmann::json blocks_json = nlohmann::json::array();
  for (const auto& b : blocks) {
    blocks_json.push_back({{"name", b.name},
                           {"kind", b.kind},
                           {"device", b.device},
                           {"placement", b.placement},
                           {"workers", b.workers},
                           {"intra_op_threads", b.intra_op_threads},
                           {"processed", b.processed},
                           {"failed", b.failed},
                           {"throughput_per_s", b.throughput_per_s},
                           {"wait", blockflow::to_json(b.wait)},
                           {"compute", blockflow::to_json(b.compute)},
                           {"overhead", blockflow::to_json(b.overhead)},
                           {"queue", blockflow::to_json(b.queue)}});
  }
  nlohmann::json paths_json = nlohmann::json::array();
  for (const auto& p : paths) {
    paths_json.push_back({{"task", p.task},
                          {"submitted", p.submitted},
                          {"completed", p.completed},
                          {"failed", p.failed},
                          {"throughput_per_s", p.throughput_per_s},
                          {"e2e", blockflow::to_json(p.e2e)},
                          {"wait", blockflow::to_json(p.wait)},
                          {"compute", blockflow::to_json(p.compute)},
                          {"overhead", blockflow::to_json(p.overhead)}});
  }
  nlohmann::json sites_json = nlohmann::json::array();
  for (const auto& s : sites) {
    sites_json.push_back({{"name", s.name},
                          {"kind", s.kind},
                          {"pid", s.pid},
                          {"restarts", s.restarts},
                          {"failed_requests", s.failed_requests},
                          {"in_flight", s.in_flight},
                          {"malformed_frames", s.malformed_frames},
                          {"rss_idle_bytes", s.rss_idle_bytes},
                          {"rss_bytes", s.rss_bytes},
                          {"data", blockflow::to_json(s.data)},
                          {"shm_requests", blockflow::to_json(s.shm_requests)},
                          {"shm_results", blockflow::to_json(s.shm_results)}});
  }
  nlohmann::json root{{"uptime_s", uptime_s}, {"in_flight", in_flight}, {"blocks", blocks_json},
                      {"paths", paths_json}, {"sites", sites_json}};
  return root.dump(indent);
}

}  // namespace blockflow
