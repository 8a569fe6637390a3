#include "worker_allowlist.hpp"

#include <blockflow/deploy/detail/deployment_json.hpp>
#include <blockflow/core/detail/log.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>

namespace blockflow::detail {

WorkerAllowList WorkerAllowList::of(const BlockflowWorkerLaunch& launch) {
  WorkerAllowList a;
  a.enforced = launch.join != 0;
  a.worker = launch.name;
  if (!a.enforced) return a;
  for (int i = 0; i < launch.allowed_plugin_count; ++i) a.plugins.insert(canonical(launch.allowed_plugins[i]));
  if (launch.models_dir != nullptr) a.models_dir = canonical(launch.models_dir);
  return a;
}

std::string WorkerAllowList::canonical(const std::string& path) {
  std::error_code ec;
  const auto c = std::filesystem::weakly_canonical(std::filesystem::absolute(path, ec), ec);
  return ec ? std::string() : c.string();
}

absl::StatusOr<std::string> WorkerAllowList::plugin(const std::string& path) const {
  if (!enforced) return path;
  const std::string c = canonical(path);
  if (c.empty() || plugins.count(c) == 0) {
    return refuse(fmt::format("plugin '{}' is not among this worker's --plugin arguments", path));
  }
  return c;
}

absl::StatusOr<BlockDescription> WorkerAllowList::block(const nlohmann::json& json) const {
  if (!enforced) return block_from_json(json, "");
  // A bare name stands for "<name>.pt": confined like any other path.
  const nlohmann::json b = json.is_string() ? nlohmann::json{{"name", json}, {"torchscript", json.get<std::string>() + ".pt"}} : json;
  auto as_given = block_from_json(b, "");
  if (!as_given.ok()) return as_given;
  // A factory's block: no file, but its warm-up bounded as any deployment from the wire.
  if (as_given->torchscript.empty()) return block_from_json(b, "", /*confine=*/true);
  if (models_dir.empty()) {
    return refuse(fmt::format("block '{}': TorchScript path '{}' refused: this worker was started without --models DIR",
                              as_given->name, as_given->torchscript));
  }
  const std::filesystem::path given(as_given->torchscript);
  if (std::find(given.begin(), given.end(), std::filesystem::path("..")) != given.end()) {
    return refuse(fmt::format("block '{}': TorchScript path '{}' is not inside the models directory (this worker's --models)",
                              as_given->name, as_given->torchscript));
  }
  auto inside = block_from_json(b, models_dir, /*confine=*/true);
  if (inside.ok()) return inside;
  return refuse(fmt::format("{} (this worker's --models)", std::string(inside.status().message())));
}

absl::Status WorkerAllowList::config(const nlohmann::json& config) const {
  if (!enforced || !config.is_object()) return absl::OkStatus();
  for (const char* field : {"peer_endpoint", "data_link", "cuda_probe"}) {
    const auto it = config.find(field);
    if (it == config.end() || it->is_null() || (it->is_string() && it->get_ref<const std::string&>().empty())) continue;
    return refuse(fmt::format("configuration field '{}' ({}) refused: a joined worker binds and connects to no "
                              "endpoint or file its session names",
                              field, it->dump()));
  }
  const auto channel = config.find("channel");
  if (channel != config.end() && *channel != "zmq" && *channel != "") {  // "": the default, zmq
    return refuse(fmt::format("channel {} refused: a joined worker takes channel \"zmq\" only", channel->dump()));
  }
  return absl::OkStatus();
}

absl::Status WorkerAllowList::refuse(const std::string& why) const {
  log(LogLevel::kError, fmt::format("worker {}: {}", worker, why));
  return absl::PermissionDeniedError(why);
}

absl::Status load_plugins(const nlohmann::json& plugins, const WorkerAllowList& allowed, std::set<std::string>& loaded) {
  for (const auto& p : plugins) {
    if (!p.is_string()) return absl::InvalidArgumentError(fmt::format("plugins: {} is not a path", p.dump()));
    auto path = allowed.plugin(p.get<std::string>());
    if (!path.ok()) return path.status();
    if (loaded.count(*path) != 0) continue;
    if (auto status = load_plugin(*path); !status.ok()) return status;
    loaded.insert(*path);
  }
  return absl::OkStatus();
}

}  // namespace blockflow::detail
