#pragma once
// Helpers shared by the tests of blocks placed in worker processes.

#include "test_util.hpp"

#include <blockflow/worker_site.hpp>

#include <string>
#include <vector>

namespace blockflow::test {

/// A TorchScript test model as a block description, placed in `placement` ("" = the host's threads).
inline BlockDescription model_block(const std::string& name, const std::string& file, const std::string& placement,
                                    std::vector<std::int64_t> shape) {
  BlockDescription d;
  d.name = name;
  d.torchscript = model_path(file);
  d.placement = placement;
  d.options.intra_op_threads = 1;
  d.options.input_shapes = {std::move(shape)};
  return d;
}

/// A C++ block of the test plugin ("affine": 3x+1, "slow_identity": 5 ms then x), built by factory.
inline BlockDescription plugin_block(const std::string& name, const std::string& factory, const std::string& placement) {
  BlockDescription d;
  d.name = name;
  d.factory = factory;
  d.placement = placement;
  return d;
}

/// A worker that loads the test plugin and restarts quickly; `channel` as in WorkerOptions.
inline WorkerOptions test_worker(const std::string& name, const std::string& channel = "") {
  WorkerOptions o;
  o.name = name;
  o.channel = channel;
  o.plugins = {BLOCKFLOW_TEST_PLUGIN};
  o.restart_backoff = absl::Milliseconds(20);
  return o;
}

}  // namespace blockflow::test
