// A worker that joins over CURVE (WorkerOptions::security on the session's side, `blockflow-worker
// --key --session-key` on the worker's): with the key the session holds under its name it serves,
// on all three sockets; a stranger on the data ports (no key, or another authorized peer's key)
// gets no request, injects no result and is counted; a worker with another key, no key or a wrong
// session key is refused, counted, and its terminal says why.
#include "curve_util.hpp"
#include "joined_util.hpp"

#include <blockflow/channel/detail/curve_keys.hpp>

#include <fmt/format.h>
#include <zmq.hpp>

#include <future>

using namespace blockflow;
using Catch::Matchers::Contains;
using namespace std::chrono_literals;
using test::WorkerProcess;

namespace {

// The session's key pair ("server"), the worker's ("far"), and another peer's ("mallory") that the
// directory admits too, but not as far.
struct WorkerKeys : test::CurveKeys {
  WorkerKeys() : test::CurveKeys({"server", "far", "mallory"}, {"far", "mallory"}) {}
};

// A session with worker "far" joining at `listen` over CURVE, hosting the test plugin's "affine".
struct CurveSession {
  CurveSession(const WorkerKeys& keys, const std::string& listen, absl::Duration start_timeout) {
    WorkerOptions o = test::test_worker("far");
    o.listen = listen;
    o.security = keys.server();
    o.start_timeout = start_timeout;
    site = make_worker(o);
    session.add_site(site).add_block(test::plugin_block("affine", "affine", "far")).add_path(Path::chain("t", {"affine"}));
  }
  std::shared_ptr<WorkerSite> site;
  Session session;
};

std::vector<std::string> worker_args(const WorkerKeys& keys, const std::string& key, const std::string& session_key) {
  std::vector<std::string> args = {"--plugin", BLOCKFLOW_TEST_PLUGIN};
  if (!key.empty()) args.insert(args.end(), {"--key", keys.file(key + ".key_secret")});
  if (!session_key.empty()) args.insert(args.end(), {"--session-key", keys.file(session_key + ".key")});
  return args;
}

std::uint64_t auth_failures(Session& session) { return session.metrics().auth_failures; }

}  // namespace

TEST_CASE("a joined worker with its key serves over CURVE; strangers on its data ports get nothing and are counted",
          "[curve]") {
  WorkerKeys keys;
  const std::string listen = fmt::format("tcp://127.0.0.1:{}", test::free_port());
  WorkerProcess worker(WorkerProcess::join_args(listen, "far", worker_args(keys, "far", "server")));
  CurveSession s(keys, listen, absl::Seconds(30));
  test::require_started(s.session);
  const std::uint64_t before = auth_failures(s.session);

  // A keyless peer and one with mallory's key (admitted by the directory, but not as far) connect
  // to the port the requests leave from, and to the one results arrive at.
  zmq::context_t context;
  std::vector<zmq::socket_t> strangers;
  for (const bool keyed : {false, true}) {
    for (const auto& [type, endpoint] : {std::pair{zmq::socket_type::pull, s.site->request_endpoint()},
                                         std::pair{zmq::socket_type::push, s.site->result_endpoint()}}) {
      zmq::socket_t socket(context, type);
      socket.set(zmq::sockopt::linger, 0);
      if (keyed) {
        std::string error;
        REQUIRE(blockflow::detail::configure_curve_client(socket, keys.file("mallory.key_secret"), keys.file("server.key"), error));
      }
      socket.connect(endpoint);
      strangers.push_back(std::move(socket));
    }
  }
  // Each refused at least once (they retry; every attempt counts).
  CHECK(test::eventually([&] { return auth_failures(s.session) >= before + 4; }, 10000ms));
  for (auto& socket : strangers) {
    if (socket.get(zmq::sockopt::type) == ZMQ_PUSH) (void)socket.send(zmq::str_buffer("forged result"), zmq::send_flags::dontwait);
  }

  // Every request reaches the worker, none a stranger: each resolves, with the worker's answer.
  for (int i = 0; i < 20; ++i) {
    const Tensor x = at::full({2, 4}, static_cast<double>(i));
    auto future = s.session.submit("t", x);
    REQUIRE(future.wait_for(10s) == std::future_status::ready);
    Result r = future.get();
    INFO(r.status.ToString());
    REQUIRE(r.ok());
    CHECK(at::equal(r.output(), x * 3 + 1));
  }
  for (auto& socket : strangers) {
    if (socket.get(zmq::sockopt::type) != ZMQ_PULL) continue;
    zmq::message_t stolen;
    CHECK_FALSE(socket.recv(stolen, zmq::recv_flags::dontwait).has_value());
  }
  const auto m = s.session.metrics();
  REQUIRE(m.sites.size() == 1);
  CHECK(m.sites[0].malformed_frames == 0);  // the forged result never arrived
  CHECK(m.sites[0].failed_requests == 0);
  CHECK(m.sites[0].data.kind == "zmq-tcp");
}

TEST_CASE("a worker joining with another key, without keys or with a wrong session key is refused, counted, told why",
          "[curve]") {
  WorkerKeys keys;
  std::string key = "far", session_key = "server", told;
  SECTION("another authorized peer's key: only the key held as far.key admits far") {
    key = "mallory";
    told = "the session refused this worker's key";
  }
  SECTION("no keys") {
    key = session_key = "";
    told = "start this worker with --key and --session-key";
  }
  SECTION("a wrong session key") { session_key = "mallory"; }
  const std::string listen = fmt::format("tcp://127.0.0.1:{}", test::free_port());
  const std::string log = keys.file("worker.log");
  WorkerProcess worker(WorkerProcess::join_args(listen, "far", worker_args(keys, key, session_key)), log);
  CurveSession s(keys, listen, absl::Seconds(3));
  const std::uint64_t before = auth_failures(s.session);
  const absl::Status status = s.session.start();
  CHECK(absl::IsUnavailable(status));
  CHECK_THAT(std::string(status.message()), Contains("worker far did not join at " + listen));
  CHECK(auth_failures(s.session) > before);
  if (!told.empty()) {
    CHECK(test::eventually([&] { return worker.log().find(told) != std::string::npos; }));
    INFO(worker.log());
    CHECK_THAT(worker.log(), Contains(told));
  }
  CHECK_FALSE(worker.exit_status(0ms).has_value());  // it keeps trying; killed here
}

TEST_CASE("blockflow-worker checks its key files when it starts", "[curve]") {
  WorkerKeys keys;
  const std::string log = keys.file("worker.log");
  auto run = [&](const std::vector<std::string>& more) {
    WorkerProcess worker(WorkerProcess::join_args("tcp://127.0.0.1:1", "far", more), log);
    const auto status = worker.exit_status(30000ms);
    REQUIRE(status.has_value());
    CHECK(WIFEXITED(*status));
    CHECK(WEXITSTATUS(*status) == 2);
    return worker.log();
  };
  CHECK_THAT(run({"--key", keys.file("far.key_secret")}), Contains("CURVE needs both --key"));
  CHECK_THAT(run({"--key", keys.file("far.key"), "--session-key", keys.file("server.key")}), Contains(keys.file("far.key")));
  CHECK_THAT(run({"--key", keys.file("far.key_secret"), "--session-key", keys.file("nope.key")}), Contains(keys.file("nope.key")));
}
