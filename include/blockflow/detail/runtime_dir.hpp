#pragma once
// Internal: private per-session directories for ipc:// endpoints.

#include <absl/status/statusor.h>

#include <string>

namespace blockflow::detail {

/// Creates a fresh 0700 directory under $XDG_RUNTIME_DIR (or /tmp) named blockflow-<tag>-XXXXXX.
absl::StatusOr<std::string> make_private_dir(const std::string& tag);

/// Removes the directory and the socket files in it (best effort).
void remove_private_dir(const std::string& dir);

}  // namespace blockflow::detail
