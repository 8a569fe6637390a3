// pipeline: the 4-block split ResNet50 in threads mode against the monolithic model, same process,
// same intra-op thread count, synchronous client, requests interleaved (split, monolithic, split,
// ...) so that machine noise hits both alike. Prints one JSON line:
// {"bench":"pipeline","mode":"threads","channel":"inproc","threads_per_block":T,"requests":N,
//  "e2e_p50_ms":..,"monolithic_p50_ms":..,"ratio":..,"overhead_p50_ms":..}
//
//   pipeline_bench --models DIR [--requests N] [--threads T]

#include "bench_util.hpp"

#include <blockflow/blockflow.hpp>
#include <blockflow/detail/clock.hpp>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <iostream>

namespace bf = blockflow;

int main(int argc, char** argv) try {
  std::string models;
  int requests = 100, threads = 2, warmup = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--models") models = v;
    else if (a == "--requests") requests = std::stoi(v);
    else if (a == "--threads") threads = std::stoi(v);
    else if (a == "--warmup") warmup = std::stoi(v);
    else throw std::invalid_argument("unknown argument " + a);
  }
  if (models.empty()) throw std::invalid_argument("usage: pipeline_bench --models DIR [--requests N] [--threads T]");

  auto load = [&](const std::string& name, std::vector<std::int64_t> shape) {
    bf::BlockOptions options;
    options.intra_op_threads = threads;
    options.input_shapes = {std::move(shape)};
    auto block = bf::load_torchscript_block(name, models + "/" + name + ".pt", options);
    if (!block.ok()) throw std::runtime_error(block.status().ToString());
    return *block;
  };
  bf::Session session;
  session.add_block(load("block1", {1, 3, 224, 224}))
      .add_block(load("block2", {1, 256, 56, 56}))
      .add_block(load("block3", {1, 512, 28, 28}))
      .add_block(load("block4", {1, 1024, 14, 14}))
      .add_block(load("monolithic", {1, 3, 224, 224}))
      .add_path(bf::Path::chain("split", {"block1", "block2", "block3", "block4"}))
      .add_path(bf::Path::chain("whole", {"monolithic"}));
  if (auto status = session.start(); !status.ok()) throw std::runtime_error(status.ToString());

  std::vector<double> e2e_ms, mono_ms, overhead_ms;
  const bf::Tensor x = at::randn({1, 3, 224, 224});
  for (int i = -warmup; i < requests; ++i) {
    const bf::Result r = session.submit("split", x).get();
    if (!r.ok()) throw std::runtime_error(r.status.ToString());
    const bf::Result m = session.submit("whole", x).get();
    if (!m.ok()) throw std::runtime_error(m.status.ToString());
    if (i < 0) continue;
    e2e_ms.push_back(r.trace.e2e_ms());
    overhead_ms.push_back(r.trace.overhead_ms());
    mono_ms.push_back(m.trace.compute_ms());  // the model alone: its forward() time
  }
  const double e2e = bf::bench::percentile(e2e_ms, 0.5), mono = bf::bench::percentile(mono_ms, 0.5);
  fmt::print(
      "{{\"bench\":\"pipeline\",\"mode\":\"threads\",\"channel\":\"inproc\",\"threads_per_block\":{},\"requests\":{},"
      "\"e2e_p50_ms\":{:.3f},\"monolithic_p50_ms\":{:.3f},\"ratio\":{:.4f},\"overhead_p50_ms\":{:.4f}}}\n",
      threads, requests, e2e, mono, e2e / mono, bf::bench::percentile(overhead_ms, 0.5));
  return 0;
} catch (const std::exception& e) {
  std::cerr << "pipeline_bench: " << e.what() << "\n";
  return 1;
}
