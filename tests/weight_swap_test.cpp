// Swapping (SessionOptions::swap, docs/memory.md "Swapping"): the memory a block's load allocates
// through libtorch is captured; unloading pages it out to a file and a reload pages it back in, with
// every value kept, writes made since the last unload included.
#include "test_util.hpp"
#include "worker_util.hpp"

#include <blockflow/core/detail/weight_swap.hpp>

#include <fmt/format.h>
#include <torch/script.h>

#include <unistd.h>

#include <filesystem>
#include <thread>

using namespace blockflow;
using blockflow::detail::WeightSwap;

namespace {

constexpr std::int64_t kFloats = 1 << 20;  // 4 MB

// A TorchScript file whose forward is x @ w, w a 1024 x 1024 matrix of `value` (4 MB of weights).
struct MatmulModel {
  std::filesystem::path file;
  explicit MatmulModel(const std::string& name, float value) {
    file = std::filesystem::temp_directory_path() / fmt::format("bf-swap-{}-{}.pt", name, ::getpid());
    torch::jit::Module m("Matmul");
    m.register_parameter("w", at::full({1024, 1024}, value), false);
    m.define(R"(
def forward(self, x):
    return torch.mm(x, self.w)
)");
    m.save(file.string());
  }
  ~MatmulModel() {
    std::error_code ec;
    std::filesystem::remove(file, ec);
  }
};

BlockDescription matmul_block(const std::string& name, const MatmulModel& model) {
  BlockDescription d;
  d.name = name;
  d.torchscript = model.file.string();
  d.options.input_shapes = {{1, 1024}};
  return d;
}

// Three rounds of a request to "ta" (x @ 0.5) and one to "tb" (x @ 0.25) on ones: each block loads in turn.
void alternate(Session& session) {
  const at::Tensor x = at::ones({1, 1024});
  for (int i = 0; i < 3; ++i) {
    Result ra = session.submit("ta", x).get();
    INFO(ra.status);
    REQUIRE(ra.ok());
    CHECK(ra.output()[0][7].item<float>() == 512.0F);
    Result rb = session.submit("tb", x).get();
    INFO(rb.status);
    REQUIRE(rb.ok());
    CHECK(rb.output()[0][7].item<float>() == 256.0F);
  }
}

}  // namespace

TEST_CASE("swap: captured weights page out and back in, keeping every value, writes since the last swap_out included",
          "[memory]") {
  REQUIRE(WeightSwap::available());
  WeightSwap swap("w", {});
  at::Tensor weights;
  {
    WeightSwap::Capture capture(swap);
    weights = at::ones({kFloats});
  }
  const std::int64_t bytes = static_cast<std::int64_t>(kFloats * sizeof(float));
  REQUIRE(swap.bytes() == bytes);
  CHECK(swap.resident_bytes() == bytes);

  REQUIRE(swap.swap_out().ok());  // the first time: written to the file, its pages dropped
  CHECK(swap.resident_bytes() == 0);
  REQUIRE(swap.swap_in().ok());
  CHECK(swap.resident_bytes() == bytes);
  CHECK(weights.sum().item<double>() == static_cast<double>(kFloats));

  // Written while loaded: saved by the next swap_out, not lost to the file's older copy.
  weights.narrow(0, 0, 1024).fill_(3.0F);
  REQUIRE(swap.swap_out().ok());
  CHECK(swap.resident_bytes() == 0);
  REQUIRE(swap.swap_in().ok());
  CHECK(weights.sum().item<double>() == static_cast<double>(kFloats + 2 * 1024));

  // Memory paged out stays valid: an access reads it back.
  REQUIRE(swap.swap_out().ok());
  CHECK(weights[5].item<float>() == 3.0F);
  CHECK(weights[kFloats - 1].item<float>() == 1.0F);

  weights = at::Tensor();  // freed: no longer captured
  CHECK(swap.bytes() == 0);
}

TEST_CASE("swap: only this thread's allocations of a page or more are captured, and only while the capture lives, unpaused",
          "[memory]") {
  REQUIRE(WeightSwap::available());
  WeightSwap swap("w", {});
  at::Tensor small, other_thread, paused, mine;
  {
    WeightSwap::Capture capture(swap);
    small = at::ones({16});
    std::thread([&] { other_thread = at::ones({kFloats}); }).join();
    {
      const WeightSwap::Pause pause;
      paused = at::ones({kFloats});
    }
    mine = at::ones({kFloats});
  }
  const at::Tensor after = at::ones({kFloats});
  CHECK(swap.bytes() == static_cast<std::int64_t>(kFloats * sizeof(float)));
  REQUIRE(swap.swap_out().ok());
  CHECK(swap.resident_bytes() == 0);
  CHECK(small.sum().item<double>() == 16.0);
  CHECK(other_thread.sum().item<double>() == static_cast<double>(kFloats));
  CHECK(paused.sum().item<double>() == static_cast<double>(kFloats));
  CHECK(after.sum().item<double>() == static_cast<double>(kFloats));
}

TEST_CASE("swap: a file that cannot be made is an error naming the block, and the memory stays as it was", "[memory]") {
  REQUIRE(WeightSwap::available());
  WeightSwap swap("weights_b", {"/nonexistent/swap-dir", false});
  at::Tensor weights;
  {
    WeightSwap::Capture capture(swap);
    weights = at::ones({kFloats});
  }
  const absl::Status status = swap.swap_out();
  REQUIRE_FALSE(status.ok());
  CHECK_THAT(std::string(status.message()), Catch::Matchers::Contains("block 'weights_b'") &&
                                                Catch::Matchers::Contains("/nonexistent/swap-dir"));
  CHECK(swap.resident_bytes() == swap.bytes());
  CHECK(weights.sum().item<double>() == static_cast<double>(kFloats));
}

TEST_CASE("on demand with swapping: evicted TorchScript blocks come back by swap-in, with the right values", "[memory]") {
  const MatmulModel half("half", 0.5F), quarter("quarter", 0.25F);
  const bool swap = GENERATE(true, false);
  // A swap file that cannot be made: the block is freed instead, and built again at its next load.
  const bool unwritable = swap && GENERATE(false, true);
  SessionOptions options;
  options.memory_policy = SessionOptions::MemoryPolicy::kOnDemand;
  options.memory_budget = 6 * test::kMB;  // room for one of the two (4 MB of weights each)
  options.lanes = 1;
  options.swap.enabled = swap;
  if (unwritable) options.swap.directory = "/nonexistent/swap-dir";
  Session session(options);
  auto a = matmul_block("a", half), b = matmul_block("b", quarter);
  a.options.memory_bytes = b.options.memory_bytes = 5 * test::kMB;
  session.add_block(a).add_block(b).add_path(Path::chain("ta", {"a"})).add_path(Path::chain("tb", {"b"}));
  test::require_started(session);
  alternate(session);
  const SiteMemory m = test::site_memory(session.metrics(), "threads");
  CHECK(m.loads == 8);  // start() loads each once, then every request loads its block
  CHECK(m.evictions == 7);
  if (swap && !unwritable) {
    CHECK(m.loads - m.swap_ins == 2);  // each block built once; every later load a swap-in
    CHECK(m.swapped_bytes >= 4 * test::kMB);  // one of them waits in its file
  } else {
    CHECK(m.swap_ins == 0);
    CHECK(m.swapped_bytes == 0);
  }
  session.shutdown();
}

TEST_CASE("on demand with swapping in a worker process: its TorchScript blocks are swapped in; heartbeats bring the figures",
          "[memory]") {
  const MatmulModel half("w-half", 0.5F), quarter("w-quarter", 0.25F);
  WorkerOptions worker = test::test_worker("w1");
  worker.memory_budget = 6 * test::kMB;
  worker.memory_policy = SessionOptions::MemoryPolicy::kOnDemand;
  Session session;
  session.add_site(std::make_shared<WorkerSite>(worker));
  auto a = matmul_block("a", half), b = matmul_block("b", quarter);
  a.placement = b.placement = "w1";
  a.options.memory_bytes = b.options.memory_bytes = 5 * test::kMB;
  session.add_block(a).add_block(b).add_path(Path::chain("ta", {"a"})).add_path(Path::chain("tb", {"b"}));
  test::require_started(session);
  alternate(session);
  CHECK(test::eventually([&] { return test::site_memory(session.metrics(), "w1").loads >= 8; }));
  const SiteMemory m = test::site_memory(session.metrics(), "w1");
  CHECK(m.loads - m.swap_ins == 2);
  CHECK(m.swapped_bytes >= 4 * test::kMB);
  CHECK_THAT(session.metrics().to_prometheus(), Catch::Matchers::Contains("blockflow_site_block_swap_ins_total{site=\"w1\"}"));
  session.shutdown();
}

TEST_CASE("on demand with swapping: an update that removes a block while it is paged out frees it and its file", "[memory]") {
  const MatmulModel half("r-half", 0.5F), quarter("r-quarter", 0.25F);
  SessionOptions options;
  options.memory_policy = SessionOptions::MemoryPolicy::kOnDemand;
  options.memory_budget = 6 * test::kMB;
  options.lanes = 1;
  Session session(options);
  auto a = matmul_block("a", half), b = matmul_block("b", quarter);
  a.options.memory_bytes = b.options.memory_bytes = 5 * test::kMB;
  session.add_block(a).add_block(b).add_path(Path::chain("ta", {"a"})).add_path(Path::chain("tb", {"b"}));
  test::require_started(session);
  alternate(session);  // "tb" last: b loaded, a paged out
  REQUIRE(test::site_memory(session.metrics(), "threads").swapped_bytes >= 4 * test::kMB);

  auto parsed = Deployment::parse(fmt::format(R"({{"blocks": [{{"name": "b", "torchscript": "{}", "input_shapes": [[1, 1024]],
                                                  "memory_bytes": {}}}], "tasks": {{"tb": ["b"]}}}})",
                                              quarter.file.string(), 5 * test::kMB),
                                  "/nowhere");
  REQUIRE(parsed.ok());
  const auto applied = session.apply(*parsed);
  INFO(applied.status().ToString());
  REQUIRE(applied.ok());
  CHECK(test::site_memory(session.metrics(), "threads").swapped_bytes == 0);
  Result rb = session.submit("tb", at::ones({1, 1024})).get();
  REQUIRE(rb.ok());
  CHECK(rb.output()[0][7].item<float>() == 256.0F);
  CHECK_FALSE(session.submit("ta", at::ones({1, 1024})).get().ok());
  session.shutdown();
}

TEST_CASE("on demand with swapping: a block holding quantized packed weights is freed and built again, not swapped",
          "[memory]") {
  // fbgemm packs the int8 weights in memory of its own: swapped, the block would keep it resident
  // while the budget counted the block as unloaded.
  auto quantized = load_torchscript_block("q", test::model_path("quantized_block.pt"));
  REQUIRE(quantized.ok());
  CHECK_FALSE(blockflow::detail::swaps_whole(**quantized));
  auto plain = load_torchscript_block("p", test::model_path("cnn_block1.pt"));
  REQUIRE(plain.ok());
  CHECK(blockflow::detail::swaps_whole(**plain));

  SessionOptions options;
  options.memory_policy = SessionOptions::MemoryPolicy::kOnDemand;
  options.memory_budget = 3 * test::kMB / 2;  // room for one of the two
  options.lanes = 1;
  options.swap.enabled = true;
  Session session(options);
  for (const char* name : {"a", "b"}) {
    BlockDescription d;
    d.name = name;
    d.torchscript = test::model_path("quantized_block.pt");
    d.options.input_shapes = {{1, 256}};
    d.options.memory_bytes = test::kMB;
    session.add_block(d).add_path(Path::chain(std::string("t") + name, {name}));
  }
  test::require_started(session);
  const at::Tensor x = at::ones({1, 256});
  const Result first = session.submit("ta", x).get();
  REQUIRE(first.ok());
  for (int i = 0; i < 3; ++i) {
    const Result rb = session.submit("tb", x).get();
    INFO(rb.status);
    REQUIRE(rb.ok());
    const Result ra = session.submit("ta", x).get();
    INFO(ra.status);
    REQUIRE(ra.ok());
    CHECK(at::equal(ra.output(), first.output()));  // built again: the same weights
    CHECK(at::equal(rb.output(), first.output()));
  }
  const SiteMemory m = test::site_memory(session.metrics(), "threads");
  CHECK(m.evictions >= 6);
  CHECK(m.swap_ins == 0);
  CHECK(m.swapped_bytes == 0);
}
