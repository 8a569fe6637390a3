#pragma once
// Shared helpers of the benchmark programs: percentiles and JSON-lines output.

#include <blockflow/kpi.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
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

/// The first GPU's name as NVML reports it ("" without one), for the figures measured on it.
inline std::string gpu_name() {
  const auto gpus = GpuProbe::instance().sample();
  return gpus.empty() ? std::string() : gpus.front().name;
}

}  // namespace blockflow::bench
