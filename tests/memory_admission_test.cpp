// Memory admission (BlockOptions::memory_bytes against SessionOptions::memory_budget and
// WorkerOptions::memory_budget): start() and apply() refuse, naming the site, its budget and the
// blocks, before anything loads; after loading, each site's growth is compared with the profiles.
#include "worker_util.hpp"

#include <blockflow/worker/worker_site.hpp>

#include <mutex>

using namespace blockflow;
using Catch::Matchers::Contains;

namespace {

using test::kMB;

std::shared_ptr<Block> profiled(const std::string& name, std::int64_t memory_mb) {
  BlockOptions o;
  o.memory_bytes = memory_mb * kMB;
  return Block::callable(name, [](Tensors&& in) -> absl::StatusOr<Tensors> { return Tensors{in.at(0) + 1}; }, o);
}

}  // namespace

TEST_CASE("start() refuses blocks whose profiled memory exceeds the threads' budget, naming them", "[admission]") {
  SessionOptions o;
  o.memory_budget = 100 * kMB;
  Session session(o);
  session.add_block(profiled("a", 80)).add_block(profiled("b", 40)).add_path(Path::chain("t", {"a", "b"}));
  const auto status = session.start();
  CHECK(status.code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(status.message()), Contains("the session's threads: its blocks' profiled memory is 120.0 MB"));
  CHECK_THAT(std::string(status.message()), Contains("'a' 80.0 MB, 'b' 40.0 MB"));
  CHECK_THAT(std::string(status.message()), Contains("memory budget of 100.0 MB"));

  Session fits(o);
  fits.add_block(profiled("a", 60)).add_block(profiled("b", 40)).add_path(Path::chain("t", {"a", "b"}));
  REQUIRE(fits.start().ok());
  CHECK(fits.submit("t", at::zeros({1})).get().output().item<float>() == 2.0f);
  const auto m = fits.metrics();
  REQUIRE(m.memory.size() == 1);
  CHECK(m.memory[0].site == "threads");
  CHECK(m.memory[0].budget_bytes == 100 * kMB);
  CHECK(m.memory[0].profiled_bytes == 100 * kMB);
}

TEST_CASE("a worker's budget refuses its blocks at start() before the worker is spawned", "[admission]") {
  WorkerOptions w;
  w.name = "w1";
  w.memory_budget = 10 * kMB;
  w.plugins = {BLOCKFLOW_TEST_PLUGIN};
  auto site = make_worker(w);
  Session session;
  BlockDescription d;
  d.name = "scaled";
  d.factory = "affine";
  d.placement = "w1";
  d.options.memory_bytes = 20 * kMB;
  session.add_site(site).add_block(d).add_path(Path::chain("t", {"scaled"}));
  const auto status = session.start();
  CHECK(status.code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(status.message()), Contains("site 'w1': its blocks' profiled memory is 20.0 MB ('scaled' 20.0 MB)"));
  CHECK(site->pid() == 0);
}

TEST_CASE("apply() refuses an update over a budget, and the session goes on as it was; one over it only during the "
          "switch is applied, and said", "[admission]") {
  SessionOptions o;
  o.memory_budget = 100 * kMB;
  Session session(o);
  session.add_block(profiled("a", 60)).add_path(Path::chain("t", {"a"}));
  REQUIRE(session.start().ok());
  auto over = Deployment::parse(R"({"blocks": ["a", {"name": "big", "factory": "big", "memory_bytes": 52428800}],
                                    "tasks": {"t": ["a"], "u": ["big"]}})");
  REQUIRE(over.ok());
  const auto refused = session.apply(*over);
  CHECK(refused.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(refused.status().message()), Contains("nothing changed"));
  CHECK_THAT(std::string(refused.status().message()), Contains("110.0 MB"));
  CHECK(session.metrics().version == 0);
  CHECK(session.submit("t", at::zeros({1})).get().ok());

  // Replacing a (60 MB) by b (50 MB) fits once a is drained, not while both are held: applied, and
  // the switch's peak is said.
  test::register_update_factories();
  std::mutex mu;
  std::vector<std::string> warnings;
  set_log_sink([&](LogLevel level, std::string_view message) {
    std::lock_guard lock(mu);
    if (level == LogLevel::kWarning) warnings.emplace_back(message);
  });
  auto swap = Deployment::parse(R"({"blocks": [{"name": "b", "factory": "upd_add_2", "memory_bytes": 52428800}],
                                    "tasks": {"u": ["b"]}})");
  REQUIRE(swap.ok());
  const auto applied = session.apply(*swap);
  set_log_sink(nullptr);
  INFO(applied.status().ToString());
  REQUIRE(applied.ok());
  CHECK(session.submit("u", at::zeros({1})).get().output().item<float>() == 2.0f);
  std::lock_guard lock(mu);
  bool said = false;
  for (const auto& w : warnings) {
    said = said || (w.find("update 1: during the switch, while the removed blocks drain, the session's threads: its "
                           "blocks' profiled memory is 110.0 MB") != std::string::npos &&
                    w.find("remove them in an update of their own first") != std::string::npos);
  }
  CHECK(said);
}

TEST_CASE("after loading, a site whose memory growth is far from its blocks' profiles is reported", "[admission]") {
  std::mutex mu;
  std::vector<std::string> warnings;
  set_log_sink([&](LogLevel level, std::string_view message) {
    std::lock_guard lock(mu);
    if (level == LogLevel::kWarning) warnings.emplace_back(message);
  });
  Session session;
  session.add_block(profiled("claims_a_lot", 4096)).add_path(Path::chain("t", {"claims_a_lot"}));
  REQUIRE(session.start().ok());
  set_log_sink(nullptr);
  const auto m = session.metrics();
  REQUIRE(m.memory.size() == 1);
  CHECK(m.memory[0].profiled_bytes == 4096 * kMB);
  CHECK(m.memory[0].measured_bytes < 4096 * kMB);  // a callable that adds nothing like 4 GB
  std::lock_guard lock(mu);
  bool reported = false;
  for (const auto& w : warnings) reported = reported || w.find("the session's threads: its memory grew by") != std::string::npos;
  CHECK(reported);
  CHECK_THAT(m.to_prometheus(), Contains("blockflow_site_memory_profiled_bytes{site=\"threads\"} 4294967296"));
  auto back = MetricsSnapshot::from_json(m.to_json());
  REQUIRE(back.ok());
  REQUIRE(back->memory.size() == 1);
  CHECK(back->memory[0].measured_bytes == m.memory[0].measured_bytes);
}

TEST_CASE("memory_bytes in a deployment: parsed, checked, and written back", "[admission]") {
  auto d = Deployment::parse(R"({"blocks": [{"name": "x", "factory": "f", "memory_bytes": 1048576}], "tasks": {"t": ["x"]}})");
  REQUIRE(d.ok());
  CHECK(d->blocks[0].options.memory_bytes == kMB);
  auto negative = Deployment::parse(R"({"blocks": [{"name": "x", "factory": "f", "memory_bytes": -1}], "tasks": {"t": ["x"]}})");
  CHECK_FALSE(negative.ok());
  CHECK_THAT(std::string(negative.status().message()), Contains("memory_bytes"));
}

TEST_CASE("apply() refuses a new site's budget before it builds any block of this process", "[admission]") {
  // Before, this process's new blocks were built (paying their load, up to twice their memory at
  // the peak) and only then were the budgets of the sites the update makes checked.
  static std::atomic<int> builds{0};
  BlockRegistry::global().add("admission_counted", [](const std::string& name, const BlockOptions& o) {
    builds.fetch_add(1);
    return Block::callable(name, [](Tensors&& in) -> absl::StatusOr<Tensors> { return Tensors{in.at(0) + 1}; }, o);
  });
  Session session;
  session.add_block(profiled("a", 1)).add_path(Path::chain("t", {"a"}));
  REQUIRE(session.start().ok());
  session.set_site_factory([](const std::string& name) -> std::shared_ptr<RemoteSite> {
    WorkerOptions w = test::test_worker(name);
    w.memory_budget = 10 * kMB;
    return make_worker(w);
  });
  auto update = Deployment::parse(R"({"blocks": ["a", {"name": "here", "factory": "admission_counted"},
                                                 {"name": "there", "factory": "affine", "placement": "w5",
                                                  "memory_bytes": 20971520}],
                                      "tasks": {"t": ["a"], "u": ["here", "there"]}})");
  REQUIRE(update.ok());
  const auto refused = session.apply(*update);
  CHECK(refused.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(refused.status().message()), Contains("site 'w5'"));
  CHECK(builds.load() == 0);
  CHECK(session.submit("t", at::zeros({1})).get().output().item<float>() == 1.0f);
}
