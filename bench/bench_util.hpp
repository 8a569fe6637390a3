#pragma once
// Shared helpers of the benchmark programs: percentiles and JSON-lines output.

#include <blockflow/core/kpi.hpp>

#include <fmt/format.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace blockflow::bench {

/// Calls `send()` at the arrival times of a Poisson process of `rate` per second (seed 1: the same
/// times in every run), on a thread of its own, until stop() or destruction. Open loop: a slow
/// system does not slow the arrivals.
class PoissonTraffic {
 public:
  PoissonTraffic(double rate, std::function<void()> send)
      : thread_([this, rate, send = std::move(send)] {
          std::mt19937_64 random(1);
          std::exponential_distribution<double> gap(rate);
          auto next = std::chrono::steady_clock::now();
          while (run_) {
            std::this_thread::sleep_until(next);
            send();
            next += std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(gap(random)));
          }
        }) {}
  ~PoissonTraffic() { stop(); }
  PoissonTraffic(const PoissonTraffic&) = delete;
  PoissonTraffic& operator=(const PoissonTraffic&) = delete;
  void stop() {
    run_ = false;
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::atomic<bool> run_{true};
  std::thread thread_;
};

/// Calls `on(name, value)` for each "--name value" pair of the command line; `on` returns false for
/// a name it does not know, which throws std::invalid_argument naming it.
template <class F>
void parse_options(int argc, char** argv, F on) {
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!on(std::string(argv[i]), std::string(argv[i + 1]))) {
      throw std::invalid_argument("unknown argument " + std::string(argv[i]));
    }
  }
}

/// The q-quantile (0..1) of `samples` (nearest rank). Sorts a copy.
inline double percentile(std::vector<double> samples, double q) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  const auto rank = static_cast<std::size_t>(std::ceil(q * static_cast<double>(samples.size())));
  return samples[std::min(samples.size() - 1, rank == 0 ? 0 : rank - 1)];
}

/// The CPU model ("model name" in /proc/cpuinfo), printed with every figure: machines differ.
/// A TCP port on 127.0.0.1 free now (the kernel's choice; released at once for the caller to bind).
inline int free_tcp_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(a);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &length) != 0) {
    throw std::runtime_error("free_tcp_port: no port");
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

inline std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

/// The machine's fields of every bench line: "cpu":"...","hardware_threads":N (no braces, no comma
/// around), so that no figure is printed without the CPU it was measured on.
inline std::string machine_json() {
  return fmt::format("\"cpu\":\"{}\",\"hardware_threads\":{}", cpu_model(), std::thread::hardware_concurrency());
}

/// Threads of this process now (/proc/self/task).
inline int process_threads() {
  int n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

/// The first GPU's name as NVML reports it ("" without one), for the figures measured on it.
inline std::string gpu_name() {
  const auto gpus = GpuProbe::instance().sample();
  return gpus.empty() ? std::string() : gpus.front().name;
}

}  // namespace blockflow::bench
