// What an on-demand budget bounds (SessionOptions::MemoryMeasure): the loaded blocks' footprints,
// or also what the process grew by beyond them (kProcess), read through the resident set's probe.
#include "test_util.hpp"

#include <blockflow/core/detail/resident_set.hpp>

#include <future>
#include <map>

using namespace blockflow;
using blockflow::detail::ResidentSet;

using blockflow::test::kMB;

namespace {

// Three blocks of 10 MB each under a budget of 30 MB; `rss` is what the probe reads.
struct ThreeBlocks {
  std::atomic<std::int64_t> rss{1000 * kMB};
  std::map<std::string, std::atomic<bool>> queued;  // requests wait for the block
  ResidentSet set;
  int a, b, c;
  explicit ThreeBlocks(bool process)
      : queued(), set(30 * kMB, [this] { return rss.load(); }, std::nullopt, process),
        a(add("a")), b(add("b")), c(add("c")) {}
  int add(const std::string& name) {
    queued[name] = false;
    return set.add(name, 10 * kMB, [name]() -> absl::StatusOr<std::shared_ptr<Block>> {
      return test::unary(name, [](const Tensor& x) { return x; });
    }, [this, name] { return queued.at(name).load(); });
  }
  void use(int id) {
    auto hold = set.hold(id);
    REQUIRE(hold.ok());
  }
  std::vector<bool> resident() const { return {set.state(a).resident, set.state(b).resident, set.state(c).resident}; }
};

}  // namespace

TEST_CASE("kBlocks: the loaded blocks' footprints fill the budget, whatever the process holds beside them", "[memory]") {
  ThreeBlocks t(/*process=*/false);
  t.use(t.a);
  t.use(t.b);
  t.rss = t.rss + 20 * kMB + 12 * kMB;  // the two blocks, and 12 MB that none accounts for
  t.use(t.c);                           // 30 MB of footprints: room for it
  CHECK(t.resident() == std::vector<bool>{true, true, true});
  CHECK(t.set.totals().evictions == 0);
  CHECK(t.set.totals().unaccounted_bytes == 0);
}

TEST_CASE("kProcess: what the process grew by beyond the blocks takes room too; idle blocks go, least recently used first",
          "[memory]") {
  ThreeBlocks t(/*process=*/true);
  t.use(t.a);
  t.use(t.b);
  t.rss = t.rss + 20 * kMB + 12 * kMB;
  // c needs 10 MB: 30 - 20 loaded - 12 unaccounted leaves -2; unloading a (8) is not enough, b too (18) is.
  t.use(t.c);
  CHECK(t.resident() == std::vector<bool>{false, false, true});
  CHECK(t.set.totals().evictions == 2);
  CHECK(t.set.totals().unaccounted_bytes == 12 * kMB);
  CHECK(t.set.totals().resident_bytes == 10 * kMB);
}

TEST_CASE("kProcess: growth that no unload can free is never a reason to wait; the block loads all the same",
          "[memory]") {
  ThreeBlocks t(/*process=*/true);
  t.use(t.a);
  t.rss = t.rss + 10 * kMB + 25 * kMB;  // 25 MB unaccounted: with every idle block gone, 5 MB of room
  auto loaded = std::async(std::launch::async, [&] {
    auto hold = t.set.hold(t.b);
    return hold.ok();
  });
  struct Unblock {  // should hold() wait on the growth, end that wait (the future's end joins it)
    ThreeBlocks& t;
    ~Unblock() { t.rss = 0; }
  } unblock{t};
  REQUIRE(loaded.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  CHECK(loaded.get());
  CHECK(t.resident() == std::vector<bool>{false, true, false});  // a went first, all the same
  CHECK(t.set.totals().evictions == 1);
}

TEST_CASE("kProcess: a running block is still never unloaded for it", "[memory]") {
  ThreeBlocks t(/*process=*/true);
  auto running = t.set.hold(t.a);  // held: running
  REQUIRE(running.ok());
  t.use(t.b);
  t.rss = t.rss + 20 * kMB + 5 * kMB;
  t.use(t.c);  // 30 - 20 - 5 < 10: b (idle) goes; a (running) stays
  CHECK(t.resident() == std::vector<bool>{true, false, true});
}

TEST_CASE("kProcess: a block with requests queued is not unloaded for the growth, only for the footprints", "[memory]") {
  ThreeBlocks t(/*process=*/true);
  t.use(t.a);
  t.use(t.b);
  t.queued["b"] = true;  // requests wait for b
  t.rss = t.rss + 20 * kMB + 12 * kMB;
  t.use(t.c);  // the footprints fit (30 MB); for the growth a (idle) goes, b (queued) stays
  CHECK(t.resident() == std::vector<bool>{false, true, true});
  CHECK(t.set.totals().evictions == 1);
}

TEST_CASE("kProcess: a prefetch loads only when idle blocks make room for the growth too; else nothing moves", "[memory]") {
  ThreeBlocks t(/*process=*/true);
  t.use(t.a);
  t.use(t.b);
  t.rss = t.rss + 20 * kMB + 25 * kMB;  // unloading a and b would leave 5 MB of room: not enough
  t.set.prefetch(t.c, {});
  CHECK(t.resident() == std::vector<bool>{true, true, false});
  CHECK(t.set.totals().evictions == 0);
  t.rss = t.rss - 20 * kMB;  // 5 MB unaccounted: unloading a makes the room
  t.set.prefetch(t.c, {});
  CHECK(t.resident() == std::vector<bool>{false, true, true});
  CHECK(t.set.totals().prefetches == 1);
}

TEST_CASE("kProcess: a block an update removed is resident until it is freed, not growth", "[memory]") {
  ThreeBlocks t(/*process=*/true);
  // 'gone' frees its memory slowly: its callable's last reference waits for the gate.
  struct SlowFree {
    std::shared_future<void> gate;
    std::atomic<bool>* freeing = nullptr;
    ~SlowFree() {
      if (freeing == nullptr) return;
      *freeing = true;
      gate.wait();
    }
  };
  std::promise<void> open;
  std::atomic<bool> freeing{false};
  auto slow = std::make_shared<SlowFree>();
  slow->gate = open.get_future().share();
  slow->freeing = &freeing;
  const int gone = t.set.add("gone", 10 * kMB, [&slow]() -> absl::StatusOr<std::shared_ptr<Block>> {
    return test::unary("gone", [s = std::exchange(slow, nullptr)](const Tensor& x) { return x; });
  }, [] { return false; });
  t.use(gone);
  t.use(t.b);
  t.rss = t.rss + 20 * kMB + 5 * kMB;  // 'gone', b, and 5 MB that none accounts for
  std::thread retiring([&] { t.set.retire(gone); });  // frees 'gone' on this thread: waits at the gate
  struct Join {  // the gate opens however the test ends
    std::promise<void>& open;
    std::thread& thread;
    ~Join() {
      open.set_value();
      thread.join();
    }
  } join{open, retiring};
  REQUIRE(test::eventually([&] { return freeing.load(); }));
  // c needs 10 MB: 30 - 10 (b) = 20 free, 5 of it growth. Counted as growth, 'gone' would make b go.
  t.use(t.c);
  CHECK(t.resident() == std::vector<bool>{false, true, true});
  CHECK(t.set.totals().evictions == 0);
  CHECK(t.set.totals().unaccounted_bytes == 5 * kMB);
}

TEST_CASE("in a session, metrics() say what the budget bounds and, measuring the process, the growth its last load saw",
          "[memory]") {
  static std::once_flag once;
  std::call_once(once, [] {
    BlockRegistry::global().add("measure_add_one", [](const std::string& name, const BlockOptions& options) {
      return Block::callable(name, [](Tensors&& in) -> absl::StatusOr<Tensors> { return Tensors{in.at(0) + 1}; }, options);
    });
  });
  // Two blocks of 2 MB (profiled) under 3 MB: one is loaded at a time, so each task's request loads its block.
  const auto make_session = [](SessionOptions::MemoryMeasure measure) {
    SessionOptions o;
    o.memory_budget = 3 * kMB;
    o.memory_policy = SessionOptions::MemoryPolicy::kOnDemand;
    o.memory_measure = measure;
    o.lanes = 1;
    auto session = std::make_unique<Session>(o);
    for (const std::string name : {"m_a", "m_b"}) {
      BlockDescription d;
      d.name = name;
      d.factory = "measure_add_one";
      d.options.memory_bytes = 2 * kMB;
      session->add_block(d).add_path(Path::chain("t_" + name, {name}));
    }
    return session;
  };

  SECTION("kBlocks") {
    auto session = make_session(SessionOptions::MemoryMeasure::kBlocks);
    REQUIRE(session->start().ok());
    std::vector<char> ballast(std::size_t{48} * kMB, 1);  // the process grows; the budget does not see it
    for (const std::string task : {"t_m_a", "t_m_b"}) REQUIRE(session->submit(task, at::zeros({2})).get().ok());
    const SiteMemory threads = test::site_memory(session->metrics(), "threads");
    REQUIRE(threads.policy == "on_demand");  // the entry is there (site_memory() gives defaults when not)
    CHECK(threads.measure == "blocks");
    CHECK(threads.unaccounted_bytes == 0);
    CHECK(ballast[ballast.size() - 1] == 1);
  }
  SECTION("kProcess") {
    auto session = make_session(SessionOptions::MemoryMeasure::kProcess);
    REQUIRE(session->start().ok());
    std::vector<char> ballast(std::size_t{48} * kMB, 1);  // 48 MB touched after start(): growth no block accounts for
    for (const std::string task : {"t_m_a", "t_m_b"}) {
      const Result r = session->submit(task, at::zeros({2})).get();
      REQUIRE(r.ok());
      CHECK(r.output()[0].item<float>() == 1.0F);
    }
    const MetricsSnapshot m = session->metrics();
    const SiteMemory threads = test::site_memory(m, "threads");
    REQUIRE(threads.policy == "on_demand");
    CHECK(threads.measure == "process");
    CHECK(threads.unaccounted_bytes >= 40 * kMB);  // the ballast, less what the blocks' footprints cover
    CHECK(threads.unaccounted_bytes < 256 * kMB);  // not the whole process (under TSan, 2 bytes of shadow per byte)
    CHECK_THAT(m.to_prometheus(), Catch::Matchers::Contains("blockflow_site_memory_unaccounted_bytes{site=\"threads\"}"));
    CHECK_THAT(m.to_json(), Catch::Matchers::Contains("\"measure\":\"process\""));
    auto back = MetricsSnapshot::from_json(m.to_json());
    REQUIRE(back.ok());
    CHECK(test::site_memory(*back, "threads").measure == "process");
    CHECK(test::site_memory(*back, "threads").unaccounted_bytes == threads.unaccounted_bytes);
    CHECK(ballast[ballast.size() - 1] == 1);
  }
}

TEST_CASE("a loader that throws something other than a std::exception fails the load, and the next one loads",
          "[memory]") {
  std::atomic<std::int64_t> rss{1000 * kMB};
  ResidentSet set(30 * kMB, [&] { return rss.load(); }, std::nullopt, false);
  std::atomic<int> tries{0};
  const int id = set.add("odd", 0, [&]() -> absl::StatusOr<std::shared_ptr<Block>> {
    if (++tries == 1) throw 42;
    rss += 5 * kMB;
    return test::unary("odd", [](const Tensor& x) { return x; });
  }, [] { return false; });
  auto first = set.hold(id);
  REQUIRE_FALSE(first.ok());
  CHECK_THAT(std::string(first.status().message()), Catch::Matchers::Contains("block 'odd': loading failed: an exception of unknown type"));
  CHECK(set.totals().resident_bytes == 0);
  auto second = std::async(std::launch::async, [&] { return set.hold(id).ok(); });  // used to wait for good
  REQUIRE(second.wait_for(std::chrono::seconds(30)) == std::future_status::ready);
  CHECK(second.get());
  CHECK(set.state(id).footprint_bytes == 5 * kMB);
}

TEST_CASE("a probe that cannot read (0) measures nothing: the block is neither refused nor charged the process",
          "[memory]") {
  std::atomic<std::int64_t> rss{0};  // /proc could not be read before the load
  ResidentSet set(30 * kMB, [&] { return rss.load(); }, std::nullopt, false);
  const int id = set.add("b", 0, [&]() -> absl::StatusOr<std::shared_ptr<Block>> {
    rss = 1005 * kMB;  // and could after it
    return test::unary("b", [](const Tensor& x) { return x; });
  }, [] { return false; });
  auto held = set.hold(id);
  INFO(held.status().ToString());
  REQUIRE(held.ok());  // was: measured as 1005 MB, over the budget, and refused for good
  CHECK(set.state(id).footprint_bytes == 0);
}

TEST_CASE("a block whose load grew nothing is known as a page: later loads are not measured again, nor refused",
          "[memory]") {
  std::atomic<std::int64_t> rss{1000 * kMB};
  ResidentSet set(20 * kMB, [&] { return rss.load(); }, std::nullopt, false);
  int tiny_loads = 0;
  const int tiny = set.add("tiny", 0, [&]() -> absl::StatusOr<std::shared_ptr<Block>> {
    if (++tiny_loads == 2) rss += 40 * kMB;  // another lane's activations, grown while it loads again
    return test::unary("tiny", [](const Tensor& x) { return x; });
  }, [] { return false; });
  auto plain = [](const std::string& name) {
    return [name]() -> absl::StatusOr<std::shared_ptr<Block>> { return test::unary(name, [](const Tensor& x) { return x; }); };
  };
  const int a = set.add("a", 10 * kMB, plain("a"), [] { return false; });
  const int b = set.add("b", 10 * kMB, plain("b"), [] { return false; });
  REQUIRE(set.hold(tiny).ok());  // grew 0
  CHECK(set.state(tiny).footprint_bytes == 4096);
  REQUIRE(set.hold(a).ok());
  REQUIRE(set.hold(b).ok());  // no room for b beside a and tiny: tiny, least recently used, goes
  REQUIRE_FALSE(set.state(tiny).resident);
  auto again = set.hold(tiny);  // its second load, beside 40 MB that others grew
  INFO(again.status().ToString());
  CHECK(again.ok());
  CHECK(set.state(tiny).footprint_bytes == 4096);
  CHECK(set.hold(tiny).ok());
}

TEST_CASE("a block measured over the room left unloads what idle blocks it can, though they do not bring the set "
          "within the budget",
          "[memory]") {
  std::atomic<std::int64_t> rss{1000 * kMB};
  ResidentSet set(30 * kMB, [&] { return rss.load(); }, std::nullopt, false);
  auto plain = [](const std::string& name) {
    return [name]() -> absl::StatusOr<std::shared_ptr<Block>> { return test::unary(name, [](const Tensor& x) { return x; }); };
  };
  const int idle = set.add("idle", 10 * kMB, plain("idle"), [] { return false; });
  const int running = set.add("running", 10 * kMB, plain("running"), [] { return false; });
  const int queued = set.add("queued", 5 * kMB, plain("queued"), [] { return true; });  // requests wait for it
  const int measured = set.add("measured", 0, [&]() -> absl::StatusOr<std::shared_ptr<Block>> {
    rss += 25 * kMB;  // 50 MB of 30 once it is in: the idle block's 10 MB go, the queued block's 5 MB would not do
    return test::unary("measured", [](const Tensor& x) { return x; });
  }, [] { return false; });
  REQUIRE(set.hold(queued).ok());
  REQUIRE(set.hold(idle).ok());
  auto run = set.hold(running);  // held: a request runs on it
  REQUIRE(run.ok());
  auto held = set.hold(measured);
  INFO(held.status().ToString());
  REQUIRE(held.ok());
  CHECK(set.state(measured).footprint_bytes == 25 * kMB);
  CHECK_FALSE(set.state(idle).resident);  // was: kept, as unloading it alone left the set over its budget
  CHECK(set.state(running).resident);
  CHECK(set.state(queued).resident);  // it would load again at once: not unloaded for a shortage it cannot end
  CHECK(set.totals().resident_bytes == 40 * kMB);
}
