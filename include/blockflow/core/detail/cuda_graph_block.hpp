#pragma once
/// @file
/// @brief CUDA graphs per block (BlockOptions::cuda_graph, deployment key "cuda_graph"): a block
/// wrapper that captures the inner block's forward() once per warm-up input shape into a CUDA
/// graph and replays it for requests of that shape; other shapes run eagerly. See docs/gpu.md.

#include <blockflow/core/block.hpp>

#include <absl/status/status.h>

#include <cstdint>
#include <memory>
#include <optional>

namespace blockflow::detail {

/// @brief Ok where this build can capture CUDA graphs (a libtorch with CUDA); else
/// Unimplemented, saying so.
absl::Status cuda_graphs_available();

/// @brief A block whose forward() replays CUDA graphs. Requests of a captured shape are copied
/// into the graph's input tensors, the graph is replayed on the caller's current stream and the
/// outputs are cloned out of the graph's memory (two device-to-device copies per call, no host
/// synchronisation); calls are serialised per block. Blocks stay immutable for their users:
/// capture() runs during warm-up, before traffic.
class CudaGraphBlock : public Block {
 public:
  using Block::Block;
  /// @brief Runs the inner block eagerly (twice, on a side stream) and captures it for the shapes
  /// of `example` (already on the block's device). Idempotent per shape.
  virtual absl::Status capture(const Tensors& example) = 0;
  [[nodiscard]] virtual CudaGraphStats counters() const = 0;
};

/// @brief Wraps `inner` (on a CUDA device). FailedPrecondition naming the block on a CPU device;
/// Unimplemented where cuda_graphs_available() is not ok.
absl::StatusOr<std::shared_ptr<Block>> make_cuda_graph_block(std::shared_ptr<Block> inner);

/// @brief What every warm-up ends with: captures `block`'s graph for `example` when it is a
/// CudaGraphBlock; Ok for any other block.
absl::Status capture_cuda_graph(Block& block, const Tensors& example);

/// @brief `block`'s counters when it is a CudaGraphBlock; nullopt otherwise.
std::optional<CudaGraphStats> cuda_graph_stats(const Block& block);

}  // namespace blockflow::detail
