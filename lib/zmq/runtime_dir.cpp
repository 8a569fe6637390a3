#include <blockflow/detail/runtime_dir.hpp>

#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
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

void remove_private_dir(const std::string& dir) {
  std::error_code ec;
  if (!dir.empty()) std::filesystem::remove_all(dir, ec);
}

}  // namespace blockflow::detail
