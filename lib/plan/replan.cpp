// Re-planning after lost sites (docs/replan.md): the remaining sites, blocks kept where they are,
// and tasks demoted, then refused, loosest SLO first, until every task left fits.
#include <blockflow/plan/replan.hpp>

#include <blockflow/core/detail/log.hpp>

#include "plan_report.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <set>

namespace blockflow {
namespace {

constexpr int kMaxDemotions = 3;  // a task keeps at least 1/8 of its rate before it is refused

const TaskVerdict* first_refused(const Plan& p) {
  for (const auto& v : p.tasks) {
    if (!v.admitted) return &v;
  }
  return nullptr;
}

// A block of `p` that stays on the site `deployed` has it on keeps its workers and max_batch.
void keep_deployed(Plan& p, const Plan& deployed) {
  for (auto& b : p.blocks) {
    for (const auto& d : deployed.blocks) {
      if (d.block == b.block && d.site == b.site) {
        b.workers = d.workers;
        b.max_batch = d.max_batch;
      }
    }
  }
}

// What the re-plan can run: plan() of `in`; when it admits every task, its blocks that stay keep
// their workers and max_batch and the tasks are predicted again with them (predict()), the plan's
// verdicts, loads and blocks then being that prediction's (each block with the plan's workers).
// `predicted`, when given: whether the verdicts are the prediction's (every task's load counted) rather
// than plan()'s (a task plan() refused takes no room).
absl::StatusOr<Plan> evaluate(const PlanInput& in, const Plan& deployed, const PlanOptions& options,
                              bool* predicted = nullptr) {
  if (predicted != nullptr) *predicted = false;
  auto p = plan(in, options);
  if (!p.ok() || first_refused(*p) != nullptr) return p;
  if (predicted != nullptr) *predicted = true;
  keep_deployed(*p, deployed);
  auto again = predict(in, p->blocks);
  if (!again.ok()) return again.status();
  for (auto& b : again->blocks) {
    for (const auto& chosen : p->blocks) {
      if (chosen.block == b.block) b.workers = chosen.workers;
    }
  }
  return again;
}

std::size_t index_of(const std::vector<PlanTask>& tasks, const std::string& name) {
  return static_cast<std::size_t>(std::find_if(tasks.begin(), tasks.end(), [&](const PlanTask& t) { return t.name == name; }) -
                                  tasks.begin());
}

// Whether what the re-plan can run of `in` without task `skip` admits task `want` (evaluate()).
absl::StatusOr<bool> admits_without(const PlanInput& in, const Plan& deployed, std::size_t skip, const std::string& want,
                                    const PlanOptions& options) {
  PlanInput trial = in;
  trial.tasks.erase(trial.tasks.begin() + static_cast<std::ptrdiff_t>(skip));
  auto p = evaluate(trial, deployed, options);
  if (!p.ok()) return p.status();
  return std::any_of(p->tasks.begin(), p->tasks.end(), [&](const TaskVerdict& v) { return v.task == want && v.admitted; });
}

// The task that makes room for `refused`, and why (docs/replan.md, "Algorithm").
// `counted`: the plan whose verdicts say which tasks take room (a task it refused takes none, and
// making it smaller lets nobody in); null: every task does.
absl::StatusOr<std::pair<std::size_t, std::string>> pick_victim(const PlanInput& in, const Plan& deployed,
                                                                 const TaskVerdict& refused, const PlanOptions& options,
                                                                 const Plan* counted) {
  const std::size_t r = index_of(in.tasks, refused.task);
  PlanInput alone = in;
  alone.tasks = {in.tasks[r]};
  auto a = evaluate(alone, deployed, options);
  if (!a.ok()) return a.status();
  if (!a->tasks.front().admitted) {
    return std::pair{r, fmt::format("it does not fit on the remaining sites even alone ({})", a->tasks.front().reason)};
  }
  // The loosest SLO first; of equal SLOs, the lower priority (later in the input) first.
  std::vector<std::size_t> order(in.tasks.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = order.size() - 1 - i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return in.tasks[a].slo_ms > in.tasks[b].slo_ms; });
  const auto takes_room = [&](std::size_t i) {
    if (i == r || counted == nullptr) return true;
    return std::any_of(counted->tasks.begin(), counted->tasks.end(),
                       [&](const TaskVerdict& v) { return v.task == in.tasks[i].name && v.admitted; });
  };
  order.erase(std::remove_if(order.begin(), order.end(), [&](std::size_t i) { return !takes_room(i); }), order.end());
  // Only tasks looser than it (before it in that order) make room for it: the loosest whose removal
  // lets it in; when no single removal does, the loosest of them all the same (demotions add up);
  // when none is looser, the task itself.
  for (const std::size_t i : order) {
    if (i == r) break;
    auto helps = admits_without(in, deployed, i, refused.task, options);
    if (!helps.ok()) return helps.status();
    if (*helps) {
      return std::pair{i, fmt::format("it has the loosest SLO ({:.1f} ms) of the tasks whose room lets in the others ({})",
                                      in.tasks[i].slo_ms, refused.reason)};
    }
  }
  if (order.front() != r) {
    return std::pair{order.front(), fmt::format("it has the loosest SLO ({:.1f} ms), and no single task's room lets in the "
                                                "others ({})", in.tasks[order.front()].slo_ms, refused.reason)};
  }
  return std::pair{r, fmt::format("it has the loosest SLO ({:.1f} ms) of the tasks that can make room, and {}",
                                  in.tasks[r].slo_ms, refused.reason)};
}

}  // namespace

absl::StatusOr<Replan> replan(const PlanInput& input, const Plan& deployed, const std::vector<std::string>& lost,
                              const PlanOptions& options) {
  const std::set<std::string> gone(lost.begin(), lost.end());
  for (const auto& name : gone) {
    if (std::none_of(input.sites.begin(), input.sites.end(), [&](const PlanSite& s) { return s.name == name; })) {
      return absl::InvalidArgumentError(fmt::format("replan: lost site '{}' is not one of the input's sites", name));
    }
  }
  Replan out;
  out.input = input;
  auto& in = out.input;
  in.sites.erase(std::remove_if(in.sites.begin(), in.sites.end(), [&](const PlanSite& s) { return gone.count(s.name) != 0; }),
                 in.sites.end());
  if (in.sites.empty()) return absl::InvalidArgumentError(fmt::format("replan: every site is lost ({})", fmt::join(lost, ", ")));
  in.current.clear();
  for (const auto& b : deployed.blocks) {
    if (gone.count(b.site) == 0) in.current[b.block] = b.site;
  }
  const std::string after = fmt::format("after losing site{} '{}'", gone.size() == 1 ? "" : "s", fmt::join(lost, "', '"));
  std::map<std::string, TaskChange> changes;
  std::map<std::string, int> demotions;
  while (true) {
    // A block that stays on its site keeps its workers and max_batch (a site cannot change it in
    // place), while the plan may have chosen another batch size for it to fit the lost site's
    // blocks: evaluate() predicts the tasks again with the kept ones, and a task that no longer fits
    // is refused there, room being made for it like for any other.
    bool predicted = false;
    auto p = evaluate(in, deployed, options, &predicted);
    if (!p.ok()) return p.status();
    const TaskVerdict* refused = first_refused(*p);
    if (refused == nullptr) {
      out.plan = *std::move(p);
      break;
    }
    auto victim = pick_victim(in, deployed, *refused, options, predicted ? nullptr : &*p);
    if (!victim.ok()) return victim.status();
    PlanTask& t = in.tasks[victim->first];
    TaskChange& c = changes[t.name];
    if (c.task.empty()) c = {t.name, false, t.rate_rps, t.rate_rps, ""};
    if (demotions[t.name]++ < kMaxDemotions) {
      t.rate_rps /= 2;
      c.rate_after = t.rate_rps;
      c.reason = fmt::format("task '{}': demoted {} from {:.1f} to {:.1f} req/s: {}", t.name, after, c.rate_before,
                             c.rate_after, victim->second);
    } else {
      c.refused = true;
      c.rate_after = 0;
      c.reason = fmt::format("task '{}': refused {}: {}", t.name, after, victim->second);
      in.tasks.erase(in.tasks.begin() + static_cast<std::ptrdiff_t>(victim->first));
    }
  }
  for (const auto& t : input.tasks) {
    if (auto it = changes.find(t.name); it != changes.end()) out.changes.push_back(it->second);
  }
  return out;
}

std::string Replan::report_json(const std::vector<std::string>& lost) const {
  auto report = detail::plan_report(plan);
  report["lost"] = lost;
  auto list = nlohmann::json::array();
  for (const auto& c : changes) {
    list.push_back({{"task", c.task}, {"refused", c.refused}, {"rate_before", c.rate_before}, {"rate_after", c.rate_after},
                    {"reason", c.reason}});
  }
  report["changes"] = list;
  return report.dump(2);
}

SiteLostFn replanner(PlanInput input, PlanOptions options, std::string models_dir) {
  struct State {
    std::mutex mu;
    PlanInput input;
    PlanOptions options;
    std::string models_dir;
    std::unique_ptr<Plan> deployed;  // the plan running now: plan(input) until the first re-plan
    std::vector<std::string> lost;   // the sites the plans so far have dropped
  };
  auto state = std::make_shared<State>();
  state->input = std::move(input);
  state->options = options;
  state->models_dir = std::move(models_dir);
  return [state](const SiteLoss& loss) -> absl::StatusOr<Deployment> {
    std::lock_guard lock(state->mu);
    if (std::none_of(state->input.sites.begin(), state->input.sites.end(), [&](const PlanSite& s) { return s.name == loss.site; })) {
      return absl::FailedPreconditionError(fmt::format("replan: site '{}' is not one of the planner's sites", loss.site));
    }
    if (!state->deployed) {
      auto first = plan(state->input, state->options);
      if (!first.ok()) return first.status();
      state->deployed = std::make_unique<Plan>(*std::move(first));
    }
    // Every site lost so far that the plans still count (one whose re-plan failed included).
    std::vector<std::string> gone;
    for (const auto& site : loss.lost.empty() ? std::vector<std::string>{loss.site} : loss.lost) {
      const bool known = std::any_of(state->input.sites.begin(), state->input.sites.end(),
                                     [&](const PlanSite& s) { return s.name == site; });
      if (known && std::find(gone.begin(), gone.end(), site) == gone.end()) gone.push_back(site);
    }
    if (std::find(gone.begin(), gone.end(), loss.site) == gone.end()) gone.push_back(loss.site);
    auto r = replan(state->input, *state->deployed, gone, state->options);
    if (!r.ok()) return r.status();
    for (const auto& c : r->changes) detail::log(LogLevel::kWarning, c.reason);
    auto wanted = Deployment::parse(r->deployment_json(), state->models_dir);
    if (!wanted.ok()) return wanted.status();
    for (const auto& site : gone) {
      if (std::find(state->lost.begin(), state->lost.end(), site) == state->lost.end()) state->lost.push_back(site);
    }
    state->input = r->input;
    state->deployed = std::make_unique<Plan>(r->plan);
    detail::log(LogLevel::kInfo, fmt::format("replan {}: {}", fmt::join(state->lost, ", "), r->report_json(state->lost)));
    return wanted;
  };
}

}  // namespace blockflow
