#pragma once
// Internal: one block description <-> JSON, the shape of docs in deployment.hpp (flat fields). The
// worker control protocol ships blocks in the same shape, so one parser validates both.
#include <blockflow/block_registry.hpp>

#include <absl/status/statusor.h>
#include <nlohmann/json.hpp>

#include <string>

namespace blockflow::detail {

/// A block as an object with every field. Paths are written as they are.
nlohmann::json block_to_json(const BlockDescription& description);
/// A block from a name (the TorchScript file <models_dir>/<name>.pt) or an object; relative
/// TorchScript paths are resolved against `models_dir` when it is not empty. Errors name the block
/// and the field.
absl::StatusOr<BlockDescription> block_from_json(const nlohmann::json& json, const std::string& models_dir);

}  // namespace blockflow::detail
