#include <blockflow/core/detail/histogram.hpp>

#include <algorithm>
#include <cmath>
#include <limits>

namespace blockflow::detail {
namespace {

constexpr double kGrowth = 1.02;
const double kLogGrowth = std::log(kGrowth);

int bucket_of(std::int64_t ns) {
  if (ns <= 1) return 0;
  const int index = static_cast<int>(std::log(static_cast<double>(ns)) / kLogGrowth) + 1;
  return std::min(index, 1499);
}

// Geometric middle of a bucket, in ns.
double bucket_value(int index) {
  if (index == 0) return 1.0;
  return std::pow(kGrowth, static_cast<double>(index) - 0.5);
}

}  // namespace

void Histogram::record(std::int64_t ns) {
  ns = std::max<std::int64_t>(ns, 0);
  buckets_[static_cast<std::size_t>(bucket_of(ns))].fetch_add(1, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
  // After the bucket: whoever reads this sum (acquire) then counts this record in the buckets.
  const auto add = static_cast<std::uint64_t>(ns);
  if (sum_ns_.fetch_add(add, std::memory_order_release) > std::numeric_limits<std::uint64_t>::max() - add) {
    sum_wraps_.fetch_add(1, std::memory_order_release);
  }
  auto seen = max_ns_.load(std::memory_order_relaxed);
  while (static_cast<std::uint64_t>(ns) > seen &&
         !max_ns_.compare_exchange_weak(seen, static_cast<std::uint64_t>(ns), std::memory_order_relaxed)) {
  }
}

LatencyStats Histogram::stats() const {
  LatencyStats out;
  // The sum first, then the buckets: every record in the sum is in the count (the mean is never
  // above the truth). The sum itself is given too: it only grows (a summary's _sum).
  const auto wraps = sum_wraps_.load(std::memory_order_acquire);
  const auto sum_ns = sum_ns_.load(std::memory_order_acquire);
  std::array<std::uint64_t, kBuckets> counts{};
  std::uint64_t total = 0;
  for (int i = 0; i < kBuckets; ++i) {
    counts[static_cast<std::size_t>(i)] = buckets_[static_cast<std::size_t>(i)].load(std::memory_order_relaxed);
    total += counts[static_cast<std::size_t>(i)];
  }
  out.count = total;
  if (total == 0) return out;
  const double max_ms = static_cast<double>(max_ns_.load(std::memory_order_relaxed)) / 1e6;
  out.max_ms = max_ms;
  out.sum_ms = (static_cast<double>(wraps) * 18446744073709551616.0 + static_cast<double>(sum_ns)) / 1e6;
  out.mean_ms = out.sum_ms / static_cast<double>(total);
  auto percentile = [&](double q) {
    const auto rank = static_cast<std::uint64_t>(std::ceil(q * static_cast<double>(total)));
    std::uint64_t seen = 0;
    for (int i = 0; i < kBuckets; ++i) {
      seen += counts[static_cast<std::size_t>(i)];
      if (seen >= std::max<std::uint64_t>(rank, 1)) return std::min(bucket_value(i) / 1e6, max_ms);
    }
    return max_ms;
  };
  out.p50_ms = percentile(0.50);
  out.p90_ms = percentile(0.90);
  out.p99_ms = percentile(0.99);
  return out;
}

}  // namespace blockflow::detail
