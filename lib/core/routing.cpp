#include <blockflow/core/detail/routing.hpp>
#include <blockflow/core/detail/topological_order.hpp>

#include <absl/container/flat_hash_map.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

namespace blockflow::detail {
namespace {

absl::Status path_error(const Path& path, const std::string& problem) {
  return absl::InvalidArgumentError(fmt::format("path '{}': {}", path.task(), problem));
}

// On a cycle, names the nodes that could not be ordered.
absl::Status check_acyclic(const Path& path, const std::vector<std::vector<int>>& inputs) {
  const std::vector<int> order = topological_order(inputs);
  if (order.size() == inputs.size()) return absl::OkStatus();
  std::vector<bool> ordered(inputs.size(), false);
  for (const int i : order) ordered[static_cast<std::size_t>(i)] = true;
  std::vector<std::string> stuck;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (!ordered[i]) stuck.push_back(path.nodes()[i].name);
  }
  return path_error(path, fmt::format("has a cycle through nodes {}", fmt::join(stuck, ", ")));
}

}  // namespace

absl::StatusOr<std::shared_ptr<const PathPlan>> compile_path(
    const Path& path, const BlockLookup& lookup, const std::function<TensorChannel*(BlockRuntime*)>& channel_of) {
  if (path.task().empty()) return absl::InvalidArgumentError("a path needs a non-empty task name");
  const auto& nodes = path.nodes();
  if (nodes.empty()) return path_error(path, "is empty (it names no block)");

  absl::flat_hash_map<std::string, int> index;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    const auto& node = nodes[i];
    if (node.name.empty()) return path_error(path, fmt::format("node {} has no name", i));
    if (!index.emplace(node.name, static_cast<int>(i)).second) {
      return path_error(path, node.block.empty()
                                  ? fmt::format("has two nodes named '{}'", node.name)
                                  : fmt::format("has a cycle: block '{}' appears twice", node.name));
    }
  }

  auto plan = std::make_shared<PathPlan>();
  plan->task = path.task();
  plan->nodes.resize(nodes.size());
  std::vector<std::vector<int>> inputs(nodes.size());
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    const auto& node = nodes[i];
    auto& out = plan->nodes[i];
    out.name = node.name;
    out.combine = node.combine;
    if (!node.block.empty()) {
      out.block = lookup(node.block);
      if (out.block == nullptr) return path_error(path, fmt::format("unknown block '{}'", node.block));
      out.channel = channel_of(out.block);
    } else if (node.inputs.empty()) {
      return path_error(path, fmt::format("join '{}' has no inputs", node.name));
    }
    for (const auto& input : node.inputs) {
      auto it = index.find(input);
      if (it == index.end()) {
        return path_error(path, fmt::format("node '{}' takes input from '{}', which is not in the path", node.name,
                                            input));
      }
      if (std::find(inputs[i].begin(), inputs[i].end(), it->second) != inputs[i].end()) {
        return path_error(path, fmt::format("node '{}' names input '{}' twice", node.name, input));
      }
      inputs[i].push_back(it->second);
    }
  }
  if (auto status = check_acyclic(path, inputs); !status.ok()) return status;

  for (std::size_t i = 0; i < nodes.size(); ++i) {
    auto& node = plan->nodes[i];
    node.inputs = inputs[i];
    if (node.inputs.empty()) plan->entries.push_back(static_cast<int>(i));
    if (node.inputs.size() > 1) node.join_index = plan->num_joins++;
    for (std::size_t slot = 0; slot < node.inputs.size(); ++slot) {
      plan->nodes[static_cast<std::size_t>(node.inputs[slot])].successors.push_back(
          PlanEdge{static_cast<int>(i), static_cast<int>(slot)});
    }
  }
  std::vector<std::string> sinks;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    if (plan->nodes[i].successors.empty()) {
      sinks.push_back(plan->nodes[i].name);
      plan->sink = static_cast<int>(i);
    }
  }
  if (sinks.size() != 1) {
    return path_error(path, fmt::format("has {} output nodes ({}); a path must end in exactly one node (add a join)",
                                        sinks.size(), fmt::join(sinks, ", ")));
  }
  return std::shared_ptr<const PathPlan>(std::move(plan));
}

}  // namespace blockflow::detail
