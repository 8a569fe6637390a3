// The zero-copy channels' data link (detail/packet_link.hpp): packets cross whole whatever the
// number of sending threads, malformed packets are rejected naming the problem, a closed peer is
// seen, a receiver out of descriptors says so, and the listener tells who connected.
#include <blockflow/channel/detail/packet_link.hpp>
#include <blockflow/channel/detail/runtime_dir.hpp>
#include <blockflow/channel/detail/tensor_codec.hpp>

#include <ATen/ATen.h>

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

using namespace blockflow::detail;
namespace wire = blockflow::wire;
using Catch::Matchers::Contains;

namespace {

std::vector<std::string> strings_of(const std::vector<zmq::message_t>& frames) {
  std::vector<std::string> out;
  for (const auto& f : frames) out.push_back(f.to_string());
  return out;
}

std::string error_of(const std::string& packet) {
  auto decoded = decode_packet(packet.data(), packet.size());
  REQUIRE_FALSE(decoded.ok());
  CHECK(decoded.status().code() == absl::StatusCode::kInvalidArgument);
  return std::string(decoded.status().message());
}

// While it lives, this process can open no descriptor: every one below the lowest free one is
// taken, and the soft RLIMIT_NOFILE is set there.
class NoDescriptorLeft {
 public:
  NoDescriptorLeft() {
    REQUIRE(::getrlimit(RLIMIT_NOFILE, &before_) == 0);
    const int lowest_free = ::fcntl(0, F_DUPFD_CLOEXEC, 0);
    REQUIRE(lowest_free >= 0);
    ::close(lowest_free);
    rlimit tight = before_;
    tight.rlim_cur = static_cast<rlim_t>(lowest_free);
    REQUIRE(::setrlimit(RLIMIT_NOFILE, &tight) == 0);
  }
  ~NoDescriptorLeft() { (void)::setrlimit(RLIMIT_NOFILE, &before_); }
  NoDescriptorLeft(const NoDescriptorLeft&) = delete;
  NoDescriptorLeft& operator=(const NoDescriptorLeft&) = delete;

 private:
  rlimit before_{};
};

}  // namespace

TEST_CASE("a packet's frames survive encoding, empty frames included", "[link]") {
  const std::string packet = encode_packet({"header", "", std::string(32, '\x7f')});
  CHECK(packet.size() == 4 * 4 + 6 + 32);
  auto frames = decode_packet(packet.data(), packet.size());
  REQUIRE(frames.ok());
  CHECK(strings_of(*frames) == std::vector<std::string>{"header", "", std::string(32, '\x7f')});
}

TEST_CASE("malformed packets are rejected with the problem named", "[link]") {
  CHECK_THAT(error_of("ab"), Contains("shorter than its frame count"));
  CHECK_THAT(error_of(std::string(4, '\0')), Contains("packet with 0 frames"));
  CHECK_THAT(error_of(std::string("\xff\xff\xff\xff", 4)), Contains("packet with 4294967295 frames"));
  std::string truncated = encode_packet({"abc", "defg"});
  CHECK_THAT(error_of(truncated.substr(0, 8)), Contains("truncated frame table"));
  CHECK_THAT(error_of(truncated.substr(0, truncated.size() - 1)), Contains("its frame table adds up to 19"));
  CHECK_THAT(error_of(truncated + "x"), Contains("packet of 20 bytes"));
  std::string huge = encode_packet({"abc"});
  huge[4] = '\xff';
  huge[7] = '\x7f';  // one frame claiming ~2 GB
  CHECK_THAT(error_of(huge), Contains("adds up to"));
}

TEST_CASE("packets from several threads arrive whole, each exactly once", "[link]") {
  auto ends = PacketLink::pair();
  REQUIRE(ends.ok());
  auto [a, b] = *ends;
  constexpr int kThreads = 4, kEach = 500;
  std::vector<std::thread> senders;
  for (int t = 0; t < kThreads; ++t) {
    senders.emplace_back([t, a = a] {
      for (int i = 0; i < kEach; ++i) {
        const std::string id = std::to_string(t * kEach + i);
        // Frame 2 repeats the id, so a packet torn or mixed with another's would show.
        if (!a->send({id, std::string(200 + i % 300, static_cast<char>('a' + t)), id}).ok()) std::abort();
      }
    });
  }
  std::set<std::string> seen;
  while (seen.size() < kThreads * kEach) {
    auto received = b->receive(5000);
    REQUIRE(received.has_value());
    REQUIRE_FALSE(received->closed);
    REQUIRE(received->frames.ok());
    const auto frames = strings_of(*received->frames);
    REQUIRE(frames.size() == 3);
    REQUIRE(frames[0] == frames[2]);
    const int n = std::stoi(frames[0]);
    CHECK(frames[1] == std::string(200 + (n % kEach) % 300, static_cast<char>('a' + n / kEach)));
    CHECK(seen.insert(frames[0]).second);
  }
  for (auto& s : senders) s.join();
  CHECK_FALSE(b->receive(0).has_value());  // nothing more
}

TEST_CASE("a link spins only while packets come in a stream: packets 5 ms apart make it sleep at once",
          "[link]") {
  auto ends = PacketLink::pair();
  REQUIRE(ends.ok());
  auto [a, b] = *ends;
  CHECK(b->mean_gap_ns() >= std::int64_t{1} << 40);  // no gap seen yet: not a stream
  for (int i = 0; i < 4; ++i) {
    REQUIRE(a->send({"tick"}).ok());
    auto got = b->receive(1000, absl::Microseconds(50));
    REQUIRE(got.has_value());
    REQUIRE(got->frames.ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // Each gap is at least the 5 ms sleep: far above the 4 x 50 us a stream would need.
  CHECK(b->mean_gap_ns() >= 5'000'000);
  CHECK(b->mean_gap_ns() >= PacketLink::kStreamGapFactor * 50'000);
}

TEST_CASE("an oversized packet is refused before it is sent; a closed peer is seen", "[link]") {
  auto ends = PacketLink::pair();
  REQUIRE(ends.ok());
  auto [a, b] = *ends;
  const std::string big(kMaxPacketBytes, 'x');
  auto status = a->send({big});
  CHECK(status.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(status.message()), Contains("exceeds"));
  CHECK_FALSE(b->receive(50).has_value());  // timed out, nothing arrived
  a.reset();
  ends->first.reset();  // the last reference: the socket closes
  auto closed = b->receive(1000);
  REQUIRE(closed.has_value());
  CHECK(closed->closed);
  CHECK(b->send({"to nobody"}).code() == absl::StatusCode::kUnavailable);
}

TEST_CASE("a receiver with no descriptor left for what a packet carries says so, naming its limit, and stops reading",
          "[link]") {
  auto ends = PacketLink::pair();
  REQUIRE(ends.ok());
  auto [a, b] = *ends;
  const int carried = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  REQUIRE(carried >= 0);
  auto keep = std::make_shared<int>(0);
  REQUIRE(a->send({"with a descriptor"}, true, {7}, [&](std::uint64_t key) { return LinkFd{key, carried, keep}; }).ok());
  ::close(carried);
  std::optional<PacketLink::Received> received;
  {
    NoDescriptorLeft none;
    received = b->receive(1000);
  }
  REQUIRE(received.has_value());
  REQUIRE_FALSE(received->frames.ok());
  const std::string message(received->frames.status().message());
  CHECK_THAT(message, Contains("did not all arrive"));
  CHECK_THAT(message, Contains("RLIMIT_NOFILE"));
  // The receiver stopped reading: the sender's next packet fails.
  CHECK(a->send({"more"}, false).code() == absl::StatusCode::kUnavailable);
}

TEST_CASE("a listener with no descriptor left for a connection says why and backs off; it takes it later",
          "[link]") {
  auto dir = make_private_dir("linktest");
  REQUIRE(dir.ok());
  auto listener = PacketListener::bind(*dir + "/data");
  REQUIRE(listener.ok());
  auto client = PacketLink::connect(*dir + "/data");
  REQUIRE(client.ok());
  {
    NoDescriptorLeft none;
    CHECK_FALSE((*listener)->accept().has_value());
  }
  const absl::Status why = (*listener)->error();
  CHECK(why.code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(why.message()), Contains(*dir + "/data"));
  CHECK_THAT(std::string(why.message()), Contains("RLIMIT_NOFILE"));
  // The connection is still pending: polling the listener would not wait, so it is left alone.
  CHECK((*listener)->poll_fd() == -1);
  CHECK_FALSE((*listener)->accept().has_value());  // backing off: not tried
  std::this_thread::sleep_for(std::chrono::nanoseconds(PacketListener::kAcceptBackoffNs));
  CHECK((*listener)->poll_fd() == (*listener)->fd());
  auto accepted = (*listener)->accept();
  REQUIRE(accepted.has_value());
  CHECK(accepted->peer_pid == ::getpid());
  CHECK((*listener)->error().ok());
}

TEST_CASE("the listener names the connecting process; a missing path is named", "[link]") {
  auto dir = make_private_dir("linktest");
  REQUIRE(dir.ok());
  auto listener = PacketListener::bind(*dir + "/data");
  REQUIRE(listener.ok());
  CHECK_FALSE((*listener)->accept().has_value());  // nobody yet; never waits
  auto client = PacketLink::connect(*dir + "/data");
  REQUIRE(client.ok());
  auto accepted = (*listener)->accept();
  REQUIRE(accepted.has_value());
  CHECK(accepted->peer_pid == ::getpid());
  REQUIRE((*client)->send({"hello"}).ok());
  auto received = accepted->link->receive(1000);
  REQUIRE(received.has_value());
  REQUIRE(received->frames.ok());
  CHECK(strings_of(*received->frames) == std::vector<std::string>{"hello"});
  auto missing = PacketLink::connect(*dir + "/nothing-here");
  REQUIRE_FALSE(missing.ok());
  CHECK_THAT(std::string(missing.status().message()), Contains("nothing-here"));
  listener->reset();
  remove_private_dir(*dir);
}
