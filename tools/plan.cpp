// blockflow-plan: admits tasks and places blocks from profiles (docs/planner.md).
//
//   blockflow-plan profile.json [more.json...] --tasks tasks.json --sites sites.json
//                  [--out deployment.json] [--report report.json]
//   blockflow-plan profile.json [more.json...] --tasks tasks.json --sites sites.json
//                  --predict deployment.json [--report report.json]
//
// Writes the deployment of the admitted tasks (what `blockflowctl apply` and Session::apply()
// take) to --out, and the report (each task admitted or refused with the reason, predicted p50,
// sites' load and memory) to --report or stdout. Exit 0 when the inputs could be planned (refused
// tasks included: the report says why), 1 when they could not, 2 for a usage error. --predict: no
// planning; the report says what the model predicts for that deployment's placement of the tasks'
// blocks (blockflow::predict(): e.g. a running deployment against profiles taken again), for the
// deployment's tasks at the rates and SLOs the tasks file gives them.
#include "tool_output.hpp"

#include <blockflow/plan/planner.hpp>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <stdexcept>

namespace {

int usage(const std::string& problem) {
  std::cerr << "blockflow-plan: " << problem
            << "\nusage: blockflow-plan PROFILE.json... --tasks TASKS.json --sites SITES.json [--out DEPLOYMENT.json]"
               " [--report REPORT.json]\n"
               "       blockflow-plan PROFILE.json... --tasks TASKS.json --sites SITES.json --predict DEPLOYMENT.json"
               " [--report REPORT.json]\n";
  return 2;
}

// Writes `file` whole or not at all; false (said on stderr, naming the file) when it could not.
bool write(const std::string& file, const std::string& text) {
  const std::string problem = blockflow::tools::write_file_atomic(file, text + "\n");
  if (!problem.empty()) std::cerr << "blockflow-plan: " << problem << "\n";
  return problem.empty();
}

}  // namespace

int main(int argc, char** argv) try {
  std::vector<std::string> profiles;
  std::string tasks, sites, out, report, predict;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](std::string& into) {
      if (i + 1 >= argc) return false;
      if (!into.empty()) throw std::invalid_argument(a + " is given twice");
      into = argv[++i];
      return true;
    };
    if (a == "--tasks") {
      if (!value(tasks)) return usage("--tasks needs a file");
    } else if (a == "--sites") {
      if (!value(sites)) return usage("--sites needs a file");
    } else if (a == "--out") {
      if (!value(out)) return usage("--out needs a file");
    } else if (a == "--predict") {
      if (!value(predict)) return usage("--predict needs a deployment file");
    } else if (a == "--report") {
      if (!value(report)) return usage("--report needs a file");
    } else if (!a.empty() && a[0] == '-') {
      return usage("unknown option " + a);
    } else {
      profiles.push_back(a);
    }
  }
  if (profiles.empty() || tasks.empty() || sites.empty()) return usage("profiles, --tasks and --sites are required");
  if (!predict.empty() && !out.empty()) return usage("--predict writes a report only, not --out");
  for (const std::string* file : {&out, &report}) {  // a wrong path fails before anything is written
    if (auto problem = file->empty() ? std::string() : blockflow::tools::check_writable(*file); !problem.empty()) {
      std::cerr << "blockflow-plan: " << problem << "\n";
      return 1;
    }
  }
  auto input = blockflow::load_plan_input(profiles, tasks, sites);
  if (!input.ok()) {
    std::cerr << "blockflow-plan: " << input.status().message() << "\n";
    return 1;
  }
  absl::StatusOr<blockflow::Plan> plan;
  if (predict.empty()) {
    plan = blockflow::plan(*input);
  } else {
    auto deployment = blockflow::load_deployment(predict);
    if (!deployment.ok()) {
      std::cerr << "blockflow-plan: " << deployment.status().message() << "\n";
      return 1;
    }
    // The deployment's tasks over its own routes, at the rates and SLOs the tasks file gives them,
    // in the tasks file's order (as plan() models them).
    const auto paths = deployment->paths();
    std::vector<blockflow::PlanTask> kept;
    for (const auto& t : input->tasks) {
      const auto path = std::find_if(paths.begin(), paths.end(), [&](const blockflow::Path& p) { return p.task() == t.name; });
      if (path != paths.end()) kept.push_back(blockflow::PlanTask::graph(*path, t.rate_rps, t.slo_ms));
    }
    if (kept.size() != paths.size()) {
      for (const auto& path : paths) {
        if (std::none_of(kept.begin(), kept.end(), [&](const blockflow::PlanTask& t) { return t.name == path.task(); })) {
          std::cerr << "blockflow-plan: " << predict << ": task '" << path.task() << "' is not in " << tasks << "\n";
        }
      }
      return 1;
    }
    input->tasks = std::move(kept);
    auto placement = blockflow::placement_of(*deployment, input->sites);
    plan = placement.ok() ? blockflow::predict(*input, *placement) : absl::StatusOr<blockflow::Plan>(placement.status());
    if (!plan.ok()) {
      std::cerr << "blockflow-plan: " << predict << " on " << sites << ": " << plan.status().message() << "\n";
      return 1;
    }
  }
  if (!plan.ok()) {
    std::cerr << "blockflow-plan: " << plan.status().message() << "\n";
    return 1;
  }
  for (const auto& v : plan->tasks) {
    std::cerr << "blockflow-plan: " << (v.admitted ? (predict.empty() ? "admitted " : "fits ") : "refused ") << v.task;
    if (v.admitted) std::cerr << " (" << v.rate_rps << " req/s, predicted p50 " << v.predicted_p50_ms << " ms)";
    else std::cerr << ": " << v.reason;
    std::cerr << "\n";
  }
  for (const auto& b : out.empty() ? std::vector<blockflow::BlockPlacement>{} : plan->blocks) {
    const blockflow::BlockProfile* p = input->profile.block(b.block);
    if (p == nullptr || p->source.empty()) {  // profiled as an object: nothing a deployment can name
      std::cerr << "blockflow-plan: " << out << ": block '" << b.block
                << "' has no source in the profile (a TorchScript file or a factory's name): not written\n";
      return 1;
    }
  }
  if (!out.empty() && !write(out, plan->deployment_json(*input))) return 1;
  if (report.empty()) {
    std::cout << plan->report_json() << "\n";
    return blockflow::tools::stdout_written("blockflow-plan") ? 0 : 1;
  }
  return write(report, plan->report_json()) ? 0 : 1;
} catch (const std::invalid_argument& e) {
  return usage(e.what());
}
