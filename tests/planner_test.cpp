// The planner (plan/planner.hpp) on synthetic profiles whose right answers are known: admission by
// rate proportionality, worst fit, memory, co-location of a heavy edge, greedy batch sizes, SLOs,
// devices, refusal reasons, determinism, the deployment it writes, and its input errors.
#include "test_util.hpp"

#include <blockflow/plan/planner.hpp>

#include <fmt/format.h>

#include <filesystem>
#include <fstream>

using namespace blockflow;
using Catch::Matchers::Contains;

namespace {

// A block served at `rate` req/s per lane at batch 1 (p50 = 1000 / rate ms); at batch 4 the
// forward takes `batch4_factor` x the batch-1 time.
BlockProfile block(const std::string& name, double rate, std::int64_t memory_mb = 10, std::uint64_t output_bytes = 1024,
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

PlanSite site(const std::string& name, int lanes = 1, std::int64_t memory_mb = 0, const std::string& kind = "worker") {
  PlanSite s;
  s.name = name;
  s.kind = kind;
  s.lanes = lanes;
  s.memory_budget = memory_mb << 20;
  return s;
}

PlanInput input(std::vector<BlockProfile> blocks, std::vector<PlanTask> tasks, std::vector<PlanSite> sites) {
  PlanInput in;
  in.profile.blocks = std::move(blocks);
  in.profile.channels = {{"inproc", 1, 0}, {"shm", 5, 1}};
  in.tasks = std::move(tasks);
  in.sites = std::move(sites);
  return in;
}

const TaskVerdict& verdict(const Plan& p, const std::string& task) {
  for (const auto& v : p.tasks) {
    if (v.task == task) return v;
  }
  FAIL("no verdict for " << task);
  return p.tasks.front();
}

std::string site_of(const Plan& p, const std::string& block) {
  for (const auto& b : p.blocks) {
    if (b.block == block) return b.site;
  }
  return "";
}

Plan planned(const PlanInput& in) {
  auto p = plan(in);
  INFO(p.status());
  REQUIRE(p.ok());
  return *std::move(p);
}

}  // namespace

TEST_CASE("admission by rate proportionality: a task is refused once its block's lanes are spoken for", "[planner]") {
  // A serves 100 req/s per lane; one site of one lane: 60 + 60 req/s do not fit.
  const auto p = planned(input({block("A", 100)}, {{"t1", {"A"}, 60, 100}, {"t2", {"A"}, 60, 100}}, {site("w1")}));
  CHECK(verdict(p, "t1").admitted);
  CHECK_FALSE(verdict(p, "t2").admitted);
  CHECK_THAT(verdict(p, "t2").reason, Contains("task 't2': needs 0.60 lanes for 60.0 req/s (block 'A' at 100.0 req/s per lane)"));
  CHECK_THAT(verdict(p, "t2").reason, Contains("0.40 lanes left"));
  REQUIRE(p.sites.size() == 1);
  CHECK(p.sites[0].utilisation == Approx(0.6));  // never over-committed: only t1's load
  CHECK(p.bottleneck_utilisation == Approx(0.6));
  REQUIRE(p.blocks.size() == 1);
  CHECK(p.blocks[0].rate_rps == Approx(60));
}

TEST_CASE("worst fit spreads blocks over the sites; the reserve is kept free", "[planner]") {
  auto in = input({block("A", 100), block("B", 100)}, {{"t", {"A", "B"}, 60, 100}}, {site("w1"), site("w2")});
  auto p = planned(in);
  CHECK(verdict(p, "t").admitted);
  CHECK(site_of(p, "A") != site_of(p, "B"));  // together they would need 1.2 lanes of one
  CHECK(p.bottleneck_utilisation < 0.7);
  in.sites[0].reserve = in.sites[1].reserve = 0.5;  // 0.5 lane each: 0.6 no longer fits anywhere
  p = planned(in);
  CHECK_FALSE(verdict(p, "t").admitted);
}

TEST_CASE("memory: the largest block goes where it fits, and a block no site can hold is refused by memory",
          "[planner]") {
  auto in = input({block("small", 1000, 100), block("big", 1000, 700)}, {{"t", {"small", "big"}, 10, 100}},
                  {site("w1", 1, 500), site("w2", 1, 800)});
  auto p = planned(in);
  CHECK(verdict(p, "t").admitted);
  CHECK(site_of(p, "big") == "w2");
  in.profile.blocks[1].memory_bytes = std::int64_t{900} << 20;
  p = planned(in);
  CHECK_FALSE(verdict(p, "t").admitted);
  CHECK_THAT(verdict(p, "t").reason, Contains("needs 900.0 MB for block 'big'"));
  CHECK_THAT(verdict(p, "t").reason, Contains("800.0 MB"));
}

TEST_CASE("a heavy edge keeps its two blocks together when splitting them costs more than it saves", "[planner]") {
  // A and B take 0.3 lanes each; A's 40 MB output crossing sites costs the receiver
  // 10 req/s x (5 us + 1000 us/MB x 40 MB) = 0.4 lanes: apart, one site would be at 0.7.
  auto in = input({block("A", 33.3333, 10, 40u << 20), block("B", 33.3333)}, {{"t", {"A", "B"}, 10, 1000}},
                  {site("w1"), site("w2")});
  in.profile.channels = {{"inproc", 1, 0}, {"shm", 5, 1000}};
  auto p = planned(in);
  CHECK(verdict(p, "t").admitted);
  CHECK(site_of(p, "A") == site_of(p, "B"));
  in.profile.channels = {{"inproc", 1, 0}, {"shm", 5, 1}};  // a cheap edge: spread them
  p = planned(in);
  CHECK(site_of(p, "A") != site_of(p, "B"));
}

TEST_CASE("greedy batch sizes: a block that cannot keep up at batch 1 takes a larger batch", "[planner]") {
  // 50 req/s per lane at batch 1; at batch 4 a forward takes 2x the time: 100 req/s per lane.
  auto in = input({block("A", 50, 10, 1024, 2.0)}, {{"t", {"A"}, 80, 200}}, {site("w1")});
  auto p = planned(in);
  CHECK(verdict(p, "t").admitted);
  REQUIRE(p.blocks.size() == 1);
  CHECK(p.blocks[0].max_batch == 4);
  CHECK(p.blocks[0].lanes_used == Approx(0.8));
  // A batch that gains nothing (4x the time for 4 requests) does not help: refused.
  in.profile.blocks[0] = block("A", 50, 10, 1024, 4.0);
  p = planned(in);
  CHECK_FALSE(verdict(p, "t").admitted);
}

TEST_CASE("SLOs and devices: a task predicted over its SLO, and a block no site can run, are refused", "[planner]") {
  auto p = planned(input({block("A", 100)}, {{"fast", {"A"}, 10, 5}, {"ok", {"A"}, 10, 50}}, {site("w1")}));
  CHECK_FALSE(verdict(p, "fast").admitted);
  CHECK_THAT(verdict(p, "fast").reason, Contains("exceeds its SLO of 5.0 ms"));
  CHECK(verdict(p, "ok").admitted);
  CHECK(verdict(p, "ok").predicted_p50_ms >= 10.0);  // at least the block's p50
  CHECK(verdict(p, "ok").predicted_p50_ms < 50.0);

  p = planned(input({block("gpu", 100, 10, 1024, 4.0, "cuda:0")}, {{"t", {"gpu"}, 10, 50}}, {site("w1")}));
  CHECK_FALSE(verdict(p, "t").admitted);
  CHECK_THAT(verdict(p, "t").reason, Contains("no site has that device"));
}

TEST_CASE("plans are deterministic, and the deployment they write is one Session::apply() takes", "[planner]") {
  auto in = input({block("A", 100), block("B", 60), block("C", 80)},
                  {{"t1", {"A", "B"}, 20, 100}, {"t2", {"A", "C"}, 20, 100}}, {site("host", 1, 0, "threads"), site("w1")});
  const auto first = planned(in);
  const auto second = planned(in);
  CHECK(first.report_json() == second.report_json());
  CHECK(first.deployment_json(in) == second.deployment_json(in));
  auto d = Deployment::parse(first.deployment_json(in), "/models");
  INFO(d.status());
  REQUIRE(d.ok());
  CHECK(d->blocks.size() == 3);
  CHECK(d->tasks.size() == 2);
  for (const auto& b : d->blocks) {
    CHECK(b.torchscript == "/models/" + b.name + ".pt");
    CHECK(b.placement == (site_of(first, b.name) == "host" ? "" : "w1"));
    CHECK(b.options.intra_op_threads == 2);
    CHECK(b.options.memory_bytes == std::int64_t{10} << 20);  // the profile's, for admission
  }
}

TEST_CASE("inputs that cannot be planned are errors naming the task, block, site, file and field", "[planner]") {
  auto bad = [](PlanInput in) { return std::string(plan(in).status().message()); };
  CHECK_THAT(bad(input({block("A", 10)}, {{"t", {"Z"}, 1, 10}}, {site("w1")})), Contains("task 't': block 'Z' is not in the profile"));
  CHECK_THAT(bad(input({block("A", 10)}, {{"t", {"A"}, 0, 10}}, {site("w1")})), Contains("task 't': rate_rps"));
  CHECK_THAT(bad(input({block("A", 10)}, {{"t", {"A"}, 1, 10}}, {site("w1"), site("w1")})), Contains("site 'w1': named twice"));
  CHECK_THAT(bad(input({block("A", 10)}, {{"t", {"A"}, 1, 10}}, {site("w1", 0)})), Contains("site 'w1': lanes"));
  CHECK_THAT(bad(input({block("A", 10)}, {{"t", {"A"}, 1, 10}}, {})), Contains("no sites"));
  auto kind = input({block("A", 10)}, {{"t", {"A"}, 1, 10}}, {site("w1")});
  kind.sites[0].kind = "gpu";
  CHECK_THAT(bad(kind), Contains("site 'w1': kind 'gpu'"));

  CHECK_THAT(std::string(parse_plan_tasks("{\"tasks\": [{\"name\": \"t\", \"path\": [\"A\"], \"rate_rps\": \"x\", \"slo_ms\": 1}]}",
                                          "tasks.json").status().message()),
             Contains("tasks.json: tasks[0].rate_rps: expected a number"));
  CHECK_THAT(std::string(parse_plan_tasks("{\"tasks\": [{\"name\": \"t\", \"path\": [1], \"rate_rps\": 1, \"slo_ms\": 1}]}",
                                          "tasks.json").status().message()),
             Contains("tasks[0].path: expected an array of strings"));
  CHECK_THAT(std::string(parse_plan_sites("{\"sites\": [{\"name\": \"w\", \"kind\": \"worker\"}]}", "sites.json").status().message()),
             Contains("sites.json: sites[0].lanes: missing"));
  CHECK_THAT(std::string(parse_plan_sites("[]", "sites.json").status().message()), Contains("sites.json: expected a JSON object"));
}

TEST_CASE("blockflow-plan reads the three files and writes the deployment and the report", "[planner]") {
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("plan-test-{}", ::getpid());
  std::filesystem::create_directories(dir);
  auto in = input({block("A", 100), block("B", 100)}, {}, {});
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir / name) << text;
    return (dir / name).string();
  };
  const std::string profile = write("profile.json", in.profile.to_json());
  const std::string tasks = write("tasks.json", R"({"tasks": [{"name": "t", "path": ["A", "B"], "rate_rps": 30, "slo_ms": 100},
                                                             {"name": "big", "path": ["A"], "rate_rps": 500, "slo_ms": 100}]})");
  const std::string sites = write("sites.json", R"({"sites": [{"name": "w1", "kind": "worker", "lanes": 1},
                                                             {"name": "w2", "kind": "worker", "lanes": 1, "memory_budget": 1000000000}]})");
  const auto deployment = dir / "deployment.json", report = dir / "report.json";
  const std::string command = fmt::format("{} {} --tasks {} --sites {} --out {} --report {} 2>/dev/null", BLOCKFLOW_TEST_PLAN_TOOL,
                                          profile, tasks, sites, deployment.string(), report.string());
  REQUIRE(std::system(command.c_str()) == 0);
  std::ifstream d(deployment), r(report);
  const std::string d_text((std::istreambuf_iterator<char>(d)), {}), r_text((std::istreambuf_iterator<char>(r)), {});
  CHECK(Deployment::parse(d_text).ok());
  CHECK_THAT(r_text, Contains("\"admitted\": true"));
  CHECK_THAT(r_text, Contains("task 'big': needs 5.00 lanes for 500.0 req/s (block 'A'"));
  const std::string broken = fmt::format("{} {} --tasks {} --sites {} 2>/dev/null", BLOCKFLOW_TEST_PLAN_TOOL, profile, profile, sites);
  CHECK(WEXITSTATUS(std::system(broken.c_str())) == 1);
  std::filesystem::remove_all(dir);
}
