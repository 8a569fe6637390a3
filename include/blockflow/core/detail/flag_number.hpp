// A number given on a command line, read whole and range-checked: the error names the flag and what
// was given ("--clients takes a whole number from 1 to 4096, not 'x'"), where std::stoi would say "stoi".
// Header-only: the tools and blockflow-worker use it.
#pragma once

#include <fmt/format.h>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace blockflow::detail {

// `text` as a T in [min, max], or std::invalid_argument naming `flag`.
template <typename T>
T flag_number(const std::string& flag, const std::string& text, T min, T max) {
  static_assert(std::is_arithmetic_v<T>);
  T value{};
  bool whole = false;
  if constexpr (std::is_integral_v<T>) {
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
    whole = error == std::errc() && end == text.data() + text.size();
  } else {
    char* end = nullptr;
    errno = 0;
    const double v = text.empty() ? 0 : std::strtod(text.c_str(), &end);
    whole = !text.empty() && end == text.c_str() + text.size() && errno == 0 && std::isfinite(v);
    value = static_cast<T>(v);
  }
  if (!whole || value < min || value > max) {
    if constexpr (std::is_integral_v<T>) {
      throw std::invalid_argument(fmt::format("{} takes a whole number from {} to {}, not '{}'", flag, min, max, text));
    } else {
      throw std::invalid_argument(fmt::format("{} takes a number from {} to {}, not '{}'", flag, min, max, text));
    }
  }
  return value;
}

}  // namespace blockflow::detail
