#pragma once
// Internal: whole numbers read from JSON that comes from outside (deployments, plans, control
// requests), range-checked before they are narrowed.

#include <nlohmann/json.hpp>

#include <cstdint>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

namespace blockflow::detail {

/// `v` as a T when it is a JSON integer (not a boolean, not a fraction) within [min, max]; nullopt
/// otherwise, never a wrapped or truncated value (nlohmann's own get<T>() casts silently).
template <typename T>
std::optional<T> json_integer(const nlohmann::json& v, T min = std::numeric_limits<T>::lowest(),
                              T max = std::numeric_limits<T>::max()) {
  static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool>);
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    if (max < 0 || u > static_cast<std::uint64_t>(max)) return std::nullopt;
    if (min > 0 && u < static_cast<std::uint64_t>(min)) return std::nullopt;
    return static_cast<T>(u);
  }
  if (v.is_number_integer()) {
    const auto i = v.get<std::int64_t>();
    if (i < 0 ? (std::is_unsigned_v<T> || i < static_cast<std::int64_t>(min))
              : (static_cast<std::uint64_t>(i) > static_cast<std::uint64_t>(max) ||
                 (min > 0 && static_cast<std::uint64_t>(i) < static_cast<std::uint64_t>(min)))) {
      return std::nullopt;
    }
    return static_cast<T>(i);
  }
  return std::nullopt;
}

/// `v` as tensor shapes: an array of arrays of whole numbers, each within int64 (2^64 - 1 is not
/// -1, "any size"); nullopt otherwise.
inline std::optional<std::vector<std::vector<std::int64_t>>> json_shapes(const nlohmann::json& v) {
  if (!v.is_array()) return std::nullopt;
  std::vector<std::vector<std::int64_t>> out;
  for (const auto& shape : v) {
    if (!shape.is_array()) return std::nullopt;
    std::vector<std::int64_t> dims;
    for (const auto& dim : shape) {
      auto n = json_integer<std::int64_t>(dim);
      if (!n) return std::nullopt;
      dims.push_back(*n);
    }
    out.push_back(std::move(dims));
  }
  return out;
}

}  // namespace blockflow::detail
