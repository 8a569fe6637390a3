#pragma once
// Internal: a Path compiled against a session's blocks, and the table of those plans.
//
// Plans are immutable and shared: a request keeps the plan it was submitted with, so replacing the
// routing table (live updates) never changes the route of a request in flight.

#include <blockflow/channel/channel.hpp>
#include <blockflow/core/path.hpp>

#include <absl/container/flat_hash_map.h>
#include <absl/status/statusor.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace blockflow::detail {

struct BlockRuntime;
struct PathRuntime;

/// One outgoing edge of a plan node.
struct PlanEdge {
  int node = -1;  ///< successor node index
  int slot = 0;   ///< position of this edge among the successor's inputs
};

struct PlanNode {
  std::string name;
  BlockRuntime* block = nullptr;     ///< null for a join node
  TensorChannel* channel = nullptr;  ///< delivers to this node's block (null for a join)
  std::vector<int> inputs;           ///< predecessor node indices, in the order of PathNode::inputs
  std::vector<PlanEdge> successors;
  int join_index = -1;               ///< index into RequestState::joins when inputs.size() > 1
  Combine combine = Combine::pack();
  /// The block hands its output to its one successor in oneDNN's layout (detail::OpaqueLayout):
  /// both run on this process's lanes, neither batches, the successor is no join.
  bool keep_layout = false;
};

struct PathPlan {
  std::string task;
  std::vector<PlanNode> nodes;
  std::vector<int> entries;  ///< nodes fed by the request input
  int sink = -1;             ///< the node whose output is the result
  int num_joins = 0;
  /// The task's counters. Shared: whoever drops the last plan of a removed task frees them, after
  /// its last use of them (collect_retired() only lets go of the session's reference).
  std::shared_ptr<PathRuntime> metrics;
  /// Set by the destructor, with release ordering, on the thread that dropped the plan last: a
  /// session that reads it true (acquire) may free the removed blocks and sites the plan reached,
  /// every access made through the plan being ordered before (a weak_ptr's expiry is not).
  std::shared_ptr<std::atomic<bool>> gone = std::make_shared<std::atomic<bool>>(false);

  PathPlan() = default;
  PathPlan(const PathPlan&) = delete;
  PathPlan& operator=(const PathPlan&) = delete;
  ~PathPlan() { gone->store(true, std::memory_order_release); }
};

/// Resolves a block name to the runtime that executes it (null: unknown block).
using BlockLookup = std::function<BlockRuntime*(const std::string&)>;

/// Validates `path` and compiles it. Errors name the path and the problem: empty path, unknown
/// block, unknown input, duplicate node, cycle, or not exactly one output node.
absl::StatusOr<std::shared_ptr<const PathPlan>> compile_path(const Path& path, const BlockLookup& lookup,
                                                             const std::function<TensorChannel*(BlockRuntime*)>& channel_of);

/// task -> plan. Replaced as a whole; never mutated once published.
struct RoutingTable {
  absl::flat_hash_map<std::string, std::shared_ptr<const PathPlan>> plans;
};

}  // namespace blockflow::detail
