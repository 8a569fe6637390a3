#pragma once
// Internal to lib/plan: the q-quantile of samples (nearest rank), 0 for none.
#include <algorithm>
#include <vector>

namespace blockflow::detail {

inline double percentile(std::vector<double> samples, double q) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  return samples[static_cast<std::size_t>(q * static_cast<double>(samples.size() - 1) + 0.5)];
}

}  // namespace blockflow::detail
