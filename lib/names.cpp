#include <blockflow/names.hpp>

#include <absl/strings/escaping.h>
#include <fmt/format.h>

#include <algorithm>

namespace blockflow {

absl::Status check_name(std::string_view what, std::string_view name) {
  auto bad = [&](std::string_view why) {
    return absl::InvalidArgumentError(fmt::format("{} name '{}' {} (names are 1 to {} characters from A-Z a-z 0-9 _ . -, "
                                                  "not starting with . or -)",
                                                  what, absl::CEscape(absl::string_view(name.data(), std::min<std::size_t>(name.size(), 80))), why, kMaxNameLength));
  };
  if (name.empty()) return bad("is empty");
  if (name.size() > kMaxNameLength) return bad("is too long");
  if (name.front() == '.' || name.front() == '-') return bad("starts with . or -");
  for (const char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-';
    if (!ok) return bad("holds a character outside the set");
  }
  return absl::OkStatus();
}

}  // namespace blockflow
