// Direct edges between workers on channel "zmq" (WorkerOptions::direct_edges): a block's outputs stay
// in its worker, the session gets placeholders and tells that worker to send them straight to the
// worker of the next block. Equality with threads mode, what the metrics count, fan-out, a chain
// through one worker, and kill -9 of the worker that holds the outputs.
#include "worker_util.hpp"

#include <blockflow/deploy/deployment.hpp>

#include <csignal>

using namespace blockflow;
using Catch::Matchers::Contains;
using namespace std::chrono_literals;

namespace {

WorkerOptions zmq_worker(const std::string& name, bool direct = true) {
  WorkerOptions o = test::test_worker(name, "zmq");
  o.direct_edges = direct;
  return o;
}

const SiteStats& site_named(const MetricsSnapshot& m, const std::string& name) {
  for (const auto& s : m.sites) {
    if (s.name == name) return s;
  }
  throw std::runtime_error("no site " + name);
}

}  // namespace

TEST_CASE("direct edges: three zmq workers equal threads; outputs go worker to worker", "[direct]") {
  Session threads;
  threads.add_block(test::model_block("b1", "cnn_block1.pt", "", {-1, 3, 16, 16}))
      .add_block(test::model_block("b2", "cnn_block2.pt", "", {-1, 8, 16, 16}))
      .add_block(test::model_block("b3", "cnn_block3.pt", "", {-1, 16, 8, 8}))
      .add_path(Path::chain("cnn", {"b1", "b2", "b3"}));
  test::require_started(threads);
  for (const bool direct : {true, false}) {
    DYNAMIC_SECTION("direct_edges " << direct) {
      Session workers;
      workers.add_site(make_worker(zmq_worker("w1", direct)))
          .add_site(make_worker(zmq_worker("w2", direct)))
          .add_site(make_worker(zmq_worker("w3", direct)))
          .add_block(test::model_block("b1", "cnn_block1.pt", "w1", {-1, 3, 16, 16}))
          .add_block(test::model_block("b2", "cnn_block2.pt", "w2", {-1, 8, 16, 16}))
          .add_block(test::model_block("b3", "cnn_block3.pt", "w3", {-1, 16, 8, 8}))
          .add_path(Path::chain("cnn", {"b1", "b2", "b3"}));
      test::require_started(workers);
      at::manual_seed(5);
      constexpr int kRequests = 8;
      for (int i = 0; i < kRequests; ++i) {
        const Tensor x = at::randn({1 + i % 3, 3, 16, 16});
        Result a = threads.submit("cnn", x).get();
        Result b = workers.submit("cnn", x).get();
        REQUIRE(a.ok());
        INFO(b.status.ToString());
        REQUIRE(b.ok());
        CHECK(b.output().device().is_cpu());
        CHECK(at::equal(a.output(), b.output()));
        REQUIRE(b.trace.hops.size() == 3);
        for (const auto& hop : b.trace.hops) CHECK(hop.compute_ms() > 0);
      }
      const auto m = workers.metrics();
      // b1 and b2 keep their outputs for the next worker; b3's output is the result.
      CHECK(site_named(m, "w1").parked_outputs == (direct ? kRequests : 0));
      CHECK(site_named(m, "w2").parked_outputs == (direct ? kRequests : 0));
      CHECK(site_named(m, "w3").parked_outputs == 0);
      // The host's sender counts a forward once its send returns, which can be after the request
      // it carried has already resolved.
      for (const char* w : {"w1", "w2"}) {
        CHECK(test::eventually([&] { return site_named(workers.metrics(), w).direct_forwards == (direct ? kRequests : 0); }));
      }
      CHECK(site_named(m, "w3").direct_forwards == 0);
      for (const auto& s : m.sites) {
        CHECK(s.data.sent == kRequests);
        CHECK(s.data.received == kRequests);
        CHECK(s.in_flight == 0);
      }
    }
  }
}

TEST_CASE("direct edges: two blocks in one worker, fan-out to two workers, a host block after", "[direct]") {
  // a, b in w1 (the output of a stays in w1: no socket), then fan-out to c (w2) and d (w3), joined in
  // the host; e in the host's threads after a worker block (its input comes back as bytes).
  Session session;
  session.add_site(make_worker(zmq_worker("w1")))
      .add_site(make_worker(zmq_worker("w2")))
      .add_site(make_worker(zmq_worker("w3")))
      .add_block(test::plugin_block("a", "affine", "w1"))
      .add_block(test::plugin_block("b", "affine", "w1"))
      .add_block(test::plugin_block("c", "affine", "w2"))
      .add_block(test::plugin_block("d", "slow_identity", "w3"))
      .add_block(test::unary("e", [](const Tensor& x) { return 3 * x + 1; }))
      .add_path(Path("fan")
                    .then("a")
                    .then("b")
                    .node("c", {"b"})
                    .node("d", {"b"})
                    .join("sum", {"c", "d"}, Combine::mean()))
      .add_path(Path::chain("tail", {"a", "e"}));
  test::require_started(session);
  for (int i = 0; i < 5; ++i) {
    const Tensor x = at::full({3}, static_cast<double>(i));
    Result r = session.submit("fan", x).get();
    INFO(r.status.ToString());
    REQUIRE(r.ok());
    const Tensor ab = 3 * (3 * x + 1) + 1;
    CHECK(at::allclose(r.output(), ((3 * ab + 1) + ab) / 2));
    Result t = session.submit("tail", x).get();
    REQUIRE(t.ok());
    CHECK(at::allclose(t.output(), 3 * (3 * x + 1) + 1));
  }
  const auto m = session.metrics();
  // a's and b's outputs stay in w1 on "fan"; a's output on "tail" goes to the host's block e.
  CHECK(site_named(m, "w1").parked_outputs == 10);
  CHECK(site_named(m, "w1").direct_forwards == 15);  // a -> b (to itself), b -> c, b -> d
  CHECK(site_named(m, "w2").parked_outputs == 0);      // c and d feed a join in the host
  CHECK(site_named(m, "w3").parked_outputs == 0);
  for (const auto& s : m.sites) CHECK(s.in_flight == 0);
}

TEST_CASE("direct edges: an output the wire cannot carry fails its request, named, whether parked or not", "[direct]") {
  // "c" returns complex numbers, which no wire format carries. Parked (direct edges), the worker's
  // result names the output it keeps; the failure must come back as an error reply, not be lost.
  const bool direct = GENERATE(true, false);
  Session session;
  session.add_site(make_worker(zmq_worker("w1", direct)))
      .add_site(make_worker(zmq_worker("w2", direct)))
      .add_block(test::plugin_block("c", "complex", "w1"))
      .add_block(test::plugin_block("next", "affine", "w2"))
      .add_path(Path::chain("t", {"c", "next"}));
  test::require_started(session);
  for (int i = 0; i < 3; ++i) {
    Result r = session.submit("t", at::zeros({4})).get();
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.status.ToString(), Contains("ComplexFloat") && Contains("no wire code"));
  }
  for (const auto& s : session.metrics().sites) CHECK(s.in_flight == 0);
}

TEST_CASE("direct edges: kill -9 of a worker holding or receiving parked outputs; every request resolves", "[direct]") {
  for (const std::string victim : {"w1", "w2"}) {
    DYNAMIC_SECTION("kill " << victim) {
      auto w1 = make_worker(zmq_worker("w1"));
      auto w2 = make_worker(zmq_worker("w2"));
      Session session;
      session.add_site(w1)
          .add_site(w2)
          .add_block(test::plugin_block("slow", "slow_identity", "w1"))
          .add_block(test::plugin_block("affine", "affine", "w2"))
          .add_path(Path::chain("t", {"slow", "affine"}));
      test::require_started(session);
      auto& site = victim == "w1" ? w1 : w2;
      const std::int64_t first_pid = site->pid();
      test::LoadClients load(session, "t", at::ones({256}), 3, "worker " + victim + " killed by signal 9",
                             [](const Tensor& y) { return at::equal(y, at::full({256}, 4.0)); });
      // Until the restarted worker (and the chain through it) has served requests again.
      load.check_kill_under_load(first_pid, 30);
      CHECK(site->pid() != first_pid);
      const auto m = session.metrics();
      CHECK(site_named(m, victim).restarts == 1);
      CHECK(site_named(m, "w1").direct_forwards >= 30);
      for (const auto& s : m.sites) CHECK(s.in_flight == 0);
    }
  }
}

TEST_CASE("direct edges: apply() removes the second worker of a chain under traffic; every request resolves", "[direct]") {
  auto parse = [](const std::string& json) {
    auto d = Deployment::parse(json);
    INFO(d.status().ToString());
    REQUIRE(d.ok());
    return *d;
  };
  Session session;
  add_deployment(session, parse(R"({"blocks": [{"name": "a", "factory": "affine", "placement": "w1"},
                                               {"name": "c", "factory": "affine", "placement": "w2"}],
                                    "tasks": {"t1": ["a"], "t3": ["a", "c"]}})"),
                 zmq_worker(""));
  test::require_started(session);
  // t3 = c(a(x)) = 3(3x + 1) + 1: 13 for x = 1, its input to c parked in w1 each time.
  std::atomic<int> sent{0}, ok{0}, refused{0}, other{0};
  std::thread traffic([&] {
    for (int i = 0; i < 2000 && refused < 5; ++i) {
      Result r = session.submit("t3", at::full({64}, 1.0)).get();
      ++sent;
      if (r.ok() && at::equal(r.output(), at::full({64}, 13.0))) ++ok;
      else if (!r.ok() && r.status.message().find("t3") != std::string::npos) ++refused;
      else ++other;
    }
  });
  CHECK(test::eventually([&] { return ok.load() >= 20; }, std::chrono::milliseconds(120000)));  // a wrong result: reported
  auto v1 = session.apply(parse(R"({"blocks": [{"name": "a", "factory": "affine", "placement": "w1"}],
                                    "tasks": {"t1": ["a"]}})"));
  INFO(v1.status().ToString());
  REQUIRE(v1.ok());
  traffic.join();
  INFO("t3: sent " << sent << ", ok " << ok << ", refused " << refused << ", other " << other);
  CHECK(other == 0);
  CHECK(refused > 0);
  auto m = session.metrics();
  REQUIRE(m.sites.size() == 1);
  CHECK(m.sites[0].direct_forwards >= 20);
  CHECK(m.sites[0].in_flight == 0);
  // c comes back in a new w2; the chain goes worker to worker again.
  auto v2 = session.apply(parse(R"({"blocks": [{"name": "a", "factory": "affine", "placement": "w1"},
                                               {"name": "c", "factory": "affine", "placement": "w2"}],
                                    "tasks": {"t1": ["a"], "t3": ["a", "c"]}})"));
  INFO(v2.status().ToString());
  REQUIRE(v2.ok());
  const std::uint64_t forwards = session.metrics().sites.at(0).direct_forwards;
  Result r = session.submit("t3", at::full({2}, 0.0)).get();
  REQUIRE(r.ok());
  CHECK(at::equal(r.output(), at::full({2}, 4.0)));
  CHECK(session.metrics().sites.at(0).direct_forwards == forwards + 1);
}
