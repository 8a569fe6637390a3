#pragma once
/// @file
/// @brief The planner: places blocks on sites and admits tasks from block profiles, so that every
/// admitted task gets its rate within its latency SLO and no site is over-committed
/// (docs/planner.md). Deterministic: the same inputs give the same plan.
///
/// @code
/// blockflow::PlanInput in;
/// in.profile = *blockflow::load_profile("profile.json");
/// in.tasks = {{"classify", {"block1", "block2", "block3", "block4"}, 20.0, 80.0}};
/// in.sites = {{"threads", "threads", "cpu", 1}, {"w1", "worker", "cpu", 1}};
/// auto plan = blockflow::plan(in);
/// auto deployment = blockflow::Deployment::parse(plan->deployment_json(in));  // session.apply(*deployment)
/// @endcode

#include <blockflow/core/path.hpp>
#include <blockflow/deploy/deployment.hpp>
#include <blockflow/plan/profile.hpp>

#include <absl/status/statusor.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace blockflow {

/// @brief A task to admit: its route (a chain of blocks, or a graph), the rate it must get and its
/// latency SLO.
struct PlanTask {
  std::string name;
  std::vector<std::string> path;  ///< a chain of blocks; empty for a graph task
  double rate_rps = 0;  ///< requests per second it must sustain (> 0)
  double slo_ms = 0;    ///< the p50 end-to-end latency it must stay within (> 0)
  /// A graph task (fan-out and fan-in), its nodes as blockflow::Path holds them: block nodes and
  /// joins with a combine rule a deployment can name (pack, mean, concat). Every block of it serves
  /// the task's rate; its predicted latency is that of its slowest way from the request to the
  /// output, and a join costs nothing but the hand-offs into the block after it.
  std::vector<PathNode> nodes;

  PlanTask() = default;
  /// A chain task.
  PlanTask(std::string task_name, std::vector<std::string> blocks, double rate, double slo)
      : name(std::move(task_name)), path(std::move(blocks)), rate_rps(rate), slo_ms(slo) {}
  /// A graph task named after `graph`'s task.
  static PlanTask graph(const Path& graph, double rate, double slo) {
    PlanTask t(graph.task(), {}, rate, slo);
    t.nodes = graph.nodes();
    return t;
  }
};

/// @brief Where blocks can run: the session's own threads or a worker process.
struct PlanSite {
  std::string name;
  std::string kind = "worker";  ///< "threads" (the session's lanes) or "worker" (a worker process)
  std::string device = "cpu";   ///< blocks run where their profile was measured: cpu or cuda[:N]
  int lanes = 1;                ///< compute lanes (a lane runs one block at a time)
  std::int64_t memory_budget = 0;  ///< bytes of resident memory its blocks may take; 0: no bound
  double reserve = 0;           ///< fraction of lanes and memory kept free (for failures), 0..0.9
  /// The machine it runs on: the sites of one host share its cores (PlanInput::hosts).
  std::string host = "local";
};

/// @brief A machine whose cores its sites share: a lane running a block of intra_op_threads T
/// keeps T cores busy, whichever site it belongs to.
struct PlanHost {
  std::string name;
  int cores = 0;  ///< at least 1
};

struct PlanInput {
  Profile profile;
  std::vector<PlanTask> tasks;  ///< in order of priority: admitted first come first
  std::vector<PlanSite> sites;
  /// Hosts and their cores. A site whose host is not listed is bounded by its own lanes only.
  std::vector<PlanHost> hosts;
  /// Where blocks run now (block -> site name), for a re-plan (blockflow::replan()): among the
  /// placements that fit, the planner keeps the most blocks where they are, before it balances the
  /// sites. Blocks and sites not listed are placed freely. Empty: no preference.
  std::map<std::string, std::string> current;
};

/// @brief The planner's answer for one task.
struct TaskVerdict {
  std::string task;
  bool admitted = false;
  std::string reason;  ///< why it was refused ("" when admitted)
  double rate_rps = 0;
  double slo_ms = 0;
  double predicted_p50_ms = 0;  ///< with the plan that admits it (refused: with it forced in, when computable; infinity: unbounded, a saturated block)
};

/// @brief Where a block runs and how.
struct BlockPlacement {
  std::string block;
  std::string site;
  int max_batch = 1;
  int workers = 1;         ///< lanes that may run it at once
  double rate_rps = 0;     ///< the admitted tasks' demand on it
  double lanes_used = 0;   ///< its share of the site's lanes (rate / capacity per lane)
};

/// @brief A site's predicted load.
struct SiteLoad {
  std::string site;
  int lanes = 0;
  double lanes_used = 0;     ///< blocks' shares plus the hand-offs it receives
  double utilisation = 0;    ///< lanes_used / (lanes x (1 - reserve))
  std::int64_t memory_bytes = 0;
  std::int64_t memory_budget = 0;
  std::vector<std::string> blocks;
};

/// @brief A host's predicted load: its sites' busy lanes times their blocks' intra-op threads.
struct HostLoad {
  std::string host;
  int cores = 0;
  double cores_used = 0;
  double utilisation = 0;  ///< cores_used / cores
};

struct Plan {
  std::vector<TaskVerdict> tasks;
  std::vector<BlockPlacement> blocks;  ///< the admitted tasks' blocks, in profile order
  std::vector<SiteLoad> sites;         ///< in input order
  std::vector<HostLoad> hosts;         ///< PlanInput::hosts, in input order
  double bottleneck_utilisation = 0;   ///< the highest site utilisation

  /// @brief A deployment JSON of the admitted tasks (Deployment::parse() and Session::apply()
  /// take it): each block with its TorchScript source, placement (none for a "threads" site),
  /// intra_op_threads, workers, max_batch and input_shapes.
  [[nodiscard]] std::string deployment_json(const PlanInput& input) const;
  /// @brief The report: tasks (admitted or the reason), predicted latency, sites' load and memory.
  [[nodiscard]] std::string report_json() const;
};

/// @brief How to search for placements.
struct PlanOptions {
  /// Try every placement of the blocks (sites^blocks: at most 12 blocks and 4^12 placements) instead of the heuristic:
  /// the optimum of the same objective, for small deployments and to measure the heuristic against.
  bool exhaustive = false;
};

/// @brief Plans `input` (docs/planner.md, "Algorithm"). InvalidArgument naming the task, block or
/// site at fault for inputs that cannot be planned at all (a task over a block the profile lacks,
/// no site, duplicate names, a rate, SLO or lane count out of range). A task that does not fit is
/// not an error: it is refused in the plan, with the reason.
absl::StatusOr<Plan> plan(const PlanInput& input, const PlanOptions& options = {});

/// @brief What the planner's model predicts for a placement it did not choose: every task of
/// `input` over the blocks where `placement` puts them, at their max_batch, no search. For a
/// deployment that runs already, e.g. with profiles taken again (`blockflow-plan --predict`). A task
/// that would not have been admitted there is marked so, with plan()'s reason (that task next to the
/// others on the same placement: an over-committed site refuses every task with a block there);
/// `predicted_p50_ms` is given either way. `input.tasks` are the tasks that run (a task plan()
/// refused would add its load). Each block's `workers` is the placement's (at least 1): a block's
/// wait depends on how many lanes may run it. InvalidArgument for the inputs plan() refuses, and naming a block with no placement,
/// a site that is not in `input.sites` or of another device, or a max_batch below 1.
absl::StatusOr<Plan> predict(const PlanInput& input, const std::vector<BlockPlacement>& placement);

/// @brief The placement of a deployment's blocks: a block placed in a worker on the site of that
/// name, one without placement on the first site of kind "threads" (InvalidArgument naming the block
/// when there is none), each with its max_batch.
absl::StatusOr<std::vector<BlockPlacement>> placement_of(const Deployment& deployment, const std::vector<PlanSite>& sites);

/// @brief Reads the planner's inputs: one or more profile files (their blocks merged; the first's
/// channels and machine), a tasks file and a sites file (docs/planner.md, "Inputs"). Errors name
/// the file and the field.
absl::StatusOr<PlanInput> load_plan_input(const std::vector<std::string>& profile_files, const std::string& tasks_file,
                                          const std::string& sites_file);
/// @brief The same from JSON text (`source` names it in errors).
absl::StatusOr<std::vector<PlanTask>> parse_plan_tasks(const std::string& json, const std::string& source = "tasks");
absl::StatusOr<std::vector<PlanSite>> parse_plan_sites(const std::string& json, const std::string& source = "sites");
/// @brief The optional "hosts" array of a sites file: [{"name": "local", "cores": 2}, ...].
absl::StatusOr<std::vector<PlanHost>> parse_plan_hosts(const std::string& json, const std::string& source = "sites");

}  // namespace blockflow
