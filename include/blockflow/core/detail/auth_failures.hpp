#pragma once
// Internal: the process-wide count of peers refused by CURVE endpoints (curve.hpp). The endpoints
// (blockflow::workers) add to it; Session::metrics() reports it as MetricsSnapshot::auth_failures.

#include <atomic>
#include <cstdint>

namespace blockflow::detail {

std::atomic<std::uint64_t>& auth_failure_counter();

}  // namespace blockflow::detail
