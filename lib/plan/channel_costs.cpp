// profile_channels(): the hand-off cost of each channel kind on this machine, measured as the hop
// bench does (bench/hop_bench.cpp): one-way latency from a sender thread to a receiver thread (the
// send time rides in request_id; one steady clock), one hand-off at a time, at two sizes; the line
// through the two medians gives fixed_us and us_per_mb.
#include <blockflow/plan/profile.hpp>

#include "percentile.hpp"

#include <blockflow/channel/inproc_channel.hpp>
#include <blockflow/channel/process_channel.hpp>
#include <blockflow/core/detail/clock.hpp>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <thread>

namespace blockflow {
namespace {

constexpr std::size_t kSmall = std::size_t{64} << 10, kLarge = std::size_t{4} << 20;

// Median one-way latency (us) of `n` hand-offs of `bytes` from `make` (the sender's tensor, made
// outside the timed span) through send -> receive.
template <typename Send, typename Receive, typename Make>
absl::StatusOr<double> one_way_us(Send&& send, Receive&& receive, Make&& make, int n) {
  InProcessChannel ack;
  std::vector<double> us;
  // Each thread its own status (the sender's error is the one reported); the flag stops the sender.
  absl::Status send_failed, receive_failed;
  std::atomic<bool> receiver_gone{false};
  std::thread receiver([&] {
    try {
      for (int i = 0; i < n; ++i) {
        auto e = receive();
        if (!e) {
          receive_failed = absl::DeadlineExceededError("nothing arrived within 10 s");
          break;
        }
        us.push_back(static_cast<double>(detail::now_ns() - static_cast<std::int64_t>(e->request_id)) / 1e3);
        e.reset();  // its tensor dies: a slot goes back
        (void)ack.send(Envelope{});
      }
    } catch (const std::exception& e) {  // nothing may escape a thread
      receive_failed = absl::InternalError(fmt::format("receiving: {}", e.what()));
    } catch (...) {
      receive_failed = absl::InternalError("receiving: a non-standard exception");
    }
    receiver_gone = !receive_failed.ok();
    if (receiver_gone) (void)ack.send(Envelope{});
  });
  try {  // and nothing may unwind past a joinable thread
    for (int i = 0; i < n && !receiver_gone; ++i) {
      auto t = make();
      if (!t.ok()) {
        send_failed = t.status();
        break;
      }
      Envelope e;
      e.tensors = {*std::move(t)};
      e.request_id = static_cast<std::uint64_t>(detail::now_ns());
      if (auto out = send(std::move(e)); !out.ok()) {
        send_failed = out;
        break;
      }
      (void)ack.receive(absl::Now() + absl::Seconds(20));
    }
  } catch (const std::exception& e) {
    send_failed = absl::InternalError(fmt::format("sending: {}", e.what()));
  } catch (...) {
    send_failed = absl::InternalError("sending: a non-standard exception");
  }
  receiver.join();
  if (!send_failed.ok()) return send_failed;
  if (!receive_failed.ok()) return receive_failed;
  us.erase(us.begin(), us.begin() + static_cast<std::ptrdiff_t>(us.size() / 5));  // warm-up
  return detail::percentile(us, 0.5);
}

absl::StatusOr<ChannelCost> fit(const std::string& kind, absl::StatusOr<double> small_us, absl::StatusOr<double> large_us) {
  if (!small_us.ok()) return absl::Status(small_us.status().code(), kind + ": " + std::string(small_us.status().message()));
  if (!large_us.ok()) return absl::Status(large_us.status().code(), kind + ": " + std::string(large_us.status().message()));
  ChannelCost c;
  c.kind = kind;
  const double mb_small = static_cast<double>(kSmall) / 1048576.0, mb_large = static_cast<double>(kLarge) / 1048576.0;
  c.us_per_mb = std::max(0.0, (*large_us - *small_us) / (mb_large - mb_small));
  c.fixed_us = std::max(0.0, *small_us - c.us_per_mb * mb_small);
  return c;
}

}  // namespace

absl::StatusOr<std::vector<ChannelCost>> profile_channels(const ProfileOptions& options) {
  const int n = options.quick ? 20 : 200;
  std::vector<ChannelCost> out;
  auto report = [&](const ChannelCost& c) {
    out.push_back(c);
    if (options.progress) {
      options.progress(fmt::format("channel {}: {:.1f} us + {:.1f} us/MB", c.kind, c.fixed_us, c.us_per_mb));
    }
  };
  {
    InProcessChannel channel;
    auto send = [&](Envelope&& e) { return channel.send(std::move(e)).status; };
    auto receive = [&] { return channel.receive(absl::Now() + absl::Seconds(10)); };
    auto make = [](std::size_t bytes) {
      return [bytes]() -> absl::StatusOr<at::Tensor> { return at::empty({static_cast<std::int64_t>(bytes)}, at::kByte); };
    };
    auto c = fit("inproc", one_way_us(send, receive, make(kSmall), n), one_way_us(send, receive, make(kLarge), n));
    if (!c.ok()) return c.status();
    report(*c);
  }
  for (const auto& [kind, scheme] : {std::pair<std::string, std::string>{"shm", "shm"}, {"zmq-ipc", "ipc"}}) {
    const std::string uri = fmt::format("{}://blockflow-profile-{}-{}", scheme, ::getpid(), kind);
    auto receiver = open_channel(uri, ChannelRole::kReceiver);
    if (!receiver.ok()) return receiver.status();
    auto sender = open_channel(uri, ChannelRole::kSender);
    if (!sender.ok()) return sender.status();
    auto send = [&](Envelope&& e) { return (*sender)->send(std::move(e)).status; };
    auto receive = [&] { return (*receiver)->receive(absl::Now() + absl::Seconds(10)); };
    auto make = [&](std::size_t bytes) {
      // The producer's tensor made where the channel wants it (a slot over shm): its writing is
      // the producer's work, not the hand-off's.
      return [&, bytes]() { return (*sender)->empty({static_cast<std::int64_t>(bytes)}, at::kByte); };
    };
    auto c = fit(kind, one_way_us(send, receive, make(kSmall), n), one_way_us(send, receive, make(kLarge), n));
    if (!c.ok()) return c.status();
    report(*c);
  }
  return out;
}

}  // namespace blockflow
