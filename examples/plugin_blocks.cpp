// A worker plugin: C++ blocks that worker processes can build by name. A worker dlopen()s each
// library in WorkerOptions::plugins and calls its blockflow_register_blocks(); a BlockDescription
// with `factory = "scale"` placed in that worker is then built there. (TorchScript blocks need no
// plugin: a description with `torchscript = "file.pt"` is loaded by the worker itself.)
#include <blockflow/core/block_registry.hpp>

#include <ATen/ATen.h>

extern "C" void blockflow_register_blocks(blockflow::BlockRegistry& registry) {
  registry.add("scale", [](const std::string& name, const blockflow::BlockOptions& options) {
    return blockflow::Block::callable(
        name,
        [](blockflow::Tensors&& in) -> absl::StatusOr<blockflow::Tensors> { return blockflow::Tensors{in.at(0) * 10}; },
        options);
  });
}
