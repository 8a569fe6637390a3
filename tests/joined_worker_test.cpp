// A worker on another host joins a session over TCP (WorkerOptions::listen on the session's side,
// `blockflow-worker --join` on the worker's): it serves; a kill -9 is caught by the heartbeats and
// fails the requests inside it with a named error; a new worker joins and traffic flows again; the
// session's stop sends it away. The hidden "[.two-host]" case is run by tests/two_host_test.sh with
// the worker in another network namespace.
#include "joined_util.hpp"

#include <fmt/format.h>
#include <zmq.hpp>

#include <csignal>
#include <cstdlib>
#include <future>
#include <mutex>
#include <thread>

using namespace blockflow;
using Catch::Matchers::Contains;
using namespace std::chrono_literals;
using test::WorkerProcess;

namespace {

WorkerOptions joined(const std::string& name, const std::string& listen) {
  WorkerOptions o = test::test_worker(name);
  o.listen = listen;
  o.heartbeat_timeout = absl::Milliseconds(500);
  o.start_timeout = absl::Seconds(60);
  return o;
}

// The same checks wherever the worker runs: values through a joined worker, 3.2 MB included.
void check_serves(Session& session) {
  for (int i = 0; i < 5; ++i) {
    const Tensor x = at::full({1 + i, 4}, static_cast<double>(i));
    Result r = session.submit("t", x).get();
    INFO(r.status.ToString());
    REQUIRE(r.ok());
    CHECK(at::equal(r.output(), x * 3 + 1));
  }
  const Tensor big = at::ones({256, 56, 56});
  Result r = session.submit("t", big).get();
  REQUIRE(r.ok());
  CHECK(r.output().sum().item<double>() == 4.0 * 256 * 56 * 56);
  const auto m = session.metrics();
  REQUIRE(m.sites.size() == 1);
  CHECK(m.sites[0].kind == "joined-worker");
  CHECK(m.sites[0].data.kind == "zmq-tcp");
  CHECK(m.sites[0].data.received >= 6);
}

// `blockflow-worker` joining at `listen` as "far", with the test plugin.
std::vector<std::string> far_args(const std::string& listen) {
  return WorkerProcess::join_args(listen, "far", {"--plugin", BLOCKFLOW_TEST_PLUGIN});
}

// A session whose path "t" is the block "affine" (3x + 1) in the joined worker "far", started.
std::shared_ptr<WorkerSite> start_far(Session& session, const std::string& listen) {
  auto site = make_worker(joined("far", listen));
  session.add_site(site).add_block(test::plugin_block("affine", "affine", "far")).add_path(Path::chain("t", {"affine"}));
  test::require_started(session);
  check_serves(session);
  return site;
}

}  // namespace

TEST_CASE("a worker joins over TCP, dies under load, another joins, traffic flows, stop sends it home", "[joined]") {
  const std::string listen = fmt::format("tcp://127.0.0.1:{}", test::free_port());
  WorkerProcess first(far_args(listen));
  Session session;
  auto site = start_far(session, listen);
  CHECK(site->join_endpoint() == listen);
  CHECK(site->pid() == 0);  // not our child

  // kill -9 under load: requests inside fail with the worker's name and the cause; those queued
  // while it is down wait for the next worker.
  test::LoadClients load(session, "t", at::ones({4}), 2, "worker far missed heartbeats");
  REQUIRE(load.wait_ok(20));
  first.kill();
  // Detected by its missed heartbeats (heartbeat_timeout 500 ms): counted as a restart.
  const auto killed_at = std::chrono::steady_clock::now();
  while (session.metrics().sites.at(0).restarts == 0 && std::chrono::steady_clock::now() < killed_at + 30s) {
    std::this_thread::sleep_for(5ms);
  }
  CHECK(session.metrics().sites.at(0).restarts >= 1);
  WorkerProcess second(far_args(listen));
  const bool served = load.wait_ok(20);
  load.finish();
  INFO(load.sample);
  CHECK(served);
  CHECK(load.unresolved.load() == 0);
  CHECK(load.resolved.load() == load.submitted.load());
  CHECK(load.other.load() == 0);
  const auto m = session.metrics();
  CHECK(m.sites.at(0).restarts == 1);
  CHECK(m.sites.at(0).failed_requests == static_cast<std::uint64_t>(load.named.load()));

  session.shutdown();
  const auto status = second.exit_status(5000ms);  // told to stop; --once: it exits
  REQUIRE(status.has_value());
  CHECK(WIFEXITED(*status));
  CHECK(WEXITSTATUS(*status) == 0);
}

TEST_CASE("a stopped joined worker, declared dead, keeps its TCP connections but gets no request; none hangs", "[joined]") {
  const std::string listen = fmt::format("tcp://127.0.0.1:{}", test::free_port());
  WorkerProcess first(far_args(listen));
  Session session;
  start_far(session, listen);

  // Stopped, not dead: its heartbeats stop, its TCP connections stay up.
  REQUIRE(::kill(first.pid(), SIGSTOP) == 0);
  REQUIRE(test::eventually([&] { return session.metrics().sites.at(0).restarts == 1; }, 10s));
  WorkerProcess second(far_args(listen));
  // Once the second has joined, every request goes to it (before, a push socket shared between
  // the two sent every other one to the stopped worker, where it stayed).
  auto queued = session.submit("t", at::ones({4}));  // waits for the next worker
  REQUIRE(queued.wait_for(30s) == std::future_status::ready);
  REQUIRE(queued.get().ok());
  for (int i = 0; i < 20; ++i) {
    auto pending = session.submit("t", at::full({4}, static_cast<double>(i)));
    REQUIRE(pending.wait_for(10s) == std::future_status::ready);
    Result r = pending.get();
    INFO(r.status.ToString());
    REQUIRE(r.ok());
    CHECK(at::equal(r.output(), at::full({4}, 3.0 * i + 1)));
  }
  ::kill(first.pid(), SIGCONT);  // back: its old data ports are gone, and the session ignores it
  for (int i = 0; i < 5; ++i) CHECK(session.submit("t", at::ones({4})).get().ok());
  CHECK(session.metrics().sites.at(0).restarts == 1);
  session.shutdown();
}

TEST_CASE("nobody joins: start() fails naming the endpoint; a worker with another name is ignored", "[joined]") {
  const std::string listen = fmt::format("tcp://127.0.0.1:{}", test::free_port());
  WorkerProcess stranger(WorkerProcess::join_args(listen, "someone-else"));
  WorkerOptions o = joined("far", listen);
  o.start_timeout = absl::Seconds(2);
  Session session;
  session.add_site(make_worker(o)).add_block(test::plugin_block("affine", "affine", "far")).add_path(Path::chain("t", {"affine"}));
  const absl::Status status = session.start();
  CHECK(absl::IsUnavailable(status));
  CHECK_THAT(std::string(status.message()), Contains("worker far did not join at " + listen));
  // The stranger keeps knocking; it goes when nobody answers (killed here).
  CHECK_FALSE(stranger.exit_status(100ms).has_value());

  WorkerOptions bad;
  bad.name = "x";
  bad.listen = "ipc:///tmp/nope";
  Session other;
  other.add_site(make_worker(bad)).add_block(test::plugin_block("affine", "affine", "x")).add_path(Path::chain("t", {"affine"}));
  const absl::Status not_tcp = other.start();
  CHECK_THAT(std::string(not_tcp.message()), Contains("worker x: listen 'ipc:///tmp/nope' is not a tcp://ADDR:PORT"));
}

TEST_CASE("a control message with a field of the wrong type is dropped and counted; the site still takes its worker",
          "[joined]") {
  const std::string listen = fmt::format("tcp://127.0.0.1:{}", test::free_port());
  Session session;
  auto site = make_worker(joined("far", listen));
  session.add_site(site).add_block(test::plugin_block("affine", "affine", "far")).add_path(Path::chain("t", {"affine"}));
  auto started = std::async(std::launch::async, [&] { return session.start(); });
  zmq::context_t context;
  zmq::socket_t dealer(context, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::linger, 0);
  dealer.connect(listen);
  // A hello whose name is a number, until the site has bound its endpoint and read one.
  for (int i = 0; i < 50 && site->stats().malformed_frames == 0; ++i) {
    (void)dealer.send(zmq::str_buffer(R"({"type": "hello", "name": 5})"), zmq::send_flags::dontwait);
    std::this_thread::sleep_for(100ms);
  }
  CHECK(site->stats().malformed_frames >= 1);
  WorkerProcess far(far_args(listen));
  REQUIRE(started.get().ok());
  check_serves(session);
}

TEST_CASE("two hosts: a worker in another network namespace serves over TCP", "[.two-host]") {
  // tests/two_host_test.sh sets these and starts the worker inside the namespace; KEYS holds the
  // session's key pair (session.key_secret) and the admitted workers' keys (authorized/).
  const char* listen = std::getenv("BLOCKFLOW_TWO_HOST_LISTEN");
  const char* keys = std::getenv("BLOCKFLOW_TWO_HOST_KEYS");
  REQUIRE(listen != nullptr);
  REQUIRE(keys != nullptr);
  WorkerOptions o = joined("far", listen);
  o.security.secret_key_file = std::string(keys) + "/session.key_secret";
  o.security.authorized_keys_dir = std::string(keys) + "/authorized";
  Session session;
  session.add_site(make_worker(o)).add_block(test::plugin_block("affine", "affine", "far")).add_path(Path::chain("t", {"affine"}));
  test::require_started(session);
  check_serves(session);
  // A recognisable payload (float 1234.5 is 00 50 9a 44), 64 KiB each way: the script looks for it
  // in the bytes it captured on the wire and must not find it.
  const Tensor marker = at::full({16384}, 1234.5, at::kFloat);
  for (int i = 0; i < 3; ++i) {
    Result r = session.submit("t", marker).get();
    INFO(r.status.ToString());
    REQUIRE(r.ok());
    CHECK(at::equal(r.output(), marker * 3 + 1));
  }
  // The impostor the script started (named far, with a key the session does not hold as far's)
  // was refused, and counted.
  if (std::getenv("BLOCKFLOW_TWO_HOST_IMPOSTOR") != nullptr) {
    CHECK(test::eventually([&] { return session.metrics().auth_failures > 0; }, 10000ms));
  }
  session.shutdown();
}
