// Loads that wait for room under an on-demand budget (ResidentSet::hold()): they are served in the
// order they came, and the first one claims the blocks it will unload, so that traffic on a busy
// block cannot hold a load off for ever.
#include "test_util.hpp"

#include <blockflow/core/detail/resident_set.hpp>

#include <future>
#include <map>

using namespace blockflow;
using blockflow::detail::ResidentSet;

using blockflow::test::kMB;

namespace {

// Blocks of the given sizes under `budget_mb`, each loaded by a loader that returns x + 1.
struct Blocks {
  ResidentSet set;
  std::map<std::string, int> id;
  Blocks(std::int64_t budget_mb, const std::map<std::string, std::int64_t>& sizes_mb)
      : set(budget_mb * kMB, [] { return std::int64_t{0}; }) {
    for (const auto& [name, mb] : sizes_mb) {
      id[name] = set.add(name, mb * kMB, [name = name]() -> absl::StatusOr<std::shared_ptr<Block>> {
        return test::unary(name, [](const Tensor& x) { return x + 1; });
      }, [] { return false; });
    }
  }
  bool resident(const std::string& name) const { return set.state(id.at(name)).resident; }
};

}  // namespace

TEST_CASE("a load waiting for room is not held off by traffic that always keeps its victim running", "[memory]") {
  Blocks t(20, {{"busy", 10}, {"big", 15}});  // 'big' fits only once 'busy' is unloaded
  std::atomic<bool> stop{false};
  std::atomic<int> holding{0};          // traffic threads holding 'busy' now (never more than its holders)
  std::atomic<int> traffic_errors{0};
  std::atomic<std::uint64_t> rounds{0};
  // Two threads take turns on 'busy' so that one always holds it: each lets go only once the other
  // holds it too, or after a second without that (the other cannot get it: the block is claimed).
  auto traffic = [&] {
    while (!stop.load()) {
      auto hold = t.set.hold(t.id.at("busy"));
      if (!hold.ok()) {
        ++traffic_errors;
        return;
      }
      ++holding;
      bool handed_over = false;
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(1000);
      while (!stop.load() && std::chrono::steady_clock::now() < deadline) {
        int n = holding.load();
        if (n >= 2 && holding.compare_exchange_strong(n, n - 1)) {
          handed_over = true;
          break;
        }
        std::this_thread::yield();
      }
      if (!handed_over) --holding;
      hold->reset();
      ++rounds;
    }
  };
  std::thread first(traffic);
  REQUIRE(test::eventually([&] { return rounds.load() > 0 && holding.load() > 0; }, std::chrono::seconds(10)));
  std::thread second(traffic);
  REQUIRE(test::eventually([&] { return rounds.load() > 10; }, std::chrono::seconds(10)));

  auto big = std::async(std::launch::async, [&] {
    auto hold = t.set.hold(t.id.at("big"));
    const bool during_traffic = !stop.load();
    return std::make_pair(hold.ok(), during_traffic);
  });
  // Before the fix the load waited for a moment with 'busy' idle, which this traffic never gives.
  const bool served = big.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  stop = true;
  first.join();
  second.join();
  const auto [loaded, during_traffic] = big.get();
  CHECK(served);
  CHECK(loaded);
  CHECK(during_traffic);
  CHECK(traffic_errors.load() == 0);
  CHECK(t.set.state(t.id.at("busy")).evictions >= 1);
  CHECK(t.set.state(t.id.at("big")).loads == 1);
  CHECK(t.set.totals().waiting_loads == 0);
  CHECK(t.set.totals().resident_bytes <= 20 * kMB);
}

TEST_CASE("loads waiting for room are served in the order they came; a block claimed for them takes no new hold",
          "[memory]") {
  Blocks t(10, {{"a", 10}, {"b", 10}, {"c", 10}});  // room for one at a time
  auto held = t.set.hold(t.id.at("a"));
  REQUIRE(held.ok());
  std::mutex mu;
  std::vector<std::string> order;
  auto use = [&](const std::string& name) {
    return std::async(std::launch::async, [&, name] {
      auto hold = t.set.hold(t.id.at(name));
      {
        std::lock_guard<std::mutex> lock(mu);
        order.push_back(hold.ok() ? name : name + ": " + hold.status().ToString());
      }
      return hold.ok();  // the hold goes here: the next waiting load may take its room
    });
  };
  auto b = use("b");  // waits for 'a', and claims it
  REQUIRE(test::eventually([&] { return t.set.totals().waiting_loads == 1; }, std::chrono::seconds(10)));
  auto c = use("c");  // waits behind 'b'
  REQUIRE(test::eventually([&] { return t.set.totals().waiting_loads == 2; }, std::chrono::seconds(10)));
  REQUIRE(test::eventually([&] { return t.set.state(t.id.at("a")).claimed; }, std::chrono::seconds(10)));
  auto a = use("a");  // 'a' is loaded, but claimed: this hold waits for it to go, then loads it again
  CHECK(a.wait_for(std::chrono::milliseconds(200)) == std::future_status::timeout);
  CHECK(t.resident("a"));
  held->reset();
  CHECK(b.get());
  CHECK(c.get());
  CHECK(a.get());
  CHECK(order == std::vector<std::string>{"b", "c", "a"});
  CHECK(t.set.state(t.id.at("a")).loads == 2);
  CHECK(t.set.totals().evictions == 3);
  CHECK(t.set.totals().waiting_loads == 0);
}

TEST_CASE("a waiting load that gives up (its block removed by an update) lets the next one claim and load", "[memory]") {
  Blocks t(10, {{"a", 10}, {"b", 10}, {"c", 10}});
  auto held = t.set.hold(t.id.at("a"));
  REQUIRE(held.ok());
  auto b = std::async(std::launch::async, [&] { return t.set.hold(t.id.at("b")).status(); });
  REQUIRE(test::eventually([&] { return t.set.totals().waiting_loads == 1; }, std::chrono::seconds(10)));
  auto c = std::async(std::launch::async, [&] { return t.set.hold(t.id.at("c")).status(); });
  REQUIRE(test::eventually([&] { return t.set.totals().waiting_loads == 2; }, std::chrono::seconds(10)));
  t.set.retire(t.id.at("b"));
  const absl::Status gone = b.get();
  CHECK(absl::IsFailedPrecondition(gone));
  CHECK_THAT(gone.ToString(), Catch::Contains("'b'"));
  // Nothing asks for 'b' any more: the set forgets it, and its id finds nothing.
  CHECK(t.set.totals().entries == 2);
  CHECK(absl::IsFailedPrecondition(t.set.hold(t.id.at("b")).status()));
  CHECK(t.set.state(t.id.at("b")).name.empty());
  CHECK(c.wait_for(std::chrono::milliseconds(200)) == std::future_status::timeout);  // 'a' still runs
  held->reset();
  CHECK(c.get().ok());
  CHECK(t.resident("c"));
  CHECK_FALSE(t.resident("a"));
  CHECK(t.set.totals().waiting_loads == 0);
}

TEST_CASE("a load whose block another load is bringing in does not hold up the loads behind it", "[memory]") {
  ResidentSet set(20 * kMB, [] { return std::int64_t{0}; });
  std::promise<void> open;
  std::shared_future<void> gate = open.get_future().share();
  std::atomic<bool> building{false};
  auto quick = [](const std::string& name) {
    return [name]() -> absl::StatusOr<std::shared_ptr<Block>> { return test::unary(name, [](const Tensor& x) { return x; }); };
  };
  const int a = set.add("a", 10 * kMB, quick("a"), [] { return false; });
  const int y = set.add("y", 15 * kMB, [&]() -> absl::StatusOr<std::shared_ptr<Block>> {
    building = true;
    gate.wait();  // a slow build
    return test::unary("y", [](const Tensor& x) { return x; });
  }, [] { return false; });
  const int z = set.add("z", 5 * kMB, quick("z"), [] { return false; });
  struct Open {  // the build ends however the test does
    std::promise<void>& open;
    ~Open() {
      try {
        open.set_value();
      } catch (const std::future_error&) {
      }
    }
  } opener{open};
  auto held = set.hold(a);
  REQUIRE(held.ok());
  auto first = std::async(std::launch::async, [&] { return set.hold(y).ok(); });  // waits for a's room
  REQUIRE(test::eventually([&] { return set.totals().waiting_loads == 1; }, std::chrono::seconds(10)));
  auto second = std::async(std::launch::async, [&] { return set.hold(y).ok(); });  // waits behind it
  REQUIRE(test::eventually([&] { return set.totals().waiting_loads == 2; }, std::chrono::seconds(10)));
  held->reset();  // 'first' unloads a and builds y; 'second' now waits only for that build
  REQUIRE(test::eventually([&] { return building.load(); }, std::chrono::seconds(10)));
  // z fits beside y's reservation (15 + 5 of 20): it loads while y is still being built.
  auto third = std::async(std::launch::async, [&] { return set.hold(z).ok(); });
  CHECK(third.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  CHECK(building.load());
  CHECK_FALSE(set.state(y).resident);
  open.set_value();
  CHECK(first.get());
  CHECK(second.get());
  CHECK(third.get());
  CHECK(set.state(y).loads == 1);
  CHECK(set.totals().waiting_loads == 0);
}

TEST_CASE("a load that waits for room and fails with an exception leaves the queue: the next load is not held up",
          "[memory]") {
  ResidentSet set(10 * kMB, [] { return std::int64_t{0}; });
  std::atomic<bool> fail{false};
  auto quick = [](const std::string& name) {
    return [name]() -> absl::StatusOr<std::shared_ptr<Block>> { return test::unary(name, [](const Tensor& x) { return x; }); };
  };
  // 'idle' answers whether requests wait for it by throwing, once told to: what make_room reads.
  const int idle = set.add("idle", 5 * kMB, quick("idle"), [&fail] {
    if (fail.load()) throw std::runtime_error("queue gone");
    return false;
  });
  const int running = set.add("running", 5 * kMB, quick("running"), [] { return false; });
  const int big = set.add("big", 10 * kMB, quick("big"), [] { return false; });
  REQUIRE(set.hold(idle).ok());  // loaded, then idle
  auto held = set.hold(running);
  REQUIRE(held.ok());
  // Room for 'big' needs both: 'running' is held, so the load waits, its ticket first in the queue.
  auto failing = std::async(std::launch::async, [&] { return set.hold(big).ok(); });
  REQUIRE(test::eventually([&] { return set.totals().waiting_loads == 1; }, std::chrono::seconds(10)));
  fail = true;  // its next look at 'idle' (within 100 ms) throws
  CHECK_THROWS_AS(failing.get(), std::runtime_error);
  CHECK(set.totals().waiting_loads == 0);
  fail = false;
  held->reset();
  auto next = std::async(std::launch::async, [&] { return set.hold(big).ok(); });
  REQUIRE(next.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  CHECK(next.get());
  CHECK(set.state(big).resident);
}

TEST_CASE("blocks added and removed by updates, again and again: the set forgets each once nothing uses it", "[memory]") {
  ResidentSet set(10 * kMB, [] { return std::int64_t{0}; });
  const int keep = set.add("keep", 5 * kMB, [] { return test::unary("keep", [](const Tensor& x) { return x; }); },
                           [] { return false; });
  REQUIRE(set.hold(keep).ok());
  for (int i = 0; i < 1000; ++i) {
    const std::string name = "b" + std::to_string(i);
    const int id = set.add(name, 5 * kMB, [name] { return test::unary(name, [](const Tensor& x) { return x; }); },
                           [] { return false; });
    auto hold = set.hold(id);
    REQUIRE(hold.ok());
    set.retire(id);                            // held: unloaded when the hold goes
    CHECK(set.totals().entries == 2);
    hold->reset();
    CHECK(set.totals().entries == 1);          // then forgotten
    CHECK(set.totals().resident_bytes == 5 * kMB);
  }
  CHECK(set.state(keep).resident);
}

TEST_CASE("a block removed while its first load measures it over the budget is forgotten all the same", "[memory]") {
  std::atomic<std::int64_t> rss{100 * kMB};
  ResidentSet set(10 * kMB, [&rss] { return rss.load(); });
  std::promise<void> open;
  std::shared_future<void> gate = open.get_future().share();
  std::atomic<bool> building{false};
  const int id = set.add("unmeasured", 0, [&]() -> absl::StatusOr<std::shared_ptr<Block>> {
    building = true;
    gate.wait();
    rss += 20 * kMB;  // what the load leaves resident: twice the budget
    return test::unary("unmeasured", [](const Tensor& x) { return x; });
  }, [] { return false; });
  auto load = std::async(std::launch::async, [&] { return set.hold(id).status(); });
  REQUIRE(test::eventually([&] { return building.load(); }, std::chrono::seconds(10)));
  set.retire(id);  // while it loads
  CHECK(set.totals().entries == 1);
  open.set_value();
  const absl::Status status = load.get();
  CHECK(absl::IsResourceExhausted(status));
  CHECK_THAT(status.ToString(), Catch::Contains("over the memory budget"));
  CHECK(set.totals().entries == 0);
  CHECK(set.totals().resident_bytes == 0);
}
