#pragma once
// Helpers shared by the test files.

#include <blockflow/blockflow.hpp>

#include <ATen/ATen.h>
#include <catch2/catch.hpp>

#include <chrono>
#include <string>
#include <thread>

namespace blockflow::test {

inline std::string model_path(const std::string& file) { return std::string(BLOCKFLOW_TEST_MODELS_DIR) + "/" + file; }

/// Loads a test model as a block; fails the test with the status message otherwise.
inline std::shared_ptr<Block> load_block(const std::string& name, const std::string& file, BlockOptions options = {}) {
  auto block = load_torchscript_block(name, model_path(file), std::move(options));
  INFO(block.status().ToString());
  REQUIRE(block.ok());
  return *block;
}

/// A callable block computing fn(first input).
template <typename F>
std::shared_ptr<Block> unary(const std::string& name, F fn, BlockOptions options = {}) {
  return Block::callable(
      name, [fn](Tensors&& in) -> absl::StatusOr<Tensors> { return Tensors{fn(in.at(0))}; }, std::move(options));
}

/// A callable block that sleeps, then returns its input + 1.
inline std::shared_ptr<Block> slow_plus_one(const std::string& name, std::chrono::milliseconds delay,
                                            BlockOptions options = {}) {
  return unary(name, [delay](const Tensor& x) {
    std::this_thread::sleep_for(delay);
    return x + 1;
  }, std::move(options));
}

inline void require_started(Session& session) {
  auto status = session.start();
  INFO(status.ToString());
  REQUIRE(status.ok());
}

/// True once `condition()` holds, polled every 10 ms; false if it still does not after `within`.
template <typename F>
bool eventually(F condition, std::chrono::milliseconds within = std::chrono::milliseconds(5000)) {
  const auto deadline = std::chrono::steady_clock::now() + within;
  while (std::chrono::steady_clock::now() < deadline) {
    if (condition()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return condition();
}

}  // namespace blockflow::test
