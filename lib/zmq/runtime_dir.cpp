#include <blockflow/detail/runtime_dir.hpp>

#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ftw.h>
#include <unistd.h>

#include <vector>

namespace blockflow::detail {

absl::StatusOr<std::string> make_private_dir(const std::string& tag) {
  const char* base = std::getenv("XDG_RUNTIME_DIR");
  std::string root = (base != nullptr && *base != '\0') ? base : "/tmp";
  std::string pattern = fmt::format("{}/blockflow-{}-XXXXXX", root, tag);
  std::vector<char> buffer(pattern.begin(), pattern.end());
  buffer.push_back('\0');
  if (::mkdtemp(buffer.data()) == nullptr) {  // mkdtemp creates the directory with mode 0700
    return absl::InternalError(fmt::format("cannot create a private directory {}: {}", pattern, std::strerror(errno)));
  }
  return std::string(buffer.data());
}

// POSIX nftw rather than std::filesystem::remove_all: some libtorch builds (PyTorch wheels) export
// their own std::filesystem symbols, and a call bound to theirs crashed at shutdown.
void remove_private_dir(const std::string& dir) {
  if (dir.empty()) return;
  (void)::nftw(
      dir.c_str(), [](const char* path, const struct stat*, int, struct FTW*) {
        (void)::remove(path);
        return 0;  // go on: remove what can be removed
      }, 16,
      FTW_DEPTH | FTW_PHYS);
}

}  // namespace blockflow::detail
