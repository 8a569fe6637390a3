// blockflow::predict() and `blockflow-plan --predict`: the planner's model applied to a placement it
// did not choose (a running deployment, profiles taken again), on synthetic profiles whose answers
// are known.
#include "plan_util.hpp"
#include "test_util.hpp"

#include <blockflow/plan/planner.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

using namespace blockflow;
using namespace blockflow::test;
using Catch::Matchers::Contains;

namespace {

Plan predicted(const PlanInput& in, const std::vector<BlockPlacement>& placement) {
  auto p = predict(in, placement);
  INFO(p.status());
  REQUIRE(p.ok());
  return *std::move(p);
}

BlockPlacement placed(const std::string& block, const std::string& site, int max_batch = 1) {
  BlockPlacement p;
  p.block = block;
  p.site = site;
  p.max_batch = max_batch;
  return p;
}

}  // namespace

TEST_CASE("predict() of a plan's own placement gives the plan's figures", "[planner]") {
  auto in = input({block("A", 100), block("B", 50), block("C", 80)},
                  {{"t1", {"A", "B"}, 20, 200}, {"t2", {"A", "C"}, 15, 200}}, {site("w1"), site("w2", 2)});
  const Plan p = planned(in);
  REQUIRE(verdict(p, "t1").admitted);
  REQUIRE(verdict(p, "t2").admitted);
  const Plan q = predicted(in, p.blocks);
  for (const auto& t : {"t1", "t2"}) {
    CHECK(verdict(q, t).admitted);
    CHECK(verdict(q, t).predicted_p50_ms == Approx(verdict(p, t).predicted_p50_ms));
  }
  REQUIRE(q.sites.size() == p.sites.size());
  for (std::size_t s = 0; s < q.sites.size(); ++s) CHECK(q.sites[s].utilisation == Approx(p.sites[s].utilisation));
  for (const auto& b : {"A", "B", "C"}) CHECK(site_of(q, b) == site_of(p, b));
}

TEST_CASE("predict() puts each block where it is told: the waits follow the sites' load", "[planner]") {
  // A and B: 10 ms each (100 req/s per lane); 30 req/s. Together on w1: 0.6 of its lane, an M/D/1
  // wait of 0.6 / (2 x 0.4) x 10 = 7.5 ms per block and an in-process hand-off of 1 us: 35.001 ms.
  // Apart: 0.3 each (w2 also decodes the shm hand-off, 30/s x ~5 us), 2.14 ms of wait per block.
  const auto in = input({block("A", 100), block("B", 100)}, {{"t", {"A", "B"}, 30, 100}}, {site("w1"), site("w2")});
  const Plan together = predicted(in, {placed("A", "w1"), placed("B", "w1")});
  CHECK(verdict(together, "t").admitted);
  CHECK(verdict(together, "t").predicted_p50_ms == Approx(2 * (10 + 7.5) + 0.001).epsilon(1e-4));
  CHECK(together.sites[0].utilisation == Approx(0.6).epsilon(1e-3));
  CHECK(together.sites[1].utilisation == 0);
  const Plan apart = predicted(in, {placed("A", "w1"), placed("B", "w2")});
  const double rho = 0.3, wait = rho / (2 * (1 - rho)) * 10;
  CHECK(verdict(apart, "t").predicted_p50_ms == Approx(10 + wait + 10 + wait + 0.005).epsilon(2e-3));
  CHECK(verdict(apart, "t").predicted_p50_ms < verdict(together, "t").predicted_p50_ms);

  // Batch sizes are kept as given (batch 4 takes 4x the batch-1 time here: no gain).
  const Plan batched = predicted(in, {placed("A", "w1", 4), placed("B", "w2")});
  REQUIRE(batched.blocks.size() == 2);
  CHECK(batched.blocks[0].max_batch == 4);
  CHECK(batched.blocks[1].max_batch == 1);
}

TEST_CASE("predict() says when a placement would not have been admitted, and still predicts it", "[planner]") {
  auto in = input({block("A", 100), block("B", 100)}, {{"t", {"A", "B"}, 60, 100}}, {site("w1"), site("w2")});
  const Plan p = predicted(in, {placed("A", "w1"), placed("B", "w1")});  // 1.2 lanes on one lane
  CHECK_FALSE(verdict(p, "t").admitted);
  CHECK_THAT(verdict(p, "t").reason, Contains("task 't': needs 1.20 lanes for 60.0 req/s"));
  CHECK(verdict(p, "t").predicted_p50_ms > 20);
  CHECK(p.sites[0].utilisation == Approx(1.2).epsilon(1e-3));
}

TEST_CASE("predict() errors name the block and the site", "[planner]") {
  const auto in = input({block("A", 100), block("B", 100)}, {{"t", {"A", "B"}, 10, 100}}, {site("w1")});
  auto missing = predict(in, {placed("A", "w1")});
  REQUIRE_FALSE(missing.ok());
  CHECK_THAT(std::string(missing.status().message()), Contains("block 'B' has no placement"));
  auto unknown = predict(in, {placed("A", "w1"), placed("B", "w9")});
  REQUIRE_FALSE(unknown.ok());
  CHECK_THAT(std::string(unknown.status().message()), Contains("block 'B': no site 'w9'"));
  auto batch = predict(in, {placed("A", "w1", 0), placed("B", "w1")});
  REQUIRE_FALSE(batch.ok());
  CHECK_THAT(std::string(batch.status().message()), Contains("block 'A': max_batch < 1"));
  auto gpu = predict(input({block("G", 100, 10, 1024, 4.0, "cuda:0")}, {{"g", {"G"}, 10, 100}}, {site("w1")}),
                     {placed("G", "w1")});
  REQUIRE_FALSE(gpu.ok());
  CHECK_THAT(std::string(gpu.status().message()), Contains("block 'G' runs on cuda:0, and site 'w1' is cpu"));
  auto bad_task = predict(input({block("A", 100)}, {{"t", {"Z"}, 10, 100}}, {site("w1")}), {placed("A", "w1")});
  REQUIRE_FALSE(bad_task.ok());
  CHECK_THAT(std::string(bad_task.status().message()), Contains("block 'Z' is not in the profile"));
}

TEST_CASE("placement_of(): a deployment's placements, the session's threads for blocks without one", "[planner]") {
  auto d = Deployment::parse(R"({"blocks": [{"name": "A", "torchscript": "a.pt", "placement": "w2", "max_batch": 4},
                                            {"name": "B", "torchscript": "b.pt"}],
                                 "tasks": {"t": ["A", "B"]}})");
  REQUIRE(d.ok());
  auto p = placement_of(*d, {site("w2"), site("host", 1, 0, "threads")});
  REQUIRE(p.ok());
  REQUIRE(p->size() == 2);
  CHECK((*p)[0].block == "A");
  CHECK((*p)[0].site == "w2");
  CHECK((*p)[0].max_batch == 4);
  CHECK((*p)[1].block == "B");
  CHECK((*p)[1].site == "host");
  auto none = placement_of(*d, {site("w2")});
  REQUIRE_FALSE(none.ok());
  CHECK_THAT(std::string(none.status().message()), Contains("block 'B' runs in the session's threads"));
}

TEST_CASE("blockflow-plan --predict reports a deployment's own placement, for its tasks only", "[planner]") {
  const PlanFiles files("plan-predict-test");
  const std::string tasks = files.write("tasks.json", R"({"tasks": [{"name": "t", "path": ["A", "B"], "rate_rps": 30, "slo_ms": 100},
                                                             {"name": "other", "path": ["A"], "rate_rps": 50, "slo_ms": 100}]})");
  const std::string sites = files.write("sites.json", R"({"sites": [{"name": "w1", "kind": "worker", "lanes": 1},
                                                             {"name": "w2", "kind": "worker", "lanes": 1}]})");
  const std::string deployment = files.write("deployment.json", R"({"blocks": [{"name": "A", "torchscript": "A.pt", "placement": "w1"},
                                                                        {"name": "B", "torchscript": "B.pt", "placement": "w1"}],
                                                              "tasks": {"t": ["A", "B"]}})");
  const auto report = files.dir / "report.json";
  auto tool = [&](const std::string& tasks_file, const std::string& extra) {
    const std::string command = fmt::format("{} {} --tasks {} --sites {} --predict {} {} 2>/dev/null", BLOCKFLOW_TEST_PLAN_TOOL,
                                            files.profile, tasks_file, sites, deployment, extra);
    return WEXITSTATUS(std::system(command.c_str()));
  };
  REQUIRE(tool(tasks, "--report " + report.string()) == 0);
  std::ifstream r(report);
  const auto doc = nlohmann::json::parse(r);
  REQUIRE(doc["tasks"].size() == 1);  // "other" is not in the deployment
  CHECK(doc["tasks"][0]["task"] == "t");
  const double p50 = doc["tasks"][0]["predicted_p50_ms"];
  CHECK(p50 == Approx(35.001).epsilon(1e-4));  // both on w1: see above
  CHECK(doc["sites"][0]["blocks"].size() == 2);
  const std::string without_t = files.write("other.json", R"({"tasks": [{"name": "other", "path": ["A"], "rate_rps": 50, "slo_ms": 100}]})");
  CHECK(tool(without_t, "") == 1);  // the deployment's task has no rate
  CHECK(tool(tasks, "--out " + (files.dir / "d.json").string()) == 2);  // --predict writes no deployment
  // A tasks file naming the deployment's task twice is refused at reading, by name.
  const std::string twice = files.write("twice.json", R"({"tasks": [{"name": "t", "path": ["A", "B"], "rate_rps": 30, "slo_ms": 100},
                                                            {"name": "t", "path": ["A"], "rate_rps": 50, "slo_ms": 100}]})");
  CHECK(tool(twice, "") == 1);
  auto read = parse_plan_tasks(R"({"tasks": [{"name": "t", "path": ["A"], "rate_rps": 1, "slo_ms": 9},
                                             {"name": "t", "path": ["A"], "rate_rps": 1, "slo_ms": 9}]})", "twice.json");
  REQUIRE_FALSE(read.ok());
  CHECK_THAT(std::string(read.status().message()), Contains("twice.json: tasks[1].name: 't' appears twice"));
}

TEST_CASE("predict(): a task is refused for its own sites only, and a batch size the profile lacks counts as the "
          "nearest measured one", "[planner]") {
  // w1 is over-committed by t1; t2's block is on w2 alone, and is admitted.
  auto in = input({block("A", 100), block("B", 100)}, {{"t1", {"A"}, 120, 1000}, {"t2", {"B"}, 10, 1000}},
                  {site("w1"), site("w2")});
  const Plan p = predicted(in, {placed("A", "w1"), placed("B", "w2")});
  CHECK_FALSE(verdict(p, "t1").admitted);
  CHECK(verdict(p, "t2").admitted);  // before: refused, "needs 0.10 lanes ... 0.80 lanes left"
  CHECK(verdict(p, "t2").reason.empty());
  // Batch 4 takes twice batch 1's time; batch 8 was not profiled: it serves as batch 4 does (0.75
  // lanes at 150 req/s), not as batch 1 (1.5 lanes).
  auto batched = input({block("A", 100, 10, 1024, 2.0)}, {{"t", {"A"}, 150, 1000}}, {site("w1")});
  const Plan eight = predicted(batched, {placed("A", "w1", 8)});
  CHECK(verdict(eight, "t").admitted);
  CHECK(eight.sites[0].lanes_used == Approx(0.75));
}
