// The profile document (docs/profile.md): Profile::to_json() and Profile::parse().
#include <blockflow/plan/profile.hpp>

#include "json_reader.hpp"

#include <blockflow/core/block.hpp>
#include <blockflow/core/names.hpp>

#include <fmt/format.h>

#include <fstream>
#include <set>
#include <sstream>

namespace blockflow {
namespace {

using nlohmann::json;
using detail::JsonReader;

absl::Status parse_block(const json& j, const std::string& source, const std::string& where, BlockProfile& b) {
  if (!j.is_object()) return absl::InvalidArgumentError(fmt::format("{}: {}: expected an object", source, where));
  const JsonReader r(j, source, where);
  BF_TRY(r.string("name", b.name));
  if (auto status = check_name("block", b.name); !status.ok()) return r.error("name", std::string(status.message()));
  BF_TRY(r.string("source", b.source));
  BF_TRY(r.string("device", b.device));
  BF_TRY(r.integer("intra_op_threads", b.intra_op_threads));
  BF_TRY(r.shapes("input_shapes", b.input_shapes));
  if (r.has("input_dtypes")) {  // absent: float32 inputs
    std::vector<std::string> names;
    BF_TRY(r.strings("input_dtypes", names));
    for (const auto& name : names) {
      const auto dtype = parse_dtype(name);
      if (!dtype) return r.error("input_dtypes", fmt::format("'{}' is not a dtype ({})", detail::key_excerpt(name), dtype_names()));
      b.input_dtypes.push_back(*dtype);
    }
  }
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
    const JsonReader l((*latency)[i], source, at);
    BatchLatency bl;
    BF_TRY(l.integer("batch", bl.batch));
    BF_TRY(l.number("p50_ms", bl.p50_ms));
    BF_TRY(l.number("p99_ms", bl.p99_ms));
    if (bl.batch < 1 || bl.batch > kMaxBatchSize) {
      return l.error("batch", fmt::format("expected a batch size from 1 to {} (what max_batch takes)", kMaxBatchSize));
    }
    BF_TRY(l.unknown_fields());
    if (!b.latency.empty() && bl.batch <= b.latency.back().batch) return l.error("batch", "batch sizes must increase");
    b.latency.push_back(bl);
  }
  BF_TRY(r.unknown_fields());
  // What a plan writes into its deployment must be what Deployment::parse() takes ("": a block
  // profiled as an object, which a deployment cannot name; blockflow-plan says so).
  if (!b.source.empty() && !b.from_file()) {
    if (auto status = check_name("factory", b.source); !status.ok()) return r.error("source", std::string(status.message()));
  }
  BlockOptions o;
  o.device = b.device;
  o.intra_op_threads = b.intra_op_threads;
  o.input_shapes = b.input_shapes;
  o.input_dtypes = b.input_dtypes;
  o.memory_bytes = b.memory_bytes;
  if (auto status = validate(b.name, o); !status.ok()) return absl::InvalidArgumentError(fmt::format("{}: {}: {}", source, where, std::string(status.message())));
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
    if (!b.input_dtypes.empty()) blocks_json.back()["input_dtypes"] = dtype_names(b.input_dtypes);
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
  const JsonReader r(doc, source, "");
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
  const JsonReader m(*machine, source, "machine");
  BF_TRY(m.string("cpu", p.cpu));
  BF_TRY(m.integer("hardware_threads", p.hardware_threads));
  BF_TRY(m.unknown_fields());
  const json* blocks = nullptr;
  BF_TRY(r.array("blocks", blocks));
  std::set<std::string> names;
  for (std::size_t i = 0; i < blocks->size(); ++i) {
    BlockProfile b;
    BF_TRY(parse_block((*blocks)[i], source, fmt::format("blocks[{}]", i), b));
    if (!names.insert(b.name).second) {
      return absl::InvalidArgumentError(fmt::format("{}: blocks[{}].name: '{}' appears twice", source, i, b.name));
    }
    p.blocks.push_back(std::move(b));
  }
  const json* channels = nullptr;
  BF_TRY(r.array("channels", channels));
  auto costs = detail::read_objects<ChannelCost>(*channels, source, "channels", &ChannelCost::kind, "kind", [](const JsonReader& c, const json&, ChannelCost& cost) {
    BF_TRY(c.string("kind", cost.kind));
    BF_TRY(c.number("fixed_us", cost.fixed_us));
    return c.number("us_per_mb", cost.us_per_mb);
  });
  if (!costs.ok()) return costs.status();
  p.channels = *std::move(costs);
  BF_TRY(r.unknown_fields());
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
