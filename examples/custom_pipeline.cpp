// A custom pipeline in a few lines: C++ callable blocks, a shared trunk, an ensemble join.
// The README's snippet is this file between the readme markers (checked by a ctest).

#include <blockflow/blockflow.hpp>

#include <ATen/ATen.h>

#include <iostream>

int main() {
  // [readme-start]
  namespace bf = blockflow;
  auto unary = [](std::string name, auto fn) {
    return bf::Block::callable(std::move(name), [fn](bf::Tensors&& in) -> absl::StatusOr<bf::Tensors> {
      return bf::Tensors{fn(in.at(0))};
    });
  };

  bf::Session session;
  session.add_block(unary("trunk", [](const at::Tensor& x) { return x * 2; }))
      .add_block(unary("head_a", [](const at::Tensor& x) { return x + 1; }))
      .add_block(unary("head_b", [](const at::Tensor& x) { return x - 1; }))
      // Two tasks share the trunk; a third averages both heads (an ensemble).
      .add_path(bf::Path::chain("task_a", {"trunk", "head_a"}))
      .add_path(bf::Path::chain("task_b", {"trunk", "head_b"}))
      .add_path(bf::Path("ensemble")
                    .then("trunk")
                    .node("head_a", {"trunk"})
                    .node("head_b", {"trunk"})
                    .join("avg", {"head_a", "head_b"}, bf::Combine::mean()));
  if (auto status = session.start(); !status.ok()) {
    std::cerr << status << "\n";  // e.g. "path 'task_a': unknown block 'trunk2'"
    return 1;
  }

  bf::Result r = session.submit("ensemble", at::full({2}, 3.0)).get();
  std::cout << "ensemble: " << r.output() << "\n";  // (3*2+1 + 3*2-1) / 2 = 6
  std::cout << "e2e " << r.trace.e2e_ms() << " ms = wait " << r.trace.wait_ms() << " + compute "
            << r.trace.compute_ms() << " + overhead " << r.trace.overhead_ms() << "\n";
  std::cout << session.metrics().to_json(2) << "\n";
  // [readme-end]
  return at::equal(r.output(), at::full({2}, 6.0)) ? 0 : 1;
}
