#pragma once
// Internal: whole numbers read from JSON that comes from outside (deployments, plans, control
// requests), range-checked before they are narrowed.

#include <nlohmann/json.hpp>

#include <cstdint>
#include <limits>
#include <optional>

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

}  // namespace blockflow::detail
