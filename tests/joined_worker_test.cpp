// A worker on another host joins a session over TCP (WorkerOptions::listen on the session's side,
// `blockflow-worker --join` on the worker's): it serves; a kill -9 is caught by the heartbeats and
// fails the requests inside it with a named error; a new worker joins and traffic flows again; the
// session's stop sends it away. The hidden "[.two-host]" case is run by tests/two_host_test.sh with
// the worker in another network namespace.
#include "worker_util.hpp"

#include <fmt/format.h>

#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <mutex>

using namespace blockflow;
using Catch::Matchers::Contains;
using namespace std::chrono_literals;

extern char** environ;

namespace {

// A TCP port nobody listens on right now (the kernel's choice for an ephemeral bind).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0);
  socklen_t length = sizeof address;
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0);
  ::close(fd);
  return ntohs(address.sin_port);
}

// Starts `blockflow-worker --join endpoint --name name --once` as another host would.
pid_t start_joining_worker(const std::string& endpoint, const std::string& name) {
  std::vector<std::string> args = {BLOCKFLOW_TEST_WORKER, "--join", endpoint, "--name", name, "--once"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  REQUIRE(::posix_spawn(&pid, BLOCKFLOW_TEST_WORKER, nullptr, nullptr, argv.data(), environ) == 0);
  return pid;
}

// The exit status of `pid` if it ends within `timeout`, else nullopt (and it is killed).
std::optional<int> wait_exit(pid_t pid, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    if (::waitpid(pid, &status, WNOHANG) == pid) return status;
    std::this_thread::sleep_for(10ms);
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  return std::nullopt;
}

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

}  // namespace

TEST_CASE("a worker joins over TCP, dies under load, another joins, traffic flows, stop sends it home", "[joined]") {
  const std::string listen = fmt::format("tcp://127.0.0.1:{}", free_port());
  const pid_t first = start_joining_worker(listen, "far");
  auto site = make_worker(joined("far", listen));
  Session session;
  session.add_site(site).add_block(test::plugin_block("affine", "affine", "far")).add_path(Path::chain("t", {"affine"}));
  test::require_started(session);
  CHECK(site->join_endpoint() == listen);
  CHECK(site->pid() == 0);  // not our child
  check_serves(session);

  // kill -9 under load: requests inside fail with the worker's name and the cause; those queued
  // while it is down wait for the next worker.
  test::LoadClients load(session, "t", at::ones({4}), 2, "worker far missed heartbeats");
  REQUIRE(load.wait_ok(20));
  REQUIRE(::kill(first, SIGKILL) == 0);
  REQUIRE(wait_exit(first, 5000ms).has_value());
  // Detected within heartbeat_timeout (500 ms) plus a supervision tick.
  const auto killed_at = std::chrono::steady_clock::now();
  while (session.metrics().sites.at(0).restarts == 0 && std::chrono::steady_clock::now() < killed_at + 5s) {
    std::this_thread::sleep_for(5ms);
  }
  CHECK(std::chrono::steady_clock::now() - killed_at < 1s);
  const pid_t second = start_joining_worker(listen, "far");
  const bool served = load.wait_ok(20);
  load.finish();
  INFO(load.sample);
  CHECK(served);
  CHECK(load.resolved.load() == load.submitted.load());
  CHECK(load.other.load() == 0);
  const auto m = session.metrics();
  CHECK(m.sites.at(0).restarts == 1);
  CHECK(m.sites.at(0).failed_requests == static_cast<std::uint64_t>(load.named.load()));

  session.shutdown();
  const auto status = wait_exit(second, 5000ms);  // told to stop; --once: it exits
  REQUIRE(status.has_value());
  CHECK(WIFEXITED(*status));
  CHECK(WEXITSTATUS(*status) == 0);
}

TEST_CASE("nobody joins: start() fails naming the endpoint; a worker with another name is ignored", "[joined]") {
  const std::string listen = fmt::format("tcp://127.0.0.1:{}", free_port());
  const pid_t stranger = start_joining_worker(listen, "someone-else");
  WorkerOptions o = joined("far", listen);
  o.start_timeout = absl::Seconds(2);
  Session session;
  session.add_site(make_worker(o)).add_block(test::plugin_block("affine", "affine", "far")).add_path(Path::chain("t", {"affine"}));
  const absl::Status status = session.start();
  CHECK(absl::IsUnavailable(status));
  CHECK_THAT(std::string(status.message()), Contains("worker far did not join at " + listen));
  // The stranger keeps knocking; it goes when nobody answers (killed here).
  CHECK_FALSE(wait_exit(stranger, 100ms).has_value());

  WorkerOptions bad;
  bad.name = "x";
  bad.listen = "ipc:///tmp/nope";
  Session other;
  other.add_site(make_worker(bad)).add_block(test::plugin_block("affine", "affine", "x")).add_path(Path::chain("t", {"affine"}));
  const absl::Status not_tcp = other.start();
  CHECK_THAT(std::string(not_tcp.message()), Contains("worker x: listen 'ipc:///tmp/nope' is not a tcp://ADDR:PORT"));
}

TEST_CASE("two hosts: a worker in another network namespace serves over TCP", "[.two-host]") {
  // tests/two_host_test.sh sets this and starts the worker inside the namespace.
  const char* listen = std::getenv("BLOCKFLOW_TWO_HOST_LISTEN");
  REQUIRE(listen != nullptr);
  Session session;
  session.add_site(make_worker(joined("far", listen)))
      .add_block(test::plugin_block("affine", "affine", "far"))
      .add_path(Path::chain("t", {"affine"}));
  test::require_started(session);
  check_serves(session);
  session.shutdown();
}
