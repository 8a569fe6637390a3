// Built against the installed package by the install_consumer ctest.
#include <blockflow/blockflow.hpp>

#include <ATen/ATen.h>  // tensor operators: blockflow.hpp only declares the Tensor type

#include <iostream>

int main() {
  namespace bf = blockflow;
  bf::Session session;
  session.add_block(bf::Block::callable("inc", [](bf::Tensors&& in) -> absl::StatusOr<bf::Tensors> {
    return bf::Tensors{in.at(0) + 1};
  })).add_path(bf::Path::chain("t", {"inc"}));
  if (!session.start().ok()) return 1;
  const bf::Result r = session.submit("t", at::zeros({1})).get();
  if (!r.ok() || r.output().item<float>() != 1.0f) return 1;
  std::cout << "consumer: ok (blockflow " << bf::kVersionString << ")\n";
  return 0;
}
