// Compute lanes: a bounded number of threads, fairness across blocks, run-to-completion, helping a
// full queue, run_on_lane().
#include "test_util.hpp"

#include <ATen/Parallel.h>
#include <absl/synchronization/notification.h>
#include <pthread.h>

#include <filesystem>
#include <mutex>
#include <thread>

using namespace blockflow;
using namespace std::chrono_literals;

namespace {

int process_threads() {
  int n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

std::string this_thread_name() {
  char name[16] = {};
  pthread_getname_np(pthread_self(), name, sizeof(name));
  return name;
}

// A block whose forward runs libtorch parallel ops (an elementwise op over 1M floats is split
// across the thread's OpenMP team), so the thread that runs it makes a team if it has none.
std::shared_ptr<Block> parallel_block(const std::string& name, int intra_op_threads) {
  BlockOptions options;
  options.intra_op_threads = intra_op_threads;
  options.input_shapes = {{1 << 20}};
  return test::unary(name, [](const Tensor& x) { return (x * 2 + 1).sum().reshape({1}).expand({1 << 20}).contiguous(); },
                     options);
}

// The process's threads after a session of `blocks` parallel blocks has started and served.
int threads_added_by_session(int blocks, int lanes, int intra_op_threads) {
  const Tensor input = at::ones({1 << 20});
  const int before = process_threads();
  SessionOptions options;
  options.lanes = lanes;
  Session session(options);
  std::vector<std::string> chain;
  for (int i = 0; i < blocks; ++i) {
    chain.push_back("b" + std::to_string(i));
    session.add_block(parallel_block(chain.back(), intra_op_threads));
  }
  session.add_path(Path::chain("t", chain));
  test::require_started(session);
  std::vector<std::future<Result>> results;
  for (int i = 0; i < 8; ++i) results.push_back(session.submit("t", input));
  for (auto& f : results) REQUIRE(f.get().ok());
  const auto m = session.metrics();
  REQUIRE(static_cast<int>(m.lanes.size()) == lanes);
  CHECK(m.lane_intra_op_threads == intra_op_threads);
  return process_threads() - before;
}

// Tasks `first` and `second` get `each` requests, i on the i-th, from two threads at once; returns
// their futures once both threads have submitted. Submitters still blocked in submit() after a
// minute (the lanes never make room) are freed by a shutdown: the test then fails, not hangs.
std::pair<std::vector<std::future<Result>>, std::vector<std::future<Result>>> submit_from_two_threads(
    Session& session, const std::string& first, const std::string& second, int each) {
  std::vector<std::future<Result>> a_results(static_cast<std::size_t>(each)), b_results(static_cast<std::size_t>(each));
  std::atomic<int> finished{0};
  auto submitter = [&](const std::string& task, std::vector<std::future<Result>>& out) {
    return std::thread([&session, &task, &out, &finished, each] {
      for (int i = 0; i < each; ++i) out[static_cast<std::size_t>(i)] = session.submit(task, at::full({1}, static_cast<double>(i)));
      ++finished;
    });
  };
  std::thread a = submitter(first, a_results);
  std::thread b = submitter(second, b_results);
  if (!test::eventually([&] { return finished.load() == 2; }, std::chrono::milliseconds(60'000))) session.shutdown();
  a.join();
  b.join();
  return {std::move(a_results), std::move(b_results)};
}

// Tasks "xy" (x then y) and "yx" (y then x) cross: each block's output goes to the other's queue of
// one, and two application threads keep both queues full. Counts the requests resolved wrong or not
// within a minute (a lane that waited on a queue only a waiting lane could empty hangs), and reads
// the two queues' stats.
struct Crossing {
  int wrong = 0;
  std::vector<BlockMetrics> blocks;
};
Crossing crossing_tasks(int lanes, int workers, int each) {
  SessionOptions options;
  options.lanes = lanes;
  options.intra_op_threads = 1;
  Session session(options);
  BlockOptions tiny = test::queue_of_one();
  tiny.workers = workers;
  session.add_block(test::unary("x", [](const Tensor& t) { return t + 1; }, tiny))
      .add_block(test::unary("y", [](const Tensor& t) { return t * 2; }, tiny))
      .add_path(Path::chain("xy", {"x", "y"}))
      .add_path(Path::chain("yx", {"y", "x"}));
  test::require_started(session);
  auto [xy, yx] = submit_from_two_threads(session, "xy", "yx", each);
  Crossing out;
  for (int i = 0; i < each; ++i) {
    auto& f = xy[static_cast<std::size_t>(i)];
    auto& g = yx[static_cast<std::size_t>(i)];
    if (f.wait_for(60s) != std::future_status::ready || g.wait_for(60s) != std::future_status::ready) {
      out.wrong += each - i;
      session.shutdown();
      return out;
    }
    const Result r = f.get();
    const Result q = g.get();
    if (!r.ok() || r.output().item<double>() != (i + 1.0) * 2 || !q.ok() || q.output().item<double>() != i * 2.0 + 1) ++out.wrong;
  }
  out.blocks = session.metrics().blocks;
  return out;
}

}  // namespace

TEST_CASE("the process's threads are bounded by lanes x intra-op threads, whatever the number of blocks", "[lanes]") {
  // A fixed base beyond the lanes' teams: nothing today; 2 to spare for libtorch's lazily made helpers
  // (and ThreadSanitizer's background thread, started at the process's first pthread_create).
#if defined(__SANITIZE_THREAD__)
  constexpr int kBase = 3;
#else
  constexpr int kBase = 2;
#endif
  for (const int blocks : {4, 16}) {
    const int added = threads_added_by_session(blocks, /*lanes=*/2, /*intra_op_threads=*/2);
    INFO(blocks << " blocks added " << added << " threads");
    CHECK(added <= 2 * 2 + kBase);
  }
  const int one_lane = threads_added_by_session(16, /*lanes=*/1, /*intra_op_threads=*/2);
  INFO("16 blocks on one lane added " << one_lane << " threads");
  CHECK(one_lane <= 1 * 2 + kBase);
}

TEST_CASE("blocks take turns on a lane: a fast task waits for at most one run of a busy block", "[lanes]") {
  SessionOptions options;
  options.lanes = 1;
  Session session(options);
  absl::Notification slow_started, gate;
  std::atomic<int> slow_runs{0};
  session.add_block(test::unary("slow", [&](const Tensor& x) {
    if (slow_runs.fetch_add(1) == 0) {
      slow_started.Notify();
      gate.WaitForNotification();  // the first run holds the only lane until the fast request is queued
    } else {
      std::this_thread::sleep_for(5ms);
    }
    return x + 1;
  }));
  session.add_block(test::unary("fast", [](const Tensor& x) { return x * 10; }));
  session.add_path(Path::chain("slow_task", {"slow"})).add_path(Path::chain("fast_task", {"fast"}));
  test::require_started(session);

  std::mutex mu;
  std::vector<std::string> order;
  std::atomic<int> resolved{0};
  auto record = [&](std::string what) {
    return [&, what](Result&& r) {
      CHECK(r.ok());
      std::lock_guard lock(mu);
      order.push_back(what);
      ++resolved;
    };
  };
  for (int i = 0; i < 6; ++i) session.submit("slow_task", {at::zeros({1})}, record("slow"));
  slow_started.WaitForNotification();
  session.submit("fast_task", {at::ones({1})}, record("fast"));
  gate.Notify();
  REQUIRE(test::eventually([&] { return resolved.load() == 7; }));
  std::lock_guard lock(mu);
  const auto fast_at = std::find(order.begin(), order.end(), "fast") - order.begin();
  INFO("completion order position of the fast request: " << fast_at);
  CHECK(fast_at <= 1);  // behind the slow run that held the lane, never behind the slow queue
}

TEST_CASE("a completion callback that resubmits as each result comes does not keep the lane from other tasks",
          "[lanes]") {
  SessionOptions options;
  options.lanes = 1;
  Session session(options);
  BlockOptions two_at_once;  // the run in progress does not hold the block's one claim
  two_at_once.workers = 2;
  session.add_block(test::unary("a", [](const Tensor& x) { return x + 1; }, two_at_once));
  session.add_block(test::unary("b", [](const Tensor& x) { return x * 10; }));
  session.add_path(Path::chain("loop", {"a"})).add_path(Path::chain("other", {"b"}));
  test::require_started(session);
  // A closed loop on one lane: each result submits the next request, until the other task's
  // request has resolved (or a bound that a starved lane would reach first).
  constexpr int kBound = 200'000;
  std::atomic<int> loops{0}, loops_when_other_done{-1}, loop_failures{0};
  std::atomic<bool> loop_over{false};
  std::function<void(Result&&)> again = [&](Result&& r) {
    if (!r.ok()) ++loop_failures;
    if (++loops < kBound && loops_when_other_done.load() < 0) {
      session.submit("loop", {at::zeros({1})}, again);
    } else {
      loop_over = true;
    }
  };
  session.submit("loop", {at::zeros({1})}, again);
  REQUIRE(test::eventually([&] { return loops.load() >= 5; }));
  auto other = session.submit("other", at::ones({1}));
  const Result r = other.get();
  loops_when_other_done = loops.load();
  REQUIRE(test::eventually([&] { return loop_over.load(); }, 120s));
  CHECK(r.ok());
  CHECK(loop_failures.load() == 0);
  INFO("loop requests resolved when the other task's request had: " << loops_when_other_done.load());
  CHECK(loops_when_other_done.load() < kBound);  // served beside the loop, not after it
}

TEST_CASE("a lane runs a request's next blocks itself, and the trace still adds up", "[lanes]") {
  SessionOptions options;
  options.lanes = 1;
  Session session(options);
  for (const char* name : {"b1", "b2", "b3", "b4"}) session.add_block(test::unary(name, [](const Tensor& x) { return x + 1; }));
  session.add_path(Path::chain("chain", {"b1", "b2", "b3", "b4"}));
  test::require_started(session);
  for (int i = 0; i < 10; ++i) {
    const Result r = session.submit("chain", at::full({2}, static_cast<double>(i))).get();
    REQUIRE(r.ok());
    CHECK(at::equal(r.output(), at::full({2}, static_cast<double>(i + 4))));
    REQUIRE(r.trace.hops.size() == 4);
    CHECK(r.trace.wait_ms() + r.trace.compute_ms() + r.trace.overhead_ms() == Approx(r.trace.e2e_ms()).margin(1e-6));
    for (std::size_t h = 1; h < 4; ++h) CHECK(r.trace.hops[h - 1].done_ns == r.trace.hops[h].input_ready_ns);
  }
  const auto m = session.metrics();
  REQUIRE(m.lanes.size() == 1);
  // Requests one at a time: b1 is queued by submit(); b2, b3 and b4 run inline after it.
  CHECK(m.lanes[0].inline_continuations == 30);
  CHECK(m.lanes[0].runs == 40);
  CHECK(m.lanes[0].busy_s > 0);
  for (const auto& b : m.blocks) {
    CHECK(b.processed == 10);
    CHECK(b.queue.sent == 10);
    CHECK(b.queue.received == 10);
  }
  const std::string prometheus = m.to_prometheus();
  CHECK(prometheus.find("blockflow_lane_inline_continuations_total{lane=\"0\"} 30") != std::string::npos);
}

TEST_CASE("batch of several forward() calls: the next block is not held for its lane, another lane runs it meanwhile",
          "[lanes]") {
  // Before, the first group's hand-off claimed "next" for the batch's lane: no other lane could run
  // it until the batch's seven other forward() calls had run.
  SessionOptions options;
  options.lanes = 2;
  options.elastic_lanes = false;
  Session session(options);
  std::atomic<int> x_running{0};
  std::atomic<int> overlaps{0};
  BlockOptions batched;
  batched.max_batch = 8;
  batched.max_batch_delay_ms = 2000;  // the 8 requests are queued at once: the batch fills at once
  session.add_block(Block::callable("x", [&](Tensors&& in) -> absl::StatusOr<Tensors> {
    ++x_running;
    std::this_thread::sleep_for(30ms);
    --x_running;
    return Tensors{in.at(0) + 1};
  }, batched));
  session.add_block(test::unary("y", [&](const Tensor& t) {
    if (x_running.load() > 0) ++overlaps;
    return t * 2;
  }));
  session.add_path(Path::chain("t", {"x", "y"}));
  test::require_started(session);
  std::vector<std::future<Result>> futures;
  for (int i = 0; i < 8; ++i) futures.push_back(session.submit("t", at::zeros({1, i + 1})));  // widths differ: 8 groups
  for (int i = 0; i < 8; ++i) {
    const Result r = futures[static_cast<std::size_t>(i)].get();
    REQUIRE(r.ok());
    CHECK(at::equal(r.output(), at::full({1, i + 1}, 2.0)));
  }
  CHECK(overlaps.load() > 0);  // y ran on the other lane while x's batch went on
}

TEST_CASE("one lane and a full queue (policy block) do not deadlock: the lane helps the full block", "[lanes]") {
  SessionOptions options;
  options.lanes = 1;
  Session session(options);
  const BlockOptions tiny = test::queue_of_one();
  // Requests of "direct" fill sink's queue of one from an application thread; the lane, finishing
  // "fan", finds it full: it must run sink itself rather than sleep (nobody else would run sink).
  session.add_block(test::unary("fan", [](const Tensor& x) { return x * 2; }))
      .add_block(test::slow_plus_one("sink", 1ms, tiny))
      .add_path(Path::chain("t", {"fan", "sink"}))
      .add_path(Path::chain("direct", {"sink"}));
  test::require_started(session);
  constexpr int kEach = 30;
  auto [via_fan, direct] = submit_from_two_threads(session, "t", "direct", kEach);
  for (int i = 0; i < kEach; ++i) {
    const Result r = via_fan[static_cast<std::size_t>(i)].get();
    REQUIRE(r.ok());
    CHECK(r.output().item<double>() == 2.0 * i + 1);
    const Result d = direct[static_cast<std::size_t>(i)].get();
    REQUIRE(d.ok());
    CHECK(d.output().item<double>() == i + 1.0);
  }
  CHECK(session.metrics().blocks[1].queue.high_watermark == 1);
}

TEST_CASE("a block one lane at a time may run (workers 1) never runs on two, even while lanes help its full queue",
          "[lanes]") {
  SessionOptions options;
  options.lanes = 2;
  options.intra_op_threads = 1;
  Session session(options);
  const BlockOptions tiny = test::queue_of_one();
  std::atomic<int> inside{0}, most{0};
  // A lane finishing "fan" finds sink's queue full for a while (the other lane runs "solo") and helps
  // sink, claiming it, while sink's entry in the ready queue is still there: the other lane, done
  // with solo, must not take it.
  session.add_block(test::unary("fan", [](const Tensor& x) { return x * 2; }))
      .add_block(test::slow_plus_one("solo", 2ms))
      .add_path(Path::chain("other", {"solo"}))
      .add_block(test::unary("sink",
                             [&](const Tensor& x) {
                               const int now = ++inside;
                               int seen = most.load();
                               while (now > seen && !most.compare_exchange_weak(seen, now)) {
                               }
                               std::this_thread::sleep_for(200us);
                               --inside;
                               return x + 1;
                             },
                             tiny))
      .add_path(Path::chain("t", {"fan", "sink"}))
      .add_path(Path::chain("direct", {"sink"}));
  test::require_started(session);
  constexpr int kEach = 400;
  std::atomic<bool> done{false};
  std::thread c([&] {
    while (!done) (void)session.submit("other", at::zeros({1})).get();
  });
  auto [via_fan, direct] = submit_from_two_threads(session, "t", "direct", kEach);
  int wrong = 0;
  for (int i = 0; i < kEach; ++i) {
    const Result r = via_fan[static_cast<std::size_t>(i)].get();
    const Result d = direct[static_cast<std::size_t>(i)].get();
    if (!r.ok() || r.output().item<double>() != 2.0 * i + 1 || !d.ok() || d.output().item<double>() != i + 1.0) ++wrong;
  }
  done = true;
  c.join();
  CHECK(wrong == 0);
  CHECK(most.load() == 1);
}

TEST_CASE("a lane whose full queue only it could empty queues past the bound: crossing tasks, one lane", "[lanes]") {
  SessionOptions options;
  options.lanes = 1;
  options.intra_op_threads = 1;
  Session session(options);
  const BlockOptions tiny = test::queue_of_one();
  std::atomic<bool> computing{false}, go{false};
  session.add_block(test::unary("x",
                                [&](const Tensor& t) {
                                  computing = true;
                                  while (!go) std::this_thread::sleep_for(1ms);
                                  return t + 1;
                                },
                                tiny))
      .add_block(test::unary("y", [](const Tensor& t) { return t * 2; }, tiny))
      .add_path(Path::chain("xy", {"x", "y"}))
      .add_path(Path::chain("yx", {"y", "x"}));
  test::require_started(session);
  // The lane runs x for xy 0 and holds it there while xy 1 fills x's queue and yx 0 y's. Then x's
  // output finds y full: the lane queues it as it takes yx 0 out and runs y for it, whose output
  // finds x full, held by this very lane. Nobody else would ever empty x: the lane queues past.
  auto xy0 = session.submit("xy", at::full({1}, 0.0));
  REQUIRE(test::eventually([&] { return computing.load(); }));
  auto xy1 = session.submit("xy", at::full({1}, 1.0));
  auto yx0 = session.submit("yx", at::full({1}, 0.0));
  go = true;
  std::vector<std::future<Result>*> all{&xy0, &xy1, &yx0};
  for (auto* f : all) REQUIRE(f->wait_for(60s) == std::future_status::ready);
  const Result r0 = xy0.get(), r1 = xy1.get(), s0 = yx0.get();
  REQUIRE(r0.ok());
  REQUIRE(r1.ok());
  REQUIRE(s0.ok());
  CHECK(r0.output().item<double>() == 2.0);
  CHECK(r1.output().item<double>() == 4.0);
  CHECK(s0.output().item<double>() == 1.0);
  const auto m = session.metrics();
  CHECK(m.blocks[0].queue.past_capacity == 1);  // x: yx 0's output
  CHECK(m.blocks[0].queue.high_watermark == 2);
  CHECK(m.blocks[1].queue.past_capacity == 0);  // y: the lane swapped its request in as it took one out
  CHECK(m.blocks[1].queue.high_watermark == 1);
}

TEST_CASE("crossing tasks over full queues (policy block) resolve every request, with one and two lanes", "[lanes]") {
  struct Case {
    int lanes, workers, each;
  };
  // One lane, blocks one lane at a time: the lane holds x while y's output waits for room in x.
  // One lane, blocks four lanes at a time: helping nests x in y in x... to its depth limit.
  // Two lanes, one at a time: a lane running x waits for room in y, whose claim the other lane
  // holds while it waits for room in x.
  for (const Case c : {Case{1, 1, 200}, Case{1, 4, 200}, Case{2, 1, 400}}) {
    INFO("lanes " << c.lanes << ", workers " << c.workers);
    const Crossing out = crossing_tasks(c.lanes, c.workers, c.each);
    CHECK(out.wrong == 0);
    REQUIRE(out.blocks.size() == 2);
    for (const auto& b : out.blocks) {
      CHECK(b.processed == static_cast<std::uint64_t>(2 * c.each));
      CHECK(b.failed == 0);
      CHECK(b.queue.depth == 0);
    }
  }
}

TEST_CASE("run_on_lane runs the application's work on a lane and returns its value or exception", "[lanes]") {
  Session session;
  session.add_block(test::unary("id", [](const Tensor& x) { return x; })).add_path(Path::chain("t", {"id"}));
  CHECK_THROWS_AS(session.run_on_lane([] { return 1; }).get(), std::logic_error);  // not started
  test::require_started(session);
  CHECK(session.run_on_lane([] { return this_thread_name(); }).get().rfind("bf-lane/", 0) == 0);
  CHECK(session.run_on_lane([] { return at::ones({3}).sum().item<int>(); }).get() == 3);
  auto failing = session.run_on_lane([]() -> int { throw std::runtime_error("app error"); });
  CHECK_THROWS_WITH(failing.get(), "app error");
  session.run_on_lane([] {}).get();  // void
  CHECK(session.submit("t", at::ones({1})).get().ok());  // the lane serves on
  CHECK(session.metrics().lanes.at(0).tasks >= 4);
  session.shutdown();
  CHECK_THROWS_AS(session.run_on_lane([] { return 1; }).get(), std::logic_error);
}

namespace {

// Records the thread count (at::get_num_threads(): this thread's OpenMP setting) each run of a block
// saw. Once armed, "b1" waits (10 s at most) until "other" has run.
struct WidthLog {
  std::mutex mu;
  std::vector<std::pair<std::string, int>> seen;  // block, threads
  std::atomic<bool> armed{false}, gate_timed_out{false}, other_notified{false};
  absl::Notification other_ran;
  void add(const std::string& block, int n) {
    std::lock_guard lock(mu);
    seen.emplace_back(block, n);
  }
  std::vector<std::pair<std::string, int>> take() {
    std::lock_guard lock(mu);
    return std::exchange(seen, {});
  }
  // How many runs saw `threads` threads.
  static long count(const std::vector<std::pair<std::string, int>>& runs, int threads) {
    return std::count_if(runs.begin(), runs.end(), [threads](const auto& r) { return r.second == threads; });
  }
};

std::shared_ptr<Block> width_logging(const std::string& name, WidthLog& log, int intra_op_threads, int workers = 1) {
  BlockOptions options;
  options.intra_op_threads = intra_op_threads;
  options.workers = workers;
  options.input_shapes = {{4}};
  return test::unary(name, [&log, name](const Tensor& x) {
    log.add(name, at::get_num_threads());
    if (log.armed.load() && name == "b1" && !log.other_ran.WaitForNotificationWithTimeout(absl::Seconds(10))) {
      log.gate_timed_out = true;
    }
    if (log.armed.load() && name == "other" && !log.other_notified.exchange(true)) log.other_ran.Notify();
    return x + 1;
  }, options);
}

}  // namespace

TEST_CASE("elastic lanes: a request alone runs on the team, work beside other work runs with one thread", "[lanes]") {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  if (cores < 2) {
    WARN("one hardware thread: no core is left for a one-thread lane");
    return;
  }
  // A team of every core: one team lane and cores - 1 one-thread lanes, whatever the machine.
  const int team = cores;
  WidthLog log;
  const int threads_before = process_threads();
  Session session;  // default SessionOptions: lanes 0, elastic
  for (const char* name : {"b1", "b2", "b3", "other"}) session.add_block(width_logging(name, log, team));
  session.add_path(Path::chain("chain", {"b1", "b2", "b3"})).add_path(Path::chain("other", {"other"}));
  test::require_started(session);
  const auto m = session.metrics();
  REQUIRE(static_cast<int>(m.lanes.size()) == cores);
  CHECK(m.lane_intra_op_threads == team);
  CHECK(m.lanes[0].threads == team);
  for (std::size_t i = 1; i < m.lanes.size(); ++i) CHECK(m.lanes[i].threads == 1);
  // Warm-up (warmup_runs 2) ran each block three times. First the runs at one thread, the four
  // blocks' spread over the lanes: the profiling run and the last run's one-thread pass; then the
  // last run with the team's threads, on the team lane (docs/lanes.md, "Warm-up and loading").
  const auto warm = log.take();
  REQUIRE(warm.size() == 12);
  for (const char* name : {"b1", "b2", "b3", "other"}) {
    INFO("block " << name);
    const auto runs_of = [&](int threads) {
      return std::count(warm.begin(), warm.end(), std::pair<std::string, int>(name, threads));
    };
    CHECK(runs_of(1) == 2);
    CHECK(runs_of(team) == 1);
  }
  for (std::size_t i = 0; i < warm.size(); ++i) {
    INFO("warm-up run " << i << ": block " << warm[i].first << ", " << warm[i].second << " threads");
    CHECK(warm[i].second == (i < 8 ? 1 : team));
  }
#if !defined(__SANITIZE_THREAD__)
  // One-thread lanes make no OpenMP team: the team lane's threads, one per other lane, 2 to spare.
  CHECK(process_threads() - threads_before <= team + (cores - 1) + 2);
#endif

  SECTION("requests one at a time run on the team lane with the team's threads") {
    const auto before = session.metrics().lanes;
    for (int i = 0; i < 10; ++i) {
      const Result r = session.submit("chain", at::zeros({4})).get();
      REQUIRE(r.ok());
      CHECK(at::equal(r.output(), at::full({4}, 3.0)));
    }
    const auto seen = log.take();
    CHECK(seen.size() == 30);
    CHECK(WidthLog::count(seen, team) == 30);
    const auto after = session.metrics().lanes;
    CHECK(after[0].runs - before[0].runs == 30);
    CHECK(after[0].one_thread_runs == before[0].one_thread_runs);
    for (std::size_t i = 1; i < after.size(); ++i) CHECK(after[i].runs == before[i].runs);
  }

  SECTION("three requests ready at once: two run at the same time, each with one thread") {
    // The team lane is held by an application task (alone, so with every core booked) while a
    // request of "chain" and two of "other" are queued. Once it is free three units wait (a unit
    // with two beside it runs narrow): whichever lane takes the first runs it with one thread, and
    // another lane takes the next, with one thread too. b1 waits until "other" has run: they ran at
    // the same time, on two lanes.
    const auto before = session.metrics().lanes;
    log.armed = true;
    absl::Notification hold, held;
    auto holder = session.run_on_lane([&] {
      held.Notify();
      hold.WaitForNotification();
    });
    held.WaitForNotification();
    auto chain = session.submit("chain", at::zeros({4}));
    auto other1 = session.submit("other", at::zeros({4}));
    auto other2 = session.submit("other", at::zeros({4}));
    hold.Notify();
    holder.get();
    const Result c = chain.get();
    REQUIRE(c.ok());
    REQUIRE(other1.get().ok());
    REQUIRE(other2.get().ok());
    CHECK(at::equal(c.output(), at::full({4}, 3.0)));
    CHECK_FALSE(log.gate_timed_out.load());
    const auto seen = log.take();
    REQUIRE(seen.size() == 5);
    CHECK(std::count(seen.begin(), seen.end(), std::pair<std::string, int>("b1", 1)) == 1);
    CHECK(std::count(seen.begin(), seen.end(), std::pair<std::string, int>("other", 1)) >= 1);
    const auto after = session.metrics().lanes;
    CHECK(after[0].one_thread_runs > before[0].one_thread_runs);
    std::uint64_t one_thread_lanes_ran = 0;
    for (std::size_t i = 1; i < after.size(); ++i) one_thread_lanes_ran += after[i].runs - before[i].runs;
    CHECK(one_thread_lanes_ran >= 1);
  }
}

TEST_CASE("warm-up: two blocks' runs with one thread run at the same time, on two lanes", "[lanes]") {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  if (cores < 2) {
    WARN("one hardware thread: nothing runs beside anything");
    return;
  }
  // b1's runs wait (up to 10 s) until other's first has begun: one after another on the team lane,
  // b1's first would wait alone and time out.
  WidthLog log;
  log.armed = true;
  Session session;  // default SessionOptions: elastic
  session.add_block(width_logging("b1", log, cores)).add_block(width_logging("other", log, cores));
  session.add_path(Path::chain("t", {"b1"})).add_path(Path::chain("u", {"other"}));
  test::require_started(session);
  log.armed = false;
  CHECK_FALSE(log.gate_timed_out.load());
  const auto lanes = session.metrics().lanes;
  REQUIRE(lanes.size() >= 2);
  std::size_t lanes_with_tasks = 0;
  for (const auto& lane : lanes) lanes_with_tasks += lane.tasks > 0 ? 1 : 0;
  CHECK(lanes_with_tasks >= 2);
  const auto warm = log.take();
  CHECK(WidthLog::count(warm, 1) == 4);      // each block: the profiling run, the last with one thread
  CHECK(WidthLog::count(warm, cores) == 2);  // each block: the last with the team's
}

TEST_CASE("elastic lanes: a lone block one lane at a time runs is not warmed up with one thread; one two lanes may run is",
          "[lanes]") {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  if (cores < 2) {
    WARN("one hardware thread: no one-thread lane");
    return;
  }
  // A one-thread lane runs a block only while the team lane is busy: with a lone block that allows
  // one lane at a time (a worker process's), never; its width-1 warm-up run would be wasted.
  for (const int workers : {1, 2}) {
    DYNAMIC_SECTION("BlockOptions::workers " << workers) {
      WidthLog log;
      Session session;  // default SessionOptions: elastic
      session.add_block(width_logging("b1", log, cores, workers)).add_path(Path::chain("t", {"b1"}));
      test::require_started(session);
      REQUIRE(session.metrics().lanes.size() == static_cast<std::size_t>(cores));  // a team lane, one-thread lanes
      const auto warm = log.take();  // warmup_runs 2
      CHECK(warm.size() == (workers == 1 ? 2U : 3U));
      CHECK(WidthLog::count(warm, 1) == (workers == 1 ? 0 : 1));
      CHECK(WidthLog::count(warm, cores) == 2);
    }
  }
}

TEST_CASE("SessionOptions::warm_up_last_narrow: the last warm-up run too with warm_up_threads; requests with the team's",
          "[lanes]") {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  if (cores < 2) {
    WARN("one hardware thread: no narrower width to warm up with");
    return;
  }
  for (const bool narrow : {true, false}) {
    DYNAMIC_SECTION("warm_up_last_narrow " << narrow) {
      WidthLog log;
      SessionOptions options;
      options.warm_up_threads = 1;
      options.warm_up_last_narrow = narrow;
      Session session(options);
      session.add_block(width_logging("b1", log, cores)).add_path(Path::chain("t", {"b1"}));
      test::require_started(session);
      const auto warm = log.take();  // warmup_runs 2, a lone block: no one-thread run of its own
      REQUIRE(warm.size() == 2);
      CHECK(warm[0].second == 1);
      CHECK(warm[1].second == (narrow ? 1 : cores));
      REQUIRE(session.submit("t", at::zeros({4})).get().ok());
      const auto served = log.take();
      REQUIRE(served.size() == 1);
      CHECK(served[0].second == cores);  // the lane's width is back for requests
    }
  }
}

TEST_CASE("SessionOptions::warm_up_threads: warm-up runs before the last use that many threads, the last and requests the lane's",
          "[lanes]") {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  if (cores < 2) {
    WARN("one hardware thread: no narrower width to warm up with");
    return;
  }
  for (const int intra_op : {cores, 0}) {  // 0: the lanes run libtorch's default width
    DYNAMIC_SECTION("block intra_op_threads " << intra_op) {
      WidthLog log;
      SessionOptions options;
      options.warm_up_threads = 1;
      options.elastic_lanes = false;  // one width: the team's
      Session session(options);
      session.add_block(width_logging("b1", log, intra_op)).add_path(Path::chain("t", {"b1"}));
      test::require_started(session);
      const auto warm = log.take();  // warmup_runs 2
      REQUIRE(warm.size() == 2);
      CHECK(warm[0].second == 1);
      CHECK(warm[1].second > 1);
      if (intra_op > 0) CHECK(warm[1].second == intra_op);
      const Result r = session.submit("t", at::zeros({4})).get();
      REQUIRE(r.ok());
      const auto served = log.take();
      REQUIRE(served.size() == 1);
      CHECK(served[0].second == warm[1].second);  // the lane's width is back for requests
    }
  }
}
