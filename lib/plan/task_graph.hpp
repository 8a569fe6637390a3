#pragma once
// A planner task's route, chain or graph, as one shape (lib/plan only).
#include <blockflow/plan/planner.hpp>

#include <absl/status/statusor.h>

#include <string>
#include <vector>

namespace blockflow::detail {

// A task's route, chain or graph, as one shape: its nodes in an order where every node comes after
// its inputs, the block of each (empty for a join), its inputs (indices into `nodes`) and, per node,
// the blocks whose outputs reach it through it (itself, or a join's inputs' blocks).
struct TaskGraph {
  struct Node {
    std::string name, block;
    std::vector<int> inputs;
    std::vector<std::string> sources;  // blocks that hand their outputs on through this node
  };
  std::vector<Node> nodes;
  int sink = -1;

  std::vector<std::string> blocks() const {
    std::vector<std::string> out;
    for (const auto& n : nodes) {
      if (!n.block.empty()) out.push_back(n.block);
    }
    return out;
  }
};

// The graph of `t`'s path or nodes; InvalidArgument naming the task for a route that is not one.
absl::StatusOr<TaskGraph> task_graph(const PlanTask& t);

}  // namespace blockflow::detail
