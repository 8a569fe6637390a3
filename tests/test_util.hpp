#pragma once
// Helpers shared by the test files.

#include <blockflow/blockflow.hpp>
#include <blockflow/deploy/deployment.hpp>

#include <ATen/ATen.h>
#include <catch2/catch.hpp>

#include <ftw.h>
#include <sys/stat.h>

#include <atomic>
#include <condition_variable>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace blockflow::test {

/// Removes a directory tree, links not followed (best effort). Not std::filesystem::remove_all:
/// PyTorch wheels' libtorch exports its own std::filesystem symbols (pytorch/pytorch#133437), and on
/// the GPU machine a test's call bound to theirs crashed.
inline void remove_tree(const std::string& dir) {
  (void)::nftw(
      dir.c_str(), [](const char* path, const struct stat*, int, struct FTW*) {
        (void)::remove(path);
        return 0;
      }, 16,
      FTW_DEPTH | FTW_PHYS);
}

/// The process's log messages while it lives (set_log_sink()).
class LogLines {
 public:
  LogLines() {
    set_log_sink([this](LogLevel, std::string_view message) {
      std::lock_guard lock(mu_);
      lines_.emplace_back(message);
    });
  }
  ~LogLines() { set_log_sink(nullptr); }
  LogLines(const LogLines&) = delete;
  LogLines& operator=(const LogLines&) = delete;
  bool contains(const std::string& text) { return count(text) > 0; }
  /// How many lines logged so far contain `text`.
  int count(const std::string& text) {
    std::lock_guard lock(mu_);
    int n = 0;
    for (const auto& line : lines_) n += line.find(text) != std::string::npos ? 1 : 0;
    return n;
  }

 private:
  std::mutex mu_;
  std::vector<std::string> lines_;
};

inline std::string model_path(const std::string& file) { return std::string(BLOCKFLOW_TEST_MODELS_DIR) + "/" + file; }

/// Options of a test model's block: 2 intra-op threads, one input of `shape` (warm-up on it).
inline BlockOptions shaped(std::vector<std::int64_t> shape, int max_batch = 1) {
  BlockOptions options;
  options.intra_op_threads = 2;
  options.input_shapes = {std::move(shape)};
  options.max_batch = max_batch;
  return options;
}

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

// Block options with an input queue of one that blocks its senders when full (FullPolicy::kBlock).
inline BlockOptions queue_of_one() {
  BlockOptions o;
  o.queue_capacity = 1;
  o.full_policy = FullPolicy::kBlock;
  return o;
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

// C++ blocks by factory for deployments: "upd_add_K" adds K; "upd_slow_MS" sleeps MS then adds 1000.
inline void register_update_factories() {
  static std::once_flag once;
  std::call_once(once, [] {
    for (int k : {1, 2, 4, 8, 16, 32, 64, 128}) {
      BlockRegistry::global().add("upd_add_" + std::to_string(k), [k](const std::string& name, const BlockOptions& o) {
        return Block::callable(name, [k](Tensors&& in) -> absl::StatusOr<Tensors> { return Tensors{in.at(0) + k}; }, o);
      });
    }
    for (int ms : {20, 300}) {
      BlockRegistry::global().add("upd_slow_" + std::to_string(ms), [ms](const std::string& name, const BlockOptions& o) {
        return Block::callable(name, [ms](Tensors&& in) -> absl::StatusOr<Tensors> {
          std::this_thread::sleep_for(std::chrono::milliseconds(ms));
          return Tensors{in.at(0) + 1000};
        }, o);
      });
    }
  });
}

/// Parses a deployment; fails the test with the status message otherwise.
inline Deployment parse(const std::string& json) {
  auto d = Deployment::parse(json);
  INFO(d.status().ToString());
  REQUIRE(d.ok());
  return *d;
}

/// The first output of `task` for the input [x], as a double; fails the test if it fails.
inline double value_of(Session& session, const std::string& task, double x = 0) {
  Result r = session.submit(task, at::full({1}, x)).get();
  INFO(task << ": " << r.status.ToString());
  REQUIRE(r.ok());
  return r.output().item<double>();
}

/// Requests `block` processed as `m` counts them; all ones when `m` has no such block.
inline std::uint64_t processed(const MetricsSnapshot& m, const std::string& block) {
  for (const auto& b : m.blocks) {
    if (b.name == block) return b.processed;
  }
  return ~std::uint64_t{0};
}

constexpr std::int64_t kMB = std::int64_t{1} << 20;

/// The memory figures `m` gives for `site` ("threads": the session's own); empty ones when none.
inline SiteMemory site_memory(const MetricsSnapshot& m, const std::string& site) {
  for (const auto& s : m.memory) {
    if (s.site == site) return s;
  }
  return SiteMemory{};
}

/// A latch blocks wait on until the test releases it (counts how many entered). A test that fails
/// before it releases it never hangs on it: its destructor releases it (a waiter left parked would
/// hold the condition variable's destruction for ever), and a wait ends after 120 s regardless.
struct Latch {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  std::atomic<int> entered{0};
  Latch() = default;
  Latch(const Latch&) = delete;
  Latch& operator=(const Latch&) = delete;
  ~Latch() {  // waits until no waiter is inside wait() (its last touch of `mu` is done)
    std::unique_lock lock(mu);
    open = true;
    cv.notify_all();
    cv.wait(lock, [&] { return waiting == 0; });
  }
  void release() {
    std::lock_guard lock(mu);
    open = true;
    cv.notify_all();
  }
  void wait() {
    std::unique_lock lock(mu);
    ++waiting;
    cv.wait_for(lock, std::chrono::seconds(120), [&] { return open; });
    --waiting;
    cv.notify_all();
  }
  int waiting = 0;  // guarded by mu
};

}  // namespace blockflow::test
