// Session: results, exactly-once resolution, errors naming the block, queue policies, shutdown.
#include "gate_site.hpp"
#include "test_util.hpp"

#include <atomic>
#include <map>
#include <mutex>
#include <thread>

using namespace blockflow;
using Catch::Matchers::Contains;
using namespace std::chrono_literals;

TEST_CASE("a chain of callable blocks computes the composition", "[session]") {
  Session session;
  session.add_block(test::unary("twice", [](const Tensor& x) { return x * 2; }))
      .add_block(test::unary("plus_one", [](const Tensor& x) { return x + 1; }))
      .add_path(Path::chain("task", {"twice", "plus_one"}));
  test::require_started(session);
  const Result r = session.submit("task", at::full({3}, 5.0)).get();
  REQUIRE(r.ok());
  CHECK(at::equal(r.output(), at::full({3}, 11.0)));
  CHECK(r.trace.hops.size() == 2);
  CHECK(r.trace.hops[0].block == "twice");
  CHECK(r.trace.hops[1].block == "plus_one");
}

TEST_CASE("many concurrent submitters: every request resolves exactly once with its own result", "[session]") {
  Session session;
  BlockOptions two_workers;
  two_workers.workers = 2;
  two_workers.queue_capacity = 4;  // small, so senders block (kBlock) and wake often
  session.add_block(test::unary("square", [](const Tensor& x) { return x * x; }, two_workers))
      .add_block(test::unary("neg", [](const Tensor& x) { return -x; }))
      .add_path(Path::chain("sq", {"square"}))
      .add_path(Path::chain("sqneg", {"square", "neg"}));
  test::require_started(session);

  constexpr int kThreads = 8, kPerThread = 250;
  std::vector<std::atomic<int>> calls(kThreads * kPerThread);
  std::atomic<int> wrong{0};
  std::vector<std::thread> submitters;
  for (int t = 0; t < kThreads; ++t) {
    submitters.emplace_back([&, t] {
      std::vector<std::future<Result>> futures;
      for (int i = 0; i < kPerThread; ++i) {
        const int id = t * kPerThread + i;
        const bool negate = id % 2 == 1;
        if (i % 3 == 0) {  // the callback flavour: count invocations
          session.submit(negate ? "sqneg" : "sq", Tensors{at::full({1}, double(id))}, [&, id, negate](Result&& r) {
            calls[static_cast<std::size_t>(id)].fetch_add(1);
            const double want = negate ? -double(id) * id : double(id) * id;
            if (!r.ok() || r.output().item<double>() != want) ++wrong;
          });
        } else {
          futures.push_back(session.submit(negate ? "sqneg" : "sq", at::full({1}, double(id))));
          calls[static_cast<std::size_t>(id)].fetch_add(1);
        }
      }
      for (std::size_t k = 0; k < futures.size(); ++k) {
        Result r = futures[k].get();
        if (!r.ok()) ++wrong;
      }
    });
  }
  for (auto& s : submitters) s.join();
  session.shutdown();
  CHECK(wrong.load() == 0);
  for (auto& c : calls) REQUIRE(c.load() == 1);
  const auto m = session.metrics();
  std::uint64_t completed = 0;
  for (const auto& p : m.paths) completed += p.completed;
  CHECK(completed == kThreads * kPerThread);
  CHECK(m.in_flight == 0);
}

TEST_CASE("an exception inside forward fails the request with the block's name and the cause", "[session]") {
  Session session;
  session.add_block(test::unary("ok", [](const Tensor& x) { return x; }))
      .add_block(Block::callable("thrower", [](Tensors&&) -> absl::StatusOr<Tensors> {
        throw std::runtime_error("disk on fire");
      }))
      .add_block(Block::callable("refuser", [](Tensors&&) -> absl::StatusOr<Tensors> {
        return absl::FailedPreconditionError("not today");
      }))
      .add_path(Path::chain("t", {"ok", "thrower"}))
      .add_path(Path::chain("u", {"refuser", "ok"}));
  test::require_started(session);
  Result r = session.submit("t", at::ones({1})).get();
  CHECK(absl::IsInternal(r.status));
  CHECK_THAT(std::string(r.status.message()), Contains("block 'thrower'") && Contains("disk on fire"));
  Result u = session.submit("u", at::ones({1})).get();
  CHECK(absl::IsFailedPrecondition(u.status));
  CHECK_THAT(std::string(u.status.message()), Contains("block 'refuser'") && Contains("not today"));
  // The session keeps serving after a failure.
  CHECK(session.submit("t", at::ones({1})).get().status.code() == absl::StatusCode::kInternal);
  const auto m = session.metrics();
  for (const auto& b : m.blocks) {
    if (b.name == "thrower") CHECK(b.failed == 2);
  }
}

TEST_CASE("a block factory that throws something other than a std::exception fails start(), naming the block",
          "[session]") {
  static std::once_flag once;
  std::call_once(once, [] {
    BlockRegistry::global().add("throws_an_int", [](const std::string&, const BlockOptions&) -> std::shared_ptr<Block> {
      throw 42;
    });
    BlockRegistry::global().add("plus_one_made", [](const std::string& name, const BlockOptions& o) {
      return test::unary(name, [](const Tensor& x) { return x + 1; }, o);
    });
  });
  SessionOptions options;
  options.lanes = 1;  // two blocks to build, one lane: built on threads of their own
  Session session(options);
  BlockDescription bad, good;
  bad.name = "bad";
  bad.factory = "throws_an_int";
  good.name = "good";
  good.factory = "plus_one_made";
  session.add_block(bad).add_block(good).add_path(Path::chain("t", {"good", "bad"}));
  const absl::Status started = session.start();
  CHECK_FALSE(started.ok());
  CHECK_THAT(std::string(started.message()), Contains("block 'bad'") && Contains("an exception of unknown type"));
}

TEST_CASE("a factory's block must carry the name and options it was given: another is refused, naming both", "[session]") {
  static std::once_flag once;
  std::call_once(once, [] {
    BlockRegistry::global().add("renames", [](const std::string& name, const BlockOptions& o) {
      return test::unary(name + "_x", [](const Tensor& x) { return x; }, o);
    });
    BlockRegistry::global().add("drops_options", [](const std::string& name, const BlockOptions&) {
      return test::unary(name, [](const Tensor& x) { return x; });  // the defaults, not what it was given
    });
  });
  BlockDescription d;
  d.name = "b";
  d.factory = "renames";
  auto renamed = make_block(d);
  CHECK_THAT(std::string(renamed.status().message()), Contains("block 'b': factory 'renames' made a block named 'b_x'"));
  d.factory = "drops_options";
  CHECK(make_block(d).ok());  // asked for the defaults: what it made
  d.options.queue_capacity = 4;
  auto dropped = make_block(d);
  CHECK_THAT(std::string(dropped.status().message()),
             Contains("block 'b': factory 'drops_options' made it with another queue_capacity than its description's"));
}

TEST_CASE("a wrong input shape fails the request naming the block and both shapes", "[session]") {
  BlockOptions options;
  options.input_shapes = {{-1, 3}};
  Session session;
  session.add_block(test::unary("needs_3", [](const Tensor& x) { return x; }, options))
      .add_path(Path::chain("t", {"needs_3"}));
  test::require_started(session);
  CHECK(session.submit("t", at::ones({2, 3})).get().ok());
  Result r = session.submit("t", at::ones({2, 4})).get();
  CHECK(absl::IsInvalidArgument(r.status));
  CHECK_THAT(std::string(r.status.message()), Contains("block 'needs_3'") && Contains("[2, 4]") && Contains("[-1, 3]"));
  Result two = session.submit("t", Tensors{at::ones({2, 3}), at::ones({2, 3})}).get();
  CHECK_THAT(std::string(two.status.message()), Contains("expects 1 input(s), got 2"));
}

TEST_CASE("input_dtypes: warm-up runs on zeros of the declared dtype, and another dtype fails naming the block",
          "[session]") {
  BlockOptions options;
  options.input_shapes = {{-1, 4}};
  options.input_dtypes = {at::kLong};
  std::atomic<int> calls{0};
  Session session;
  session.add_block(Block::callable("embed", [&](Tensors&& in) -> absl::StatusOr<Tensors> {
           ++calls;
           if (in.at(0).scalar_type() != at::kLong) return absl::InternalError("ids must be int64");
           return Tensors{in.at(0).sum(1)};  // an embedding would index with them
         }, options))
      .add_path(Path::chain("t", {"embed"}));
  test::require_started(session);  // its warm-up runs fail on float32 zeros
  CHECK(calls.load() == options.warmup_runs);
  Result ok = session.submit("t", at::full({3, 4}, 2, at::kLong)).get();
  REQUIRE(ok.ok());
  CHECK(ok.outputs.at(0).equal(at::full({3}, 8, at::kLong)));
  Result floats = session.submit("t", at::ones({3, 4})).get();
  CHECK(absl::IsInvalidArgument(floats.status));
  CHECK_THAT(std::string(floats.status.message()),
             Contains("block 'embed': input 0 is [3, 4] float32 cpu, expected dtype int64"));
  CHECK(calls.load() == options.warmup_runs + 1);  // refused before forward()
}

TEST_CASE("unknown tasks and submits outside start/shutdown resolve at once with a clear error", "[session]") {
  Session session;
  session.add_block(test::unary("a", [](const Tensor& x) { return x; })).add_path(Path::chain("known", {"a"}));
  Result early = session.submit("known", at::ones({1})).get();
  CHECK(absl::IsFailedPrecondition(early.status));
  CHECK_THAT(std::string(early.status.message()), Contains("not started"));
  test::require_started(session);
  Result unknown = session.submit("nope", at::ones({1})).get();
  CHECK(absl::IsNotFound(unknown.status));
  CHECK_THAT(std::string(unknown.status.message()), Contains("unknown task 'nope'") && Contains("known"));
  session.shutdown();
  Result late = session.submit("known", at::ones({1})).get();
  CHECK_THAT(std::string(late.status.message()), Contains("shut down"));
}

namespace {

// A block that waits on a gate, so a test controls when its queue moves.
using Gate = test::Latch;

std::shared_ptr<Block> gated(const std::string& name, Gate& gate, BlockOptions options) {
  return test::unary(name, [&gate](const Tensor& x) {
    gate.entered = true;
    gate.wait();
    return x;
  }, std::move(options));
}

// Submits n requests numbered 0..n-1 while the gated block holds request 0.
void wait_for(const std::function<bool()>& condition) {
  REQUIRE(test::eventually(condition, std::chrono::milliseconds(60000)));  // never: a failure, not a hang
}

std::vector<std::future<Result>> fill(Session& session, Gate& gate, int n) {
  std::vector<std::future<Result>> futures;
  futures.push_back(session.submit("t", at::full({1}, 0.0)));
  wait_for([&] { return gate.entered.load(); });  // request 0 is inside forward(), not in the queue
  for (int i = 1; i < n; ++i) futures.push_back(session.submit("t", at::full({1}, double(i))));
  return futures;
}

}  // namespace

TEST_CASE("queue policy reject: requests beyond the capacity fail with ResourceExhausted", "[session]") {
  Gate gate;
  BlockOptions options;
  options.queue_capacity = 2;
  options.full_policy = FullPolicy::kReject;
  Session session;
  session.add_block(gated("gated", gate, options)).add_path(Path::chain("t", {"gated"}));
  test::require_started(session);
  auto futures = fill(session, gate, 5);  // 1 in forward, 2 queued, 2 rejected
  for (int i : {3, 4}) {
    Result r = futures[static_cast<std::size_t>(i)].get();  // ready before the gate opens
    CHECK(absl::IsResourceExhausted(r.status));
    CHECK_THAT(std::string(r.status.message()), Contains("block 'gated'") && Contains("reject"));
  }
  gate.release();
  for (int i : {0, 1, 2}) CHECK(futures[static_cast<std::size_t>(i)].get().output().item<double>() == i);
  CHECK(session.metrics().blocks.at(0).queue.rejected == 2);
}

TEST_CASE("queue policy drop-oldest: the oldest queued requests fail, the newest run", "[session]") {
  Gate gate;
  BlockOptions options;
  options.queue_capacity = 2;
  options.full_policy = FullPolicy::kDropOldest;
  Session session;
  session.add_block(gated("gated", gate, options)).add_path(Path::chain("t", {"gated"}));
  test::require_started(session);
  auto futures = fill(session, gate, 5);  // 1 in forward; 1 and 2 dropped by 3 and 4
  for (int i : {1, 2}) {
    Result r = futures[static_cast<std::size_t>(i)].get();
    CHECK(absl::IsResourceExhausted(r.status));
    CHECK_THAT(std::string(r.status.message()), Contains("block 'gated'") && Contains("drop-oldest"));
  }
  gate.release();
  for (int i : {0, 3, 4}) CHECK(futures[static_cast<std::size_t>(i)].get().output().item<double>() == i);
  CHECK(session.metrics().blocks.at(0).queue.dropped == 2);
}

TEST_CASE("queue policy block: a full queue holds the submitter back, nothing fails", "[session]") {
  Gate gate;
  BlockOptions options;
  options.queue_capacity = 1;
  options.full_policy = FullPolicy::kBlock;
  Session session;
  session.add_block(gated("gated", gate, options)).add_path(Path::chain("t", {"gated"}));
  test::require_started(session);
  std::atomic<int> submitted{0};
  std::vector<std::future<Result>> futures;
  std::thread client([&] {
    for (int i = 0; i < 4; ++i) {
      futures.push_back(session.submit("t", at::full({1}, double(i))));
      ++submitted;
    }
  });
  wait_for([&] { return submitted.load() >= 2; });
  std::this_thread::sleep_for(50ms);
  CHECK(submitted.load() == 2);  // one in forward, one queued, the third submit waits for room
  gate.release();
  client.join();
  for (int i = 0; i < 4; ++i) CHECK(futures[static_cast<std::size_t>(i)].get().output().item<double>() == i);
  CHECK(session.metrics().blocks.at(0).queue.high_watermark == 1);
}

TEST_CASE("shutdown with requests in flight resolves every one of them", "[session]") {
  Session session;
  BlockOptions small;
  small.queue_capacity = 4;
  session.add_block(test::slow_plus_one("slow", 20ms, small))
      .add_block(test::unary("fast", [](const Tensor& x) { return x; }))
      .add_path(Path::chain("t", {"slow", "fast"}));
  test::require_started(session);
  std::atomic<int> resolved{0}, ok{0}, cancelled{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < 3; ++c) {
    clients.emplace_back([&] {
      for (int i = 0; i < 10; ++i) {
        session.submit("t", Tensors{at::zeros({1})}, [&](Result&& r) {
          ++resolved;
          if (r.ok()) ++ok;
          if (absl::IsCancelled(r.status) || absl::IsFailedPrecondition(r.status)) ++cancelled;
        });
      }
    });
  }
  std::this_thread::sleep_for(50ms);
  session.shutdown(absl::ZeroDuration());  // no drain: cancel what is queued
  for (auto& c : clients) c.join();
  CHECK(resolved.load() == 30);
  CHECK(ok.load() + cancelled.load() == 30);
  CHECK(cancelled.load() >= 1);
  CHECK(session.metrics().in_flight == 0);
}

TEST_CASE("shutdown with a drain period lets in-flight requests finish", "[session]") {
  Session session;
  session.add_block(test::slow_plus_one("slow", 5ms)).add_path(Path::chain("t", {"slow"}));
  test::require_started(session);
  std::vector<std::future<Result>> futures;
  for (int i = 0; i < 10; ++i) futures.push_back(session.submit("t", at::zeros({1})));
  session.shutdown(absl::Seconds(30));
  for (auto& f : futures) CHECK(f.get().ok());
}

TEST_CASE("a block's warm-up failure makes start() fail, naming the block", "[session]") {
  BlockOptions options;
  options.input_shapes = {{1, 2}};
  Session session;
  session.add_block(Block::callable("bad_warmup", [](Tensors&&) -> absl::StatusOr<Tensors> {
    throw std::runtime_error("cannot warm up");
  }, options)).add_path(Path::chain("t", {"bad_warmup"}));
  auto status = session.start();
  CHECK_FALSE(status.ok());
  CHECK_THAT(std::string(status.message()), Contains("block 'bad_warmup'") && Contains("cannot warm up"));
}

TEST_CASE("a block on a device this machine does not have is rejected at start(), naming it", "[session]") {
  BlockOptions options;
  options.device = "cuda:7";
  Session session;
  session.add_block(test::unary("gpu_block", [](const Tensor& x) { return x; }, options))
      .add_path(Path::chain("t", {"gpu_block"}));
  auto status = session.start();
  CHECK(absl::IsInvalidArgument(status));
  CHECK_THAT(std::string(status.message()), Contains("block 'gpu_block'") && Contains("cuda:7") &&
                                                 Contains("not present"));
}

TEST_CASE("a completion callback that throws keeps no other request from resolving: shutdown with requests queued",
          "[session]") {
  SessionOptions one_lane;
  one_lane.lanes = 1;
  Session session(one_lane);
  std::atomic<bool> go{false};
  session.add_block(Block::callable("gate", [&go](Tensors&& in) -> absl::StatusOr<Tensors> {
    while (!go) std::this_thread::sleep_for(1ms);
    return std::move(in);
  })).add_path(Path::chain("t", {"gate"}));
  test::require_started(session);
  auto running = session.submit("t", at::ones({1}));
  REQUIRE(test::eventually([&] { return session.metrics().blocks.at(0).computing_s > 0; }));
  // Queued behind it: one whose callback throws, then two more.
  std::atomic<int> thrown{0};
  session.submit("t", Tensors{at::ones({1})}, [&thrown](Result&&) {
    ++thrown;
    throw std::runtime_error("callback bug");
  });
  auto second = session.submit("t", at::ones({1}));
  auto third = session.submit("t", at::ones({1}));
  std::thread opener([&go] {  // long after shutdown() has closed the queue, on a loaded machine too
    std::this_thread::sleep_for(500ms);
    go = true;
  });
  CHECK_NOTHROW(session.shutdown(absl::ZeroDuration()));  // the queued ones fail, each resolved
  opener.join();
  CHECK(thrown == 1);
  for (auto* f : {&second, &third}) {
    Result r;
    REQUIRE_NOTHROW(r = f->get());  // before: a broken promise
    CHECK(absl::IsCancelled(r.status));
  }
  CHECK(running.get().status.code() != absl::StatusCode::kUnknown);
}

TEST_CASE("an exception thrown by a done callback does not take the worker down", "[session]") {
  Session session;
  session.add_block(test::unary("a", [](const Tensor& x) { return x + 1; })).add_path(Path::chain("t", {"a"}));
  test::require_started(session);
  session.submit("t", Tensors{at::zeros({1})}, [](Result&&) { throw std::runtime_error("callback bug"); });
  CHECK(session.submit("t", at::zeros({1})).get().output().item<float>() == 1.0f);
}

namespace {

// A site whose try_run() throws: a request for its block cannot start. With `in_run`, try_run()
// takes nothing and run() (on the block's forwarding thread) throws instead.
class ThrowingSite final : public RemoteSite {
 public:
  explicit ThrowingSite(bool in_run = false) : in_run_(in_run) {}
  const std::string& name() const override { return name_; }
  absl::Status start(const std::vector<BlockDescription>&, CompletionFn) override { return absl::OkStatus(); }
  void run(const std::string&, Envelope&&) override {
    if (in_run_) throw std::runtime_error("site refuses in run()");
  }
  bool try_run(const std::string&, Envelope&) override {
    if (in_run_) return false;
    throw std::runtime_error("site refuses at once");
  }
  void stop() override {}
  SiteStats stats() const override {
    SiteStats s;
    s.name = name_;
    s.kind = "throwing";
    return s;
  }

 private:
  const bool in_run_;
  std::string name_ = "thrower";
};

}  // namespace

TEST_CASE("a request that throws while it starts resolves with the reason; submit() does not throw", "[session]") {
  Session session;
  BlockDescription remote;
  remote.name = "far";
  remote.placement = "thrower";
  session.add_site(std::make_shared<ThrowingSite>()).add_block(remote).add_path(Path::chain("t", {"far"}));
  test::require_started(session);
  std::future<Result> pending;
  REQUIRE_NOTHROW(pending = session.submit("t", at::ones({2})));  // before: it threw, and resolved again at shutdown
  REQUIRE(pending.wait_for(10s) == std::future_status::ready);
  const Result r = pending.get();
  CHECK(r.status.code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(r.status.message()), Contains("task 't'") && Contains("site refuses at once"));
  CHECK(session.metrics().in_flight == 0);  // before: 1 for good (shutdown waited its whole drain)
}

TEST_CASE("add_site refuses a second site of one name and the names metrics give the session's own", "[session]") {
  Session session;
  session.add_site(std::make_shared<test::GateSite>("w1"));
  CHECK_THROWS_WITH(session.add_site(std::make_shared<test::GateSite>("w1")),
                    Contains("Session::add_site(): a site named 'w1' was added already"));
  for (const char* reserved : {"threads", "host"}) {
    CHECK_THROWS_WITH(session.add_site(std::make_shared<test::GateSite>(reserved)), Contains("is reserved"));
  }
  CHECK_THROWS_WITH(session.add_site(std::make_shared<test::GateSite>("../w")), Contains("site name '../w'"));
}

TEST_CASE("a site that throws on a site's thread fails the request, naming the block; the process goes on", "[session]") {
  // Before, the exception left the thread (std::terminate) and the request stayed in flight.
  Session session;
  BlockDescription far;
  far.name = "far";
  far.placement = "thrower";
  std::string expected;
  bool near_is_local = false;
  SECTION("run() throws on the block's forwarding thread") {
    session.add_site(std::make_shared<ThrowingSite>(/*in_run=*/true)).add_block(far).add_path(Path::chain("t", {"far"}));
    expected = "block 'far': the request could not be handed to its site: site refuses in run()";
  }
  SECTION("handing a site's output on throws on that site's thread (the next block's site throws)") {
    BlockDescription near;
    near.name = "near";
    near.placement = "gate";
    session.add_site(std::make_shared<test::GateSite>("gate"))  // reports on the thread that feeds it
        .add_site(std::make_shared<ThrowingSite>())
        .add_block(near)
        .add_block(far)
        .add_path(Path::chain("t", {"near", "far"}));
    expected = "block 'near': the request could not hand its output on: site refuses at once";
  }
  SECTION("a block of this process hands its output to a site that throws (on a lane)") {
    session.add_site(std::make_shared<ThrowingSite>())
        .add_block(test::unary("near", [](const Tensor& x) { return x + 1; }))
        .add_block(far)
        .add_path(Path::chain("t", {"near", "far"}));
    expected = "block 'near': the request could not hand its output on: site refuses at once";
    near_is_local = true;
  }
  test::require_started(session);
  for (int i = 0; i < 2; ++i) {  // the thread lives on: a second request fails the same way
    std::future<Result> pending = session.submit("t", at::ones({2}));
    REQUIRE(pending.wait_for(30s) == std::future_status::ready);
    const Result r = pending.get();
    CHECK(r.status.code() == absl::StatusCode::kInternal);
    CHECK_THAT(std::string(r.status.message()), Contains(expected));
  }
  const auto m = session.metrics();
  CHECK(m.in_flight == 0);
  if (near_is_local) {  // it ran both: processed, not failed (the hand-off failed)
    CHECK(m.blocks.at(0).processed == 2);
    CHECK(m.blocks.at(0).failed == 0);
  }
}
