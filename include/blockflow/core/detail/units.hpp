#pragma once
// Internal: byte counts as the MB figures of messages and reports (2^20 bytes).

#include <cstdint>

namespace blockflow::detail {

inline double to_mb(std::int64_t bytes) { return static_cast<double>(bytes) / 1048576.0; }

}  // namespace blockflow::detail
