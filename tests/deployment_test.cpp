// The deployment format: the reference's {"blocks": [names], "tasks": {task: [blocks]}}, richer
// per-block objects, and rejection of every malformed document with a message naming the fault.
#include "test_util.hpp"

#include <blockflow/deploy/deployment.hpp>
#include <blockflow/deploy/detail/deployment_json.hpp>
#include <blockflow/core/detail/cuda_graph_block.hpp>
#include <blockflow/core/names.hpp>
#include <blockflow/worker/worker_site.hpp>

#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

using namespace blockflow;
using Catch::Matchers::Contains;
using Catch::Matchers::Equals;

namespace {

std::string error_of(const std::string& json) {
  auto d = Deployment::parse(json, "/models");
  REQUIRE_FALSE(d.ok());
  CHECK(absl::IsInvalidArgument(d.status()));
  return std::string(d.status().message());
}

}  // namespace

TEST_CASE("the reference's deployment format is accepted as is", "[deployment]") {
  auto d = Deployment::parse(R"({"blocks": ["block1", "block2", "block3"],
                                 "tasks": {"task1": ["block1", "block2"], "task2": ["block1", "block3"]}})",
                             "/models");
  REQUIRE(d.ok());
  REQUIRE(d->blocks.size() == 3);
  CHECK(d->blocks[1].name == "block2");
  CHECK(d->blocks[1].torchscript == "/models/block2.pt");
  CHECK(d->blocks[1].placement.empty());
  REQUIRE(d->tasks.size() == 2);
  CHECK(d->tasks[0].first == "task1");
  CHECK(d->tasks[1].second == std::vector<std::string>{"block1", "block3"});
  CHECK(d->workers().empty());
  CHECK(d->paths().size() == 2);
}

TEST_CASE("rich block objects set file, factory, placement and options", "[deployment]") {
  auto d = Deployment::parse(R"({"blocks": [
      {"name": "b1", "torchscript": "one.pt", "placement": "w2", "intra_op_threads": 2, "workers": 3,
       "queue_capacity": 8, "full_policy": "drop-oldest", "device": "cpu", "input_shapes": [[-1, 3, 8, 8]],
       "warmup_runs": 0, "optimize_for_inference": false},
      {"name": "b2", "factory": "scale", "placement": "w1"},
      {"name": "b3", "torchscript": "/abs/three.pt"}],
    "tasks": {"t": ["b1", "b2", "b3"]}})",
                             "/models");
  INFO(d.status().ToString());
  REQUIRE(d.ok());
  const BlockDescription& b1 = d->blocks[0];
  CHECK(b1.torchscript == "/models/one.pt");
  CHECK(b1.placement == "w2");
  CHECK(b1.options.intra_op_threads == 2);
  CHECK(b1.options.workers == 3);
  CHECK(b1.options.queue_capacity == 8);
  CHECK(b1.options.full_policy == FullPolicy::kDropOldest);
  CHECK(b1.options.input_shapes == std::vector<std::vector<std::int64_t>>{{-1, 3, 8, 8}});
  CHECK(b1.options.warmup_runs == 0);
  CHECK(b1.torchscript_options.freeze);
  CHECK_FALSE(b1.torchscript_options.optimize_for_inference);
  CHECK(d->blocks[2].torchscript_options.optimize_for_inference);  // the default
  auto unfrozen = Deployment::parse(R"({"blocks": [{"name": "u", "torchscript": "u.pt", "freeze": false}],
                                        "tasks": {"t": ["u"]}})", "");
  REQUIRE(unfrozen.ok());
  CHECK_FALSE(unfrozen->blocks[0].torchscript_options.optimize_for_inference);  // implied by freeze false
  // A C++ description that only turns freezing off (optimize_for_inference keeps its default) still
  // crosses to a worker: the JSON never claims optimization for an unfrozen module.
  BlockDescription cpp;
  cpp.name = "c";
  cpp.torchscript = "c.pt";
  cpp.torchscript_options.freeze = false;
  auto shipped = blockflow::detail::block_from_json(blockflow::detail::block_to_json(cpp), "");
  INFO(shipped.status().ToString());
  REQUIRE(shipped.ok());
  CHECK_FALSE(shipped->torchscript_options.freeze);
  CHECK_FALSE(shipped->torchscript_options.optimize_for_inference);
  CHECK(d->blocks[1].factory == "scale");
  CHECK(d->blocks[1].torchscript.empty());
  // A factory's block crosses to a worker without TorchScript's settings (which its parse refuses).
  auto factory_shipped = blockflow::detail::block_from_json(blockflow::detail::block_to_json(d->blocks[1]), "");
  INFO(factory_shipped.status().ToString());
  REQUIRE(factory_shipped.ok());
  CHECK(factory_shipped->factory == "scale");
  CHECK(d->blocks[2].torchscript == "/abs/three.pt");
  CHECK(d->workers() == std::vector<std::string>{"w1", "w2"});
  // The worker protocol ships blocks in this shape: a description survives the trip.
  auto back = blockflow::detail::block_from_json(blockflow::detail::block_to_json(b1), "");
  REQUIRE(back.ok());
  CHECK(blockflow::detail::block_to_json(*back) == blockflow::detail::block_to_json(b1));
}

TEST_CASE("malformed deployments are rejected whole, naming the fault", "[deployment]") {
  CHECK_THAT(error_of("{"), Equals("deployment: not valid JSON"));
  CHECK_THAT(error_of("[]"), Contains("expected an object"));
  CHECK_THAT(error_of(R"({"blocks": [], "tasks": {}, "extra": 1})"), Contains("unknown field 'extra'"));
  CHECK_THAT(error_of(R"({"tasks": {}})"), Contains("\"blocks\" must be an array"));
  CHECK_THAT(error_of(R"({"blocks": []})"), Contains("\"tasks\" must be an object"));
  CHECK_THAT(error_of(R"({"blocks": [""], "tasks": {}})"), Contains("block name '' is empty"));
  CHECK_THAT(error_of(R"({"blocks": [3], "tasks": {}})"), Contains("a block is a name or an object, not 3"));
  // A value quoted in an error is cut short: a request cannot make its error reply as large as itself.
  const std::string unnamed = error_of(R"({"blocks": [{"torchscript": ")" + std::string(100000, 'x') + R"("}], "tasks": {}})");
  CHECK_THAT(unnamed, Contains("block {\"torchscript\":\"xxx") && Contains("...: needs a non-empty string \"name\""));
  CHECK(unnamed.size() < 200);
  const std::string key = error_of(R"({"blocks": [{"name": "b", "factory": "f", ")" + std::string(100000, 'k') + R"(\n": 1}], "tasks": {}})");
  CHECK_THAT(key, Contains("block 'b': unknown field 'kkk"));
  CHECK(key.size() < 200);
  CHECK_THAT(error_of(R"({"blocks": [{"torchscript": "x.pt"}], "tasks": {}})"), Contains("needs a non-empty string \"name\""));
  CHECK_THAT(error_of(R"({"blocks": [{"name": "b", "torchscript": "x.pt", "colour": "red"}], "tasks": {}})"),
             Contains("block 'b': unknown field 'colour'"));
  // Each field named; numbers never wrapped or truncated into range (-1 is not SIZE_MAX, 2^32 + 1
  // not 1, 1.9 and true not 1, 2^64 - 1 not -1).
  const std::pair<const char*, const char*> faults[] = {
      {R"("workers": "two")", "field 'workers': expected a whole number"},
      {R"("device": 5)", "field 'device': wrong type"},
      {R"("queue_capacity": -1)", "field 'queue_capacity': expected a whole number from 0 to 18446744073709551615"},
      {R"("workers": 4294967297)", "field 'workers': expected a whole number from -2147483648 to 2147483647"},
      {R"("workers": true)", "field 'workers': expected a whole number"},
      {R"("max_batch": 1.9)", "field 'max_batch': expected a whole number"},
      {R"("memory_bytes": 1e19)", "field 'memory_bytes': expected a whole number"},
      {R"("input_shapes": [[1, 18446744073709551615]])", "field 'input_shapes': expected an array of shapes"},
      {R"("max_batch_delay_ms": "soon")", "field 'max_batch_delay_ms': expected a number"},
  };
  for (const auto& [field, expected] : faults) {
    const std::string json = std::string(R"({"blocks": [{"name": "b", "factory": "f", )") + field + R"(}], "tasks": {}})";
    CHECK_THAT(error_of(json), Contains(std::string("block 'b': ") + expected));
  }
  CHECK_THAT(error_of(R"({"blocks": [{"name": "b"}], "tasks": {}})"), Contains("block 'b': give exactly one of"));
  CHECK_THAT(error_of(R"({"blocks": [{"name": "b", "torchscript": "x.pt", "factory": "f"}], "tasks": {}})"),
             Contains("block 'b': give exactly one of"));
  CHECK_THAT(error_of(R"({"blocks": [{"name": "b", "factory": "f", "full_policy": "panic"}], "tasks": {}})"),
             Contains("block 'b': unknown full_policy 'panic'"));
  CHECK_THAT(error_of(R"({"blocks": [{"name": "b", "factory": "f", "workers": 0}], "tasks": {}})"),
             Contains("block 'b': workers must be >= 1"));
  // Within what the process can do: no OpenMP team of a million threads, no deadline past int64.
  CHECK_THAT(error_of(R"({"blocks": [{"name": "b", "factory": "f", "intra_op_threads": 1000000}], "tasks": {}})"),
             Contains("block 'b': intra_op_threads must be from 0 to 1024"));
  CHECK_THAT(error_of(R"({"blocks": [{"name": "b", "factory": "f", "input_shapes": [[-2, 3]]}], "tasks": {}})"),
             Contains("block 'b': input_shapes[0] has dimension -2"));
  CHECK_THAT(error_of(R"({"blocks": [{"name": "b", "factory": "f", "max_batch": 8, "max_batch_delay_ms": 1e300}], "tasks": {}})"),
             Contains("block 'b': max_batch_delay_ms must be from 0 to 60000"));
  CHECK_THAT(error_of(R"({"blocks": [{"name": "b", "torchscript": "x.pt", "freeze": false, "optimize_for_inference": true}],
                       "tasks": {}})"),
             Contains("block 'b': optimize_for_inference needs \"freeze\": true"));
  // A C++ block has no module to freeze: TorchScript's settings on it are refused, not ignored.
  for (const char* key : {"freeze", "optimize_for_inference"}) {
    CHECK_THAT(error_of(std::string(R"({"blocks": [{"name": "b", "factory": "f", ")") + key + R"(": false}], "tasks": {}})"),
               Contains(std::string("block 'b': field '") + key + "' applies to TorchScript blocks only (this block is made by factory 'f')"));
  }
  CHECK_THAT(error_of(R"({"blocks": ["a", "a"], "tasks": {}})"), Contains("block 'a' appears twice"));
  CHECK_THAT(error_of(R"({"blocks": ["a"], "tasks": {"t": []}})"), Contains("task 't' must be a non-empty list"));
  CHECK_THAT(error_of(R"({"blocks": ["a"], "tasks": {"t": ["a", "nope"]}})"), Contains("task 't': unknown block 'nope'"));
  CHECK_THAT(error_of(R"({"blocks": ["a", "b"], "tasks": {"t": ["a", "b", "a"]}})"),
             Contains("task 't': has a cycle: block 'a' appears twice"));
  CHECK_THAT(error_of(R"({"blocks": ["a"], "tasks": {"t": [1]}})"), Contains("task 't': 1 is not a block name"));
  CHECK(absl::IsNotFound(load_deployment("/nonexistent/deploy.json").status()));
}

TEST_CASE("a deployment's tasks come in the file's order, chains and graphs together", "[deployment]") {
  auto d = Deployment::parse(R"({"blocks": ["a", "b"], "tasks": {"zeta": ["a"], "alpha": {"nodes": [{"block": "b"}]},
                                                                 "mid": ["b", "a"]}})");
  INFO(d.status().ToString());
  REQUIRE(d.ok());
  REQUIRE(d->tasks.size() == 2);
  CHECK(d->tasks[0].first == "zeta");  // before: sorted by name (alpha, mid, zeta), chains before graphs
  CHECK(d->tasks[1].first == "mid");
  std::vector<std::string> order;
  for (const auto& path : d->paths()) order.push_back(path.task());
  CHECK(order == std::vector<std::string>{"zeta", "alpha", "mid"});
}

TEST_CASE("a task given as a graph: nodes, inputs, joins and combine rules; its faults named", "[deployment]") {
  auto d = Deployment::parse(R"({"blocks": ["trunk", "ha", "hb"],
      "tasks": {"chain": ["trunk", "ha"],
                "ensemble": {"nodes": [{"join": "avg", "inputs": ["ha", "hb"], "combine": "mean"},
                                       {"block": "trunk"},
                                       {"block": "ha", "inputs": ["trunk"]},
                                       {"block": "hb", "inputs": ["trunk"], "combine": "pack"}]}}})", "/m");
  INFO(d.status().ToString());
  REQUIRE(d.ok());
  REQUIRE(d->tasks.size() == 1);
  REQUIRE(d->graphs.size() == 1);
  const auto paths = d->paths();
  REQUIRE(paths.size() == 2);
  CHECK(paths[0].task() == "chain");
  const Path& e = paths[1];
  CHECK(e.task() == "ensemble");
  REQUIRE(e.nodes().size() == 4);
  CHECK(e.nodes()[0].name == "avg");
  CHECK(e.nodes()[0].block.empty());
  CHECK(e.nodes()[0].combine.name() == "mean");
  CHECK(e.nodes()[0].inputs == std::vector<std::string>{"ha", "hb"});
  CHECK(e.nodes()[1].block == "trunk");
  CHECK(e.nodes()[1].inputs.empty());
  CHECK(e.nodes()[3].combine.name() == "pack");
  auto concat = Deployment::parse(R"({"blocks": ["a", "b"], "tasks": {"t": {"nodes": [{"block": "a"}, {"block": "b"},
      {"join": "j", "inputs": ["a", "b"], "combine": "concat:0"}]}}})");
  REQUIRE(concat.ok());
  CHECK(concat->graphs.at(0).nodes().at(2).combine.name() == "concat(dim=0)");

  const std::string blocks = R"({"blocks": ["a", "b"], "tasks": {"t": )";
  auto graph_error = [&](const std::string& task) { return error_of(blocks + task + "}}"); };
  CHECK_THAT(graph_error(R"({"nodes": []})"), Contains("task 't': \"nodes\" must be a non-empty array"));
  CHECK_THAT(graph_error(R"({"nodes": [{"block": "a"}], "colour": 1})"), Contains("task 't': unknown field 'colour'"));
  CHECK_THAT(graph_error(R"({"nodes": [{"block": "nope"}]})"), Contains("task 't': unknown block 'nope'"));
  CHECK_THAT(graph_error(R"({"nodes": [{"inputs": []}]})"), Contains("needs \"block\" or \"join\""));
  CHECK_THAT(graph_error(R"({"nodes": [{"block": "a", "join": "j"}]})"), Contains("needs \"block\" or \"join\""));
  CHECK_THAT(graph_error(R"({"nodes": [{"block": "a"}, {"block": "a"}]})"), Contains("task 't': node 'a' appears twice"));
  CHECK_THAT(graph_error(R"({"nodes": [{"block": "a"}, {"block": "b", "inputs": ["c"]}]})"),
             Contains("task 't': node 'b': unknown input 'c'"));
  CHECK_THAT(graph_error(R"({"nodes": [{"block": "a"}, {"block": "b"}, {"join": "j", "inputs": ["a", "b"]}]})"),
             Contains("join 'j' needs \"combine\""));
  CHECK_THAT(graph_error(R"({"nodes": [{"block": "a"}, {"join": "j", "inputs": ["a"], "combine": "mean"}]})"),
             Contains("join 'j' needs at least two inputs"));
  CHECK_THAT(graph_error(R"({"nodes": [{"block": "a"}, {"block": "b"}, {"join": "j", "inputs": ["a", "b"], "combine": "max"}]})"),
             Contains("node 'j': unknown combine rule 'max' (pack, mean, concat, concat:DIM)"));
  CHECK_THAT(graph_error(R"({"nodes": [{"block": "a", "weight": 2}]})"), Contains("unknown node field 'weight'"));
  CHECK_THAT(graph_error(R"("a")"), Contains("task 't' must be a non-empty list of block names, or a graph"));
}

TEST_CASE("names of blocks, tasks and placements follow one rule: never a path, never an option", "[deployment]") {
  CHECK_THAT(error_of(R"({"blocks": [{"name": "a/b", "factory": "f"}], "tasks": {"t": ["a/b"]}})"),
             Contains("block name 'a/b' holds a character outside the set"));
  CHECK_THAT(error_of(R"({"blocks": [".."], "tasks": {"t": [".."]}})"), Contains("block name '..' starts with . or -"));
  CHECK_THAT(error_of(R"({"blocks": [{"name": "a", "factory": "f", "placement": "w1\n"}], "tasks": {"t": ["a"]}})"),
             Contains("block 'a': placement name 'w1\\n' holds a character outside the set"));
  CHECK_THAT(error_of(R"({"blocks": [{"name": "a", "factory": "f", "placement": " "}], "tasks": {"t": ["a"]}})"),
             Contains("placement name ' '"));
  CHECK_THAT(error_of(R"({"blocks": [{"name": "a", "factory": "f", "placement": "../../x"}], "tasks": {"t": ["a"]}})"),
             Contains("placement name '../../x' starts with . or -"));
  CHECK_THAT(error_of(R"({"blocks": [{"name": "a", "factory": "f"}], "tasks": {"-t": ["a"]}})"),
             Contains("task name '-t' starts with . or -"));
  CHECK_THAT(error_of(R"({"blocks": [{"name": ")" + std::string(65, 'x') + R"(", "factory": "f"}], "tasks": {}})"),
             Contains("is too long"));
  CHECK(check_name("worker", "w-1.gpu_0").ok());
  // The session's own process goes by "threads" and "host" in metrics: no worker takes them.
  CHECK_THAT(error_of(R"({"blocks": [{"name": "a", "factory": "f", "placement": "host"}], "tasks": {"t": ["a"]}})"),
             Contains("block 'a': placement name 'host' is reserved"));
  CHECK_THAT(error_of(R"({"blocks": [{"name": "a", "factory": "f", "placement": "threads"}], "tasks": {"t": ["a"]}})"),
             Contains("placement name 'threads' is reserved"));
  WorkerOptions host;
  host.name = "host";
  CHECK_THROWS_WITH(WorkerSite(host), Contains("worker name 'host' is reserved"));
  WorkerOptions slash;
  slash.name = "w/1";
  CHECK_THROWS_WITH(WorkerSite(slash), Contains("worker name 'w/1'"));
}

TEST_CASE("confined to the models directory: no path leads out, and the error does not say what exists", "[deployment]") {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / fmt::format("bf-models-{}", ::getpid());
  test::remove_tree(root.string());
  fs::create_directories(root / "sub");
  std::ofstream(root / "sub" / "m.pt") << "x";
  fs::create_symlink("/etc", root / "out");
  auto confined = [&](const std::string& file) {
    return Deployment::parse(R"({"blocks": [{"name": "a", "torchscript": ")" + file + R"("}], "tasks": {"t": ["a"]}})",
                             root.string(), /*confine_to_models_dir=*/true);
  };
  auto inside = confined("sub/m.pt");
  INFO(inside.status().ToString());
  REQUIRE(inside.ok());
  CHECK(inside->blocks[0].torchscript == (root / "sub" / "m.pt").string());
  CHECK(confined((root / "sub" / "m.pt").string()).ok());  // absolute, but inside
  for (const std::string file : {"../etc/passwd", "/etc/passwd", "/etc/no-such-file", "out/passwd", "sub/../../x.pt",
                                 "nope/../out/passwd", "sub/../sub/m.pt"}) {
    auto refused = confined(file);
    INFO(file);
    REQUIRE_FALSE(refused.ok());
    CHECK(std::string(refused.status().message()) ==
          "deployment: block 'a': TorchScript path '" + file + "' is not inside the models directory");
  }
  CHECK(Deployment::parse(R"({"blocks": [{"name": "a", "torchscript": "/etc/passwd"}], "tasks": {"t": ["a"]}})", root.string())
            .ok());  // the application's own deployments are not confined unless asked
  // A bare block name stands for NAME.pt in the directory, which may be a link out of it.
  fs::create_symlink("/etc/passwd", root / "ln.pt");
  std::ofstream(root / "plain.pt") << "x";
  auto bare = [&](const std::string& name) {
    return Deployment::parse(R"({"blocks": [")" + name + R"("], "tasks": {"t": [")" + name + R"("]}})", root.string(), true);
  };
  auto linked = bare("ln");
  REQUIRE_FALSE(linked.ok());
  CHECK_THAT(std::string(linked.status().message()), Contains("block 'ln': TorchScript path 'ln.pt' is not inside"));
  auto plain = bare("plain");
  REQUIRE(plain.ok());
  CHECK(plain->blocks[0].torchscript == (root / "plain.pt").string());
  test::remove_tree(root.string());
}

TEST_CASE("confined: a deployment from the wire may not ask for warm-ups beyond its bounds", "[deployment]") {
  auto confined = [](const std::string& options) {
    return Deployment::parse(R"({"blocks": [{"name": "a", "factory": "f", )" + options + R"(}], "tasks": {"t": ["a"]}})",
                             ".", /*confine_to_models_dir=*/true);
  };
  CHECK(confined(R"("input_shapes": [[1, 3, 224, 224]], "warmup_runs": 3)").ok());
  auto huge = confined(R"("input_shapes": [[200000, 100000]])");
  REQUIRE_FALSE(huge.ok());
  CHECK_THAT(std::string(huge.status().message()),
             Contains("block 'a': input_shapes[0] is beyond what a deployment from the wire may warm up"));
  CHECK_FALSE(confined(R"("input_shapes": [[1, 1, 1, 1, 1, 1, 1, 1, 1]])").ok());  // 9 dimensions
  auto runs = confined(R"("warmup_runs": 2147483647)");
  REQUIRE_FALSE(runs.ok());
  CHECK_THAT(std::string(runs.status().message()), Contains("warmup_runs 2147483647 is above 16"));
  // Everywhere: a count of elements beyond 64 bits.
  auto wide = Deployment::parse(
      R"({"blocks": [{"name": "a", "factory": "f", "input_shapes": [[4611686018427387904, 4]]}], "tasks": {"t": ["a"]}})");
  REQUIRE_FALSE(wide.ok());
  CHECK_THAT(std::string(wide.status().message()), Contains("more elements than 64 bits count"));
  CHECK(Deployment::parse(R"({"blocks": [{"name": "a", "factory": "f", "input_shapes": [[200000, 100000]]}], "tasks": {"t": ["a"]}})")
            .ok());  // the application's own: its choice
  // The bound is on bytes: 2^28 elements are 1 GiB of float32 but 2 GiB of int64.
  CHECK(confined(R"("input_shapes": [[268435456]])").ok());
  CHECK(confined(R"("input_shapes": [[134217728]], "input_dtypes": ["int64"])").ok());
  auto wide_ids = confined(R"("input_shapes": [[268435456]], "input_dtypes": ["int64"])");
  REQUIRE_FALSE(wide_ids.ok());
  CHECK_THAT(std::string(wide_ids.status().message()), Contains("1073741824 bytes at most"));
}

TEST_CASE("input_dtypes: parsed by name, shipped to workers, refused naming the entry", "[deployment]") {
  auto d = Deployment::parse(R"({"blocks": [{"name": "embed", "factory": "f", "input_shapes": [[-1, 16], [-1]],
                                             "input_dtypes": ["int64", "bool"]}], "tasks": {"t": ["embed"]}})");
  INFO(d.status().ToString());
  REQUIRE(d.ok());
  CHECK(d->blocks[0].options.input_dtypes == std::vector<at::ScalarType>{at::kLong, at::kBool});
  const auto json = blockflow::detail::block_to_json(d->blocks[0]);
  CHECK(json.at("input_dtypes") == nlohmann::json::array({"int64", "bool"}));
  auto back = blockflow::detail::block_from_json(json, "");
  REQUIRE(back.ok());
  CHECK(back->options.input_dtypes == d->blocks[0].options.input_dtypes);
  CHECK_FALSE(blockflow::detail::block_to_json(BlockDescription{}).contains("input_dtypes"));  // none: float32
  CHECK_THAT(error_of(R"({"blocks": [{"name": "b", "factory": "f", "input_shapes": [[1]], "input_dtypes": ["int63"]}],
                       "tasks": {}})"),
             Contains("block 'b': field 'input_dtypes': entry 0 is \"int63\", not a dtype (float32, float64"));
  CHECK_THAT(error_of(R"({"blocks": [{"name": "b", "factory": "f", "input_shapes": [[1]], "input_dtypes": "int64"}],
                       "tasks": {}})"),
             Contains("block 'b': field 'input_dtypes': expected an array of dtype names"));
  CHECK_THAT(error_of(R"({"blocks": [{"name": "b", "factory": "f", "input_shapes": [[1]], "input_dtypes": ["int64", "int64"]}],
                       "tasks": {}})"),
             Contains("block 'b': input_dtypes has 2 entries for 1 input_shapes"));
  CHECK_THAT(error_of(R"({"blocks": [{"name": "b", "factory": "f", "input_dtypes": ["int64"]}], "tasks": {}})"),
             Contains("block 'b': input_dtypes has 1 entries for 0 input_shapes"));
  BlockOptions complex;
  complex.input_shapes = {{1}};
  complex.input_dtypes = {at::kComplexFloat};
  CHECK_THAT(std::string(validate("c", complex).message()),
             Contains("block 'c': input_dtypes[0] is ComplexFloat, which channels do not carry"));
}

TEST_CASE("a malformed concat rule is an error naming it, never an exception", "[deployment]") {
  for (const std::string rule : {"concat:-", "concat:---", "concat:1-2", "concat:", "concat:x"}) {
    INFO(rule);
    absl::StatusOr<Deployment> d = absl::InternalError("not parsed");
    REQUIRE_NOTHROW(d = Deployment::parse(
                        R"({"blocks": ["a"], "tasks": {"t": {"nodes": [{"block": "a", "combine": ")" + rule + R"("}]}}})"));
    REQUIRE_FALSE(d.ok());
    CHECK_THAT(std::string(d.status().message()), Contains("unknown combine rule '" + rule + "'"));
  }
}

TEST_CASE("JSON nested deeper than the limit is refused before it is parsed", "[deployment]") {
  const std::string deep = std::string(75000, '[') + std::string(75000, ']');
  auto d = Deployment::parse(deep);
  REQUIRE_FALSE(d.ok());
  CHECK_THAT(std::string(d.status().message()), Contains("JSON nests deeper than 64 levels"));
  CHECK(blockflow::detail::check_json_depth(R"({"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["})").ok());
  CHECK(blockflow::detail::check_json_depth(std::string(64, '{')).ok());
  CHECK_FALSE(blockflow::detail::check_json_depth(std::string(65, '{')).ok());
}

TEST_CASE("sites' settings: memory budget, policy and measure, lanes; read for the sites blocks are placed in", "[deployment]") {
  const std::string blocks = R"("blocks": [{"name": "a", "factory": "f", "placement": "w1"}, {"name": "b", "factory": "f", "placement": "w2"}],
                                 "tasks": {"t": ["a", "b"]})";
  auto d = Deployment::parse(fmt::format(R"({{{}, "sites": {{"w1": {{"memory": {{"budget": 1048576, "policy": "on_demand", "measure": "process"}}, "lanes": 2}}}}}})", blocks));
  REQUIRE(d.ok());
  REQUIRE(d->sites.size() == 1);
  const SiteSettings w1 = d->site("w1");
  CHECK(w1.name == "w1");
  CHECK(w1.memory_budget == 1048576);
  CHECK(w1.memory_policy == "on_demand");
  CHECK(w1.memory_measure == "process");
  CHECK(w1.lanes == 2);
  const SiteSettings w2 = d->site("w2");  // none given: the defaults
  CHECK(w2.name == "w2");
  CHECK(w2.memory_budget == 0);
  CHECK(w2.memory_policy.empty());
  CHECK(w2.memory_measure.empty());
  CHECK(w2.lanes == 0);
  const auto with_sites = [&](const std::string& sites) { return error_of(fmt::format(R"({{{}, "sites": {}}})", blocks, sites)); };
  CHECK_THAT(with_sites(R"({"w9": {}})"), Contains("site 'w9': no block is placed in it"));
  CHECK_THAT(with_sites(R"({"w1": {"memory": {"policy": "on_demand"}}})"), Contains("site 'w1': memory.policy \"on_demand\" needs memory.budget above 0"));
  CHECK_THAT(with_sites(R"({"w1": {"memory": {"budget": -1}}})"), Contains("site 'w1': memory.budget must be a number of bytes"));
  CHECK_THAT(with_sites(R"({"w1": {"memory": {"policy": "lru"}}})"), Contains("memory.policy must be \"admit\" or \"on_demand\""));
  CHECK_THAT(with_sites(R"({"w1": {"memory": {"size": 1}}})"), Contains("unknown field 'memory.size' (budget, policy, measure)"));
  CHECK_THAT(with_sites(R"({"w1": {"memory": {"measure": "rss"}}})"), Contains("memory.measure must be \"blocks\" or \"process\""));
  CHECK_THAT(with_sites(R"({"w1": {"memory": {"budget": 1048576, "measure": "process"}}})"),
             Contains("memory.measure applies to memory.policy \"on_demand\" only"));
  CHECK_THAT(with_sites(R"({"w1": {"threads": 1}})"), Contains("site 'w1': unknown field 'threads' (memory, lanes)"));
  CHECK_THAT(with_sites(R"({"w1": {"lanes": "two"}})"), Contains("\"lanes\" must be an integer"));
  CHECK_THAT(with_sites(R"(["w1"])"), Contains("\"sites\" must be an object"));
}

TEST_CASE("cuda_graph: parsed and carried to workers; refused on a CPU device, without shapes, without CUDA", "[deployment]") {
  auto d = Deployment::parse(R"({"blocks": [{"name": "b", "torchscript": "x.pt", "device": "cuda:0", "cuda_graph": true,
                                              "input_shapes": [[1, 3]]}], "tasks": {"t": ["b"]}})",
                             "/models");
  INFO(d.status().ToString());
  REQUIRE(d.ok());
  CHECK(d->blocks.at(0).options.cuda_graph);
  CHECK(blockflow::detail::block_to_json(d->blocks.at(0)).at("cuda_graph") == true);  // what a worker's configuration carries
  auto plain = Deployment::parse(R"({"blocks": [{"name": "c", "torchscript": "x.pt"}], "tasks": {"t": ["c"]}})", "/models");
  REQUIRE(plain.ok());
  CHECK_FALSE(plain->blocks.at(0).options.cuda_graph);
  CHECK_THAT(error_of(R"({"blocks": [{"name": "b", "torchscript": "x.pt", "cuda_graph": true, "input_shapes": [[1]]}],
                       "tasks": {}})"),
             Contains("block 'b': cuda_graph needs a CUDA device (device is 'cpu')"));
  CHECK_THAT(error_of(R"({"blocks": [{"name": "b", "torchscript": "x.pt", "device": "cuda", "cuda_graph": true}], "tasks": {}})"),
             Contains("block 'b': cuda_graph needs input_shapes"));
  // This build (CI's): a libtorch without CUDA refuses the option by name, before loading anything.
  if (!blockflow::detail::cuda_graphs_available().ok()) {
    auto block = make_block(d->blocks.at(0));
    REQUIRE_FALSE(block.ok());
    CHECK(absl::IsUnimplemented(block.status()));
    CHECK_THAT(std::string(block.status().message()), Contains("block 'b': cuda_graph needs a libtorch with CUDA"));
    BlockOptions options;
    options.device = "cuda:0";
    options.cuda_graph = true;
    options.input_shapes = {{4}};
    Session session;
    CHECK_THROWS_WITH(session.add_block(Block::callable(
                          "g", [](Tensors&& in) -> absl::StatusOr<Tensors> { return std::move(in); }, options)),
                      Contains("block 'g': cuda_graph needs a libtorch with CUDA"));
  }
}

TEST_CASE("a deployment from the wire warms a block up within one bound for all its input shapes together",
          "[deployment]") {
  std::string shapes;
  for (int i = 0; i < 4; ++i) shapes += std::string(i > 0 ? "," : "") + "[8192, 8192]";  // 2^26 elements each
  const std::string within = R"({"blocks": [{"name": "a", "factory": "f", "input_shapes": [)" + shapes + R"(]}], "tasks": {"t": ["a"]}})";
  CHECK(Deployment::parse(within, "/models", /*confine_to_models_dir=*/true).ok());
  const std::string over = R"({"blocks": [{"name": "a", "factory": "f", "input_shapes": [)" + shapes + R"(, [1, 1]]}], "tasks": {"t": ["a"]}})";
  auto refused = Deployment::parse(over, "/models", /*confine_to_models_dir=*/true);
  REQUIRE_FALSE(refused.ok());
  CHECK_THAT(std::string(refused.status().message()),
             Contains("block 'a': input_shapes[4] is beyond what a deployment from the wire may warm up") &&
                 Contains("all its shapes together"));
  CHECK(Deployment::parse(over, "/models").ok());  // a deployment of the application's own: not bounded
}
