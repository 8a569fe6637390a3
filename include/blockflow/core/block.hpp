#pragma once
/// @file
/// @brief Block: a named unit of compute (a TorchScript module or a C++ callable).

#include <blockflow/channel/channel.hpp>
#include <blockflow/core/tensor.hpp>

#include <absl/status/statusor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace blockflow {

/// @brief How a block runs inside a session.
struct BlockOptions {
  /// "cpu", "cuda", "cuda:1", ... Inputs are moved to this device before forward().
  std::string device = "cpu";
  /// libtorch intra-op threads the block asks for; it runs with its session's lanes' setting
  /// (SessionOptions::intra_op_threads, by default the largest of its blocks'). Debian's CPU
  /// libtorch runs convolutions ~10x slower with 1 thread than with 2: set this deliberately.
  int intra_op_threads = 0;
  /// At most this many compute lanes run the block at once (above 1, forward() must be thread-safe;
  /// a block in a worker process: lanes of that process).
  int workers = 1;
  /// Bound of the block's input queue, and what happens when it is full.
  std::size_t queue_capacity = 64;
  FullPolicy full_policy = FullPolicy::kBlock;
  /// Expected input shapes, one per input; -1 matches any size. When set, inputs are checked
  /// before forward() (a mismatch fails the request with a message naming the block) and each
  /// worker warms the block up on zeros of this shape (-1 read as 1) before traffic arrives.
  std::vector<std::vector<std::int64_t>> input_shapes;
  /// Element types of the inputs, one per input_shapes entry (so only with input_shapes); empty:
  /// float32 warm-up zeros and no dtype check. When set, warm-up's zeros take these dtypes and an
  /// input of another dtype fails the request with a message naming the block, the input and both
  /// dtypes: a block of token ids says {at::kLong}. Deployment key "input_dtypes": ["int64"]
  /// (the names of dtype_name()).
  std::vector<at::ScalarType> input_dtypes;
  /// Warm-up forward passes, on a compute lane, before start() or apply() returns (only with
  /// input_shapes). TorchScript's profiling executor profiles the first call and optimises on the
  /// second; measured on the build machine (split ResNet50, 2 threads), the first request after 2
  /// warm-up runs takes its steady-state time (33.7 ms, as after 3), so 2 is the default
  /// (bench/cold_start_bench --warmup-runs N compares).
  int warmup_runs = 2;
  /// Dynamic batching: with max_batch > 1, a lane that takes a request also takes what else is
  /// waiting in the queue, from any task, up to max_batch requests or until max_batch_delay_ms has
  /// passed since the first of them entered the queue. Requests whose inputs agree in count, dtype,
  /// device and every dimension but the first are stacked along dimension 0 and run in one
  /// forward(); each output is split back by the requests' row counts (the block must keep rows
  /// apart: output rows = input rows). Others run alone. Time spent waiting for the batch counts as
  /// the request's wait.
  int max_batch = 1;
  double max_batch_delay_ms = 2.0;
  /// Resident memory the block adds where it runs, as profiled (BlockProfile::memory_bytes; the
  /// planner writes it into deployments); 0: unknown. A site with a memory budget
  /// (SessionOptions::memory_budget, WorkerOptions::memory_budget) refuses, at start() and
  /// apply(), blocks whose profiled memory exceeds it; after loading, the session compares what
  /// the site's memory grew by with the profile (docs/planner.md, "Admission").
  std::int64_t memory_bytes = 0;
  /// CUDA graphs (a block on a CUDA device, with input_shapes; a libtorch with CUDA): at warm-up
  /// the block's forward() is captured into a CUDA graph for the warm-up shapes, and requests of
  /// those shapes replay it (their inputs copied into the graph's, its outputs cloned out, on the
  /// caller's stream); other shapes (a batch of another size) run eagerly. BlockMetrics'
  /// cuda_graph_* fields count both. docs/gpu.md, "CUDA graphs".
  bool cuda_graph = false;
};

/// @brief What a block with BlockOptions::cuda_graph did since it was made.
struct CudaGraphStats {
  std::uint64_t graphs = 0;      ///< input shapes captured (one CUDA graph each)
  std::uint64_t replays = 0;     ///< forward() calls served by replaying a graph
  std::uint64_t eager_runs = 0;  ///< forward() calls after the capture whose shapes had no graph
};

/// The largest BlockOptions::max_batch.
inline constexpr int kMaxBatchSize = 4096;

/// @brief Checks a block's options, the one rule for every way a block is made (Block's
/// constructor, Deployment::parse(), worker configurations): a device libtorch parses and that is
/// cpu or cuda[:N], workers >= 1, queue_capacity >= 1, intra_op_threads from 0 to 1024, max_batch
/// from 1 to 4096, max_batch_delay_ms from 0 to 60000, warmup_runs >= 0, memory_bytes >= 0, input_shapes whose element counts
/// fit 64 bits and whose only negative dimension is -1 (any size, counting as 1), input_dtypes one per input_shape and each
/// a dtype dtype_name() names, cuda_graph only on a CUDA device and with input_shapes. InvalidArgument naming the block and
/// the field.
absl::Status validate(const std::string& block, const BlockOptions& options);

/// @brief A unit of compute with a name and a device.
///
/// Contract: forward() receives the request's tensors already on device(); it returns the output
/// tensors or an error status; an exception escaping forward() is caught by the session and fails
/// the request with a message naming the block. forward() must not modify its inputs in place:
/// with fan-out, several blocks may hold the same tensor. With BlockOptions::workers > 1 it is
/// called concurrently and must be thread-safe. Blocks are immutable once built, hence shareable by
/// any number of paths and sessions.
class Block {
 public:
  /// @brief The signature of a C++ callable block.
  using Fn = std::function<absl::StatusOr<Tensors>(Tensors&&)>;

  Block(std::string name, BlockOptions options);
  virtual ~Block();
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;

  [[nodiscard]] const std::string& name() const { return name_; }
  [[nodiscard]] const BlockOptions& options() const { return options_; }
  [[nodiscard]] c10::Device device() const { return device_; }
  /// @brief "callable" or "torchscript".
  [[nodiscard]] virtual std::string_view kind() const = 0;

  /// @brief Runs the block (see the class comment for the contract).
  virtual absl::StatusOr<Tensors> forward(Tensors&& inputs) = 0;

  /// @brief A block from a C++ callable.
  /// @code
  /// auto twice = blockflow::Block::callable("twice", [](blockflow::Tensors&& in)
  ///     -> absl::StatusOr<blockflow::Tensors> { return blockflow::Tensors{in.at(0) * 2}; });
  /// @endcode
  /// Throws std::invalid_argument, with validate()'s message, for an empty name or callable or an
  /// option out of range (device, workers, queue_capacity, max_batch, max_batch_delay_ms, cuda_graph).
  static std::shared_ptr<Block> callable(std::string name, Fn fn, BlockOptions options = {});

 private:
  std::string name_;
  BlockOptions options_;
  c10::Device device_;
};

/// @brief Checks `inputs` against `block.options().input_shapes` and `input_dtypes` (if any). The
/// message names the block, the input and both shapes or dtypes.
absl::Status check_inputs(const Block& block, const Tensors& inputs);

}  // namespace blockflow
