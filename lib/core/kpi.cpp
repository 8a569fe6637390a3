#include <blockflow/core/kpi.hpp>
#include <blockflow/core/detail/process_state.hpp>
#include <blockflow/core/detail/clock.hpp>

#include <absl/synchronization/mutex.h>
#include <fmt/format.h>

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <mutex>
#include <sstream>
#include <optional>
#include <thread>

namespace blockflow {

double process_age_seconds() {
  const auto f = detail::stat_fields(0);
  timespec now{};
  if (f.size() <= 19 || ::clock_gettime(CLOCK_BOOTTIME, &now) != 0) return 0;
  const double started = std::stod(f[19]) / static_cast<double>(::sysconf(_SC_CLK_TCK));  // field 22
  return std::max(0.0, static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec) / 1e9 - started);
}

std::int64_t process_rss_bytes() {
  const int fd = ::open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char text[128] = {};
  const ssize_t n = ::read(fd, text, sizeof text - 1);
  ::close(fd);
  long long size = 0, resident = 0;
  if (n <= 0 || std::sscanf(text, "%lld %lld", &size, &resident) != 2) return 0;
  static const long page = ::sysconf(_SC_PAGESIZE);
  return static_cast<std::int64_t>(resident) * page;
}

ProcessSample sample_process() {
  ProcessSample s;
  s.rss_bytes = process_rss_bytes();
  {
    // After the name: state(3) ... utime(14) stime(15) ... num_threads(20); f[0] is field 3.
    const auto f = detail::stat_fields(0);
    if (f.size() > 17) {
      const double tick = static_cast<double>(::sysconf(_SC_CLK_TCK));
      s.cpu_seconds = (std::stod(f[11]) + std::stod(f[12])) / tick;
      s.threads = std::stoll(f[17]);
    }
  }
  {
    std::ifstream status("/proc/self/status");
    for (std::string line; std::getline(status, line);) {
      auto value = [&](const char* key) -> std::optional<std::uint64_t> {
        if (line.rfind(key, 0) != 0) return std::nullopt;
        return std::stoull(line.substr(line.find(':') + 1));
      };
      if (auto v = value("voluntary_ctxt_switches:")) s.voluntary_context_switches = *v;
      if (auto v = value("nonvoluntary_ctxt_switches:")) s.involuntary_context_switches = *v;
    }
  }
  return s;
}

// --- NVML, resolved at run time ----------------------------------------------------------------------
struct GpuProbe::Impl {
  using Device = void*;
  struct Memory {
    unsigned long long total, free, used;
  };
  struct Utilization {
    unsigned int gpu, memory;
  };
  // nvmlMemory_v2_t: `used` without the driver's reserved memory, as nvidia-smi reports it (the v1
  // call counts the reserve as used: 614 MiB more on an H200 with driver 580).
  struct MemoryV2 {
    unsigned int version;
    unsigned long long total, reserved, free, used;
  };
  int (*memory_v2)(Device, MemoryV2*) = nullptr;
  int (*init)() = nullptr;
  int (*count)(unsigned int*) = nullptr;
  int (*handle)(unsigned int, Device*) = nullptr;
  int (*name)(Device, char*, unsigned int) = nullptr;
  int (*memory)(Device, Memory*) = nullptr;
  int (*utilization)(Device, Utilization*) = nullptr;
  int (*clock)(Device, int, unsigned int*) = nullptr;
  int (*temperature)(Device, int, unsigned int*) = nullptr;
  int (*power)(Device, unsigned int*) = nullptr;
  // Optional (NVML 11.x+); this process's memory comes from the list of compute processes.
  // nvmlProcessInfo_v2_t (24 bytes), what _v2 fills on every driver. _v3 fills the same on most,
  // but 32-byte records on R535 (nvmlProcessInfo_t grew there without a version bump): _v3 is
  // only a fallback, and the buffer has room for 32-byte records whichever is called.
  struct ProcessInfo {
    unsigned int pid;
    unsigned long long used_gpu_memory;
    unsigned int gpu_instance_id, compute_instance_id;
  };
  static constexpr std::size_t kLargestProcessRecord = 32;
  int (*processes)(Device, unsigned int*, ProcessInfo*) = nullptr;
  std::string status;
  unsigned int devices = 0;
  mutable std::mutex mu;  // NVML is thread-safe; this keeps the figures of one sample together
};

GpuProbe::GpuProbe() : impl_(std::make_shared<Impl>()) {
  Impl& n = *impl_;
  void* lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    n.status = "no GPU: libnvidia-ml.so.1 not found (no NVIDIA driver)";
    return;
  }
  auto bind = [&](auto& fn, const char* symbol) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(lib, symbol));
    return fn != nullptr;
  };
  if (!bind(n.init, "nvmlInit_v2") || !bind(n.count, "nvmlDeviceGetCount_v2") ||
      !bind(n.handle, "nvmlDeviceGetHandleByIndex_v2") || !bind(n.name, "nvmlDeviceGetName") ||
      !bind(n.memory, "nvmlDeviceGetMemoryInfo") || !bind(n.utilization, "nvmlDeviceGetUtilizationRates") ||
      !bind(n.clock, "nvmlDeviceGetClockInfo") || !bind(n.temperature, "nvmlDeviceGetTemperature") ||
      !bind(n.power, "nvmlDeviceGetPowerUsage")) {
    n.status = "no GPU: libnvidia-ml.so.1 lacks an expected symbol";
    return;
  }
  if (!bind(n.processes, "nvmlDeviceGetComputeRunningProcesses_v2")) bind(n.processes, "nvmlDeviceGetComputeRunningProcesses_v3");
  bind(n.memory_v2, "nvmlDeviceGetMemoryInfo_v2");
  if (const int rc = n.init(); rc != 0) {
    n.status = fmt::format("no GPU: nvmlInit failed (NVML error {})", rc);
    return;
  }
  if (n.count(&n.devices) != 0 || n.devices == 0) {
    n.status = "no GPU: NVML sees no device";
    n.devices = 0;
    return;
  }
  n.status = "ok";
}

GpuProbe& GpuProbe::instance() {
  static GpuProbe probe;
  return probe;
}

const std::string& GpuProbe::status() const { return impl_->status; }
bool GpuProbe::available() const { return impl_->devices > 0; }

std::vector<GpuSample> GpuProbe::sample() const {
  const Impl& n = *impl_;
  std::vector<GpuSample> out;
  const auto pid = static_cast<unsigned int>(::getpid());
  std::lock_guard lock(n.mu);
  for (unsigned int i = 0; i < n.devices; ++i) {
    Impl::Device device = nullptr;
    if (n.handle(i, &device) != 0) continue;
    GpuSample g;
    g.index = static_cast<int>(i);
    char name[96] = {};
    if (n.name(device, name, sizeof name) == 0) g.name = name;
    Impl::MemoryV2 memory_v2{};
    memory_v2.version = static_cast<unsigned int>(sizeof(Impl::MemoryV2)) | (2U << 24);  // NVML_STRUCT_VERSION(Memory, 2)
    Impl::Memory memory{};
    if (n.memory_v2 != nullptr && n.memory_v2(device, &memory_v2) == 0) {
      g.memory_used_bytes = memory_v2.used;
      g.memory_total_bytes = memory_v2.total;
    } else if (n.memory(device, &memory) == 0) {
      g.memory_used_bytes = memory.used;
      g.memory_total_bytes = memory.total;
    }
    Impl::Utilization utilization{};
    if (n.utilization(device, &utilization) == 0) g.utilisation = utilization.gpu / 100.0;
    unsigned int value = 0;
    if (n.clock(device, /*NVML_CLOCK_SM*/ 1, &value) == 0) g.sm_clock_mhz = value;
    if (n.temperature(device, /*NVML_TEMPERATURE_GPU*/ 0, &value) == 0) g.temperature_c = value;
    if (n.power(device, &value) == 0) g.power_w = value / 1000.0;  // milliwatts
    if (n.processes != nullptr) {
      // `count` records of ProcessInfo are asked for, with room for as many of the largest.
      constexpr std::size_t kSlack = Impl::kLargestProcessRecord / sizeof(Impl::ProcessInfo) + 1;
      std::size_t records = 256;
      std::vector<Impl::ProcessInfo> list(records * kSlack);
      auto count = static_cast<unsigned int>(records);
      int rc = n.processes(device, &count, list.data());
      if (rc == 7 /*NVML_ERROR_INSUFFICIENT_SIZE*/ && count > records) {  // a busy shared GPU
        records = count + 16;
        list.assign(records * kSlack, Impl::ProcessInfo{});
        count = static_cast<unsigned int>(records);
        rc = n.processes(device, &count, list.data());
      }
      if (rc == 0) {
        for (unsigned int p = 0; p < count && p < records; ++p) {
          // NVML_VALUE_NOT_AVAILABLE (all ones) where the driver hides per-process figures.
          if (list[p].pid == pid && list[p].used_gpu_memory != ~0ULL) g.process_memory_bytes = list[p].used_gpu_memory;
        }
      }
    }
    out.push_back(std::move(g));
  }
  return out;
}

// --- KpiSampler ------------------------------------------------------------------------------------------
struct KpiSampler::Impl {
  mutable std::mutex mu;
  std::condition_variable changed;
  bool enabled = false, stopping = false;
  absl::Duration period = absl::Milliseconds(100);
  KpiSample latest;
  std::uint64_t taken = 0;
  std::uint64_t settings = 0;  // set() calls so far: a new period, or a switch on, ends the wait
  std::int64_t started_ns = detail::now_ns();
  std::int64_t last_ns = 0;
  double last_cpu = 0;
  std::thread thread;

  // Measures one sample: called without mu, so that latest() (every metrics snapshot) never waits
  // for /proc or NVML; derived figures and the store come after, under mu (record()).
  static KpiSample measure() {
    KpiSample s;
    s.process = sample_process();
    GpuProbe& gpu = GpuProbe::instance();
    s.gpu_status = gpu.status();
    s.torch_cuda_status = sample_torch_cuda(s.torch_cuda);
    if (gpu.available()) s.gpus = gpu.sample();
    return s;
  }

  // Completes and stores a measured sample; called with mu held.
  void record(KpiSample s, std::int64_t now) {
    s.time_s = static_cast<double>(now - started_ns) / 1e9;
    if (last_ns > 0 && now > last_ns) {
      s.process.cpu_utilisation = (s.process.cpu_seconds - last_cpu) / (static_cast<double>(now - last_ns) / 1e9);
    }
    s.energy_j = latest.energy_j;
    double watts = 0;
    for (const auto& g : s.gpus) watts += g.power_w;
    if (last_ns > 0 && now > last_ns) s.energy_j += watts * static_cast<double>(now - last_ns) / 1e9;
    last_ns = now;
    last_cpu = s.process.cpu_seconds;
    latest = std::move(s);
    ++taken;
  }

  void main() {
    // Nice +10 for this thread only: where the cores are busy with blocks, their threads go first
    // and a sample waits a little. Failure (a sandbox without the permission) changes nothing else.
    (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 10);
    std::unique_lock lock(mu);
    while (!stopping) {
      if (!enabled) {
        changed.wait(lock, [&] { return stopping || enabled; });
        continue;
      }
      const std::int64_t now = detail::now_ns();
      lock.unlock();
      KpiSample s = measure();
      lock.lock();
      if (stopping || !enabled) continue;
      record(std::move(s), now);
      // At most a day at a time (an infinite period would overflow the clock and spin); a set()
      // meanwhile takes the next sample at once, with its period.
      const std::uint64_t seen = settings;
      changed.wait_for(lock, absl::ToChronoNanoseconds(std::min(period, absl::Hours(24))),
                       [&] { return stopping || !enabled || settings != seen; });
    }
  }
};

KpiSampler::KpiSampler() : impl_(std::make_unique<Impl>()) {
  impl_->thread = std::thread([this] { impl_->main(); });
}

KpiSampler::~KpiSampler() {
  {
    std::lock_guard lock(impl_->mu);
    impl_->stopping = true;
  }
  impl_->changed.notify_all();
  impl_->thread.join();
}

void KpiSampler::set(bool enabled, absl::Duration period) {
  {
    std::lock_guard lock(impl_->mu);
    if (period > absl::ZeroDuration()) impl_->period = period;
    if (enabled && !impl_->enabled) impl_->last_ns = 0;  // utilisation restarts from this sample
    impl_->enabled = enabled;
    ++impl_->settings;
  }
  impl_->changed.notify_all();
}

bool KpiSampler::enabled() const {
  std::lock_guard lock(impl_->mu);
  return impl_->enabled;
}

absl::Duration KpiSampler::period() const {
  std::lock_guard lock(impl_->mu);
  return impl_->period;
}

KpiSample KpiSampler::latest() const {
  std::lock_guard lock(impl_->mu);
  return impl_->latest;
}

std::uint64_t KpiSampler::samples_taken() const {
  std::lock_guard lock(impl_->mu);
  return impl_->taken;
}

}  // namespace blockflow
