#pragma once
/// @file
/// @brief Re-planning after a lost site: a plan for the sites that remain, which keeps blocks where
/// they are and makes room by demoting, then refusing, tasks in Rim's order (the task with the
/// loosest latency target goes first); and a SessionOptions::on_site_lost function that applies
/// it (docs/replan.md).
///
/// @code
/// blockflow::PlanInput in = *blockflow::load_plan_input({"profile.json"}, "tasks.json", "sites.json");
/// blockflow::SessionOptions options;
/// options.on_site_lost = blockflow::replanner(in);   // a worker gone for good: re-plan and apply
/// @endcode

#include <blockflow/core/site_loss.hpp>
#include <blockflow/plan/planner.hpp>

#include <absl/status/statusor.h>

#include <string>
#include <vector>

namespace blockflow {

/// @brief What a re-plan did to one task.
struct TaskChange {
  std::string task;
  bool refused = false;     ///< left out of the deployment; otherwise demoted to rate_after
  double rate_before = 0;   ///< req/s the task had in the input
  double rate_after = 0;    ///< req/s the new plan gives it (0: refused)
  std::string reason;       ///< why, naming the lost sites and what did not fit
};

/// @brief A plan for the remaining sites.
struct Replan {
  PlanInput input;                  ///< what was planned: the remaining sites, the demoted rates, without the refused tasks
  Plan plan;                        ///< every task of `input` admitted
  std::vector<TaskChange> changes;  ///< one per demoted or refused task, in the order of the input's tasks
  /// @brief The deployment of the new plan (Plan::deployment_json() of `input`).
  [[nodiscard]] std::string deployment_json() const { return plan.deployment_json(input); }
  /// @brief Plan::report_json() plus "lost" (the sites) and "changes".
  [[nodiscard]] std::string report_json(const std::vector<std::string>& lost) const;
};

/// @brief Plans `input` without the `lost` sites (docs/replan.md, "Algorithm"). `deployed` is the
/// plan running now (plan(input) for the first loss): its blocks stay on their sites while the plan
/// fits (PlanInput::current), and a block that stays keeps its workers and max_batch (a site cannot
/// change a block in place; the tasks are predicted again with them). When some task does not fit,
/// tasks with a looser SLO make room for it one step at a time: the loosest whose removal would let
/// it in, else the loosest of them, else the task itself; a task's rate is halved (demoted, at most
/// 3 times: 1/8 of its rate), then it is refused. A task that does not fit even alone makes room
/// itself. InvalidArgument for a lost site that `input` does not have, when no site
/// remains, or for an input plan() refuses.
absl::StatusOr<Replan> replan(const PlanInput& input, const Plan& deployed, const std::vector<std::string>& lost,
                              const PlanOptions& options = {});

/// @brief A SessionOptions::on_site_lost function: for each loss, replan() from the last plan it
/// made (the first from `input` as given: the plan that was deployed), logs each demotion and
/// refusal with its reason, and returns the new deployment (TorchScript paths resolved against
/// `models_dir`). Its state is shared by its copies; it is thread-safe.
SiteLostFn replanner(PlanInput input, PlanOptions options = {}, std::string models_dir = ".");

}  // namespace blockflow
