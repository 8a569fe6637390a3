#pragma once
// Internal: blocks that hand tensors to each other in oneDNN's blocked layout.
//
// optimize_for_inference() wraps a CPU module's oneDNN convolutions in aten::to_mkldnn at the input
// and aten::to_dense at the output. Between two such blocks of one process those two reorders
// cancel out: the first block's last op already holds the tensor the second block's first op wants.
// Cut at three points, ResNet50 pays six reorders of 0.8-3.2 MB per request, 4-6% of the whole
// model on the build machine (docs/lanes.md, "Layouts between blocks"). A session skips them on
// an edge between two blocks that both support it (PlanNode::keep_layout); an opaque tensor never
// leaves such an edge: not to a client, a join, a batch, a remote site or a C++ callable block.

#include <blockflow/core/tensor.hpp>

#include <absl/status/statusor.h>

namespace blockflow::detail {

class OpaqueLayout {
 public:
  virtual ~OpaqueLayout() = default;
  /// Its one input may arrive in oneDNN's layout (the module's first op on it is to_mkldnn).
  [[nodiscard]] virtual bool takes_opaque() const = 0;
  /// It can return its one output in oneDNN's layout (the module's last op is to_dense).
  [[nodiscard]] virtual bool gives_opaque() const = 0;
  /// forward() with the input in whatever layout it arrives, the output opaque when asked (and
  /// gives_opaque()). Same contract as Block::forward() otherwise.
  virtual absl::StatusOr<Tensors> forward_layout(Tensors&& inputs, bool opaque_output) = 0;
};

/// True when `inputs` is one tensor in oneDNN's opaque layout.
inline bool is_opaque(const Tensors& inputs) { return inputs.size() == 1 && inputs.front().defined() && inputs.front().is_mkldnn(); }

}  // namespace blockflow::detail
