#pragma once
// Internal: how deep JSON text nests, read without parsing it, in plain C++: shared by
// check_json_depth() (deployments, plans, control requests) and blockflowctl, which links no
// BlockFlow library. nlohmann's code recurses once a level, so text from outside is looked at
// before it is parsed.

#include <string_view>

namespace blockflow::detail {

/// Whether the arrays and objects of `text` nest deeper than `max_depth` (strings skipped).
inline bool json_nests_deeper(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > max_depth) return true;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return false;
}

}  // namespace blockflow::detail
