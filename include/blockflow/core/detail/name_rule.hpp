#pragma once
// Internal: the character rule of blockflow/names.hpp in plain C++, shared by check_name() and the
// tools that link no BlockFlow library (blockflowctl keygen, blockflow-worker).

#include <cstddef>
#include <string_view>

namespace blockflow::detail {

inline constexpr std::size_t kNameMaxLength = 64;

/// nullptr when `name` follows the rule, else what is wrong with it ("is empty", ...).
inline const char* name_problem(std::string_view name) {
  if (name.empty()) return "is empty";
  if (name.size() > kNameMaxLength) return "is too long";
  if (name.front() == '.' || name.front() == '-') return "starts with . or -";
  for (const char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-';
    if (!ok) return "holds a character outside the set";
  }
  return nullptr;
}

}  // namespace blockflow::detail
