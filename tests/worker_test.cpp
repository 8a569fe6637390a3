// Blocks in child worker processes: equality with threads mode, mixed placement, C++ blocks through
// a plugin, kill -9 under load (every request resolves, the worker restarts), start errors, no
// orphans; the configuration a worker gets (heartbeat interval, parked-output bound) and applies.
#include "joined_util.hpp"

#include <blockflow/core/detail/process_state.hpp>
#include <blockflow/worker/detail/worker_protocol.hpp>

#include <nlohmann/json.hpp>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <memory>

using namespace blockflow;
using Catch::Matchers::Contains;
using namespace std::chrono_literals;

namespace {

using test::process_exists;

// The test plays the session for one `blockflow-worker --join ENDPOINT --name NAME --once`: it
// binds the control socket and the two data sockets, and reads and writes the control messages.
class FakeHost {
 public:
  explicit FakeHost(const std::string& name) {
    for (zmq::socket_t* s : {&control_, &requests_, &results_}) s->set(zmq::sockopt::linger, 0);
    control_.bind("tcp://127.0.0.1:*");
    requests_.bind("tcp://127.0.0.1:*");
    results_.bind("tcp://127.0.0.1:*");
    worker_ = std::make_unique<test::WorkerProcess>(test::WorkerProcess::join_args(
        control_.get(zmq::sockopt::last_endpoint), name, {"--plugin", BLOCKFLOW_TEST_PLUGIN}));
  }
  FakeHost(const FakeHost&) = delete;
  FakeHost& operator=(const FakeHost&) = delete;

  // The next control message of this type from the worker (others are skipped); fails the test if
  // none comes within `within`.
  nlohmann::json expect(const std::string& type, std::chrono::milliseconds within = std::chrono::seconds(60)) {
    const auto deadline = std::chrono::steady_clock::now() + within;
    while (std::chrono::steady_clock::now() < deadline) {
      zmq::pollitem_t item{control_.handle(), 0, ZMQ_POLLIN, 0};
      zmq::poll(&item, 1, std::chrono::milliseconds(100));
      if ((item.revents & ZMQ_POLLIN) == 0) continue;
      std::vector<zmq::message_t> parts;
      if (!zmq::recv_multipart(control_, std::back_inserter(parts)) || parts.size() != 2) continue;
      identity_ = parts[0].to_string();
      auto message = nlohmann::json::parse(parts[1].to_string(), nullptr, false);
      if (!message.is_discarded() && message.value("type", "") == type) return message;
    }
    FAIL("no '" << type << "' message from the worker");
    return {};
  }
  void send(nlohmann::json message) {
    if (message.value("type", "") == blockflow::detail::kConfig) {  // a joined worker learns the data ports
      message["requests_port"] = port_of(requests_);
      message["results_port"] = port_of(results_);
    }
    (void)control_.send(zmq::buffer(identity_), zmq::send_flags::sndmore);
    (void)control_.send(zmq::buffer(message.dump()), zmq::send_flags::none);
  }
  // The worker's exit status once it has exited (within `within`).
  std::optional<int> exit_status(std::chrono::milliseconds within) { return worker_->exit_status(within); }

 private:
  static int port_of(zmq::socket_t& socket) {
    const std::string endpoint = socket.get(zmq::sockopt::last_endpoint);
    return std::stoi(endpoint.substr(endpoint.rfind(':') + 1));
  }
  zmq::context_t context_;
  zmq::socket_t control_{context_, zmq::socket_type::router};
  zmq::socket_t requests_{context_, zmq::socket_type::push};
  zmq::socket_t results_{context_, zmq::socket_type::pull};
  std::string identity_;
  std::unique_ptr<test::WorkerProcess> worker_;  // killed, if still running, before the sockets close
};

}  // namespace

TEST_CASE("a split small CNN in two workers equals the same blocks in threads", "[worker]") {
  Session threads, workers;
  threads.add_block(test::model_block("b1", "cnn_block1.pt", "", {-1, 3, 16, 16}))
      .add_block(test::model_block("b2", "cnn_block2.pt", "", {-1, 8, 16, 16}))
      .add_block(test::model_block("b3", "cnn_block3.pt", "", {-1, 16, 8, 8}))
      .add_path(Path::chain("cnn", {"b1", "b2", "b3"}));
  workers.add_site(make_worker(test::test_worker("w1")))
      .add_site(make_worker(test::test_worker("w2")))
      .add_block(test::model_block("b1", "cnn_block1.pt", "w1", {-1, 3, 16, 16}))
      .add_block(test::model_block("b2", "cnn_block2.pt", "w2", {-1, 8, 16, 16}))
      .add_block(test::model_block("b3", "cnn_block3.pt", "", {-1, 16, 8, 8}))  // mixed: the head stays in the host
      .add_path(Path::chain("cnn", {"b1", "b2", "b3"}));
  test::require_started(threads);
  test::require_started(workers);
  at::manual_seed(11);
  for (int i = 0; i < 6; ++i) {
    const auto [a, b] = test::both_ok(threads, workers, "cnn", at::randn({1 + i % 3, 3, 16, 16}));
    CHECK(at::equal(a.output(), b.output()));
    REQUIRE(b.trace.hops.size() == 3);
    const double parts = b.trace.wait_ms() + b.trace.compute_ms() + b.trace.overhead_ms();
    CHECK(parts == Approx(b.trace.e2e_ms()).margin(1e-6));
    CHECK(b.trace.hops[0].compute_ms() > 0);
  }
  const auto m = workers.metrics();
  REQUIRE(m.sites.size() == 2);
  CHECK(m.sites[0].name == "w1");
  CHECK(m.sites[0].pid > 0);
  CHECK(m.sites[0].data.sent == 6);
  for (const auto& b : m.blocks) CHECK(b.placement == (b.name == "b1" ? "w1" : b.name == "b2" ? "w2" : "threads"));
}

TEST_CASE("C++ blocks run in a worker through a plugin; errors come back named", "[worker]") {
  Session session;
  session.add_site(make_worker(test::test_worker("w1")))
      .add_block(test::plugin_block("affine", "affine", "w1"))
      .add_block(test::model_block("raiser", "raise_block.pt", "w1", {-1, 3}))
      .add_path(Path::chain("t", {"affine"}))
      .add_path(Path::chain("boom", {"affine", "raiser"}));
  // The warm-up of raise_block raises: warm-up failures must name the worker and the block.
  auto status = session.start();
  CHECK_FALSE(status.ok());
  CHECK_THAT(std::string(status.message()), Contains("worker w1") && Contains("raiser") && Contains("boom from raise_block"));

  Session ok;
  BlockDescription raiser = test::model_block("raiser", "raise_block.pt", "w1", {});
  raiser.options.input_shapes.clear();  // no warm-up: the failure happens per request
  ok.add_site(make_worker(test::test_worker("w1")))
      .add_block(test::plugin_block("affine", "affine", "w1"))
      .add_block(raiser)
      .add_path(Path::chain("t", {"affine"}))
      .add_path(Path::chain("boom", {"affine", "raiser"}));
  test::require_started(ok);
  Result r = ok.submit("t", at::full({2}, 2.0)).get();
  REQUIRE(r.ok());
  CHECK(at::equal(r.output(), at::full({2}, 7.0)));
  Result e = ok.submit("boom", at::ones({2, 3})).get();
  CHECK_THAT(std::string(e.status.message()), Contains("worker w1") && Contains("block 'raiser'") &&
                                                  Contains("boom from raise_block"));
  CHECK(ok.submit("t", at::zeros({1})).get().ok());  // still serving
}

TEST_CASE("a worker that cannot load its blocks fails start(), naming worker and block", "[worker]") {
  Session session;
  BlockDescription missing = test::model_block("ghost", "no_such_file.pt", "w1", {1});
  session.add_site(make_worker(test::test_worker("w1"))).add_block(missing).add_path(Path::chain("t", {"ghost"}));
  auto status = session.start();
  CHECK_FALSE(status.ok());
  CHECK_THAT(std::string(status.message()), Contains("worker w1") && Contains("block 'ghost'") &&
                                                Contains("not found"));
  Session unknown_site;
  unknown_site.add_block(test::plugin_block("a", "affine", "nowhere")).add_path(Path::chain("t", {"a"}));
  CHECK_THAT(std::string(unknown_site.start().message()), Contains("block 'a'") && Contains("'nowhere'"));
}

TEST_CASE("start() starts every worker at once; one that cannot load fails it, and the others are stopped",
          "[worker]") {
  Session session;
  auto w1 = make_worker(test::test_worker("w1"));
  auto w2 = make_worker(test::test_worker("w2"));
  auto w3 = make_worker(test::test_worker("w3"));
  session.add_site(w1).add_site(w2).add_site(w3)
      .add_block(test::plugin_block("a", "affine", "w1"))
      .add_block(test::model_block("ghost", "no_such_file.pt", "w2", {1}))
      .add_block(test::plugin_block("c", "affine", "w3"))
      .add_path(Path::chain("t", {"a", "ghost", "c"}));
  const auto status = session.start();
  CHECK_FALSE(status.ok());
  CHECK_THAT(std::string(status.message()), Contains("worker w2") && Contains("block 'ghost'"));
  for (const auto& w : {w1, w2, w3}) CHECK(w->pid() == 0);  // rolled back: none left running
}

TEST_CASE("kill -9 of a worker under load: every request resolves, the worker restarts, traffic flows", "[worker]") {
  auto site = make_worker(test::test_worker("w2"));
  Session session;
  session.add_site(site)
      .add_block(test::plugin_block("slow", "slow_identity", "w2"))
      .add_path(Path::chain("t", {"slow"}));
  test::require_started(session);
  const std::int64_t first_pid = site->pid();
  REQUIRE(process_exists(first_pid));

  test::LoadClients load(session, "t", at::ones({4}), 3, "block 'slow': worker w2 killed by signal 9");  // named by its block
  load.check_kill_under_load(first_pid, 20);  // and the restarted worker served again
  CHECK(site->pid() != first_pid);
  CHECK_FALSE(process_exists(first_pid));
  const auto m = session.metrics();
  CHECK(m.sites.at(0).restarts == 1);
  CHECK(m.sites.at(0).failed_requests >= 1);
}

TEST_CASE("a block call that never returns: the worker says so, compute_timeout kills it, traffic flows", "[worker]") {
  WorkerOptions o = test::test_worker("w4");
  o.compute_timeout = absl::Seconds(2);
  auto site = make_worker(o);
  Session session;
  session.add_site(site).add_block(test::plugin_block("h", "hang_on_negative", "w4")).add_path(Path::chain("t", {"h"}));
  test::require_started(session);
  const std::int64_t first_pid = site->pid();
  REQUIRE(session.submit("t", at::ones({4})).get().ok());
  // As of the worker's next heartbeat: one answered while that call ran may arrive after its result.
  CHECK(test::eventually([&] { return session.metrics().sites.at(0).computing_s == 0; }));

  auto stuck = session.submit("t", -at::ones({4}));  // its heartbeats go on: only the call's age tells
  CHECK(test::eventually([&] {
    const auto m = session.metrics();
    return m.sites.at(0).computing_block == "h" && m.sites.at(0).computing_s > 0;
  }));
  REQUIRE(stuck.wait_for(std::chrono::seconds(30)) == std::future_status::ready);
  const Result failed = stuck.get();
  CHECK(absl::IsUnavailable(failed.status));
  CHECK_THAT(std::string(failed.status.message()), Contains("worker w4 ran block 'h' for more than 2s in one call (compute_timeout)"));
  CHECK(session.submit("t", at::ones({4})).get().ok());  // the restarted worker
  const auto m = session.metrics();
  CHECK(m.sites.at(0).restarts == 1);
  CHECK(m.sites.at(0).failed_requests == 1);
  CHECK(site->pid() != first_pid);
}

TEST_CASE("a supervised child is exiting once killed, before it is reaped, and after", "[worker]") {
  // The supervisor waits for such a child instead of reporting missed heartbeats, so that a worker
  // killed by signal 9 is reported as killed by signal 9 even when its teardown is slow.
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::pause();
    ::_exit(0);
  }
  CHECK_FALSE(blockflow::detail::process_exiting(child));  // alive, sleeping
  REQUIRE(::kill(child, SIGKILL) == 0);
  CHECK(test::eventually([&] { return blockflow::detail::process_exiting(child); }));  // a zombie, not reaped
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFSIGNALED(status));
  CHECK(blockflow::detail::process_exiting(child));  // gone
  CHECK_FALSE(blockflow::detail::process_exiting(::getpid()));
}

TEST_CASE("a worker that cannot be restarted fails the requests queued for its restart, and is lost", "[worker]") {
  // Its executable (a link here) is gone by the time the restart spawns it. Each restart that
  // cannot spawn uses one of max_restarts and backs off again (a spawn may fail for a moment); the
  // last one gives the worker up.
  const auto dir = std::filesystem::temp_directory_path() / ("bf-norestart-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto link = dir / "blockflow-worker";
  std::filesystem::create_symlink(BLOCKFLOW_TEST_WORKER, link);
  auto options = test::test_worker("w1");
  options.executable = link.string();
  options.max_restarts = GENERATE(1, 3);
  options.restart_backoff = absl::Seconds(1);  // the request below is submitted within it (1 + 2 + 4 s with 3)
  test::LogLines log;
  auto site = make_worker(options);
  Session session;
  session.add_site(site).add_block(test::plugin_block("a", "affine", "w1")).add_path(Path::chain("t", {"a"}));
  test::require_started(session);
  REQUIRE(session.submit("t", at::zeros({1})).get().ok());
  test::remove_tree(dir);
  REQUIRE(::kill(static_cast<pid_t>(site->pid()), SIGKILL) == 0);
  REQUIRE(test::eventually([&] { return session.metrics().sites.at(0).restarts >= 1; }));
  auto queued = session.submit("t", at::zeros({1}));  // waits in the site for the restart
  REQUIRE(queued.wait_for(60s) == std::future_status::ready);
  const Result r = queued.get();
  CHECK_FALSE(r.ok());
  CHECK_THAT(std::string(r.status.message()), Contains("worker w1 could not be restarted") && Contains("cannot start"));
  const auto m = session.metrics();
  CHECK(m.sites.at(0).lost);
  CHECK(m.sites.at(0).restarts == static_cast<std::uint64_t>(options.max_restarts));
  // With 3: the kill used restart 1; its spawn and the next failed (restarts 2 and 3, said), the third gave up.
  if (options.max_restarts == 3) CHECK(log.count("could not be restarted: ") >= 3);
  if (options.max_restarts == 3) CHECK(log.contains("; restart 3 of 3"));
  CHECK(m.sites.at(0).failed_requests >= 1);
  auto after = session.submit("t", at::zeros({1}));  // a lost site fails at once
  REQUIRE(after.wait_for(10s) == std::future_status::ready);
  CHECK_FALSE(after.get().ok());
}

TEST_CASE("no orphans: workers are gone after shutdown and after the session is destroyed", "[worker]") {
  std::int64_t pid = 0;
  {
    auto site = make_worker(test::test_worker("w1"));
    Session session;
    session.add_site(site).add_block(test::plugin_block("affine", "affine", "w1")).add_path(Path::chain("t", {"affine"}));
    test::require_started(session);
    pid = site->pid();
    REQUIRE(process_exists(pid));
    REQUIRE(session.submit("t", at::zeros({1})).get().ok());
  }
  CHECK_FALSE(process_exists(pid));
}

TEST_CASE("what a worker makes of the heartbeat interval in its configuration: bounded, with a default", "[worker]") {
  using blockflow::detail::heartbeat_settings;
  const absl::Duration fallback = WorkerOptions{}.heartbeat_interval;
  CHECK(heartbeat_settings({{"heartbeat_ms", 40}}).interval == absl::Milliseconds(40));
  CHECK(heartbeat_settings({{"heartbeat_ms", 40}}).host_silence == absl::Milliseconds(1200));  // 30 intervals
  CHECK(heartbeat_settings({{"heartbeat_ms", 10}}).host_silence == blockflow::detail::kMinHostSilence);  // not below 1 s
  CHECK(heartbeat_settings({{"heartbeat_ms", 3'600'000}}).interval == blockflow::detail::kMaxHeartbeat);
  CHECK(heartbeat_settings({{"heartbeat_ms", 0.01}}).interval == blockflow::detail::kMinHeartbeat);
  for (const auto& config : {nlohmann::json::object(), nlohmann::json{{"heartbeat_ms", 0}},
                             nlohmann::json{{"heartbeat_ms", -5}}, nlohmann::json{{"heartbeat_ms", "fast"}}}) {
    INFO(config.dump());
    CHECK(heartbeat_settings(config).interval == fallback);
    CHECK(heartbeat_settings(config).host_silence == 30 * fallback);
  }
}

TEST_CASE("WorkerOptions::heartbeat_interval and max_parked_bytes reach the worker, which applies them", "[worker]") {
  WorkerOptions options = test::test_worker("hb");
  options.heartbeat_interval = absl::Milliseconds(40);
  options.max_parked_bytes = 12345;
  const nlohmann::json config = blockflow::detail::make_config({test::plugin_block("affine", "affine", "")}, options);
  CHECK(config.at("heartbeat_ms") == 40);
  CHECK(config.at("max_parked_bytes") == 12345);

  FakeHost host("hb");
  CHECK(host.expect(blockflow::detail::kHello).value("name", "") == "hb");
  host.send(config);
  const nlohmann::json loaded = host.expect(blockflow::detail::kLoaded);
  INFO(loaded.dump());
  CHECK(loaded.value("heartbeat_ms", std::int64_t{0}) == 40);       // the interval it applied
  CHECK(loaded.value("host_silence_ms", std::int64_t{0}) == 1200);  // how long it waits for a ping
  host.send({{"type", blockflow::detail::kPing}});
  CHECK(host.expect(blockflow::detail::kHeartbeat).value("rss_bytes", std::int64_t{0}) > 0);
  host.send({{"type", blockflow::detail::kStop}});
  const auto status = host.exit_status(std::chrono::seconds(10));  // --once: told to stop, it exits
  REQUIRE(status.has_value());
  CHECK(WIFEXITED(*status));
  CHECK(WEXITSTATUS(*status) == 0);
}

TEST_CASE("a zero-copy worker with outputs in slots makes its result pools at start (one primed run after warm-up), not on "
          "a first request",
          "[worker]") {
  // Two workers started together warm up with cores / workers threads, the last run too
  // (SessionOptions::warm_up_last_narrow): the primed run is then the first with the team's.
  for (const int workers : {1, 2}) {
    DYNAMIC_SECTION(workers << " worker(s)") {
      Session session;
      std::vector<std::shared_ptr<RemoteSite>> sites;
      for (int w = 1; w <= workers; ++w) {
        const std::string name = "w" + std::to_string(w), block = "b" + std::to_string(w);
        WorkerOptions options = test::test_worker(name, "shm");
        options.shm_outputs_in_slots = true;  // off by default
        sites.push_back(make_worker(options));
        session.add_site(sites.back())
            .add_block(test::model_block(block, "cnn_block1.pt", name, {-1, 3, 256, 256}))  // activations of 2 MB: in slots
            .add_path(Path::chain("t" + std::to_string(w), {block}));
      }
      test::require_started(session);
      for (int w = 1; w <= workers; ++w) {
        INFO("worker w" << w);
        const auto& site = sites[static_cast<std::size_t>(w - 1)];
        // As of a heartbeat after start(), before any request: the pools its activations took exist.
        CHECK(test::eventually([&] { return site->stats().shm_results.pools_created > 0; }));
        CHECK(site->stats().shm_results.slots_in_use == 0);  // and the primed run gave its slots back
        const Result r = session.submit("t" + std::to_string(w), at::ones({1, 3, 256, 256})).get();
        REQUIRE(r.ok());
      }
    }
  }
}

TEST_CASE("a worker's results reach the next block in the worker's order while that block's queue is full (policy block)",
          "[worker]") {
  // The site's thread may not wait for room in "after"'s queue: a result that finds it full is
  // handed to a lane, and the results behind it must queue behind it, not overtake it. "mid" returns
  // the order in which the worker ran it (so the order of the requests into the worker is not tested).
  // Over zmq the worker's results leave from its lanes or its sending thread (ReplyQueue), in order.
  WorkerOptions w = test::test_worker("wo", GENERATE(as<std::string>{}, "shm", "zmq"));
  w.lanes = 2;
  w.max_in_flight = 8;
  SessionOptions options;
  options.lanes = GENERATE(1, 2);
  Session session(options);
  std::mutex mu;
  std::vector<double> seen;
  session.add_site(make_worker(w))
      .add_block(test::plugin_block("mid", "sequence", "wo"))
      .add_block(test::unary("after", [&](const Tensor& x) {
        std::this_thread::sleep_for(1ms);
        std::lock_guard<std::mutex> lock(mu);
        seen.push_back(x.item<double>());
        return x;
      }, test::queue_of_one()))
      .add_path(Path::chain("t", {"mid", "after"}));
  test::require_started(session);
  constexpr int kRequests = 300;
  std::atomic<int> ok{0}, wrong{0};
  for (int i = 0; i < kRequests; ++i) {
    session.submit("t", {at::full({1}, static_cast<double>(i))}, [&](Result&& r) { (r.ok() ? ok : wrong)++; });
  }
  REQUIRE(test::eventually([&] { return ok + wrong == kRequests; }, std::chrono::seconds(60)));
  CHECK(wrong == 0);
  std::lock_guard<std::mutex> lock(mu);
  REQUIRE(seen.size() == static_cast<std::size_t>(kRequests));
  std::size_t out_of_order = 0;
  for (std::size_t i = 1; i < seen.size(); ++i) out_of_order += seen[i] < seen[i - 1] ? 1 : 0;
  CHECK(out_of_order == 0);
}

TEST_CASE("a worker's results reach the next worker block in the order they came back", "[worker]") {
  // While worker "wj" is full, a request waits in "seq"'s queue and the session's forwarding thread
  // waits for room with it; the next result from "wi" must not be taken by "wj" first (from the
  // site's receiving thread, RemoteSite::try_run()) when room appears. "wi" runs its requests in
  // order (one lane); "wj" runs one at a time, and "seq" returns the order in which it ran them.
  const bool zmq = GENERATE(false, true);
  WorkerOptions wi = test::test_worker("wi", zmq ? "zmq" : "shm");
  WorkerOptions wj = test::test_worker("wj", zmq ? "zmq" : "shm");
  wi.lanes = wj.lanes = 1;
  wi.max_in_flight = wj.max_in_flight = 1;  // in step: a result of wi's often meets the forwarder waiting
  wi.direct_edges = wj.direct_edges = zmq;  // zmq: a parked output's handle; shm: a slot's, relayed as is
  Session session;
  session.add_site(make_worker(wi))
      .add_site(make_worker(wj))
      .add_block(test::plugin_block("first", "affine", "wi"))
      .add_block(test::plugin_block("seq", "sequence", "wj"))
      .add_path(Path::chain("t", {"first", "seq"}));
  test::require_started(session);
  constexpr int kRequests = 400;
  std::vector<std::future<Result>> results;
  for (int i = 0; i < kRequests; ++i) results.push_back(session.submit("t", at::zeros({16384})));
  std::vector<double> order;
  for (auto& f : results) {
    Result r = f.get();
    REQUIRE(r.ok());
    order.push_back(r.output().item<double>());
  }
  std::size_t out_of_order = 0;
  for (std::size_t i = 1; i < order.size(); ++i) out_of_order += order[i] < order[i - 1] ? 1 : 0;
  CHECK(out_of_order == 0);
}

TEST_CASE("threads -> worker -> threads with full queues (policy block) and one lane does not deadlock", "[worker]") {
  // The lane may wait for room in the worker block's queue (the application fills it too) while the
  // worker's results wait for room in "after"'s queue, which only the lane empties: neither the lane
  // nor the site's thread may wait for good.
  WorkerOptions w = test::test_worker("wq");
  w.max_in_flight = 1;
  SessionOptions options;
  options.lanes = 1;
  Session session(options);
  const BlockOptions tiny = test::queue_of_one();
  BlockDescription mid = test::plugin_block("mid", "affine", "wq");
  mid.options = tiny;
  session.add_site(make_worker(w))
      .add_block(test::unary("before", [](const Tensor& x) { return x + 0; }, tiny))
      .add_block(mid)
      .add_block(test::slow_plus_one("after", 2ms, tiny))
      .add_path(Path::chain("t", {"before", "mid", "after"}))
      .add_path(Path::chain("t2", {"mid", "after"}));  // the application fills mid's queue too
  test::require_started(session);
  constexpr int kThreads = 4, kEach = 50;
  std::atomic<int> ok{0}, wrong{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < kThreads; ++c) {
    clients.emplace_back([&, c] {
      for (int i = 0; i < kEach; ++i) {
        session.submit(c % 2 == 0 ? "t" : "t2", {at::full({1}, 1.0)}, [&](Result&& r) {
          (r.ok() && r.output().item<double>() == 5 ? ok : wrong)++;  // (1 x 3 + 1) + 1
        });
      }
    });
  }
  const bool all = test::eventually([&] { return ok + wrong == kThreads * kEach; }, std::chrono::seconds(60));
  CHECK(all);
  CHECK(wrong == 0);
  session.shutdown(absl::ZeroDuration());  // a deadlock's submits are blocked: this lets them go
  for (auto& t : clients) t.join();
}

TEST_CASE("blocks at sites in a row, with full queues (policy block), do not deadlock", "[worker]") {
  // The worker's results for "y" find y's queue full; y's requests wait for room at y's worker,
  // which frees room only as its site's receiving thread takes results in: a site's thread may not
  // wait for room in y's queue. One worker hosting x and y; or two, with paths crossing
  // (x at wa -> y at wb, and u at wb -> v at wa).
  const std::string channel = GENERATE(as<std::string>{}, "shm", "zmq");
  const bool crossing = GENERATE(false, true);
  WorkerOptions wa = test::test_worker("wa", channel), wb = test::test_worker("wb", channel);
  wa.max_in_flight = wb.max_in_flight = 2;
  Session session;
  BlockDescription x = test::plugin_block("x", "affine", "wa");
  BlockDescription y = test::plugin_block("y", "slow_identity", crossing ? "wb" : "wa");
  x.options = y.options = test::queue_of_one();
  session.add_site(make_worker(wa)).add_block(x).add_block(y).add_path(Path::chain("t", {"x", "y"}));
  if (crossing) {
    BlockDescription u = test::plugin_block("u", "affine", "wb");
    BlockDescription v = test::plugin_block("v", "slow_identity", "wa");
    u.options = v.options = test::queue_of_one();
    session.add_site(make_worker(wb)).add_block(u).add_block(v).add_path(Path::chain("t2", {"u", "v"}));
  }
  test::require_started(session);
  constexpr int kThreads = 4, kEach = 40;
  std::atomic<int> ok{0}, wrong{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < kThreads; ++c) {
    clients.emplace_back([&, c] {
      for (int i = 0; i < kEach; ++i) {
        session.submit(crossing && c % 2 == 1 ? "t2" : "t", {at::full({1}, 1.0)}, [&](Result&& r) {
          (r.ok() && r.output().item<double>() == 4 ? ok : wrong)++;  // 1 x 3 + 1
        });
      }
    });
  }
  const bool all = test::eventually([&] { return ok + wrong == kThreads * kEach; }, std::chrono::seconds(60));
  CHECK(all);
  CHECK(wrong == 0);
  session.shutdown(absl::ZeroDuration());  // a deadlock's submits are blocked: this lets them go
  for (auto& t : clients) t.join();
}
