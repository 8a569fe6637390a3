// The profile document (docs/profile.md): Profile::to_json() and Profile::parse().
#include <blockflow/plan/profile.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>

namespace blockflow {
namespace {

using nlohmann::json;

// Reads fields of one JSON object, naming `where` ("blocks[1].latency[0]") in every error.
class Reader {
 public:
  Reader(const json& object, std::string source, std::string where)
      : object_(object), source_(std::move(source)), where_(std::move(where)) {}

  absl::Status error(const std::string& field, const std::string& problem) const {
    return absl::InvalidArgumentError(fmt::format("{}: {}{}{}: {}", source_, where_, where_.empty() ? "" : ".", field, problem));
  }
  const json* find(const std::string& field, json::value_t a, json::value_t b, const char* expected, absl::Status& status) const {
    auto it = object_.find(field);
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
  absl::Status number(const std::string& field, double& out) const {
    auto it = object_.find(field);
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
    if (d != static_cast<double>(static_cast<std::int64_t>(d))) return error(field, "expected a whole number");
    out = static_cast<Int>(d);
    return absl::OkStatus();
  }
  absl::Status string(const std::string& field, std::string& out) const {
    absl::Status status;
    const json* v = find(field, json::value_t::string, json::value_t::string, "a string", status);
    if (v == nullptr) return status;
    out = v->get<std::string>();
    return absl::OkStatus();
  }
  absl::Status array(const std::string& field, const json*& out) const {
    absl::Status status;
    out = find(field, json::value_t::array, json::value_t::array, "an array", status);
    return status;
  }
  absl::Status shapes(const std::string& field, std::vector<std::vector<std::int64_t>>& out) const {
    const json* list = nullptr;
    if (auto status = array(field, list); !status.ok()) return status;
    for (const auto& shape : *list) {
      if (!shape.is_array()) return error(field, "expected arrays of whole numbers");
      std::vector<std::int64_t> dims;
      for (const auto& d : shape) {
        if (!d.is_number_integer()) return error(field, "expected arrays of whole numbers");
        dims.push_back(d.get<std::int64_t>());
      }
      out.push_back(std::move(dims));
    }
    return absl::OkStatus();
  }
  absl::Status object(const std::string& field, const json*& out) const {
    absl::Status status;
    out = find(field, json::value_t::object, json::value_t::object, "an object", status);
    return status;
  }

 private:
  const json& object_;
  std::string source_, where_;
};

#define BF_TRY(expr)                     \
  do {                                   \
    if (auto s_ = (expr); !s_.ok()) return s_; \
  } while (false)

absl::Status parse_block(const json& j, const std::string& source, const std::string& where, BlockProfile& b) {
  if (!j.is_object()) return absl::InvalidArgumentError(fmt::format("{}: {}: expected an object", source, where));
  const Reader r(j, source, where);
  BF_TRY(r.string("name", b.name));
  BF_TRY(r.string("source", b.source));
  BF_TRY(r.string("device", b.device));
  BF_TRY(r.integer("intra_op_threads", b.intra_op_threads));
  BF_TRY(r.shapes("input_shapes", b.input_shapes));
  BF_TRY(r.shapes("output_shapes", b.output_shapes));
  BF_TRY(r.number("load_ms", b.load_ms));
  BF_TRY(r.number("warmup_ms", b.warmup_ms));
  BF_TRY(r.integer("memory_bytes", b.memory_bytes));
  BF_TRY(r.number("max_rate_rps", b.max_rate_rps));
  BF_TRY(r.integer("output_bytes", b.output_bytes));
  const json* latency = nullptr;
  BF_TRY(r.array("latency", latency));
  for (std::size_t i = 0; i < latency->size(); ++i) {
    const std::string at = fmt::format("{}.latency[{}]", where, i);
    if (!(*latency)[i].is_object()) return absl::InvalidArgumentError(fmt::format("{}: {}: expected an object", source, at));
    const Reader l((*latency)[i], source, at);
    BatchLatency bl;
    BF_TRY(l.integer("batch", bl.batch));
    BF_TRY(l.number("p50_ms", bl.p50_ms));
    BF_TRY(l.number("p99_ms", bl.p99_ms));
    if (bl.batch < 1) return l.error("batch", "expected a batch size >= 1");
    if (!b.latency.empty() && bl.batch <= b.latency.back().batch) return l.error("batch", "batch sizes must increase");
    b.latency.push_back(bl);
  }
  return absl::OkStatus();
}

}  // namespace

std::string Profile::to_json(int indent) const {
  json blocks_json = json::array();
  for (const auto& b : blocks) {
    json latency_json = json::array();
    for (const auto& l : b.latency) latency_json.push_back({{"batch", l.batch}, {"p50_ms", l.p50_ms}, {"p99_ms", l.p99_ms}});
    blocks_json.push_back({{"name", b.name},
                           {"source", b.source},
                           {"device", b.device},
                           {"intra_op_threads", b.intra_op_threads},
                           {"input_shapes", b.input_shapes},
                           {"load_ms", b.load_ms},
                           {"warmup_ms", b.warmup_ms},
                           {"memory_bytes", b.memory_bytes},
                           {"latency", latency_json},
                           {"max_rate_rps", b.max_rate_rps},
                           {"output_bytes", b.output_bytes},
                           {"output_shapes", b.output_shapes}});
  }
  json channels_json = json::array();
  for (const auto& c : channels) channels_json.push_back({{"kind", c.kind}, {"fixed_us", c.fixed_us}, {"us_per_mb", c.us_per_mb}});
  const json doc = {{"schema", "blockflow-profile"},
                    {"version", version},
                    {"machine", {{"cpu", cpu}, {"hardware_threads", hardware_threads}}},
                    {"blocks", blocks_json},
                    {"channels", channels_json}};
  return doc.dump(indent);
}

absl::StatusOr<Profile> Profile::parse(const std::string& text, const std::string& source) {
  json doc = json::parse(text, nullptr, false);
  if (doc.is_discarded()) return absl::InvalidArgumentError(fmt::format("{}: not JSON", source));
  if (!doc.is_object()) return absl::InvalidArgumentError(fmt::format("{}: expected a JSON object", source));
  const Reader r(doc, source, "");
  Profile p;
  std::string schema;
  BF_TRY(r.string("schema", schema));
  if (schema != "blockflow-profile") return r.error("schema", fmt::format("'{}' is not \"blockflow-profile\"", schema));
  BF_TRY(r.integer("version", p.version));
  if (p.version != kProfileVersion) {
    return r.error("version", fmt::format("{} is not a version this build reads ({})", p.version, kProfileVersion));
  }
  const json* machine = nullptr;
  BF_TRY(r.object("machine", machine));
  const Reader m(*machine, source, "machine");
  BF_TRY(m.string("cpu", p.cpu));
  BF_TRY(m.integer("hardware_threads", p.hardware_threads));
  const json* blocks = nullptr;
  BF_TRY(r.array("blocks", blocks));
  for (std::size_t i = 0; i < blocks->size(); ++i) {
    BlockProfile b;
    BF_TRY(parse_block((*blocks)[i], source, fmt::format("blocks[{}]", i), b));
    if (p.block(b.name) != nullptr) {
      return absl::InvalidArgumentError(fmt::format("{}: blocks[{}].name: '{}' appears twice", source, i, b.name));
    }
    p.blocks.push_back(std::move(b));
  }
  const json* channels = nullptr;
  BF_TRY(r.array("channels", channels));
  for (std::size_t i = 0; i < channels->size(); ++i) {
    const std::string at = fmt::format("channels[{}]", i);
    if (!(*channels)[i].is_object()) return absl::InvalidArgumentError(fmt::format("{}: {}: expected an object", source, at));
    const Reader c((*channels)[i], source, at);
    ChannelCost cost;
    BF_TRY(c.string("kind", cost.kind));
    BF_TRY(c.number("fixed_us", cost.fixed_us));
    BF_TRY(c.number("us_per_mb", cost.us_per_mb));
    p.channels.push_back(std::move(cost));
  }
  return p;
}

const BlockProfile* Profile::block(std::string_view name) const {
  for (const auto& b : blocks) {
    if (b.name == name) return &b;
  }
  return nullptr;
}

absl::StatusOr<Profile> load_profile(const std::string& file) {
  std::ifstream in(file);
  if (!in) return absl::NotFoundError(fmt::format("{}: cannot open", file));
  std::ostringstream text;
  text << in.rdbuf();
  return Profile::parse(text.str(), file);
}

}  // namespace blockflow
