// SessionOptions::serve_while_warming: start() returns before the blocks of this process load; they
// load in the background task by task, each task active once its blocks have loaded, and the first
// task serves while a later one's block is still loading.
#include "test_util.hpp"

#include <condition_variable>
#include <future>
#include <mutex>

using namespace blockflow;
using Catch::Matchers::Contains;

namespace {

// A block whose construction (its load) waits until `released`; `building` says it has begun.
struct LoadGate {
  std::mutex mu;
  std::condition_variable cv;
  bool building = false;
  bool released = false;
};
LoadGate load_gate;

void register_warming_factories() {
  static std::once_flag once;
  std::call_once(once, [] {
    BlockRegistry::global().add("warm_add1", [](const std::string& name, const BlockOptions& options) {
      return Block::callable(name, [](Tensors&& in) -> absl::StatusOr<Tensors> { return Tensors{in.at(0) + 1}; }, options);
    });
    BlockRegistry::global().add("warm_gated_add10", [](const std::string& name, const BlockOptions& options) {
      std::unique_lock<std::mutex> lock(load_gate.mu);
      load_gate.building = true;
      load_gate.cv.notify_all();
      load_gate.cv.wait(lock, [] { return load_gate.released; });
      return Block::callable(name, [](Tensors&& in) -> absl::StatusOr<Tensors> { return Tensors{in.at(0) + 10}; }, options);
    });
    BlockRegistry::global().add("warm_broken", [](const std::string&, const BlockOptions&) -> std::shared_ptr<Block> {
      throw std::runtime_error("no weights here");
    });
  });
}

BlockDescription described(const std::string& name, const std::string& factory) {
  BlockDescription d;
  d.name = name;
  d.factory = factory;
  return d;
}

const PathMetrics& task_in(const MetricsSnapshot& m, const std::string& task) {
  for (const auto& p : m.paths) {
    if (p.task == task) return p;
  }
  FAIL("no task " << task);
  throw std::logic_error("unreachable");
}

}  // namespace

TEST_CASE("serve while warming: the first task serves while a later task's block still loads", "[warming]") {
  register_warming_factories();
  {
    std::lock_guard<std::mutex> lock(load_gate.mu);
    load_gate.building = false;
    load_gate.released = false;
  }
  SessionOptions o;
  o.serve_while_warming = true;
  o.lanes = 2;
  Session session(o);
  session.add_block(described("first", "warm_add1")).add_block(described("slow", "warm_gated_add10"));
  session.add_path(Path::chain("t1", {"first"})).add_path(Path::chain("t2", {"first", "slow"}));
  REQUIRE(session.start().ok());  // returns although 'slow' cannot load yet
  {
    std::unique_lock<std::mutex> lock(load_gate.mu);
    load_gate.cv.wait(lock, [] { return load_gate.building; });  // the background reached 'slow'
  }
  Result r = session.submit("t1", at::zeros({1})).get();
  REQUIRE(r.ok());
  CHECK(r.output()[0].item<float>() == 1.0f);
  // The loader marks the task active just after its load, which may be just after the request ran.
  CHECK(test::eventually([&] { return task_in(session.metrics(), "t1").active_ms > 0; }));
  auto m = session.metrics();
  CHECK(task_in(m, "t2").active_ms == 0);  // 'slow' has not loaded
  auto waiting = session.submit("t2", at::zeros({1}));  // waits for the load rather than failing
  {
    std::lock_guard<std::mutex> lock(load_gate.mu);
    load_gate.released = true;
  }
  load_gate.cv.notify_all();
  Result r2 = waiting.get();
  REQUIRE(r2.ok());
  CHECK(r2.output()[0].item<float>() == 11.0f);
  CHECK(test::eventually([&] { return task_in(session.metrics(), "t2").active_ms > 0; }));
  m = session.metrics();
  CHECK(task_in(m, "t2").active_ms >= task_in(m, "t1").active_ms);
  CHECK(m.start.start_ms < task_in(m, "t2").active_ms);
  CHECK(m.memory.empty());  // no budget, no memory figures
}

TEST_CASE("serve while warming: a block that fails to load fails its task's requests, named; others serve", "[warming]") {
  register_warming_factories();
  SessionOptions o;
  o.serve_while_warming = true;
  o.lanes = 1;
  Session session(o);
  session.add_block(described("fine", "warm_add1")).add_block(described("broken", "warm_broken"));
  session.add_path(Path::chain("ok_task", {"fine"})).add_path(Path::chain("bad_task", {"broken"}));
  REQUIRE(session.start().ok());
  CHECK(session.submit("ok_task", at::zeros({1})).get().output()[0].item<float>() == 1.0f);
  Result bad = session.submit("bad_task", at::zeros({1})).get();
  CHECK_FALSE(bad.ok());
  CHECK_THAT(bad.status.ToString(), Contains("broken"));
  CHECK_THAT(bad.status.ToString(), Contains("no weights here"));
  CHECK(test::eventually([&] { return task_in(session.metrics(), "ok_task").active_ms > 0; }));
  CHECK(task_in(session.metrics(), "bad_task").active_ms == 0);
}

TEST_CASE("without serve_while_warming every task is active when start() returns", "[warming]") {
  register_warming_factories();
  Session session;
  session.add_block(described("plain", "warm_add1")).add_path(Path::chain("t", {"plain"}));
  REQUIRE(session.start().ok());
  const auto m = session.metrics();
  CHECK(task_in(m, "t").active_ms > 0);
  CHECK(task_in(m, "t").active_ms <= m.start.start_ms + 1e-6);
}
