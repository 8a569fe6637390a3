#pragma once
// Internal to the worker runtime: what a joined worker may load. Its configuration comes from
// whoever answers at the join address, so only its own command line chooses code (--plugin) and
// files (--models) (issue 21, docs/security.md). A child worker's parent is trusted: it loads what
// the configuration names. Refusals are logged here too: the operator of this host wants to know
// what was asked of it.

#include <blockflow/core/block_registry.hpp>
#include <blockflow/worker/detail/worker_launch.hpp>

#include <absl/status/status.h>
#include <absl/status/statusor.h>
#include <nlohmann/json.hpp>

#include <set>
#include <string>

namespace blockflow::detail {

struct WorkerAllowList {
  bool enforced = false;          ///< a joined worker
  std::string worker;             ///< its name, for the log
  std::set<std::string> plugins;  ///< canonical
  std::string models_dir;         ///< canonical; "" when no --models was given

  static WorkerAllowList of(const BlockflowWorkerLaunch& launch);
  static std::string canonical(const std::string& path);

  /// The file to dlopen() for a plugin the configuration names: itself, or refused.
  absl::StatusOr<std::string> plugin(const std::string& path) const;

  /// A block of the configuration; its TorchScript file (relative: to --models) must lie inside
  /// --models once symbolic links are resolved (detail::block_from_json's confinement), and must not
  /// climb with `..` at all: resolving `outside/x/..` would tell whether x is a link. The refusal
  /// says the same whether or not the file exists.
  absl::StatusOr<BlockDescription> block(const nlohmann::json& json) const;

  /// The configuration's endpoints and files: a joined worker's session is whoever answers at the
  /// address it joined, and never needs one on this host, so a configuration that names a peer
  /// endpoint (which this process would bind: an ipc:// path unlinked, a TCP listener opened), a
  /// data link or a CUDA probe (a local socket or file), or a channel other than "zmq" is refused.
  absl::Status config(const nlohmann::json& config) const;

  /// PermissionDenied with `why`, logged.
  absl::Status refuse(const std::string& why) const;
};

/// Loads each plugin of the configuration's list once per process (an update may list those
/// already loaded), through the allow-list.
absl::Status load_plugins(const nlohmann::json& plugins, const WorkerAllowList& allowed, std::set<std::string>& loaded);

}  // namespace blockflow::detail
