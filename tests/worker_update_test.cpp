// Session::apply() with blocks in worker processes: a new placement starts a worker, a running
// worker loads new blocks next to its others without a restart, a worker left without blocks stops,
// and an update a worker cannot carry out is rejected as a whole with the worker's reason.
#include "worker_util.hpp"

#include <blockflow/deploy/deployment.hpp>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <set>
#include <csignal>
#include <thread>

using namespace blockflow;
using Catch::Matchers::Contains;
using namespace std::chrono_literals;

namespace {

using test::parse;
using test::process_exists;
using test::processed;
using test::value_of;

// This process's live children (worker processes), from /proc/self/task/*/children.
std::set<std::int64_t> children() {
  std::set<std::int64_t> out;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream in(task.path() / "children");
    for (std::int64_t pid = 0; in >> pid;) {
      std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
      std::string line;
      std::getline(stat, line);
      const auto close = line.rfind(')');
      if (close != std::string::npos && line.size() > close + 2 && line[close + 2] != 'Z') out.insert(pid);
    }
  }
  return out;
}

const SiteStats* site(const MetricsSnapshot& m, const std::string& name) {
  for (const auto& s : m.sites) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

// Block a ("affine": 3x + 1, the test plugin) in worker w1, task t1 = [a], with the factory of
// worker sites that add_deployment() installs.
void start_a_in_w1(Session& session) {
  add_deployment(session, parse(R"({"blocks": [{"name": "a", "factory": "affine", "placement": "w1"}],
                                    "tasks": {"t1": ["a"]}})"),
                 test::test_worker(""));
  test::require_started(session);
}

}  // namespace

TEST_CASE("apply starts workers, loads blocks into running ones untouched, stops emptied ones; no request lost",
          "[worker_update]") {
  Session session;
  start_a_in_w1(session);
  CHECK(value_of(session, "t1", 1) == 4);
  const auto before = session.metrics();
  const std::int64_t w1 = site(before, "w1")->pid;
  REQUIRE(w1 > 0);

  // Traffic on t1 the whole time: every request must succeed with the right value.
  std::atomic<bool> running{true};
  std::atomic<int> sent{0}, wrong{0};
  std::thread traffic([&] {
    while (running) {
      Result r = session.submit("t1", at::full({1}, 2.0)).get();
      if (!r.ok() || r.output().item<double>() != 7) ++wrong;
      ++sent;
    }
  });

  // b joins a in the running w1; c needs a worker w2 that does not exist yet.
  auto v1 = session.apply(parse(R"({"blocks": [{"name": "a", "factory": "affine", "placement": "w1"},
                                               {"name": "b", "factory": "affine", "placement": "w1"},
                                               {"name": "c", "factory": "affine", "placement": "w2"}],
                                    "tasks": {"t1": ["a"], "t2": ["b"], "t3": ["a", "c"]}})"));
  INFO(v1.status().ToString());
  REQUIRE(v1.ok());
  CHECK(*v1 == 1);
  CHECK(value_of(session, "t2", 1) == 4);
  CHECK(value_of(session, "t3", 1) == 13);
  auto m = session.metrics();
  CHECK(m.version == 1);
  REQUIRE(m.sites.size() == 2);
  CHECK(site(m, "w1")->pid == w1);  // not restarted: a kept running
  CHECK(site(m, "w1")->restarts == 0);
  const std::int64_t w2 = site(m, "w2")->pid;
  CHECK(process_exists(w2));
  CHECK(w2 != w1);
  for (const auto& b : m.blocks) CHECK(b.placement == (b.name == "c" ? "w2" : "w1"));

  // c and b go while t2 (through b) has traffic: w2 has nothing left and stops; w1 unloads b and
  // keeps a. Every t2 request resolves: done by b before it went, or refused once t2 is gone.
  std::atomic<int> t2_sent{0}, t2_ok{0}, t2_refused{0}, t2_other{0};
  std::thread traffic2([&] {
    for (int i = 0; i < 400; ++i) {
      Result r = session.submit("t2", at::full({1}, 1.0)).get();
      ++t2_sent;
      if (r.ok() && r.output().item<double>() == 4) ++t2_ok;
      else if (!r.ok() && r.status.message().find("t2") != std::string::npos) ++t2_refused;
      else ++t2_other;
      if (t2_refused > 3) break;
    }
  });
  std::this_thread::sleep_for(50ms);
  auto v2 = session.apply(parse(R"({"blocks": [{"name": "a", "factory": "affine", "placement": "w1"}],
                                    "tasks": {"t1": ["a"]}})"));
  INFO(v2.status().ToString());
  REQUIRE(v2.ok());
  m = session.metrics();
  REQUIRE(m.sites.size() == 1);
  CHECK(m.sites[0].name == "w1");
  CHECK(m.sites[0].pid == w1);
  CHECK(m.blocks.size() == 1);
  traffic2.join();
  INFO("t2: sent " << t2_sent << ", ok " << t2_ok << ", refused " << t2_refused << ", other " << t2_other);
  CHECK(t2_ok > 0);
  CHECK(t2_refused > 0);
  CHECK(t2_other == 0);
  CHECK(test::eventually([&] { return !process_exists(w2); }));
  CHECK(children() == std::set<std::int64_t>{w1});

  // w2 comes back when an update names it again.
  auto v3 = session.apply(parse(R"({"blocks": [{"name": "a", "factory": "affine", "placement": "w1"},
                                               {"name": "c", "factory": "affine", "placement": "w2"}],
                                    "tasks": {"t1": ["a"], "t3": ["a", "c"]}})"));
  INFO(v3.status().ToString());
  REQUIRE(v3.ok());
  CHECK(value_of(session, "t3", 0) == 4);
  running = false;
  traffic.join();
  CHECK(sent > 0);
  CHECK(wrong == 0);
  REQUIRE(processed(before, "a") != ~std::uint64_t{0});  // block 'a' is in the metrics
  CHECK(processed(session.metrics(), "a") >= processed(before, "a") + static_cast<std::uint64_t>(sent.load()));
  session.shutdown();
}

TEST_CASE("an update a worker cannot carry out is rejected whole, naming the worker and the cause",
          "[worker_update]") {
  Session session;
  start_a_in_w1(session);
  const std::int64_t w1 = session.metrics().sites.at(0).pid;
  auto reject = [&](const std::string& json) {
    auto v = session.apply(parse(json));
    REQUIRE_FALSE(v.ok());
    CHECK(absl::IsInvalidArgument(v.status()));
    const auto m = session.metrics();
    CHECK(m.version == 0);
    CHECK(m.blocks.size() == 1);
    REQUIRE(m.sites.size() == 1);
    CHECK(m.sites[0].pid == w1);
    CHECK(value_of(session, "t1", 1) == 4);
    return std::string(v.status().message());
  };
  // A model the running worker cannot load: w1 keeps a, and only a.
  CHECK_THAT(reject(R"({"blocks": [{"name": "a", "factory": "affine", "placement": "w1"},
                                   {"name": "m", "torchscript": "/nowhere/missing.pt", "placement": "w1"}],
                        "tasks": {"t1": ["a"], "t2": ["m"]}})"),
             Contains("update 1 rejected, nothing changed") && Contains("worker w1") && Contains("missing.pt"));
  // The same in a worker that had to be started, while w1 loaded a good block for the same update:
  // w5 is stopped again and w1 unloads what it loaded.
  CHECK_THAT(reject(R"({"blocks": [{"name": "a", "factory": "affine", "placement": "w1"},
                                   {"name": "b", "factory": "affine", "placement": "w1"},
                                   {"name": "m", "torchscript": "/nowhere/missing.pt", "placement": "w5"}],
                        "tasks": {"t1": ["a"], "t2": ["b"], "t3": ["m"]}})"),
             Contains("worker w5") && Contains("missing.pt"));
  CHECK(test::eventually([&] { return children() == std::set<std::int64_t>{w1}; }));
  // A block changed in place inside its worker.
  CHECK_THAT(reject(R"({"blocks": [{"name": "a", "factory": "affine", "placement": "w1", "queue_capacity": 7}],
                        "tasks": {"t1": ["a"]}})"),
             Contains("block 'a' in site 'w1': changing a block in place inside the same site is not supported"));
  // After all that, a valid update still goes through on the same worker.
  auto v = session.apply(parse(R"({"blocks": [{"name": "a", "factory": "affine", "placement": "w1"},
                                              {"name": "s", "factory": "slow_identity", "placement": "w1"}],
                                   "tasks": {"t1": ["a", "s"]}})"));
  INFO(v.status().ToString());
  REQUIRE(v.ok());
  CHECK(*v == 1);
  CHECK(value_of(session, "t1", 2) == 7);
  CHECK(session.metrics().sites.at(0).pid == w1);
}

TEST_CASE("apply() starts two new workers at once; when one cannot load, both are stopped and it is named",
          "[worker_update]") {
  Session session;
  start_a_in_w1(session);
  const std::int64_t w1 = session.metrics().sites.at(0).pid;
  auto v = session.apply(parse(R"({"blocks": [{"name": "a", "factory": "affine", "placement": "w1"},
                                              {"name": "c", "factory": "affine", "placement": "w2"},
                                              {"name": "m", "torchscript": "/nowhere/missing.pt", "placement": "w3"}],
                                   "tasks": {"t1": ["a"], "t2": ["a", "c"], "t3": ["m"]}})"));
  REQUIRE_FALSE(v.ok());
  CHECK(absl::IsInvalidArgument(v.status()));
  CHECK_THAT(std::string(v.status().message()), Contains("update 1 rejected, nothing changed") && Contains("worker w3"));
  CHECK(test::eventually([&] { return children() == std::set<std::int64_t>{w1}; }));
  CHECK(session.metrics().sites.size() == 1);

  v = session.apply(parse(R"({"blocks": [{"name": "a", "factory": "affine", "placement": "w1"},
                                         {"name": "c", "factory": "affine", "placement": "w2"},
                                         {"name": "d", "factory": "affine", "placement": "w3"}],
                              "tasks": {"t1": ["a"], "t2": ["a", "c"], "t3": ["d"]}})"));
  INFO(v.status().ToString());
  REQUIRE(v.ok());
  CHECK(value_of(session, "t2", 1) == 13);
  CHECK(value_of(session, "t3", 1) == 4);
  const auto m = session.metrics();
  CHECK(m.sites.size() == 3);
  CHECK(m.last_update.sites_started == 2);
  CHECK(children() == std::set<std::int64_t>{w1, site(m, "w2")->pid, site(m, "w3")->pid});
}

TEST_CASE("a worker that dies while loading an update: rejected as Unavailable, restarted with its old blocks",
          "[worker_update]") {
  Session session;
  start_a_in_w1(session);
  auto v = session.apply(parse(R"({"blocks": [{"name": "a", "factory": "affine", "placement": "w1"},
                                              {"name": "x", "factory": "abort_on_build", "placement": "w1"}],
                                   "tasks": {"t1": ["a"], "t2": ["x"]}})"));
  REQUIRE_FALSE(v.ok());
  CHECK(absl::IsUnavailable(v.status()));
  CHECK_THAT(std::string(v.status().message()),
             Contains("update 1 rejected") && Contains("worker w1 went down during the update"));
  CHECK(session.metrics().version == 0);
  // The restarted worker loads what it had (a), not the block that killed it.
  REQUIRE(test::eventually([&] {
    const auto m = session.metrics();
    return m.sites.at(0).restarts == 1 && m.sites.at(0).pid > 0 && session.submit("t1", at::full({1}, 1.0)).get().ok();
  }, std::chrono::milliseconds(10000)));
  CHECK(value_of(session, "t1", 1) == 4);
}

TEST_CASE("a placement naming no site, in a session without a site factory, is rejected by name", "[worker_update]") {
  Session session;
  session.add_site(make_worker(test::test_worker("w1")))
      .add_block(test::plugin_block("a", "affine", "w1"))
      .add_path(Path::chain("t1", {"a"}));
  test::require_started(session);
  auto v = session.apply(parse(R"({"blocks": [{"name": "a", "factory": "affine", "placement": "w1"},
                                              {"name": "b", "factory": "affine", "placement": "w9"}],
                                   "tasks": {"t1": ["a"], "t2": ["b"]}})"));
  REQUIRE_FALSE(v.ok());
  CHECK_THAT(std::string(v.status().message()),
             Contains("block 'b': placement 'w9' names no site, and the session has no site factory"));
  // The running worker takes new blocks without a factory.
  auto ok = session.apply(parse(R"({"blocks": [{"name": "a", "factory": "affine", "placement": "w1"},
                                               {"name": "b", "factory": "affine", "placement": "w1"}],
                                    "tasks": {"t1": ["a"], "t2": ["a", "b"]}})"));
  INFO(ok.status().ToString());
  REQUIRE(ok.ok());
  CHECK(value_of(session, "t2", 0) == 4);
}

TEST_CASE("a worker added with add_site() stays, idle, when an update removes its last block, and takes blocks again",
          "[worker_update]") {
  Session session;
  session.add_site(make_worker(test::test_worker("w1")))
      .add_block(test::plugin_block("a", "affine", "w1"))
      .add_path(Path::chain("t1", {"a"}));
  test::require_started(session);
  CHECK(value_of(session, "t1", 2) == 7);
  const std::int64_t pid = site(session.metrics(), "w1")->pid;
  REQUIRE(process_exists(pid));

  // The only block goes: the worker unloads it and stays (no factory made it, no deployment named it).
  auto emptied = session.apply(parse(R"({"blocks": [], "tasks": {}})"));
  INFO(emptied.status().ToString());
  REQUIRE(emptied.ok());
  CHECK(session.metrics().last_update.sites_stopped == 0);
  REQUIRE(site(session.metrics(), "w1") != nullptr);
  CHECK(site(session.metrics(), "w1")->pid == pid);
  CHECK(process_exists(pid));

  // A later update places a block there again: loaded into the same process.
  auto back = session.apply(parse(R"({"blocks": [{"name": "b", "factory": "affine", "placement": "w1"}],
                                      "tasks": {"t2": ["b"]}})"));
  INFO(back.status().ToString());
  REQUIRE(back.ok());
  CHECK(value_of(session, "t2", 1) == 4);
  CHECK(site(session.metrics(), "w1")->pid == pid);
  CHECK(site(session.metrics(), "w1")->restarts == 0);
}
