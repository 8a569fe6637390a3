// A WorkerSite's life next to its owner: after stop() its completion callback is never called
// (the session that gave it may be gone), an update can be cancelled, and an idle site's sender
// thread sleeps instead of polling.
#include "worker_util.hpp"

#include <blockflow/channel/detail/runtime_dir.hpp>
#include <blockflow/channel/wire_format.hpp>

#include <fmt/format.h>
#include <zmq.hpp>

#include <dirent.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>

using namespace blockflow;
using namespace std::chrono_literals;

namespace {

// The id of this process's thread named `name`, or 0.
std::string thread_named(const std::string& name) {
  DIR* dir = ::opendir("/proc/self/task");
  if (dir == nullptr) return {};
  std::string found;
  while (dirent* entry = ::readdir(dir)) {
    std::ifstream comm(std::string("/proc/self/task/") + entry->d_name + "/comm");
    std::string line;
    if (std::getline(comm, line) && line == name) found = entry->d_name;
  }
  ::closedir(dir);
  return found;
}

// How often a thread of this process went to sleep and was woken (voluntary context switches).
long wake_ups(const std::string& tid) {
  std::ifstream status("/proc/self/task/" + tid + "/status");
  std::string key;
  while (status >> key) {
    if (key == "voluntary_ctxt_switches:") {
      long n = 0;
      status >> n;
      return n;
    }
    status.ignore(1 << 10, '\n');
  }
  return -1;
}

}  // namespace

TEST_CASE("a stopped WorkerSite never calls its completion callback again", "[worker_lifecycle]") {
  auto calls = std::make_shared<std::atomic<int>>(0);
  auto site = std::make_shared<WorkerSite>(test::test_worker("wl1", "shm"));
  auto status = site->start({test::plugin_block("x", "affine", "wl1")},
                            [calls](SiteCompletion&&) { calls->fetch_add(1); });
  INFO(status.ToString());
  REQUIRE(status.ok());
  Envelope before;
  before.request_id = 1;
  before.tensors = {at::ones({2})};
  site->run("x", std::move(before));
  REQUIRE(test::eventually([&] { return calls->load() == 1; }));
  site->stop();
  Envelope after;
  after.request_id = 2;
  after.tensors = {at::ones({2})};
  site->run("x", std::move(after));  // used to be failed through the callback of a session maybe gone
  CHECK(calls->load() == 1);
}

TEST_CASE("a request frame a worker cannot decode is answered at the node it names: no other request of the same id "
          "fails",
          "[worker_lifecycle]") {
  std::mutex mu;
  std::vector<SiteCompletion> done;
  auto site = std::make_shared<WorkerSite>(test::test_worker("wl4", "zmq"));  // direct edges: a peer endpoint
  REQUIRE(site->start({test::plugin_block("x", "hang_on_negative", "wl4")}, [&](SiteCompletion&& c) {
                std::lock_guard lock(mu);
                done.push_back(std::move(c));
              }).ok());
  REQUIRE_FALSE(site->peer_endpoint().empty());
  Envelope e;
  e.request_id = 5;
  e.tensors = {-at::ones({2})};  // request 5 at node 0 stays in the worker (its block hangs)
  site->run("x", std::move(e));
  // The header of a request 5 for node 3, without its tensor frame: malformed, its id and node readable.
  wire::Header h;
  h.kind = wire::MessageKind::kData;
  h.request_id = 5;
  h.node = 3;
  h.target = "x";
  h.tensors.push_back({wire::DType::kFloat32, {2}, {1}, 8});
  zmq::context_t context;
  zmq::socket_t push(context, zmq::socket_type::push);
  push.set(zmq::sockopt::linger, 1000);
  push.connect(site->peer_endpoint());
  REQUIRE(push.send(zmq::buffer(wire::encode_header(h)), zmq::send_flags::none));
  std::this_thread::sleep_for(500ms);  // the worker's error reply for node 3 has come back by now
  {
    std::lock_guard lock(mu);
    CHECK(done.empty());  // before: (5, 0) failed with "malformed request frame" (the reply named node 0)
  }
  site->stop();  // fails (5, 0), which is still the worker's
  std::lock_guard lock(mu);
  REQUIRE(done.size() == 1);
  CHECK(done[0].request_id == 5);
  CHECK(done[0].node == 0);
  CHECK(absl::IsCancelled(done[0].outputs.status()));
}

TEST_CASE("WorkerSite::cancel_update() ends an update that is loading", "[worker_lifecycle]") {
  auto site = std::make_shared<WorkerSite>(test::test_worker("wl2", "shm"));
  REQUIRE(site->start({test::plugin_block("x", "affine", "wl2")}, [](SiteCompletion&&) {}).ok());
  // 2,000 warm-up runs of 5 ms: ten seconds of loading.
  BlockDescription slow = test::plugin_block("s", "slow_identity", "wl2");
  slow.options.input_shapes = {{1}};
  slow.options.warmup_runs = 2000;
  auto update = std::async(std::launch::async, [&] { return site->update({test::plugin_block("x", "affine", "wl2"), slow}); });
  // Until it is in progress (a cancel before it starts does nothing), then once more.
  while (update.wait_for(10ms) != std::future_status::ready) site->cancel_update();
  const absl::Status status = update.get();
  INFO(status.ToString());
  CHECK(absl::IsCancelled(status));
  site->stop();
}

TEST_CASE("an idle WorkerSite's sender thread sleeps until there is work", "[worker_lifecycle]") {
  auto site = std::make_shared<WorkerSite>(test::test_worker("wl3", "shm"));
  std::atomic<int> done{0};
  REQUIRE(site->start({test::plugin_block("x", "affine", "wl3")}, [&](SiteCompletion&&) { ++done; }).ok());
  const std::string sender = thread_named("bf-wl3:snd");
  REQUIRE_FALSE(sender.empty());
  const long before = wake_ups(sender);
  std::this_thread::sleep_for(500ms);
  const long idle = wake_ups(sender) - before;
  INFO("sender wake-ups in 500 ms idle: " << idle);
  CHECK(idle < 25);  // it polled every 2 ms: ~250
  Envelope work;
  work.request_id = 7;
  work.tensors = {at::ones({2})};
  site->run("x", std::move(work));  // and it still serves
  CHECK(test::eventually([&] { return done.load() == 1; }));
  site->stop();
}

TEST_CASE("private directories a killed host left are removed by the next one; live ones stay", "[worker_lifecycle]") {
  namespace fs = std::filesystem;
  // What a host killed with SIGKILL leaves: its directory and owner lock, the lock held by no one.
  const char* base = std::getenv("XDG_RUNTIME_DIR");
  const std::string root = (base != nullptr && *base != '\0') ? base : "/tmp";
  std::string pattern = root + "/blockflow-orphan-XXXXXX";
  REQUIRE(::mkdtemp(pattern.data()) != nullptr);
  const std::string orphan = pattern;
  std::ofstream(orphan + "/owner.lock") << "";
  std::ofstream(orphan + "/requests") << "";
  auto live = blockflow::detail::make_private_dir("live");
  REQUIRE(live.ok());
  auto next = blockflow::detail::make_private_dir("next");  // sweeps first
  REQUIRE(next.ok());
  CHECK_FALSE(fs::exists(orphan));
  CHECK(fs::exists(*live));
  CHECK(fs::exists(*next + "/owner.lock"));
  blockflow::detail::remove_private_dir(*live);
  blockflow::detail::remove_private_dir(*next);
  CHECK_FALSE(fs::exists(*live));
}

TEST_CASE("stop() from two threads at once: one stops the site, the other waits; what it failed is counted",
          "[worker_lifecycle]") {
  auto ok = std::make_shared<std::atomic<int>>(0), failed = std::make_shared<std::atomic<int>>(0);
  auto site = std::make_shared<WorkerSite>(test::test_worker("wl2", "shm"));
  auto status = site->start({test::plugin_block("s", "slow_identity", "wl2")}, [ok, failed](SiteCompletion&& c) {
    (c.outputs.ok() ? ok : failed)->fetch_add(1);
  });
  INFO(status.ToString());
  REQUIRE(status.ok());
  constexpr int kRequests = 40;  // 5 ms each in the worker: most are still inside when it stops
  for (int i = 0; i < kRequests; ++i) {
    Envelope e;
    e.request_id = static_cast<std::uint64_t>(i + 1);
    e.tensors = {at::ones({2})};
    site->run("s", std::move(e));
  }
  auto other = std::async(std::launch::async, [site] { site->stop(); });
  site->stop();
  other.get();
  CHECK(ok->load() + failed->load() == kRequests);  // every request resolved once
  CHECK(failed->load() > 0);
  CHECK(site->stats().failed_requests == static_cast<std::uint64_t>(failed->load()));
}

TEST_CASE("a worker whose block never returns holds neither apply() nor shutdown(): requests waiting for its room give up",
          "[worker_lifecycle]") {
  // One request hangs in the worker (never killed: compute_timeout 0); with max_in_flight 1 the next
  // waits in the site's queue, the one after it in the session's forwarder, inside run(), for room
  // that never comes; the rest wait in the block's input queue.
  WorkerOptions o = test::test_worker("wl5");
  o.compute_timeout = absl::ZeroDuration();
  o.max_in_flight = 1;
  auto site = make_worker(o);
  Session session;
  session.add_site(site).add_block(test::plugin_block("h", "hang_on_negative", "wl5")).add_path(Path::chain("t", {"h"}));
  test::require_started(session);
  auto stuck = session.submit("t", -at::ones({4}));
  std::vector<std::future<Result>> waiting;
  for (int i = 0; i < 4; ++i) waiting.push_back(session.submit("t", at::ones({4})));
  REQUIRE(test::eventually([&] { return session.metrics().blocks.at(0).queue.depth == 2; }));
  std::vector<std::future<Result>> all;
  all.push_back(std::move(stuck));
  for (auto& f : waiting) all.push_back(std::move(f));

  std::string expected;
  SECTION("apply() removing the block") {
    auto v = session.apply(test::parse(R"({"blocks": [], "tasks": {}})"), absl::Milliseconds(200));
    INFO(v.status().ToString());
    REQUIRE(v.ok());
    expected = "block 'h': removed by update 1";
  }
  SECTION("shutdown()") {
    session.shutdown(absl::Milliseconds(200));
    expected = "block 'h': session shut down";
  }
  // The one the forwarder held names the site it waited at; each resolves (the hung one when the
  // session stops its site, at the latest).
  int gave_up = 0;
  session.shutdown(absl::Milliseconds(200));
  for (auto& f : all) {
    REQUIRE(f.wait_for(30s) == std::future_status::ready);
    const Result r = f.get();
    CHECK_FALSE(r.ok());
    const std::string message(r.status.message());
    if (message.find("waited for room at site 'wl5'") != std::string::npos) {
      ++gave_up;
      CHECK(absl::IsCancelled(r.status));
      CHECK_THAT(message, Catch::Matchers::StartsWith(expected));
    }
  }
  CHECK(gave_up == 1);
}

TEST_CASE("stop() returns only once a report another thread is making is over", "[worker_lifecycle]") {
  WorkerOptions options = test::test_worker("wl5", "shm");
  options.max_restarts = 0;
  auto site = std::make_shared<WorkerSite>(options);
  std::promise<void> entered, release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<bool> reporting{false};
  REQUIRE(site->start({test::plugin_block("x", "affine", "wl5")}, [&](SiteCompletion&& c) {
                if (c.request_id != 7) return;
                reporting = true;
                entered.set_value();
                released.wait();
                reporting = false;
              }).ok());
  ::kill(static_cast<pid_t>(site->stats().pid), SIGKILL);
  REQUIRE(test::eventually([&] { return site->stats().lost; }));  // not restarted: down for good
  // A request run now is failed by the caller's thread, through the callback, which waits here.
  std::thread caller([&] {
    Envelope e;
    e.request_id = 7;
    e.tensors = {at::ones({2})};
    site->run("x", std::move(e));
  });
  entered.get_future().wait();
  std::atomic<bool> stopped{false};
  std::thread stopper([&] {
    site->stop();
    stopped = true;
  });
  std::this_thread::sleep_for(300ms);
  CHECK_FALSE(stopped.load());  // before: stop() returned while the report still ran (its session may be gone)
  CHECK(reporting.load());
  release.set_value();
  stopper.join();
  caller.join();
  CHECK(stopped.load());
  CHECK_FALSE(reporting.load());
}

TEST_CASE("a worker inherits no descriptor of the host beyond 0-2, nor the starting thread's blocked signals",
          "[worker_lifecycle]") {
  int ends[2];
  REQUIRE(::pipe(ends) == 0);  // inheritable: no O_CLOEXEC
  const std::string pipe_name = std::filesystem::read_symlink(fmt::format("/proc/self/fd/{}", ends[1])).string();
  sigset_t blocked, before;
  sigemptyset(&blocked);
  sigaddset(&blocked, SIGUSR2);
  REQUIRE(::pthread_sigmask(SIG_BLOCK, &blocked, &before) == 0);  // the site's threads inherit it
  auto site = make_worker(test::test_worker("wfd"));
  Session session;
  session.add_site(site).add_block(test::plugin_block("a", "affine", "wfd")).add_path(Path::chain("t", {"a"}));
  const absl::Status started = session.start();
  REQUIRE(::pthread_sigmask(SIG_SETMASK, &before, nullptr) == 0);
  INFO(started.ToString());
  REQUIRE(started.ok());
  REQUIRE(session.submit("t", at::ones({1})).get().ok());
  const auto pid = site->pid();
  REQUIRE(pid > 0);
  std::vector<std::string> inherited;
  for (const auto& entry : std::filesystem::directory_iterator(fmt::format("/proc/{}/fd", pid))) {
    std::error_code ec;
    const auto target = std::filesystem::read_symlink(entry.path(), ec);
    if (!ec && target.string() == pipe_name) inherited.push_back(entry.path().filename().string());
  }
  CHECK(inherited.empty());  // before: the pipe's ends, for the worker's whole life
  std::ifstream status(fmt::format("/proc/{}/status", pid));
  std::uint64_t sigblk = ~std::uint64_t{0};
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("SigBlk:", 0) == 0) sigblk = std::stoull(line.substr(7), nullptr, 16);
  }
  CHECK((sigblk & (std::uint64_t{1} << (SIGUSR2 - 1))) == 0);
  ::close(ends[0]);
  ::close(ends[1]);
}

TEST_CASE("start() refuses supervision options that cannot work, naming the worker and the option", "[worker_lifecycle]") {
  // Before: a negative max_restarts restarted for ever, a heartbeat_interval of 0 pinged in a busy
  // loop, and a timeout no longer than the interval killed every worker in turn.
  WorkerOptions options = test::test_worker("w9");
  std::string expected;
  SECTION("max_restarts below 0") {
    options.max_restarts = -1;
    expected = "worker w9: WorkerOptions::max_restarts is -1";
  }
  SECTION("heartbeat_interval 0") {
    options.heartbeat_interval = absl::ZeroDuration();
    expected = "worker w9: WorkerOptions::heartbeat_interval is 0; give 1ms or more";
  }
  SECTION("heartbeat_timeout no longer than the interval") {
    options.heartbeat_interval = absl::Milliseconds(500);
    options.heartbeat_timeout = absl::Milliseconds(500);
    expected = "worker w9: WorkerOptions::heartbeat_timeout (500ms) must be longer than heartbeat_interval (500ms)";
  }
  SECTION("start_timeout 0") {
    options.start_timeout = absl::ZeroDuration();
    expected = "worker w9: WorkerOptions::start_timeout (0) must be above 0";
  }
  SECTION("max_in_flight 0") {
    options.max_in_flight = 0;
    expected = "worker w9: WorkerOptions::max_in_flight is 0";
  }
  WorkerSite site(options);
  const absl::Status status = site.start({}, [](SiteCompletion&&) {});
  CHECK(status.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(status.message()), Catch::Matchers::Contains(expected));
}

TEST_CASE("a worker block whose queue is shorter than the requests in flight to it: every request resolves, none waits "
          "for a slot",
          "[worker_lifecycle]") {
  // The worker's receiving thread, which also takes the host's slot releases, never waits for room
  // in a block's queue: requests that find it full are queued in order by a lane.
  Session session;
  session.add_site(std::make_shared<WorkerSite>(test::test_worker("w1", "shm")));
  BlockDescription d = test::plugin_block("a", "affine", "w1");
  d.options.queue_capacity = 1;
  session.add_block(d).add_path(Path::chain("t", {"a"}));
  test::require_started(session);
  const Tensor x = at::ones({256, 1024});  // 1 MB: results go through the worker's slots
  std::vector<std::future<Result>> futures;
  for (int i = 0; i < 48; ++i) futures.push_back(session.submit("t", x));
  int ok = 0;
  std::string sample;
  for (auto& f : futures) {
    const Result r = f.get();
    if (r.ok() && at::allclose(r.output(), x * 3 + 1)) ++ok;
    else if (!r.ok()) sample = std::string(r.status.message());
  }
  INFO(sample);
  CHECK(ok == 48);
}

TEST_CASE("a closed loop that resubmits from its completion callback into a full worker block never stalls",
          "[worker_lifecycle]") {
  // The callback runs on the site's thread that takes the worker's results in. Before, a submit()
  // from it waited for room in the block's full queue; that room comes only as the worker takes
  // requests, and the worker takes them only as that very thread reads its results: every request
  // of the task hung. "complex" fails every request in the worker (its output's dtype crosses no
  // wire): the callbacks then run for failures, on the same thread.
  WorkerOptions w = test::test_worker("w1", GENERATE(as<std::string>{}, "shm", "zmq"));
  const std::string factory = GENERATE(as<std::string>{}, "affine", "complex");
  w.max_in_flight = 2;
  // Before the session: its destructor may still run callbacks on it.
  struct Loop {
    Session* session = nullptr;
    std::atomic<int> left{400}, ok{0}, failed{0}, chains{16};
    std::promise<void> all_done;
    void next() {
      if (left.fetch_sub(1) <= 0) {
        if (chains.fetch_sub(1) == 1) all_done.set_value();
        return;
      }
      session->submit("t", Tensors{at::ones({4, 2})}, [this](Result&& r) {
        if (r.ok() && at::equal(r.output(), at::full({4, 2}, 4.0f))) ok.fetch_add(1);
        if (!r.ok() && std::string(r.status.message()).find("block 'a'") != std::string::npos) failed.fetch_add(1);
        next();
      });
    }
  } loop;
  Session session;
  loop.session = &session;
  session.add_site(std::make_shared<WorkerSite>(w));
  BlockDescription d = test::plugin_block("a", factory, "w1");
  d.options.queue_capacity = 2;
  session.add_block(d).add_path(Path::chain("t", {"a"}));
  test::require_started(session);
  auto finished = loop.all_done.get_future();
  for (int c = 0; c < 16; ++c) loop.next();  // 16 chains: more than the queue and the worker hold
  REQUIRE(finished.wait_for(120s) == std::future_status::ready);
  CHECK((factory == "affine" ? loop.ok : loop.failed).load() == 400);
}
