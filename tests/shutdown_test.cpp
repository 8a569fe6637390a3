// Shutdown with a call into a block of this process that does not return: every request resolves,
// shutdown() and the Session's destructor return, and what the call holds is freed once it returns;
// a Session destroyed in its own completion callback is shut down and freed all the same, and so is
// one shut down or destroyed by its SessionOptions::on_site_lost.
#include "gate_site.hpp"
#include "test_util.hpp"

#include <future>
#include <memory>

using namespace blockflow;
using namespace std::chrono_literals;

namespace {

// A block whose first call after arm() waits until open() (a call that "never returns").
struct StuckCall {
  std::atomic<bool> armed{false}, entered{false};
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  void open() { gate.set_value(); }
};

std::shared_ptr<Block> stuck_block(const std::shared_ptr<StuckCall>& call) {
  BlockOptions queue;
  queue.queue_capacity = 8;
  return test::unary("stuck", [call](const Tensor& x) {
    // 120 s at most: a shutdown() or ~Session that wrongly waits for the call fails, never hangs.
    if (call->armed.load() && !call->entered.exchange(true)) call->opened.wait_for(std::chrono::seconds(120));
    return x + 1;
  }, queue);
}

bool cancelled_naming(std::future<Result>& future, const std::string& text) {
  if (future.wait_for(0s) != std::future_status::ready) return false;
  const Result r = future.get();
  INFO(r.status.ToString());
  return absl::IsCancelled(r.status) && std::string(r.status.message()).find(text) != std::string::npos;
}

}  // namespace

TEST_CASE("a call into a block that does not return holds neither shutdown() nor the other requests",
          "[session]") {
  auto call = std::make_shared<StuckCall>();
  std::shared_ptr<Block> stuck = stuck_block(call);
  SessionOptions options;
  options.lanes = 2;
  auto session = std::make_unique<Session>(options);
  session->add_block(stuck)
      .add_block(test::unary("other", [](const Tensor& x) { return x * 2; }))
      .add_path(Path::chain("t", {"stuck"}))
      .add_path(Path::chain("u", {"other"}));
  test::require_started(*session);
  call->armed = true;
  auto first = session->submit("t", at::zeros({1}));
  REQUIRE(test::eventually([&] { return call->entered.load(); }, std::chrono::seconds(30)));
  std::vector<std::future<Result>> queued;
  for (int i = 0; i < 3; ++i) queued.push_back(session->submit("t", at::zeros({1})));
  CHECK(session->submit("u", at::ones({1})).get().output().item<float>() == 2.0f);  // the other lane serves u
  test::LogLines log;

  SECTION("shutdown() returns with every request resolved; the lane is joined once the call returns") {
    auto shut = std::async(std::launch::async, [&] { session->shutdown(absl::Milliseconds(10)); });
    const bool returned = shut.wait_for(60s) == std::future_status::ready;
    CHECK(returned);  // while the call still waits: the gate is opened below
    CHECK(cancelled_naming(first, "task 't': session shut down while the request was in flight"));
    for (auto& f : queued) CHECK(cancelled_naming(f, "block 'stuck': session shut down while the request waited in its queue"));
    CHECK(log.contains("shutdown(): a call into block 'stuck' has not returned"));
    call->open();
    shut.wait();
    session.reset();  // joins the lane, which the call has left
    CHECK_FALSE(log.contains("~Session(): a lane is still in a call"));
    CHECK(stuck.use_count() == 1);
  }

  SECTION("the destructor after shutdown() does not quiesce the stuck call again nor log it twice") {
    session->shutdown(absl::Milliseconds(10));
    session.reset();
    CHECK(log.count("shutdown(): a call into block 'stuck' has not returned") == 1);
    CHECK(log.count("~Session(): a lane is still in a call that has not returned") == 1);
    CHECK(stuck.use_count() > 1);  // parked until the call returns
    call->open();
    CHECK(test::eventually([&] { return stuck.use_count() == 1; }, std::chrono::seconds(30)));
  }

  SECTION("the destructor returns too; what the call holds is freed once it returns") {
    session.reset();
    CHECK(log.contains("~Session(): a lane is still in a call that has not returned"));
    CHECK(log.contains("shutdown(): a call into block 'stuck' has not returned"));
    CHECK(cancelled_naming(first, "task 't': session shut down while the request was in flight"));
    for (auto& f : queued) CHECK(cancelled_naming(f, "block 'stuck'"));
    CHECK(stuck.use_count() > 1);  // the parked session still holds the block
    call->open();
    CHECK(test::eventually([&] { return stuck.use_count() == 1; }, std::chrono::seconds(30)));
  }
}

TEST_CASE("a Session destroyed in its own completion callback is shut down and freed on a thread of its own",
          "[session]") {
  std::shared_ptr<Block> block = test::unary("b", [](const Tensor& x) { return x + 1; });
  auto* session = new Session();
  session->add_block(block).add_path(Path::chain("t", {"b"}));
  test::require_started(*session);
  test::LogLines log;
  std::promise<float> result;
  session->submit("t", {at::zeros({1})}, [&](Result&& r) {
    result.set_value(r.ok() ? r.output().item<float>() : -1.0f);
    delete session;  // on the lane that resolved the request
  });
  CHECK(result.get_future().get() == 1.0f);
  CHECK(test::eventually([&] { return block.use_count() == 1; }, std::chrono::seconds(30)));  // freed
  CHECK(log.contains("~Session() on a thread of the session"));
}

TEST_CASE("SessionOptions::on_site_lost may shut its session down, or destroy it", "[session]") {
  // kBoth: the application shuts the session down while the function does (before: each waited
  // for the other).
  enum Mode { kShutdown, kDestroy, kBoth };
  const Mode mode = GENERATE(kShutdown, kDestroy, kBoth);
  auto site = std::make_shared<test::GateSite>("far");
  std::promise<void> asked, in_function;
  std::atomic<bool> application_shutting{false};
  std::unique_ptr<Session> session;
  SessionOptions options;
  options.on_site_lost = [&](const SiteLoss&) -> absl::StatusOr<Deployment> {
    in_function.set_value();
    if (mode == kDestroy) {
      session.reset();  // before: joined its own thread from its destructor (std::terminate)
    } else {
      if (mode == kBoth) {
        while (!application_shutting) std::this_thread::sleep_for(1ms);
        std::this_thread::sleep_for(50ms);  // the application's shutdown() is under way
      }
      session->shutdown();  // before: threw (a thread joining itself), the shutdown left half done
    }
    asked.set_value();
    return absl::UnavailableError("no re-plan: the session is gone");
  };
  session = std::make_unique<Session>(options);
  BlockDescription far;
  far.name = "f";
  far.placement = "far";
  session->add_site(site).add_block(far).add_path(Path::chain("t", {"f"}));
  test::require_started(*session);
  REQUIRE(session->submit("t", at::zeros({1})).get().ok());
  test::LogLines log;
  site->lose("the test lost it");
  if (mode == kBoth) {
    REQUIRE(in_function.get_future().wait_for(30s) == std::future_status::ready);
    auto shut = std::async(std::launch::async, [&] {
      application_shutting = true;
      session->shutdown();
    });
    REQUIRE(shut.wait_for(30s) == std::future_status::ready);
  }
  REQUIRE(asked.get_future().wait_for(30s) == std::future_status::ready);
  CHECK(test::eventually([&] { return site->stopped(); }, std::chrono::seconds(30)));  // shut down for good
  if (mode != kDestroy) {
    CHECK(session->submit("t", at::zeros({1})).get().status.code() == absl::StatusCode::kFailedPrecondition);
    session.reset();  // joins the responder's thread, which has ended
  }
  CHECK_FALSE(log.contains("threw"));
}
