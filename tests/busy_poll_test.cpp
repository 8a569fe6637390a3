// WorkerOptions::busy_poll: the data link's receivers poll instead of sleeping.
#include "worker_util.hpp"

#include <blockflow/worker/worker_site.hpp>

#include <catch2/catch.hpp>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

using namespace blockflow;
using Catch::Matchers::Contains;

namespace {

// voluntary_ctxt_switches of the thread of this process named `comm` (-1: none such): a thread that
// sleeps in poll() for a packet makes one each time it sleeps, a polling thread none.
long busy_poll_voluntary_switches(const std::string& comm) {
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream name_file(task.path() / "comm");
    std::string name;
    std::getline(name_file, name);
    if (name != comm) continue;
    std::ifstream status(task.path() / "status");
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("voluntary_ctxt_switches:", 0) == 0) return std::stol(line.substr(line.find(':') + 1));
    }
  }
  return -1;
}

}  // namespace

TEST_CASE("WorkerOptions::busy_poll: the session's receiver takes a worker's results without sleeping; a killed worker "
          "comes back",
          "[shm]") {
  for (const bool busy : {false, true}) {
    DYNAMIC_SECTION("busy_poll " << busy) {
      WorkerOptions options = test::test_worker("w1", "shm");
      options.busy_poll = busy;
      auto site = make_worker(options);
      Session session;
      session.add_site(site).add_block(test::plugin_block("affine", "affine", "w1")).add_path(Path::chain("t", {"affine"}));
      test::require_started(session);
      // Requests 5 ms apart: a receiver that sleeps between results sleeps once per result at least.
      constexpr int kRequests = 40;
      const long before = busy_poll_voluntary_switches("bf-w1:rcv");
      REQUIRE(before >= 0);
      for (int i = 0; i < kRequests; ++i) {
        Result r = session.submit("t", at::full({4}, static_cast<double>(i))).get();
        REQUIRE(r.ok());
        CHECK(r.output()[3].item<double>() == 3.0 * i + 1.0);  // affine: x * 3 + 1
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      const long switches = busy_poll_voluntary_switches("bf-w1:rcv") - before;
      INFO("the receiver thread's voluntary context switches over " << kRequests << " results: " << switches);
      if (busy) {
        // It may still sleep on a lock held by a preempted thread (2 polling threads on 2 cores).
        CHECK(switches < kRequests / 2);
      } else {
        CHECK(switches >= kRequests);
      }
      // A killed worker's link closes; the restarted one connects (the busy receiver still accepts).
      REQUIRE(::kill(static_cast<pid_t>(site->pid()), SIGKILL) == 0);
      Result after;
      after.status = absl::UnavailableError("not submitted yet");
      for (int i = 0; i < 300 && !after.ok(); ++i) {
        after = session.submit("t", at::full({4}, 1.0)).get();
        if (!after.ok()) {
          CHECK_THAT(std::string(after.status.message()), Contains("worker w1"));
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
      }
      REQUIRE(after.ok());
      CHECK(after.output()[0].item<double>() == 4.0);
      CHECK(session.metrics().sites.at(0).restarts >= 1);
    }
  }
}

TEST_CASE("WorkerOptions::busy_poll on channel zmq, and a receive_spin over 1 s, are refused at start(), naming the worker "
          "and the option",
          "[shm]") {
  for (const bool zmq : {true, false}) {
    DYNAMIC_SECTION((zmq ? "busy_poll on zmq" : "receive_spin 2 s")) {
      WorkerOptions options = test::test_worker("w1", zmq ? "zmq" : "shm");
      if (zmq) {
        options.busy_poll = true;
      } else {
        options.receive_spin = absl::Seconds(2);
      }
      Session session;
      session.add_site(make_worker(options)).add_block(test::plugin_block("affine", "affine", "w1")).add_path(Path::chain("t", {"affine"}));
      const absl::Status status = session.start();
      CHECK(absl::IsInvalidArgument(status));
      CHECK_THAT(std::string(status.message()), Contains("worker w1") && Contains(zmq ? "busy_poll" : "receive_spin"));
      if (zmq) CHECK_THAT(std::string(status.message()), Contains("'zmq'"));
    }
  }
}
