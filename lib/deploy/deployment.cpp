#include <blockflow/deploy/deployment.hpp>
#include <blockflow/deploy/detail/deployment_json.hpp>
#include <blockflow/core/names.hpp>
#include <blockflow/core/detail/json_depth.hpp>
#include <blockflow/core/detail/json_integer.hpp>
#include <blockflow/core/detail/utf8_text.hpp>
#include <blockflow/core/detail/warm_up_shapes.hpp>

#include <absl/strings/numbers.h>
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <type_traits>

namespace blockflow {
namespace detail {
namespace {

absl::StatusOr<FullPolicy> policy_from(const std::string& name) {
  for (auto p : {FullPolicy::kBlock, FullPolicy::kReject, FullPolicy::kDropOldest}) {
    if (to_string(p) == name) return p;
  }
  return absl::InvalidArgumentError(fmt::format("unknown full_policy '{}' (block, reject, drop-oldest)", name));
}

// Bounds on a confined (wire) deployment's warm-up: what zeros of its input_shapes allocate (1 GiB:
// 2^28 float32 elements) and how often a block runs before serving.
constexpr std::size_t kConfinedMaxDims = 8;
constexpr std::int64_t kConfinedMaxBytes = std::int64_t{1} << 30;
constexpr int kConfinedMaxWarmupRuns = 16;

std::string resolve(const std::string& file, const std::string& models_dir) {
  if (file.empty() || file.front() == '/' || models_dir.empty()) return file;
  return models_dir + "/" + file;
}

// `file` (relative to `models_dir`, or absolute) as a path inside `models_dir` once `..` and
// symbolic links are resolved; else an error that says nothing about the file (nor whether it exists).
absl::StatusOr<std::string> resolve_inside(const std::string& block, const std::string& file, const std::string& models_dir) {
  namespace fs = std::filesystem;
  // No `..` at all: weakly_canonical() resolves links only along the part of a path that exists, and
  // then `..` lexically, so "missing/../link/file" would pass through `link` unresolved.
  for (const auto& part : fs::path(file)) {
    if (part == "..") {
      return absl::InvalidArgumentError(fmt::format("block '{}': TorchScript path '{}' is not inside the models directory",
                                                    block, file));
    }
  }
  std::error_code ec;
  const fs::path root = fs::weakly_canonical(fs::absolute(models_dir.empty() ? "." : models_dir, ec), ec);
  const fs::path wanted = fs::path(file).is_absolute() ? fs::path(file) : root / file;
  const fs::path resolved = fs::weakly_canonical(wanted, ec);
  const fs::path inside = resolved.lexically_relative(root);
  if (ec || inside.empty() || *inside.begin() == ".." || *inside.begin() == ".") {
    return absl::InvalidArgumentError(fmt::format("block '{}': TorchScript path '{}' is not inside the models directory",
                                                  block, file));
  }
  return resolved.string();
}

}  // namespace

nlohmann::json block_to_json(const BlockDescription& d) {
  const BlockOptions& o = d.options;
  nlohmann::json json = {{"name", d.name},
          {"torchscript", d.torchscript},
          {"factory", d.factory},
          {"placement", d.placement},
          {"device", o.device},
          {"intra_op_threads", o.intra_op_threads},
          {"workers", o.workers},
          {"queue_capacity", o.queue_capacity},
          {"full_policy", std::string(to_string(o.full_policy))},
          {"input_shapes", o.input_shapes},
          {"warmup_runs", o.warmup_runs},
          {"max_batch", o.max_batch},
          {"max_batch_delay_ms", o.max_batch_delay_ms},
          {"memory_bytes", o.memory_bytes},
          {"cuda_graph", o.cuda_graph}};
  if (!o.input_dtypes.empty()) json["input_dtypes"] = dtype_names(o.input_dtypes);
  if (d.factory.empty()) {  // TorchScript's own settings: block_from_json refuses them on a factory's block
    json["freeze"] = d.torchscript_options.freeze;
    // Only a frozen module is optimized: an unfrozen one never claims it (block_from_json refuses that).
    json["optimize_for_inference"] = d.torchscript_options.freeze && d.torchscript_options.optimize_for_inference;
  }
  return json;
}

absl::Status check_json_depth(std::string_view text, int max_depth) {
  if (json_nests_deeper(text, max_depth)) {
    return absl::InvalidArgumentError(fmt::format("JSON nests deeper than {} levels", max_depth));
  }
  return absl::OkStatus();
}

absl::StatusOr<BlockDescription> block_from_json(const nlohmann::json& json, const std::string& models_dir, bool confine) {
  BlockDescription d;
  if (json.is_string()) {  // the reference's form: a name, its model file beside the others
    d.name = json.get<std::string>();
    if (auto status = check_name("block", d.name); !status.ok()) return status;
    if (confine) {  // NAME.pt may be a link out of the directory
      auto inside = resolve_inside(d.name, d.name + ".pt", models_dir);
      if (!inside.ok()) return inside.status();
      d.torchscript = *std::move(inside);
      return d;
    }
    d.torchscript = resolve(d.name + ".pt", models_dir);
    return d;
  }
  if (!json.is_object()) {
    return absl::InvalidArgumentError(fmt::format("a block is a name or an object, not {}", detail::json_excerpt(json)));
  }
  if (!json.contains("name") || !json["name"].is_string() || json["name"].get<std::string>().empty()) {
    return absl::InvalidArgumentError(fmt::format("block {}: needs a non-empty string \"name\"", detail::json_excerpt(json)));
  }
  d.name = json["name"].get<std::string>();
  if (auto status = check_name("block", d.name); !status.ok()) return status;
  static const std::set<std::string> known = {"name",         "torchscript", "factory",        "placement",
                                              "device",       "intra_op_threads", "workers",   "queue_capacity",
                                              "full_policy",  "input_shapes", "warmup_runs", "max_batch",
                                              "max_batch_delay_ms", "freeze",      "optimize_for_inference", "memory_bytes",
                                              "cuda_graph", "input_dtypes"};
  for (const auto& [key, value] : json.items()) {
    if (known.count(key) == 0) return absl::InvalidArgumentError(fmt::format("block '{}': unknown field '{}'", d.name, detail::key_excerpt(key)));
  }
  BlockOptions& o = d.options;
  struct BadField {
    std::string problem;
  };
  const char* field = "";  // the one being read, named in the error
  try {
    // Whole numbers within their type's range (nlohmann's own conversion wraps -1 into SIZE_MAX and
    // truncates 1.9 and true into 1), numbers, arrays of whole numbers; strings and booleans as
    // nlohmann reads them (other types refused).
    auto get = [&](const char* key, auto& into) {
      if (!json.contains(key)) return;
      field = key;
      using T = std::decay_t<decltype(into)>;
      const nlohmann::json& v = json.at(key);
      if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
        auto n = json_integer<T>(v);
        if (!n) {
          throw BadField{fmt::format("expected a whole number from {} to {}", std::numeric_limits<T>::lowest(),
                                     std::numeric_limits<T>::max())};
        }
        into = *n;
      } else if constexpr (std::is_same_v<T, double>) {
        if (!v.is_number()) throw BadField{"expected a number"};
        into = v.get<double>();
      } else if constexpr (std::is_same_v<T, std::vector<std::vector<std::int64_t>>>) {
        auto shapes = json_shapes(v);
        if (!shapes) throw BadField{"expected an array of shapes (arrays of whole numbers)"};
        into = std::move(*shapes);
      } else if constexpr (std::is_same_v<T, std::vector<at::ScalarType>>) {
        if (!v.is_array()) throw BadField{fmt::format("expected an array of dtype names ({})", dtype_names())};
        for (std::size_t i = 0; i < v.size(); ++i) {
          const auto dtype = v[i].is_string() ? parse_dtype(v[i].get<std::string>()) : std::nullopt;
          if (!dtype) {
            throw BadField{fmt::format("entry {} is {}, not a dtype ({})", i, detail::json_excerpt(v[i]), dtype_names())};
          }
          into.push_back(*dtype);
        }
      } else {
        v.get_to(into);
      }
    };
    get("torchscript", d.torchscript);
    get("factory", d.factory);
    get("placement", d.placement);
    get("device", o.device);
    get("intra_op_threads", o.intra_op_threads);
    get("workers", o.workers);
    get("queue_capacity", o.queue_capacity);
    get("input_shapes", o.input_shapes);
    get("input_dtypes", o.input_dtypes);
    get("warmup_runs", o.warmup_runs);
    get("max_batch", o.max_batch);
    get("max_batch_delay_ms", o.max_batch_delay_ms);
    get("memory_bytes", o.memory_bytes);
    get("cuda_graph", o.cuda_graph);
    get("freeze", d.torchscript_options.freeze);
    // Unfrozen means not optimized either, unless asked for (which is then refused below).
    if (!d.torchscript_options.freeze) d.torchscript_options.optimize_for_inference = false;
    get("optimize_for_inference", d.torchscript_options.optimize_for_inference);
    if (json.contains("full_policy")) {
      field = "full_policy";
      auto policy = policy_from(json.at("full_policy").get<std::string>());
      if (!policy.ok()) return absl::InvalidArgumentError(fmt::format("block '{}': {}", d.name, std::string(policy.status().message())));
      o.full_policy = *policy;
    }
  } catch (const BadField& bad) {
    return absl::InvalidArgumentError(fmt::format("block '{}': field '{}': {}", d.name, field, bad.problem));
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(fmt::format("block '{}': field '{}': wrong type: {}", d.name, field, e.what()));
  }
  if (d.torchscript.empty() == d.factory.empty()) {
    return absl::InvalidArgumentError(
        fmt::format("block '{}': give exactly one of \"torchscript\" (a file) and \"factory\" (a registered C++ block)", d.name));
  }
  if (!d.factory.empty()) {  // a C++ block has no module to freeze: a setting it would ignore is refused
    for (const char* key : {"freeze", "optimize_for_inference"}) {
      if (json.contains(key)) {
        return absl::InvalidArgumentError(fmt::format(
            "block '{}': field '{}' applies to TorchScript blocks only (this block is made by factory '{}')", d.name,
            key, detail::key_excerpt(d.factory)));
      }
    }
  }
  if (d.torchscript_options.optimize_for_inference && !d.torchscript_options.freeze) {
    return absl::InvalidArgumentError(
        fmt::format("block '{}': optimize_for_inference needs \"freeze\": true (it works on the frozen module)", d.name));
  }
  if (auto status = validate(d.name, o); !status.ok()) return status;
  if (confine) {  // from the wire: what a warm-up may allocate and repeat is bounded
    // The warm-up makes the zeros of every shape at once: the bound is on their sum.
    std::int64_t total = 0;
    for (std::size_t i = 0; i < o.input_shapes.size(); ++i) {
      const std::int64_t numel = detail::warm_up_elements(o.input_shapes[i]).value_or(0);  // validate(): counted
      const std::int64_t element = o.input_dtypes.empty() ? 4 : static_cast<std::int64_t>(c10::elementSize(o.input_dtypes[i]));
      const std::int64_t bytes = numel > kConfinedMaxBytes / element ? kConfinedMaxBytes + 1 : numel * element;
      total += bytes;
      if (o.input_shapes[i].size() > kConfinedMaxDims || bytes > kConfinedMaxBytes || total > kConfinedMaxBytes) {
        return absl::InvalidArgumentError(fmt::format(
            "block '{}': input_shapes[{}] is beyond what a deployment from the wire may warm up ({} dimensions and {} "
            "bytes at most, all its shapes together)", d.name, i, kConfinedMaxDims, kConfinedMaxBytes));
      }
    }
    if (o.warmup_runs > kConfinedMaxWarmupRuns) {
      return absl::InvalidArgumentError(fmt::format("block '{}': warmup_runs {} is above {}, the most a deployment from "
                                                    "the wire may ask for", d.name, o.warmup_runs, kConfinedMaxWarmupRuns));
    }
  }
  if (!d.placement.empty()) {
    if (auto status = check_site_name("placement", d.placement); !status.ok()) {
      return absl::InvalidArgumentError(fmt::format("block '{}': {}", d.name, std::string(status.message())));
    }
  }
  if (confine && !d.torchscript.empty()) {
    auto inside = resolve_inside(d.name, d.torchscript, models_dir);
    if (!inside.ok()) return inside.status();
    d.torchscript = *std::move(inside);
    return d;
  }
  d.torchscript = resolve(d.torchscript, models_dir);
  return d;
}

// "pack", "mean", "concat", "concat:DIM".
absl::StatusOr<Combine> combine_from_name(const std::string& name) {
  if (name == "pack") return Combine::pack();
  if (name == "mean") return Combine::mean();
  if (name == "concat") return Combine::concat();
  if (name.rfind("concat:", 0) == 0) {
    const std::string dim = name.substr(7);
    if (std::int64_t d = 0; dim.size() < 4 && absl::SimpleAtoi(dim, &d)) return Combine::concat(d);
  }
  return absl::InvalidArgumentError(fmt::format("unknown combine rule '{}' (pack, mean, concat, concat:DIM)", name));
}

bool has_deployment_form(const Combine& combine) {
  const std::string& rule = combine.name();  // Combine::concat(dim) is named "concat(dim=DIM)"
  return rule == "pack" || rule == "mean" || rule.rfind("concat(dim=", 0) == 0;
}

nlohmann::json graph_to_json(const std::vector<PathNode>& nodes) {
  auto out = nlohmann::json::array();
  for (const auto& n : nodes) {
    nlohmann::json node;
    if (n.block.empty()) node["join"] = n.name;
    else node["block"] = n.block;
    if (!n.inputs.empty()) node["inputs"] = n.inputs;
    if (n.inputs.size() > 1 || n.block.empty()) {
      std::string rule = n.combine.name();  // Combine::concat(dim) is named "concat(dim=DIM)"
      long long dim = 0;
      if (std::sscanf(rule.c_str(), "concat(dim=%lld)", &dim) == 1) rule = dim == 1 ? "concat" : fmt::format("concat:{}", dim);
      node["combine"] = rule;
    }
    out.push_back(std::move(node));
  }
  return {{"nodes", std::move(out)}};
}

absl::StatusOr<Path> graph_from_json(const std::string& task, const nlohmann::json& graph, const std::set<std::string>& blocks) {
  auto bad = [&](const std::string& what) { return absl::InvalidArgumentError(fmt::format("task '{}': {}", task, what)); };
  for (const auto& [key, value] : graph.items()) {
    if (key != "nodes") return bad(fmt::format("unknown field '{}' (nodes)", detail::key_excerpt(key)));
  }
  if (!graph.contains("nodes") || !graph["nodes"].is_array() || graph["nodes"].empty()) {
    return bad("\"nodes\" must be a non-empty array");
  }
  Path path(task);
  std::set<std::string> nodes;
  for (const auto& n : graph["nodes"]) {
    if (!n.is_object()) return bad(fmt::format("node {} is not an object", detail::json_excerpt(n)));
    for (const auto& [key, value] : n.items()) {
      if (key != "block" && key != "join" && key != "inputs" && key != "combine") {
        return bad(fmt::format("unknown node field '{}' (block, join, inputs, combine)", detail::key_excerpt(key)));
      }
    }
    if (n.contains("block") == n.contains("join")) return bad(fmt::format("node {} needs \"block\" or \"join\"", detail::json_excerpt(n)));
    const bool is_join = n.contains("join");
    const auto& name_json = is_join ? n["join"] : n["block"];
    if (!name_json.is_string()) return bad(fmt::format("node {}: the name must be a string", detail::json_excerpt(n)));
    const std::string name = name_json.get<std::string>();
    if (!is_join && blocks.count(name) == 0) return bad(fmt::format("unknown block '{}'", detail::key_excerpt(name)));
    if (is_join) {
      if (auto status = check_name("join", name); !status.ok()) return bad(std::string(status.message()));
    }
    if (!nodes.insert(name).second) return bad(fmt::format("node '{}' appears twice", name));
    std::vector<std::string> inputs;
    if (n.contains("inputs")) {
      if (!n["inputs"].is_array()) return bad(fmt::format("node '{}': \"inputs\" must be a list of node names", name));
      for (const auto& i : n["inputs"]) {
        if (!i.is_string()) return bad(fmt::format("node '{}': input {} is not a node name", name, detail::json_excerpt(i)));
        inputs.push_back(i.get<std::string>());
      }
    }
    if (is_join && inputs.size() < 2) return bad(fmt::format("join '{}' needs at least two inputs", name));
    Combine combine = Combine::pack();
    if (n.contains("combine")) {
      if (!n["combine"].is_string()) return bad(fmt::format("node '{}': \"combine\" must be a string", name));
      auto rule = combine_from_name(n["combine"].get<std::string>());
      if (!rule.ok()) return bad(fmt::format("node '{}': {}", name, std::string(rule.status().message())));
      combine = *std::move(rule);
    } else if (is_join) {
      return bad(fmt::format("join '{}' needs \"combine\"", name));
    }
    if (is_join) path.join(name, std::move(inputs), std::move(combine));
    else path.node(name, std::move(inputs), std::move(combine));
  }
  for (const auto& node : path.nodes()) {
    for (const auto& input : node.inputs) {
      if (nodes.count(input) == 0) return bad(fmt::format("node '{}': unknown input '{}'", node.name, detail::key_excerpt(input)));
    }
  }
  return path;
}

absl::StatusOr<std::vector<SiteSettings>> sites_from_json(const nlohmann::json& sites, const std::vector<std::string>& placements) {
  if (!sites.is_object()) return absl::InvalidArgumentError("\"sites\" must be an object (site -> settings)");
  std::vector<SiteSettings> out;
  for (const auto& [name, settings] : sites.items()) {
    auto bad = [&](const std::string& what) { return absl::InvalidArgumentError(fmt::format("site '{}': {}", name, what)); };
    if (auto status = check_site_name("site", name); !status.ok()) return status;
    if (std::find(placements.begin(), placements.end(), name) == placements.end()) {
      return bad("no block is placed in it (settings are for the sites blocks name as their placement)");
    }
    if (!settings.is_object()) return bad("its settings must be an object (memory, lanes)");
    SiteSettings s;
    s.name = name;
    for (const auto& [key, value] : settings.items()) {
      if (key == "lanes") {
        if (!value.is_number_integer() || value.get<std::int64_t>() < 0 || value.get<std::int64_t>() > 1024) {
          return bad("\"lanes\" must be an integer from 0 to 1024");
        }
        s.lanes = value.get<int>();
      } else if (key == "memory") {
        if (!value.is_object()) return bad("\"memory\" must be an object (budget, policy, measure)");
        for (const auto& [field, v] : value.items()) {
          if (field == "budget") {
            if (!v.is_number_integer() || v.get<std::int64_t>() < 0) return bad("memory.budget must be a number of bytes (>= 0)");
            s.memory_budget = v.get<std::int64_t>();
          } else if (field == "policy") {
            if (!v.is_string() || (v != "admit" && v != "on_demand")) return bad("memory.policy must be \"admit\" or \"on_demand\"");
            s.memory_policy = v.get<std::string>();
          } else if (field == "measure") {
            if (!v.is_string() || (v != "blocks" && v != "process")) return bad("memory.measure must be \"blocks\" or \"process\"");
            s.memory_measure = v.get<std::string>();
          } else {
            return bad(fmt::format("unknown field 'memory.{}' (budget, policy, measure)", detail::key_excerpt(field)));
          }
        }
        if (s.memory_policy == "on_demand" && s.memory_budget <= 0) return bad("memory.policy \"on_demand\" needs memory.budget above 0");
        if (!s.memory_measure.empty() && s.memory_policy != "on_demand") {
          return bad("memory.measure applies to memory.policy \"on_demand\" only");
        }
      } else {
        return bad(fmt::format("unknown field '{}' (memory, lanes)", detail::key_excerpt(key)));
      }
    }
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace detail

absl::StatusOr<Deployment> Deployment::parse(const std::string& text, const std::string& models_dir, bool confine) {
  if (auto status = detail::check_json_depth(text); !status.ok()) {
    return absl::InvalidArgumentError(fmt::format("deployment: {}", std::string(status.message())));
  }
  const auto json = nlohmann::json::parse(text, nullptr, false);
  if (json.is_discarded()) return absl::InvalidArgumentError("deployment: not valid JSON");
  if (!json.is_object()) return absl::InvalidArgumentError("deployment: expected an object with \"blocks\" and \"tasks\"");
  for (const auto& [key, value] : json.items()) {
    if (key != "blocks" && key != "tasks" && key != "sites") {
      return absl::InvalidArgumentError(fmt::format("deployment: unknown field '{}' (blocks, tasks, sites)", detail::key_excerpt(key)));
    }
  }
  if (!json.contains("blocks") || !json["blocks"].is_array()) {
    return absl::InvalidArgumentError("deployment: \"blocks\" must be an array");
  }
  if (!json.contains("tasks") || !json["tasks"].is_object()) {
    return absl::InvalidArgumentError("deployment: \"tasks\" must be an object (task -> list of blocks)");
  }
  Deployment out;
  std::set<std::string> names;
  for (const auto& b : json["blocks"]) {
    auto block = detail::block_from_json(b, models_dir, confine);
    if (!block.ok()) return absl::InvalidArgumentError(fmt::format("deployment: {}", std::string(block.status().message())));
    if (!names.insert(block->name).second) {
      return absl::InvalidArgumentError(fmt::format("deployment: block '{}' appears twice", block->name));
    }
    if (b.is_string()) out.bare_names.push_back(block->name);
    out.blocks.push_back(*std::move(block));
  }
  // In the file's order (nlohmann::json keeps an object's keys sorted): paths() adds them so, and
  // a session serving while it warms up makes the first task ready first.
  std::vector<std::string> task_order;
  {
    const auto ordered = nlohmann::ordered_json::parse(text, nullptr, false);
    std::set<std::string> listed;
    for (const auto& [task, chain] : ordered.at("tasks").items()) {
      if (listed.insert(task).second) task_order.push_back(task);
    }
  }
  for (const auto& task : task_order) {
    const nlohmann::json& chain = json["tasks"][task];
    if (auto status = check_name("task", task); !status.ok()) return absl::InvalidArgumentError(fmt::format("deployment: {}", std::string(status.message())));
    if (chain.is_object()) {
      auto graph = detail::graph_from_json(task, chain, names);
      if (!graph.ok()) return absl::InvalidArgumentError(fmt::format("deployment: {}", std::string(graph.status().message())));
      out.graphs.push_back(*std::move(graph));
      continue;
    }
    if (!chain.is_array() || chain.empty()) {
      return absl::InvalidArgumentError(fmt::format(
          "deployment: task '{}' must be a non-empty list of block names, or a graph {{\"nodes\": [...]}}", task));
    }
    std::vector<std::string> blocks;
    std::set<std::string> seen;
    for (const auto& b : chain) {
      if (!b.is_string()) return absl::InvalidArgumentError(fmt::format("deployment: task '{}': {} is not a block name", task, detail::json_excerpt(b)));
      const std::string name = b.get<std::string>();
      if (names.count(name) == 0) {
        return absl::InvalidArgumentError(fmt::format("deployment: task '{}': unknown block '{}'", task, detail::key_excerpt(name)));
      }
      if (!seen.insert(name).second) {
        return absl::InvalidArgumentError(fmt::format("deployment: task '{}': has a cycle: block '{}' appears twice", task, name));
      }
      blocks.push_back(name);
    }
    out.tasks.emplace_back(task, std::move(blocks));
  }
  out.order = std::move(task_order);
  if (json.contains("sites")) {
    auto sites = detail::sites_from_json(json["sites"], out.workers());
    if (!sites.ok()) return absl::InvalidArgumentError(fmt::format("deployment: {}", std::string(sites.status().message())));
    out.sites = *std::move(sites);
  }
  return out;
}

SiteSettings Deployment::site(const std::string& name) const {
  for (const auto& s : sites) {
    if (s.name == name) return s;
  }
  SiteSettings defaults;
  defaults.name = name;
  return defaults;
}

std::vector<std::string> Deployment::workers() const {
  std::set<std::string> w;
  for (const auto& b : blocks) {
    if (!b.placement.empty()) w.insert(b.placement);
  }
  return {w.begin(), w.end()};
}

std::vector<Path> Deployment::paths() const {
  std::vector<Path> out;
  for (const auto& [task, chain] : tasks) out.push_back(Path::chain(task, chain));
  out.insert(out.end(), graphs.begin(), graphs.end());
  if (order.size() == out.size()) {  // in the file's order; stable: a name `order` lacks keeps its place after the rest
    std::map<std::string, std::size_t> rank;
    for (std::size_t i = 0; i < order.size(); ++i) rank.emplace(order[i], i);
    std::stable_sort(out.begin(), out.end(), [&](const Path& a, const Path& b) {
      const auto ra = rank.find(a.task()), rb = rank.find(b.task());
      return (ra == rank.end() ? order.size() : ra->second) < (rb == rank.end() ? order.size() : rb->second);
    });
  }
  return out;
}

absl::StatusOr<Deployment> load_deployment(const std::string& file, const std::string& models_dir) {
  std::ifstream in(file);
  if (!in) return absl::NotFoundError(fmt::format("deployment file '{}' cannot be read", file));
  std::stringstream text;
  text << in.rdbuf();
  const auto slash = file.find_last_of('/');
  const std::string dir = !models_dir.empty()         ? models_dir
                          : slash == std::string::npos ? "."
                          : slash == 0                 ? "/"  // "/deploy.json": the root, not the cwd
                                                       : file.substr(0, slash);
  auto d = Deployment::parse(text.str(), dir);
  if (!d.ok()) return absl::InvalidArgumentError(fmt::format("{}: {}", file, std::string(d.status().message())));
  return d;
}

}  // namespace blockflow
