#pragma once
// Internal to lib/plan: a plan's report as a JSON document (Plan::report_json() prints it;
// Replan::report_json() adds the lost sites and the task changes to it).

#include <blockflow/plan/planner.hpp>

#include <nlohmann/json.hpp>

namespace blockflow::detail {

nlohmann::json plan_report(const Plan& plan);

}  // namespace blockflow::detail
