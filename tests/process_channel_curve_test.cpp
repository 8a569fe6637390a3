// tcp:// ProcessChannels with CURVE (process_channel.hpp, curve.hpp): a receiver with keys takes
// envelopes from the senders whose keys it admits and from no one else (a stranger's key, no key,
// a wrong receiver key: refused at the handshake, counted, nothing arrives); a receiver without
// keys binds beyond the loopback only when told it is insecure; keys are refused where they mean
// nothing, and an unreadable key file is named.
#include "curve_util.hpp"

#include <blockflow/channel/process_channel.hpp>
#include <blockflow/core/detail/auth_failures.hpp>

using namespace blockflow;
using Catch::Matchers::Contains;

namespace {

using Keys = test::AliceKeys;

Envelope numbered(std::uint64_t id) {
  Envelope e;
  e.request_id = id;
  e.tensors = {at::full({2, 3}, static_cast<double>(id))};
  return e;
}

std::uint64_t auth_failures() { return blockflow::detail::auth_failure_counter().load(); }

// A sender with `security` that must give up after `timeout`.
std::unique_ptr<ProcessChannel> sender_with(const std::string& uri, ClientSecurity security,
                                            absl::Duration timeout = absl::Seconds(10)) {
  ProcessChannelOptions options;
  options.sender_security = std::move(security);
  options.send_timeout = timeout;
  auto ch = open_channel(uri, ChannelRole::kSender, options);
  INFO(ch.status());
  REQUIRE(ch.ok());
  return *std::move(ch);
}

}  // namespace

TEST_CASE("tcp:// channel with CURVE: the admitted sender's envelopes arrive; strangers are refused and counted",
          "[process_channel][curve]") {
  Keys keys;
  ProcessChannelOptions options;
  options.receiver_security = keys.server();
  auto opened = open_channel("tcp://127.0.0.1:*", ChannelRole::kReceiver, options);
  INFO(opened.status());
  REQUIRE(opened.ok());
  auto receiver = *std::move(opened);
  const std::string uri = receiver->uri();

  auto alice = sender_with(uri, keys.client("alice"));
  for (std::uint64_t id = 1; id <= 3; ++id) REQUIRE(alice->send(numbered(id)).status.ok());
  for (std::uint64_t id = 1; id <= 3; ++id) {
    auto e = receiver->receive(absl::Now() + absl::Seconds(10));
    REQUIRE(e.has_value());
    CHECK(e->request_id == id);
    CHECK(at::equal(e->tensors.at(0), at::full({2, 3}, static_cast<double>(id))));
  }

  struct Stranger {
    const char* who;
    ClientSecurity security;
  };
  const std::vector<Stranger> strangers = {
      {"mallory: a valid pair the receiver does not admit", keys.client("mallory")},
      {"no keys at all", {}},
      {"alice's pair with the wrong receiver key", {keys.file("alice.key_secret"), keys.file("mallory.key")}},
  };
  for (const auto& stranger : strangers) {
    INFO(stranger.who);
    const std::uint64_t before = auth_failures();
    auto sender = sender_with(uri, stranger.security, absl::Milliseconds(700));
    auto out = sender->send(numbered(99));
    CHECK(out.status.code() == absl::StatusCode::kDeadlineExceeded);
    CHECK_THAT(std::string(out.status.message()), Contains(uri) && Contains("refused"));
    REQUIRE(out.displaced.has_value());
    CHECK(out.displaced->request_id == 99);
    CHECK(test::eventually([&] { return auth_failures() > before; }));
    CHECK_FALSE(receiver->receive(absl::Now() + absl::Milliseconds(200)).has_value());
  }
  CHECK(receiver->stats().received == 3);

  // alice is still served after all that.
  REQUIRE(alice->send(numbered(7)).status.ok());
  auto e = receiver->receive(absl::Now() + absl::Seconds(10));
  REQUIRE(e.has_value());
  CHECK(e->request_id == 7);
}

TEST_CASE("tcp:// channel receivers: plain TCP beyond the loopback only when insecure; keys are for tcp:// only",
          "[process_channel][curve]") {
  Keys keys;
  auto plain = open_channel("tcp://0.0.0.0:*", ChannelRole::kReceiver);
  CHECK(plain.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(plain.status().message()), Contains("tcp://0.0.0.0:*") && Contains("insecure"));

  ProcessChannelOptions insecure;
  insecure.receiver_security.insecure = true;
  CHECK(open_channel("tcp://0.0.0.0:*", ChannelRole::kReceiver, insecure).ok());
  ProcessChannelOptions keyed;
  keyed.receiver_security = keys.server();
  CHECK(open_channel("tcp://0.0.0.0:*", ChannelRole::kReceiver, keyed).ok());

  for (const char* uri : {"ipc://pc-curve-keys", "shm://pc-curve-keys"}) {
    INFO(uri);
    auto refused = open_channel(uri, ChannelRole::kReceiver, keyed);
    CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(refused.status().message()), Contains(uri) && Contains("tcp://"));
  }

  // A sender whose key file is missing: the error names the URI and the file.
  ProcessChannelOptions missing;
  missing.sender_security = {keys.file("nobody.key_secret"), keys.file("server.key")};
  auto sender = open_channel("tcp://127.0.0.1:5999", ChannelRole::kSender, missing);
  CHECK(sender.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(sender.status().message()), Contains("tcp://127.0.0.1:5999") && Contains("nobody.key_secret"));
  // A receiver's unreadable key file stops it from binding, naming the file.
  ProcessChannelOptions bad_receiver;
  bad_receiver.receiver_security = {keys.file("nobody.key_secret"), keys.file("authorized"), false};
  auto receiver = open_channel("tcp://127.0.0.1:*", ChannelRole::kReceiver, bad_receiver);
  CHECK_FALSE(receiver.ok());
  CHECK_THAT(std::string(receiver.status().message()), Contains("nobody.key_secret"));
}
