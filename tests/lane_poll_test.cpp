// SessionOptions::poll_lane: one lane polls for work and never sleeps, so a request that reaches an
// idle session starts without a wake-up; lanes' sleeps are counted (LaneMetrics::sleeps).
#include "test_util.hpp"

#include <nlohmann/json.hpp>

using namespace blockflow;
using namespace std::chrono_literals;

TEST_CASE("poll_lane: lane 0 polls for work and never sleeps; without it, idle lanes sleep", "[lanes]") {
  const bool poll = GENERATE(true, false);
  SessionOptions options;
  options.lanes = 2;
  options.poll_lane = poll;
  // Lane 0's sleeps, and all lanes', after start() and after the requests.
  std::uint64_t first_after_start = 0, first_after_requests = 0, all_after_start = 0, all_after_requests = 0, runs = 0;
  auto all_sleeps = [](const MetricsSnapshot& m) {
    std::uint64_t n = 0;
    for (const auto& lane : m.lanes) n += lane.sleeps;
    return n;
  };
  {
    Session session(options);
    session.add_block(test::unary("b", [](const Tensor& x) { return x + 1; })).add_path(Path::chain("t", {"b"}));
    test::require_started(session);
    std::this_thread::sleep_for(20ms);  // lane 1 is past its spin, asleep
    const MetricsSnapshot started = session.metrics();
    REQUIRE(started.lanes.size() == 2);
    first_after_start = started.lanes[0].sleeps;
    all_after_start = all_sleeps(started);
    constexpr int kRequests = 10;
    for (int i = 0; i < kRequests; ++i) {
      std::this_thread::sleep_for(20ms);  // the lanes are idle between requests, far beyond their spin
      CHECK(session.submit("t", at::full({1}, static_cast<float>(i))).get().output().item<float>() == i + 1.0f);
    }
    const MetricsSnapshot m = session.metrics();
    REQUIRE(m.lanes.size() == 2);
    first_after_requests = m.lanes[0].sleeps;
    all_after_requests = all_sleeps(m);
    for (const auto& lane : m.lanes) runs += lane.runs;
    CHECK(runs == kRequests);
    const auto json = nlohmann::json::parse(m.to_json());
    CHECK(json.at("lanes").at(0).at("sleeps").get<std::uint64_t>() == first_after_requests);
  }  // shutdown() ends the polling lane too
  INFO("poll_lane " << poll);
  if (poll) {
    CHECK(first_after_start == 0);
    CHECK(first_after_requests == 0);
    CHECK(all_after_requests == all_after_start);  // nor is lane 1 woken for what the polling lane takes
  } else {
    CHECK(all_after_requests >= all_after_start + 5);  // the lanes slept between requests
  }
}
