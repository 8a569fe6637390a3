// The shared-memory pools' ids, the names their memfds carry, and the list of the pools mapped in
// this process (shm_segment.hpp): a pool's descriptor for the data link, a tensor's slot for a relay.
#include "shm_segment.hpp"

#include <blockflow/channel/detail/shm_pool.hpp>
#include <blockflow/core/detail/mutex.hpp>

#include <fmt/format.h>

#include <optional>
#include <string_view>

#include <sys/stat.h>
#include <unistd.h>

#include <random>

namespace blockflow::detail {

std::string shm_name(std::uint64_t pool_id) { return fmt::format("blockflow-{:016x}", pool_id); }

std::optional<std::uint64_t> shm_pool_id(std::string_view name) {
  for (const std::string_view prefix : {"/memfd:", "memfd:"}) {
    if (name.substr(0, prefix.size()) == prefix) {
      name.remove_prefix(prefix.size());
      break;
    }
  }
  constexpr std::string_view kPrefix = "blockflow-";
  if (name.size() != kPrefix.size() + 16 || name.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
  std::uint64_t id = 0;
  for (const char c : name.substr(kPrefix.size())) {
    const int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (digit < 0) return std::nullopt;  // shm_name() writes lower case
    id = id << 4 | static_cast<std::uint64_t>(digit);
  }
  return id;
}

// Pool ids carry the producer's pid in their high 32 bits: a hint for people reading /proc/PID/maps,
// not a test of anything, as pids mean nothing across PID namespaces.
std::uint64_t new_pool_id() {
  static std::mt19937_64 random{std::random_device{}()};
  static blockflow::detail::Mutex mu;
  blockflow::detail::MutexLock lock(&mu);
  return (static_cast<std::uint64_t>(::getpid()) << 32) | (random() & 0xFFFFFFFFull);
}

std::uint64_t pid_namespace_id() {
  static const std::uint64_t id = [] {
    struct stat st {};
    return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<std::uint64_t>(st.st_ino) : std::uint64_t{0};
  }();
  return id;
}

ShmPoolFd shm_pool_fd(std::uint64_t pool_id) {
  auto mapping = MappedPools::get().find(pool_id, /*own_only=*/false);
  if (!mapping) return {};
  const int fd = mapping->fd;
  const std::atomic<std::uint64_t>* retired = pool_retired(mapping->base);
  return {fd, std::move(mapping), retired};
}

std::optional<wire::ShmHandle> shm_origin(const void* data, std::size_t bytes) {
  const auto* p = static_cast<const char*>(data);
  MappedPools& all = MappedPools::get();
  blockflow::detail::MutexLock lock(&all.mu);
  for (const auto& [id, weak] : all.pools) {
    const auto mapping = weak.lock();
    if (!mapping || mapping->own) continue;
    const auto* base = static_cast<const char*>(mapping->base);
    const char* first = base + mapping->data_offset;
    if (p < first || p >= base + mapping->size) continue;
    const auto slot = static_cast<std::uint32_t>(static_cast<std::size_t>(p - first) / mapping->slot_bytes);
    const std::uint64_t offset = static_cast<std::uint64_t>(p - first) - std::uint64_t{slot} * mapping->slot_bytes;
    if (slot >= mapping->slot_count || offset + bytes > mapping->slot_bytes) return std::nullopt;
    const std::uint64_t generation = slot_generations(mapping->base)[slot].load(std::memory_order_acquire);
    if (generation == 0) return std::nullopt;
    return wire::ShmHandle{id, slot, generation, offset};
  }
  return std::nullopt;
}

}  // namespace blockflow::detail
