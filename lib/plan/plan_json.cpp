// The planner's files: tasks and sites in (docs/planner.md, "Inputs"), the deployment and the
// report out.
#include <blockflow/plan/planner.hpp>

#include "json_reader.hpp"
#include "plan_report.hpp"

#include <blockflow/core/names.hpp>
#include <blockflow/deploy/detail/deployment_json.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>

namespace blockflow {
namespace {

using nlohmann::json;
using detail::JsonReader;

absl::StatusOr<std::string> read_file(const std::string& file) {
  std::ifstream in(file);
  if (!in) return absl::NotFoundError(fmt::format("{}: cannot open", file));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The array under `key` of a JSON object document.
absl::StatusOr<json> list_of(const std::string& text, const std::string& source, const std::string& key) {
  // Nested past the bound, a document would be copied (below) by recursion as deep as its nesting.
  if (auto depth = detail::check_json_depth(text); !depth.ok()) {
    return absl::InvalidArgumentError(fmt::format("{}: {}", source, std::string(depth.message())));
  }
  json doc = json::parse(text, nullptr, false);
  if (doc.is_discarded()) return absl::InvalidArgumentError(fmt::format("{}: not JSON", source));
  if (!doc.is_object()) return absl::InvalidArgumentError(fmt::format("{}: expected a JSON object with \"{}\"", source, key));
  const json* list = nullptr;
  if (auto status = JsonReader(doc, source, "").array(key, list); !status.ok()) return status;
  return *list;
}

}  // namespace

absl::StatusOr<std::vector<PlanTask>> parse_plan_tasks(const std::string& text, const std::string& source) {
  auto list = list_of(text, source, "tasks");
  if (!list.ok()) return list.status();
  return detail::read_objects<PlanTask>(*list, source, "tasks", &PlanTask::name, "name", [](const JsonReader& r, const json& item, PlanTask& t) {
    BF_TRY(r.string("name", t.name));
    if (auto status = check_name("task", t.name); !status.ok()) return r.error("name", std::string(status.message()));
    if (r.has("nodes") == r.has("path")) return r.error("give \"path\" (a chain) or \"nodes\" (a graph)");
    if (r.has("path")) {
      BF_TRY(r.strings("path", t.path));
    } else {
      // The deployment's graph form; the profile, not this file, says which blocks exist.
      const json& nodes = item["nodes"];
      std::set<std::string> blocks;
      if (nodes.is_array()) {
        for (const auto& n : nodes) {
          if (n.is_object() && n.contains("block") && n["block"].is_string()) blocks.insert(n["block"].get<std::string>());
        }
      }
      auto graph = detail::graph_from_json(t.name, json{{"nodes", nodes}}, blocks);
      if (!graph.ok()) return r.error("nodes", std::string(graph.status().message()));
      t.nodes = graph->nodes();
    }
    BF_TRY(r.number("rate_rps", t.rate_rps));
    return r.number("slo_ms", t.slo_ms);
  });
}

absl::StatusOr<std::vector<PlanSite>> parse_plan_sites(const std::string& text, const std::string& source) {
  auto list = list_of(text, source, "sites");
  if (!list.ok()) return list.status();
  return detail::read_objects<PlanSite>(*list, source, "sites", &PlanSite::name, "name", [](const JsonReader& r, const json&, PlanSite& s) {
    BF_TRY(r.string("name", s.name));
    if (auto status = check_name("site", s.name); !status.ok()) return r.error("name", std::string(status.message()));
    BF_TRY(r.string("kind", s.kind));
    if (r.has("device")) BF_TRY(r.string("device", s.device));
    BF_TRY(r.integer("lanes", s.lanes));
    if (r.has("memory_budget")) BF_TRY(r.integer("memory_budget", s.memory_budget));
    if (r.has("reserve")) BF_TRY(r.number("reserve", s.reserve));
    if (r.has("host")) BF_TRY(r.string("host", s.host));
    return absl::OkStatus();
  });
}

absl::StatusOr<std::vector<PlanHost>> parse_plan_hosts(const std::string& text, const std::string& source) {
  const json doc = json::parse(text, nullptr, false);
  if (!doc.is_object() || !doc.contains("hosts")) return std::vector<PlanHost>{};  // parse_plan_sites() reports the rest
  auto list = list_of(text, source, "hosts");
  if (!list.ok()) return list.status();
  return detail::read_objects<PlanHost>(*list, source, "hosts", &PlanHost::name, "name", [](const JsonReader& r, const json&, PlanHost& h) {
    BF_TRY(r.string("name", h.name));
    return r.integer("cores", h.cores);
  });
}

absl::StatusOr<PlanInput> load_plan_input(const std::vector<std::string>& profile_files, const std::string& tasks_file,
                                          const std::string& sites_file) {
  PlanInput in;
  std::set<std::string> names;
  for (std::size_t i = 0; i < profile_files.size(); ++i) {
    auto p = load_profile(profile_files[i]);
    if (!p.ok()) return p.status();
    if (i == 0) {
      in.profile = *std::move(p);
      for (const auto& b : in.profile.blocks) names.insert(b.name);
      continue;
    }
    for (auto& b : p->blocks) {
      if (!names.insert(b.name).second) {
        return absl::InvalidArgumentError(fmt::format("{}: block '{}' is already in {}", profile_files[i], b.name, profile_files[0]));
      }
      in.profile.blocks.push_back(std::move(b));
    }
  }
  if (profile_files.empty()) return absl::InvalidArgumentError("plan: no profile files");
  auto tasks_text = read_file(tasks_file);
  if (!tasks_text.ok()) return tasks_text.status();
  auto tasks = parse_plan_tasks(*tasks_text, tasks_file);
  if (!tasks.ok()) return tasks.status();
  in.tasks = *std::move(tasks);
  auto sites_text = read_file(sites_file);
  if (!sites_text.ok()) return sites_text.status();
  auto sites = parse_plan_sites(*sites_text, sites_file);
  if (!sites.ok()) return sites.status();
  in.sites = *std::move(sites);
  auto hosts = parse_plan_hosts(*sites_text, sites_file);
  if (!hosts.ok()) return hosts.status();
  in.hosts = *std::move(hosts);
  return in;
}

absl::StatusOr<std::vector<BlockPlacement>> placement_of(const Deployment& deployment, const std::vector<PlanSite>& sites) {
  const auto threads = std::find_if(sites.begin(), sites.end(), [](const PlanSite& s) { return s.kind == "threads"; });
  std::vector<BlockPlacement> out;
  for (const auto& b : deployment.blocks) {
    if (b.placement.empty() && threads == sites.end()) {
      return absl::InvalidArgumentError(
          fmt::format("block '{}' runs in the session's threads, and no site is of kind \"threads\"", b.name));
    }
    BlockPlacement p;
    p.block = b.name;
    p.site = b.placement.empty() ? threads->name : b.placement;
    p.max_batch = b.options.max_batch;
    p.workers = b.options.workers;
    out.push_back(std::move(p));
  }
  return out;
}

std::string Plan::deployment_json(const PlanInput& input) const {
  json blocks_json = json::array();
  for (const auto& b : blocks) {
    const BlockProfile* p = input.profile.block(b.block);
    json block = {{"name", b.block}, {"intra_op_threads", p->intra_op_threads}, {"workers", b.workers},
                  {"max_batch", b.max_batch}, {"device", p->device}, {"memory_bytes", p->memory_bytes}};
    const bool torchscript = p->from_file();
    block[torchscript ? "torchscript" : "factory"] = p->source;
    for (const auto& s : input.sites) {
      if (s.name == b.site && s.kind == "worker") block["placement"] = s.name;
    }
    auto shapes = p->input_shapes;
    if (b.max_batch > 1) {
      for (auto& shape : shapes) {
        if (!shape.empty()) shape[0] = -1;  // batches stack along dimension 0
      }
    }
    block["input_shapes"] = shapes;
    if (!p->input_dtypes.empty()) block["input_dtypes"] = dtype_names(p->input_dtypes);
    blocks_json.push_back(std::move(block));
  }
  // In the order of the plan's verdicts (the input's), kept in the file (ordered_json: Deployment::order).
  nlohmann::ordered_json tasks_json = nlohmann::ordered_json::object();
  for (const auto& v : tasks) {
    if (!v.admitted) continue;
    for (const auto& t : input.tasks) {
      if (t.name == v.task) tasks_json[t.name] = t.nodes.empty() ? json(t.path) : detail::graph_to_json(t.nodes);
    }
  }
  // The worker sites' memory budgets, as the session starts them. Their lanes are left to the
  // workers' defaults: the predictions of docs/planner.md ("Accuracy") were measured that way.
  json sites_json = json::object();
  for (const auto& s : input.sites) {
    const bool placed = std::any_of(blocks.begin(), blocks.end(), [&](const BlockPlacement& b) { return b.site == s.name; });
    if (s.kind != "worker" || !placed || s.memory_budget <= 0) continue;
    sites_json[s.name] = {{"memory", {{"budget", s.memory_budget}, {"policy", "admit"}}}};
  }
  nlohmann::ordered_json out = {{"blocks", blocks_json}, {"tasks", tasks_json}};
  if (!sites_json.empty()) out["sites"] = sites_json;
  return out.dump(2);
}

std::string Plan::report_json() const { return detail::plan_report(*this).dump(2); }

nlohmann::json detail::plan_report(const Plan& plan) {
  json tasks_json = json::array();
  for (const auto& v : plan.tasks) {
    tasks_json.push_back({{"task", v.task}, {"admitted", v.admitted}, {"reason", v.reason}, {"rate_rps", v.rate_rps},
                          {"slo_ms", v.slo_ms}, {"predicted_p50_ms", v.predicted_p50_ms}});
  }
  json sites_json = json::array();
  for (const auto& s : plan.sites) {
    sites_json.push_back({{"site", s.site}, {"lanes", s.lanes}, {"lanes_used", s.lanes_used}, {"utilisation", s.utilisation},
                          {"memory_bytes", s.memory_bytes}, {"memory_budget", s.memory_budget}, {"blocks", s.blocks}});
  }
  json blocks_json = json::array();
  for (const auto& b : plan.blocks) {
    blocks_json.push_back({{"block", b.block}, {"site", b.site}, {"max_batch", b.max_batch}, {"workers", b.workers},
                           {"rate_rps", b.rate_rps}, {"lanes_used", b.lanes_used}});
  }
  json hosts_json = json::array();
  for (const auto& h : plan.hosts) {
    hosts_json.push_back({{"host", h.host}, {"cores", h.cores}, {"cores_used", h.cores_used}, {"utilisation", h.utilisation}});
  }
  return json{{"tasks", tasks_json}, {"sites", sites_json}, {"hosts", hosts_json}, {"blocks", blocks_json},
              {"bottleneck_utilisation", plan.bottleneck_utilisation}};
}

}  // namespace blockflow
