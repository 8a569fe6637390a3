#pragma once
// Internal: text the library writes out (metrics, control replies) whatever bytes a name holds.
// Names given through the C++ API are not held to check_name(): a Latin-1 task name must neither
// make nlohmann's dump() throw on a server's thread nor make Prometheus refuse a whole scrape.

#include <nlohmann/json.hpp>

#include <string>
#include <string_view>

namespace blockflow::detail {

/// `text` with each byte that does not start a well-formed UTF-8 sequence (RFC 3629: no overlong
/// form, no surrogate, nothing past U+10FFFF) replaced by U+FFFD.
inline std::string utf8_or_replaced(std::string_view text) {
  auto continuation = [&](std::size_t i) { return i < text.size() && (static_cast<unsigned char>(text[i]) & 0xC0) == 0x80; };
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    std::size_t length = 0;
    unsigned char low = 0x80, high = 0xBF;  // the second byte's range
    if (c < 0x80) length = 1;
    else if (c >= 0xC2 && c <= 0xDF) length = 2;
    else if (c >= 0xE0 && c <= 0xEF) length = 3, low = c == 0xE0 ? 0xA0 : 0x80, high = c == 0xED ? 0x9F : 0xBF;
    else if (c >= 0xF0 && c <= 0xF4) length = 4, low = c == 0xF0 ? 0x90 : 0x80, high = c == 0xF4 ? 0x8F : 0xBF;
    bool ok = length > 0;
    if (ok && length > 1) {
      const auto second = i + 1 < text.size() ? static_cast<unsigned char>(text[i + 1]) : 0;
      ok = second >= low && second <= high;
      for (std::size_t k = 2; ok && k < length; ++k) ok = continuation(i + k);
    }
    if (ok) {
      out.append(text.substr(i, length));
      i += length;
    } else {
      out += "\xEF\xBF\xBD";
      ++i;
    }
  }
  return out;
}

/// `json.dump(indent)` that never throws for a string that is not UTF-8 (it is written with U+FFFD).
inline std::string dump_json(const nlohmann::json& json, int indent = -1) {
  return json.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

/// A value quoted in an error message: its JSON text, at most `max` bytes of it and then "...", so
/// that a request cannot make its error reply (or the log) as large as itself.
inline std::string json_excerpt(const nlohmann::json& json, std::size_t max = 80) {
  std::string text = dump_json(json);
  if (text.size() <= max) return text;
  return utf8_or_replaced(std::string_view(text).substr(0, max)) + "...";
}

/// A field name quoted in an error message: JSON's escapes (no raw newline reaches a log), without
/// the quotes, at most `max` bytes and then "...".
inline std::string key_excerpt(const std::string& key, std::size_t max = 80) {
  const std::string text = dump_json(nlohmann::json(key));
  const std::string_view inner = std::string_view(text).substr(1, text.size() - 2);
  if (inner.size() <= max) return std::string(inner);
  return utf8_or_replaced(inner.substr(0, max)) + "...";
}

}  // namespace blockflow::detail
