#include <blockflow/core/names.hpp>
#include <blockflow/core/detail/name_rule.hpp>

#include <absl/strings/escaping.h>
#include <fmt/format.h>

#include <algorithm>

namespace blockflow {

static_assert(kMaxNameLength == detail::kNameMaxLength);

absl::Status check_name(std::string_view what, std::string_view name) {
  auto bad = [&](std::string_view why) {
    return absl::InvalidArgumentError(fmt::format("{} name '{}' {} (names are 1 to {} characters from A-Z a-z 0-9 _ . -, "
                                                  "not starting with . or -)",
                                                  what, absl::CEscape(absl::string_view(name.data(), std::min<std::size_t>(name.size(), 80))), why, kMaxNameLength));
  };
  if (const char* problem = detail::name_problem(name)) return bad(problem);
  return absl::OkStatus();
}

absl::Status check_site_name(std::string_view what, std::string_view name) {
  if (auto status = check_name(what, name); !status.ok()) return status;
  if (name == "threads" || name == "host") {
    return absl::InvalidArgumentError(fmt::format("{} name '{}' is reserved (the session's own process goes by it in "
                                                  "metrics)", what, name));
  }
  return absl::OkStatus();
}

}  // namespace blockflow
