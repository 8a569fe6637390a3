#pragma once
/// @file
/// @brief The control endpoint: how an external optimiser (or `blockflowctl`) drives a running
/// session. ZeroMQ: clients use REQ (or DEALER with an empty delimiter frame), the endpoint a
/// ROUTER; one JSON object per message. Part of the optional `blockflow::workers` target.
///
/// Updates run on a thread of their own, one at a time (up to 4 wait their turn; more are refused,
/// saying so): status, metrics and sampling are answered while an apply runs. Destroying the
/// endpoint cancels its apply in progress (Session::cancel_update_from()) instead of waiting for it;
/// queued ones are dropped unanswered. An apply of the endpoint's that waits behind another
/// thread's apply() (the application's, a re-plan) is not cancelled before its turn: the
/// destructor waits for that other apply() to end, which it leaves alone, then cancels its own.
///
/// Requests and replies (every reply has "ok"; a failed one has "error", naming the problem):
/// - `{"cmd": "apply", "deployment": {...}}` -> `{"ok": true, "version": N}`: Session::apply() of a
///   deployment (deployment.hpp), its model paths confined to the endpoint's models directory and
///   its size to ControlOptions. JSON nested deeper than 64 levels is refused before it is parsed.
/// - `{"cmd": "status"}` -> `{"ok": true, "version", "uptime_s", "in_flight", "tasks": [...],
///   "blocks": [{"name", "placement", "processed", "failed"}], "workers": [{"name", "pid", "restarts"}],
///   "updating": true while an apply runs}`
/// - `{"cmd": "metrics"}` -> `{"ok": true, "metrics": {...snapshot...}, "prometheus": "..."}`
/// - `{"cmd": "sampling", "enabled": true, "period_ms": 100}` -> `{"ok": true}`

#include <blockflow/channel/curve.hpp>
#include <blockflow/core/session.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace blockflow {

/// @brief What one control request may ask for. Every refusal is an error reply naming the limit.
struct ControlOptions {
  /// TorchScript files of deployments resolve inside this directory (no `..`, no absolute path or
  /// symbolic link leading out); a path outside is refused without saying whether it exists.
  std::string models_dir = ".";
  /// A request above this size gets an error reply; one above twice this size closes the
  /// connection unanswered (ZeroMQ drops it before it is read whole).
  std::size_t max_message_bytes = std::size_t{1} << 20;
  /// Worker processes (distinct placements), blocks and tasks one deployment may name.
  std::size_t max_workers = 16;
  std::size_t max_blocks = 128;
  std::size_t max_tasks = 128;
  /// CURVE keys and the admitted clients (curve.hpp; `blockflowctl --key --server-key` is such a
  /// client). Without keys, a TCP endpoint beyond the loopback is refused unless `security.insecure`.
  ServerSecurity security;
};

/// The session must outlive the endpoint (declare the endpoint after the session): its threads
/// call Session::apply(), metrics() and set_sampling(). Destroying the endpoint cancels an apply()
/// it has running (once it runs: see the file's comment) and waits for its threads.
class ControlEndpoint {
 public:
  /// @brief Binds `endpoint` (say "tcp://127.0.0.1:5560"; name another interface only on purpose) and
  /// serves on its own thread. Throws std::runtime_error naming the endpoint when it cannot bind,
  /// when a key file is unusable, or when a plain-TCP endpoint beyond the loopback is not insecure.
  ControlEndpoint(Session& session, const std::string& endpoint, ControlOptions options);
  ControlEndpoint(Session& session, const std::string& endpoint, std::string models_dir = ".");
  ~ControlEndpoint();
  ControlEndpoint(const ControlEndpoint&) = delete;
  ControlEndpoint& operator=(const ControlEndpoint&) = delete;

  [[nodiscard]] const std::string& endpoint() const;
  [[nodiscard]] std::uint64_t requests_served() const;
  /// @brief Clients refused by CURVE since the endpoint started.
  [[nodiscard]] std::uint64_t auth_failures() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace blockflow
