#pragma once
// Helpers of the ProcessChannel tests (process_channel.hpp): both ends opened in this process.
#include "test_util.hpp"

#include <blockflow/channel/process_channel.hpp>

#include <fmt/format.h>

#include <unistd.h>

namespace blockflow::test {

/// A channel name no other test of this process uses: "pc-TAG-PID-N".
inline std::string unique_name(const char* tag) {
  static std::atomic<int> n{0};
  return fmt::format("pc-{}-{}-{}", tag, ::getpid(), ++n);
}

/// Opens the `role` end of `uri`; fails the test with the status otherwise.
inline std::unique_ptr<ProcessChannel> open_or_fail(const std::string& uri, ChannelRole role, ProcessChannelOptions o = {}) {
  auto ch = open_channel(uri, role, o);
  INFO(uri << ": " << ch.status());
  REQUIRE(ch.ok());
  return *std::move(ch);
}

/// Options of a sender that never waits (FullPolicy::kReject).
inline ProcessChannelOptions no_wait() {
  ProcessChannelOptions o;
  o.full_policy = FullPolicy::kReject;
  return o;
}

/// An envelope with request id `id`, node id % 7 and `tensors`.
inline Envelope envelope_of(std::uint64_t id, Tensors tensors) {
  Envelope e;
  e.request_id = id;
  e.node = static_cast<std::uint32_t>(id % 7);
  e.tensors = std::move(tensors);
  return e;
}

/// Sends `count` envelopes of one float tensor [2, 3] made by the sender's empty(), holding
/// id*10 + 0..5, receives them, and checks ids, nodes and values.
inline void round_trip(ProcessChannel& sender, ProcessChannel& receiver, int count) {
  for (int i = 0; i < count; ++i) {
    auto t = sender.empty({2, 3});
    REQUIRE(t.ok());
    t->copy_(at::arange(6, at::kFloat).reshape({2, 3}) + 10.0 * i);
    auto out = sender.send(envelope_of(static_cast<std::uint64_t>(i), {*t}));
    INFO(out.status);
    REQUIRE(out.status.ok());
  }
  for (int i = 0; i < count; ++i) {
    auto e = receiver.receive(absl::Now() + absl::Seconds(10));
    REQUIRE(e.has_value());
    CHECK(e->request_id == static_cast<std::uint64_t>(i));
    CHECK(e->node == static_cast<std::uint32_t>(i % 7));
    REQUIRE(e->tensors.size() == 1);
    CHECK(e->tensors[0].sizes() == at::IntArrayRef({2, 3}));
    CHECK(at::equal(e->tensors[0], at::arange(6, at::kFloat).reshape({2, 3}) + 10.0 * i));
  }
}

}  // namespace blockflow::test
