#pragma once
// Internal: one block description <-> JSON, the shape of docs in deployment.hpp (flat fields). The
// worker control protocol ships blocks in the same shape, so one parser validates both.
#include <blockflow/core/block_registry.hpp>
#include <blockflow/core/path.hpp>
#include <blockflow/deploy/deployment.hpp>

#include <absl/status/statusor.h>
#include <nlohmann/json.hpp>

#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace blockflow::detail {

/// A block as an object with every field. Paths are written as they are.
nlohmann::json block_to_json(const BlockDescription& description);
/// A block from a name (the TorchScript file <models_dir>/<name>.pt) or an object; relative
/// TorchScript paths are resolved against `models_dir` when it is not empty. Errors name the block
/// and the field.
absl::StatusOr<BlockDescription> block_from_json(const nlohmann::json& json, const std::string& models_dir,
                                                 bool confine = false);

/// A graph task's combine rule from its deployment name: "pack", "mean", "concat", "concat:DIM".
absl::StatusOr<Combine> combine_from_name(const std::string& name);
/// Whether a deployment can name `combine` (a built-in rule, not Combine::custom()).
bool has_deployment_form(const Combine& combine);

/// A graph task from its deployment form `{"nodes": [...]}` (deployment.hpp); block nodes must name
/// one of `blocks`. Errors name the task and the node.
absl::StatusOr<Path> graph_from_json(const std::string& task, const nlohmann::json& graph, const std::set<std::string>& blocks);
/// The "sites" object of a deployment: settings of sites that `placements` name; errors name the
/// site and the field.
absl::StatusOr<std::vector<SiteSettings>> sites_from_json(const nlohmann::json& sites, const std::vector<std::string>& placements);
/// The deployment form of a graph's nodes; their combine rules must have one (has_deployment_form()).
nlohmann::json graph_to_json(const std::vector<PathNode>& nodes);

/// Deepest nesting of JSON accepted from outside (a deployment, a control request): nlohmann's
/// parser recurses per level, so a 150 KB document of brackets would overflow the stack.
inline constexpr int kMaxJsonDepth = 64;
/// OK when no object or array in `text` nests deeper than `max_depth` (strings are skipped, so
/// brackets inside them do not count); else InvalidArgument naming the limit. Checks the text only.
absl::Status check_json_depth(std::string_view text, int max_depth = kMaxJsonDepth);

}  // namespace blockflow::detail
