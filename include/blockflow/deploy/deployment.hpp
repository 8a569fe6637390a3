#pragma once
/// @file
/// @brief Deployment: the declarative description of what a session runs (its blocks, where each
/// runs, and each task's path), parsed from JSON. It is the format an optimiser sends: the
/// reference's `{"blocks": ["block1", ...], "tasks": {"task1": ["block1", ...]}}` is accepted as is
/// (a block given by name is the TorchScript file `<models dir>/<name>.pt`, in the host's threads),
/// and each block may instead be an object with the fields below.
///
/// @code
/// {"blocks": ["block1",
///             {"name": "block2", "torchscript": "b2.pt", "placement": "w1", "intra_op_threads": 2,
///              "workers": 1, "queue_capacity": 64, "full_policy": "reject", "device": "cpu",
///              "input_shapes": [[-1, 256, 56, 56]], "warmup_runs": 1, "memory_bytes": 104857600,
///              "max_batch": 4, "max_batch_delay_ms": 2, "freeze": true, "optimize_for_inference": true},
///             {"name": "block3", "torchscript": "b3.pt", "device": "cuda:0", "cuda_graph": true,
///              "input_shapes": [[-1, 512, 28, 28]]},
///             {"name": "scale", "factory": "scale", "placement": "w1"}],
///  "tasks": {"task1": ["block1", "block2"], "task2": ["block1", "scale"]}}
/// @endcode
///
/// A task is a chain (a list of block names) or a graph with fan-out and fan-in, as
/// blockflow::Path builds it: its nodes in any order, each a block (`"block"`, the node's name
/// too) or a block-less join (`"join"`: its name), fed by `"inputs"` (node names; none: the
/// request), merging several inputs with `"combine"`: "pack" (the default: positional inputs),
/// "mean", "concat" (along dimension 1) or "concat:DIM". Exactly one node feeds no other: its
/// output is the result.
///
/// Sites that blocks are placed in may carry settings (SiteSettings), read when the site starts:
///
/// @code
/// "sites": {"w1": {"memory": {"budget": 104857600, "policy": "on_demand", "measure": "blocks"}, "lanes": 1}}
/// @endcode
///
/// Spellings: `full_policy` is "block", "reject" or "drop-oldest"; `memory.policy` "admit" or
/// "on_demand"; `memory.measure` "blocks" or "process". Tasks keep the file's order (Deployment::order).
///
/// @code
/// "tasks": {"ensemble": {"nodes": [{"block": "trunk"},
///                                  {"block": "head_a", "inputs": ["trunk"]},
///                                  {"block": "head_b", "inputs": ["trunk"]},
///                                  {"join": "avg", "inputs": ["head_a", "head_b"], "combine": "mean"}]}}
/// @endcode

#include <blockflow/core/block_registry.hpp>
#include <blockflow/core/path.hpp>

#include <absl/status/statusor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace blockflow {

class Session;

/// @brief Settings of a worker site that blocks are placed in: the deployment's
/// `"sites": {"w1": {"memory": {"budget": BYTES, "policy": "on_demand"}, "lanes": 1}}`. Read when the
/// site starts (add_deployment(), or the apply() that makes it); a running site keeps the settings
/// it started with. Fields left out keep the defaults the site is made with (WorkerOptions).
struct SiteSettings {
  std::string name;
  std::int64_t memory_budget = 0;  ///< "memory": {"budget": BYTES}; 0: the default
  std::string memory_policy;       ///< "memory": {"policy": "admit" | "on_demand"}; "": the default
  std::string memory_measure;      ///< "memory": {"measure": "blocks" | "process"}; "": the default
  int lanes = 0;                   ///< "lanes": compute lanes of the worker; 0: the default
};

/// @brief A parsed, validated deployment.
struct Deployment {
  std::vector<BlockDescription> blocks;
  std::vector<std::pair<std::string, std::vector<std::string>>> tasks;  ///< task -> chain of blocks, in file order
  std::vector<Path> graphs;  ///< the tasks given as graphs ({"nodes": [...]}), in file order
  /// Every task's name in file order, chains and graphs together (parse() sets it; paths() follows
  /// it when it names as many tasks as there are; empty: chains first, then graphs).
  std::vector<std::string> order;
  /// Blocks given by a bare name (the reference's form). Session::apply() keeps a running block of
  /// that name as it is, whatever it is (a C++ callable included).
  std::vector<std::string> bare_names;
  /// When set, Session::apply() refuses, naming it, an update that leaves out a block added in code
  /// as a C++ object (Session::add_block() with a Block): no deployment could bring it back. The
  /// control endpoint sets it on every deployment it receives; in C++ leaving such a block out
  /// removes it, as asked.
  bool keep_code_blocks = false;
  /// Settings of the sites named by placements (only those the deployment gives settings for).
  std::vector<SiteSettings> sites;

  /// @brief Parses and validates `json`. Relative TorchScript paths (and bare block names) are
  /// resolved against `models_dir`. Every error is InvalidArgument and names the field, block or
  /// task at fault: not JSON, unknown key, wrong type, empty or duplicate name, a block that is
  /// neither TorchScript nor factory, an unknown full_policy, a task naming an unknown block or
  /// visiting a block twice, an empty task, a block, task or placement name that breaks the rule of
  /// names.hpp. Files are not opened here (start() does).
  ///
  /// With `confine_to_models_dir` (what the control endpoint does with deployments from the wire),
  /// every TorchScript path (a bare block name's NAME.pt too) must lie inside `models_dir` once
  /// symbolic links are resolved, and may not contain `..`; one outside is refused with a message
  /// that does not say whether the file exists. A confined block's warm-up is bounded too: each of
  /// its input_shapes at most 8 dimensions and 2^28 elements, warmup_runs at most 16.
  static absl::StatusOr<Deployment> parse(const std::string& json, const std::string& models_dir = ".",
                                          bool confine_to_models_dir = false);

  /// @brief The worker names the blocks are placed in, sorted, without duplicates.
  [[nodiscard]] std::vector<std::string> workers() const;
  /// @brief The settings of site `name`: its entry of `sites`, or defaults (only the name set).
  [[nodiscard]] SiteSettings site(const std::string& name) const;
  /// @brief The tasks as paths, in `order` (the file's) when parse() set it; else the chains, then the graphs.
  [[nodiscard]] std::vector<Path> paths() const;
};

/// @brief Reads a file and parses it (errors name the file). Relative TorchScript paths and bare
/// block names resolve against `models_dir`; "" (the default) means the file's own directory
/// (Deployment::parse() defaults to the current one).
absl::StatusOr<Deployment> load_deployment(const std::string& file, const std::string& models_dir = "");

}  // namespace blockflow
