#pragma once
// Internal: the control-plane messages between a session and its worker processes.
//
// Control frames are JSON objects with a "type" (never code): the worker sends hello {pid},
// loaded, load_error {message}, heartbeat {rss_bytes} and updated / update_error; the host sends
// config {blocks, plugins, heartbeat_ms}, ping, sampler, update and stop. Data frames use the binary wire format (wire_format.hpp).

#include <blockflow/block_registry.hpp>
#include <blockflow/detail/shm_pool.hpp>
#include <blockflow/remote_site.hpp>
#include <blockflow/worker_site.hpp>

#include <absl/status/statusor.h>
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace blockflow::detail {

inline constexpr const char* kHello = "hello";
inline constexpr const char* kLoaded = "loaded";
inline constexpr const char* kLoadError = "load_error";
inline constexpr const char* kHeartbeat = "heartbeat";
inline constexpr const char* kPing = "ping";
inline constexpr const char* kStop = "stop";
inline constexpr const char* kConfig = "config";
inline constexpr const char* kSampler = "sampler";  // host -> worker: {enabled, period_ms}
// host -> worker: {seq, blocks, plugins} (as config): host exactly these blocks from now on.
inline constexpr const char* kUpdate = "update";
inline constexpr const char* kUpdated = "updated";            // worker -> host: {seq, rss_bytes}
inline constexpr const char* kUpdateError = "update_error";   // worker -> host: {seq, message}

// Blocks travel in the deployment format: detail/deployment_json.hpp.

nlohmann::json make_config(const std::vector<BlockDescription>& blocks, const WorkerOptions& options);

}  // namespace blockflow::detail
