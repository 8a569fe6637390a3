#pragma once
// Shared helpers of the benchmark programs: percentiles and JSON-lines output.

#include <blockflow/kpi.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace blockflow::bench {

/// The q-quantile (0..1) of `samples` (nearest rank). Sorts a copy.
inline double percentile(std::vector<double> samples, double q) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  const auto rank = static_cast<std::size_t>(std::ceil(q * static_cast<double>(samples.size())));
  return samples[std::min(samples.size() - 1, rank == 0 ? 0 : rank - 1)];
}

/// The CPU model ("model name" in /proc/cpuinfo), printed with every figure: machines differ.
inline std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
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
