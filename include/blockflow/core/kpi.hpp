#pragma once
/// @file
/// @brief KPI sampling: process figures from /proc and GPU figures through NVML (loaded at run
/// time, so machines without a GPU or driver run fine), taken periodically by a KpiSampler in the
/// host and in every worker process. Off by default; see Session::set_sampling().

#include <absl/time/time.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace blockflow {

/// @brief One process's figures at one moment (Linux /proc/self).
struct ProcessSample {
  std::int64_t rss_bytes = 0;           ///< resident set
  double cpu_seconds = 0;               ///< user + system time since the process started
  double cpu_utilisation = 0;           ///< cores busy over the last sampling period (2.0 = two cores)
  std::int64_t threads = 0;
  std::uint64_t voluntary_context_switches = 0;
  std::uint64_t involuntary_context_switches = 0;
};

/// @brief One GPU's figures (NVML). Memory in bytes, clock in MHz, power in watts.
struct GpuSample {
  int index = 0;
  std::string name;
  std::uint64_t memory_used_bytes = 0, memory_total_bytes = 0;
  double utilisation = 0;  ///< 0..1, busy fraction of the last NVML interval
  std::uint32_t sm_clock_mhz = 0;
  std::uint32_t temperature_c = 0;
  double power_w = 0;
  /// This process's memory on the device as NVML counts it (context, allocator pools, libraries);
  /// 0 when NVML does not list the process (it has not touched the device, or NVML cannot see
  /// processes from inside this PID namespace).
  std::uint64_t process_memory_bytes = 0;
};

/// @brief libtorch's CUDA caching allocator in this process, for one CUDA device index (as
/// CUDA_VISIBLE_DEVICES numbers them, which may differ from NVML's `index`).
struct TorchCudaMemory {
  int device = 0;
  std::int64_t allocated_bytes = 0;       ///< held by live tensors
  std::int64_t reserved_bytes = 0;        ///< held by the allocator's cache (>= allocated)
  std::int64_t peak_allocated_bytes = 0;  ///< high watermark of allocated_bytes
};

/// @brief What a sampler saw last. `gpu_status` says "ok" or why there are no GPU figures (for
/// instance "no GPU: libnvidia-ml.so.1 not found"). `time_s` is 0 when nothing was sampled yet.
struct KpiSample {
  double time_s = 0;  ///< seconds since the sampler started
  ProcessSample process;
  std::vector<GpuSample> gpus;
  std::string gpu_status;
  /// libtorch's CUDA allocator, per device this process initialised; empty when libtorch was built
  /// without CUDA or the process has not used a GPU (`torch_cuda_status` says which).
  std::vector<TorchCudaMemory> torch_cuda;
  std::string torch_cuda_status;
  double energy_j = 0;  ///< GPU energy integrated from power readings since the sampler started
};

/// @brief Reads /proc/self now (cpu_utilisation is left 0: it needs two samples).
ProcessSample sample_process();
/// @brief This process's resident set in bytes (ProcessSample::rss_bytes alone): one read(2) of
/// /proc/self/statm, cheap enough for every load decision of a memory budget. 0 if unreadable.
std::int64_t process_rss_bytes();
/// @brief Seconds since this process started (/proc/self/stat; the kernel's clock-tick resolution,
/// 10 ms on Debian).
double process_age_seconds();

/// @brief libtorch's CUDA allocator figures for this process. Fills `out` and returns "ok", or
/// returns why there are none ("libtorch built without CUDA", "CUDA not initialised in this
/// process"). Never throws.
std::string sample_torch_cuda(std::vector<TorchCudaMemory>& out);

/// @brief NVML, opened once per process with dlopen(); never throws.
class GpuProbe {
 public:
  static GpuProbe& instance();
  /// @brief "ok" or the reason no GPU figures are available.
  [[nodiscard]] const std::string& status() const;
  [[nodiscard]] bool available() const;
  [[nodiscard]] std::vector<GpuSample> sample() const;

 private:
  GpuProbe();
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

/// @brief Samples the process (and GPUs) every `period` on its own thread while enabled. Thread-safe.
/// Cost: one read of /proc/self/stat and /proc/self/status per period (tens of microseconds), plus
/// the NVML calls where a GPU is present. The sampling thread runs at nice +10, so that block
/// threads win a busy core.
class KpiSampler {
 public:
  KpiSampler();
  ~KpiSampler();
  KpiSampler(const KpiSampler&) = delete;
  KpiSampler& operator=(const KpiSampler&) = delete;

  /// @brief Switches sampling on (with this period; <= 0 keeps the current one) or off. Takes one
  /// sample at once when switched on, and at each call while on (a new period takes effect then);
  /// then one per period (at least one a day, whatever the period).
  void set(bool enabled, absl::Duration period);
  [[nodiscard]] bool enabled() const;
  [[nodiscard]] absl::Duration period() const;
  [[nodiscard]] KpiSample latest() const;
  [[nodiscard]] std::uint64_t samples_taken() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace blockflow
