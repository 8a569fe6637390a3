#pragma once
// Helpers shared by the planner's tests: synthetic block profiles whose right answers are known,
// sites, inputs, and lookups in a plan.

#include "test_util.hpp"

#include <blockflow/plan/planner.hpp>

#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace blockflow::test {

// A block served at `rate` req/s per lane at batch 1 (p50 = 1000 / rate ms); at batch 4 the
// forward takes `batch4_factor` x the batch-1 time.
inline BlockProfile block(const std::string& name, double rate, std::int64_t memory_mb = 10, std::uint64_t output_bytes = 1024,
                   double batch4_factor = 4.0, const std::string& device = "cpu") {
  BlockProfile b;
  b.name = name;
  b.source = name + ".pt";
  b.device = device;
  b.intra_op_threads = 2;
  b.input_shapes = {{1, 8}};
  b.output_shapes = {{1, 8}};
  const double p50 = 1000.0 / rate;
  b.latency = {{1, p50, p50 * 1.2}, {4, p50 * batch4_factor, p50 * batch4_factor * 1.2}};
  b.max_rate_rps = rate;
  b.memory_bytes = memory_mb << 20;
  b.output_bytes = output_bytes;
  return b;
}

inline PlanSite site(const std::string& name, int lanes = 1, std::int64_t memory_mb = 0, const std::string& kind = "worker") {
  PlanSite s;
  s.name = name;
  s.kind = kind;
  s.lanes = lanes;
  s.memory_budget = memory_mb << 20;
  return s;
}

inline PlanInput input(std::vector<BlockProfile> blocks, std::vector<PlanTask> tasks, std::vector<PlanSite> sites) {
  PlanInput in;
  in.profile.blocks = std::move(blocks);
  in.profile.channels = {{"inproc", 1, 0}, {"shm", 5, 1}};
  in.tasks = std::move(tasks);
  in.sites = std::move(sites);
  return in;
}

inline const TaskVerdict& verdict(const Plan& p, const std::string& task) {
  for (const auto& v : p.tasks) {
    if (v.task == task) return v;
  }
  FAIL("no verdict for " << task);
  return p.tasks.front();
}

inline std::string site_of(const Plan& p, const std::string& block) {
  for (const auto& b : p.blocks) {
    if (b.block == block) return b.site;
  }
  return "";
}

// A directory of its own for the planner tools' files, removed with it; `profile` holds blocks A
// and B of 100 req/s per lane.
struct PlanFiles {
  std::filesystem::path dir;
  std::string profile;
  explicit PlanFiles(const std::string& name)
      : dir(std::filesystem::temp_directory_path() / fmt::format("{}-{}", name, ::getpid())) {
    std::filesystem::create_directories(dir);
    profile = write("profile.json", input({block("A", 100), block("B", 100)}, {}, {}).profile.to_json());
  }
  ~PlanFiles() { remove_tree(dir.string()); }
  PlanFiles(const PlanFiles&) = delete;
  PlanFiles& operator=(const PlanFiles&) = delete;
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(dir / name) << text;
    return (dir / name).string();
  }
};

inline Plan planned(const PlanInput& in) {
  auto p = plan(in);
  INFO(p.status());
  REQUIRE(p.ok());
  return *std::move(p);
}


}  // namespace blockflow::test
