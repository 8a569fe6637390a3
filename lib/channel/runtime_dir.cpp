#include <blockflow/channel/detail/runtime_dir.hpp>

#include <blockflow/core/detail/mutex.hpp>
#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <map>
#include <vector>

namespace blockflow::detail {
namespace {

constexpr const char* kOwnerLock = "owner.lock";

}  // namespace

std::string runtime_root() {
  const char* base = std::getenv("XDG_RUNTIME_DIR");
  return (base != nullptr && *base != '\0') ? base : "/tmp";
}

namespace {

// The owner locks this process holds, by directory: the lock lives as long as the process or
// until remove_private_dir(), so a directory whose lock anyone can take is abandoned.
struct OwnerLocks {
  blockflow::detail::Mutex mu;
  std::map<std::string, int> fds;
  static OwnerLocks& get() {
    static OwnerLocks* locks = new OwnerLocks;  // never destroyed: used until the process exits
    return *locks;
  }
};

// Removes the directory tree (best effort). POSIX nftw rather than std::filesystem::remove_all:
// some libtorch builds (PyTorch wheels) export their own std::filesystem symbols, and a call bound
// to theirs crashed at shutdown.
void remove_tree(const std::string& dir) {
  (void)::nftw(
      dir.c_str(), [](const char* path, const struct stat*, int, struct FTW*) {
        (void)::remove(path);
        return 0;  // go on: remove what can be removed
      }, 16,
      FTW_DEPTH | FTW_PHYS);
}

// Holds a shared lock on <dir>/owner.lock for the process's life. The lock file is made under a
// temporary name, locked, then renamed: a sweeper never sees an owner lock that nobody holds yet.
int take_owner_lock(const std::string& dir) {
  std::string pattern = dir + "/owner.lock.XXXXXX";
  std::vector<char> name(pattern.begin(), pattern.end());
  name.push_back('\0');
  const int fd = ::mkostemp(name.data(), O_CLOEXEC);
  if (fd < 0) return -1;
  if (::flock(fd, LOCK_SH) != 0 || ::rename(name.data(), (dir + "/" + kOwnerLock).c_str()) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

}  // namespace

void sweep_abandoned_private_dirs() {
  const std::string root = runtime_root();
  DIR* listing = ::opendir(root.c_str());
  if (listing == nullptr) return;
  std::vector<std::string> abandoned;
  while (dirent* entry = ::readdir(listing)) {
    if (std::strncmp(entry->d_name, "blockflow-", 10) != 0) continue;
    const std::string dir = root + "/" + entry->d_name;
    struct stat st {};
    if (::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid()) continue;
    // No owner lock (being made right now, or made by an older version): not provably abandoned.
    const int fd = ::open((dir + "/" + kOwnerLock).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) continue;
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) abandoned.push_back(dir);
    ::close(fd);
  }
  ::closedir(listing);
  for (const auto& dir : abandoned) remove_tree(dir);
}

absl::StatusOr<std::string> make_private_dir(const std::string& tag) {
  sweep_abandoned_private_dirs();
  std::string pattern = fmt::format("{}/blockflow-{}-XXXXXX", runtime_root(), tag);
  std::vector<char> buffer(pattern.begin(), pattern.end());
  buffer.push_back('\0');
  if (::mkdtemp(buffer.data()) == nullptr) {  // mkdtemp creates the directory with mode 0700
    return absl::InternalError(fmt::format("cannot create a private directory {}: {}", pattern, std::strerror(errno)));
  }
  std::string dir(buffer.data());
  const int fd = take_owner_lock(dir);
  if (fd < 0) {
    const std::string why = std::strerror(errno);
    remove_tree(dir);
    return absl::InternalError(fmt::format("cannot lock the private directory {}: {}", dir, why));
  }
  OwnerLocks& locks = OwnerLocks::get();
  blockflow::detail::MutexLock lock(&locks.mu);
  locks.fds[dir] = fd;
  return dir;
}

void remove_private_dir(const std::string& dir) {
  if (dir.empty()) return;
  remove_tree(dir);
  OwnerLocks& locks = OwnerLocks::get();
  blockflow::detail::MutexLock lock(&locks.mu);
  if (auto it = locks.fds.find(dir); it != locks.fds.end()) {
    ::close(it->second);
    locks.fds.erase(it);
  }
}

}  // namespace blockflow::detail
