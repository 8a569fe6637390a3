// The client endpoint's bounds and its way down: requests (and their bytes) in flight per client and
// for every client together, a graceful drain, a stopped endpoint that accepts nobody, a malformed
// endpoint named; the control endpoint's replies to a client that does not read.
#include "client_test_util.hpp"

#include <blockflow/serve/client_endpoint.hpp>
#include <blockflow/serve/control_endpoint.hpp>
#include <blockflow/channel/wire_format.hpp>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <future>

using namespace blockflow;
using Catch::Matchers::Contains;

namespace {

// A raw client: submits float32 tensors of `floats` elements to task "held" and reads the replies.
struct Dealer {
  zmq::context_t context;
  zmq::socket_t socket{context, zmq::socket_type::dealer};
  explicit Dealer(const std::string& endpoint) {
    socket.set(zmq::sockopt::linger, 0);
    socket.connect(endpoint);
  }
  void submit(std::uint64_t id, std::int64_t floats = 2) {
    (void)socket.send(zmq::buffer(test::submit_header(id, "held", floats)), zmq::send_flags::sndmore);
    (void)socket.send(zmq::buffer(std::string(static_cast<std::size_t>(floats) * 4, '\0')), zmq::send_flags::none);
  }
  // The next reply's header, if one comes within 5 s.
  std::optional<wire::Header> reply() { return test::next_reply(socket, std::chrono::milliseconds(5000)); }
};

}  // namespace

TEST_CASE("client endpoint: requests in flight are bounded for every client together, and in bytes per client",
          "[client]") {
  Session session;
  test::Latch latch;
  test::serve_held(session, latch);
  ClientEndpointOptions options;
  options.max_in_flight = 2;
  options.max_in_flight_bytes_per_client = 1000;
  ClientEndpoint endpoint(session, "tcp://127.0.0.1:*", options);
  Dealer a(endpoint.endpoint()), b(endpoint.endpoint()), c(endpoint.endpoint());
  // Bytes: 200 floats (800 bytes and the header's) leave no room for a second such request.
  a.submit(1, 200);
  REQUIRE(test::eventually([&] { return endpoint.in_flight() == 1; }));
  a.submit(2, 200);
  auto refused = a.reply();
  REQUIRE(refused.has_value());
  CHECK(refused->request_id == 2);
  CHECK(refused->status_code == static_cast<int>(absl::StatusCode::kResourceExhausted));
  CHECK_THAT(refused->message, Contains("max_in_flight_bytes_per_client"));
  // Every client together: a second connection takes the last place, a third is refused.
  b.submit(3);
  REQUIRE(test::eventually([&] { return endpoint.in_flight() == 2; }));
  c.submit(4);
  auto full = c.reply();
  REQUIRE(full.has_value());
  CHECK(full->request_id == 4);
  CHECK(full->status_code == static_cast<int>(absl::StatusCode::kResourceExhausted));
  CHECK_THAT(full->message, Contains("requests of all its clients in flight, its max_in_flight"));
  CHECK(session.metrics().in_flight == 2);
  latch.release();
  auto first = a.reply();
  auto third = b.reply();
  REQUIRE(first.has_value());
  REQUIRE(third.has_value());
  CHECK(first->status_code == 0);
  CHECK(third->status_code == 0);
  CHECK(test::eventually([&] { return endpoint.in_flight() == 0; }));
  c.submit(5);  // room again
  auto fifth = c.reply();
  REQUIRE(fifth.has_value());
  CHECK(fifth->request_id == 5);
  CHECK(fifth->status_code == 0);
}

TEST_CASE("client endpoint: drain() answers the requests in flight, refuses new ones, then stops accepting",
          "[client]") {
  Session session;
  test::Latch latch;
  test::serve_held(session, latch);
  ClientEndpoint endpoint(session, "tcp://127.0.0.1:*");
  const std::string address = endpoint.endpoint();
  Dealer a(address);
  a.submit(1);
  REQUIRE(test::eventually([&] { return latch.entered.load() == 1; }));
  auto drained = std::async(std::launch::async, [&] { endpoint.drain(absl::Seconds(30)); });
  REQUIRE(test::eventually([&] { return endpoint.draining(); }));
  Dealer b(address);
  b.submit(2);
  auto refused = b.reply();
  REQUIRE(refused.has_value());
  CHECK(refused->request_id == 2);
  CHECK(refused->status_code == static_cast<int>(absl::StatusCode::kUnavailable));
  CHECK_THAT(refused->message, Contains("is stopping"));
  CHECK(drained.wait_for(std::chrono::milliseconds(100)) == std::future_status::timeout);  // request 1 holds it
  latch.release();
  auto answered = a.reply();
  REQUIRE(answered.has_value());
  CHECK(answered->request_id == 1);
  CHECK(answered->status_code == 0);
  REQUIRE(drained.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  CHECK(endpoint.dropped_replies() == 0);
  // Stopped: the port takes no connection (a client would otherwise wait its whole timeout).
  const int port = std::stoi(address.substr(address.rfind(':') + 1));
  // ZeroMQ's I/O thread closes the listener just after stop() returns.
  const auto closed = [port] {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return false;
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(static_cast<std::uint16_t>(port));
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const int connected = ::connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof to);
    ::close(fd);
    return connected != 0;
  };
  CHECK(test::eventually(closed));
}

TEST_CASE("a remote client of a malformed endpoint throws std::runtime_error naming it", "[client]") {
  CHECK_THROWS_AS(RemoteClient("127.0.0.1:5555"), std::runtime_error);
  CHECK_THROWS_WITH(RemoteClient("127.0.0.1:5555"), Contains("'127.0.0.1:5555'"));
}

TEST_CASE("control endpoint: a client that sends many requests and never reads is sent at most a few replies",
          "[control]") {
  Session session;
  test::Latch latch;
  test::serve_held(session, latch);
  // ipc: a Unix socket's buffers are small and fixed, unlike the loopback's, which grow to megabytes.
  ControlEndpoint endpoint(session, "ipc:///tmp/blockflow-control-hwm-" + std::to_string(::getpid()), ControlOptions{});
  zmq::context_t context;
  zmq::socket_t dealer{context, zmq::socket_type::dealer};
  dealer.set(zmq::sockopt::linger, 0);
  dealer.set(zmq::sockopt::rcvhwm, 1);
  dealer.set(zmq::sockopt::rcvbuf, 4096);
  dealer.connect(endpoint.endpoint());
  constexpr int kRequests = 1000;
  for (int i = 0; i < kRequests; ++i) {
    REQUIRE(dealer.send(zmq::message_t(), zmq::send_flags::sndmore));
    REQUIRE(dealer.send(zmq::buffer(std::string(R"({"cmd": "metrics"})")), zmq::send_flags::none));
  }
  REQUIRE(test::eventually([&] { return endpoint.requests_served() == kRequests; }, std::chrono::seconds(60)));
  int received = 0;
  for (;;) {
    zmq::pollitem_t item{dealer.handle(), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, std::chrono::milliseconds(500)) == 0) break;
    std::vector<zmq::message_t> reply;
    REQUIRE(zmq::recv_multipart(dealer, std::back_inserter(reply)));
    ++received;
  }
  INFO(received << " replies of " << kRequests);
  CHECK(received > 0);
  CHECK(received < kRequests / 2);  // ZeroMQ's default would have buffered all 1000
  latch.release();
}
