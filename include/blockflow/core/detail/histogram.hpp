#pragma once
// Internal: a lock-free log-bucketed latency histogram with bounded memory.

#include <blockflow/core/metrics.hpp>

#include <array>
#include <atomic>
#include <cstdint>

namespace blockflow::detail {

/// Records durations in nanoseconds into geometric buckets (2% wide, 1 ns .. ~30 min), so
/// percentiles are exact to ~1% and memory is fixed (~12 KiB). record() is wait-free and
/// thread-safe; stats() may run concurrently with record().
class Histogram {
 public:
  void record(std::int64_t ns);
  [[nodiscard]] LatencyStats stats() const;
  [[nodiscard]] std::uint64_t count() const { return count_.load(std::memory_order_relaxed); }

 private:
  static constexpr int kBuckets = 1500;
  std::array<std::atomic<std::uint64_t>, kBuckets> buckets_{};
  std::atomic<std::uint64_t> count_{0};
  // In microseconds (each record rounded): 64 bits of them hold ~580k years of latency, 58 years
  // of a path saturated with 10k requests/s waiting 1 s each (in ns, 21 days, then the sum wraps).
  std::atomic<std::uint64_t> sum_us_{0};
  std::atomic<std::uint64_t> max_ns_{0};
};

}  // namespace blockflow::detail
