// Built-in measurement: per-request decomposition adds up; aggregates count; JSON round-trips.
#include "test_util.hpp"

#include <blockflow/core/detail/histogram.hpp>
#include <blockflow/core/detail/utf8_text.hpp>

#include <nlohmann/json.hpp>

#include <future>

using namespace blockflow;
using Catch::Matchers::Contains;
using namespace std::chrono_literals;

TEST_CASE("wait + compute + overhead per request equals its end-to-end time", "[metrics]") {
  Session session;
  BlockOptions options;
  options.intra_op_threads = 2;
  options.input_shapes = {{-1, 3, 16, 16}};
  session.add_block(test::load_block("b1", "cnn_block1.pt", options))
      .add_block(test::slow_plus_one("sleepy", 3ms))
      .add_path(Path::chain("t", {"b1", "sleepy"}));
  test::require_started(session);
  // Concurrent requests, so that queueing (wait) is non-zero for some of them.
  std::vector<std::future<Result>> futures;
  std::vector<std::int64_t> submitted;
  for (int i = 0; i < 12; ++i) {
    submitted.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now().time_since_epoch()).count());
    futures.push_back(session.submit("t", at::randn({1, 3, 16, 16})));
  }
  double total_wait = 0;
  for (std::size_t i = 0; i < futures.size(); ++i) {
    Result r = futures[i].get();
    const auto got = std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::steady_clock::now().time_since_epoch()).count();
    REQUIRE(r.ok());
    const auto& t = r.trace;
    REQUIRE(t.hops.size() == 2);
    const double parts = t.wait_ms() + t.compute_ms() + t.overhead_ms();
    CHECK(parts == Approx(t.e2e_ms()).margin(1e-6));  // the decomposition leaves no gap
    // The trace lies inside what the client observed.
    CHECK(t.submitted_ns >= submitted[i]);
    CHECK(t.resolved_ns <= got);
    for (const auto& hop : t.hops) {
      CHECK(hop.wait_ms() >= 0);
      CHECK(hop.compute_ms() > 0);
      CHECK(hop.overhead_ms() >= 0);
      CHECK(hop.input_ready_ns <= hop.arrived_ns);
      CHECK(hop.arrived_ns <= hop.dequeued_ns);
      CHECK(hop.dequeued_ns <= hop.compute_start_ns);
      CHECK(hop.compute_end_ns <= hop.done_ns);
    }
    CHECK(t.hops[1].compute_ms() >= 3.0);  // the sleep is inside compute
    CHECK(t.hops[0].done_ns == t.hops[1].input_ready_ns);
    total_wait += t.wait_ms();
  }
  CHECK(total_wait > 0);  // 12 requests at once through a 3 ms block must have queued

  const auto m = session.metrics();
  REQUIRE(m.blocks.size() == 2);
  CHECK(m.blocks[0].processed == 12);
  CHECK(m.blocks[1].processed == 12);
  CHECK(m.blocks[1].compute.count == 12);
  CHECK(m.blocks[1].compute.p50_ms >= 2.9);
  CHECK(m.blocks[1].compute.p50_ms <= m.blocks[1].compute.p99_ms);
  CHECK(m.blocks[1].queue.high_watermark >= 1);
  REQUIRE(m.paths.size() == 1);
  CHECK(m.paths[0].submitted == 12);
  CHECK(m.paths[0].completed == 12);
  CHECK(m.paths[0].e2e.p50_ms >= m.paths[0].compute.p50_ms);
  CHECK(m.paths[0].throughput_per_s > 0);
}

TEST_CASE("waiting for room in a full queue counts as the block's wait, not as hand-off overhead", "[metrics]") {
  SessionOptions so;
  so.lanes = 3;
  so.intra_op_threads = 1;
  Session session(so);
  test::Latch latch;
  BlockOptions held;
  held.queue_capacity = 1;
  session.add_block(test::unary("first", [](const Tensor& x) { return x + 1; }))
      .add_block(test::unary("held", [&latch](const Tensor& x) {
        latch.entered.fetch_add(1);
        latch.wait();
        return x + 1;
      }, held))
      .add_path(Path::chain("t", {"first", "held"}));
  test::require_started(session);
  std::vector<std::future<Result>> futures;
  for (int i = 0; i < 3; ++i) futures.push_back(session.submit("t", at::full({1}, double(i))));
  // One request in "held", one in its queue (capacity 1), the third's lane waiting for room.
  const auto first_done = [&] {
    for (const auto& b : session.metrics().blocks) {
      if (b.name == "first") return b.processed;
    }
    return std::uint64_t{0};
  };
  REQUIRE(test::eventually([&] { return latch.entered.load() == 1 && first_done() == 3; }));
  std::this_thread::sleep_for(150ms);  // the third's lane is waiting for room by now
  const std::int64_t released_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                       std::chrono::steady_clock::now().time_since_epoch()).count();
  latch.release();
  for (auto& f : futures) {
    Result r = f.get();
    REQUIRE(r.ok());
    REQUIRE(r.trace.hops.size() == 2);
    const HopTiming& hop = r.trace.hops[1];
    INFO("wait " << hop.wait_ms() << " ms, overhead " << hop.overhead_ms() << " ms");
    // Each reached "held" before the latch opened (running, queued, or waiting for room there): its
    // wait there began then, and what came after is wait, not hand-off overhead. Without counting
    // the wait for room, the third arrived only once the queue had room, after the release.
    CHECK(hop.arrived_ns < released_ns);
    CHECK(r.trace.wait_ms() + r.trace.compute_ms() + r.trace.overhead_ms() == Approx(r.trace.e2e_ms()).margin(1e-6));
  }
}

TEST_CASE("computing_s shows how long a block call in progress has run, and 0 once it returned", "[metrics]") {
  std::atomic<bool> entered{false};
  Session session;
  // After the session: should a check fail, the promise goes first, and the blocked call returns.
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  session.add_block(test::unary("held", [released, &entered](const Tensor& x) {
    entered = true;
    released.wait();
    return x + 1;
  }));
  session.add_path(Path::chain("t", {"held"}));
  test::require_started(session);
  CHECK(session.metrics().blocks.at(0).computing_s == 0);
  auto pending = session.submit("t", at::ones({2}));
  REQUIRE(test::eventually([&] { return entered.load(); }));
  const double first = session.metrics().blocks.at(0).computing_s;
  CHECK(first > 0);
  REQUIRE(test::eventually([&] { return session.metrics().blocks.at(0).computing_s > first; }));  // growing
  CHECK_THAT(session.metrics().to_prometheus(), Contains("blockflow_block_computing_seconds{block=\"held\""));
  release.set_value();
  REQUIRE(pending.get().ok());
  CHECK(session.metrics().blocks.at(0).computing_s == 0);
}

TEST_CASE("the metrics snapshot serialises to JSON with every field", "[metrics]") {
  Session session;
  session.add_block(test::unary("a", [](const Tensor& x) { return x; })).add_path(Path::chain("t", {"a"}));
  test::require_started(session);
  for (int i = 0; i < 3; ++i) REQUIRE(session.submit("t", at::ones({1})).get().ok());
  const auto snapshot = session.metrics();
  const auto json = nlohmann::json::parse(snapshot.to_json());
  CHECK(json["in_flight"] == 0);
  REQUIRE(json["blocks"].size() == 1);
  const auto& block = json["blocks"][0];
  CHECK(block["name"] == "a");
  CHECK(block["kind"] == "callable");
  CHECK(block["device"] == "cpu");
  CHECK(block["processed"] == 3);
  CHECK(block["compute"]["count"] == 3);
  CHECK(block["queue"]["kind"] == "inproc");
  CHECK(block["queue"]["bytes_copied"] == 0);
  CHECK(block["queue"]["capacity"] == 64);
  const auto& path = json["paths"][0];
  CHECK(path["task"] == "t");
  CHECK(path["completed"] == 3);
  CHECK(path["e2e"]["p50_ms"].get<double>() == Approx(snapshot.paths[0].e2e.p50_ms));
  CHECK(path["e2e"]["p99_ms"].get<double>() >= path["e2e"]["p50_ms"].get<double>());
}

TEST_CASE("cold start and update figures: process start, start(), the first result", "[metrics]") {
  Session session;
  session.add_block(test::slow_plus_one("sleepy", 5ms)).add_path(Path::chain("t", {"sleepy"}));
  const auto before_start = std::chrono::steady_clock::now();
  test::require_started(session);
  const double start_call_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - before_start).count();
  auto m = session.metrics();
  CHECK(m.start.process_to_start_ms > 0);  // this test binary started before
  CHECK(m.start.start_ms > 0);
  CHECK(m.start.start_ms <= start_call_ms);
  CHECK(m.start.time_to_first_result_ms == 0);  // no request yet
  REQUIRE(session.submit("t", at::ones({1})).get().ok());
  REQUIRE(session.submit("t", at::ones({1})).get().ok());
  m = session.metrics();
  // Process start <= start() called <= start() returned <= the first result (>= 5 ms of compute later).
  CHECK(m.start.time_to_first_result_ms >= m.start.process_to_start_ms + m.start.start_ms + 5.0);
  const double first = m.start.time_to_first_result_ms;
  CHECK(session.metrics().start.time_to_first_result_ms == first);  // the first, not the latest
  CHECK(m.last_update.time_to_first_result_ms == 0);  // no update yet

  auto d = Deployment::parse(R"({"blocks": ["sleepy"], "tasks": {"t": ["sleepy"], "u": ["sleepy"]}})");
  INFO(d.status().ToString());
  REQUIRE(d.ok());
  auto v = session.apply(*d);
  REQUIRE(v.ok());
  CHECK(session.metrics().last_update.time_to_first_result_ms == 0);
  REQUIRE(session.submit("u", at::ones({1})).get().ok());
  m = session.metrics();
  CHECK(m.last_update.time_to_first_result_ms >= m.last_update.total_ms + 5.0);  // after apply() returned
  CHECK(m.start.time_to_first_result_ms == first);
  const std::string prometheus = m.to_prometheus();
  CHECK(prometheus.find("blockflow_start_seconds{phase=\"first_result\"}") != std::string::npos);
  CHECK(prometheus.find("blockflow_last_update_seconds{phase=\"first_result\"}") != std::string::npos);
}

TEST_CASE("histogram percentiles are within 2% of the exact values", "[metrics]") {
  blockflow::detail::Histogram h;
  for (int i = 1; i <= 1000; ++i) h.record(std::int64_t{i} * 1000);  // 1 us .. 1 ms
  const auto s = h.stats();
  CHECK(s.count == 1000);
  CHECK(s.p50_ms == Approx(0.5).epsilon(0.02));
  CHECK(s.p90_ms == Approx(0.9).epsilon(0.02));
  CHECK(s.p99_ms == Approx(0.99).epsilon(0.02));
  CHECK(s.max_ms == Approx(1.0));
  CHECK(s.mean_ms == Approx(0.5005));
  CHECK(s.sum_ms == 500.5);  // exact: 500500 us
  CHECK(blockflow::detail::Histogram().stats().count == 0);
  // A summary's _sum is that sum, not mean x count: waits of 0 ns that come later change the mean
  // and the count, and mean x count may come out an ulp lower (a counter reset to Prometheus).
  for (int i = 0; i < 3; ++i) h.record(0);
  MetricsSnapshot snapshot;
  PathMetrics p;
  p.task = "t";
  p.e2e = h.stats();
  snapshot.paths = {p};
  CHECK_THAT(snapshot.to_prometheus(), Contains("blockflow_path_latency_seconds_sum{path=\"t\"} 0.5005\n"));
}

TEST_CASE("UTF-8 as written out: well-formed sequences kept, every other byte U+FFFD", "[metrics]") {
  using blockflow::detail::utf8_or_replaced;
  const std::string r = "\xEF\xBF\xBD";
  CHECK(utf8_or_replaced("plain-name_1.x") == "plain-name_1.x");
  CHECK(utf8_or_replaced("caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80") == "caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80");
  CHECK(utf8_or_replaced("caf\xE9") == "caf" + r);                 // Latin-1
  CHECK(utf8_or_replaced("\xC0\xAF") == r + r);                     // overlong '/'
  CHECK(utf8_or_replaced("\xED\xA0\x80") == r + r + r);             // a surrogate
  CHECK(utf8_or_replaced("\xF4\x90\x80\x80") == r + r + r + r);     // past U+10FFFF
  CHECK(utf8_or_replaced("\xE2\x82") == r + r);                     // cut short
  CHECK(blockflow::detail::dump_json(nlohmann::json("a\xFF")) == "\"a" + r + "\"");
}

TEST_CASE("blockflow_worker_up: a worker's process running; a joined worker or another site: not lost", "[metrics]") {
  MetricsSnapshot snapshot;
  SiteStats spawned, joined, gone;
  spawned.name = "w1";
  spawned.kind = "worker";
  spawned.pid = 0;  // down, between restarts
  joined.name = "w2";
  joined.kind = "joined-worker";
  gone.name = "w3";
  gone.kind = "joined-worker";
  gone.lost = true;
  snapshot.sites = {spawned, joined, gone};
  const std::string text = snapshot.to_prometheus();
  CHECK_THAT(text, Contains("blockflow_worker_up{worker=\"w1\",kind=\"worker\"} 0\n"));
  CHECK_THAT(text, Contains("blockflow_worker_up{worker=\"w2\",kind=\"joined-worker\"} 1\n"));
  CHECK_THAT(text, Contains("blockflow_worker_up{worker=\"w3\",kind=\"joined-worker\"} 0\n"));
}
