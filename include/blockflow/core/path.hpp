#pragma once
/// @file
/// @brief Path: the route of a task's requests through named blocks (a chain or a DAG).

#include <blockflow/core/tensor.hpp>

#include <absl/status/statusor.h>

#include <functional>
#include <string>
#include <vector>

namespace blockflow {

/// @brief How a node with several inputs merges them (fan-in).
///
/// Each input is the output list of one predecessor, in the order the node names its inputs.
/// Copyable, cheap, thread-safe (the function is called concurrently by compute lanes).
class Combine {
 public:
  using Fn = std::function<absl::StatusOr<Tensors>(std::vector<Tensors>&&)>;

  /// @brief Appends the inputs' lists: a block node then receives them as positional arguments
  /// (a TorchScript `forward(x, y)`). The default.
  static Combine pack();
  /// @brief Element-wise mean of the first tensor of every input (ensembles). Shapes must match.
  static Combine mean();
  /// @brief Concatenation of the first tensor of every input along `dim`.
  static Combine concat(std::int64_t dim = 1);
  /// @brief A user function; `name` appears in error messages and metrics.
  static Combine custom(std::string name, Fn fn);

  [[nodiscard]] const std::string& name() const { return name_; }
  /// @brief Applies the rule. Errors (shape mismatch, ...) come back as a status.
  [[nodiscard]] absl::StatusOr<Tensors> apply(std::vector<Tensors>&& inputs) const;

 private:
  Combine(std::string name, Fn fn) : name_(std::move(name)), fn_(std::move(fn)) {}
  std::string name_;
  Fn fn_;
};

/// @brief One node of a path: a block, or a block-less join.
struct PathNode {
  std::string name;                 ///< unique in the path; the block's name for block nodes
  std::string block;                ///< empty for a join node
  std::vector<std::string> inputs;  ///< names of predecessor nodes; empty: the request's input
  Combine combine = Combine::pack();
};

/// @brief The route of one task. A chain or a DAG with fan-out and fan-in; it must end in exactly
/// one node, whose output is the request's result. Validated when a session is built: an empty
/// path, an unknown block, an unknown input, a cycle (a block visited twice included) or several
/// outputs are rejected with a message naming the path. Value type; not thread-safe to mutate.
///
/// @code
/// // A chain shared-trunk classifier:
/// auto a = blockflow::Path::chain("task_a", {"block1", "block2", "block3", "block4"});
/// // An ensemble: one trunk, two heads, averaged.
/// blockflow::Path e("ensemble");
/// e.then("trunk").node("head_a", {"trunk"}).node("head_b", {"trunk"})
///  .join("avg", {"head_a", "head_b"}, blockflow::Combine::mean());
/// @endcode
class Path {
 public:
  explicit Path(std::string task) : task_(std::move(task)) {}

  /// @brief A chain through `blocks`, in order.
  static Path chain(std::string task, const std::vector<std::string>& blocks);

  /// @brief Appends a block node fed by the last node added (or by the request, if first).
  Path& then(std::string block);
  /// @brief Adds a block node fed by `inputs` (names of other nodes; empty: the request input).
  Path& node(std::string block, std::vector<std::string> inputs, Combine combine = Combine::pack());
  /// @brief Adds a block-less node that merges `inputs` with `combine`.
  Path& join(std::string name, std::vector<std::string> inputs, Combine combine);

  [[nodiscard]] const std::string& task() const { return task_; }
  [[nodiscard]] const std::vector<PathNode>& nodes() const { return nodes_; }

 private:
  std::string task_;
  std::vector<PathNode> nodes_;
};

}  // namespace blockflow
