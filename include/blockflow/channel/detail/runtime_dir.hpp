#pragma once
// Internal: private per-session directories for ipc:// endpoints.

#include <absl/status/statusor.h>

#include <string>

namespace blockflow::detail {

/// Where BlockFlow keeps its sockets: $XDG_RUNTIME_DIR when set, else /tmp.
std::string runtime_root();

/// Creates a fresh 0700 directory under $XDG_RUNTIME_DIR (or /tmp) named blockflow-<tag>-XXXXXX,
/// holding a shared flock on its `owner.lock` until remove_private_dir() or the process's end; first
/// removes the directories of this user that a killed process left (sweep_abandoned_private_dirs()).
absl::StatusOr<std::string> make_private_dir(const std::string& tag);

/// Removes the directory and the socket files in it (best effort), and lets go of its lock.
void remove_private_dir(const std::string& dir);

/// Removes this user's blockflow-* directories under the runtime root whose owner lock anyone can
/// take (their process is gone: a lock dies with it, in any PID namespace). Directories without an
/// owner lock are left alone.
void sweep_abandoned_private_dirs();

}  // namespace blockflow::detail
