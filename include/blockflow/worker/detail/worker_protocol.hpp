#pragma once
// Internal: the control-plane messages between a session and its worker processes.
//
// Control frames are JSON objects with a "type" (never code): the worker sends hello {pid, name,
// rss_bytes}, loaded {rss_bytes, heartbeat_ms, host_silence_ms: the heartbeat settings it applied},
// load_error {message}, heartbeat {rss_bytes, shm, cuda, kpi} (the answer to a ping) and
// updated / update_error; the host sends config (make_config(), plus what only the site knows:
// sampling, sampling_period_ms, cuda_probe, data_link, peer_endpoint, max_parked, and a joined
// worker's requests_port / results_port), ping (every WorkerOptions::heartbeat_interval), sampler,
// update and stop. Data frames use the binary wire format (wire_format.hpp).

#include <blockflow/core/block_registry.hpp>
#include <blockflow/channel/detail/shm_pool.hpp>
#include <blockflow/core/remote_site.hpp>
#include <blockflow/worker/worker_site.hpp>
#include <blockflow/core/detail/utf8_text.hpp>  // dump_json(): every message of the protocol is written with it

#include <absl/status/statusor.h>
#include <absl/time/time.h>
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

// The config message's part that follows from the options: blocks, plugins, heartbeat_ms, channel,
// shm_*, receive_spin_us, busy_poll, max_parked_bytes, lanes. Also the body of an update message.
nlohmann::json make_config(const std::vector<BlockDescription>& blocks, const WorkerOptions& options);

// What a worker makes of the config's heartbeat_ms. The host pings every `interval`; a joined
// worker that hears nothing from the host for `host_silence` takes it for gone and joins again (a
// child follows its parent process instead). Missing or not a positive number: the default
// WorkerOptions::heartbeat_interval. The interval is bounded to [kMinHeartbeat, kMaxHeartbeat];
// the silence is kHostSilenceBeats intervals, at least kMinHostSilence.
inline constexpr absl::Duration kMinHeartbeat = absl::Milliseconds(1);
inline constexpr absl::Duration kMaxHeartbeat = absl::Seconds(10);
inline constexpr int kHostSilenceBeats = 30;
inline constexpr absl::Duration kMinHostSilence = absl::Seconds(1);
struct HeartbeatSettings {
  absl::Duration interval;
  absl::Duration host_silence;
};
HeartbeatSettings heartbeat_settings(const nlohmann::json& config);

// A heartbeat's figures from the worker's own session: on_demand (its memory totals, when its
// blocks load on demand), computing (its longest block call in progress: {"block", "s"}), and
// cuda_graphs (per block with CUDA graphs).
void add_session_figures(nlohmann::json& beat, const MetricsSnapshot& m, bool on_demand);

}  // namespace blockflow::detail
