// A shm:// receiver among several senders, some of them misbehaving (process_channel.hpp): a new
// sender is accepted while another streams; a receiver that does not accept never holds a sender's
// connect; a sender that closed still takes its receiver's releases (flush()).
#include "process_channel_util.hpp"

#include <future>
#include <thread>

using namespace blockflow;
using namespace std::chrono_literals;
using Catch::Matchers::Contains;
using test::envelope_of;
using test::no_wait;
using test::open_or_fail;
using test::unique_name;

TEST_CASE("a shm:// receiver accepts a new sender while another keeps envelopes coming", "[process_channel]") {
  const std::string name = unique_name("accept");
  auto receiver = open_or_fail("shm://" + name, ChannelRole::kReceiver);
  auto fast = open_or_fail("shm://" + name, ChannelRole::kSender);
  std::atomic<bool> stop{false};
  std::thread streaming([&] {  // always one envelope ready (its credits bound it)
    for (std::uint64_t i = 0; !stop; ++i) (void)fast->send(envelope_of(i % 100, {at::ones({16})}));
  });
  REQUIRE(receiver->receive(absl::Now() + absl::Seconds(10)).has_value());
  auto late = open_or_fail("shm://" + name, ChannelRole::kSender, no_wait());
  bool sent = false, seen = false;
  for (int i = 0; i < 2000 && !seen; ++i) {
    if (!sent) sent = late->send(envelope_of(999, {at::full({4}, 9.0f)})).status.ok();
    auto e = receiver->receive(absl::Now() + absl::Seconds(10));
    REQUIRE(e.has_value());
    seen = e->request_id == 999;
    std::this_thread::sleep_for(1ms);  // slower than the fast sender
  }
  stop = true;
  while (receiver->receive(absl::Now() + absl::Milliseconds(50))) {
  }
  streaming.join();
  CHECK(sent);
  CHECK(seen);  // before: never accepted while the fast sender had one ready
}

TEST_CASE("a shm:// receiver that does not accept never holds a sender's connect", "[process_channel]") {
  const std::string name = unique_name("backlog");
  auto receiver = open_or_fail("shm://" + name, ChannelRole::kReceiver);  // never receives
  std::vector<std::unique_ptr<ProcessChannel>> senders;
  std::vector<std::future<absl::Status>> sends;
  for (int i = 0; i < 12; ++i) {  // beyond the listener's backlog
    senders.push_back(open_or_fail("shm://" + name, ChannelRole::kSender, no_wait()));
    sends.push_back(std::async(std::launch::async, [&s = *senders.back(), i] {
      return s.send(envelope_of(static_cast<std::uint64_t>(i), {at::ones({4})})).status;
    }));
  }
  int refused = 0;
  for (auto& f : sends) {
    REQUIRE(f.wait_for(10s) == std::future_status::ready);  // before: blocked in connect() for good
    const absl::Status status = f.get();
    if (!status.ok()) {
      ++refused;
      CHECK(status.code() == absl::StatusCode::kUnavailable);
      CHECK_THAT(std::string(status.message()), Contains("shm://" + name));
    }
  }
  CHECK(refused > 0);  // those past the backlog: refused at once (kReject)
}

TEST_CASE("a shm:// sender that closed still takes its receiver's releases: flush() then succeeds", "[process_channel]") {
  const std::string uri = "shm://" + unique_name("closeflush");
  auto sender = open_or_fail(uri, ChannelRole::kSender, no_wait());
  auto receiver = open_or_fail(uri, ChannelRole::kReceiver);
  REQUIRE(sender->send(envelope_of(1, {at::full({16}, 1.0f)})).status.ok());
  auto held = receiver->receive(absl::Now() + absl::Seconds(10));
  REQUIRE(held.has_value());
  sender->close();
  CHECK(sender->flush(absl::Now() + absl::Milliseconds(20)).code() == absl::StatusCode::kDeadlineExceeded);
  held.reset();  // its release goes back on the link
  const absl::Status flushed = sender->flush(absl::Now() + absl::Seconds(10));
  INFO(flushed.ToString());
  CHECK(flushed.ok());  // before: nobody read the release any more
  CHECK(sender->shm_stats().releases == 1);
}
