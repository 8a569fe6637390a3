// The lifetimes of shm:// ends (process_channel.hpp, "lifetimes"): a receiver's tensors outlive it
// and the sender never takes their slots back under them; a receiver that closes stops its senders,
// drops what it had not taken and frees the URI; flush() waits for what the receiver holds, relayed
// tensors included, and not for the sender's own; a relayed tensor stays held for its receiver
// after the sender that relayed it is gone; kReject never waits for room in the receiver's queue;
// the pools of a sender killed with SIGKILL are let go of where its tensors were relayed.
#include "process_channel_util.hpp"
#include "shm_util.hpp"

#include <filesystem>
#include <thread>

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

using namespace blockflow;
using Catch::Matchers::Contains;
using test::envelope_of;
using test::no_wait;
using test::open_or_fail;
using test::round_trip;
using test::unique_name;

namespace {


std::vector<Envelope> receive_n(ProcessChannel& receiver, int n) {
  std::vector<Envelope> out;
  for (int i = 0; i < n; ++i) {
    auto e = receiver.receive(absl::Now() + absl::Seconds(10));
    REQUIRE(e.has_value());
    out.push_back(std::move(*e));
  }
  return out;
}

// A send that is refused because the receiver no longer reads, naming the slots it holds.
void check_refused_for_held(ProcessChannel& sender, std::uint64_t held) {
  auto refused = sender.send(envelope_of(99, {at::full({64}, 99.0f)}));
  CHECK(refused.status.code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(refused.status.message()), Contains("stopped reading"));
  CHECK_THAT(std::string(refused.status.message()), Contains(fmt::format("still holds {} slot(s)", held)));
  CHECK((refused.displaced.has_value() && refused.displaced->request_id == 99));
  CHECK_FALSE(sender.connected());
}

// Sends until the sender has moved on to `receiver` (it does once the old receiver's end closed),
// then takes that envelope from it.
void require_moves_on(ProcessChannel& sender, ProcessChannel& receiver) {
  REQUIRE(test::eventually([&] { return sender.send(envelope_of(50, {at::full({8}, 5.0f)})).status.ok(); }));
  auto e = receiver.receive(absl::Now() + absl::Seconds(10));
  REQUIRE(e.has_value());
  CHECK(e->request_id == 50);
  CHECK(at::equal(e->tensors.at(0), at::full({8}, 5.0f)));
}

// This test binary again, running only the hidden test case `tag`, with `env` added to its
// environment; killed and reaped when this goes.
class ChildTest {
 public:
  ChildTest(const char* tag, const std::string& env) {
    std::vector<std::string> vars{env};
    for (char** e = environ; *e != nullptr; ++e) {
      if (std::string_view(*e).rfind("BLOCKFLOW_TEST_FORK_SERVER=", 0) != 0) vars.emplace_back(*e);
    }
    std::vector<char*> envp;
    for (auto& v : vars) envp.push_back(v.data());
    envp.push_back(nullptr);
    std::string exe = std::filesystem::read_symlink("/proc/self/exe");
    std::string selected = tag;
    std::vector<char*> argv{exe.data(), selected.data(), nullptr};
    posix_spawn_file_actions_t quiet;
    posix_spawn_file_actions_init(&quiet);
    posix_spawn_file_actions_addopen(&quiet, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
    if (::posix_spawn(&pid_, exe.c_str(), &quiet, nullptr, argv.data(), envp.data()) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&quiet);
  }
  ~ChildTest() { kill(); }
  ChildTest(const ChildTest&) = delete;
  ChildTest& operator=(const ChildTest&) = delete;
  pid_t pid() const { return pid_; }
  void kill() {
    if (pid_ <= 0) return;
    (void)::kill(pid_, SIGKILL);
    (void)::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
};

}  // namespace

TEST_CASE("shm:// tensors outlive their receiver: the sender takes nothing back under them, then moves on",
          "[process_channel]") {
  const std::string uri = "shm://" + unique_name("outlive");
  auto sender = open_or_fail(uri, ChannelRole::kSender, no_wait());
  std::vector<Envelope> kept;
  {
    auto first = open_or_fail(uri, ChannelRole::kReceiver);
    for (int i = 0; i < 3; ++i) REQUIRE(sender->send(envelope_of(i, {at::full({64}, float(i))})).status.ok());
    kept = receive_n(*first, 3);
  }
  auto second = open_or_fail(uri, ChannelRole::kReceiver);  // the URI is free once the first has gone
  check_refused_for_held(*sender, 3);
  CHECK(sender->shm_stats().reclaims == 0);
  CHECK(sender->shm_stats().slots_in_use == 3);
  for (int i = 0; i < 3; ++i) CHECK(at::equal(kept[i].tensors[0], at::full({64}, float(i))));

  kept.clear();  // their releases go back on the old link, which then closes
  require_moves_on(*sender, *second);
  round_trip(*sender, *second, 4);
  CHECK(test::eventually([&] { return sender->shm_stats().slots_in_use == 0; }));
  // The three kept, the refused one's slot (given back unsent), the one that moved on, the round trip.
  CHECK(sender->shm_stats().releases == 3 + 1 + 1 + 4);
  CHECK(sender->shm_stats().reclaims == 0);
  CHECK(sender->shm_stats().stale_releases == 0);
}

TEST_CASE("a shm:// receiver that closes drops what it had not taken, stops its senders and frees the URI",
          "[process_channel]") {
  const std::string uri = "shm://" + unique_name("close");
  auto sender = open_or_fail(uri, ChannelRole::kSender, no_wait());
  auto receiver = open_or_fail(uri, ChannelRole::kReceiver);
  for (int i = 0; i < 3; ++i) REQUIRE(sender->send(envelope_of(i, {at::full({64}, float(i))})).status.ok());
  auto taken = receiver->receive(absl::Now() + absl::Seconds(10));
  REQUIRE(taken.has_value());
  CHECK(taken->request_id == 0);

  receiver->close();
  CHECK(receiver->stats().dropped == 2);
  CHECK_FALSE(receiver->receive(absl::Now() + absl::Milliseconds(20)).has_value());
  CHECK(test::eventually([&] { return sender->shm_stats().slots_in_use == 1; }));  // the two dropped came back
  check_refused_for_held(*sender, 1);
  auto next = open_or_fail(uri, ChannelRole::kReceiver);  // while the closed one still exists
  CHECK(at::equal(taken->tensors[0], at::full({64}, 0.0f)));

  taken.reset();
  require_moves_on(*sender, *next);
  CHECK(sender->shm_stats().reclaims == 0);
  CHECK(sender->shm_stats().stale_releases == 0);
}

TEST_CASE("shm:// flush() waits for what the receiver holds, not for the sender's own tensors", "[process_channel]") {
  const std::string uri = "shm://" + unique_name("flush");
  auto sender = open_or_fail(uri, ChannelRole::kSender, no_wait());
  auto receiver = open_or_fail(uri, ChannelRole::kReceiver);
  auto own = sender->empty({16});  // leased, never sent
  REQUIRE(own.ok());
  CHECK(sender->flush(absl::Now()).ok());

  REQUIRE(sender->send(envelope_of(1, {at::full({16}, 1.0f)})).status.ok());
  auto held = receiver->receive(absl::Now() + absl::Seconds(10));
  REQUIRE(held.has_value());
  const absl::Status waited = sender->flush(absl::Now() + absl::Milliseconds(20));
  CHECK(waited.code() == absl::StatusCode::kDeadlineExceeded);
  CHECK_THAT(std::string(waited.message()), Contains("1 slot(s) still held"));
  held.reset();
  CHECK(sender->flush(absl::Now() + absl::Seconds(10)).ok());
  CHECK(sender->shm_stats().slots_in_use == 1);  // `own`'s lease
}

TEST_CASE("a tensor relayed over shm:// stays held for its receiver after the relaying sender is gone",
          "[process_channel]") {
  // origin -> middle (a receiver) -> relay (a sender) -> last: the middle hands the origin's slot on
  // unchanged, so the origin must not get it back before `last` lets go of it.
  const std::string in_uri = "shm://" + unique_name("relay-in"), out_uri = "shm://" + unique_name("relay-out");
  auto origin = open_or_fail(in_uri, ChannelRole::kSender, no_wait());
  auto middle = open_or_fail(in_uri, ChannelRole::kReceiver);
  auto last = open_or_fail(out_uri, ChannelRole::kReceiver);
  std::optional<Envelope> at_last;
  {
    auto relay = open_or_fail(out_uri, ChannelRole::kSender, no_wait());
    REQUIRE(origin->send(envelope_of(7, {at::full({32}, 7.0f)})).status.ok());
    {
      auto e = middle->receive(absl::Now() + absl::Seconds(10));
      REQUIRE(e.has_value());
      REQUIRE(relay->send(std::move(*e)).status.ok());
    }
    at_last = last->receive(absl::Now() + absl::Seconds(10));
    REQUIRE(at_last.has_value());
    CHECK(relay->stats().bytes_copied == 0);
    CHECK(relay->shm_stats().forwarded == 1);
    const absl::Status waited = relay->flush(absl::Now() + absl::Milliseconds(20));
    CHECK(waited.code() == absl::StatusCode::kDeadlineExceeded);  // the relayed tensor counts
  }
  CHECK(origin->shm_stats().slots_in_use == 1);  // still held for `last`
  CHECK(at::equal(at_last->tensors[0], at::full({32}, 7.0f)));
  REQUIRE(origin->send(envelope_of(8, {at::full({32}, 8.0f)})).status.ok());  // takes another slot
  CHECK(at::equal(at_last->tensors[0], at::full({32}, 7.0f)));

  at_last.reset();
  // The held tensor goes once `last`'s release is read (by the thread that keeps what gone senders
  // left behind).
  CHECK(test::eventually([&] { return origin->shm_stats().slots_in_use == 1; }));  // envelope 8's slot alone
  CHECK(origin->shm_stats().stale_releases == 0);
}

TEST_CASE("a shm:// sender never waits past its policy for room in the receiver's queue", "[process_channel]") {
  // Envelopes without tensors take no slot: only the receiver's queue can fill.
  auto fill = [](ProcessChannel& sender) {
    absl::Status last;
    int sent = 0;
    for (int i = 0; i < 1000000 && last.ok(); ++i) {
      auto out = sender.send(envelope_of(static_cast<std::uint64_t>(i), {}));
      last = out.status;
      if (last.ok()) ++sent;
    }
    CHECK(sent > 0);
    return last;
  };
  const std::string uri = "shm://" + unique_name("full");
  auto receiver = open_or_fail(uri, ChannelRole::kReceiver);  // never reads until the end
  auto rejecting = open_or_fail(uri, ChannelRole::kSender, no_wait());
  const absl::Status rejected = fill(*rejecting);
  CHECK(rejected.code() == absl::StatusCode::kResourceExhausted);  // at once: it used to wait for room forever
  CHECK_THAT(std::string(rejected.message()), Contains("receive queue is full"));

  const std::string other = "shm://" + unique_name("full");
  auto slow = open_or_fail(other, ChannelRole::kReceiver);
  ProcessChannelOptions o;
  o.send_timeout = absl::Milliseconds(100);
  auto blocking = open_or_fail(other, ChannelRole::kSender, o);
  const absl::Status timed_out = fill(*blocking);
  CHECK(timed_out.code() == absl::StatusCode::kDeadlineExceeded);
  CHECK_THAT(std::string(timed_out.message()), Contains("stayed full"));

  REQUIRE(receiver->receive(absl::Now() + absl::Seconds(10)).has_value());  // room for one more
  CHECK(test::eventually([&] { return rejecting->send(envelope_of(7, {})).status.ok(); }));
}

TEST_CASE("(run by the test below) a shm:// sender sends two tensors of its own, then waits to be killed",
          "[.shm-sender-child]") {
  const char* uri = std::getenv("BLOCKFLOW_TEST_SHM_URI");
  REQUIRE(uri != nullptr);
  ProcessChannelOptions o;
  o.send_timeout = absl::Seconds(30);  // the receiver opens the URI first; this is a margin
  auto sender = open_or_fail(uri, ChannelRole::kSender, o);
  for (int i = 1; i <= 2; ++i) {
    auto t = sender->empty({64});
    REQUIRE(t.ok());
    t->fill_(static_cast<float>(i));
    REQUIRE(sender->send(envelope_of(static_cast<std::uint64_t>(i), {*t})).status.ok());
  }
  std::this_thread::sleep_for(std::chrono::seconds(60));
}

TEST_CASE("a shm:// sender killed with SIGKILL: where its tensors were relayed, its pools are let go of",
          "[process_channel]") {
  // origin (another process) -> middle -> relay -> last. The origin cannot retire its pools when it
  // is killed; the middle sees its link end and does, so `last` drops them too (it looks once a second).
  const std::string in_uri = "shm://" + unique_name("killed-in"), out_uri = "shm://" + unique_name("killed-out");
  auto middle = open_or_fail(in_uri, ChannelRole::kReceiver);
  auto last = open_or_fail(out_uri, ChannelRole::kReceiver);
  auto relay = open_or_fail(out_uri, ChannelRole::kSender, no_wait());
  ChildTest origin("[.shm-sender-child]", "BLOCKFLOW_TEST_SHM_URI=" + in_uri);
  REQUIRE(origin.pid() > 0);
  const std::int64_t origin_pid = origin.pid();
  for (int i = 1; i <= 2; ++i) {
    auto e = middle->receive(absl::Now() + absl::Seconds(30));
    REQUIRE(e.has_value());
    REQUIRE(relay->send(std::move(*e)).status.ok());
    auto at_last = last->receive(absl::Now() + absl::Seconds(10));
    REQUIRE(at_last.has_value());
    CHECK(at::equal(at_last->tensors.at(0), at::full({64}, static_cast<float>(i))));
  }
  CHECK(relay->stats().bytes_copied == 0);
  REQUIRE_FALSE(test::pools_mapped_by(::getpid(), origin_pid).empty());

  origin.kill();
  const bool let_go = test::eventually(
      [&] {
        (void)middle->receive(absl::Now() + absl::Milliseconds(20));  // sees the origin's link end
        (void)last->receive(absl::Now() + absl::Milliseconds(20));
        return test::pools_mapped_by(::getpid(), origin_pid).empty();
      },
      std::chrono::seconds(10));
  CHECK(let_go);  // before: `last` kept them mapped for as long as the relay's link lived
  CHECK(relay->send(envelope_of(3, {at::full({8}, 3.0f)})).status.ok());  // the relay goes on
  auto after = last->receive(absl::Now() + absl::Seconds(10));
  REQUIRE(after.has_value());
  CHECK(after->request_id == 3);
}
