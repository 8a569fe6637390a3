// Remote clients: round trips through the client endpoint, errors, and malformed frames sent with a
// raw ZeroMQ socket to the client endpoint and to a worker's data endpoint; a stranger on a
// zero-copy worker's data link; requests that complete after their endpoint stopped or was
// destroyed.
#include "client_test_util.hpp"

#include <blockflow/serve/client_endpoint.hpp>
#include <blockflow/channel/detail/packet_link.hpp>
#include <blockflow/channel/wire_format.hpp>
#include <blockflow/worker/worker_site.hpp>

#include <fmt/format.h>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <filesystem>
#include <future>
#include <mutex>
#include <set>

using namespace blockflow;
using Catch::Matchers::Contains;

namespace {

void serve_basic(Session& session) {
  session.add_block(test::unary("twice", [](const Tensor& x) { return x * 2; }))
      .add_block(Block::callable("fails", [](Tensors&&) -> absl::StatusOr<Tensors> {
        return absl::FailedPreconditionError("no can do");
      }))
      .add_path(Path::chain("double", {"twice"}))
      .add_path(Path::chain("broken", {"fails"}));
  test::require_started(session);
}

// A valid submit header for one float32 [2] tensor, as bytes.
std::string valid_header(std::uint64_t id) { return test::submit_header(id, "double"); }

// Sends raw frames and returns the reply's header, if one comes within 2 s.
std::optional<wire::Header> send_raw(zmq::socket_t& dealer, const std::vector<std::string>& frames) {
  for (std::size_t i = 0; i < frames.size(); ++i) {
    (void)dealer.send(zmq::buffer(frames[i]), i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
  }
  return test::next_reply(dealer, std::chrono::milliseconds(2000));
}

// A latch the block of task "held" waits on, so that a request stays inside the session until the
// test opens it.
using Latch = test::Latch;

using test::serve_held;

// This process's open eventfds: a client endpoint wakes its socket thread through one, which must
// stay open while a completion callback may still write to it.
int open_eventfds() {
  int n = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    if (std::filesystem::read_symlink(entry.path(), ec).string() == "anon_inode:[eventfd]") ++n;
  }
  return n;
}

}  // namespace

TEST_CASE("a remote client submits over TCP and gets outputs or the named error", "[client]") {
  Session session;
  serve_basic(session);
  ClientEndpoint endpoint(session, "tcp://127.0.0.1:*");
  CHECK_THAT(endpoint.endpoint(), Contains("tcp://127.0.0.1:"));
  RemoteClient client(endpoint.endpoint());
  auto out = client.submit("double", {at::arange(4, at::kFloat)});
  REQUIRE(out.ok());
  CHECK(at::equal(out->at(0), at::arange(4, at::kFloat) * 2));
  auto big = client.submit("double", {at::ones({256, 56, 56})});  // 3.2 MB each way
  REQUIRE(big.ok());
  CHECK(big->at(0).sum().item<double>() == 2.0 * 256 * 56 * 56);
  auto failed = client.submit("broken", {at::ones({1})});
  CHECK(absl::IsFailedPrecondition(failed.status()));
  CHECK_THAT(std::string(failed.status().message()), Contains("block 'fails'") && Contains("no can do"));
  auto unknown = client.submit("nope", {at::ones({1})});
  CHECK(absl::IsNotFound(unknown.status()));
  CHECK(endpoint.served() == 4);
}

TEST_CASE("a task whose first block's queue is full holds up no other client (policy block)", "[client]") {
  // The endpoint's one thread submits for every client: it may not wait for room in "gate"'s queue
  // (one call in it, one request queued, a third handed to a lane), or "quick" would go unanswered.
  std::promise<void> open;
  std::shared_future<void> opened = open.get_future().share();
  BlockOptions one = test::queue_of_one();
  one.workers = 1;  // one lane in "gate", one waiting for its room with the third request, one free
  SessionOptions options;
  options.lanes = 3;
  Session session(options);
  session.add_block(test::unary("gate", [opened](const Tensor& x) {
           opened.wait();
           return x;
         }, one))
      .add_block(test::unary("quick", [](const Tensor& x) { return x + 1; }))
      .add_path(Path::chain("slow", {"gate"}))
      .add_path(Path::chain("fast", {"quick"}));
  test::require_started(session);
  ClientEndpoint endpoint(session, "tcp://127.0.0.1:*");
  std::vector<std::future<absl::StatusOr<Tensors>>> slow;
  for (int i = 0; i < 3; ++i) {
    slow.push_back(std::async(std::launch::async, [&] {
      RemoteClient client(endpoint.endpoint());
      return client.submit("slow", {at::ones({1})});
    }));
  }
  REQUIRE(test::eventually([&] { return session.metrics().in_flight == 3; }, std::chrono::seconds(30)));
  RemoteClient other(endpoint.endpoint(), absl::Seconds(20));
  auto quick = other.submit("fast", {at::ones({1})});
  INFO(quick.status().ToString());
  CHECK(quick.ok());  // before: DeadlineExceeded, the endpoint's thread waiting for room in "gate"
  open.set_value();
  for (auto& f : slow) CHECK(f.get().ok());
}

TEST_CASE("a remote client with no endpoint to reach keeps its timeout, however many requests it sent", "[client]") {
  // Nothing listens there: requests queue in the client's socket up to its bound (1000), and each
  // submit() still ends within its timeout, first waiting for a reply, then for the socket.
  RemoteClient client("tcp://127.0.0.1:1", absl::Milliseconds(1));
  int no_reply = 0, not_sent = 0;
  for (int i = 0; i < 2000; ++i) {
    auto out = client.submit("double", {at::ones({1})});
    REQUIRE(absl::IsDeadlineExceeded(out.status()));
    const std::string why(out.status().message());
    if (why.find("no reply to request") != std::string::npos) ++no_reply;
    if (why.find("could not be sent within 1ms (no endpoint takes it)") != std::string::npos) ++not_sent;
  }
  CHECK(no_reply + not_sent == 2000);
  CHECK(not_sent >= 500);  // the socket's bound (1000 by default) was reached
}

TEST_CASE("outputs the wire cannot carry come back as an error naming why; the endpoint keeps serving", "[client]") {
  Session session;
  session.add_block(test::unary("grow", [](const Tensor& x) { return x.unsqueeze(0); }))
      .add_block(test::unary("complex", [](const Tensor& x) { return at::zeros({x.numel()}, at::kComplexFloat); }))
      .add_block(test::unary("twice", [](const Tensor& x) { return x * 2; }))
      .add_path(Path::chain("grow", {"grow"}))
      .add_path(Path::chain("complex", {"complex"}))
      .add_path(Path::chain("double", {"twice"}));
  test::require_started(session);
  ClientEndpoint endpoint(session, "tcp://127.0.0.1:*");
  RemoteClient client(endpoint.endpoint());
  // An 8-dimensional input is fine; its output has 9 dimensions, one more than the format carries.
  auto nine = client.submit("grow", {at::ones({1, 1, 1, 1, 1, 1, 1, 2})});
  CHECK(absl::IsInvalidArgument(nine.status()));
  CHECK_THAT(std::string(nine.status().message()), Contains("the outputs cannot be sent") && Contains("ndim 9 exceeds 8"));
  auto complex = client.submit("complex", {at::ones({2})});
  CHECK(absl::IsInvalidArgument(complex.status()));
  CHECK_THAT(std::string(complex.status().message()), Contains("has no wire code"));
  auto fine = client.submit("double", {at::ones({2})});  // the same connection, served on
  REQUIRE(fine.ok());
  CHECK(at::equal(fine->at(0), at::full({2}, 2.0F)));
}

TEST_CASE("malformed frames to the client endpoint: dropped, counted, answered when the id is readable", "[client]") {
  Session session;
  serve_basic(session);
  ClientEndpoint endpoint(session, "tcp://127.0.0.1:*");
  zmq::context_t context;
  zmq::socket_t dealer(context, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::linger, 0);
  dealer.connect(endpoint.endpoint());
  const std::string data(8, '\0');
  const std::string good = valid_header(7);
  const std::size_t desc = wire::kFixedHeaderBytes + std::string("double").size();  // first tensor descriptor

  auto expect_error = [&](std::vector<std::string> frames, const std::string& needle) {
    auto reply = send_raw(dealer, frames);
    REQUIRE(reply.has_value());
    CHECK(reply->request_id == 7);
    CHECK(reply->status_code == static_cast<int>(absl::StatusCode::kInvalidArgument));
    CHECK_THAT(reply->message, Contains("malformed request") && Contains(needle));
  };
  std::string huge_ndim = good;
  huge_ndim[desc + 1] = 9;
  expect_error({huge_ndim, data}, "ndim 9");
  std::string bad_dtype = good;
  bad_dtype[desc] = 77;
  expect_error({bad_dtype, data}, "dtype code 77");
  expect_error({good, std::string(12, '\0')}, "tensor 0");                  // byte count != shape x dtype
  expect_error({good.substr(0, good.size() - 3), data}, "");                // truncated tensor descriptor
  std::string bad_kind = good;
  bad_kind[6] = 9;
  expect_error({bad_kind, data}, "kind");
  std::vector<std::string> many_frames = {good, data};  // more frames than a request has: never all held
  many_frames.resize(1000);
  expect_error(many_frames, "a request of more than 65 frames");

  // No readable request id: dropped without a reply.
  std::string bad_magic = good;
  bad_magic[0] = 'X';
  CHECK_FALSE(send_raw(dealer, {bad_magic, data}).has_value());
  std::string bad_version = good;
  bad_version[4] = 42;
  CHECK_FALSE(send_raw(dealer, {bad_version, data}).has_value());
  CHECK_FALSE(send_raw(dealer, {"garbage"}).has_value());
  CHECK_FALSE(send_raw(dealer, {good.substr(0, 10)}).has_value());
  CHECK(endpoint.malformed_frames() == 10);

  // The session keeps serving.
  auto reply = send_raw(dealer, {good, std::string("\0\0\x80\x3f\0\0\0\x40", 8)});  // [1.0, 2.0]
  REQUIRE(reply.has_value());
  CHECK(reply->status_code == 0);
  RemoteClient client(endpoint.endpoint());
  CHECK(client.submit("double", {at::ones({1})}).ok());
}

// The session of the next two tests: block "affine" (x * 2 + 2 in the test plugin) in worker w1.
std::shared_ptr<WorkerSite> serve_affine_in_worker(Session& session, const std::string& channel) {
  auto site = make_worker([&] {
    WorkerOptions o;
    o.name = "w1";
    o.channel = channel;
    o.plugins = {BLOCKFLOW_TEST_PLUGIN};
    return o;
  }());
  BlockDescription affine;
  affine.name = "affine";
  affine.factory = "affine";
  affine.placement = "w1";
  session.add_site(site).add_block(affine).add_path(Path::chain("t", {"affine"}));
  test::require_started(session);
  return site;
}

void wait_for_malformed(Session& session, std::uint64_t n) {
  for (int i = 0; i < 200 && session.metrics().sites.at(0).malformed_frames < n; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

TEST_CASE("malformed frames to a worker's data endpoint are counted and dropped; the session keeps serving", "[client]") {
  Session session;
  auto site = serve_affine_in_worker(session, "zmq");
  zmq::context_t context;
  zmq::socket_t push(context, zmq::socket_type::push);
  push.set(zmq::sockopt::linger, 1000);
  push.connect(site->result_endpoint());
  std::string bad = valid_header(123456);
  bad[4] = 3;  // wrong version
  (void)push.send(zmq::buffer(bad), zmq::send_flags::none);
  (void)push.send(zmq::str_buffer("garbage"), zmq::send_flags::none);
  wait_for_malformed(session, 2);
  CHECK(session.metrics().sites.at(0).malformed_frames == 2);
  Result r = session.submit("t", at::ones({2})).get();
  REQUIRE(r.ok());
  CHECK(at::equal(r.output(), at::full({2}, 4.0)));
}

TEST_CASE("a zero-copy worker's data link refuses any process but the worker; the session keeps serving", "[client]") {
  Session session;
  auto site = serve_affine_in_worker(session, "shm");
  // This test's process is not the worker: its connection is refused (counted) whatever it sends.
  auto intruder = blockflow::detail::PacketLink::connect(site->result_endpoint());
  REQUIRE(intruder.ok());
  (void)(*intruder)->send({"garbage"});
  wait_for_malformed(session, 1);
  CHECK(session.metrics().sites.at(0).malformed_frames == 1);
  // The refused end sees its connection closed.
  auto closed = (*intruder)->receive(2000);
  REQUIRE(closed.has_value());
  CHECK(closed->closed);
  Result r = session.submit("t", at::ones({2})).get();
  REQUIRE(r.ok());
  CHECK(at::equal(r.output(), at::full({2}, 4.0)));
}

TEST_CASE("a request that completes after its endpoint stopped is dropped and counted; then the session goes first", "[client]") {
  Latch latch;
  auto session = std::make_unique<Session>();
  serve_held(*session, latch);
  ClientEndpoint endpoint(*session, "tcp://127.0.0.1:*");
  auto reply = std::async(std::launch::async, [address = endpoint.endpoint()] {
    return RemoteClient(address, absl::Milliseconds(300)).submit("held", {at::ones({2})});
  });
  REQUIRE(test::eventually([&] { return latch.entered.load() == 1; }));
  endpoint.stop();
  latch.release();  // the completion runs on a lane now; nobody sends its reply
  CHECK(test::eventually([&] { return endpoint.dropped_replies() == 1; }));
  CHECK(absl::IsDeadlineExceeded(reply.get().status()));
  CHECK(endpoint.served() == 0);
  session.reset();  // the session may go before the stopped endpoint
  CHECK(endpoint.dropped_replies() == 1);
}

TEST_CASE("the endpoint destroyed while its request is inside the session: the late completion touches nothing freed", "[client]") {
  Latch latch;
  Session session;
  serve_held(session, latch);
  // Made before the endpoint, so that the eventfds of its ZeroMQ context are in the baseline.
  const std::string address = fmt::format("ipc:///tmp/blockflow-client-test-{}", ::getpid());
  RemoteClient client(address, absl::Milliseconds(300));
  const int baseline = open_eventfds();
  auto endpoint = std::make_unique<ClientEndpoint>(session, address);
  auto reply = std::async(std::launch::async, [&client] { return client.submit("held", {at::ones({2})}); });
  REQUIRE(test::eventually([&] { return latch.entered.load() == 1; }));
  endpoint.reset();
  // The request's completion callback still holds the endpoint's outbox: its wake-up fd stays open
  // (the endpoint used to close it here, and its callback then wrote through the freed endpoint).
  CHECK(open_eventfds() == baseline + 1);
  latch.release();     // the completion runs now, on a lane, and drops its reply
  session.shutdown();  // waits for it
  CHECK(absl::IsDeadlineExceeded(reply.get().status()));
  CHECK(open_eventfds() == baseline);  // the last owner, the callback, is gone: so is the fd
}

TEST_CASE("a client that never reads its replies loses them, counted; the other clients are served meanwhile", "[client]") {
  Session session;
  serve_basic(session);
  ClientEndpointOptions options;
  options.max_backlog_bytes_per_client = 1 << 20;  // 16 replies of 64 KiB wait for it, beyond ZeroMQ's 16
  ClientEndpoint endpoint(session, "tcp://127.0.0.1:*", options);

  zmq::context_t context;
  zmq::socket_t sloth(context, zmq::socket_type::dealer);
  sloth.set(zmq::sockopt::linger, 0);
  sloth.set(zmq::sockopt::rcvhwm, 1);
  sloth.set(zmq::sockopt::rcvbuf, 4096);
  sloth.connect(endpoint.endpoint());
  const std::string payload(64 << 10, '\1');  // 16,384 float32
  constexpr int kRequests = 400;
  for (int i = 0; i < kRequests; ++i) {
    wire::Header h = *wire::decode_header(valid_header(1000 + i).data(), valid_header(1000 + i).size());
    h.tensors[0].shape = {16384};
    h.tensors[0].byte_count = payload.size();
    (void)sloth.send(zmq::buffer(wire::encode_header(h)), zmq::send_flags::sndmore);
    (void)sloth.send(zmq::buffer(payload), zmq::send_flags::none);
  }
  // Once the session has answered all of them, most of the sloth's replies are dropped...
  REQUIRE(test::eventually([&] { return endpoint.dropped_replies() >= kRequests / 2; }, std::chrono::seconds(60)));
  // ...and another client is answered while the sloth still reads nothing.
  RemoteClient other(endpoint.endpoint(), absl::Seconds(10));
  for (int i = 0; i < 20; ++i) {
    auto out = other.submit("double", {at::ones({4})});
    REQUIRE(out.ok());
    CHECK(out->at(0).sum().item<double>() == 8);
  }
  // The sloth gets what was kept for it, in order, when it finally reads.
  std::vector<zmq::message_t> reply;
  sloth.set(zmq::sockopt::rcvtimeo, 30000);  // what was kept for it never came: a failure, not a hang
  REQUIRE(zmq::recv_multipart(sloth, std::back_inserter(reply)));
  auto first = wire::decode_header(reply.at(0).data(), reply.at(0).size());
  REQUIRE(first.ok());
  CHECK(first->request_id == 1000);
}

TEST_CASE("replies waiting for clients that do not read are bounded in all by max_backlog_bytes", "[client]") {
  Session session;
  serve_basic(session);
  ClientEndpointOptions options;
  options.max_backlog_bytes_per_client = std::size_t{64} << 20;  // never reached here: 12.8 MB each
  options.max_backlog_bytes = 1 << 20;                            // 16 replies of 64 KiB, for both
  ClientEndpoint endpoint(session, "tcp://127.0.0.1:*", options);

  zmq::context_t context;
  std::vector<zmq::socket_t> sloths;
  for (int s = 0; s < 2; ++s) {
    sloths.emplace_back(context, zmq::socket_type::dealer);
    sloths.back().set(zmq::sockopt::linger, 0);
    sloths.back().set(zmq::sockopt::rcvhwm, 1);
    sloths.back().set(zmq::sockopt::rcvbuf, 4096);
    sloths.back().connect(endpoint.endpoint());
  }
  const std::string payload(64 << 10, '\1');  // 16,384 float32
  constexpr int kRequests = 200;                // per sloth
  for (int i = 0; i < 2 * kRequests; ++i) {
    wire::Header h = *wire::decode_header(valid_header(1000 + i).data(), valid_header(1000 + i).size());
    h.tensors[0].shape = {16384};
    h.tensors[0].byte_count = payload.size();
    zmq::socket_t& sloth = sloths[static_cast<std::size_t>(i % 2)];
    (void)sloth.send(zmq::buffer(wire::encode_header(h)), zmq::send_flags::sndmore);
    (void)sloth.send(zmq::buffer(payload), zmq::send_flags::none);
  }
  // Each sloth's own bound is far off: what is dropped, the bound on both together dropped.
  REQUIRE(test::eventually([&] { return endpoint.dropped_replies() >= kRequests; }, std::chrono::seconds(60)));
  // Every reply has left the session: sent to its client's pipe, waiting in a backlog, or dropped.
  REQUIRE(test::eventually([&] { return session.metrics().in_flight == 0; }, std::chrono::seconds(60)));
  // The two read at last: what the bound kept, and what ZeroMQ and the kernel buffered before the
  // pipes filled; the rest was dropped.
  int received = 0;
  for (auto& sloth : sloths) {
    for (;;) {
      zmq::pollitem_t item{sloth.handle(), 0, ZMQ_POLLIN, 0};
      zmq::poll(&item, 1, std::chrono::milliseconds(500));
      if ((item.revents & ZMQ_POLLIN) == 0) break;
      std::vector<zmq::message_t> reply;
      REQUIRE(zmq::recv_multipart(sloth, std::back_inserter(reply)));
      ++received;
    }
  }
  CHECK(received + static_cast<int>(endpoint.dropped_replies()) == 2 * kRequests);
  CHECK(received <= kRequests);
}

TEST_CASE("requests above max_request_bytes are refused naming the limit; a frame above it is never read whole",
          "[client]") {
  Session session;
  serve_basic(session);
  ClientEndpointOptions options;
  options.max_request_bytes = 1 << 20;
  ClientEndpoint endpoint(session, "tcp://127.0.0.1:*", options);
  zmq::context_t context;
  zmq::socket_t dealer(context, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::linger, 0);
  dealer.connect(endpoint.endpoint());

  // Two tensors of 600 KiB each: every frame is under the limit, the request is not.
  const std::string part(600 << 10, '\0');
  wire::Header h = *wire::decode_header(valid_header(7).data(), valid_header(7).size());
  h.tensors[0].shape = {153600};
  h.tensors[0].byte_count = part.size();
  h.tensors.push_back(h.tensors[0]);
  auto refused = send_raw(dealer, {wire::encode_header(h), part, part});
  REQUIRE(refused.has_value());
  CHECK(refused->request_id == 7);
  CHECK(refused->status_code == static_cast<int>(absl::StatusCode::kInvalidArgument));
  CHECK_THAT(refused->message, Contains("max_request_bytes") && Contains("1048576"));

  // One frame of 2 MiB: ZeroMQ drops the connection before reading it whole, and nothing answers.
  h.tensors.resize(1);
  h.tensors[0].shape = {524288};
  h.tensors[0].byte_count = 2 << 20;
  CHECK_FALSE(send_raw(dealer, {wire::encode_header(h), std::string(2 << 20, '\0')}).has_value());

  // The endpoint serves on.
  RemoteClient client(endpoint.endpoint(), absl::Seconds(10));
  REQUIRE(client.submit("double", {at::ones({2})}).ok());
}

TEST_CASE("one client's requests in flight are bounded: beyond max_in_flight_per_client, ResourceExhausted at once",
          "[client]") {
  Session session;
  Latch latch;
  serve_held(session, latch);
  ClientEndpointOptions options;
  options.max_in_flight_per_client = 2;
  ClientEndpoint endpoint(session, "tcp://127.0.0.1:*", options);
  zmq::context_t context;
  zmq::socket_t dealer(context, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::linger, 0);
  dealer.connect(endpoint.endpoint());
  auto held_header = [](std::uint64_t id) { return test::submit_header(id, "held"); };
  auto submit_held = [&](std::uint64_t id) {
    (void)dealer.send(zmq::buffer(held_header(id)), zmq::send_flags::sndmore);
    (void)dealer.send(zmq::buffer(std::string(8, '\0')), zmq::send_flags::none);
  };
  submit_held(1);
  submit_held(2);
  auto third = send_raw(dealer, {held_header(3), std::string(8, '\0')});
  REQUIRE(third.has_value());
  CHECK(third->request_id == 3);
  CHECK(third->status_code == static_cast<int>(absl::StatusCode::kResourceExhausted));
  CHECK_THAT(third->message, Contains("max_in_flight_per_client"));
  latch.release();
  // The two held ones are answered, and the client may submit again.
  std::set<std::uint64_t> answered;
  for (int i = 0; i < 2; ++i) {
    zmq::pollitem_t item{dealer.handle(), 0, ZMQ_POLLIN, 0};
    zmq::poll(&item, 1, std::chrono::milliseconds(5000));
    std::vector<zmq::message_t> reply;
    REQUIRE(zmq::recv_multipart(dealer, std::back_inserter(reply), zmq::recv_flags::dontwait));
    answered.insert(wire::decode_header(reply.at(0).data(), reply.at(0).size())->request_id);
  }
  CHECK(answered == std::set<std::uint64_t>{1, 2});
  auto fourth = send_raw(dealer, {held_header(4), std::string(8, '\0')});
  REQUIRE(fourth.has_value());
  CHECK(fourth->status_code == 0);
}
