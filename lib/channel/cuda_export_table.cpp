// The table of exported CUDA allocations (include/blockflow/channel/detail/cuda_export_table.hpp).
#include <blockflow/channel/detail/cuda_export_table.hpp>

#include <absl/container/flat_hash_map.h>
#include <blockflow/core/detail/mutex.hpp>

#include <algorithm>

namespace blockflow::detail {

struct CudaExportTable::Impl {
  struct Entry {
    Allocation allocation;
    std::weak_ptr<void> live;  // expires when the last share of the allocation is released
  };
  mutable blockflow::detail::Mutex mu;
  std::size_t bound ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<std::string, Entry> entries ABSL_GUARDED_BY(mu);

  // Makes room before an insert: evicts the released entries; if every entry is live, grows the
  // bound instead (doubling keeps the sweeps rare), since dropping one would make a handle still
  // out fail with "never exported".
  void make_room() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (entries.size() < bound) return;
    for (auto it = entries.begin(); it != entries.end();) {
      if (it->second.live.expired()) {
        entries.erase(it++);
      } else {
        ++it;
      }
    }
    if (entries.size() >= bound) bound *= 2;
  }
};

CudaExportTable::CudaExportTable(std::size_t bound) : impl_(std::make_unique<Impl>()) {
  impl_->bound = std::max<std::size_t>(bound, 1);
}
CudaExportTable::~CudaExportTable() = default;

std::shared_ptr<void> CudaExportTable::remember(const std::string& key, Allocation allocation) {
  Impl& s = *impl_;
  blockflow::detail::MutexLock lock(&s.mu);
  if (auto it = s.entries.find(key); it != s.entries.end()) {
    if (auto live = it->second.live.lock()) {
      it->second.allocation = allocation;
      return live;
    }
  } else {
    s.make_room();
  }
  std::shared_ptr<void> token = std::make_shared<char>(0);
  s.entries[key] = Impl::Entry{allocation, token};
  return token;
}

std::optional<CudaExportTable::Allocation> CudaExportTable::find(const std::string& key) const {
  blockflow::detail::MutexLock lock(&impl_->mu);
  auto it = impl_->entries.find(key);
  if (it == impl_->entries.end() || it->second.live.expired()) return std::nullopt;
  return it->second.allocation;
}

std::size_t CudaExportTable::size() const {
  blockflow::detail::MutexLock lock(&impl_->mu);
  return impl_->entries.size();
}

std::size_t CudaExportTable::bound() const {
  blockflow::detail::MutexLock lock(&impl_->mu);
  return impl_->bound;
}

}  // namespace blockflow::detail
