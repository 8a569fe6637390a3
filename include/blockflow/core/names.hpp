#pragma once
/// @file
/// @brief The one rule for names that reach the session from outside (deployments, the control
/// endpoint, worker configurations): blocks, tasks, placements and worker sites. A name is 1 to 64
/// characters from `A-Z a-z 0-9 _ . -`, and does not start with `.` or `-`: it is never a path,
/// never `..`, never an option, and safe in a file name, a thread name and a metric label.

#include <absl/status/status.h>

#include <string_view>

namespace blockflow {

inline constexpr std::size_t kMaxNameLength = 64;  // detail::kNameMaxLength

/// @brief OK, or InvalidArgument naming `what` ("block", "task", "placement", "worker") and the
/// name (escaped when it holds unprintable bytes) and the rule it breaks.
absl::Status check_name(std::string_view what, std::string_view name);

/// @brief check_name(), and not a name the session's own rows take in metrics and memory figures
/// ("threads": blocks of the session's process; "host": that process): for worker sites and the
/// placements and site settings that name them.
absl::Status check_site_name(std::string_view what, std::string_view name);

}  // namespace blockflow
