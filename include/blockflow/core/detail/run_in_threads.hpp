#pragma once
// Internal: independent steps run side by side (sites started or updated together).

#include <cstddef>
#include <thread>
#include <vector>

namespace blockflow::detail {

/// Runs step(0) ... step(n - 1), each on a thread of its own, and returns once all have. A step
/// whose thread cannot be made (the process's thread limit, no memory) runs on the calling thread
/// instead, in turn: nothing is left unrun and no started thread is left unjoined.
template <typename Step>
void run_in_threads(std::size_t n, const Step& step) {
  if (n == 1) {
    step(std::size_t{0});
    return;
  }
  std::vector<std::thread> threads;
  try {
    threads.reserve(n);
  } catch (...) {
    for (std::size_t i = 0; i < n; ++i) step(i);
    return;
  }
  for (std::size_t i = 0; i < n; ++i) {
    try {
      threads.emplace_back([&step, i] { step(i); });
    } catch (...) {
      step(i);
    }
  }
  for (auto& t : threads) t.join();
}

}  // namespace blockflow::detail
