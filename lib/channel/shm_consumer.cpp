// The consuming side of the shared-memory pools (shm_pool.hpp): the pools a link was given, mapped
// once each, and the handles checked against them.
#include <blockflow/channel/detail/shm_pool.hpp>

#include "shm_segment.hpp"

#include <absl/container/flat_hash_map.h>
#include <blockflow/core/detail/clock.hpp>
#include <fmt/format.h>

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/statfs.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace blockflow::detail {

// ---------------------------------------------------------------------------------------------------
struct ShmConsumer::Impl {
  bool local = false;
  mutable blockflow::detail::Mutex mu;
  absl::flat_hash_map<std::uint64_t, std::shared_ptr<PoolMapping>> pools;
  // Forgotten by the last forget(), kept until the next: a relay that checked a pool's retired flag
  // just before it was set may still send a handle of it without its descriptor.
  absl::flat_hash_map<std::uint64_t, std::shared_ptr<PoolMapping>> grace;

  // Maps a pool's descriptor (taken: closed with the mapping, or at once on an error). Every check
  // comes before the mapping, and the mapping is exactly the pool the header describes.
  static absl::StatusOr<std::shared_ptr<PoolMapping>> map(int fd) {
    auto mapping = std::make_shared<PoolMapping>();
    mapping->fd = fd;
    // Sealed at its size, or a process holding it could make our reads past a new end fault; on
    // tmpfs (a plain memfd), not hugetlbfs, whose faults can fail when huge pages run out.
    constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
    const int seals = ::fcntl(fd, F_GET_SEALS);
    struct statfs fs {};
    if (seals < 0 || (seals & kSeals) != kSeals || ::fstatfs(fd, &fs) != 0 || fs.f_type != TMPFS_MAGIC) {
      return absl::InvalidArgumentError("shm pool: its descriptor is not a memfd sealed at its size");
    }
    struct stat st {};
    SegmentHeader h{};
    if (::fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(kPoolPage) || ::pread(fd, &h, sizeof h, 0) != sizeof h) {
      return absl::InvalidArgumentError("shm pool: not a BlockFlow pool (too small)");
    }
    mapping->device = st.st_dev;
    mapping->inode = st.st_ino;
    // Checked in this copy, kept, and never read from shared memory again: the peer may rewrite it.
    const std::size_t size = static_cast<std::size_t>(st.st_size);
    const bool sane = h.magic == kSegmentMagic && h.version == kSegmentVersion && h.pool_id != 0 && h.slot_count > 0 &&
                      h.slot_count < (1u << 20) && h.data_offset >= kPoolHeaderBytes + 8 * h.slot_count &&
                      h.data_offset % kPoolPage == 0 && h.data_offset <= kMaxPoolBytes && h.slot_bytes > 0 &&
                      h.slot_bytes <= kMaxPoolBytes && h.slot_count <= (kMaxPoolBytes - h.data_offset) / h.slot_bytes &&
                      size == h.data_offset + h.slot_count * h.slot_bytes;
    if (!sane) return absl::InvalidArgumentError("shm pool: its header is malformed, or does not match its size");
    mapping->size = size;
    mapping->base = ::mmap(nullptr, mapping->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (mapping->base == MAP_FAILED) {
      return absl::ResourceExhaustedError(fmt::format("shm pool: mmap of {} bytes: {}", mapping->size, std::strerror(errno)));
    }
    mapping->slot_count = h.slot_count;
    mapping->slot_bytes = h.slot_bytes;
    mapping->data_offset = h.data_offset;
    mapping->pool_id = h.pool_id;
    mapping->maker_namespace = h.reserved[kMakerNamespaceWord];
    // The slots' pages are mapped now, as the producer made them (MAP_POPULATE there), so that this
    // process's resident memory moves when a pool comes or goes, not with each slot a burst first
    // reaches. An older kernel without it maps lazily. Not a sparse one (a producer populates its
    // pools): its holes would become pages here.
    if (size <= kPopulateMaxBytes && static_cast<std::size_t>(st.st_blocks) * 512 >= size) {
      ::madvise(mapping->base, size, kMadvPopulateRead);
    }
    return mapping;
  }
};

ShmConsumer::ShmConsumer(bool local_pools) : impl_(std::make_unique<Impl>()) { impl_->local = local_pools; }
ShmConsumer::~ShmConsumer() = default;

absl::StatusOr<std::uint64_t> ShmConsumer::adopt(int fd) {
  auto mapped = Impl::map(fd);
  if (!mapped.ok()) return mapped.status();
  const std::uint64_t id = (*mapped)->pool_id;
  {
    blockflow::detail::MutexLock lock(&impl_->mu);
    if (auto it = impl_->pools.find(id); it != impl_->pools.end()) {
      // Given again (a retired pool, relayed): the same file keeps its mapping; another replaces it.
      if (it->second->device == (*mapped)->device && it->second->inode == (*mapped)->inode) return id;
    } else if (impl_->pools.size() >= kMaxPoolsPerLink) {
      return absl::ResourceExhaustedError(fmt::format("shm pool: more than {} pools given on one link", kMaxPoolsPerLink));
    }
    impl_->pools.insert_or_assign(id, *mapped);
  }
  MappedPools::get().add(id, *mapped);
  return id;
}

std::vector<std::uint64_t> ShmConsumer::retired() const {
  std::vector<std::uint64_t> ids;
  blockflow::detail::MutexLock lock(&impl_->mu);
  for (const auto& [id, mapping] : impl_->pools) {
    if (pool_retired(mapping->base)->load(std::memory_order_acquire) != 0) ids.push_back(id);
  }
  return ids;
}

void ShmConsumer::retire_made_by(std::int64_t pid) {
  // The pid in a pool's id is the producer's own view of itself: it names the process `pid` names
  // only when the pool was made in this process's PID namespace (0: a producer that did not say).
  const std::uint64_t here = pid_namespace_id();
  blockflow::detail::MutexLock lock(&impl_->mu);
  for (const auto& [id, mapping] : impl_->pools) {
    if (shm_pool_producer(id) == pid && (mapping->maker_namespace == here || mapping->maker_namespace == 0)) {
      pool_retired(mapping->base)->store(1, std::memory_order_release);
    }
  }
}

void ShmConsumer::forget(const std::vector<std::uint64_t>& ids) {
  absl::flat_hash_map<std::uint64_t, std::shared_ptr<PoolMapping>> gone;  // unmapped after the lock is let go
  blockflow::detail::MutexLock lock(&impl_->mu);
  gone.swap(impl_->grace);
  for (const std::uint64_t id : ids) {
    if (auto it = impl_->pools.find(id); it != impl_->pools.end()) {
      impl_->grace.insert_or_assign(id, std::move(it->second));
      impl_->pools.erase(it);
    }
  }
}

absl::StatusOr<ShmConsumer::View> ShmConsumer::resolve(const wire::ShmHandle& handle, std::uint64_t bytes) {
  Impl& s = *impl_;
  std::shared_ptr<PoolMapping> mapping;
  {
    blockflow::detail::MutexLock lock(&s.mu);
    if (auto it = s.pools.find(handle.pool_id); it != s.pools.end()) {
      mapping = it->second;
    } else if (auto late = s.grace.find(handle.pool_id); late != s.grace.end()) {
      mapping = late->second;
    }
  }
  if (!mapping && s.local) mapping = MappedPools::get().find(handle.pool_id, /*own_only=*/true);
  if (!mapping) {
    return absl::InvalidArgumentError(
        fmt::format("shm handle: pool {:016x} was never given to this process on this link", handle.pool_id));
  }
  const PoolMapping& m = *mapping;  // the layout captured when mapped, never the shared header
  if (handle.slot >= m.slot_count) {
    return absl::InvalidArgumentError(
        fmt::format("shm handle: slot {} out of range (pool {:016x} has {})", handle.slot, handle.pool_id, m.slot_count));
  }
  if (handle.offset > m.slot_bytes || bytes > m.slot_bytes - handle.offset) {
    return absl::InvalidArgumentError(fmt::format("shm handle: offset {} + {} bytes exceeds the slot ({} bytes)",
                                                  handle.offset, bytes, m.slot_bytes));
  }
  const std::uint64_t current = slot_generations(mapping->base)[handle.slot].load(std::memory_order_acquire);
  if (handle.generation == 0 || current != handle.generation) {
    return absl::InvalidArgumentError(fmt::format("shm handle: stale or forged: generation {}, slot {} is at {}",
                                                  handle.generation, handle.slot, current));
  }
  View view;
  view.data = static_cast<char*>(mapping->base) + m.data_offset + handle.slot * m.slot_bytes + handle.offset;
  view.pool_base = mapping->base;
  view.pool_bytes = mapping->size;
  view.keep = std::move(mapping);
  return view;
}

std::size_t ShmConsumer::pools_mapped() const {
  blockflow::detail::MutexLock lock(&impl_->mu);
  return impl_->pools.size();
}

}  // namespace blockflow::detail
