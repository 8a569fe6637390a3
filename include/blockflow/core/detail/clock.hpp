#pragma once
// Internal: the one clock every timestamp in BlockFlow comes from.

#include <chrono>
#include <cstdint>

namespace blockflow::detail {

/// Steady-clock nanoseconds. All HopTiming/RequestTrace fields use this clock.
inline std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline double ns_to_ms(std::int64_t ns) { return static_cast<double>(ns) / 1e6; }

/// Milliseconds from `t0_ns` (a now_ns() reading) to now.
inline double ms_since(std::int64_t t0_ns) { return ns_to_ms(now_ns() - t0_ns); }

}  // namespace blockflow::detail
