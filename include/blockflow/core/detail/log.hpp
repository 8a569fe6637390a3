#pragma once
// Internal: how library code logs (to the sink of blockflow/log.hpp).

#include <blockflow/core/log.hpp>

#include <blockflow/core/detail/mutex.hpp>
#include <absl/time/time.h>

#include <cstdint>
#include <string_view>

namespace blockflow::detail {

/// Sends `message` to the process's sink when `level` is at or above the log level.
void log(LogLevel level, std::string_view message);

/// For a message that can repeat at the rate of requests or frames: at most `burst` of them per
/// `period` reach the sink; the first one after a suppression says how many were dropped.
class RateLimitedLog {
 public:
  explicit RateLimitedLog(int burst = 5, absl::Duration period = absl::Seconds(10)) : burst_(burst), period_(period) {}
  void log(LogLevel level, std::string_view message);
  /// Messages dropped so far.
  [[nodiscard]] std::uint64_t suppressed() const;

 private:
  const int burst_;
  const absl::Duration period_;
  mutable blockflow::detail::Mutex mu_;
  absl::Time window_start_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int in_window_ ABSL_GUARDED_BY(mu_) = 0;
  std::uint64_t dropped_since_ ABSL_GUARDED_BY(mu_) = 0;  // since the last one that got through
  std::uint64_t dropped_total_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace blockflow::detail
