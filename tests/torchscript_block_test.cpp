// TorchScript blocks: split small CNN == monolithic, tuple/list/multi-input modules, load errors, build order.
#include "test_util.hpp"

#include <blockflow/core/detail/build_scope.hpp>
#include <blockflow/core/detail/opaque_layout.hpp>
#include <blockflow/core/detail/session_core.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <thread>

using namespace blockflow;
using Catch::Matchers::Contains;

TEST_CASE("a split small CNN gives the monolithic model's output", "[torchscript]") {
  Session session;
  session.add_block(test::load_block("b1", "cnn_block1.pt", test::shaped({-1, 3, 16, 16})))
      .add_block(test::load_block("b2", "cnn_block2.pt", test::shaped({-1, 8, 16, 16})))
      .add_block(test::load_block("b3", "cnn_block3.pt", test::shaped({-1, 16, 8, 8})))
      .add_block(test::load_block("mono", "cnn_monolithic.pt", test::shaped({-1, 3, 16, 16})))
      .add_path(Path::chain("split", {"b1", "b2", "b3"}))
      .add_path(Path::chain("whole", {"mono"}));
  test::require_started(session);
  at::manual_seed(7);
  for (int i = 0; i < 5; ++i) {
    const Tensor x = at::randn({1 + i % 2, 3, 16, 16});
    Result split = session.submit("split", x).get();
    Result whole = session.submit("whole", x).get();
    REQUIRE(split.ok());
    REQUIRE(whole.ok());
    CHECK(split.output().sizes() == whole.output().sizes());
    CHECK(split.output().size(1) == 5);
    const double diff = (split.output() - whole.output()).abs().max().item<double>();
    CHECK(diff <= 1e-5);
  }
  const auto m = session.metrics();
  CHECK(m.blocks.at(0).kind == "torchscript");
  CHECK(m.blocks.at(0).intra_op_threads == 2);
}

TEST_CASE("tuple and list outputs are flattened; multi-input forward takes positional tensors", "[torchscript]") {
  BlockOptions two_in;
  two_in.input_shapes = {{2, 3}, {2, 3}};
  Session session;
  session.add_block(test::load_block("tuple", "tuple_block.pt"))
      .add_block(test::load_block("list", "list_block.pt"))
      .add_block(test::load_block("mul", "two_input_block.pt", two_in))
      .add_path(Path::chain("t", {"tuple"}))
      .add_path(Path::chain("l", {"list"}))
      .add_path(Path::chain("m", {"mul"}))
      .add_path(Path::chain("tm", {"tuple", "mul"}));  // tuple's two outputs feed mul's two inputs
  test::require_started(session);
  const Tensor x = at::arange(6, at::kFloat).reshape({2, 3});
  Result t = session.submit("t", x).get();
  REQUIRE(t.outputs.size() == 2);
  CHECK(at::equal(t.outputs[0], x * 2));
  CHECK(at::equal(t.outputs[1], x + 1));
  Result l = session.submit("l", x).get();
  REQUIRE(l.outputs.size() == 2);
  CHECK(at::equal(l.outputs[1], x * 3));
  Result m = session.submit("m", Tensors{x, x}).get();
  CHECK(at::equal(m.output(), x * x + 1));
  Result tm = session.submit("tm", x).get();
  CHECK(at::equal(tm.output(), (x * 2) * (x + 1) + 1));
}

TEST_CASE("a TorchScript exception fails the request with the block name and the message", "[torchscript]") {
  Session session;
  session.add_block(test::load_block("raiser", "raise_block.pt")).add_path(Path::chain("t", {"raiser"}));
  test::require_started(session);
  Result r = session.submit("t", at::ones({2, 3})).get();
  CHECK(absl::IsInternal(r.status));
  CHECK_THAT(std::string(r.status.message()), Contains("block 'raiser'") && Contains("boom from raise_block"));
}

TEST_CASE("a wrong input shape inside TorchScript fails naming the block", "[torchscript]") {
  Session session;  // no declared input_shapes: the module itself rejects the tensor
  session.add_block(test::load_block("b2", "cnn_block2.pt")).add_path(Path::chain("t", {"b2"}));
  test::require_started(session);
  Result r = session.submit("t", at::ones({1, 3, 16, 16})).get();
  CHECK_FALSE(r.ok());
  CHECK_THAT(std::string(r.status.message()), Contains("block 'b2'"));
}

TEST_CASE("loading a missing or invalid file names the block and the file", "[torchscript]") {
  auto missing = load_torchscript_block("ghost", "/nonexistent/ghost.pt");
  CHECK(absl::IsNotFound(missing.status()));
  CHECK_THAT(std::string(missing.status().message()), Contains("block 'ghost'") && Contains("/nonexistent/ghost.pt"));
  auto not_ts = load_torchscript_block("json", test::model_path("manifest.json"));
  CHECK(absl::IsInvalidArgument(not_ts.status()));
  CHECK_THAT(std::string(not_ts.status().message()), Contains("block 'json'") && Contains("manifest.json"));
}

TEST_CASE("blocks described by files build at once, one thread per core, when lanes are fewer than cores",
          "[torchscript]") {
  if (std::thread::hardware_concurrency() < 2) {
    SUCCEED("one core: blocks build one after another");
    return;
  }
  // The first two builds wait (up to 20 s) for each other: built one after another, each would
  // wait alone and `most` would stay 1.
  std::atomic<int> entered{0}, inside{0}, most{0};
  blockflow::detail::set_build_scope([&]() -> std::shared_ptr<void> {
    const int n = ++entered;
    const int now = ++inside;
    for (int seen = most.load(); now > seen && !most.compare_exchange_weak(seen, now);) {
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (n <= 2 && most.load() < 2 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return std::shared_ptr<void>(nullptr, [&inside](void*) { --inside; });
  });
  SessionOptions options;
  options.lanes = 1;
  Session session(options);
  for (const auto& [name, file] : {std::pair{"b1", "cnn_block1.pt"}, std::pair{"b2", "cnn_block2.pt"}}) {
    BlockDescription d;
    d.name = name;
    d.torchscript = test::model_path(file);
    d.options.intra_op_threads = 2;
    session.add_block(d);
  }
  session.add_path(Path::chain("t", {"b1", "b2"}));
  const auto status = session.start();
  blockflow::detail::set_build_scope(nullptr);
  REQUIRE(status.ok());
  CHECK(most.load() == 2);
  CHECK(session.metrics().lanes.size() == 1);
  CHECK(session.submit("t", at::randn({1, 3, 16, 16})).get().ok());
}

TEST_CASE("blocks build largest TorchScript file first; C++ blocks and unreadable files last, in their order",
          "[torchscript]") {
  // Longest job first: no builder is left alone with the largest block at the end.
  const std::vector<std::string> files = {"cnn_block1.pt", "cnn_monolithic.pt", "", "/nonexistent/ghost.pt", "cnn_block3.pt", ""};
  std::vector<BlockDescription> descriptions(files.size());
  std::vector<const BlockDescription*> pointers;
  for (std::size_t i = 0; i < files.size(); ++i) {
    descriptions[i].name = fmt::format("b{}", i);
    if (files[i].empty()) descriptions[i].factory = "some_factory";
    else descriptions[i].torchscript = files[i].front() == '/' ? files[i] : test::model_path(files[i]);
    pointers.push_back(&descriptions[i]);
  }
  std::vector<std::pair<std::uintmax_t, std::size_t>> by_size;  // (bytes, index) of the readable files
  for (std::size_t i : {0U, 1U, 4U}) by_size.emplace_back(std::filesystem::file_size(descriptions[i].torchscript), i);
  std::sort(by_size.begin(), by_size.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  REQUIRE(by_size[0].first > by_size[1].first);
  REQUIRE(by_size[1].first > by_size[2].first);
  const std::vector<std::size_t> expected = {by_size[0].second, by_size[1].second, by_size[2].second, 2, 3, 5};
  CHECK(blockflow::detail::build_order(pointers) == expected);
}

TEST_CASE("a block's layout variants take the forward's inputs as forward() does, and any legal block name",
          "[torchscript]") {
  // "stage." is a legal block name (names.hpp) that a qualified name of the block's own would refuse.
  for (const char* name : {"b1", "stage."}) {
    INFO(name);
    BlockOptions options;
    options.input_shapes = {{-1, 3, 16, 16}};
    auto loaded = load_torchscript_block(name, test::model_path("cnn_block1.pt"), options);
    REQUIRE(loaded.ok());
    auto* layout = dynamic_cast<blockflow::detail::OpaqueLayout*>(loaded->get());
    REQUIRE(layout != nullptr);
    Block& block = **loaded;
    REQUIRE(layout->gives_opaque());  // optimised for inference on this CPU: a variant without the exit reorder
    const Tensor x = at::randn({1, 3, 16, 16});
    auto dense = block.forward({x});
    REQUIRE(dense.ok());
    auto opaque = layout->forward_layout({x}, /*opaque_output=*/true);
    REQUIRE(opaque.ok());
    CHECK(at::allclose(opaque->front().to_dense(), dense->front(), 1e-4, 1e-5));
    // One input too many: refused as forward() refuses it (the variant alone would bind the last).
    CHECK_THROWS_WITH(layout->forward_layout({x, x}, true), Contains("argument"));
  }
}
