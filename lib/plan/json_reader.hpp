#pragma once
// Internal to lib/plan: reads the fields of a JSON object, naming the file and the place of the
// field ("profile.json: blocks[1].latency[0].p50_ms: expected a number >= 0") in every error.

#include <blockflow/core/detail/json_integer.hpp>
#include <blockflow/core/detail/utf8_text.hpp>

#include <absl/status/status.h>
#include <absl/status/statusor.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <string>
#include <vector>

namespace blockflow::detail {

// Reads fields of one JSON object, naming `where` ("blocks[1].latency[0]") in every error. It
// remembers which fields it was asked about, so that unknown_fields() can refuse the rest (a
// misspelled optional key would otherwise keep its default without a word).
class JsonReader {
 public:
  JsonReader(const nlohmann::json& object, std::string source, std::string where)
      : object_(object), source_(std::move(source)), where_(std::move(where)) {}

  // A problem of the object itself, not of one field.
  absl::Status error(const std::string& problem) const {
    return absl::InvalidArgumentError(fmt::format("{}: {}: {}", source_, where_, problem));
  }
  absl::Status error(const std::string& field, const std::string& problem) const {
    return absl::InvalidArgumentError(fmt::format("{}: {}{}{}: {}", source_, where_, where_.empty() ? "" : ".", field, problem));
  }
  const nlohmann::json* find(const std::string& field, nlohmann::json::value_t a, nlohmann::json::value_t b, const char* expected, absl::Status& status) const {
    auto it = lookup(field);
    if (it == object_.end()) {
      status = error(field, "missing");
      return nullptr;
    }
    if (it->type() != a && it->type() != b) {
      status = error(field, fmt::format("expected {}", expected));
      return nullptr;
    }
    return &*it;
  }
  [[nodiscard]] bool has(const std::string& field) const { return lookup(field) != object_.end(); }
  // The first field of the object nobody asked about, as an error ("unknown field"); OK when none.
  absl::Status unknown_fields() const {
    for (auto it = object_.begin(); it != object_.end(); ++it) {
      if (std::find(asked_.begin(), asked_.end(), it.key()) == asked_.end()) return error(key_excerpt(it.key()), "unknown field");
    }
    return absl::OkStatus();
  }
  absl::Status strings(const std::string& field, std::vector<std::string>& out) const {
    const nlohmann::json* list = nullptr;
    if (auto status = array(field, list); !status.ok()) return status;
    for (const auto& v : *list) {
      if (!v.is_string()) return error(field, "expected an array of strings");
      out.push_back(v.get<std::string>());
    }
    return absl::OkStatus();
  }
  absl::Status number(const std::string& field, double& out) const {
    auto it = lookup(field);
    if (it == object_.end()) return error(field, "missing");
    if (!it->is_number()) return error(field, "expected a number >= 0");
    out = it->get<double>();
    if (!(out >= 0)) return error(field, "expected a number >= 0");
    return absl::OkStatus();
  }
  template <typename Int>
  absl::Status integer(const std::string& field, Int& out) const {
    double d = 0;
    if (auto status = number(field, d); !status.ok()) return status;
    if (std::floor(d) != d) return error(field, "expected a whole number");
    // Past 2^53 a JSON number is no longer exact, and past the type's range the cast is undefined.
    const double limit = std::min(std::ldexp(1.0, 53), std::ldexp(1.0, std::numeric_limits<Int>::digits) - 1);
    if (d > limit) return error(field, fmt::format("expected a whole number <= {:.0f}", limit));
    out = static_cast<Int>(d);
    return absl::OkStatus();
  }
  absl::Status string(const std::string& field, std::string& out) const {
    absl::Status status;
    const nlohmann::json* v = find(field, nlohmann::json::value_t::string, nlohmann::json::value_t::string, "a string", status);
    if (v == nullptr) return status;
    out = v->get<std::string>();
    return absl::OkStatus();
  }
  absl::Status array(const std::string& field, const nlohmann::json*& out) const {
    absl::Status status;
    out = find(field, nlohmann::json::value_t::array, nlohmann::json::value_t::array, "an array", status);
    return status;
  }
  absl::Status shapes(const std::string& field, std::vector<std::vector<std::int64_t>>& out) const {
    const nlohmann::json* list = nullptr;
    if (auto status = array(field, list); !status.ok()) return status;
    auto shapes = json_shapes(*list);
    if (!shapes) return error(field, "expected arrays of whole numbers");
    out.insert(out.end(), std::make_move_iterator(shapes->begin()), std::make_move_iterator(shapes->end()));
    return absl::OkStatus();
  }
  absl::Status object(const std::string& field, const nlohmann::json*& out) const {
    absl::Status status;
    out = find(field, nlohmann::json::value_t::object, nlohmann::json::value_t::object, "an object", status);
    return status;
  }

 private:
  nlohmann::json::const_iterator lookup(const std::string& field) const {
    if (std::find(asked_.begin(), asked_.end(), field) == asked_.end()) asked_.push_back(field);
    return object_.find(field);
  }
  const nlohmann::json& object_;
  std::string source_, where_;
  mutable std::vector<std::string> asked_;
};

// Reads the elements of `list` (the array `key` of `source`), each an object, with
// `read(reader, element, item)`; errors name the file and "key[i]". A field `read` did not ask
// about is refused, and so is a second element whose `unique` member (its name) an earlier one has.
template <typename T, typename Read>
absl::StatusOr<std::vector<T>> read_objects(const nlohmann::json& list, const std::string& source, const std::string& key,
                                           std::string T::*unique, const char* unique_field, Read read) {
  std::vector<T> out;
  std::set<std::string> seen;
  for (std::size_t i = 0; i < list.size(); ++i) {
    const std::string where = fmt::format("{}[{}]", key, i);
    if (!list[i].is_object()) return absl::InvalidArgumentError(fmt::format("{}: {}: expected an object", source, where));
    T item;
    const JsonReader reader(list[i], source, where);
    if (auto status = read(reader, list[i], item); !status.ok()) return status;
    if (auto status = reader.unknown_fields(); !status.ok()) return status;
    if (!seen.insert(item.*unique).second) {
      return reader.error(unique_field, fmt::format("'{}' appears twice", item.*unique));
    }
    out.push_back(std::move(item));
  }
  return out;
}

#define BF_TRY(expr)                     \
  do {                                   \
    if (auto s_ = (expr); !s_.ok()) return s_; \
  } while (false)


}  // namespace blockflow::detail
