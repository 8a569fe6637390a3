// The CUDA IPC channel (TensorMQ); see include/blockflow/channel/detail/cuda_ipc.hpp and docs/wire-format.md.
// Built with BLOCKFLOW_CUDA where CMake found the CUDA toolkit; the libtorch-facing part (which
// allocation holds a tensor, the current stream) needs BLOCKFLOW_TORCH_CUDA (a libtorch with CUDA).
#include <blockflow/channel/detail/cuda_ipc.hpp>

#include <ATen/ATen.h>
#include <absl/container/flat_hash_map.h>
#include <blockflow/core/detail/mutex.hpp>
#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#ifdef BLOCKFLOW_CUDA
#include <cuda_runtime_api.h>
#endif
#ifdef BLOCKFLOW_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace blockflow::detail {
namespace {

// What a record slot holds (little-endian, in the producer's host shared-memory pool).
constexpr std::uint32_t kRecordMagic = 0x52434642;  // "BFCR"
constexpr std::size_t kRecordSlotBytes = 256;
constexpr std::size_t kIpcHandleBytes = 64;  // cudaIpcMemHandle_t, cudaIpcEventHandle_t
struct Record {
  std::uint32_t magic = kRecordMagic;
  std::uint32_t reserved = 0;
  std::uint64_t alloc_bytes = 0;            // size of the exported allocation
  char pci_bus_id[32] = {};                 // its device, as cudaDeviceGetPCIBusId writes it
  unsigned char memory[kIpcHandleBytes] = {};  // cudaIpcMemHandle_t of the allocation
  unsigned char event[kIpcHandleBytes] = {};   // cudaIpcEventHandle_t, recorded after the write
  std::uint64_t producer_pid = 0;
};
static_assert(sizeof(Record) <= kRecordSlotBytes);

}  // namespace

#ifdef BLOCKFLOW_CUDA
namespace {

std::string to_hex(const void* data, std::size_t n) {
  std::string out;
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) out += fmt::format("{:02x}", p[i]);
  return out;
}

bool from_hex(const std::string& hex, void* out, std::size_t n) {
  if (hex.size() != 2 * n) return false;
  auto* p = static_cast<unsigned char*>(out);
  for (std::size_t i = 0; i < n; ++i) {
    unsigned v = 0;
    if (std::sscanf(hex.c_str() + 2 * i, "%2x", &v) != 1) return false;
    p[i] = static_cast<unsigned char>(v);
  }
  return true;
}

static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes && sizeof(cudaIpcEventHandle_t) == kIpcHandleBytes);

std::string cuda_error(cudaError_t e) { return fmt::format("{} ({})", cudaGetErrorString(e), cudaGetErrorName(e)); }

// The call failed: clear CUDA's sticky last error so it does not surface elsewhere.
std::string take_error(cudaError_t e) {
  (void)cudaGetLastError();
  return cuda_error(e);
}

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) (void)cudaSetDevice(device);
  }
  ~DeviceGuard() {
    if (previous_ >= 0) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// The stream libtorch's kernels of this thread run on (what a consumer must order after the
// producer's event, and what a producer's event must follow).
cudaStream_t current_stream(int device) {
#ifdef BLOCKFLOW_TORCH_CUDA
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
#else
  (void)device;
  return nullptr;  // the legacy default stream
#endif
}

absl::StatusOr<std::string> pci_bus_id(int device) {
  static blockflow::detail::Mutex mu;
  static absl::flat_hash_map<int, std::string> known;  // the driver query is not free: once per device
  {
    blockflow::detail::MutexLock lock(&mu);
    if (auto it = known.find(device); it != known.end()) return it->second;
  }
  char id[32] = {};
  if (auto e = cudaDeviceGetPCIBusId(id, sizeof(id), device); e != cudaSuccess) {
    return absl::FailedPreconditionError(fmt::format("cudaDeviceGetPCIBusId(device {}): {}", device, take_error(e)));
  }
  blockflow::detail::MutexLock lock(&mu);
  known[device] = id;
  return std::string(id);
}

absl::StatusOr<int> device_of(const char* pci) {
  int device = -1;
  if (auto e = cudaDeviceGetByPCIBusId(&device, pci); e != cudaSuccess) {
    return absl::FailedPreconditionError(
        fmt::format("CUDA device {} is not visible in this process (CUDA_VISIBLE_DEVICES?): {}", pci, take_error(e)));
  }
  return device;
}

// An allocation of another process, opened here (cudaIpcOpenMemHandle allows one mapping per
// process, so the table is process-wide).
struct Imported {
  void* base = nullptr;
  std::uint64_t bytes = 0;
  int device = 0;
  Record record;
  bool own = false;  // this process's own allocation, come back (not opened, not closed)
  ~Imported() {
    if (base != nullptr && !own) {
      DeviceGuard guard(device);
      (void)cudaIpcCloseMemHandle(base);
    }
  }
};

class Imports {
 public:
  static Imports& get() {
    static auto* imports = new Imports;  // never destroyed: tensors over its mappings may outlive statics
    return *imports;
  }

  absl::StatusOr<std::shared_ptr<Imported>> open(const Record& record, int device) {
    const std::string key(reinterpret_cast<const char*>(record.memory), kIpcHandleBytes);
    blockflow::detail::MutexLock lock(&mu_);
    if (record.producer_pid == static_cast<std::uint64_t>(::getpid())) {
      // Our own allocation, handed back (a worker returned a view of what we sent it). CUDA opens
      // no handle of its own process; the allocation is alive (the share that exported it is out).
      auto exported = exported_.find(key);
      if (!exported) {
        return absl::InvalidArgumentError(
            "cuda handle: names an allocation of this process that it never exported, or whose shares were all "
            "released");
      }
      auto own = std::make_shared<Imported>();
      own->base = exported->base;
      own->bytes = exported->bytes;
      own->device = device;
      own->record = record;
      own->own = true;
      return own;
    }
    if (auto it = memory_.find(key); it != memory_.end()) return it->second;
    evict_unused();
    DeviceGuard guard(device);
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, record.memory, sizeof(handle));
    void* base = nullptr;
    if (auto e = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess) {
      return absl::FailedPreconditionError(fmt::format(
          "cannot open the CUDA memory of process {} on device {}: {} (another PID namespace, or a device "
          "without IPC support?)",
          record.producer_pid, record.pci_bus_id, take_error(e)));
    }
    auto imported = std::make_shared<Imported>();
    imported->base = base;
    imported->bytes = record.alloc_bytes;
    imported->device = device;
    imported->record = record;
    memory_.emplace(key, imported);
    return imported;
  }

  absl::StatusOr<cudaEvent_t> event(const Record& record, int device) {
    const std::string key(reinterpret_cast<const char*>(record.event), kIpcHandleBytes);
    blockflow::detail::MutexLock lock(&mu_);
    if (auto it = events_.find(key); it != events_.end()) return it->second;
    DeviceGuard guard(device);
    cudaIpcEventHandle_t handle;
    std::memcpy(&handle, record.event, sizeof(handle));
    cudaEvent_t event = nullptr;
    if (auto e = cudaIpcOpenEventHandle(&event, handle); e != cudaSuccess) {
      return absl::FailedPreconditionError(
          fmt::format("cannot open the CUDA event of process {}: {}", record.producer_pid, take_error(e)));
    }
    events_.emplace(key, event);
    return event;
  }

  // An allocation this process exported (CudaProducer::share), so that a handle naming it can
  // come back. Keyed by its IPC handle; a freed segment's next handle differs. The share keeps the
  // token until its release: only released exports are ever evicted (CudaExportTable).
  [[nodiscard]] std::shared_ptr<void> remember_export(const Record& record, void* base) {
    const std::string key(reinterpret_cast<const char*>(record.memory), kIpcHandleBytes);
    return exported_.remember(key, {base, record.alloc_bytes});
  }

  // The device a PCI bus id names here (cached: the driver query is not free).
  absl::StatusOr<int> device(const char* pci) {
    {
      blockflow::detail::MutexLock lock(&mu_);
      if (auto it = devices_.find(pci); it != devices_.end()) return it->second;
    }
    auto device = device_of(pci);
    if (!device.ok()) return device.status();
    blockflow::detail::MutexLock lock(&mu_);
    devices_[pci] = *device;
    return *device;
  }

  // The opened allocation `ptr` lies in, if any (a tensor received here, being forwarded).
  std::shared_ptr<Imported> origin(const void* ptr) {
    const auto* p = static_cast<const char*>(ptr);
    blockflow::detail::MutexLock lock(&mu_);
    for (const auto& [key, imported] : memory_) {
      const auto* base = static_cast<const char*>(imported->base);
      if (p >= base && p < base + imported->bytes) return imported;
    }
    return nullptr;
  }

 private:
  // Closes allocations no tensor uses any more once the table grows (their producer may have freed
  // them). Closing happens here only, never on a CUDA callback thread.
  void evict_unused() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    constexpr std::size_t kKeep = 256;
    if (memory_.size() < kKeep) return;
    for (auto it = memory_.begin(); it != memory_.end();) {
      if (it->second.use_count() == 1) {
        memory_.erase(it++);
      } else {
        ++it;
      }
    }
  }

  blockflow::detail::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Imported>> memory_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, cudaEvent_t> events_ ABSL_GUARDED_BY(mu_);
  CudaExportTable exported_;  // thread-safe on its own
  absl::flat_hash_map<std::string, int> devices_ ABSL_GUARDED_BY(mu_);
};

void CUDART_CB run_host_function(void* payload) {
  auto* fn = static_cast<std::function<void()>*>(payload);
  (*fn)();
  delete fn;
}

}  // namespace

absl::Status cuda_ipc_usable() {
#ifndef BLOCKFLOW_TORCH_CUDA
  return absl::UnimplementedError(
      "the CUDA channel needs a libtorch with CUDA (this build's libtorch has none; see docs/gpu.md)");
#else
  int count = 0;
  if (auto e = cudaGetDeviceCount(&count); e != cudaSuccess || count == 0) {
    return absl::FailedPreconditionError(
        fmt::format("the CUDA channel needs a CUDA device: {}", e == cudaSuccess ? "none visible" : take_error(e)));
  }
  return absl::OkStatus();
#endif
}

absl::StatusOr<std::string> export_cuda_probe() {
  static blockflow::detail::Mutex mu;
  static std::string probe;
  blockflow::detail::MutexLock lock(&mu);
  if (!probe.empty()) return probe;
  int device = 0;
  if (auto e = cudaGetDevice(&device); e != cudaSuccess) {
    return absl::FailedPreconditionError(fmt::format("CUDA probe: no device: {}", take_error(e)));
  }
  auto pci = pci_bus_id(device);
  if (!pci.ok()) return pci.status();
  void* memory = nullptr;  // kept for the life of the process
  if (auto e = cudaMalloc(&memory, 512); e != cudaSuccess) {
    return absl::FailedPreconditionError(fmt::format("CUDA probe: cudaMalloc: {}", take_error(e)));
  }
  cudaIpcMemHandle_t mem;
  if (auto e = cudaIpcGetMemHandle(&mem, memory); e != cudaSuccess) {
    return absl::FailedPreconditionError(fmt::format("CUDA probe: cudaIpcGetMemHandle: {}", take_error(e)));
  }
  cudaEvent_t event = nullptr;
  cudaIpcEventHandle_t ev;
  if (auto e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventInterprocess); e != cudaSuccess) {
    return absl::FailedPreconditionError(fmt::format("CUDA probe: interprocess event: {}", take_error(e)));
  }
  if (auto e = cudaIpcGetEventHandle(&ev, event); e != cudaSuccess) {
    return absl::FailedPreconditionError(fmt::format("CUDA probe: cudaIpcGetEventHandle: {}", take_error(e)));
  }
  probe = fmt::format("{}.{}.{}.{}", to_hex(pci->data(), pci->size()), to_hex(&mem, sizeof(mem)),
                      to_hex(&ev, sizeof(ev)), ::getpid());
  return probe;
}

absl::Status open_cuda_probe(const std::string& probe) {
  std::vector<std::string> parts;
  for (std::size_t at = 0;;) {
    const std::size_t dot = probe.find('.', at);
    parts.push_back(probe.substr(at, dot == std::string::npos ? std::string::npos : dot - at));
    if (dot == std::string::npos) break;
    at = dot + 1;
  }
  std::string pci(parts.empty() ? 0 : parts[0].size() / 2, '\0');
  cudaIpcMemHandle_t mem;
  cudaIpcEventHandle_t ev;
  if (parts.size() != 4 || !from_hex(parts[0], pci.data(), pci.size()) || !from_hex(parts[1], &mem, sizeof(mem)) ||
      !from_hex(parts[2], &ev, sizeof(ev))) {
    return absl::InvalidArgumentError("CUDA probe: malformed probe string");
  }
  const std::string pid = parts[3];
  auto device = device_of(pci.c_str());
  if (!device.ok()) return device.status();
  DeviceGuard guard(*device);
  void* base = nullptr;
  if (auto e = cudaIpcOpenMemHandle(&base, mem, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess) {
    return absl::FailedPreconditionError(fmt::format(
        "cannot open CUDA IPC memory of process {} on device {}: {} (another PID namespace, or a device without "
        "IPC support?)",
        pid, pci, take_error(e)));
  }
  (void)cudaIpcCloseMemHandle(base);
  cudaEvent_t event = nullptr;
  if (auto e = cudaIpcOpenEventHandle(&event, ev); e != cudaSuccess) {
    return absl::FailedPreconditionError(
        fmt::format("cannot open a CUDA IPC event of process {}: {}", pid, take_error(e)));
  }
  (void)cudaEventDestroy(event);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------------
struct CudaProducer::Impl {
  explicit Impl(std::size_t max_in_flight) : records(pool_options(max_in_flight)) {}
  static ShmPoolOptions pool_options(std::size_t n) {
    ShmPoolOptions o;
    o.slots_per_pool = std::max<std::size_t>(n, 1);
    o.min_slot_bytes = kRecordSlotBytes;
    o.max_pools = 1;
    return o;
  }

  struct Event {
    cudaEvent_t event = nullptr;
    cudaIpcEventHandle_t handle{};
    int device = 0;
    bool busy = false;
  };
  struct Held {
    at::Tensor tensor;                   // keeps the allocation from being reused
    int event = -1;                      // index in `events`
    std::shared_ptr<void> exported;      // keeps the allocation's export record (null when forwarded)
  };
  using Key = std::tuple<std::uint64_t, std::uint32_t, std::uint64_t>;  // pool, slot, generation

  ShmProducer records;
  blockflow::detail::Mutex mu;
  absl::flat_hash_map<Key, Held> held ABSL_GUARDED_BY(mu);
  std::vector<Event> events ABSL_GUARDED_BY(mu);

  absl::StatusOr<int> take_event(int device) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (std::size_t i = 0; i < events.size(); ++i) {
      if (!events[i].busy && events[i].device == device) {
        events[i].busy = true;
        return static_cast<int>(i);
      }
    }
    Event e;
    e.device = device;
    DeviceGuard guard(device);
    if (auto r = cudaEventCreateWithFlags(&e.event, cudaEventDisableTiming | cudaEventInterprocess); r != cudaSuccess) {
      return absl::InternalError(fmt::format("interprocess CUDA event: {}", take_error(r)));
    }
    if (auto r = cudaIpcGetEventHandle(&e.handle, e.event); r != cudaSuccess) {
      (void)cudaEventDestroy(e.event);
      return absl::InternalError(fmt::format("cudaIpcGetEventHandle: {}", take_error(r)));
    }
    e.busy = true;
    events.push_back(e);
    return static_cast<int>(events.size() - 1);
  }

  void drop(const Key& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = held.find(key);
    if (it == held.end()) return;
    if (it->second.event >= 0) events[static_cast<std::size_t>(it->second.event)].busy = false;
    held.erase(it);
  }

  ~Impl() {
    blockflow::detail::MutexLock lock(&mu);
    held.clear();
    for (auto& e : events) (void)cudaEventDestroy(e.event);
  }
};

CudaProducer::CudaProducer(std::size_t max_in_flight) : impl_(std::make_shared<Impl>(max_in_flight)) {}
CudaProducer::~CudaProducer() = default;

CudaProducer::Reserved::~Reserved() {
  for (auto& record : records) record.drop();
}

std::shared_ptr<CudaProducer::Reserved> CudaProducer::reserve_now(std::size_t n) {
  auto reserved = std::make_shared<Reserved>();
  reserved->records.reserve(n);  // no allocation between taking a record and keeping it
  for (std::size_t i = 0; i < n; ++i) {
    auto lease = impl_->records.try_lease(sizeof(Record));
    if (!lease) return nullptr;  // those taken go back with `reserved`
    reserved->records.push_back(std::move(*lease));
  }
  return reserved;
}

absl::StatusOr<wire::ShmHandle> CudaProducer::share(const at::Tensor& t, absl::Time deadline) {
  return share_in(t, [&] { return impl_->records.lease(sizeof(Record), deadline); });
}

absl::StatusOr<wire::ShmHandle> CudaProducer::share(const at::Tensor& t, Reserved& reserved) {
  return share_in(t, [&]() -> absl::StatusOr<ShmLease> {
    if (reserved.records.empty()) return absl::FailedPreconditionError("no CUDA record left of those reserved");
    ShmLease record = std::move(reserved.records.back());
    reserved.records.pop_back();
    return record;
  });
}

absl::StatusOr<wire::ShmHandle> CudaProducer::share_in(const at::Tensor& t,
                                                       const std::function<absl::StatusOr<ShmLease>()>& take_record) {
  if (!t.is_cuda() || !t.is_contiguous()) {
    return absl::InvalidArgumentError(fmt::format("the CUDA channel carries contiguous CUDA tensors, not {}", describe(t)));
  }
  const int device = t.device().index();
  Record record;
  record.producer_pid = static_cast<std::uint64_t>(::getpid());
  std::uint64_t offset = 0;
  std::shared_ptr<void> exported;  // our own allocation's export, live until this share's release
  if (auto origin = Imports::get().origin(t.data_ptr())) {
    // Received here over CUDA IPC: hand over the original allocation. The event is ours (below):
    // our stream waited on the producer's, and anything this process did to the tensor since
    // (an in-place block) is ordered before it too.
    record = origin->record;
    offset = static_cast<std::uint64_t>(static_cast<const char*>(t.data_ptr()) - static_cast<const char*>(origin->base));
  } else {
#ifdef BLOCKFLOW_TORCH_CUDA
    std::size_t alloc_bytes = 0;
    void* base = nullptr;
    try {
      base = c10::cuda::CUDACachingAllocator::getBaseAllocation(t.data_ptr(), &alloc_bytes);
    } catch (const std::exception& e) {
      return absl::InvalidArgumentError(
          fmt::format("tensor {} was not allocated by libtorch's CUDA allocator: {}", describe(t), e.what()));
    }
    cudaIpcMemHandle_t mem;
    {
      DeviceGuard guard(device);
      if (auto e = cudaIpcGetMemHandle(&mem, base); e != cudaSuccess) {
        return absl::FailedPreconditionError(fmt::format(
            "cudaIpcGetMemHandle for a tensor on cuda:{}: {} (PYTORCH_CUDA_ALLOC_CONF=expandable_segments "
            "allocations cannot be exported)",
            device, take_error(e)));
      }
    }
    std::memcpy(record.memory, &mem, sizeof(mem));
    record.alloc_bytes = alloc_bytes;
    exported = Imports::get().remember_export(record, base);
    offset = static_cast<std::uint64_t>(static_cast<const char*>(t.data_ptr()) - static_cast<const char*>(base));
    auto pci = pci_bus_id(device);
    if (!pci.ok()) return pci.status();
    std::snprintf(record.pci_bus_id, sizeof(record.pci_bus_id), "%s", pci->c_str());
#else
    return cuda_ipc_usable();
#endif
  }
  Impl& s = *impl_;
  auto lease = take_record();
  if (!lease.ok()) {
    return absl::Status(lease.status().code(), fmt::format("CUDA channel: {}", std::string(lease.status().message())));
  }
  blockflow::detail::MutexLock lock(&s.mu);
  int event = -1;
  {
    auto taken = s.take_event(device);
    if (!taken.ok()) {
      lease->drop();
      return taken.status();
    }
    event = *taken;
    Impl::Event& e = s.events[static_cast<std::size_t>(event)];
    DeviceGuard guard(device);
    if (auto r = cudaEventRecord(e.event, current_stream(device)); r != cudaSuccess) {
      e.busy = false;
      lease->drop();
      return absl::InternalError(fmt::format("cudaEventRecord: {}", take_error(r)));
    }
    std::memcpy(record.event, &e.handle, sizeof(e.handle));
  }
  std::memcpy(lease->data, &record, sizeof(record));
  auto handle = s.records.share(lease->data, sizeof(record));
  lease->drop();  // from here the record slot is the consumer's until it releases the handle
  if (!handle) return absl::InternalError("CUDA channel: a leased record slot could not be shared");
  s.held.emplace(Impl::Key{handle->pool_id, handle->slot, handle->generation}, Impl::Held{t, event, std::move(exported)});
  handle->memory = wire::kCudaMemory;
  handle->offset = offset;
  return *handle;
}

bool CudaProducer::release(const wire::ShmHandle& handle) {
  Impl& s = *impl_;
  blockflow::detail::MutexLock lock(&s.mu);
  wire::ShmHandle record = handle;
  record.memory = wire::kHostMemory;
  record.offset = 0;
  if (!s.records.release(record)) return false;
  s.drop({handle.pool_id, handle.slot, handle.generation});
  return true;
}

std::size_t CudaProducer::reclaim_all() {
  Impl& s = *impl_;
  blockflow::detail::MutexLock lock(&s.mu);
  const std::size_t n = s.records.reclaim_all();
  std::vector<Impl::Key> keys;
  for (const auto& [key, held] : s.held) keys.push_back(key);
  for (const auto& key : keys) s.drop(key);
  return n;
}

ShmEdgeStats CudaProducer::stats() const { return impl_->records.stats(); }
void CudaProducer::stop_waiting() { impl_->records.stop_waiting(); }

// ---------------------------------------------------------------------------------------------------
CudaConsumer::CudaConsumer() = default;
CudaConsumer::~CudaConsumer() = default;

absl::StatusOr<at::Tensor> CudaConsumer::resolve(ShmConsumer& records, const wire::TensorDesc& desc,
                                                 const wire::ShmHandle& handle, at::ScalarType type,
                                                 std::function<void(const wire::ShmHandle&)> release) {
  if (auto usable = cuda_ipc_usable(); !usable.ok()) return usable;
  wire::ShmHandle slot = handle;
  slot.memory = wire::kHostMemory;
  slot.offset = 0;
  auto view = records.resolve(slot, sizeof(Record));
  if (!view.ok()) return absl::InvalidArgumentError(fmt::format("cuda {}", std::string(view.status().message())));
  Record record;
  std::memcpy(&record, view->data, sizeof(record));
  record.pci_bus_id[sizeof(record.pci_bus_id) - 1] = '\0';
  if (record.magic != kRecordMagic) return absl::InvalidArgumentError("cuda handle: its slot holds no CUDA record");
  if (handle.offset > record.alloc_bytes || desc.byte_count > record.alloc_bytes - handle.offset) {
    return absl::InvalidArgumentError(fmt::format("cuda handle: offset {} + {} bytes exceeds the allocation ({} bytes)",
                                                  handle.offset, desc.byte_count, record.alloc_bytes));
  }
  if (handle.offset % wire::element_size(desc.dtype) != 0) {
    return absl::InvalidArgumentError(
        fmt::format("cuda handle: offset {} is misaligned for {}", handle.offset, wire::to_string(desc.dtype)));
  }
  auto device = Imports::get().device(record.pci_bus_id);
  if (!device.ok()) return device.status();
  auto imported = Imports::get().open(record, *device);
  if (!imported.ok()) return imported.status();
  auto event = Imports::get().event(record, *device);
  if (!event.ok()) return event.status();
  {
    DeviceGuard guard(*device);
    if (auto e = cudaStreamWaitEvent(current_stream(*device), *event, 0); e != cudaSuccess) {
      return absl::InternalError(fmt::format("cudaStreamWaitEvent: {}", take_error(e)));
    }
  }
  char* data = static_cast<char*>((*imported)->base) + handle.offset;
  const int dev = *device;
  auto deleter = [mapping = *imported, handle, release = std::move(release), dev](void*) {
    // Return the handle once this process's stream has finished with the memory; no host wait.
    auto* payload = new std::function<void()>([mapping, handle, release] { release(handle); });
    DeviceGuard guard(dev);
    if (cudaLaunchHostFunc(current_stream(dev), run_host_function, payload) != cudaSuccess) {
      (void)cudaGetLastError();
      run_host_function(payload);  // the context is going away: nothing can still read it
    }
  };
  return at::from_blob(data, desc.shape, desc.strides, deleter,
                       at::TensorOptions().dtype(type).device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(dev))));
}

#else  // without the CUDA toolkit --------------------------------------------------------------------

namespace {
absl::Status no_cuda() {
  return absl::UnimplementedError("BlockFlow was built without CUDA (BLOCKFLOW_WITH_CUDA found no CUDA toolkit)");
}
}  // namespace

absl::Status cuda_ipc_usable() { return no_cuda(); }
absl::StatusOr<std::string> export_cuda_probe() { return no_cuda(); }
absl::Status open_cuda_probe(const std::string&) { return no_cuda(); }

struct CudaProducer::Impl {};
CudaProducer::CudaProducer(std::size_t) {}
CudaProducer::~CudaProducer() = default;
absl::StatusOr<wire::ShmHandle> CudaProducer::share(const at::Tensor&, absl::Time) { return no_cuda(); }
CudaProducer::Reserved::~Reserved() = default;
std::shared_ptr<CudaProducer::Reserved> CudaProducer::reserve_now(std::size_t) { return nullptr; }
absl::StatusOr<wire::ShmHandle> CudaProducer::share(const at::Tensor&, Reserved&) { return no_cuda(); }
bool CudaProducer::release(const wire::ShmHandle&) { return false; }
std::size_t CudaProducer::reclaim_all() { return 0; }
ShmEdgeStats CudaProducer::stats() const { return {}; }
void CudaProducer::stop_waiting() {}

CudaConsumer::CudaConsumer() = default;
CudaConsumer::~CudaConsumer() = default;
absl::StatusOr<at::Tensor> CudaConsumer::resolve(ShmConsumer&, const wire::TensorDesc&, const wire::ShmHandle&,
                                                 at::ScalarType, std::function<void(const wire::ShmHandle&)>) {
  return no_cuda();
}

#endif

}  // namespace blockflow::detail
