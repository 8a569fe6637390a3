// check_plan_input(): what plan() and predict() refuse before they model anything (plan_check.hpp).
#include "plan_check.hpp"

#include <blockflow/core/names.hpp>

#include "task_graph.hpp"

#include <fmt/format.h>

#include <map>
#include <set>
#include <string_view>
#include <string>

namespace blockflow::detail {

absl::Status check_plan_input(const PlanInput& in) {
  if (in.sites.empty()) return absl::InvalidArgumentError("plan: no sites");
  std::set<std::string> names;
  int threads_sites = 0;
  for (const auto& s : in.sites) {
    if (!names.insert(s.name).second) return absl::InvalidArgumentError(fmt::format("site '{}': named twice", s.name));
    if (s.kind != "threads" && s.kind != "worker") {
      return absl::InvalidArgumentError(fmt::format("site '{}': kind '{}' is neither \"threads\" nor \"worker\"", s.name, s.kind));
    }
    if (s.lanes < 1) return absl::InvalidArgumentError(fmt::format("site '{}': lanes must be at least 1", s.name));
    if (s.kind == "threads" && ++threads_sites > 1) {  // its deployment runs every "threads" block in one session
      return absl::InvalidArgumentError(fmt::format("site '{}': a second site of kind \"threads\" (there is one session)", s.name));
    }
    if (s.kind == "worker") {  // its name becomes a placement
      if (auto status = check_site_name("site", s.name); !status.ok()) return status;
    }
    if (s.memory_budget < 0) return absl::InvalidArgumentError(fmt::format("site '{}': memory_budget < 0", s.name));
    if (!(s.reserve >= 0 && s.reserve <= 0.9)) return absl::InvalidArgumentError(fmt::format("site '{}': reserve must be in 0..0.9", s.name));
  }
  names.clear();
  for (const auto& h : in.hosts) {
    if (!names.insert(h.name).second) return absl::InvalidArgumentError(fmt::format("host '{}': named twice", h.name));
    if (h.cores < 1) return absl::InvalidArgumentError(fmt::format("host '{}': cores must be at least 1", h.name));
  }
  names.clear();
  std::map<std::string_view, const BlockProfile*> profiles;
  for (const auto& b : in.profile.blocks) profiles.emplace(b.name, &b);  // the first of a name, as Profile::block()
  for (const auto& t : in.tasks) {
    if (!names.insert(t.name).second) return absl::InvalidArgumentError(fmt::format("task '{}': named twice", t.name));
    if (!(t.rate_rps > 0)) return absl::InvalidArgumentError(fmt::format("task '{}': rate_rps must be > 0", t.name));
    if (!(t.slo_ms > 0)) return absl::InvalidArgumentError(fmt::format("task '{}': slo_ms must be > 0", t.name));
    auto graph = task_graph(t);
    if (!graph.ok()) return graph.status();
    for (const auto& b : graph->blocks()) {
      const auto found = profiles.find(b);
      const BlockProfile* p = found == profiles.end() ? nullptr : found->second;
      if (p == nullptr) return absl::InvalidArgumentError(fmt::format("task '{}': block '{}' is not in the profile", t.name, b));
      if (p->at_batch(1) == nullptr) return absl::InvalidArgumentError(fmt::format("block '{}': the profile has no batch-1 latency", b));
    }
  }
  return absl::OkStatus();
}

}  // namespace blockflow::detail
