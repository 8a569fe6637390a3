// task_graph(): a planner task's chain or graph checked and put in an order where every node comes
// after its inputs.
#include "task_graph.hpp"

#include <blockflow/core/detail/topological_order.hpp>
#include <blockflow/deploy/detail/deployment_json.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <set>
#include <string_view>

namespace blockflow::detail {

absl::StatusOr<TaskGraph> task_graph(const PlanTask& t) {
  auto bad = [&](const std::string& what) { return absl::InvalidArgumentError(fmt::format("task '{}': {}", t.name, what)); };
  std::vector<PathNode> nodes = t.nodes;
  if (!t.path.empty() && !nodes.empty()) return bad("give a path (a chain) or nodes (a graph), not both");
  if (nodes.empty()) nodes = Path::chain(t.name, t.path).nodes();
  if (nodes.empty()) return bad("empty path");
  std::map<std::string, int> index;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    const auto& n = nodes[i];
    if (!index.emplace(n.name, static_cast<int>(i)).second) {
      return bad(n.block.empty() ? fmt::format("two nodes are named '{}'", n.name) : fmt::format("visits block '{}' twice", n.name));
    }
  }
  for (const auto& n : nodes) {
    if (n.block.empty() && n.inputs.size() < 2) return bad(fmt::format("join '{}' needs at least two inputs", n.name));
    if (n.inputs.size() > 1 && !detail::has_deployment_form(n.combine)) {
      return bad(fmt::format("node '{}': combine rule '{}' has no deployment form (pack, mean, concat)", n.name, n.combine.name()));
    }
    std::set<std::string_view> named;
    for (const auto& input : n.inputs) {
      if (index.count(input) == 0) return bad(fmt::format("node '{}': unknown input '{}'", n.name, input));
      if (!named.insert(input).second) return bad(fmt::format("node '{}' names input '{}' twice", n.name, input));
    }
  }
  std::vector<std::vector<int>> inputs(nodes.size());
  std::vector<bool> feeds(nodes.size(), false);
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    for (const auto& input : nodes[i].inputs) {
      inputs[i].push_back(index.at(input));
      feeds[static_cast<std::size_t>(index.at(input))] = true;
    }
  }
  const std::vector<int> order = detail::topological_order(inputs);
  if (order.size() != nodes.size()) return bad("has a cycle");
  TaskGraph g;
  std::vector<int> position(nodes.size());
  for (std::size_t k = 0; k < order.size(); ++k) position[static_cast<std::size_t>(order[k])] = static_cast<int>(k);
  for (const int i : order) {
    const auto& n = nodes[static_cast<std::size_t>(i)];
    TaskGraph::Node out{n.name, n.block, {}, {}};
    std::set<std::string_view> sources;
    for (const auto& input : n.inputs) {
      const int from = position[static_cast<std::size_t>(index.at(input))];
      out.inputs.push_back(from);
      if (n.block.empty()) {
        // Each source once: joins of joins that share sources would otherwise double them at each level.
        for (const auto& source : g.nodes[static_cast<std::size_t>(from)].sources) {
          if (sources.insert(source).second) out.sources.push_back(source);
        }
      }
    }
    if (!n.block.empty()) out.sources = {n.block};
    g.nodes.push_back(std::move(out));
  }
  std::vector<std::string> sinks;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    if (!feeds[i]) {
      sinks.push_back(nodes[i].name);
      g.sink = position[i];
    }
  }
  if (sinks.size() != 1) return bad(fmt::format("must end in exactly one node; it ends in {}", fmt::join(sinks, ", ")));
  return g;
}

}  // namespace blockflow::detail
