#pragma once
// Helpers shared by the tests of blocks placed in worker processes.

#include "test_util.hpp"

#include <blockflow/worker/worker_site.hpp>

#include <atomic>
#include <csignal>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace blockflow::test {

/// Whether a process of that pid lives (a zombie counts until it is reaped).
inline bool process_exists(std::int64_t pid) { return pid > 0 && ::kill(static_cast<pid_t>(pid), 0) == 0; }

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

/// Submits `x` to `task` of both sessions (one in threads, one with workers) and requires both
/// results, showing the second one's error.
inline std::pair<Result, Result> both_ok(Session& threads, Session& workers, const std::string& task, const Tensor& x) {
  Result a = threads.submit(task, x).get();
  Result b = workers.submit(task, x).get();
  REQUIRE(a.ok());
  INFO(b.status.ToString());
  REQUIRE(b.ok());
  return {std::move(a), std::move(b)};
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

/// Clients that submit `task` (input `input`) in a loop from `threads` threads until finish(), sorting
/// what comes back: results that pass `good`, errors whose message contains `named`, and anything
/// else (the last such message is kept in `sample`). For the kill-under-load tests.
class LoadClients {
 public:
  LoadClients(Session& session, std::string task, Tensor input, int threads, std::string named_error,
              std::function<bool(const Tensor&)> good = [](const Tensor&) { return true; })
      : named_(std::move(named_error)), good_(std::move(good)) {
    for (int c = 0; c < threads; ++c) {
      clients_.emplace_back([this, &session, task, input] {
        while (run_) {
          ++submitted;
          auto pending = session.submit(task, input);
          // A request that never resolves is the bug these tests look for: counted, never waited
          // for past its deadline (finish() would join for ever).
          if (pending.wait_for(std::chrono::seconds(120)) != std::future_status::ready) {
            ++unresolved;
            return;
          }
          Result r = pending.get();
          ++resolved;
          const std::string message(r.status.message());
          if (r.ok() && good_(r.output())) {
            ++ok;
            continue;
          }
          ++(!r.ok() && message.find(named_) != std::string::npos ? named : other);
          std::lock_guard lock(mu_);
          sample = r.ok() ? "a wrong result" : message;
        }
      });
    }
  }
  ~LoadClients() { finish(); }
  /// Waits until `n` more results passed than now, or `within` went by; false on timeout.
  bool wait_ok(int n, std::chrono::milliseconds within = std::chrono::milliseconds(60000)) {
    const int target = ok.load() + n;
    const auto deadline = std::chrono::steady_clock::now() + within;
    while (ok.load() < target) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return true;
  }
  /// Once `n` results passed, kill -9 `pid`; then waits until `n` more passed (the worker is back)
  /// and stops the clients. False if a wait timed out or the kill failed.
  bool kill_under_load(std::int64_t pid, int n) {
    const bool killed = wait_ok(n) && ::kill(static_cast<pid_t>(pid), SIGKILL) == 0;
    const bool served = killed && wait_ok(n);
    finish();
    return served;
  }
  /// kill_under_load(), then what every kill test asserts: the worker served again, every request
  /// resolved, at least one failed naming the death, and none failed otherwise.
  void check_kill_under_load(std::int64_t pid, int n) {
    const bool served = kill_under_load(pid, n);
    INFO(sample);
    CHECK(served);
    CHECK(unresolved.load() == 0);
    CHECK(resolved.load() == submitted.load());
    CHECK(named.load() >= 1);
    CHECK(other.load() == 0);
  }
  /// Stops the clients once their requests in flight resolved.
  void finish() {
    run_ = false;
    for (auto& c : clients_) {
      if (c.joinable()) c.join();
    }
  }

  std::atomic<int> submitted{0}, resolved{0}, unresolved{0}, ok{0}, named{0}, other{0};
  std::string sample;  // read after finish()

 private:
  std::string named_;
  std::function<bool(const Tensor&)> good_;
  std::atomic<bool> run_{true};
  std::mutex mu_;
  std::vector<std::thread> clients_;
};

}  // namespace blockflow::test
