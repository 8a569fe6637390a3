// A zmq worker's replies on their way to its one PUSH socket (lib/worker/worker_replies.hpp): the
// thread that hands a reply in sends it itself when it may, and replies keep the order in which
// they were handed in, whoever sends them.
#include "../lib/worker/worker_replies.hpp"

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <thread>

using blockflow::detail::Reply;
using blockflow::detail::ReplyQueue;

namespace reply_queue_test {

Reply numbered(std::uint64_t n) {
  blockflow::wire::Header h;
  h.request_id = n;
  return Reply(h);
}

// What a sending thread's socket saw: each reply's number and the thread that sent it.
struct Sink {
  std::mutex mu;
  std::vector<std::pair<std::uint64_t, std::thread::id>> sent;
  std::chrono::microseconds each{0};
  std::atomic<bool> full{false};  // a socket that would block: only a send that waits goes through
  ReplyQueue::Send send() {
    return [this](Reply& r, bool wait) {
      if (!wait && full.load()) return false;
      if (each.count() > 0) std::this_thread::sleep_for(each);
      std::lock_guard lock(mu);
      sent.emplace_back(r.header.request_id, std::this_thread::get_id());
      return true;
    };
  }
  std::vector<std::pair<std::uint64_t, std::thread::id>> taken() {
    std::lock_guard lock(mu);
    return sent;
  }
};

// The thread that owns the socket; started() returns once it has attached it and sent one reply
// (numbered kWarm), with nothing pending.
constexpr std::uint64_t kWarm = 1'000'000'000;
struct SendingThread {
  ReplyQueue& replies;
  std::thread thread;
  SendingThread(ReplyQueue& r, Sink& sink) : replies(r) {
    thread = std::thread([this, &sink] {
      replies.attach(sink.send());
      while (replies.send_next()) {
      }
      replies.detach();
    });
  }
  bool started() {
    replies.push(numbered(kWarm));  // queued until the socket is attached, or sent at once
    for (int i = 0; i < 5000 && replies.pending() != 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return replies.pending() == 0;
  }
  void finish() {
    replies.close();
    thread.join();
  }
  ~SendingThread() {  // a failed REQUIRE leaves it running
    if (thread.joinable()) finish();
  }
};

}  // namespace reply_queue_test

TEST_CASE("a reply goes from the thread that hands it in while the socket takes it at once, else through the "
          "sending thread; in order either way", "[worker]") {
  const bool full = GENERATE(false, true);  // a socket that would block: only the sending thread waits for it
  reply_queue_test::Sink sink;
  ReplyQueue replies;
  reply_queue_test::SendingThread sender(replies, sink);
  const std::thread::id sending_thread = sender.thread.get_id();
  REQUIRE(sender.started());
  const std::size_t before = sink.taken().size();
  sink.full = full;
  for (std::uint64_t n = 0; n < 50; ++n) replies.push(reply_queue_test::numbered(n));
  sender.finish();
  const auto sent = sink.taken();
  REQUIRE(sent.size() == before + 50);
  for (std::size_t i = before; i < sent.size(); ++i) {
    CHECK(sent[i].first == i - before);
    CHECK(sent[i].second == (full ? sending_thread : std::this_thread::get_id()));
  }
}

TEST_CASE("replies keep the order they were handed in while the sending thread sends some of them", "[worker]") {
  reply_queue_test::Sink sink;
  sink.each = std::chrono::microseconds(200);  // a slow socket: replies handed in meanwhile queue
  ReplyQueue replies;
  reply_queue_test::SendingThread sender(replies, sink);
  // Three producers, each with its own numbers; a fourth hands in one reply at a time, waiting a
  // little between them, so that some go directly and some through the queue.
  constexpr std::uint64_t kEach = 300;
  std::vector<std::thread> producers;
  for (std::uint64_t p = 0; p < 4; ++p) {
    producers.emplace_back([&, p] {
      for (std::uint64_t n = 0; n < kEach; ++n) {
        replies.push(reply_queue_test::numbered(p * 1'000'000 + n));
        if (p == 3) std::this_thread::sleep_for(std::chrono::microseconds(300));
      }
    });
  }
  for (auto& t : producers) t.join();
  sender.finish();
  const auto sent = sink.taken();
  REQUIRE(sent.size() == 4 * kEach);  // none lost, none twice
  std::vector<std::uint64_t> next(4, 0);
  for (const auto& one : sent) {
    const std::uint64_t p = one.first / 1'000'000;
    REQUIRE(p < 4);
    CHECK(one.first % 1'000'000 == next[p]);  // each producer's replies in its order
    next[p] = one.first % 1'000'000 + 1;
  }
}

TEST_CASE("a reply handed in after close() is dropped, not left waiting", "[worker]") {
  reply_queue_test::Sink sink;
  ReplyQueue replies;
  replies.close();
  replies.push(reply_queue_test::numbered(1));
  CHECK_FALSE(replies.send_next());
  CHECK(sink.taken().empty());
}

TEST_CASE("a send interrupted by a signal is tried again in order; one that fails otherwise is dropped, not thrown",
          "[worker]") {
  ReplyQueue replies;
  std::vector<std::uint64_t> sent, dropped;
  int interrupted = 0;
  // The sending thread's socket: no direct send (so all go through send_next()); the first wait is
  // interrupted (EINTR), reply 3 cannot be sent at all.
  replies.attach([&](Reply& r, bool wait) {
    if (!wait) return false;
    if (interrupted++ == 0) throw zmq::error_t(EINTR);
    if (r.header.request_id == 3) throw std::runtime_error("the socket is gone");
    sent.push_back(r.header.request_id);
    return true;
  }, [&](Reply& r) { dropped.push_back(r.header.request_id); });
  for (std::uint64_t n = 1; n <= 4; ++n) replies.push(reply_queue_test::numbered(n));
  for (int i = 0; i < 5; ++i) REQUIRE_NOTHROW(replies.send_next());
  CHECK(sent == std::vector<std::uint64_t>{1, 2, 4});
  CHECK(dropped == std::vector<std::uint64_t>{3});
  CHECK(replies.pending() == 0);
}
