// Fan-out / fan-in paths against a sequential reference computed by hand.
#include "test_util.hpp"

using namespace blockflow;
using Catch::Matchers::Contains;

namespace {

// The trunk and the two heads of the small CNN, run directly (the sequential reference).
struct Reference {
  std::shared_ptr<Block> b1 = test::load_block("b1", "cnn_block1.pt");
  std::shared_ptr<Block> b2 = test::load_block("b2", "cnn_block2.pt");
  std::shared_ptr<Block> ha = test::load_block("head_a", "head_a.pt");
  std::shared_ptr<Block> hb = test::load_block("head_b", "head_b.pt");

  Tensor run(Block& block, const Tensor& x) { return block.forward(Tensors{x}).value().at(0); }
  Tensor trunk(const Tensor& x) { return run(*b2, run(*b1, x)); }
};

}  // namespace

TEST_CASE("an ensemble (fan-out to two heads, mean fan-in) equals the sequential reference", "[dag]") {
  Reference ref;
  Session session;
  session.add_block(ref.b1).add_block(ref.b2).add_block(ref.ha).add_block(ref.hb);
  session.add_path(Path("ensemble")
                       .then("b1")
                       .then("b2")
                       .node("head_a", {"b2"})
                       .node("head_b", {"b2"})
                       .join("avg", {"head_a", "head_b"}, Combine::mean()));
  session.add_path(Path("both")
                       .then("b1")
                       .then("b2")
                       .node("head_a", {"b2"})
                       .node("head_b", {"b2"})
                       .join("cat", {"head_b", "head_a"}, Combine::concat(1)));
  test::require_started(session);
  c10::InferenceMode guard;
  at::manual_seed(3);
  for (int i = 0; i < 4; ++i) {
    const Tensor x = at::randn({1, 3, 16, 16});
    const Tensor t = ref.trunk(x);
    const Tensor a = ref.run(*ref.ha, t), b = ref.run(*ref.hb, t);
    Result mean = session.submit("ensemble", x).get();
    REQUIRE(mean.ok());
    CHECK((mean.output() - (a + b) / 2).abs().max().item<double>() <= 1e-6);
    Result cat = session.submit("both", x).get();
    REQUIRE(cat.ok());
    CHECK(cat.output().sizes() == c10::IntArrayRef({1, 10}));
    CHECK((cat.output() - at::cat({b, a}, 1)).abs().max().item<double>() <= 1e-6);
    // The critical path ends at the join and starts at the trunk.
    REQUIRE(mean.trace.hops.size() == 4);
    CHECK(mean.trace.hops.front().block == "b1");
    CHECK(mean.trace.hops.back().node == "avg");
  }
}

TEST_CASE("a graph task from a deployment: apply() adds it, it equals the reference, and replaces it", "[dag]") {
  Reference ref;
  Session session;
  session.add_block(ref.b1).add_block(ref.b2).add_block(ref.ha).add_block(ref.hb);
  session.add_path(Path::chain("trunk", {"b1", "b2"}));
  test::require_started(session);
  auto d = Deployment::parse(R"({"blocks": ["b1", "b2", "head_a", "head_b"],
      "tasks": {"trunk": ["b1", "b2"],
                "ensemble": {"nodes": [{"block": "b1"}, {"block": "b2", "inputs": ["b1"]},
                                       {"block": "head_a", "inputs": ["b2"]}, {"block": "head_b", "inputs": ["b2"]},
                                       {"join": "avg", "inputs": ["head_a", "head_b"], "combine": "mean"}]}}})");
  INFO(d.status().ToString());
  REQUIRE(d.ok());
  auto v = session.apply(*d);
  INFO(v.status().ToString());
  REQUIRE(v.ok());
  c10::InferenceMode guard;
  at::manual_seed(5);
  const Tensor x = at::randn({1, 3, 16, 16});
  const Tensor t = ref.trunk(x);
  Result mean = session.submit("ensemble", x).get();
  REQUIRE(mean.ok());
  CHECK((mean.output() - (ref.run(*ref.ha, t) + ref.run(*ref.hb, t)) / 2).abs().max().item<double>() <= 1e-6);
  // An update that leaves the graph task out removes it, as for a chain (a deployment can bring it back).
  auto chain_only = Deployment::parse(R"({"blocks": ["b1", "b2"], "tasks": {"trunk": ["b1", "b2"]}})");
  REQUIRE(chain_only.ok());
  auto v2 = session.apply(*chain_only);
  INFO(v2.status().ToString());
  REQUIRE(v2.ok());
  CHECK_FALSE(session.submit("ensemble", x).get().ok());
  CHECK(session.submit("trunk", x).get().ok());
}

TEST_CASE("a custom combine rule and a block with two inputs (pack)", "[dag]") {
  Session session;
  session.add_block(test::unary("x2", [](const Tensor& x) { return x * 2; }))
      .add_block(test::unary("x3", [](const Tensor& x) { return x * 3; }))
      .add_block(Block::callable("sub", [](Tensors&& in) -> absl::StatusOr<Tensors> {
        return Tensors{in.at(0) - in.at(1)};
      }))
      .add_path(Path("packed").node("x2", {}).node("x3", {}).node("sub", {"x3", "x2"}))
      .add_path(Path("custom").node("x2", {}).node("x3", {}).join(
          "max", {"x2", "x3"}, Combine::custom("max", [](std::vector<Tensors>&& in) -> absl::StatusOr<Tensors> {
            return Tensors{at::maximum(in.at(0).at(0), in.at(1).at(0))};
          })));
  test::require_started(session);
  const Tensor x = at::tensor({1.0, -1.0});
  CHECK(at::equal(session.submit("packed", x).get().output(), x * 3 - x * 2));
  CHECK(at::equal(session.submit("custom", x).get().output(), at::tensor({3.0, -2.0})));
}

TEST_CASE("a fan-in with mismatched shapes fails naming the path and the join", "[dag]") {
  Session session;
  session.add_block(test::unary("same", [](const Tensor& x) { return x; }))
      .add_block(test::unary("wider", [](const Tensor& x) { return at::cat({x, x}); }))
      .add_path(Path("bad").node("same", {}).node("wider", {}).join("avg", {"same", "wider"}, Combine::mean()));
  test::require_started(session);
  Result r = session.submit("bad", at::ones({2})).get();
  CHECK(absl::IsInvalidArgument(r.status));
  CHECK_THAT(std::string(r.status.message()), Contains("path 'bad'") && Contains("join 'avg'") && Contains("shapes differ"));
}

TEST_CASE("a combine rule that throws something other than a std::exception fails its request, named", "[dag]") {
  Session session;
  session.add_block(test::unary("same", [](const Tensor& x) { return x; }))
      .add_block(test::unary("twice", [](const Tensor& x) { return x * 2; }))
      .add_path(Path("odd").node("same", {}).node("twice", {}).join(
          "throws", {"same", "twice"}, Combine::custom("throws", [](std::vector<Tensors>&&) -> absl::StatusOr<Tensors> {
            throw 42;
          })));
  test::require_started(session);
  Result r = session.submit("odd", at::ones({2})).get();
  CHECK(absl::IsInternal(r.status));
  CHECK_THAT(std::string(r.status.message()),
             Contains("path 'odd', join 'throws'") && Contains("combine rule 'throws' raised: an exception of unknown type"));
  CHECK(session.submit("odd", at::ones({2})).get().status.code() == absl::StatusCode::kInternal);  // the lane lives on
}

TEST_CASE("a failing branch fails the request once; the sibling branch does not resolve it again", "[dag]") {
  Session session;
  session.add_block(test::slow_plus_one("slow", std::chrono::milliseconds(20)))
      .add_block(Block::callable("broken", [](Tensors&&) -> absl::StatusOr<Tensors> {
        return absl::DataLossError("branch broke");
      }))
      .add_path(Path("p").node("slow", {}).node("broken", {}).join("avg", {"slow", "broken"}, Combine::mean()));
  test::require_started(session);
  std::atomic<int> calls{0};
  absl::Status seen;
  std::promise<void> done;
  session.submit("p", Tensors{at::ones({1})}, [&](Result&& r) {
    seen = r.status;
    if (calls.fetch_add(1) == 0) done.set_value();
  });
  done.get_future().wait();
  session.shutdown();  // joins workers: the slow branch has finished by now
  CHECK(calls.load() == 1);
  CHECK(absl::IsDataLoss(seen));
  CHECK_THAT(std::string(seen.message()), Contains("block 'broken'"));
}
