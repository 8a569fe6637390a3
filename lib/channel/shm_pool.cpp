#include <blockflow/channel/detail/shm_pool.hpp>

#include "shm_segment.hpp"

#include <absl/container/flat_hash_map.h>
#include <blockflow/core/detail/clock.hpp>
#include <blockflow/core/detail/mutex.hpp>
#include <fmt/format.h>

#include <optional>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <vector>

namespace blockflow::detail {
namespace {

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

std::size_t next_pow2(std::size_t n) {
  std::size_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
struct ShmProducer::Impl {
  struct Slot {
    bool leased = false;
    std::uint64_t generation = 0;
    bool producer_holds = false;     // lease(): the producer's own tensor is over it
    std::uint32_t consumer_holds = 0;  // handles sent and not yet released
  };
  struct Pool {
    std::uint64_t id = 0;
    std::shared_ptr<PoolMapping> mapping;
    std::size_t slot_bytes = 0;
    std::size_t data_offset = 0;
    std::vector<Slot> slots;
    std::uint64_t next_generation = 1;
    std::int64_t idle_since_ns = 0;  // when its last leased slot was freed; 0 while any is leased
    char* slot_address(std::uint32_t slot) const {
      return static_cast<char*>(mapping->base) + data_offset + slot * slot_bytes;
    }
  };

  // The trim delay of one size class (ShmPoolOptions::idle_trim_max).
  struct ClassTrim {
    std::size_t slot_bytes = 0;
    std::int64_t delay_ns = 0;
    std::int64_t last_trim_ns = 0;  // 0: none of this class trimmed yet
  };

  ShmPoolOptions options;
  mutable blockflow::detail::Mutex mu;
  std::vector<Pool> pools;  // by slot size, small first
  std::vector<ClassTrim> class_trims;
  ShmEdgeStats stats;
  // Changes that may let a waiting stage() on: a slot freed, a pool made (or its making given up),
  // a pool unmapped (room under max_total_bytes). stage() waits for this to move.
  std::uint64_t frees = 0;
  bool stopped_waiting = false;  // stop_waiting(): no more waits for a slot
  std::size_t creating_bytes = 0, creating_pools = 0;  // pools being made without the lock (find_slot())

  struct WaitArg {
    Impl* impl;
    std::uint64_t seen;
  };
  static bool freed_since(WaitArg* arg) { return arg->impl->frees != arg->seen || arg->impl->stopped_waiting; }

  absl::StatusOr<Pool> create_pool(std::size_t slot_bytes) {
    Pool pool;
    pool.id = new_pool_id();
    pool.slot_bytes = slot_bytes;
    pool.data_offset = round_up(kPoolHeaderBytes + 8 * options.slots_per_pool, kPoolPage);
    const std::size_t size = pool.data_offset + slot_bytes * options.slots_per_pool;
    const std::string name = shm_name(pool.id);
    // A memfd: no name anyone can open, gone with its last descriptor and mapping (a producer
    // killed leaves nothing behind); sealed at its size, so that no process holding it can shrink
    // it under a consumer (whose next read past the end would fault with SIGBUS).
    const int fd = ::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return absl::ResourceExhaustedError(fmt::format("memfd_create {}: {}", name, std::strerror(errno)));
    auto mapping = std::make_shared<PoolMapping>();
    mapping->fd = fd;  // closed with the mapping
    mapping->own = true;
    auto fail = [&](const char* what) {
      return absl::ResourceExhaustedError(fmt::format("{} {} ({} bytes): {}", what, name, size, std::strerror(errno)));
    };
    if (::ftruncate(fd, static_cast<off_t>(size)) != 0) return fail("ftruncate");
    if (::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) return fail("sealing");
    mapping->size = size;
    // MAP_POPULATE (pools up to kPopulateMaxBytes): the pool's pages are made now, once, rather than
    // by faults on the requests that first use each slot; a process's resident memory then moves
    // when a pool comes or goes.
    const int populate = size <= kPopulateMaxBytes ? MAP_POPULATE : 0;
    mapping->base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | populate, fd, 0);
    if (mapping->base == MAP_FAILED) return fail("mmap");
    auto* header = static_cast<SegmentHeader*>(mapping->base);
    *header = SegmentHeader{kSegmentMagic, kSegmentVersion, pool.id, options.slots_per_pool, slot_bytes, pool.data_offset, {}};
    header->reserved[kMakerNamespaceWord] = pid_namespace_id();
    for (std::size_t i = 0; i < options.slots_per_pool; ++i) slot_generations(mapping->base)[i].store(0);
    mapping->slot_count = options.slots_per_pool;
    mapping->slot_bytes = slot_bytes;
    mapping->data_offset = pool.data_offset;
    mapping->pool_id = pool.id;
    MappedPools::get().add(pool.id, mapping);
    pool.mapping = std::move(mapping);
    pool.slots.resize(options.slots_per_pool);
    return pool;
  }

  std::uint64_t bytes_mapped() const {
    std::uint64_t total = 0;
    for (const auto& p : pools) total += p.mapping->size;
    return total;
  }

  ClassTrim& class_trim(std::size_t slot_bytes) {
    for (auto& c : class_trims) {
      if (c.slot_bytes == slot_bytes) return c;
    }
    class_trims.push_back({slot_bytes, absl::ToInt64Nanoseconds(options.idle_trim), 0});
    return class_trims.back();
  }

  // Retires and unmaps the pools idle for their class's trim delay, newest first, keeping the
  // oldest of each size class (the one every consumer has mapped). Before any Pool* is taken: it
  // moves the others in `pools`.
  void trim_idle_pools() {
    if (options.idle_trim <= absl::ZeroDuration()) return;
    const std::int64_t now = now_ns();
    for (std::size_t i = pools.size(); i-- > 0;) {
      const Pool& pool = pools[i];
      const bool oldest_of_class = i == 0 || pools[i - 1].slot_bytes != pool.slot_bytes;  // sorted, stable
      if (pool.idle_since_ns == 0 || oldest_of_class) continue;
      ClassTrim& trim = class_trim(pool.slot_bytes);
      if (now - pool.idle_since_ns < trim.delay_ns) continue;
      trim.last_trim_ns = now;
      retire_pool(i);
    }
  }

  // Retires and unmaps pools[i], which no slot of is leased: consumers drop it as they see it retired.
  void retire_pool(std::size_t i) {
    const Pool& pool = pools[i];
    pool_retired(pool.mapping->base)->store(1, std::memory_order_release);  // it goes with the Pool
    stats.slots_total -= pool.slots.size();
    ++stats.pools_trimmed;
    pools.erase(pools.begin() + static_cast<std::ptrdiff_t>(i));
    ++frees;  // room under max_total_bytes
  }

  bool room_for(std::size_t size) const {
    return bytes_mapped() + creating_bytes + size <= options.max_total_bytes &&
           (options.max_pools == 0 || pools.size() + creating_pools < options.max_pools);
  }

  // Room for a new pool of `size` bytes: idle pools of any class go, the longest idle first (the
  // oldest of a class too: an idle pool must not keep a tensor that fits from being sent).
  bool make_room(std::size_t size) {
    std::size_t idle_bytes = 0, idle_pools = 0;
    for (const auto& p : pools) {
      if (p.idle_since_ns != 0) {
        idle_bytes += p.mapping->size;
        ++idle_pools;
      }
    }
    // None goes unless all the idle ones together make the room (no churn for nothing).
    if (bytes_mapped() - idle_bytes + creating_bytes + size > options.max_total_bytes ||
        (options.max_pools > 0 && pools.size() - idle_pools + creating_pools >= options.max_pools)) {
      return false;
    }
    while (!room_for(size)) {
      std::optional<std::size_t> idlest;
      for (std::size_t i = 0; i < pools.size(); ++i) {
        if (pools[i].idle_since_ns != 0 && (!idlest || pools[i].idle_since_ns < pools[*idlest].idle_since_ns)) idlest = i;
      }
      if (!idlest) return false;
      retire_pool(*idlest);
    }
    return true;
  }

  // A pool of this class is about to be made: if the class lost one lately, the last trim came too
  // soon, so its delay doubles (up to idle_trim_max).
  void note_pool_needed(std::size_t slot_bytes) {
    ClassTrim& trim = class_trim(slot_bytes);
    if (trim.last_trim_ns == 0 || now_ns() - trim.last_trim_ns >= 4 * trim.delay_ns) return;
    trim.delay_ns = std::min(2 * trim.delay_ns, std::max(absl::ToInt64Nanoseconds(options.idle_trim_max), trim.delay_ns));
    trim.last_trim_ns = 0;  // one doubling per trim
  }

  // A free slot of the smallest fitting class, creating a pool if none is free and the bound allows
  // (unmapping idle pools for it). `can_ever_fit` false: no pool for it fits under max_total_bytes
  // (max_pools) even alone, `pool_bytes` the size it needs.
  absl::StatusOr<std::pair<Pool*, std::uint32_t>> find_slot(std::size_t bytes, bool& can_ever_fit, std::size_t& pool_bytes) {
    trim_idle_pools();
    can_ever_fit = false;
    for (auto& pool : pools) {
      if (pool.slot_bytes < bytes) continue;
      can_ever_fit = true;
      for (std::uint32_t i = 0; i < pool.slots.size(); ++i) {
        if (!pool.slots[i].leased) return std::make_pair(&pool, i);
      }
    }
    const std::size_t slot_bytes = std::max(options.min_slot_bytes, next_pow2(std::max<std::size_t>(bytes, 1)));
    const std::size_t size = round_up(kPoolHeaderBytes + 8 * options.slots_per_pool, kPoolPage) + slot_bytes * options.slots_per_pool;
    if (slot_bytes > kMaxPoolBytes / options.slots_per_pool || size > kMaxPoolBytes) {
      return absl::ResourceExhaustedError(fmt::format("a pool of {} slots of {} bytes exceeds the largest a consumer maps ({} bytes)",
                                                      options.slots_per_pool, slot_bytes, kMaxPoolBytes));
    }
    pool_bytes = size;
    if (!make_room(size)) {
      // Pools in use (or being made) hold the room: it comes as they are freed, unless the pool is
      // larger than the whole bound.
      if (size <= options.max_total_bytes) can_ever_fit = true;
      return std::make_pair(static_cast<Pool*>(nullptr), 0u);
    }
    note_pool_needed(slot_bytes);
    // Made without the lock: populating a pool of up to 64 MB takes milliseconds, which every
    // release, lease and share of the other pools would otherwise wait. No Pool* is held across it
    // (`pools` may move meanwhile); creating_bytes keeps max_total_bytes while it runs.
    creating_bytes += size;
    ++creating_pools;
    mu.Unlock();
    if (auto hook = shm_pool_create_hook.load(std::memory_order_acquire)) hook();
    auto pool = create_pool(slot_bytes);
    mu.Lock();
    creating_bytes -= size;
    --creating_pools;
    ++frees;  // made or given up: a stage() waiting meanwhile looks again (a slot, or the room)
    if (!pool.ok()) return pool.status();
    ++stats.pools_created;
    can_ever_fit = true;
    stats.slots_total += options.slots_per_pool;
    pools.push_back(*std::move(pool));
    // By size class, oldest first within one (trim_idle_pools() keeps the oldest).
    std::stable_sort(pools.begin(), pools.end(), [](const Pool& a, const Pool& b) { return a.slot_bytes < b.slot_bytes; });
    for (auto& p : pools) {
      if (p.slot_bytes == slot_bytes && !p.slots[0].leased) return std::make_pair(&p, 0u);
    }
    return absl::InternalError("new shm pool not found");
  }

  Pool* pool_of(std::uint64_t id) {
    for (auto& p : pools) {
      if (p.id == id) return &p;
    }
    return nullptr;
  }

  // Frees the slot once nobody holds it any more.
  void maybe_free(Pool& pool, std::uint32_t slot) {
    const Slot& x = pool.slots[slot];
    if (x.leased && !x.producer_holds && x.consumer_holds == 0) free_slot(pool, slot);
  }

  // A free slot for `bytes`, leased with a fresh generation (published in shared memory), waiting
  // for a credit until `deadline`.
  // `wait` false: nullptr slot at once when none is free (no credit wait counted).
  absl::StatusOr<std::pair<Pool*, std::uint32_t>> acquire(std::size_t bytes, absl::Time deadline, bool wait = true)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    bool waited = false;
    if (bytes > options.max_total_bytes) {  // never fits; and next_pow2() must not see it
      if (!wait) return std::pair<Pool*, std::uint32_t>{nullptr, 0};
      return absl::ResourceExhaustedError(fmt::format(
          "a tensor of {} bytes does not fit in shared memory: max_total_bytes is {}", bytes, options.max_total_bytes));
    }
    while (true) {
      // Closing: not even a slot freed meanwhile (the link's end reclaims them all) is taken.
      if (stopped_waiting && wait) return absl::CancelledError("the channel was closed while a send waited for a slot");
      bool can_ever_fit = false;
      std::size_t pool_bytes = 0;
      auto found = find_slot(bytes, can_ever_fit, pool_bytes);
      if (!found.ok()) return found.status();
      if (auto [pool, slot] = *found; pool != nullptr) {
        const std::uint64_t generation = pool->next_generation++;
        pool->slots[slot] = {true, generation, false, 0};
        pool->idle_since_ns = 0;
        // Published before the handle can reach anyone (the send that follows is a barrier too).
        slot_generations(pool->mapping->base)[slot].store(generation, std::memory_order_release);
        ++stats.slots_in_use;
        return *found;
      }
      if (!wait) return std::pair<Pool*, std::uint32_t>{nullptr, 0};
      if (!can_ever_fit) {
        return absl::ResourceExhaustedError(fmt::format(
            "a tensor of {} bytes does not fit in shared memory: its pool ({} slots) takes {} bytes, more than "
            "max_total_bytes {}",
            bytes, options.slots_per_pool, pool_bytes, options.max_total_bytes));
      }
      if (!waited) ++stats.credit_waits;
      waited = true;
      WaitArg arg{this, frees};
      if (mu.AwaitWithDeadline(absl::Condition(&Impl::freed_since, &arg), deadline)) continue;
      return absl::DeadlineExceededError(
          fmt::format("no free shared-memory slot for {} bytes: {} slot(s) in use, none released in time", bytes,
                      stats.slots_in_use));
    }
  }

  // stage()'s first step: a slot for `bytes`, held by the producer as a lease is (producer_holds),
  // so that while it is copied into, without the lock, nobody can take, free or reclaim it: find_slot
  // skips it, and release(), reclaim_all() and maybe_free() see no consumer hold to drop.
  absl::StatusOr<std::pair<wire::ShmHandle, char*>> reserve(std::size_t bytes, absl::Time deadline) {
    blockflow::detail::MutexLock lock(&mu);
    auto acquired = acquire(bytes, deadline);
    if (!acquired.ok()) return acquired.status();
    auto [pool, slot] = *acquired;
    pool->slots[slot].producer_holds = true;
    return std::make_pair(wire::ShmHandle{pool->id, slot, pool->slots[slot].generation, 0}, pool->slot_address(slot));
  }

  // stage()'s last step: the filled slot becomes the consumer's (its handle is about to be sent).
  // Found again by id: another stage() may have added a pool (and moved `pools`) meanwhile.
  void publish_staged(const wire::ShmHandle& handle, std::size_t bytes) {
    blockflow::detail::MutexLock lock(&mu);
    Slot& x = pool_of(handle.pool_id)->slots[handle.slot];
    x.producer_holds = false;
    x.consumer_holds = 1;
    ++stats.handles;
    stats.bytes_staged += bytes;
  }

  void free_slot(Pool& pool, std::uint32_t slot) {
    pool.slots[slot] = {};
    slot_generations(pool.mapping->base)[slot].store(0, std::memory_order_release);
    --stats.slots_in_use;
    ++frees;
    if (std::none_of(pool.slots.begin(), pool.slots.end(), [](const Slot& x) { return x.leased; })) {
      pool.idle_since_ns = now_ns();
    }
  }
};

ShmProducer::ShmProducer(ShmPoolOptions options) : impl_(std::make_shared<Impl>()) {
  if (options.slots_per_pool == 0) options.slots_per_pool = 1;
  impl_->options = options;
}

ShmProducer::~ShmProducer() {
  for (const auto& pool : impl_->pools) pool_retired(pool.mapping->base)->store(1, std::memory_order_release);
}

std::atomic<void (*)(const wire::ShmHandle&)> shm_stage_copy_hook{nullptr};
std::atomic<void (*)()> shm_pool_create_hook{nullptr};

absl::StatusOr<wire::ShmHandle> ShmProducer::stage(const void* data, std::size_t bytes, absl::Time deadline) {
  Impl& s = *impl_;
  auto reserved = s.reserve(bytes, deadline);
  if (!reserved.ok()) return reserved.status();
  const auto [handle, slot_data] = *reserved;
  if (auto hook = shm_stage_copy_hook.load(std::memory_order_acquire)) hook(handle);
  // Without the lock: a 100 MB copy takes ~10 ms, and every release() and share() of these pools
  // would wait that long. The handle is sent only after this returns (the send orders the bytes).
  if (bytes > 0) std::memcpy(slot_data, data, bytes);
  s.publish_staged(handle, bytes);
  return handle;
}

absl::StatusOr<ShmLease> ShmProducer::lease(std::size_t bytes, absl::Time deadline) {
  return lease_slot(bytes, deadline, true);
}

std::optional<ShmLease> ShmProducer::try_lease(std::size_t bytes) {
  auto lease = lease_slot(bytes, absl::InfinitePast(), false);
  if (!lease.ok() || lease->data == nullptr) return std::nullopt;
  return *std::move(lease);
}

absl::StatusOr<ShmLease> ShmProducer::lease_slot(std::size_t bytes, absl::Time deadline, bool wait) {
  Impl& s = *impl_;
  blockflow::detail::MutexLock lock(&s.mu);
  auto acquired = s.acquire(bytes, deadline, wait);
  if (!acquired.ok()) return acquired.status();
  auto [pool, slot] = *acquired;
  if (pool == nullptr) return ShmLease{};  // none free (wait == false)
  pool->slots[slot].producer_holds = true;
  ++s.stats.leases;
  ShmLease out;
  out.data = pool->slot_address(slot);
  out.handle = wire::ShmHandle{pool->id, slot, pool->slots[slot].generation, 0};
  out.keep = pool->mapping;
  std::weak_ptr<Impl> weak = impl_;
  out.drop = [weak, handle = out.handle] {
    auto impl = weak.lock();
    if (!impl) return;  // the producer is gone; the mapping stayed alive for the tensor
    blockflow::detail::MutexLock lock(&impl->mu);
    Impl::Pool* p = impl->pool_of(handle.pool_id);
    if (p == nullptr || handle.slot >= p->slots.size() || p->slots[handle.slot].generation != handle.generation) return;
    p->slots[handle.slot].producer_holds = false;
    impl->maybe_free(*p, handle.slot);
  };
  return out;
}

std::optional<wire::ShmHandle> ShmProducer::share(const void* data, std::size_t bytes) {
  Impl& s = *impl_;
  blockflow::detail::MutexLock lock(&s.mu);
  const char* p = static_cast<const char*>(data);
  for (auto& pool : s.pools) {
    const char* first = pool.slot_address(0);
    const char* end = first + pool.slot_bytes * pool.slots.size();
    if (p < first || p >= end) continue;
    const auto slot = static_cast<std::uint32_t>(static_cast<std::size_t>(p - first) / pool.slot_bytes);
    const std::size_t offset = static_cast<std::size_t>(p - pool.slot_address(slot));
    Impl::Slot& x = pool.slots[slot];
    if (!x.leased || !x.producer_holds || offset + bytes > pool.slot_bytes) return std::nullopt;
    ++x.consumer_holds;
    ++s.stats.handles;
    return wire::ShmHandle{pool.id, slot, x.generation, offset};
  }
  return std::nullopt;
}

void ShmProducer::stop_waiting() {
  blockflow::detail::MutexLock lock(&impl_->mu);
  impl_->stopped_waiting = true;
}

bool ShmProducer::release(const wire::ShmHandle& handle) {
  Impl& s = *impl_;
  blockflow::detail::MutexLock lock(&s.mu);
  Impl::Pool* pool = s.pool_of(handle.pool_id);
  if (pool == nullptr || handle.slot >= pool->slots.size() || !pool->slots[handle.slot].leased ||
      pool->slots[handle.slot].generation != handle.generation) {
    ++s.stats.stale_releases;
    return false;
  }
  Impl::Slot& x = pool->slots[handle.slot];
  if (x.consumer_holds == 0) {  // a duplicate release while the producer still holds the slot
    ++s.stats.stale_releases;
    return false;
  }
  --x.consumer_holds;
  s.maybe_free(*pool, handle.slot);
  ++s.stats.releases;
  return true;
}

std::size_t ShmProducer::reclaim_all() {
  Impl& s = *impl_;
  blockflow::detail::MutexLock lock(&s.mu);
  std::size_t n = 0;
  for (auto& pool : s.pools) {
    for (std::uint32_t i = 0; i < pool.slots.size(); ++i) {
      Impl::Slot& x = pool.slots[i];
      if (!x.leased || x.consumer_holds == 0) continue;
      x.consumer_holds = 0;  // the producer's own tensor, if any, keeps its slot
      s.maybe_free(pool, i);
      ++n;
    }
  }
  s.stats.reclaims += n;
  return n;
}

ShmEdgeStats ShmProducer::stats() const {
  const Impl& s = *impl_;
  blockflow::detail::MutexLock lock(&s.mu);
  ShmEdgeStats out = s.stats;
  out.pools = s.pools.size();
  out.bytes_mapped = s.bytes_mapped();
  return out;
}

std::uint64_t ShmProducer::held_by_consumer() const {
  const Impl& s = *impl_;
  blockflow::detail::MutexLock lock(&s.mu);
  std::uint64_t held = 0;
  for (const auto& pool : s.pools) {
    for (const auto& x : pool.slots) held += (x.leased && x.consumer_holds > 0) ? 1 : 0;
  }
  return held;
}

const void* ShmProducer::address(const wire::ShmHandle& handle) const {
  Impl& s = *impl_;
  blockflow::detail::MutexLock lock(&s.mu);
  Impl::Pool* pool = s.pool_of(handle.pool_id);
  if (pool == nullptr || handle.slot >= pool->slots.size()) return nullptr;
  return pool->slot_address(handle.slot) + handle.offset;
}

}  // namespace blockflow::detail
