// Live system updates (Session::apply): new blocks are loaded before traffic reaches them, tasks are
// re-routed at once, removed blocks drain first, unchanged blocks are untouched, invalid updates
// change nothing, and under continuous traffic with 100 random updates every request resolves
// exactly once with the value of the path it took.
#include "test_util.hpp"

#include <blockflow/deploy/deployment.hpp>
#include <blockflow/core/kpi.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <set>

using namespace blockflow;
using Catch::Matchers::Contains;
using namespace std::chrono_literals;

namespace {

using test::parse;
using test::processed;
using test::value_of;

void start_with(Session& session, const Deployment& d) {
  for (const auto& b : d.blocks) session.add_block(b);
  for (auto& p : d.paths()) session.add_path(std::move(p));
  test::require_started(session);
}

}  // namespace

TEST_CASE("apply adds blocks and tasks, re-routes, removes; unchanged blocks keep running", "[update]") {
  test::register_update_factories();
  Session session;
  start_with(session, parse(R"({"blocks": [{"name": "a", "factory": "upd_add_1"}, {"name": "b", "factory": "upd_add_2"}],
                                "tasks": {"t1": ["a", "b"]}})"));
  CHECK(value_of(session, "t1") == 3);
  CHECK(session.metrics().version == 0);

  auto v1 = session.apply(parse(R"({"blocks": [{"name": "a", "factory": "upd_add_1"}, {"name": "b", "factory": "upd_add_2"},
                                              {"name": "c", "factory": "upd_add_4"}],
                                   "tasks": {"t1": ["a", "b"], "t2": ["a", "c"]}})"));
  INFO(v1.status().ToString());
  REQUIRE(v1.ok());
  CHECK(*v1 == 1);
  CHECK(value_of(session, "t2") == 5);
  CHECK(value_of(session, "t1") == 3);
  auto m = session.metrics();
  CHECK(m.version == 1);
  CHECK(m.blocks.size() == 3);
  CHECK(processed(m, "a") == 3);  // counted since start(): block 'a' was not rebuilt

  // Re-route t1 through c, drop b; 'a' listed by bare name is kept as it is.
  auto v2 = session.apply(parse(R"({"blocks": ["a", {"name": "c", "factory": "upd_add_4"}],
                                   "tasks": {"t1": ["a", "c"]}})"));
  REQUIRE(v2.ok());
  CHECK(value_of(session, "t1") == 5);
  Result gone = session.submit("t2", at::zeros({1})).get();
  CHECK(absl::IsNotFound(gone.status));
  CHECK_THAT(std::string(gone.status.message()), Contains("unknown task 't2' (known: t1)"));
  m = session.metrics();
  CHECK(m.blocks.size() == 2);
  CHECK(processed(m, "a") == 4);  // the t2 request was refused before reaching it

  // A changed block is replaced: same name, another factory.
  REQUIRE(session.apply(parse(R"({"blocks": ["a", {"name": "c", "factory": "upd_add_8"}], "tasks": {"t1": ["a", "c"]}})")).ok());
  CHECK(value_of(session, "t1") == 9);
  CHECK(session.metrics().version == 3);
}

TEST_CASE("an invalid update is rejected whole, naming the problem; nothing changes", "[update]") {
  test::register_update_factories();
  Session session;
  start_with(session, parse(R"({"blocks": [{"name": "a", "factory": "upd_add_1"}], "tasks": {"t": ["a"]}})"));
  const auto before = session.metrics().to_json();
  auto reject = [&](const std::string& json) {
    auto d = Deployment::parse(json, "/nowhere");
    REQUIRE(d.ok());
    auto v = session.apply(*d);
    REQUIRE_FALSE(v.ok());
    CHECK(absl::IsInvalidArgument(v.status()));
    CHECK(value_of(session, "t") == 1);
    CHECK(session.metrics().version == 0);
    CHECK(session.metrics().blocks.size() == 1);
    return std::string(v.status().message());
  };
  CHECK_THAT(reject(R"({"blocks": ["a", {"name": "m", "torchscript": "missing.pt"}], "tasks": {"t": ["a", "m"]}})"),
             Contains("update 1 rejected, nothing changed") && Contains("missing.pt"));
  CHECK_THAT(reject(R"({"blocks": ["a", {"name": "f", "factory": "no_such_factory"}], "tasks": {"t": ["f"]}})"),
             Contains("no_such_factory"));
  CHECK_THAT(reject(R"({"blocks": ["a", {"name": "g", "factory": "upd_add_2", "device": "cuda:3"}], "tasks": {"t": ["g"]}})"),
             Contains("block 'g': device 'cuda:3' is not present"));
  CHECK_THAT(reject(R"({"blocks": ["a", {"name": "w", "factory": "upd_add_2", "placement": "w9"}], "tasks": {"t": ["a"]}})"),
             Contains("block 'w': placement 'w9' names no site, and the session has no site factory"));
  // Paths are checked against the new block set (the parser already refuses unknown blocks and
  // cycles inside one document; the session refuses a task with a block that the update removes).
  Deployment removes_used;
  removes_used.blocks = {};
  removes_used.tasks = {{"t", {"a"}}};
  auto v = session.apply(removes_used);
  REQUIRE_FALSE(v.ok());
  CHECK_THAT(std::string(v.status().message()), Contains("unknown block 'a'"));
  CHECK(value_of(session, "t") == 1);
}

TEST_CASE("a removed block is drained before it stops; past the drain time, what waits fails named", "[update]") {
  test::register_update_factories();
  Session session;
  start_with(session, parse(R"({"blocks": [{"name": "a", "factory": "upd_add_1"}, {"name": "slow", "factory": "upd_slow_20"}],
                                "tasks": {"quick": ["a"], "s": ["a", "slow"]}})"));
  std::vector<std::future<Result>> in_flight;
  for (int i = 0; i < 6; ++i) in_flight.push_back(session.submit("s", at::zeros({1})));
  REQUIRE(session.apply(parse(R"({"blocks": ["a"], "tasks": {"quick": ["a"]}})"), absl::Seconds(10)).ok());
  for (auto& f : in_flight) {
    Result r = f.get();
    INFO(r.status.ToString());
    CHECK(r.ok());  // all 6 finished on the path they started with (6 x 20 ms < 10 s)
    if (r.ok()) CHECK(r.output().item<double>() == 1001);
  }
  CHECK(session.metrics().blocks.size() == 1);

  // Now with no drain time: the queued ones fail with the removed block's name.
  REQUIRE(session.apply(parse(R"({"blocks": ["a", {"name": "slow", "factory": "upd_slow_300"}],
                                  "tasks": {"quick": ["a"], "s": ["a", "slow"]}})")).ok());
  in_flight.clear();
  for (int i = 0; i < 4; ++i) in_flight.push_back(session.submit("s", at::zeros({1})));
  std::this_thread::sleep_for(50ms);  // all 4 past 'a', queued at or running in 'slow'
  REQUIRE(session.apply(parse(R"({"blocks": ["a"], "tasks": {"quick": ["a"]}})"), absl::ZeroDuration()).ok());
  int failed = 0;
  for (auto& f : in_flight) {
    Result r = f.get();
    if (!r.ok()) {
      ++failed;
      CHECK(absl::IsCancelled(r.status));
      CHECK_THAT(std::string(r.status.message()), Contains("block 'slow': removed by update 3"));
    }
  }
  CHECK(failed >= 1);
  CHECK(value_of(session, "quick") == 1);
}

TEST_CASE("100 random updates under traffic on three tasks: every request resolves once, values match a path", "[update]") {
  test::register_update_factories();
  const std::vector<int> constants = {1, 2, 4, 8, 16, 32, 64, 128};  // a path's sum names its blocks
  const std::vector<std::string> tasks = {"t0", "t1", "t2"};
  const std::int64_t threads_before = sample_process().threads;
  std::mt19937 random(7);
  auto random_update = [&]() {
    std::vector<int> chosen;
    for (int k : constants) {
      if (random() % 2 == 0) chosen.push_back(k);
    }
    if (chosen.empty()) chosen.push_back(constants[random() % constants.size()]);
    nlohmann::json blocks = nlohmann::json::array(), paths = nlohmann::json::object();
    for (int k : chosen) blocks.push_back({{"name", "b" + std::to_string(k)}, {"factory", "upd_add_" + std::to_string(k)}});
    for (const auto& t : tasks) {
      if (random() % 4 == 0) continue;  // this task absent in this version
      std::vector<int> order = chosen;
      std::shuffle(order.begin(), order.end(), random);
      order.resize(1 + random() % order.size());
      nlohmann::json chain = nlohmann::json::array();
      for (int k : order) chain.push_back("b" + std::to_string(k));
      paths[t] = chain;
    }
    return nlohmann::json{{"blocks", blocks}, {"tasks", paths}}.dump();
  };
  // Which sums each task may produce: every chain it had in any version.
  std::mutex mu;
  std::map<std::string, std::set<int>> valid;
  auto remember = [&](const Deployment& d) {
    std::lock_guard lock(mu);
    for (const auto& [task, chain] : d.tasks) {
      int sum = 0;
      for (const auto& b : chain) sum += std::stoi(b.substr(1));
      valid[task].insert(sum);
    }
  };
  // Every request's count of completions, checked once the session is gone: a late second one
  // (resolved again at shutdown, say) counts too.
  std::vector<std::shared_ptr<std::atomic<int>>> all_calls;
  std::mutex calls_mu;
  {
    Session session;
    Deployment first = parse(R"({"blocks": [{"name": "b1", "factory": "upd_add_1"}],
                                 "tasks": {"t0": ["b1"], "t1": ["b1"], "t2": ["b1"]}})");
    remember(first);
    start_with(session, first);
    std::atomic<bool> run{true};
    std::atomic<int> submitted{0}, resolved{0}, ok{0}, absent{0}, bad{0}, twice{0};
    std::string sample;
    std::vector<std::thread> clients;
    for (int c = 0; c < 3; ++c) {
      clients.emplace_back([&, c] {
        while (run) {
          const std::string& task = tasks[static_cast<std::size_t>(c)];
          auto calls = std::make_shared<std::atomic<int>>(0);
          {
            std::lock_guard lock(calls_mu);
            all_calls.push_back(calls);
          }
          std::promise<Result> promise;
          auto future = promise.get_future();
          ++submitted;
          session.submit(task, {at::zeros({1})}, [calls, p = std::make_shared<std::promise<Result>>(std::move(promise))](Result&& r) {
            if (calls->fetch_add(1) == 0) p->set_value(std::move(r));
          });
          Result r = future.get();
          ++resolved;
          if (calls->load() != 1) ++twice;
          if (r.ok()) {
            const int sum = static_cast<int>(r.output().item<double>());
            std::lock_guard lock(mu);
            if (valid[task].count(sum) != 0) ++ok;
            else {
              ++bad;
              sample = task + " gave " + std::to_string(sum);
            }
          } else if (absl::IsNotFound(r.status) ||
                     std::string(r.status.message()).find("removed by update") != std::string::npos) {
            ++absent;
          } else {
            ++bad;
            std::lock_guard lock(mu);
            sample = r.status.ToString();
          }
        }
      });
    }
    for (int u = 0; u < 100; ++u) {
      Deployment d = parse(random_update());
      remember(d);  // before apply: a request may take the new path as soon as it is published
      auto v = session.apply(d, absl::Seconds(5));
      INFO(v.status().ToString());
      REQUIRE(v.ok());
      REQUIRE(*v == static_cast<std::uint64_t>(u + 1));
    }
    std::this_thread::sleep_for(50ms);
    run = false;
    for (auto& c : clients) c.join();
    INFO(sample);
    CHECK(resolved.load() == submitted.load());
    CHECK(twice.load() == 0);
    CHECK(bad.load() == 0);
    CHECK(ok.load() > 100);
    CHECK(session.metrics().version == 100);
    CHECK(session.metrics().blocks.size() <= constants.size());
  }
  CHECK(std::count_if(all_calls.begin(), all_calls.end(), [](const auto& c) { return c->load() != 1; }) == 0);
  // No thread left behind by the blocks that came and went.
  CHECK(sample_process().threads <= threads_before + 1);
}
