#include <blockflow/channel/detail/slot_allocator.hpp>

#include <absl/container/flat_hash_map.h>
#include <blockflow/core/detail/cpu_allocator_override.hpp>
#include <blockflow/core/detail/mutex.hpp>
#include <c10/core/CPUAllocator.h>
#include <cstring>

#include <atomic>

namespace blockflow::detail {
namespace {

// The raw deleter is a plain function: the allocator's state is process-wide.
struct State {
  blockflow::detail::Mutex mu;
  std::shared_ptr<ShmProducer> producer ABSL_GUARDED_BY(mu);
  std::atomic<std::size_t> min_bytes{0};  // read without the lock on every allocation
  absl::flat_hash_map<void*, ShmLease> leases ABSL_GUARDED_BY(mu);  // by data pointer
  c10::Allocator* fallback = nullptr;  // libtorch's allocator before ours (set once)
};

thread_local int paused = 0;  // SlotAllocatorPause nesting on this thread

State& state() {
  static auto* s = new State;  // never destroyed: tensors may die during static destruction
  return *s;
}

void delete_slot_or_fallback(void* data) {
  State& s = state();
  ShmLease lease;
  {
    blockflow::detail::MutexLock lock(&s.mu);
    auto it = s.leases.find(data);
    if (it != s.leases.end()) {
      lease = std::move(it->second);
      s.leases.erase(it);
    }
  }
  if (!lease.drop) return s.fallback->raw_deleter()(data);  // from raw_allocate() of a fallback allocation
  lease.drop();  // the slot is free once the consumer's views are released too
}

class SlotAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(std::size_t bytes) BLOCKFLOW_ALLOCATE_CONST override {
    State& s = state();
    // Small allocations (most of them) and paused threads go straight to libtorch's allocator.
    if (bytes < s.min_bytes.load(std::memory_order_relaxed) || paused != 0) return s.fallback->allocate(bytes);
    {
      // One lock section (the producer's own lock nests inside; lease drops never take ours).
      blockflow::detail::MutexLock lock(&s.mu);
      if (s.producer) {
        if (auto lease = s.producer->try_lease(bytes)) {
          void* data = lease->data;
          s.leases.emplace(data, *std::move(lease));
          return {data, data, &delete_slot_or_fallback, c10::Device(c10::DeviceType::CPU)};
        }
      }
    }
    return s.fallback->allocate(bytes);
  }
  BLOCKFLOW_CPU_COPY_DATA
  c10::DeleterFnPtr raw_deleter() const override {
    return s_has_raw_fallback() ? &delete_slot_or_fallback : nullptr;
  }

 private:
  static bool s_has_raw_fallback() { return state().fallback->raw_deleter() != nullptr; }
};

}  // namespace

void install_slot_allocator(std::shared_ptr<ShmProducer> producer, std::size_t min_bytes) {
  // Installed for good (never destroyed: c10 keeps pointing at it until exit); uninstall only cuts
  // it off its pools.
  static auto* allocator = new SlotAllocator;
  State& s = state();
  {
    blockflow::detail::MutexLock lock(&s.mu);
    s.producer = std::move(producer);
    s.min_bytes.store(min_bytes);
  }
  if (s.fallback == nullptr) {
    s.fallback = c10::GetCPUAllocator();
    c10::SetCPUAllocator(allocator, /*priority=*/100);
  }
}

SlotAllocatorPause::SlotAllocatorPause() { ++paused; }
SlotAllocatorPause::~SlotAllocatorPause() { --paused; }

void uninstall_slot_allocator() {
  State& s = state();
  blockflow::detail::MutexLock lock(&s.mu);
  s.producer.reset();
}

}  // namespace blockflow::detail
