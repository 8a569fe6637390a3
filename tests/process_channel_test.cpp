// ProcessChannel (process_channel.hpp): the cross-process TensorChannels opened by URI, both ends in
// this process here (the examples' ctest runs them in two processes and kills one): values and
// request ids arrive intact, shm:// copies nothing for a tensor made by empty() and copies once
// otherwise, slots come back when the receiver's tensors die, FullPolicy on both ends, URIs and
// directories checked, errors name the URI. The ends' lifetimes: shm_channel_lifetime_test.cpp.
#include "process_channel_util.hpp"

#include <blockflow/channel/detail/cuda_ipc.hpp>
#include <blockflow/channel/detail/runtime_dir.hpp>

#include <fmt/format.h>

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <future>

using namespace blockflow;
using Catch::Matchers::Contains;
using Catch::Matchers::StartsWith;

using test::envelope_of;
using test::open_or_fail;
using test::round_trip;
using test::unique_name;

TEST_CASE("shm:// hands tensors made by empty() over with no copy; slots return when the receiver's tensors die",
          "[process_channel]") {
  const std::string uri = "shm://" + unique_name("shm");
  auto receiver = open_or_fail(uri, ChannelRole::kReceiver);
  auto sender = open_or_fail(uri, ChannelRole::kSender);
  CHECK(receiver->kind() == "shm");
  CHECK(sender->uri() == uri);
  round_trip(*sender, *receiver, 12);
  CHECK(sender->stats().sent == 12);
  CHECK(sender->stats().bytes_copied == 0);
  CHECK(receiver->stats().received == 12);
  CHECK(receiver->stats().bytes_copied == 0);
  CHECK(sender->connected());
  CHECK(receiver->connected());
  // Every received tensor has died: every slot comes back.
  CHECK(test::eventually([&] { return sender->shm_stats().releases == 12 && sender->shm_stats().slots_in_use == 0; }));
  CHECK(sender->shm_stats().leases == 12);

  SECTION("a tensor that is not in a slot is copied into one, once, and counted") {
    const at::Tensor plain = at::full({256, 1024}, 3.0f);  // 1 MiB
    REQUIRE(sender->send(envelope_of(99, {plain})).status.ok());
    auto e = receiver->receive(absl::Now() + absl::Seconds(10));
    REQUIRE(e.has_value());
    CHECK(at::equal(e->tensors[0], plain));
    CHECK(sender->stats().bytes_copied == plain.nbytes());
    CHECK(receiver->stats().bytes_copied == 0);
  }
  SECTION("a non-contiguous tensor arrives with its values") {
    const at::Tensor t = at::arange(12, at::kLong).reshape({3, 4}).t();
    REQUIRE(sender->send(envelope_of(5, {t, at::ones({2}, at::kBool)})).status.ok());
    auto e = receiver->receive(absl::Now() + absl::Seconds(10));
    REQUIRE(e.has_value());
    REQUIRE(e->tensors.size() == 2);
    CHECK(at::equal(e->tensors[0], t));
    CHECK(e->tensors[1].dtype() == at::kBool);
  }
}

TEST_CASE("empty() refuses negative and overflowing sizes on every end, naming the URI; too big for the pools is refused",
          "[process_channel]") {
  const std::string shm = "shm://" + unique_name("sizes");
  auto receiver = open_or_fail(shm, ChannelRole::kReceiver);
  auto sender = open_or_fail(shm, ChannelRole::kSender);
  for (ProcessChannel* end : {sender.get(), receiver.get()}) {
    auto negative = end->empty({2, -1});
    REQUIRE_FALSE(negative.ok());
    CHECK(negative.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(negative.status().message()), StartsWith(shm) && Contains("size -1 of dimension 1 is negative"));
    auto overflow = end->empty({std::int64_t{1} << 31, std::int64_t{1} << 31});  // 2^62 floats: 2^64 bytes
    REQUIRE_FALSE(overflow.ok());
    CHECK(overflow.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(overflow.status().message()), Contains("overflows 64 bits"));
  }
  // 2^63 bytes: more than the pools may ever hold (it once wrapped the pool's size to 0).
  auto huge = sender->empty({std::int64_t{1} << 61});
  REQUIRE_FALSE(huge.ok());
  CHECK(huge.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(huge.status().message()), StartsWith(shm) && Contains("does not fit in shared memory"));
  round_trip(*sender, *receiver, 3);  // the channel still works
}

TEST_CASE("shm:// credits: a sender that must not wait is refused while the receiver holds every slot",
          "[process_channel]") {
  const std::string uri = "shm://" + unique_name("credits");
  ProcessChannelOptions o;
  o.shm_slots_per_pool = 2;
  o.shm_max_bytes = 4u << 20;  // one pool of two 1 MiB slots (and its header); a second would not fit
  o.full_policy = FullPolicy::kReject;
  auto receiver = open_or_fail(uri, ChannelRole::kReceiver);
  auto sender = open_or_fail(uri, ChannelRole::kSender, o);
  std::vector<Envelope> held;
  for (int i = 0; i < 2; ++i) {
    auto sent = sender->send(envelope_of(i, {at::ones({1000})}));
    INFO(sent.status);
    REQUIRE(sent.status.ok());
    auto e = receiver->receive(absl::Now() + absl::Seconds(10));
    REQUIRE(e.has_value());
    held.push_back(std::move(*e));
  }
  auto refused = sender->send(envelope_of(7, {at::ones({1000})}));
  CHECK(refused.status.code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(refused.status.message()), Contains(uri));
  REQUIRE(refused.displaced.has_value());
  CHECK(refused.displaced->request_id == 7);
  held.clear();  // the receiver lets go: the slots are credits again
  REQUIRE(test::eventually([&] { return sender->shm_stats().slots_in_use == 0; }));
  CHECK(sender->send(envelope_of(8, {at::ones({1000})})).status.ok());
}

TEST_CASE("close() ends a shm:// send that waits for a slot: Cancelled, the envelope comes back", "[process_channel]") {
  const std::string uri = "shm://" + unique_name("close");
  ProcessChannelOptions o;
  o.shm_slots_per_pool = 2;
  o.shm_max_bytes = 4u << 20;  // one pool of two 1 MiB slots
  o.full_policy = FullPolicy::kBlock;
  o.send_timeout = absl::Seconds(60);
  auto receiver = open_or_fail(uri, ChannelRole::kReceiver);
  auto sender = open_or_fail(uri, ChannelRole::kSender, o);
  std::vector<Envelope> held;  // the receiver holds both slots
  for (int i = 0; i < 2; ++i) {
    REQUIRE(sender->send(envelope_of(i, {at::ones({1000})})).status.ok());
    auto e = receiver->receive(absl::Now() + absl::Seconds(10));
    REQUIRE(e.has_value());
    held.push_back(std::move(*e));
  }
  auto waiting = std::async(std::launch::async, [&] { return sender->send(envelope_of(9, {at::ones({1000})})); });
  REQUIRE(test::eventually([&] { return sender->shm_stats().credit_waits == 1; }));
  sender->close();
  REQUIRE(waiting.wait_for(std::chrono::seconds(10)) == std::future_status::ready);  // not send_timeout's 60 s
  const SendOutcome out = waiting.get();
  CHECK(out.status.code() == absl::StatusCode::kCancelled);
  CHECK_THAT(std::string(out.status.message()), Contains(uri) && Contains("closed"));
  REQUIRE(out.displaced.has_value());
  CHECK(out.displaced->request_id == 9);
}

TEST_CASE("a sender with no receiver: kReject fails at once, kBlock after send_timeout; the envelope comes back",
          "[process_channel]") {
  for (const std::string scheme : {"shm", "ipc"}) {
    const std::string uri = scheme + "://" + unique_name("absent");
    ProcessChannelOptions o;
    o.full_policy = FullPolicy::kReject;
    auto now = open_or_fail(uri, ChannelRole::kSender, o);
    auto out = now->send(envelope_of(1, {at::ones({4})}));
    CHECK(out.status.code() == absl::StatusCode::kUnavailable);
    CHECK_THAT(std::string(out.status.message()), Contains(uri));
    REQUIRE(out.displaced.has_value());
    o.full_policy = FullPolicy::kBlock;
    o.send_timeout = absl::Milliseconds(50);
    auto later = open_or_fail(uri, ChannelRole::kSender, o);
    out = later->send(envelope_of(2, {at::ones({4})}));
    CHECK(out.status.code() == absl::StatusCode::kDeadlineExceeded);
    REQUIRE(out.displaced.has_value());
    CHECK(out.displaced->request_id == 2);
  }
}

TEST_CASE("a shm:// receiver with kDropOldest takes the newest envelope and drops the older ones",
          "[process_channel]") {
  const std::string uri = "shm://" + unique_name("policy");
  ProcessChannelOptions o;
  o.full_policy = FullPolicy::kDropOldest;
  auto receiver = open_or_fail(uri, ChannelRole::kReceiver, o);
  auto sender = open_or_fail(uri, ChannelRole::kSender);
  for (int i = 0; i < 4; ++i) REQUIRE(sender->send(envelope_of(i, {at::full({8}, float(i))})).status.ok());
  auto e = receiver->receive(absl::Now() + absl::Seconds(10));
  REQUIRE(e.has_value());
  CHECK(e->request_id == 3);  // the newest
  CHECK(at::equal(e->tensors[0], at::full({8}, 3.0f)));
  CHECK(receiver->stats().dropped == 3);
  CHECK(receiver->stats().received == 1);
  e.reset();
  CHECK(test::eventually([&] { return sender->shm_stats().slots_in_use == 0; }));  // the dropped ones' too
  CHECK(receiver->send(envelope_of(1, {})).status.code() == absl::StatusCode::kFailedPrecondition);
  receiver->close();
  CHECK(receiver->closed());
  CHECK_FALSE(receiver->receive(absl::Now() + absl::Seconds(1)).has_value());
}

TEST_CASE("several senders feed one shm:// receiver, and several threads may receive", "[process_channel]") {
  const std::string uri = "shm://" + unique_name("many");
  auto receiver = open_or_fail(uri, ChannelRole::kReceiver);
  auto a = open_or_fail(uri, ChannelRole::kSender);
  auto b = open_or_fail(uri, ChannelRole::kSender);
  constexpr int kEach = 50;
  std::thread send_b([&] {
    for (int i = 0; i < kEach; ++i) (void)b->send(envelope_of(1000 + i, {at::full({16}, float(1000 + i))}));
  });
  for (int i = 0; i < kEach; ++i) REQUIRE(a->send(envelope_of(i, {at::full({16}, float(i))})).status.ok());
  send_b.join();
  CHECK(b->stats().sent == kEach);
  std::atomic<int> got{0}, wrong{0};
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);  // a lost envelope: counted below
  auto take = [&] {
    while (got.load() < 2 * kEach && std::chrono::steady_clock::now() < give_up) {
      auto e = receiver->receive(absl::Now() + absl::Milliseconds(200));
      if (!e) continue;
      if (!at::equal(e->tensors[0], at::full({16}, float(e->request_id)))) ++wrong;
      ++got;
    }
  };
  std::thread other(take);
  take();
  other.join();
  CHECK(got.load() == 2 * kEach);
  CHECK(wrong.load() == 0);
  CHECK(receiver->stats().received == 2 * kEach);
}

TEST_CASE("ipc:// and tcp:// carry the serialized wire format", "[process_channel]") {
  const std::string ipc = "ipc://" + unique_name("ipc");
  for (const std::string& uri : {ipc, std::string("tcp://127.0.0.1:*")}) {
    auto receiver = open_or_fail(uri, ChannelRole::kReceiver);
    const bool tcp = uri != ipc;
    if (tcp) {  // a free port, named by the receiver's uri() for its senders
      CHECK_THAT(receiver->uri(), StartsWith("tcp://127.0.0.1:"));
      CHECK(receiver->uri().find('*') == std::string::npos);
    }
    auto sender = open_or_fail(receiver->uri(), ChannelRole::kSender);
    CHECK(receiver->kind() == (tcp ? "zmq-tcp" : "zmq-ipc"));
    round_trip(*sender, *receiver, 5);
    const at::Tensor bytes = at::arange(256, at::kInt).to(at::kByte);
    REQUIRE(sender->send(envelope_of(42, {bytes, at::ones({3, 3}, at::kDouble)})).status.ok());
    auto e = receiver->receive(absl::Now() + absl::Seconds(10));
    REQUIRE(e.has_value());
    CHECK(at::equal(e->tensors[0], bytes));
    CHECK(at::equal(e->tensors[1], at::ones({3, 3}, at::kDouble)));
    CHECK(sender->stats().sent == 6);
    CHECK(receiver->stats().received == 6);
    CHECK(sender->stats().bytes_copied == 0);
  }
  // The ipc:// receiver's socket file goes with it (libzmq 4.3 leaves it).
  const std::string file = fmt::format("{}/blockflow-channels-{}/{}.ipc", blockflow::detail::runtime_root(), ::geteuid(),
                                       ipc.substr(6));
  {
    auto receiver = open_or_fail(ipc, ChannelRole::kReceiver);
    CHECK(std::filesystem::exists(file));
  }
  CHECK_FALSE(std::filesystem::exists(file));
}

TEST_CASE("an ipc:// receiver takes no frame above max_frame_bytes: the sender is cut off, its next envelope comes",
          "[process_channel]") {
  ProcessChannelOptions small;
  small.max_frame_bytes = 1024;
  auto receiver = open_or_fail("ipc://" + unique_name("maxframe"), ChannelRole::kReceiver, small);
  auto sender = open_or_fail(receiver->uri(), ChannelRole::kSender);
  REQUIRE(sender->send(envelope_of(1, {at::zeros({4096}, at::kByte)})).status.ok());  // queued: it goes out
  CHECK_FALSE(receiver->receive(absl::Now() + absl::Seconds(1)).has_value());  // never held here
  REQUIRE(sender->send(envelope_of(2, {at::ones({16}, at::kByte)})).status.ok());
  auto e = receiver->receive(absl::Now() + absl::Seconds(10));
  REQUIRE(e.has_value());
  CHECK(e->request_id == 2);
}

TEST_CASE("cuda:// opens only where CUDA can carry tensors between processes: elsewhere both ends are refused, naming the URI",
          "[process_channel]") {
  // No silent fallback to host memory: a build without CUDA, or a machine without a device, refuses
  // at open(). With a device, the two-process exchange is in tests/tensormq_example_test.py.
  const std::string uri = "cuda://" + unique_name("frames");
  const absl::Status usable = blockflow::detail::cuda_ipc_usable();
  for (const auto role : {ChannelRole::kSender, ChannelRole::kReceiver}) {
    auto ch = open_channel(uri, role);
    if (usable.ok()) {
      REQUIRE(ch.ok());
      CHECK((*ch)->kind() == "cuda");
      CHECK((*ch)->stats().kind == "cuda");
    } else {
      CHECK(ch.status().code() == absl::StatusCode::kFailedPrecondition);
      CHECK_THAT(std::string(ch.status().message()), Contains(uri) && Contains("no CUDA channel here") &&
                                                         Contains(std::string(usable.message())));
    }
  }
}

TEST_CASE("URIs are checked: names, schemes, directories and a URI held by a live receiver", "[process_channel]") {
  const std::string uri = "shm://" + unique_name("held");
  auto receiver = open_or_fail(uri, ChannelRole::kReceiver);
  auto again = open_channel(uri, ChannelRole::kReceiver);
  CHECK(again.status().code() == absl::StatusCode::kAlreadyExists);
  CHECK_THAT(std::string(again.status().message()), Contains(uri));
  const std::string ipc = "ipc://" + unique_name("held");
  auto ipc_receiver = open_or_fail(ipc, ChannelRole::kReceiver);
  CHECK(open_channel(ipc, ChannelRole::kReceiver).status().code() == absl::StatusCode::kAlreadyExists);

  for (const char* bad : {"shm://../etc", "shm://a/b", "shm://", "ipc://-x", "udp://x", "frames", "tcp://host",
                          "tcp://:80", "ipc:///tmp/../x", "cuda://../x", "cuda://"}) {
    auto ch = open_channel(bad, ChannelRole::kSender);
    INFO(bad);
    CHECK(ch.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(ch.status().message()), Contains(bad));
  }
  CHECK_THAT(std::string(open_channel("tcp://127.0.0.1:*", ChannelRole::kSender).status().message()),
             Contains("tcp://HOST:*: receivers only"));

  // ipc:///ABS/PATH: only in a directory of ours closed to others.
  const auto dir = std::filesystem::temp_directory_path() / unique_name("dir");
  std::filesystem::create_directory(dir);
  ::chmod(dir.c_str(), 0755);
  const std::string open_dir = "ipc://" + (dir / "s").string();
  auto refused = open_channel(open_dir, ChannelRole::kReceiver);
  CHECK(refused.status().code() == absl::StatusCode::kPermissionDenied);
  CHECK_THAT(std::string(refused.status().message()), Contains("0700"));
  ::chmod(dir.c_str(), 0700);
  {
    auto ok = open_or_fail(open_dir, ChannelRole::kReceiver);
    auto sender = open_or_fail(open_dir, ChannelRole::kSender);
    round_trip(*sender, *ok, 2);
  }
  test::remove_tree(dir);
}

TEST_CASE("a receive() that waits with no deadline ends when its channel is closed, on every kind", "[process_channel]") {
  for (const std::string& uri : {"shm://" + unique_name("forever"), "ipc://" + unique_name("forever")}) {
    INFO(uri);
    auto receiver = open_or_fail(uri, ChannelRole::kReceiver);
    auto waiting = std::async(std::launch::async, [&] { return receiver->receive(absl::InfiniteFuture()); });
    // Give it time to be waiting (the test holds either way: a close() first ends it at once).
    CHECK(waiting.wait_for(std::chrono::milliseconds(200)) == std::future_status::timeout);
    receiver->close();
    const bool ended = waiting.wait_for(std::chrono::seconds(30)) == std::future_status::ready;
    if (!ended) {  // end it with an envelope, so that the failed test does not hang in the future's destructor
      auto sender = open_or_fail(uri, ChannelRole::kSender, test::no_wait());
      (void)sender->send(envelope_of(1, {at::ones({1})}));
    }
    REQUIRE(ended);
    CHECK_FALSE(waiting.get().has_value());
  }
}

TEST_CASE("envelopes a shm:// receiver never took are counted as dropped at close(), accepted senders or not",
          "[process_channel]") {
  const std::string uri = "shm://" + unique_name("unread");
  auto receiver = open_or_fail(uri, ChannelRole::kReceiver);
  auto sender = open_or_fail(uri, ChannelRole::kSender, test::no_wait());
  for (std::uint64_t i = 0; i < 3; ++i) REQUIRE(sender->send(envelope_of(i, {at::ones({16})})).status.ok());
  receiver->close();  // no receive(): the sender's connection was never accepted
  CHECK(sender->stats().sent == 3);
  CHECK(receiver->stats().received == 0);
  CHECK(receiver->stats().dropped == 3);
}

TEST_CASE("a shm receiver held by a live receiver that accepts nobody now: AlreadyExists at once, never a wait",
          "[process_channel]") {
  const std::string name = unique_name("busy");
  const std::string uri = "shm://" + name;
  auto receiver = open_or_fail(uri, ChannelRole::kReceiver);  // never calls receive(): accepts nobody
  const std::string path =
      fmt::format("{}/blockflow-channels-{}/{}.shm", blockflow::detail::runtime_root(), ::geteuid(), name);
  std::vector<int> pending;  // more connections than its backlog holds
  for (int i = 0; i < 16; ++i) {
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
    const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    REQUIRE(fd >= 0);
    (void)::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address);
    pending.push_back(fd);
  }
  auto again = std::async(std::launch::async, [&] { return open_channel(uri, ChannelRole::kReceiver); });
  const bool answered = again.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  for (const int fd : pending) ::close(fd);  // lets a waiting open() go, should the check fail
  REQUIRE(answered);
  CHECK(again.get().status().code() == absl::StatusCode::kAlreadyExists);
}

TEST_CASE("two receivers opened at once on one URI: exactly one holds it", "[process_channel]") {
  for (int i = 0; i < 50; ++i) {
    const std::string uri = "shm://" + unique_name(fmt::format("race{}", i).c_str());
    std::promise<void> go;
    std::shared_future<void> start = go.get_future().share();
    auto open_when_told = [&] {
      start.wait();
      return open_channel(uri, ChannelRole::kReceiver);
    };
    auto a = std::async(std::launch::async, open_when_told);
    auto b = std::async(std::launch::async, open_when_told);
    go.set_value();
    auto first = a.get();
    auto second = b.get();
    INFO(i << ": " << first.status().ToString() << " / " << second.status().ToString());
    REQUIRE(first.ok() != second.ok());
    CHECK((first.ok() ? second : first).status().code() == absl::StatusCode::kAlreadyExists);
    // The one that holds it is reachable: a sender's message arrives.
    auto sender = open_or_fail(uri, ChannelRole::kSender);
    round_trip(*sender, first.ok() ? **first : **second, 1);
  }
}
