// The names of the shared-memory pools' objects (/dev/shm/blockflow-<16 hex>), their ids, and the
// sweep of the objects that no live producer holds (shm_pool_names.hpp).
#include "shm_pool_names.hpp"

#include <blockflow/channel/detail/shm_pool.hpp>
#include <blockflow/core/detail/mutex.hpp>

#include <fmt/format.h>

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <random>

namespace blockflow::detail {
namespace {

// Unlinks the pool object `name` when it is abandoned. A producer holds LOCK_SH on each pool from
// its creation to its end, so LOCK_EX at once means no producer holds it (it died, or it is between
// the exclusive create and its flock); it takes the lock before it gives the object a size, so a
// size-0 object may be one being created right now and is kept. Never judged by the pid in the name.
void unlink_if_abandoned(const std::string& name) {
  const int fd = ::shm_open(name.c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) return;  // gone meanwhile, or another user's
  struct stat st {};
  if (::flock(fd, LOCK_EX | LOCK_NB) == 0 && ::fstat(fd, &st) == 0 && st.st_size > 0) ::shm_unlink(name.c_str());
  ::close(fd);  // drops our LOCK_EX too
}

}  // namespace

std::string shm_name(std::uint64_t pool_id) { return fmt::format("/blockflow-{:016x}", pool_id); }

std::optional<std::uint64_t> shm_pool_id(std::string_view name) {
  for (const std::string_view dir : {"/dev/shm/", "/"}) {
    if (name.substr(0, dir.size()) == dir) {
      name.remove_prefix(dir.size());
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

// Pool ids carry the producer's pid in their high 32 bits: a hint for people reading /dev/shm, not
// the test of abandonment (sweep_orphaned_pools()), as pids mean nothing across PID namespaces.
std::uint64_t new_pool_id() {
  static std::mt19937_64 random{std::random_device{}()};
  static blockflow::detail::Mutex mu;
  blockflow::detail::MutexLock lock(&mu);
  return (static_cast<std::uint64_t>(::getpid()) << 32) | (random() & 0xFFFFFFFFull);
}

bool lock_shared(int fd) {
  while (::flock(fd, LOCK_SH) != 0) {
    if (errno != EINTR) return false;
  }
  return true;
}

void sweep_orphaned_pools() {
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return;
  while (dirent* entry = ::readdir(dir)) {
    if (const auto id = shm_pool_id(entry->d_name)) unlink_if_abandoned(shm_name(*id));
  }
  ::closedir(dir);
}

}  // namespace blockflow::detail
