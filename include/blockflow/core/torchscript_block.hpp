#pragma once
/// @file
/// @brief Blocks loaded from TorchScript files.

#include <blockflow/core/block.hpp>

#include <absl/status/statusor.h>

#include <memory>
#include <string>

namespace blockflow {

/// @brief How a TorchScript file becomes a block.
struct TorchScriptOptions {
  /// Freeze the module (inline parameters, fold conv+batch-norm). Measured on this project's
  /// machine: frozen ResNet50 runs batch 2-4 at ~2x the throughput of the unfrozen module.
  bool freeze = true;
  /// Also run torch::jit::optimize_for_inference on the frozen module of a CPU block (convolutions
  /// through oneDNN with prepacked weights; blocks on a GPU stay as frozen). Measured on this
  /// project's 2-core machine, 2 intra-op threads: the four split ResNet50 blocks take 62 ms per
  /// image against 83 ms frozen only, and 94 ms instead of ~1 s with one thread
  /// (bench/pipeline_bench --optimize 0|1 compares them).
  bool optimize_for_inference = true;
};

/// @brief Loads a TorchScript file as a block named `name`.
///
/// The module's forward() may take one or several tensors and return a tensor, or a tuple/list of
/// tensors (flattened in order into the block's outputs). The module is put in eval mode, moved to
/// options.device and frozen where TorchScript allows it (a module that cannot be frozen is used
/// as loaded, and kind() still says "torchscript"). Returns NotFound/InvalidArgument naming the
/// file and the block when the file is missing or is not TorchScript.
absl::StatusOr<std::shared_ptr<Block>> load_torchscript_block(std::string name, const std::string& file,
                                                              BlockOptions options = {},
                                                              TorchScriptOptions ts_options = {});

}  // namespace blockflow
