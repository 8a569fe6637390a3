// Blocks in worker processes: a C++ block built by a plugin's factory runs in the child process
// "w1"; the next block runs in this process's threads. Tensors cross over the zero-copy
// shared-memory channel (the default for a child worker). The README's "Placing blocks in worker
// processes" snippet is this file between the readme markers (checked by a ctest).
//
//   worker_pipeline [PLUGIN.so]     (default: the plugin_blocks library built beside it)

#include <blockflow/blockflow.hpp>
#include <blockflow/worker/worker_site.hpp>

#include <ATen/ATen.h>

#include <iostream>

int main(int argc, char** argv) {
  const std::string plugin = argc > 1 ? argv[1] : BLOCKFLOW_EXAMPLE_PLUGIN;
  // [readme-start]
  namespace bf = blockflow;
  bf::WorkerOptions w1;
  w1.name = "w1";         // a child process (posix_spawn), supervised and restarted if it dies
  w1.plugins = {plugin};  // exports blockflow_register_blocks(): the C++ blocks w1 can build

  bf::BlockDescription scale;  // built inside w1 by the plugin's "scale" factory
  scale.name = "scale";
  scale.factory = "scale";     // or: scale.torchscript = "block1.pt";
  scale.placement = "w1";      // empty: this process's threads

  bf::Session session;
  session.add_site(bf::make_worker(w1))
      .add_block(scale)
      .add_block(bf::Block::callable("plus_one", [](bf::Tensors&& in) -> absl::StatusOr<bf::Tensors> {
        return bf::Tensors{in.at(0) + 1};
      }))
      .add_path(bf::Path::chain("task", {"scale", "plus_one"}));
  if (auto status = session.start(); !status.ok()) {  // waits until w1 has built and warmed its blocks
    std::cerr << status << "\n";
    return 1;
  }
  bf::Result r = session.submit("task", at::full({2}, 3.0)).get();
  std::cout << "task: " << r.output() << "\n";  // 3 * 10 + 1 = 31
  const bf::SiteStats w = session.metrics().sites.at(0);
  std::cout << "worker " << w.name << ": pid " << w.pid << ", channel " << w.data.kind << ", bytes copied in the hand-off "
            << w.data.bytes_copied << ", restarts " << w.restarts << "\n";
  // [readme-end]
  return r.ok() && at::equal(r.output(), at::full({2}, 31.0)) && w.data.kind == "shm" ? 0 : 1;
}
