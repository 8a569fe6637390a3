#pragma once
/// @file
/// @brief What a session does when a site is lost for good (a worker process that died after its
/// last restart, WorkerOptions::max_restarts): SessionOptions::on_site_lost is asked for a deployment
/// of the remaining sites, which the session applies (docs/replan.md). blockflow::replanner()
/// (plan/replan.hpp) makes such a function from the planner's inputs.

#include <blockflow/deploy/deployment.hpp>

#include <absl/status/statusor.h>

#include <functional>
#include <string>
#include <vector>

namespace blockflow {

/// @brief A site gone for good.
struct SiteLoss {
  std::string site;                 ///< its name
  std::string cause;                ///< how it went, e.g. "worker w3 killed by signal 9"
  std::vector<std::string> lost;    ///< every site this session has lost so far, `site` last
};

/// @brief Called once per lost site, on a thread of the session's own (never a lane or a site's
/// thread): the deployment to apply instead of the running one, or an error (logged, counted, and
/// the deployment stays as it is). It may take its time: nothing waits for it but the re-plan.
using SiteLostFn = std::function<absl::StatusOr<Deployment>(const SiteLoss& loss)>;

}  // namespace blockflow
