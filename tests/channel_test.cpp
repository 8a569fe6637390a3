// InProcessChannel: ordering, the three full policies, close semantics, zero copy.
#include "test_util.hpp"

#include <atomic>
#include <thread>

using namespace blockflow;

namespace {

Envelope envelope_with(std::uint64_t id, Tensor t = at::ones({2})) {
  Envelope e;
  e.request_id = id;
  e.tensors = {std::move(t)};
  return e;
}

InProcessChannel make_channel(std::size_t capacity, FullPolicy policy) {
  InProcessChannelOptions options;
  options.capacity = capacity;
  options.full_policy = policy;
  return InProcessChannel(options);
}

}  // namespace

TEST_CASE("in-process channel delivers in FIFO order and moves references, not bytes", "[channel]") {
  InProcessChannel channel;
  const Tensor big = at::rand({1024, 1024});
  auto out = channel.send(envelope_with(1, big));
  REQUIRE(out.status.ok());
  REQUIRE(channel.send(envelope_with(2)).status.ok());
  auto first = channel.receive(absl::InfiniteFuture());
  REQUIRE(first.has_value());
  CHECK(first->request_id == 1);
  CHECK(first->tensors.at(0).data_ptr() == big.data_ptr());  // the same storage: nothing copied
  CHECK(first->sent_ns > 0);
  CHECK(channel.receive(absl::InfiniteFuture())->request_id == 2);
  const auto stats = channel.stats();
  CHECK(stats.kind == "inproc");
  CHECK(stats.sent == 2);
  CHECK(stats.received == 2);
  CHECK(stats.bytes_copied == 0);
  CHECK(stats.depth == 0);
  CHECK(stats.high_watermark == 2);
}

TEST_CASE("receive times out on an empty channel", "[channel]") {
  InProcessChannel channel;
  CHECK_FALSE(channel.receive(absl::Now() + absl::Milliseconds(5)).has_value());
}

TEST_CASE("reject policy refuses the new envelope and hands it back", "[channel]") {
  auto channel = make_channel(2, FullPolicy::kReject);
  REQUIRE(channel.send(envelope_with(1)).status.ok());
  REQUIRE(channel.send(envelope_with(2)).status.ok());
  auto outcome = channel.send(envelope_with(3));
  CHECK(absl::IsResourceExhausted(outcome.status));
  REQUIRE(outcome.displaced.has_value());
  CHECK(outcome.displaced->request_id == 3);
  CHECK(channel.stats().rejected == 1);
  CHECK(channel.receive(absl::InfiniteFuture())->request_id == 1);
}

TEST_CASE("drop-oldest policy evicts the oldest envelope and accepts the new one", "[channel]") {
  auto channel = make_channel(2, FullPolicy::kDropOldest);
  REQUIRE(channel.send(envelope_with(1)).status.ok());
  REQUIRE(channel.send(envelope_with(2)).status.ok());
  auto outcome = channel.send(envelope_with(3));
  CHECK(outcome.status.ok());
  REQUIRE(outcome.displaced.has_value());
  CHECK(outcome.displaced->request_id == 1);
  CHECK(channel.receive(absl::InfiniteFuture())->request_id == 2);
  CHECK(channel.receive(absl::InfiniteFuture())->request_id == 3);
  CHECK(channel.stats().dropped == 1);
}

TEST_CASE("block policy makes the sender wait until a receiver makes room", "[channel]") {
  auto channel = make_channel(1, FullPolicy::kBlock);
  REQUIRE(channel.send(envelope_with(1)).status.ok());
  std::atomic<bool> sent{false};
  absl::Status status;  // Catch2 assertions are not thread-safe: check after join()
  std::thread sender([&] {
    status = channel.send(envelope_with(2)).status;
    sent = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  CHECK_FALSE(sent.load());  // still waiting: the queue is full
  CHECK(channel.receive(absl::InfiniteFuture())->request_id == 1);
  sender.join();
  CHECK(sent.load());
  CHECK(status.ok());
  CHECK(channel.receive(absl::InfiniteFuture())->request_id == 2);
}

TEST_CASE("close wakes a blocked sender and a blocked receiver; drain returns what is left", "[channel]") {
  auto channel = make_channel(1, FullPolicy::kBlock);
  REQUIRE(channel.send(envelope_with(1)).status.ok());
  SendOutcome blocked_outcome;
  std::thread sender([&] { blocked_outcome = channel.send(envelope_with(2)); });
  InProcessChannel empty;
  std::optional<Envelope> received = envelope_with(99);
  std::thread receiver([&] { received = empty.receive(absl::InfiniteFuture()); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  channel.close();
  empty.close();
  sender.join();
  receiver.join();
  CHECK(absl::IsCancelled(blocked_outcome.status));
  REQUIRE(blocked_outcome.displaced.has_value());
  CHECK(blocked_outcome.displaced->request_id == 2);
  CHECK_FALSE(received.has_value());
  CHECK_FALSE(channel.receive(absl::InfiniteFuture()).has_value());  // closed: no more deliveries
  auto left = channel.drain();
  REQUIRE(left.size() == 1);
  CHECK(left[0].request_id == 1);
  CHECK(absl::IsCancelled(channel.send(envelope_with(3)).status));
  const ChannelStats stats = channel.stats();  // what drain() took out counts as received
  CHECK(stats.sent == 1);
  CHECK(stats.received == 1);
  CHECK(stats.depth == 0);
}

TEST_CASE("drain() of an open channel makes room: a sender waiting on a full channel goes on", "[channel]") {
  auto channel = make_channel(1, FullPolicy::kBlock);
  REQUIRE(channel.send(envelope_with(1)).status.ok());
  SendOutcome outcome;
  std::thread sender([&] { outcome = channel.send(envelope_with(2)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the sender waits for room (or, rarely, has not come yet)
  auto left = channel.drain();
  sender.join();  // without the wake-up it waits for ever
  CHECK(outcome.status.ok());
  REQUIRE(left.size() == 1);
  CHECK(left[0].request_id == 1);
  auto next = channel.try_receive();
  REQUIRE(next.has_value());
  CHECK(next->request_id == 2);
}

TEST_CASE("many producers and consumers: every envelope is received exactly once", "[channel]") {
  auto channel = make_channel(8, FullPolicy::kBlock);
  constexpr int kProducers = 4, kPerProducer = 2000;
  std::vector<std::atomic<int>> seen(kProducers * kPerProducer);
  std::vector<std::thread> threads;
  std::atomic<int> send_failures{0};
  for (int p = 0; p < kProducers; ++p) {
    threads.emplace_back([&, p] {
      for (int i = 0; i < kPerProducer; ++i) {
        if (!channel.send(envelope_with(static_cast<std::uint64_t>(p * kPerProducer + i))).status.ok()) ++send_failures;
      }
    });
  }
  std::atomic<int> received{0};
  for (int c = 0; c < 2; ++c) {
    threads.emplace_back([&] {
      while (auto e = channel.receive(absl::InfiniteFuture())) {
        seen[e->request_id].fetch_add(1);
        if (received.fetch_add(1) + 1 == kProducers * kPerProducer) channel.close();
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(send_failures.load() == 0);
  for (auto& s : seen) REQUIRE(s.load() == 1);
}

TEST_CASE("exchange on a full queue takes the oldest as it queues, in one step; send_past_capacity passes the bound",
          "[channel]") {
  auto channel = make_channel(2, FullPolicy::kBlock);
  std::optional<Envelope> oldest;
  // Not full: queued, nothing taken.
  REQUIRE(channel.exchange(envelope_with(1), oldest).status.ok());
  CHECK_FALSE(oldest.has_value());
  REQUIRE(channel.send(envelope_with(2)).status.ok());
  // Full: 1 comes out, 3 goes in; the depth stays at the bound.
  REQUIRE(channel.exchange(envelope_with(3), oldest).status.ok());
  REQUIRE(oldest.has_value());
  CHECK(oldest->request_id == 1);
  CHECK(channel.stats().depth == 2);
  CHECK(channel.stats().high_watermark == 2);
  // Past the bound: queued at once, counted; a sender that waits for room waits until under it.
  REQUIRE(channel.send_past_capacity(envelope_with(4)).status.ok());
  auto stats = channel.stats();
  CHECK(stats.depth == 3);
  CHECK(stats.past_capacity == 1);
  CHECK(stats.high_watermark == 3);
  auto refused = channel.send_past_capacity(envelope_with(9), 3);  // 3 queued: the limit
  CHECK(absl::IsResourceExhausted(refused.status));
  REQUIRE(refused.displaced.has_value());
  CHECK(refused.displaced->request_id == 9);
  CHECK(channel.stats().depth == 3);
  CHECK(absl::IsDeadlineExceeded(channel.send(envelope_with(5), absl::Now()).status));
  CHECK(channel.receive(absl::Now())->request_id == 2);
  CHECK(absl::IsDeadlineExceeded(channel.send(envelope_with(5), absl::Now()).status));  // 2 queued: still full
  CHECK(channel.receive(absl::Now())->request_id == 3);
  CHECK(channel.send(envelope_with(5), absl::Now()).status.ok());
  CHECK(channel.receive(absl::Now())->request_id == 4);
  CHECK(channel.receive(absl::Now())->request_id == 5);
  REQUIRE(channel.send_past_capacity(envelope_with(8)).status.ok());  // room: not past the bound
  CHECK(channel.stats().past_capacity == 1);
  CHECK(channel.receive(absl::Now())->request_id == 8);
  // Closed: nothing taken, the envelope comes back.
  channel.close();
  oldest.reset();
  auto outcome = channel.exchange(envelope_with(6), oldest);
  CHECK(absl::IsCancelled(outcome.status));
  REQUIRE(outcome.displaced.has_value());
  CHECK(outcome.displaced->request_id == 6);
  CHECK_FALSE(oldest.has_value());
  CHECK(absl::IsCancelled(channel.send_past_capacity(envelope_with(7)).status));
}
