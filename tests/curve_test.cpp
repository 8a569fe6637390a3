// CURVE (curve.hpp): key files, the plain-TCP bind rule, and the client and control endpoints with
// keys: the admitted key is served; an unknown key, no key and a wrong server key are refused and
// counted (per endpoint and in the session's metrics). The joined worker's keys: curve_worker_test.cpp.
#include "curve_util.hpp"

#include <blockflow/serve/client_endpoint.hpp>
#include <blockflow/serve/control_endpoint.hpp>
#include <blockflow/channel/curve.hpp>
#include <blockflow/channel/detail/curve_auth.hpp>
#include <blockflow/channel/detail/curve_keys.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <zmq.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

using namespace blockflow;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

// `server`, `alice` and `mallory` key pairs; only alice is authorized.
using Keys = test::AliceKeys;

void serve_twice(Session& session) {
  session.add_block(test::unary("twice", [](const Tensor& x) { return x * 2; }));
  session.add_path(Path::chain("double", {"twice"}));
  test::require_started(session);
}

}  // namespace

TEST_CASE("key files: written 0600/0644, read back, never overwritten, refused when others can read the secret",
          "[curve]") {
  Keys keys;
  auto pair = read_curve_keypair(keys.file("alice.key_secret"));
  REQUIRE(pair.ok());
  auto pub = read_curve_public_key(keys.file("alice.key"));
  REQUIRE(pub.ok());
  CHECK(*pub == pair->public_key);
  CHECK(pair->secret_key.size() == 40);
  CHECK(curve_fingerprint(*pub).size() == 16);
  struct stat st {};
  REQUIRE(::stat(keys.file("alice.key_secret").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  REQUIRE(::stat(keys.file("alice.key").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0644);

  auto again = write_curve_keypair(keys.root.string(), "alice", *pair);
  CHECK(again.code() == absl::StatusCode::kAlreadyExists);
  CHECK(write_curve_keypair(keys.root.string(), "../alice", *pair).code() == absl::StatusCode::kInvalidArgument);
  // Only the public file of a name exists: nothing is written, so no secret sits beside another pair's key.
  std::ofstream(keys.file("bob.key")) << "not bob's pair\n";
  CHECK(write_curve_keypair(keys.root.string(), "bob", *pair).code() == absl::StatusCode::kAlreadyExists);
  CHECK_FALSE(fs::exists(keys.file("bob.key_secret")));

  // A FIFO where a key file should be is refused at once, not waited on.
  REQUIRE(::mkfifo(keys.file("fifo.key").c_str(), 0600) == 0);
  auto fifo = read_curve_public_key(keys.file("fifo.key"));
  REQUIRE_FALSE(fifo.ok());
  CHECK_THAT(std::string(fifo.status().message()), Contains("fifo.key") && Contains("not a regular file"));

  // A public key file is not a secret one.
  auto only_public = read_curve_keypair(keys.file("alice.key"));
  REQUIRE_FALSE(only_public.ok());
  CHECK_THAT(std::string(only_public.status().message()), Contains("no valid secret-key") && Contains("alice.key"));

  ::chmod(keys.file("alice.key_secret").c_str(), 0640);
  auto exposed = read_curve_keypair(keys.file("alice.key_secret"));
  REQUIRE_FALSE(exposed.ok());
  CHECK_THAT(std::string(exposed.status().message()), Contains("readable by others") && Contains("0640"));

  // A secret whose public line was swapped for another key's.
  std::ofstream(keys.file("forged.key_secret")) << "public-key = \"" << *read_curve_public_key(keys.file("mallory.key"))
                                                << "\"\nsecret-key = \"" << pair->secret_key << "\"\n";
  ::chmod(keys.file("forged.key_secret").c_str(), 0600);
  auto forged = read_curve_keypair(keys.file("forged.key_secret"));
  REQUIRE_FALSE(forged.ok());
  CHECK_THAT(std::string(forged.status().message()), Contains("does not belong"));
}

TEST_CASE("plain TCP beyond the loopback is refused unless insecure; keys or loopback are accepted", "[curve]") {
  Session session;
  serve_twice(session);
  try {
    ClientEndpoint endpoint(session, "tcp://0.0.0.0:*");
    FAIL("bound every interface without keys");
  } catch (const std::runtime_error& e) {
    CHECK_THAT(std::string(e.what()), Contains("tcp://0.0.0.0:*") && Contains("CURVE") && Contains("insecure"));
  }
  try {
    ControlEndpoint control(session, "tcp://*:*");
    FAIL("bound every interface without keys");
  } catch (const std::runtime_error& e) {
    CHECK_THAT(std::string(e.what()), Contains("control endpoint") && Contains("tcp://*:*"));
  }
  try {  // a loopback source address, then every interface: what ZeroMQ binds is the second
    ClientEndpoint sourced(session, "tcp://127.0.0.1:1;0.0.0.0:*");
    FAIL("bound every interface through a source address");
  } catch (const std::runtime_error& e) {
    CHECK_THAT(std::string(e.what()), Contains("tcp://127.0.0.1:1;0.0.0.0:*") && Contains("source address"));
  }
  ClientEndpointOptions insecure;
  insecure.security.insecure = true;
  ClientEndpoint open(session, "tcp://0.0.0.0:*", insecure);
  RemoteClient client("tcp://127.0.0.1:" + open.endpoint().substr(open.endpoint().rfind(':') + 1), absl::Seconds(10));
  auto out = client.submit("double", {at::ones({2})});
  REQUIRE(out.ok());
  CHECK((*out)[0].sum().item<float>() == 4);

  Keys keys;
  ClientEndpointOptions keyed;
  keyed.security = keys.server();
  ClientEndpoint secured(session, "tcp://0.0.0.0:*", keyed);  // every interface, but keyed
  ClientEndpoint loopback(session, "tcp://127.0.0.1:*");       // the loopback needs no keys
  CHECK(loopback.auth_failures() == 0);
}

TEST_CASE("client endpoint with CURVE: the authorized key is served; unknown, missing and wrong server keys are refused "
          "and counted",
          "[curve]") {
  Keys keys;
  Session session;
  serve_twice(session);
  ClientEndpointOptions options;
  options.security = keys.server();
  ClientEndpoint endpoint(session, "tcp://127.0.0.1:*", options);
  const std::uint64_t process_failures_before = session.metrics().auth_failures;

  RemoteClient alice(endpoint.endpoint(), absl::Seconds(10), keys.client("alice"));
  auto out = alice.submit("double", {at::full({3}, 2.0)});
  REQUIRE(out.ok());
  CHECK((*out)[0].sum().item<float>() == 12);
  CHECK(endpoint.auth_failures() == 0);

  // mallory has a valid pair, unknown to the server.
  RemoteClient mallory(endpoint.endpoint(), absl::Milliseconds(700), keys.client("mallory"));
  CHECK(mallory.submit("double", {at::ones({1})}).status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(test::eventually([&] { return endpoint.auth_failures() >= 1; }));

  // No keys at all: the CURVE handshake fails before any key is known.
  const std::uint64_t after_mallory = endpoint.auth_failures();
  RemoteClient plain(endpoint.endpoint(), absl::Milliseconds(700));
  CHECK(plain.submit("double", {at::ones({1})}).status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(test::eventually([&] { return endpoint.auth_failures() > after_mallory; }));

  // alice's own pair, but the wrong server key: the server cannot read her hello.
  const std::uint64_t after_plain = endpoint.auth_failures();
  RemoteClient confused(endpoint.endpoint(), absl::Milliseconds(700), {keys.file("alice.key_secret"), keys.file("mallory.key")});
  CHECK(confused.submit("double", {at::ones({1})}).status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(test::eventually([&] { return endpoint.auth_failures() > after_plain; }));

  // The session's metrics carry the process-wide count, in JSON and Prometheus.
  const MetricsSnapshot m = session.metrics();
  CHECK(m.auth_failures >= process_failures_before + 3);
  CHECK_THAT(m.to_prometheus(), Contains("blockflow_auth_failures_total"));
  auto back = MetricsSnapshot::from_json(m.to_json());
  REQUIRE(back.ok());
  CHECK(back->auth_failures == m.auth_failures);

  // alice is still served after all that.
  REQUIRE(alice.submit("double", {at::ones({1})}).ok());
}

TEST_CASE("a key file the server cannot use stops the endpoint from starting, naming the file", "[curve]") {
  Keys keys;
  Session session;
  serve_twice(session);
  ClientEndpointOptions options;
  options.security = keys.server();
  options.security.authorized_keys_dir = keys.file("no-such-dir");
  CHECK_THROWS_WITH(ClientEndpoint(session, "tcp://127.0.0.1:*", options), Contains("no-such-dir"));
  options.security = keys.server();
  options.security.secret_key_file = keys.file("server.key");  // the public half
  CHECK_THROWS_WITH(ClientEndpoint(session, "tcp://127.0.0.1:*", options), Contains("server.key"));
  CHECK_THROWS_WITH(RemoteClient("tcp://127.0.0.1:1", absl::Seconds(1), {keys.file("alice.key_secret"), ""}),
                    Contains("server's public key"));
}

TEST_CASE("control endpoint with CURVE: blockflowctl's keys get answers, a stranger gets none and is counted", "[curve]") {
  Keys keys;
  Session session;
  serve_twice(session);
  ControlOptions options;
  options.security = keys.server();
  ControlEndpoint control(session, "tcp://127.0.0.1:*", options);
  auto ask = [&](const std::string& who) -> std::optional<nlohmann::json> {
    zmq::context_t context(1);
    zmq::socket_t req(context, zmq::socket_type::req);
    req.set(zmq::sockopt::linger, 0);
    req.set(zmq::sockopt::rcvtimeo, who.empty() ? 700 : 10000);
    if (!who.empty()) {
      std::string error;
      REQUIRE(blockflow::detail::configure_curve_client(req, keys.file(who + ".key_secret"), keys.file("server.key"), error));
    }
    req.connect(control.endpoint());
    (void)req.send(zmq::str_buffer(R"({"cmd": "status"})"), zmq::send_flags::none);
    zmq::message_t reply;
    if (!req.recv(reply)) return std::nullopt;
    return nlohmann::json::parse(reply.to_string());
  };
  auto status = ask("alice");
  REQUIRE(status.has_value());
  CHECK((*status)["ok"] == true);
  CHECK_FALSE(ask("").has_value());
  CHECK(test::eventually([&] { return control.auth_failures() >= 1; }));
}

TEST_CASE("a CURVE socket whose authentication handler has gone refuses every peer, the authorized ones too",
          "[curve]") {
  // libzmq admits every CURVE client of a context with no ZAP handler, unless the socket enforces
  // its ZAP domain: the handler's end (a bug, a thread gone) must not open the door.
  Keys keys;
  zmq::context_t context(1);
  zmq::socket_t server(context, zmq::socket_type::pull);
  server.set(zmq::sockopt::linger, 0);
  {
    auto curve = blockflow::detail::CurveServer::start(context, keys.server(), "test");
    REQUIRE(curve.ok());
    (*curve)->secure(server);
    server.bind("tcp://127.0.0.1:*");
  }  // the handler stops here; the socket stays
  const std::string endpoint = server.get(zmq::sockopt::last_endpoint);
  zmq::socket_t client(context, zmq::socket_type::push);
  client.set(zmq::sockopt::linger, 0);
  std::string error;
  REQUIRE(blockflow::detail::configure_curve_client(client, keys.file("alice.key_secret"), keys.file("server.key"), error));
  client.connect(endpoint);
  (void)client.send(zmq::str_buffer("hello"), zmq::send_flags::dontwait);
  zmq::pollitem_t item{server.handle(), 0, ZMQ_POLLIN, 0};
  zmq::poll(&item, 1, std::chrono::milliseconds(1500));
  CHECK((item.revents & ZMQ_POLLIN) == 0);  // before: alice (or anyone) got through
}
