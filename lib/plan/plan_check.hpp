#pragma once
// The validation of a planner's input that plan() and predict() begin with (lib/plan only).
#include <blockflow/plan/planner.hpp>

#include <absl/status/status.h>

namespace blockflow::detail {

// InvalidArgument naming the site, host, task or block at fault: no sites, names twice, lanes,
// cores, rates, SLOs and reserves out of range, tasks whose route is malformed or names a block
// the profile lacks (or has no batch-1 latency for).
absl::Status check_plan_input(const PlanInput& in);

}  // namespace blockflow::detail
