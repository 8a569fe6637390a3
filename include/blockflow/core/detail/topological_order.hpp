#pragma once
// Internal: Kahn's order of a graph given as each node's inputs, shared by path compilation
// (routing.cpp) and the planner's task graphs.
#include <cstddef>
#include <vector>

namespace blockflow::detail {

/// The nodes (0..inputs.size()-1) in an order where each comes after all of its inputs (indices
/// into `inputs`), ready nodes first come first. Fewer entries than nodes when there is a cycle: the
/// missing ones lie on it or after it.
inline std::vector<int> topological_order(const std::vector<std::vector<int>>& inputs) {
  const std::size_t n = inputs.size();
  std::vector<int> pending(n);
  std::vector<std::vector<int>> successors(n);
  for (std::size_t i = 0; i < n; ++i) {
    pending[i] = static_cast<int>(inputs[i].size());
    for (const int p : inputs[i]) successors[static_cast<std::size_t>(p)].push_back(static_cast<int>(i));
  }
  std::vector<int> order;
  for (std::size_t i = 0; i < n; ++i) {
    if (pending[i] == 0) order.push_back(static_cast<int>(i));
  }
  for (std::size_t next = 0; next < order.size(); ++next) {
    for (const int s : successors[static_cast<std::size_t>(order[next])]) {
      if (--pending[static_cast<std::size_t>(s)] == 0) order.push_back(s);
    }
  }
  return order;
}

}  // namespace blockflow::detail
