// The planner (plan/planner.hpp) on synthetic profiles whose right answers are known: admission by
// rate proportionality, worst fit, memory, co-location of a heavy edge, greedy batch sizes, SLOs,
// devices, refusal reasons, determinism, the deployment it writes, and its input errors.
#include "plan_util.hpp"
#include "test_util.hpp"

#include <blockflow/plan/planner.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>

using namespace blockflow;
using namespace blockflow::test;
using Catch::Matchers::Contains;

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

TEST_CASE("greedy batch sizes: a task over its SLO at batch 1, with no site over-committed, takes the batch that "
          "brings it within", "[planner]") {
  // 50 req/s per lane at batch 1 (20 ms), 100 at batch 4 (40 ms a forward). At 45 req/s batch 1 fits
  // (0.9 of the lane) but queues: 20 + 90 ms wait, over the 80 ms SLO. Batch 4: 0.45 of the lane,
  // 40 ms + 16.4 ms wait + the fill, within. Before, batches were tried only when over-committed.
  auto in = input({block("A", 50, 10, 1024, 2.0)}, {{"t", {"A"}, 45, 80}}, {site("w1")});
  auto p = planned(in);
  INFO(verdict(p, "t").reason);
  CHECK(verdict(p, "t").admitted);
  REQUIRE(p.blocks.size() == 1);
  CHECK(p.blocks[0].max_batch == 4);
  CHECK(verdict(p, "t").predicted_p50_ms < 80);
  // Where no batch brings it within (no batch gain), it is refused at batch 1.
  in.profile.blocks[0] = block("A", 50, 10, 1024, 4.0);
  p = planned(in);
  CHECK_FALSE(verdict(p, "t").admitted);
}

TEST_CASE("greedy batch sizes: the batch that lowers the over-commitment is taken, not the one that frees most lanes "
          "elsewhere", "[planner]") {
  // B nearly fills w2 (2.7 of 3 lanes at batch 1: a site at 3 of 3 would be saturated, its wait
  // unbounded); A needs 1.1 lanes, 0.1 more than w1 keeps usable (2 lanes, half in reserve). B's
  // batch 4 would free the most lanes (2.0, where nothing is short); A's frees 0.55, and is the one
  // that lowers the over-commitment.
  PlanSite w1 = site("w1", 2);
  w1.reserve = 0.5;
  auto in = input({block("A", 100, 10, 1024, 2.0), block("B", 100, 10, 1024, 1.0)},
                  {{"ta", {"A"}, 110, 500}, {"tb", {"B"}, 270, 500}}, {w1, site("w2", 3)});
  auto p = planned(in);
  CHECK(site_of(p, "A") == "w1");
  CHECK(verdict(p, "ta").admitted);
  CHECK(verdict(p, "tb").admitted);
  for (const auto& b : p.blocks) {
    INFO(b.block << " on " << b.site << " at max_batch " << b.max_batch);
    CHECK(b.max_batch == (b.block == "A" ? 4 : 1));
  }
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

  // A block no site can run after one that has a site: the placement's swaps pass over it, and the
  // exhaustive search names that block, not the first one.
  for (const bool exhaustive : {false, true}) {
    INFO("exhaustive " << exhaustive);
    PlanOptions options;
    options.exhaustive = exhaustive;
    auto q = plan(input({block("A", 100), block("gpu", 100, 10, 1024, 4.0, "cuda:0")}, {{"t", {"A", "gpu"}, 10, 50}},
                        {site("w1"), site("w2")}),
                  options);
    REQUIRE(q.ok());
    CHECK_FALSE(verdict(*q, "t").admitted);
    CHECK_THAT(verdict(*q, "t").reason, Contains("'gpu'") && Contains("no site has that device"));
    CHECK_THAT(verdict(*q, "t").reason, !Contains("'A'"));
  }
}

TEST_CASE("graph tasks: joins of joins count each source block once; a node naming an input twice is refused",
          "[planner]") {
  // 24 levels of joins over the same two branches: doubling its sources at each level, the graph
  // would count 2^24 of them.
  Path deep("deep");
  deep.node("A", {}).node("B", {}).join("j0", {"A", "B"}, Combine::pack());
  for (int k = 1; k <= 24; ++k) {
    const std::string prev = fmt::format("j{}", k - 1);
    deep.join(fmt::format("x{}", k), {prev, "A"}, Combine::pack())
        .join(fmt::format("y{}", k), {prev, "B"}, Combine::pack())
        .join(fmt::format("j{}", k), {fmt::format("x{}", k), fmt::format("y{}", k)}, Combine::pack());
  }
  auto p = plan(input({block("A", 100), block("B", 100)}, {PlanTask::graph(deep, 10, 500)}, {site("w1"), site("w2")}));
  INFO(p.status());
  REQUIRE(p.ok());
  CHECK(verdict(*p, "deep").admitted);

  Path twice("twice");
  twice.node("A", {}).join("j", {"A", "A"}, Combine::pack());
  auto refused = plan(input({block("A", 100)}, {PlanTask::graph(twice, 10, 500)}, {site("w1")}));
  REQUIRE_FALSE(refused.ok());
  CHECK_THAT(std::string(refused.status().message()), Contains("names input 'A' twice"));
}

TEST_CASE("an exhaustive search is refused, naming its size, when the sites' placements are too many", "[planner]") {
  std::vector<BlockProfile> blocks;
  std::vector<std::string> path;
  for (int i = 0; i < 10; ++i) {
    blocks.push_back(block(fmt::format("b{}", i), 1000));
    path.push_back(fmt::format("b{}", i));
  }
  std::vector<PlanSite> sites;
  for (int i = 0; i < 6; ++i) sites.push_back(site(fmt::format("w{}", i)));
  PlanOptions options;
  options.exhaustive = true;
  auto p = plan(input(blocks, {{"t", path, 10, 500}}, sites), options);  // 6^10 > 4^12
  REQUIRE_FALSE(p.ok());
  CHECK_THAT(std::string(p.status().message()), Contains("10 blocks on 6 sites"));
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
  // One session runs every "threads" block; a worker's name becomes a placement.
  CHECK_THAT(bad(input({block("A", 10)}, {{"t", {"A"}, 1, 10}}, {site("a", 1, 0, "threads"), site("b", 1, 0, "threads")})),
             Contains("site 'b': a second site of kind \"threads\""));
  CHECK_THAT(bad(input({block("A", 10)}, {{"t", {"A"}, 1, 10}}, {site("host")})), Contains("site name 'host' is reserved"));
  CHECK(plan(input({block("A", 10)}, {{"t", {"A"}, 1, 10}}, {site("host", 1, 0, "threads")})).ok());

  CHECK_THAT(std::string(parse_plan_tasks("{\"tasks\": [{\"name\": \"t\", \"path\": [\"A\"], \"rate_rps\": \"x\", \"slo_ms\": 1}]}",
                                          "tasks.json").status().message()),
             Contains("tasks.json: tasks[0].rate_rps: expected a number"));
  CHECK_THAT(std::string(parse_plan_tasks("{\"tasks\": [{\"name\": \"t\", \"path\": [1], \"rate_rps\": 1, \"slo_ms\": 1}]}",
                                          "tasks.json").status().message()),
             Contains("tasks[0].path: expected an array of strings"));
  const std::string deep = "{\"tasks\": " + std::string(100'000, '[') + std::string(100'000, ']') + "}";
  CHECK_THAT(std::string(parse_plan_tasks(deep, "tasks.json").status().message()),
             Contains("tasks.json: JSON nests deeper than 64 levels"));
  CHECK_THAT(std::string(parse_plan_sites("{\"sites\": [{\"name\": \"w\", \"kind\": \"worker\"}]}", "sites.json").status().message()),
             Contains("sites.json: sites[0].lanes: missing"));
  CHECK_THAT(std::string(parse_plan_sites("[]", "sites.json").status().message()), Contains("sites.json: expected a JSON object"));
  // Past what the field's type holds (or 2^53): refused, not cast.
  CHECK_THAT(std::string(parse_plan_sites("{\"sites\": [{\"name\": \"w\", \"kind\": \"worker\", \"lanes\": 3000000000}]}",
                                          "sites.json").status().message()),
             Contains("sites.json: sites[0].lanes: expected a whole number <= 2147483647"));
  // A misspelled optional field is refused, not left at its default (an unbounded budget here).
  CHECK_THAT(std::string(parse_plan_sites(R"({"sites": [{"name": "w", "kind": "worker", "lanes": 1, "memory_budjet": 2}]})",
                                          "sites.json").status().message()),
             Contains("sites.json: sites[0].memory_budjet: unknown field"));
  CHECK_THAT(std::string(parse_plan_tasks(R"({"tasks": [{"name": "t", "path": ["A"], "rate_rps": 1, "slo_ms": 1, "slo": 2}]})",
                                          "tasks.json").status().message()),
             Contains("tasks.json: tasks[0].slo: unknown field"));
  // Names a deployment could not carry are refused here, not when the plan's deployment is read.
  CHECK_THAT(std::string(parse_plan_tasks(R"({"tasks": [{"name": "classify/v2", "path": ["A"], "rate_rps": 1, "slo_ms": 1}]})",
                                          "tasks.json").status().message()),
             Contains("tasks.json: tasks[0].name: task name 'classify/v2'"));
  CHECK_THAT(std::string(parse_plan_sites(R"({"sites": [{"name": "gpu box", "kind": "worker", "lanes": 1}]})",
                                          "sites.json").status().message()),
             Contains("sites.json: sites[0].name: site name 'gpu box'"));
}

TEST_CASE("blockflow-plan reads the three files and writes the deployment and the report", "[planner]") {
  const PlanFiles files("plan-test");
  const std::string tasks = files.write("tasks.json", R"({"tasks": [{"name": "t", "path": ["A", "B"], "rate_rps": 30, "slo_ms": 100},
                                                             {"name": "big", "path": ["A"], "rate_rps": 500, "slo_ms": 100}]})");
  const std::string sites = files.write("sites.json", R"({"sites": [{"name": "w1", "kind": "worker", "lanes": 1},
                                                             {"name": "w2", "kind": "worker", "lanes": 1, "memory_budget": 1000000000}]})");
  const auto deployment = files.dir / "deployment.json", report = files.dir / "report.json";
  const std::string command = fmt::format("{} {} --tasks {} --sites {} --out {} --report {} 2>/dev/null", BLOCKFLOW_TEST_PLAN_TOOL,
                                          files.profile, tasks, sites, deployment.string(), report.string());
  REQUIRE(std::system(command.c_str()) == 0);
  std::ifstream d(deployment), r(report);
  const std::string d_text((std::istreambuf_iterator<char>(d)), {}), r_text((std::istreambuf_iterator<char>(r)), {});
  CHECK(Deployment::parse(d_text).ok());
  CHECK_THAT(r_text, Contains("\"admitted\": true"));
  CHECK_THAT(r_text, Contains("task 'big': needs 5.00 lanes for 500.0 req/s (block 'A'"));
  const std::string broken = fmt::format("{} {} --tasks {} --sites {} 2>/dev/null", BLOCKFLOW_TEST_PLAN_TOOL, files.profile, files.profile, sites);
  CHECK(WEXITSTATUS(std::system(broken.c_str())) == 1);
}

namespace {

// trunk -> head_a, head_b -> mean: the ensemble of the deployment docs.
PlanTask ensemble(double rate, double slo) {
  Path p("ensemble");
  p.then("trunk").node("head_a", {"trunk"}).node("head_b", {"trunk"}).join("avg", {"head_a", "head_b"}, Combine::mean());
  return PlanTask::graph(p, rate, slo);
}

}  // namespace

TEST_CASE("graph tasks: every branch's block serves the task's rate, latency follows the slowest branch", "[planner]") {
  // One site of 4 lanes, no hand-off costs: the prediction is trunk + the slower head, each with
  // the M/D/1 wait at the site's utilisation over its 4 lanes (each block may run on all four: its
  // own load on them waits less).
  auto in = input({block("trunk", 200), block("head_a", 100), block("head_b", 50)}, {ensemble(20, 100)}, {site("w1", 4)});
  in.profile.channels.clear();
  const auto p = planned(in);
  REQUIRE(verdict(p, "ensemble").admitted);
  for (const auto& b : p.blocks) CHECK(b.rate_rps == Approx(20));  // both heads serve every request
  REQUIRE(p.sites.size() == 1);
  CHECK(p.sites[0].lanes_used == Approx(20.0 / 200 + 20.0 / 100 + 20.0 / 50));
  const double rho = p.sites[0].utilisation;
  const double wait = rho / (2 * (1 - rho)) / 4;
  CHECK(verdict(p, "ensemble").predicted_p50_ms == Approx((5.0 + 20.0) * (1 + wait)));  // trunk 5 ms, head_b 20 ms
  for (const auto& b : p.blocks) CHECK(b.workers == 4);

  // Too fast for head_b's lanes: refused, naming it as the largest share.
  auto busy = input({block("trunk", 200), block("head_a", 100), block("head_b", 50)}, {ensemble(60, 1000)}, {site("w1", 1)});
  const auto refused = planned(busy);
  CHECK_FALSE(verdict(refused, "ensemble").admitted);
  CHECK_THAT(verdict(refused, "ensemble").reason, Contains("over 3 blocks") && Contains("block 'head_b'"));
}

TEST_CASE("graph tasks: a heavy fan-out keeps its blocks together, and the deployment written is a graph apply() takes",
          "[planner]") {
  // Each block takes 0.3 lanes at 10 req/s; the trunk's 80 MB output crossing sites costs the
  // receiver 10 x 80 ms = 0.8 lanes per head: together one site is at 0.9 / 2 lanes, while any split
  // puts a head and its hop at (0.3 + 0.8) / 2 or more.
  auto in = input({block("trunk", 33.3333, 10, 80u << 20), block("head_a", 33.3333), block("head_b", 33.3333)},
                  {ensemble(10, 1000)}, {site("w1", 2), site("w2", 2)});
  in.profile.channels = {{"inproc", 1, 0}, {"shm", 5, 1000}};
  auto p = planned(in);
  REQUIRE(verdict(p, "ensemble").admitted);
  CHECK(site_of(p, "head_a") == site_of(p, "trunk"));
  CHECK(site_of(p, "head_b") == site_of(p, "trunk"));
  in.profile.channels = {{"inproc", 1, 0}, {"shm", 5, 1}};  // a cheap fan-out: the heads spread
  const auto cheap = planned(in);
  CHECK((site_of(cheap, "head_a") != site_of(cheap, "trunk") || site_of(cheap, "head_b") != site_of(cheap, "trunk")));

  auto d = Deployment::parse(p.deployment_json(in), "/models");
  INFO(d.status());
  REQUIRE(d.ok());
  CHECK(d->tasks.empty());
  REQUIRE(d->graphs.size() == 1);
  const auto& nodes = d->graphs[0].nodes();
  REQUIRE(nodes.size() == 4);
  CHECK(nodes[3].name == "avg");
  CHECK(nodes[3].block.empty());
  CHECK(nodes[3].inputs == std::vector<std::string>{"head_a", "head_b"});
  CHECK(nodes[3].combine.name() == "mean");
  CHECK(nodes[1].inputs == std::vector<std::string>{"trunk"});
}

TEST_CASE("graph tasks: the tasks file takes the deployment's graph form; bad graphs name the task and the node", "[planner]") {
  auto tasks = parse_plan_tasks(R"({"tasks": [{"name": "e", "rate_rps": 5, "slo_ms": 50, "nodes": [
      {"block": "trunk"}, {"block": "head_a", "inputs": ["trunk"]}, {"block": "head_b", "inputs": ["trunk"]},
      {"join": "cat", "inputs": ["head_a", "head_b"], "combine": "concat:0"}]}]})",
                                "tasks.json");
  INFO(tasks.status());
  REQUIRE(tasks.ok());
  REQUIRE(tasks->size() == 1);
  CHECK((*tasks)[0].path.empty());
  REQUIRE((*tasks)[0].nodes.size() == 4);
  CHECK((*tasks)[0].nodes[3].combine.name() == "concat(dim=0)");
  auto in = input({block("trunk", 200), block("head_a", 100), block("head_b", 50)}, *tasks, {site("w1", 2)});
  const auto p = planned(in);
  CHECK(verdict(p, "e").admitted);
  CHECK_THAT(p.deployment_json(in), Contains("\"combine\": \"concat:0\""));

  auto parse_error = [](const std::string& text) { return std::string(parse_plan_tasks(text, "tasks.json").status().message()); };
  CHECK_THAT(parse_error(R"({"tasks": [{"name": "e", "rate_rps": 5, "slo_ms": 50, "path": ["a"], "nodes": [{"block": "a"}]}]})"),
             Contains("tasks.json: tasks[0]: give \"path\" (a chain) or \"nodes\" (a graph)"));
  CHECK_THAT(parse_error(R"({"tasks": [{"name": "e", "rate_rps": 5, "slo_ms": 50, "nodes": [{"block": "a"}, {"join": "j", "inputs": ["a", "b"], "combine": "mean"}]}]})"),
             Contains("tasks[0].nodes: task 'e': node 'j': unknown input 'b'"));

  auto bad = [](PlanTask t) {
    return std::string(plan(input({block("a", 10), block("b", 10)}, {std::move(t)}, {site("w1")})).status().message());
  };
  Path cycle("c");
  cycle.node("a", {"b"}).node("b", {"a"});
  CHECK_THAT(bad(PlanTask::graph(cycle, 1, 10)), Contains("task 'c': has a cycle"));
  Path two_ends("t");
  two_ends.node("a", {}).node("b", {});
  CHECK_THAT(bad(PlanTask::graph(two_ends, 1, 10)), Contains("task 't': must end in exactly one node; it ends in a, b"));
  Path custom("x");
  custom.node("a", {}).node("b", {}).join("j", {"a", "b"}, Combine::custom("sum", [](std::vector<Tensors>&& in) {
    return absl::StatusOr<Tensors>(std::move(in[0]));
  }));
  CHECK_THAT(bad(PlanTask::graph(custom, 1, 10)), Contains("task 'x': node 'j': combine rule 'sum' has no deployment form"));
  PlanTask both("both", {"a"}, 1, 10);
  both.nodes = two_ends.nodes();
  CHECK_THAT(bad(both), Contains("task 'both': give a path (a chain) or nodes (a graph), not both"));
}

TEST_CASE("sites of one host share its cores: a task the sites' lanes would hold is refused when the cores are spoken for",
          "[planner]") {
  auto one_thread = [](BlockProfile b) {
    b.intra_op_threads = 1;
    return b;
  };
  PlanInput in = input({one_thread(block("a", 100)), one_thread(block("b", 100)), one_thread(block("c", 100))},
                       {{"t1", {"a"}, 80, 1000}, {"t2", {"b"}, 80, 1000}, {"t3", {"c"}, 60, 1000}},
                       {site("w1"), site("w2"), site("w3")});
  in.hosts = {{"local", 2}};
  const Plan p = planned(in);
  CHECK(verdict(p, "t1").admitted);
  CHECK(verdict(p, "t2").admitted);
  CHECK_FALSE(verdict(p, "t3").admitted);  // w3's lane is free, but the host's 2 cores hold 1.6 already
  CHECK_THAT(verdict(p, "t3").reason, Contains("task 't3': needs 0.60 cores for 60.0 req/s; host 'local' has 2 cores, "
                                               "0.40 of them left"));
  REQUIRE(p.hosts.size() == 1);
  CHECK(p.hosts[0].host == "local");
  CHECK(p.hosts[0].cores_used == Approx(1.6));
  CHECK(p.hosts[0].utilisation == Approx(0.8));
  CHECK_THAT(p.report_json(), Contains("\"hosts\"") && Contains("\"cores_used\""));

  // Without the host's bound the three sites hold all three tasks.
  in.hosts.clear();
  CHECK(verdict(planned(in), "t3").admitted);

  // A block of 2 intra-op threads keeps 2 cores busy while its lane does.
  PlanInput wide = input({block("a", 100)}, {{"t1", {"a"}, 40, 1000}}, {site("w1")});
  wide.hosts = {{"local", 4}};
  const Plan w = planned(wide);
  REQUIRE(w.hosts.size() == 1);
  CHECK(w.hosts[0].cores_used == Approx(0.8));  // 0.4 of a lane x 2 threads

  // A site's wait for a lane sees its host's load when that is higher than its own.
  PlanInput shared = input({one_thread(block("a", 100)), one_thread(block("b", 100)), one_thread(block("c", 100))},
                           {{"t1", {"a"}, 50, 1000}, {"t2", {"b"}, 50, 1000}, {"t3", {"c"}, 50, 1000}},
                           {site("w1"), site("w2"), site("w3")});
  const double alone = verdict(planned(shared), "t1").predicted_p50_ms;
  shared.hosts = {{"local", 2}};  // 1.5 of 2 cores busy: 0.75 against each site's 0.5
  const double beside = verdict(planned(shared), "t1").predicted_p50_ms;
  CHECK(alone == Approx(10 + 0.5 / (2 * 0.5) * 10));
  CHECK(beside == Approx(10 + 0.75 / (2 * 0.25) * 10));

  shared.hosts = {{"local", 0}};
  CHECK_THAT(std::string(plan(shared).status().message()), Contains("host 'local': cores must be at least 1"));
  shared.hosts = {{"local", 2}, {"local", 2}};
  CHECK_THAT(std::string(plan(shared).status().message()), Contains("host 'local': named twice"));
}

TEST_CASE("a sites file's hosts: read with the sites, errors naming the file and the field", "[planner]") {
  auto hosts = parse_plan_hosts(R"({"sites": [], "hosts": [{"name": "local", "cores": 2}, {"name": "edge", "cores": 8}]})",
                                "sites.json");
  REQUIRE(hosts.ok());
  REQUIRE(hosts->size() == 2);
  CHECK((*hosts)[1].name == "edge");
  CHECK((*hosts)[1].cores == 8);
  CHECK(parse_plan_hosts(R"({"sites": []})", "sites.json")->empty());
  CHECK_THAT(std::string(parse_plan_hosts(R"({"hosts": [{"name": "local"}]})", "sites.json").status().message()),
             Contains("sites.json: hosts[0].cores"));
  auto sites = parse_plan_sites(R"({"sites": [{"name": "w", "kind": "worker", "lanes": 1, "host": "edge"},
                                              {"name": "m", "kind": "threads", "lanes": 1}]})",
                                "sites.json");
  REQUIRE(sites.ok());
  CHECK((*sites)[0].host == "edge");
  CHECK((*sites)[1].host == "local");
}

TEST_CASE("saturation: a block whose lanes serve its rate and no more, or a busy block on a site of many lanes, "
          "is predicted as it will run", "[planner]") {
  // At exactly one lane's rate the queue has no bound: refused, however loose the SLO (before: the
  // site counted as feasible and the wait was clamped to utilisation 0.95, predicting 105 ms).
  auto full = planned(input({block("A", 100)}, {{"t", {"A"}, 100, 1e6}}, {site("w1")}));
  CHECK_FALSE(verdict(full, "t").admitted);
  CHECK_THAT(verdict(full, "t").reason, Contains("predicted p50 unbounded"));
  // Just under it, the M/D/1 wait itself: 10 ms + 0.99 / (2 x 0.01) x 10 ms.
  auto nearly = planned(input({block("A", 100)}, {{"t", {"A"}, 99, 1e6}}, {site("w1")}));
  REQUIRE(verdict(nearly, "t").admitted);
  CHECK(verdict(nearly, "t").predicted_p50_ms == Approx(10 + 0.99 / 0.02 * 10));
  // A site of four lanes: the plan lets all four run A (0.225 of a lane each), and its wait is the
  // site's, four lanes at 0.225.
  auto wide_in = input({block("A", 100)}, {{"t", {"A"}, 90, 30}}, {site("w1", 4)});
  auto wide = planned(wide_in);
  REQUIRE(verdict(wide, "t").admitted);
  REQUIRE(wide.blocks.size() == 1);
  CHECK(wide.blocks[0].workers == 4);
  CHECK(verdict(wide, "t").predicted_p50_ms == Approx(10 + 0.225 / (2 * 0.775) * 10 / 4));
  // One lane of the four runs it (a deployment's workers 1): it waits at its own 0.9, not at the
  // site's 0.225 (before: predicted 10.4 ms).
  BlockPlacement one{"A", "w1", 1, 1};
  auto narrow = predict(wide_in, {one});
  REQUIRE(narrow.ok());
  CHECK_FALSE(verdict(*narrow, "t").admitted);
  CHECK(verdict(*narrow, "t").predicted_p50_ms == Approx(10 + 0.9 / 0.2 * 10));
  // Admission follows the rate: the prediction grows with it, at a tight SLO as at a loose one.
  double last = 0;
  bool refused = false;
  for (double rate = 10; rate < 400; rate += 7) {
    INFO(rate << " req/s");
    const Plan p = planned(input({block("A", 100)}, {{"t", {"A"}, rate, 15}}, {site("w1", 4)}));
    const TaskVerdict& v = verdict(p, "t");
    CHECK(v.predicted_p50_ms >= last);
    CHECK_FALSE((refused && v.admitted));  // once refused, no faster rate is admitted
    refused = refused || !v.admitted;
    last = v.predicted_p50_ms;
    if (rate < 250) CHECK(verdict(planned(input({block("A", 100)}, {{"t", {"A"}, rate, 100}}, {site("w1", 4)})), "t").admitted);
  }
  // A C++ factory's block may not be reentrant: one lane runs it (its share rounded up), and it
  // waits as a queue at 0.9.
  auto factory_in = wide_in;
  factory_in.profile.blocks[0].source = "scale";
  const Plan factory = planned(factory_in);
  CHECK_FALSE(verdict(factory, "t").admitted);
  CHECK(verdict(factory, "t").predicted_p50_ms == Approx(10 + 0.9 / 0.2 * 10));
  factory_in.tasks[0].rate_rps = 50;  // admitted (15 ms): one worker
  const Plan slower = planned(factory_in);
  REQUIRE(slower.blocks.size() == 1);
  CHECK(slower.blocks[0].workers == 1);
  CHECK(verdict(slower, "t").predicted_p50_ms == Approx(10 + 0.5 / 1.0 * 10));
  // A deployment's workers over its site's lanes cost nothing: the lanes cap them.
  BlockPlacement many{"A", "w1", 1, 8};
  auto capped = predict(wide_in, {many});
  REQUIRE(capped.ok());
  CHECK(verdict(*capped, "t").admitted);
}

TEST_CASE("a site's reserve that is not a number is refused", "[planner]") {
  PlanSite w1 = site("w1");
  w1.reserve = std::nan("");
  auto p = plan(input({block("A", 100)}, {{"t", {"A"}, 10, 100}}, {w1}));
  REQUIRE_FALSE(p.ok());
  CHECK_THAT(std::string(p.status().message()), Contains("site 'w1': reserve must be in 0..0.9"));
}

TEST_CASE("a profiled TorchScript file of any name is written as one in the deployment", "[planner]") {
  auto in = input({block("A", 100)}, {{"t", {"A"}, 10, 100}}, {site("w1")});
  in.profile.blocks[0].source = "/models/a.pth";  // blockflow-profile writes the file's absolute path
  const auto json = nlohmann::json::parse(planned(in).deployment_json(in));
  CHECK(json["blocks"][0]["torchscript"] == "/models/a.pth");  // before: "factory" (no ".pt" suffix)
  CHECK_FALSE(json["blocks"][0].contains("factory"));
}

TEST_CASE("a plan's deployment lists its tasks in the input's order, as Deployment::order reads them", "[planner]") {
  auto in = input({block("A", 100), block("B", 100)}, {{"zeta", {"A"}, 10, 100}, {"alpha", {"B"}, 10, 100}}, {site("w1")});
  auto d = Deployment::parse(planned(in).deployment_json(in), "/models");
  INFO(d.status().ToString());
  REQUIRE(d.ok());
  CHECK(d->order == std::vector<std::string>{"zeta", "alpha"});  // before: alpha, zeta (nlohmann sorts keys)
}
