#pragma once
// The split ResNet50 of scripts/export_models.py as the benchmarks deploy it: four blocks with their
// input shapes, and the monolithic model.

#include <blockflow/blockflow.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace blockflow::bench {

/// block1..block4: name and input shape (batch 1).
inline const std::vector<std::pair<std::string, std::vector<std::int64_t>>>& resnet_split_stages() {
  static const std::vector<std::pair<std::string, std::vector<std::int64_t>>> stages = {
      {"block1", {1, 3, 224, 224}}, {"block2", {1, 256, 56, 56}}, {"block3", {1, 512, 28, 28}}, {"block4", {1, 1024, 14, 14}}};
  return stages;
}

/// The block `name` (models/<name>.pt) with `threads` intra-op threads, warmed up on `shape`.
inline BlockDescription model_block(const std::string& models, const std::string& name, std::vector<std::int64_t> shape,
                                    int threads, bool optimize) {
  BlockDescription d;
  d.name = name;
  d.torchscript = models + "/" + name + ".pt";
  d.options.intra_op_threads = threads;
  d.torchscript_options.optimize_for_inference = optimize;
  d.options.input_shapes = {std::move(shape)};
  return d;
}

}  // namespace blockflow::bench
