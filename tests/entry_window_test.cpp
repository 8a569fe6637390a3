// The entry window (SessionOptions::max_in_flight_per_task): at most that many requests of a task
// inside the blocks, the rest waiting at the entry in order; updates and shutdown resolve them.
#include "test_util.hpp"

#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

using namespace blockflow;
using Catch::Matchers::Contains;
using namespace std::chrono_literals;

namespace {

const PathMetrics* path_of(const MetricsSnapshot& m, const std::string& task) {
  for (const auto& p : m.paths) {
    if (p.task == task) return &p;
  }
  return nullptr;
}

// A block that holds every call until the latch opens, and records the order of its inputs.
struct HeldBlock {
  test::Latch latch;
  std::atomic<int> inside{0}, most_inside{0};
  std::mutex mu;
  std::vector<double> order;

  std::shared_ptr<Block> make(const std::string& name, int workers) {
    BlockOptions options;
    options.workers = workers;
    return test::unary(name, [this](const Tensor& x) {
      const int now = ++inside;
      for (int seen = most_inside.load(); now > seen && !most_inside.compare_exchange_weak(seen, now);) {
      }
      {
        std::lock_guard lock(mu);
        order.push_back(x.item<double>());
      }
      latch.entered.fetch_add(1);
      latch.wait();
      --inside;
      return x + 1;
    }, options);
  }
};

SessionOptions windowed(int window) {
  SessionOptions options;
  options.lanes = 3;  // more lanes than the window: only the window holds requests back
  options.intra_op_threads = 1;
  options.max_in_flight_per_task = window;
  return options;
}

// Tasks a and b over one held block, a window of 1 each.
struct TwoTasks {
  HeldBlock held;
  Session session{windowed(1)};
  TwoTasks() {
    session.add_block(held.make("hold", 3)).add_path(Path::chain("a", {"hold"})).add_path(Path::chain("b", {"hold"}));
    test::require_started(session);
  }
};

// One task over one held block, with `window`; submit(n) sends it 0, 1, ..., n-1.
struct OneTask {
  HeldBlock held;
  Session session;
  explicit OneTask(int window) : session(windowed(window)) {
    session.add_block(held.make("hold", 3)).add_path(Path::chain("task", {"hold"}));
    test::require_started(session);
  }
  std::vector<std::future<Result>> submit(int n) {
    std::vector<std::future<Result>> futures;
    for (int i = 0; i < n; ++i) futures.push_back(session.submit("task", at::full({1}, double(i))));
    return futures;
  }
};

}  // namespace

TEST_CASE("the entry window keeps a task's requests beyond it at the entry", "[entry]") {
  OneTask fixture(2);
  HeldBlock& held = fixture.held;
  Session& session = fixture.session;
  std::vector<std::future<Result>> futures = fixture.submit(6);
  REQUIRE(test::eventually([&] { return held.latch.entered.load() == 2; }));
  std::this_thread::sleep_for(100ms);  // room for a third call, were the window not holding it
  CHECK(held.latch.entered.load() == 2);
  const MetricsSnapshot m = session.metrics();
  const PathMetrics* p = path_of(m, "task");
  REQUIRE(p != nullptr);
  CHECK(p->waiting_at_entry == 4);
  CHECK(p->waited_at_entry == 4);
  CHECK(p->submitted == 6);

  held.latch.release();
  for (int i = 0; i < 6; ++i) {
    Result r = futures[static_cast<std::size_t>(i)].get();
    INFO(r.status.ToString());
    REQUIRE(r.ok());
    CHECK(r.output().item<double>() == i + 1);
    REQUIRE(r.trace.hops.size() == 1);
    const HopTiming& hop = r.trace.hops[0];
    if (i < 2) {
      CHECK(hop.entry_wait_ns == 0);
    } else {
      // It waited at the entry while the latch held the block (over 100 ms, slept above): that is
      // wait in the trace, and the first hop's queue wait and overhead do not count it.
      CHECK(hop.entry_wait_ns >= 100'000'000);
      CHECK(hop.wait_ms() >= hop.entry_wait_ns / 1e6);
      CHECK(hop.input_ready_ns - r.trace.submitted_ns == hop.entry_wait_ns);
      CHECK(hop.overhead_ms() < hop.entry_wait_ns / 1e6);
    }
    CHECK(r.trace.wait_ms() + r.trace.compute_ms() + r.trace.overhead_ms() == Approx(r.trace.e2e_ms()).margin(1e-6));
  }
  CHECK(held.most_inside.load() == 2);
  const MetricsSnapshot at_end = session.metrics();
  const PathMetrics* after = path_of(at_end, "task");
  REQUIRE(after != nullptr);
  CHECK(after->waiting_at_entry == 0);
  CHECK(after->completed == 6);
}

TEST_CASE("with a window of 1, requests start in submission order", "[entry]") {
  OneTask fixture(1);
  HeldBlock& held = fixture.held;
  std::vector<std::future<Result>> futures = fixture.submit(8);
  Session& session = fixture.session;
  REQUIRE(test::eventually([&] { return path_of(session.metrics(), "task")->waiting_at_entry == 7; }));
  held.latch.release();
  for (auto& f : futures) CHECK(f.get().ok());
  std::lock_guard lock(held.mu);
  CHECK(held.order == std::vector<double>{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(held.most_inside.load() == 1);
}

TEST_CASE("each task has its own entry window", "[entry]") {
  TwoTasks fixture;
  HeldBlock& held = fixture.held;
  Session& session = fixture.session;
  std::vector<std::future<Result>> futures;
  for (int i = 0; i < 3; ++i) futures.push_back(session.submit("a", at::full({1}, double(i))));
  futures.push_back(session.submit("b", at::full({1}, 10.0)));
  REQUIRE(test::eventually([&] { return held.latch.entered.load() == 2; }));  // one of a, one of b
  std::this_thread::sleep_for(100ms);
  CHECK(held.latch.entered.load() == 2);
  const MetricsSnapshot m = session.metrics();
  CHECK(path_of(m, "a")->waiting_at_entry == 2);
  CHECK(path_of(m, "b")->waiting_at_entry == 0);
  held.latch.release();
  for (auto& f : futures) CHECK(f.get().ok());
}

TEST_CASE("a request waiting at the entry of a task an update removed fails naming the task", "[entry]") {
  TwoTasks fixture;
  HeldBlock& held = fixture.held;
  Session& session = fixture.session;
  std::future<Result> first = session.submit("a", at::full({1}, 1.0));
  std::future<Result> waiting = session.submit("a", at::full({1}, 2.0));
  REQUIRE(test::eventually([&] { return held.latch.entered.load() == 1; }));
  REQUIRE(path_of(session.metrics(), "a")->waiting_at_entry == 1);

  // "hold" by its bare name stays as it runs; task a goes.
  auto version = session.apply(test::parse(R"({"blocks": ["hold"], "tasks": {"b": ["hold"]}})"));
  INFO(version.status().ToString());
  REQUIRE(version.ok());
  held.latch.release();
  const Result done = first.get();  // in flight: it finishes on the path it started with
  CHECK(done.ok());
  const Result r = waiting.get();
  CHECK(r.status.code() == absl::StatusCode::kNotFound);
  CHECK_THAT(std::string(r.status.message()),
             Contains("task 'a' was removed by an update while the request waited at its entry"));
  CHECK(test::value_of(session, "b", 5) == 6);
}

TEST_CASE("a request waiting at the entry takes the task's path as an update left it", "[entry]") {
  HeldBlock held;
  Session session(windowed(1));
  session.add_block(held.make("hold", 3))
      .add_block(test::unary("neg", [](const Tensor& x) { return -x; }))
      .add_path(Path::chain("a", {"hold"}));
  test::require_started(session);
  std::future<Result> first = session.submit("a", at::full({1}, 1.0));
  std::future<Result> waiting = session.submit("a", at::full({1}, 2.0));
  REQUIRE(test::eventually([&] { return held.latch.entered.load() == 1; }));
  auto version = session.apply(test::parse(R"({"blocks": ["hold", "neg"], "tasks": {"a": ["neg", "hold"]}})"));
  INFO(version.status().ToString());
  REQUIRE(version.ok());
  held.latch.release();
  CHECK(first.get().output().item<double>() == 2);     // started before: hold only
  CHECK(waiting.get().output().item<double>() == -1);  // started after: neg, then hold
}

TEST_CASE("shutdown resolves the requests waiting at the entry", "[entry]") {
  HeldBlock held;
  auto session = std::make_unique<Session>(windowed(1));
  session->add_block(held.make("hold", 3))
      .add_block(test::unary("free", [](const Tensor& x) { return x; }))
      .add_path(Path::chain("task", {"hold"}))
      .add_path(Path::chain("probe", {"free"}));  // never held: its requests tell when shutdown began
  test::require_started(*session);
  std::vector<std::future<Result>> futures;
  for (int i = 0; i < 5; ++i) futures.push_back(session->submit("task", at::full({1}, double(i))));
  REQUIRE(test::eventually([&] { return held.latch.entered.load() == 1; }));
  std::atomic<bool> refused{false};
  std::thread opener([&] {
    // Once shutdown refuses new requests (at once, inline) it closes the queues at once (no drain):
    // then the block returns. A probe accepted before may stay queued until shutdown's end: not waited for.
    while (!refused.load()) {
      session->submit("probe", Tensors{at::full({1}, 0.0)}, [&](Result&& r) {
        if (r.status.code() == absl::StatusCode::kFailedPrecondition) refused = true;
      });
      std::this_thread::sleep_for(1ms);
    }
    std::this_thread::sleep_for(100ms);
    held.latch.release();
  });
  session->shutdown(absl::ZeroDuration());
  opener.join();
  int ok = 0, cancelled = 0;
  for (auto& f : futures) {
    REQUIRE(f.wait_for(10s) == std::future_status::ready);
    const Result r = f.get();
    if (r.ok()) ++ok;
    if (r.status.code() == absl::StatusCode::kCancelled) {
      ++cancelled;
      CHECK_THAT(std::string(r.status.message()), Contains("shut down"));
    }
  }
  CHECK(ok == 1);         // the one inside the block finished
  CHECK(cancelled == 4);  // the four that waited started as it resolved, and found the queue closed
  session.reset();
}
