// Blocks loaded on demand under a memory budget (SessionOptions::MemoryPolicy::kOnDemand, and
// WorkerOptions::memory_policy in a worker process): least recently used blocks make room, a running
// block is never unloaded, a block larger than the whole budget is refused naming it, and a
// request's trace shows its load apart from its compute.
#include "test_util.hpp"
#include "worker_util.hpp"

#include <blockflow/core/detail/resident_set.hpp>

#include <atomic>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <thread>

using namespace blockflow;
using Catch::Matchers::Contains;

namespace {

using test::kMB;

// How many times each block was built (loaded), by name.
std::mutex built_mu;
std::map<std::string, int> built;

int times_built(const std::string& name) {
  std::lock_guard<std::mutex> lock(built_mu);
  return built[name];
}

// A gate a block's forward() waits at, and whether one has arrived there.
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = true;
  bool arrived = false;
};
Gate gate;

// Makes the next od_gate forward() wait.
void close_gate() {
  std::lock_guard<std::mutex> lock(gate.mu);
  gate.open = false;
  gate.arrived = false;
}

// Until an od_gate forward() waits at the closed gate.
void wait_at_gate() {
  std::unique_lock<std::mutex> lock(gate.mu);
  gate.cv.wait(lock, [] { return gate.arrived; });
}

void open_gate() {
  {
    std::lock_guard<std::mutex> lock(gate.mu);
    gate.open = true;
  }
  gate.cv.notify_all();
}

void register_on_demand_factories() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Adds the position of the last letter of its name ('a' adds 1, 'b' 2, ...).
    BlockRegistry::global().add("od_add", [](const std::string& name, const BlockOptions& options) {
      {
        std::lock_guard<std::mutex> lock(built_mu);
        ++built[name];
      }
      const float add = static_cast<float>(name.back() - 'a' + 1);
      return Block::callable(name, [add](Tensors&& in) -> absl::StatusOr<Tensors> { return Tensors{in.at(0) + add}; },
                             options);
    });
    // Doubles, after waiting at the gate.
    BlockRegistry::global().add("od_gate", [](const std::string& name, const BlockOptions& options) {
      {
        std::lock_guard<std::mutex> lock(built_mu);
        ++built[name];
      }
      return Block::callable(name, [](Tensors&& in) -> absl::StatusOr<Tensors> {
        std::unique_lock<std::mutex> lock(gate.mu);
        gate.arrived = true;
        gate.cv.notify_all();
        gate.cv.wait(lock, [] { return gate.open; });
        return Tensors{in.at(0) * 2};
      }, options);
    });
    // Holds 40 MB of weights of its own.
    BlockRegistry::global().add("od_heavy", [](const std::string& name, const BlockOptions& options) {
      auto weights = at::ones({10 * 1024 * 1024});
      return Block::callable(name, [weights](Tensors&& in) -> absl::StatusOr<Tensors> { return Tensors{in.at(0) + weights[0]}; },
                             options);
    });
  });
}

BlockDescription described(const std::string& name, const std::string& factory, std::int64_t memory_mb) {
  BlockDescription d;
  d.name = name;
  d.factory = factory;
  d.options.memory_bytes = memory_mb * kMB;
  return d;
}

SessionOptions on_demand(std::int64_t budget_mb, int lanes) {
  SessionOptions o;
  o.memory_budget = budget_mb * kMB;
  o.memory_policy = SessionOptions::MemoryPolicy::kOnDemand;
  o.lanes = lanes;
  return o;
}

const BlockMetrics& block_in(const MetricsSnapshot& m, const std::string& name) {
  for (const auto& b : m.blocks) {
    if (b.name == name) return b;
  }
  FAIL("no block " << name);
  throw std::logic_error("unreachable");
}

const SiteMemory& threads_memory(const MetricsSnapshot& m) {
  for (const auto& s : m.memory) {
    if (s.site == "threads") return s;
  }
  FAIL("no memory figures for the threads");
  throw std::logic_error("unreachable");
}

std::vector<bool> resident(const MetricsSnapshot& m, const std::vector<std::string>& names) {
  std::vector<bool> out;
  for (const auto& n : names) out.push_back(block_in(m, n).resident);
  return out;
}

}  // namespace

TEST_CASE("on demand: a budget for two of four blocks loads them as requests need them, least recently used out", "[memory]") {
  register_on_demand_factories();
  Session session(on_demand(25, 1));
  for (const std::string name : {"a", "b", "c", "d"}) {
    session.add_block(described("lru_" + name, "od_add", 10)).add_path(Path::chain("t" + name, {"lru_" + name}));
  }
  REQUIRE(session.start().ok());
  const std::vector<std::string> names = {"lru_a", "lru_b", "lru_c", "lru_d"};
  // start() loads each once, in order: the last two stay.
  auto m = session.metrics();
  CHECK(resident(m, names) == std::vector<bool>{false, false, true, true});
  CHECK(threads_memory(m).policy == "on_demand");
  CHECK(threads_memory(m).budget_bytes == 25 * kMB);
  CHECK(threads_memory(m).resident_bytes == 20 * kMB);
  CHECK(threads_memory(m).loads == 4);
  CHECK(threads_memory(m).evictions == 2);

  // a is loaded for its request; c, the least recently used, makes room.
  Result r = session.submit("ta", at::zeros({2})).get();
  REQUIRE(r.ok());
  CHECK(r.output()[0].item<float>() == 1.0f);
  REQUIRE(r.trace.hops.size() == 1);
  const HopTiming& hop = r.trace.hops[0];
  CHECK(hop.load_start_ns >= hop.dequeued_ns);
  CHECK(hop.load_end_ns > hop.load_start_ns);
  CHECK(hop.compute_start_ns >= hop.load_end_ns);
  CHECK(r.trace.load_ms() > 0);
  CHECK(r.trace.wait_ms() + r.trace.load_ms() + r.trace.compute_ms() + r.trace.overhead_ms() ==
        Approx(r.trace.e2e_ms()).epsilon(1e-9));
  CHECK(resident(session.metrics(), names) == std::vector<bool>{true, false, false, true});

  // b next: d is now the least recently used.
  REQUIRE(session.submit("tb", at::zeros({2})).get().output()[0].item<float>() == 2.0f);
  CHECK(resident(session.metrics(), names) == std::vector<bool>{true, true, false, false});
  // a again: loaded already, nothing moves.
  REQUIRE(session.submit("ta", at::zeros({2})).get().output()[0].item<float>() == 1.0f);
  m = session.metrics();
  CHECK(resident(m, names) == std::vector<bool>{true, true, false, false});
  CHECK(threads_memory(m).loads == 6);
  CHECK(threads_memory(m).evictions == 4);
  CHECK(threads_memory(m).bytes_loaded == 60 * kMB);
  CHECK(block_in(m, "lru_a").loads == 2);
  CHECK(block_in(m, "lru_c").evictions == 1);
  CHECK(block_in(m, "lru_a").on_demand);
  CHECK(block_in(m, "lru_a").footprint_bytes == 10 * kMB);
  CHECK(block_in(m, "lru_a").last_use_s > block_in(m, "lru_d").last_use_s);
  CHECK(times_built("lru_a") == 2);
  CHECK(times_built("lru_c") == 1);
  const std::string prom = m.to_prometheus();
  CHECK_THAT(prom, Contains("blockflow_site_block_evictions_total{site=\"threads\"} 4"));
  CHECK_THAT(prom, Contains("blockflow_block_resident{block=\"lru_c\",placement=\"threads\",device=\"cpu\"} 0"));
  auto back = MetricsSnapshot::from_json(m.to_json());
  REQUIRE(back.ok());
  CHECK(back->to_json() == m.to_json());
}

TEST_CASE("on demand: a running block is never unloaded; the load that needs its room waits for it", "[memory]") {
  register_on_demand_factories();
  Session session(on_demand(15, 2));  // room for one block at a time, two lanes
  session.add_block(described("held", "od_gate", 10)).add_block(described("other", "od_add", 10));
  session.add_path(Path::chain("held_task", {"held"})).add_path(Path::chain("other_task", {"other"}));
  REQUIRE(session.start().ok());
  CHECK(resident(session.metrics(), {"held", "other"}) == std::vector<bool>{false, true});
  close_gate();
  auto running = session.submit("held_task", at::ones({1}));
  wait_at_gate();
  auto waiting = session.submit("other_task", at::ones({1}));
  // The second lane takes it, and cannot load 'other' while 'held' computes.
  CHECK(waiting.wait_for(std::chrono::milliseconds(300)) == std::future_status::timeout);
  CHECK(resident(session.metrics(), {"held", "other"}) == std::vector<bool>{true, false});
  open_gate();
  CHECK(running.get().output()[0].item<float>() == 2.0f);
  Result r = waiting.get();
  REQUIRE(r.ok());
  CHECK(r.output()[0].item<float>() == 19.0f);  // 'other' ends in 'r': adds 18
  CHECK(resident(session.metrics(), {"held", "other"}) == std::vector<bool>{false, true});
  CHECK(block_in(session.metrics(), "held").evictions == 2);
}

TEST_CASE("on demand: every request resolves while four blocks share room for two, from several threads", "[memory]") {
  register_on_demand_factories();
  Session session(on_demand(25, 2));
  const std::vector<std::string> letters = {"a", "b", "c", "d"};
  for (const auto& l : letters) {
    session.add_block(described("many_" + l, "od_add", 10));
    session.add_block(described("next_" + l, "od_add", 1));  // 'next_x' adds x's position too
    session.add_path(Path::chain("task_" + l, {"many_" + l, "next_" + l}));
  }
  REQUIRE(session.start().ok());
  constexpr int kPerThread = 40;
  std::vector<std::thread> clients;
  std::atomic<int> wrong{0}, failed{0};
  for (int c = 0; c < 4; ++c) {
    clients.emplace_back([&, c] {
      for (int i = 0; i < kPerThread; ++i) {
        const std::size_t k = static_cast<std::size_t>((i + c) % 4);
        Result r = session.submit("task_" + letters[k], at::zeros({1})).get();
        if (!r.ok()) {
          ++failed;
          continue;
        }
        if (r.output()[0].item<float>() != 2.0f * static_cast<float>(k + 1)) ++wrong;
      }
    });
  }
  for (auto& t : clients) t.join();
  CHECK(failed.load() == 0);
  CHECK(wrong.load() == 0);
  const auto m = session.metrics();
  CHECK(threads_memory(m).resident_bytes <= 25 * kMB);
  CHECK(threads_memory(m).evictions > 0);
  CHECK(threads_memory(m).loads == threads_memory(m).evictions + [&] {
          std::uint64_t loaded = 0;
          for (const auto& b : m.blocks) loaded += b.resident ? 1 : 0;
          return loaded;
        }());
  for (const auto& p : m.paths) CHECK(p.completed == 40);
}

TEST_CASE("on demand: a block larger than the whole budget is refused at start(), named", "[memory]") {
  register_on_demand_factories();
  SECTION("by its profile, before anything loads") {
    Session session(on_demand(20, 1));
    session.add_block(described("small", "od_add", 5)).add_block(described("big_profiled", "od_add", 30));
    session.add_path(Path::chain("t", {"small", "big_profiled"}));
    const auto status = session.start();
    CHECK(status.code() == absl::StatusCode::kResourceExhausted);
    CHECK_THAT(std::string(status.message()), Contains("block 'big_profiled': its profiled memory is 30.0 MB"));
    CHECK_THAT(std::string(status.message()), Contains("memory budget of 20.0 MB"));
    CHECK(times_built("big_profiled") == 0);
  }
  SECTION("by what its first load took, when it has no profile") {
    Session session(on_demand(20, 1));
    session.add_block(described("big_measured", "od_heavy", 0)).add_path(Path::chain("t", {"big_measured"}));
    const auto status = session.start();
    CHECK(status.code() == absl::StatusCode::kResourceExhausted);
    CHECK_THAT(std::string(status.message()), Contains("block 'big_measured': loading it took"));
    CHECK_THAT(std::string(status.message()), Contains("over the memory budget of 20.0 MB"));
  }
  SECTION("without a budget, the policy is refused") {
    Session session(on_demand(0, 1));
    session.add_block(described("x", "od_add", 5)).add_path(Path::chain("t", {"x"}));
    const auto status = session.start();
    CHECK(status.code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(status.message()), Contains("memory_policy kOnDemand needs a memory_budget"));
  }
}

TEST_CASE("on demand: apply() loads an added block once (unloading others to fit) and unloads a removed one", "[memory]") {
  register_on_demand_factories();
  Session session(on_demand(25, 1));
  session.add_block(described("upd_a", "od_add", 10)).add_block(described("upd_b", "od_add", 10));
  session.add_path(Path::chain("ta", {"upd_a"})).add_path(Path::chain("tb", {"upd_b"}));
  REQUIRE(session.start().ok());
  CHECK(resident(session.metrics(), {"upd_a", "upd_b"}) == std::vector<bool>{true, true});
  auto parsed = Deployment::parse(R"({"blocks": [{"name": "upd_a", "factory": "od_add", "memory_bytes": 10485760},
                                                {"name": "upd_c", "factory": "od_add", "memory_bytes": 10485760}],
                                     "tasks": {"ta": ["upd_a"], "tc": ["upd_c"]}})", "/nowhere");
  REQUIRE(parsed.ok());
  auto v = session.apply(*parsed);
  INFO(v.status().ToString());
  REQUIRE(v.ok());
  // upd_c loaded while upd_a and upd_b were still there: upd_a, the least recently used, made room;
  // then upd_b went with the update, and its memory with it.
  auto m = session.metrics();
  CHECK(resident(m, {"upd_a", "upd_c"}) == std::vector<bool>{false, true});
  CHECK(threads_memory(m).resident_bytes == 10 * kMB);
  CHECK(times_built("upd_c") == 1);
  CHECK(session.submit("tc", at::zeros({1})).get().output()[0].item<float>() == 3.0f);
  CHECK(session.submit("ta", at::zeros({1})).get().output()[0].item<float>() == 1.0f);
  m = session.metrics();
  CHECK(resident(m, {"upd_a", "upd_c"}) == std::vector<bool>{true, true});
  CHECK(threads_memory(m).resident_bytes == 20 * kMB);
  CHECK(times_built("upd_c") == 1);  // no reload: both fit now

  auto too_big = Deployment::parse(R"({"blocks": [{"name": "upd_a", "factory": "od_add", "memory_bytes": 10485760},
                                                 {"name": "upd_huge", "factory": "od_add", "memory_bytes": 31457280}],
                                      "tasks": {"ta": ["upd_a"], "th": ["upd_huge"]}})", "/nowhere");
  REQUIRE(too_big.ok());
  const auto refused = session.apply(*too_big);
  CHECK(refused.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(refused.status().message()), Contains("block 'upd_huge': its profiled memory is 30.0 MB"));
  CHECK(session.submit("tc", at::zeros({1})).get().ok());  // the session goes on as it was
}

TEST_CASE("on demand: a block an update removed is never loaded again, and makes no room decision after it is freed",
          "[memory]") {
  register_on_demand_factories();
  Session session(on_demand(25, 1));
  session.add_block(described("ret_a", "od_add", 10)).add_block(described("ret_b", "od_add", 10));
  session.add_path(Path::chain("ta", {"ret_a"})).add_path(Path::chain("tb", {"ret_b"}));
  REQUIRE(session.start().ok());
  REQUIRE(session.submit("tb", at::zeros({1})).get().ok());
  auto parsed = Deployment::parse(R"({"blocks": [{"name": "ret_a", "factory": "od_add", "memory_bytes": 10485760},
                                                {"name": "ret_c", "factory": "od_add", "memory_bytes": 10485760},
                                                {"name": "ret_d", "factory": "od_add", "memory_bytes": 10485760}],
                                     "tasks": {"ta": ["ret_a"], "tc": ["ret_c"], "td": ["ret_d"]}})", "/nowhere");
  REQUIRE(parsed.ok());
  REQUIRE(session.apply(*parsed).ok());
  REQUIRE(session.apply(*parsed).ok());  // no change; it frees what the first one removed
  REQUIRE(session.metrics().retired_blocks == 0);  // ret_b's runtime, its queue with it, is gone
  const int built_b = times_built("ret_b");
  // Three blocks take turns in room for two: every load makes room, looking at every block the set
  // ever had, the removed one included (its queue is gone: ASan sees a read of it).
  for (int i = 0; i < 6; ++i) {
    for (const char* task : {"ta", "tc", "td"}) {
      Result r = session.submit(task, at::zeros({1})).get();
      INFO(task << ": " << r.status.ToString());
      REQUIRE(r.ok());
    }
  }
  CHECK(times_built("ret_b") == built_b);
  const auto m = session.metrics();
  CHECK(threads_memory(m).resident_bytes <= 20 * kMB);
}

TEST_CASE("on demand: the block a session keeps for an on-demand block loads it for forward() and lets it go", "[memory]") {
  // The session's lanes hold blocks themselves; a caller of the kept Block (on_demand_block()) gets
  // the same residency: a load when needed, eviction of the least recently used, errors named.
  blockflow::detail::ResidentSet set(10 * kMB, [] { return std::int64_t{0}; });
  const auto loader = [](float add) {
    return [add]() -> absl::StatusOr<std::shared_ptr<Block>> {
      return Block::callable("loaded", [add](Tensors&& in) -> absl::StatusOr<Tensors> { return Tensors{in.at(0) + add}; });
    };
  };
  const auto idle = [] { return false; };
  const int a = set.add("a", 6 * kMB, loader(1), idle);
  const int b = set.add("b", 6 * kMB, loader(2), idle);
  const int broken = set.add("broken", 1 * kMB, [] { return absl::StatusOr<std::shared_ptr<Block>>(absl::InternalError("block 'broken': no such file")); }, idle);
  auto block_a = blockflow::detail::on_demand_block(set, a, "a", {}, "torchscript");
  auto block_b = blockflow::detail::on_demand_block(set, b, "b", {}, "torchscript");
  CHECK(block_a->name() == "a");
  CHECK(block_a->kind() == "torchscript");
  CHECK_FALSE(set.state(a).resident);
  auto out = block_a->forward({at::zeros({1})});
  REQUIRE(out.ok());
  CHECK(out->at(0).item<float>() == 1.0f);
  CHECK(set.state(a).resident);
  out = block_b->forward({at::zeros({1})});  // 6 + 6 MB do not fit in 10: a, idle, goes
  REQUIRE(out.ok());
  CHECK(out->at(0).item<float>() == 2.0f);
  CHECK_FALSE(set.state(a).resident);
  CHECK(set.state(a).evictions == 1);
  CHECK(set.state(b).resident);
  CHECK(set.totals().loads == 2);
  CHECK(set.totals().resident_bytes == 6 * kMB);
  const auto failed = blockflow::detail::on_demand_block(set, broken, "broken", {}, "torchscript")->forward({at::zeros({1})});
  REQUIRE_FALSE(failed.ok());
  CHECK_THAT(std::string(failed.status().message()), Contains("block 'broken'"));
}

TEST_CASE("on demand with prefetch: the next block of the path loads on another lane while this one runs", "[memory]") {
  register_on_demand_factories();
  for (const bool prefetch : {false, true}) {
    SessionOptions options = on_demand(25, 2);  // room for two of the three blocks, two lanes
    options.prefetch = prefetch;
    Session session(options);
    session.add_block(described("second", "od_add", 10)).add_block(described("first", "od_gate", 10));
    session.add_block(described("elsewhere", "od_add", 10));
    session.add_path(Path::chain("chain", {"first", "second"})).add_path(Path::chain("other", {"elsewhere"}));
    REQUIRE(session.start().ok());  // loads the three in turn: the last two stay
    REQUIRE(session.submit("other", at::ones({1})).get().ok());
    REQUIRE(resident(session.metrics(), {"first", "second", "elsewhere"}) == std::vector<bool>{true, false, true});
    close_gate();
    auto r = session.submit("chain", at::ones({1}));
    wait_at_gate();
    // While 'first' computes (held at the gate), the other lane loads 'second', making room from
    // 'elsewhere' (idle, on another path); without prefetch, 'second' waits for its request.
    if (prefetch) CHECK(test::eventually([&] { return block_in(session.metrics(), "second").resident; }));
    CHECK(block_in(session.metrics(), "second").resident == prefetch);
    const auto loads_before = block_in(session.metrics(), "second").loads;
    open_gate();
    const Result result = r.get();
    REQUIRE(result.ok());
    CHECK(result.output()[0].item<float>() == 6.0f);  // 1 x 2, + 4 ('second' ends in 'd')
    const auto m = session.metrics();
    CHECK(threads_memory(m).prefetches == (prefetch ? 1u : 0u));
    CHECK(block_in(m, "second").loads == loads_before + (prefetch ? 0u : 1u));  // prefetched: its request loaded nothing
    CHECK_FALSE(block_in(m, "elsewhere").resident);
  }
}

namespace {

// Two plugin blocks of 6 MB (by their profiles) in worker w1, whose budget holds one of them.
BlockDescription six_mb(const std::string& name) {
  BlockDescription d = test::plugin_block(name, "affine", "w1");
  d.options.memory_bytes = 6 * kMB;
  return d;
}

WorkerOptions on_demand_worker(std::int64_t budget) {
  WorkerOptions o = test::test_worker("w1");
  o.memory_budget = budget;
  o.memory_policy = SessionOptions::MemoryPolicy::kOnDemand;
  return o;
}

}  // namespace

TEST_CASE("on demand in a worker process: its blocks take turns under its budget; the host sees its loads", "[memory]") {
  Session session;
  session.add_site(std::make_shared<WorkerSite>(on_demand_worker(10 * kMB)));
  session.add_block(six_mb("a")).add_block(six_mb("b"));  // 12 MB: admitted, as each fits alone
  session.add_path(Path::chain("ta", {"a"})).add_path(Path::chain("tb", {"b"}));
  REQUIRE(session.start().ok());
  for (int i = 0; i < 6; ++i) {
    const Result r = session.submit(i % 2 == 0 ? "ta" : "tb", at::full({1, 4}, 2.0f)).get();
    INFO(r.status);
    REQUIRE(r.ok());
    CHECK(r.output().eq(7.0f).all().item<bool>());
  }
  // Each request of the other task unloaded the block before it (the heartbeats bring the figures).
  CHECK(test::eventually([&] { return test::site_memory(session.metrics(), "w1").evictions >= 6; }));
  const SiteMemory w1 = test::site_memory(session.metrics(), "w1");
  CHECK(w1.policy == "on_demand");
  CHECK(w1.budget_bytes == 10 * kMB);
  CHECK(w1.resident_bytes == 6 * kMB);
  CHECK(w1.loads >= 7);
  CHECK(w1.bytes_loaded == static_cast<std::int64_t>(w1.loads) * 6 * kMB);
  CHECK_THAT(session.metrics().to_prometheus(), Contains("blockflow_site_block_evictions_total{site=\"w1\"}"));
}

TEST_CASE("on demand in a worker process: a block larger than its budget is refused, naming the block and the worker", "[memory]") {
  Session session;
  session.add_site(std::make_shared<WorkerSite>(on_demand_worker(5 * kMB)));
  session.add_block(six_mb("a")).add_path(Path::chain("ta", {"a"}));
  const absl::Status status = session.start();
  CHECK(status.code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(status.message()), Contains("block 'a'"));
  CHECK_THAT(std::string(status.message()), Contains("site 'w1' (on demand, every block must fit alone)"));
  Session no_budget;
  no_budget.add_site(std::make_shared<WorkerSite>(on_demand_worker(0)));
  no_budget.add_block(six_mb("a")).add_path(Path::chain("ta", {"a"}));
  CHECK_THAT(std::string(no_budget.start().message()), Contains("worker w1: WorkerOptions::memory_policy kOnDemand needs a memory_budget"));
}

TEST_CASE("on demand in a worker process, set by the deployment's sites: the worker it starts loads on demand, measuring "
          "the process",
          "[memory]") {
  auto d = Deployment::parse(R"({"blocks": [{"name": "a", "factory": "affine", "placement": "w1", "memory_bytes": 6291456},
                                            {"name": "b", "factory": "affine", "placement": "w1", "memory_bytes": 6291456}],
                                 "tasks": {"ta": ["a"], "tb": ["b"]},
                                 "sites": {"w1": {"memory": {"budget": 10485760, "policy": "on_demand", "measure": "process"}}}})");
  REQUIRE(d.ok());
  Session session;
  add_deployment(session, *d, test::test_worker(""));  // the defaults admit; the deployment says on demand
  REQUIRE(session.start().ok());  // 12 MB over a 10 MB budget: admitted only because it loads on demand
  for (int i = 0; i < 4; ++i) REQUIRE(session.submit(i % 2 == 0 ? "ta" : "tb", at::full({1, 4}, 2.0f)).get().ok());
  const auto m = session.metrics();
  bool on_demand = false;
  for (const auto& s : m.memory) on_demand = on_demand || (s.site == "w1" && s.policy == "on_demand" && s.budget_bytes == 10 * kMB);
  CHECK(on_demand);  // What the worker's budget bounds, as its site was configured.
  CHECK(test::site_memory(session.metrics(), "w1").measure == "process");
}

TEST_CASE("on demand in a worker process measuring the process: its growth beyond the blocks' footprints reaches the "
          "host in its heartbeats",
          "[memory]") {
  WorkerOptions o = on_demand_worker(10 * kMB);
  o.memory_measure = SessionOptions::MemoryMeasure::kProcess;
  BlockDescription grow = test::plugin_block("grow", "ballast", "w1");  // 48 MB at its first forward
  grow.options.memory_bytes = 5 * kMB;  // with a's 6 MB, over the 10 MB budget: they take turns
  Session session;
  session.add_site(std::make_shared<WorkerSite>(o));
  session.add_block(six_mb("a")).add_block(grow);
  session.add_path(Path::chain("ta", {"a"})).add_path(Path::chain("tg", {"grow"}));
  REQUIRE(session.start().ok());
  CHECK(test::site_memory(session.metrics(), "w1").unaccounted_bytes < 40 * kMB);  // nothing grown yet
  // The worker grows, then loads a block: the load decision samples the growth (and, finding no
  // room, loads it all the same once every idle block is gone). Each load unloads the other block.
  for (const std::string task : {"tg", "ta", "tg", "ta"}) {
    const Result r = session.submit(task, at::full({1, 4}, 2.0f)).get();
    INFO(r.status);
    REQUIRE(r.ok());
    CHECK(r.output().eq(task == "ta" ? 7.0f : 3.0f).all().item<bool>());
  }
  // Both from one heartbeat: one that reports the growth may precede the fourth load (under ASan it did).
  CHECK(test::eventually([&] {
    const SiteMemory now = test::site_memory(session.metrics(), "w1");
    return now.unaccounted_bytes >= 40 * kMB && now.loads >= 4;
  }));
  const MetricsSnapshot m = session.metrics();
  const SiteMemory w1 = test::site_memory(m, "w1");
  CHECK(w1.measure == "process");
  CHECK(w1.loads >= 4);
  CHECK(w1.unaccounted_bytes < 256 * kMB);  // the ballast, not the whole process (sanitizers' shadow included)
  CHECK_THAT(m.to_prometheus(), Contains("blockflow_site_memory_unaccounted_bytes{site=\"w1\"}"));
}
