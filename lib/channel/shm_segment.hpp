#pragma once
// Internal to the shared-memory pools (shm_pool.cpp: the producer; shm_consumer.cpp; shm_segment.cpp):
// a pool's layout in memory, a mapping of one, the process-wide list of the pools mapped here, and
// pool ids and the names their memfds carry.

#include <blockflow/core/detail/mutex.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace blockflow::detail {

constexpr std::uint32_t kSegmentMagic = 0x50534642;  // "BFSP"
constexpr std::uint32_t kSegmentVersion = 1;
constexpr std::size_t kPoolHeaderBytes = 64;
constexpr std::size_t kPoolPage = 4096;
// The largest pool a consumer maps: 4 slots of the wire format's largest tensor (16 GiB), and the
// generations of up to 2^20 slots before them.
constexpr std::size_t kMaxPoolBytes = (std::size_t{64} << 30) + (std::size_t{16} << 20);
// Pools up to this size have their pages made (producer) and mapped (consumer) at once; larger ones
// fault page by page as slots are used, so that one big tensor does not commit all its pool's slots.
constexpr std::size_t kPopulateMaxBytes = std::size_t{64} << 20;
#ifdef MADV_POPULATE_READ
constexpr int kMadvPopulateRead = MADV_POPULATE_READ;
#else
constexpr int kMadvPopulateRead = 22;  // Linux 5.14; EINVAL (ignored) on older kernels
#endif

struct SegmentHeader {
  std::uint32_t magic;
  std::uint32_t version;
  std::uint64_t pool_id;
  std::uint64_t slot_count;
  std::uint64_t slot_bytes;
  std::uint64_t data_offset;
  std::uint64_t reserved[3];
};
static_assert(sizeof(SegmentHeader) == kPoolHeaderBytes);
static_assert(sizeof(std::atomic<std::uint64_t>) == 8 && std::atomic<std::uint64_t>::is_always_lock_free);

inline std::atomic<std::uint64_t>* slot_generations(void* base) {
  return reinterpret_cast<std::atomic<std::uint64_t>*>(static_cast<char*>(base) + kPoolHeaderBytes);
}

// The header's second reserved word: the producer's PID namespace (pid_namespace_id()), so that a
// consumer compares the pid in a pool's id with a pid it sees only when both mean the same process.
inline constexpr std::size_t kMakerNamespaceWord = 1;

// The header's first reserved word: 1 once the producer has let the pool go (trimmed, or the
// producer ended), so that consumers drop their cached mapping of it.
inline std::atomic<std::uint64_t>* pool_retired(void* base) {
  return reinterpret_cast<std::atomic<std::uint64_t>*>(static_cast<char*>(base) + offsetof(SegmentHeader, reserved));
}

// A pool mapped here, with its memfd (kept open: a relay sends it on to the next process). The
// producer's mapping retires the pool as it goes (a pool trimmed, or the producer gone): the
// consumers drop their mappings of it.
struct PoolMapping {
  void* base = MAP_FAILED;
  std::size_t size = 0;
  int fd = -1;
  bool own = false;  // made by a ShmProducer of this process
  // The pool's layout. A consumer's copy is taken (and checked against `size`) when it was mapped:
  // the header lies in memory another process can rewrite, so it is never read again.
  std::uint64_t slot_count = 0, slot_bytes = 0, data_offset = 0, pool_id = 0;
  std::uint64_t device = 0, inode = 0;  // the file's, to know it when it is given again
  std::uint64_t maker_namespace = 0;    // the producer's PID namespace, from the header (0: unknown)
  ~PoolMapping() {
    if (base != MAP_FAILED && own) pool_retired(base)->store(1, std::memory_order_release);
    if (base != MAP_FAILED) ::munmap(base, size);
    if (fd >= 0) ::close(fd);
  }
};

// Every pool mapped here: this process's own (ShmProducer) and those other processes gave it
// (ShmConsumer::adopt()), so that a tensor over one can be handed on as the same slot (shm_origin())
// with the pool's descriptor (shm_pool_fd()).
struct MappedPools {
  blockflow::detail::Mutex mu;
  std::vector<std::pair<std::uint64_t, std::weak_ptr<PoolMapping>>> pools ABSL_GUARDED_BY(mu);
  static MappedPools& get() {
    static auto* all = new MappedPools;  // never destroyed: deleters may run during exit
    return *all;
  }
  void add(std::uint64_t id, const std::shared_ptr<PoolMapping>& mapping) {
    blockflow::detail::MutexLock lock(&mu);
    pools.erase(std::remove_if(pools.begin(), pools.end(), [](const auto& p) { return p.second.expired(); }),
                pools.end());
    pools.emplace_back(id, mapping);
  }
  // The newest live mapping of pool `id` (own or given), or null.
  std::shared_ptr<PoolMapping> find(std::uint64_t id, bool own_only) {
    blockflow::detail::MutexLock lock(&mu);
    for (auto it = pools.rbegin(); it != pools.rend(); ++it) {
      if (it->first != id) continue;
      if (auto mapping = it->second.lock(); mapping && (mapping->own || !own_only)) return mapping;
    }
    return nullptr;
  }
};

/// "blockflow-<16 hex digits>": the memfd name of pool `pool_id` (shown as "/memfd:blockflow-..." in
/// /proc/PID/maps and /proc/PID/fd; shm_pool_id() reads it back).
std::string shm_name(std::uint64_t pool_id);
/// A fresh pool id: this process's pid in the high 32 bits, random low 32 bits.
std::uint64_t new_pool_id();
// This process's PID namespace: the inode of /proc/self/ns/pid (0 where /proc does not say).
std::uint64_t pid_namespace_id();

}  // namespace blockflow::detail
