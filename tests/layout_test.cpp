// Layouts between blocks: two optimized TorchScript blocks on the lanes hand the tensor over in
// oneDNN's layout (no to_dense/to_mkldnn pair); nothing opaque reaches a client, a C++ block or a
// batch, and results equal the dense run's.
#include "test_util.hpp"

using namespace blockflow;

namespace {

const BlockMetrics& block_named(const MetricsSnapshot& m, const std::string& name) {
  for (const auto& b : m.blocks) {
    if (b.name == name) return b;
  }
  FAIL("no block " << name);
  throw std::logic_error("unreachable");
}

// What the two blocks compute through their plain forward(), dense in, dense out.
Tensor dense_chain(const std::vector<std::shared_ptr<Block>>& blocks, const Tensor& x) {
  c10::InferenceMode inference;
  Tensors values{x};
  for (const auto& block : blocks) values = block->forward(std::move(values)).value();
  return values.at(0);
}

}  // namespace

TEST_CASE("two optimized blocks keep oneDNN's layout between them; clients get dense, equal results", "[layout]") {
  auto b1 = test::load_block("b1", "cnn_block1.pt", test::shaped({-1, 3, 16, 16}));
  auto b2 = test::load_block("b2", "cnn_block2.pt", test::shaped({-1, 8, 16, 16}));
  auto b3 = test::load_block("b3", "cnn_block3.pt", test::shaped({-1, 16, 8, 8}));
  auto mono = test::load_block("mono", "cnn_monolithic.pt", test::shaped({-1, 3, 16, 16}));
  auto twice = Block::callable("twice", [](Tensors&& in) -> absl::StatusOr<Tensors> {
    if (in.at(0).is_mkldnn()) return absl::InvalidArgumentError("an opaque tensor reached a C++ block");
    return Tensors{in.at(0) * 2};
  });
  Session session;
  session.add_block(b1).add_block(b2).add_block(b3).add_block(mono).add_block(twice)
      .add_path(Path::chain("split", {"b1", "b2", "b3"}))   // b1 -> b2 kept; b3 takes dense only
      .add_path(Path::chain("front", {"b1", "b2"}))         // b2 is the sink: its output is dense
      .add_path(Path::chain("to_cpp", {"b1", "twice"}))     // a C++ successor: b1 gives dense
      .add_path(Path::chain("whole", {"mono"}));
  test::require_started(session);
  at::manual_seed(11);
  for (int i = 0; i < 4; ++i) {
    const Tensor x = at::randn({1 + i % 2, 3, 16, 16});
    Result split = session.submit("split", x).get();
    Result whole = session.submit("whole", x).get();
    Result front = session.submit("front", x).get();
    Result to_cpp = session.submit("to_cpp", x).get();
    REQUIRE(split.ok());
    REQUIRE(whole.ok());
    REQUIRE(front.ok());
    REQUIRE(to_cpp.ok());
    CHECK_FALSE(split.output().is_mkldnn());
    CHECK_FALSE(front.output().is_mkldnn());
    CHECK((split.output() - whole.output()).abs().max().item<double>() <= 1e-5);
    CHECK((front.output() - dense_chain({b1, b2}, x)).abs().max().item<double>() <= 1e-5);
    CHECK((to_cpp.output() - dense_chain({b1}, x) * 2).abs().max().item<double>() <= 1e-5);
  }
  const auto m = session.metrics();
  CHECK(block_named(m, "b1").layout_kept == 8);  // "split" and "front", 4 requests each
  CHECK(block_named(m, "b2").layout_kept == 0);
  CHECK(block_named(m, "b3").layout_kept == 0);
  CHECK(block_named(m, "twice").processed == 4);
  CHECK(block_named(m, "twice").failed == 0);
  CHECK(m.to_prometheus().find("blockflow_block_layout_kept_total{block=\"b1\",placement=\"threads\",device=\"cpu\"} 8") != std::string::npos);
}

TEST_CASE("a batching successor gets dense tensors", "[layout]") {
  Session session;
  session.add_block(test::load_block("b1", "cnn_block1.pt", test::shaped({-1, 3, 16, 16})))
      .add_block(test::load_block("b2", "cnn_block2.pt", test::shaped({-1, 8, 16, 16}, 4)))
      .add_block(test::load_block("mono", "cnn_monolithic.pt", test::shaped({-1, 3, 16, 16})))
      .add_block(test::load_block("b3", "cnn_block3.pt", test::shaped({-1, 16, 8, 8})))
      .add_path(Path::chain("split", {"b1", "b2", "b3"}))
      .add_path(Path::chain("whole", {"mono"}));
  test::require_started(session);
  std::vector<std::future<Result>> split;
  std::vector<Tensor> inputs;
  at::manual_seed(12);
  for (int i = 0; i < 6; ++i) {
    inputs.push_back(at::randn({1, 3, 16, 16}));
    split.push_back(session.submit("split", inputs.back()));
  }
  for (int i = 0; i < 6; ++i) {
    Result r = split[static_cast<std::size_t>(i)].get();
    REQUIRE(r.ok());
    Result whole = session.submit("whole", inputs[static_cast<std::size_t>(i)]).get();
    REQUIRE(whole.ok());
    CHECK((r.output() - whole.output()).abs().max().item<double>() <= 1e-5);
  }
  CHECK(block_named(session.metrics(), "b1").layout_kept == 0);
}
