// The fork server (blockflow/worker/fork_server.hpp). The cases tagged [fork_server] run in a test
// process that started a fork server first in main() (ctest's `fork_server` area sets
// BLOCKFLOW_TEST_FORK_SERVER=1, and GOMP_SPINCOUNT=10000 so that the workers' default environment
// lets them be forked); they are hidden from a plain run of the binary. The rest run anywhere.
#include "worker_util.hpp"

#include <blockflow/worker/detail/fork_server.hpp>
#include <blockflow/core/detail/process_state.hpp>
#include <blockflow/worker/fork_server.hpp>

#include <fmt/format.h>

#include <fcntl.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <sstream>
#include <thread>
#include <vector>

extern int blockflow_test_pipe_before_fork_server[2];  // main.cpp

using namespace blockflow;
using Catch::Matchers::Contains;

namespace {

pid_t parent_of(std::int64_t pid) { return static_cast<pid_t>(blockflow::detail::process_parent(pid)); }
int threads_of(pid_t pid) { return blockflow::detail::process_threads(pid); }

// How many of `pid`'s descriptors lead to `target` (a /proc/PID/fd link's text, e.g. "pipe:[123]").
int holds_descriptor_of(pid_t pid, const std::string& target) {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(fmt::format("/proc/{}/fd", pid))) {
    std::error_code ec;
    const auto link = std::filesystem::read_symlink(entry.path(), ec);
    if (!ec && link.string() == target) ++count;
  }
  return count;
}


}  // namespace

TEST_CASE("a worker forked from the fork server is its child, runs TorchScript and C++ blocks, and equals threads",
          "[.][fork_server]") {
  REQUIRE(fork_server_running());
  auto w1 = make_worker(test::test_worker("w1", "shm"));
  auto w2 = make_worker(test::test_worker("w2"));
  Session threads, workers;
  threads.add_block(test::model_block("b1", "cnn_block1.pt", "", {-1, 3, 16, 16})).add_path(Path::chain("t", {"b1"}));
  workers.add_site(w1).add_site(w2)
      .add_block(test::model_block("b1", "cnn_block1.pt", "w1", {-1, 3, 16, 16}))
      .add_block(test::plugin_block("a", "affine", "w2"))
      .add_path(Path::chain("t", {"b1", "a"}));
  test::require_started(threads);
  test::require_started(workers);
  for (const auto& w : {w1, w2}) {
    CHECK(w->stats().forked);
    const pid_t parent = parent_of(w->pid());
    CHECK(parent != 0);
    CHECK(parent != ::getpid());  // the fork server's
  }
  CHECK(parent_of(w1->pid()) == parent_of(w2->pid()));
  // The application's inheritable pipe (main.cpp) is held by neither the server nor its workers.
  REQUIRE(blockflow_test_pipe_before_fork_server[1] >= 0);
  const std::string pipe_name =
      std::filesystem::read_symlink(fmt::format("/proc/self/fd/{}", blockflow_test_pipe_before_fork_server[1])).string();
  for (const pid_t holder : {parent_of(w1->pid()), static_cast<pid_t>(w1->pid())}) {
    INFO("process " << holder);
    CHECK(holds_descriptor_of(holder, pipe_name) == 0);
  }
  // The server ran libtorch once before forking (a small module loaded, optimised and run) and
  // still has one thread: a thread made there would be missing in every forked worker.
  CHECK(threads_of(parent_of(w1->pid())) == 1);
  at::manual_seed(5);
  for (int i = 0; i < 4; ++i) {
    const auto [a, b] = test::both_ok(threads, workers, "t", at::randn({1 + i % 2, 3, 16, 16}));
    CHECK(at::allclose(a.output() * 3 + 1, b.output()));  // then "affine" (3x+1) in w2
  }
  const auto m = workers.metrics();
  REQUIRE(m.sites.size() == 2);
  CHECK(m.sites[0].forked);
  CHECK(m.sites[0].shm_requests.handles > 0);  // zero-copy to a forked worker as to any other
  const std::int64_t pid = w1->pid();
  workers.shutdown();
  CHECK(test::eventually([&] { return !test::process_exists(pid); }));  // reaped by the server
}

TEST_CASE("kill -9 of a forked worker under load: named by its signal, restarted by a fork, traffic flows",
          "[.][fork_server]") {
  auto site = make_worker(test::test_worker("w2"));
  Session session;
  session.add_site(site).add_block(test::plugin_block("slow", "slow_identity", "w2")).add_path(Path::chain("t", {"slow"}));
  test::require_started(session);
  const std::int64_t first_pid = site->pid();
  REQUIRE(site->stats().forked);
  test::LoadClients load(session, "t", at::ones({4}), 3, "worker w2 killed by signal 9");  // the server's wait status
  load.check_kill_under_load(first_pid, 20);
  CHECK(site->pid() != first_pid);
  CHECK(site->stats().forked);
  CHECK(parent_of(site->pid()) != ::getpid());
  CHECK(session.metrics().sites.at(0).restarts == 1);
}

TEST_CASE("a worker whose environment changes a variable read at load is started as a program, saying why",
          "[.][fork_server]") {
  test::LogLines log;
  WorkerOptions spin = test::test_worker("w3");
  spin.environment.push_back("GOMP_SPINCOUNT=12345");  // the later entry wins
  WorkerOptions off = test::test_worker("w4");
  off.fork = false;
  WorkerOptions malloc_only = test::test_worker("w5");
  malloc_only.environment.push_back("MALLOC_ARENA_MAX=2");  // applied by mallopt() in a forked worker
  auto w3 = make_worker(spin), w4 = make_worker(off), w5 = make_worker(malloc_only);
  Session session;
  session.add_site(w3).add_site(w4).add_site(w5)
      .add_block(test::plugin_block("a", "affine", "w3"))
      .add_block(test::plugin_block("b", "affine", "w4"))
      .add_block(test::plugin_block("c", "affine", "w5"))
      .add_path(Path::chain("t", {"a", "b", "c"}));
  test::require_started(session);
  CHECK_FALSE(w3->stats().forked);
  CHECK(parent_of(w3->pid()) == ::getpid());
  CHECK(log.contains("worker w3: started as a new process, not forked from the fork server: GOMP_SPINCOUNT=12345 "
                     "(the fork server has GOMP_SPINCOUNT=10000)"));
  CHECK_FALSE(w4->stats().forked);
  CHECK(parent_of(w4->pid()) == ::getpid());
  CHECK_FALSE(log.contains("worker w4: started as a new process"));  // not asked for: nothing to say
  CHECK(w5->stats().forked);
  Result r = session.submit("t", at::ones({2})).get();
  REQUIRE(r.ok());
  CHECK(at::allclose(r.output(), at::full({2}, 40.0)));  // ((3x+1)*3+1)*3+1 at x = 1
}

TEST_CASE("start_fork_server() refuses a process that has threads, naming how many", "[worker]") {
  if (fork_server_running()) return;  // started in main(): a second call starts nothing
  std::atomic<bool> stop{false};
  std::thread other([&] {
    while (!stop) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  const absl::Status status = start_fork_server();
  stop = true;
  other.join();
  CHECK(absl::IsFailedPrecondition(status));
  CHECK_THAT(std::string(status.message()), Contains("threads; call it first in main()"));
  CHECK_FALSE(fork_server_running());
}

TEST_CASE("the fork server's environment check: variables read at load must match, MALLOC_* tuning need not",
          "[worker]") {
  blockflow::detail::ForkServer server(-1, 0, {"GOMP_SPINCOUNT=10000", "MALLOC_TRIM_THRESHOLD_=5", "HOME=/root", "OMP_NUM_THREADS=2"});
  const std::vector<std::string> same = {"GOMP_SPINCOUNT=10000", "MALLOC_TRIM_THRESHOLD_=5", "OMP_NUM_THREADS=2"};
  CHECK(server.unforkable(same).empty());
  auto with = [&](std::vector<std::string> extra) {
    auto env = same;
    env.insert(env.end(), extra.begin(), extra.end());
    return env;
  };
  CHECK(server.unforkable(with({"HOME=/tmp", "BLOCKFLOW_X=1"})).empty());  // not read at load: set in the fork
  CHECK(server.unforkable(with({"MALLOC_TRIM_THRESHOLD_=7", "MALLOC_MMAP_THRESHOLD_=9"})).empty());  // mallopt()
  CHECK(server.unforkable({"GOMP_SPINCOUNT=1", "MALLOC_TRIM_THRESHOLD_=5", "OMP_NUM_THREADS=2"}) ==
        "GOMP_SPINCOUNT=1 (the fork server has GOMP_SPINCOUNT=10000)");
  CHECK(server.unforkable({"GOMP_SPINCOUNT=10000", "MALLOC_TRIM_THRESHOLD_=5"}) ==
        "OMP_NUM_THREADS unset (the fork server has OMP_NUM_THREADS=2)");
  CHECK(server.unforkable(with({"LD_PRELOAD=/x.so"})) == "LD_PRELOAD=/x.so (the fork server has it unset)");
  CHECK(server.unforkable(with({"MALLOC_PERTURB_=3"})) == "MALLOC_PERTURB_=3 (the fork server has it unset)");
  CHECK(blockflow::detail::read_when_loaded("GOMP_SPINCOUNT"));
  CHECK(blockflow::detail::read_when_loaded("ASAN_OPTIONS"));
  CHECK_FALSE(blockflow::detail::read_when_loaded("BLOCKFLOW_WORKER"));
}

namespace fork_server_test {

// A process that stands for a forked worker: this test process is its parent.
pid_t spawn_sleeper() {
  pid_t pid = 0;
  char sleep_path[] = "/bin/sleep";
  char seconds[] = "120";
  char* argv[] = {sleep_path, seconds, nullptr};
  char* envp[] = {nullptr};
  return ::posix_spawn(&pid, sleep_path, nullptr, nullptr, argv, envp) == 0 ? pid : -1;
}

// One answer of the server, with `fd` attached when it is not -1 (closed here).
void answer(int socket, const std::string& text, int fd) {
  (void)blockflow::detail::send_datagram(socket, text, fd);
  if (fd >= 0) ::close(fd);
}

}  // namespace fork_server_test

TEST_CASE("a fork the server answers too late is killed when its answer comes; statuses are still read", "[worker]") {
  using namespace fork_server_test;
  int pair[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) == 0);
  const pid_t on_time = spawn_sleeper(), late = spawn_sleeper();
  REQUIRE(on_time > 0);
  REQUIRE(late > 0);
  auto pidfd_of = [](pid_t pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); };
  std::promise<void> gave_up;
  // The server's end, played by this thread: it answers the first fork at once, and the second
  // only after the application gave up on it; then it reports the first worker killed by signal 9.
  std::thread server([&, application_gave_up = gave_up.get_future()]() mutable {
    std::string request(65536, '\0');
    (void)::recv(pair[1], request.data(), request.size(), 0);
    answer(pair[1], fmt::format(R"({{"pid":{},"id":1}})", on_time), pidfd_of(on_time));
    (void)::recv(pair[1], request.data(), request.size(), 0);
    application_gave_up.wait();
    answer(pair[1], fmt::format(R"({{"pid":{},"id":2}})", late), pidfd_of(late));
    answer(pair[1], fmt::format(R"({{"exited":{},"id":1,"status":9}})", on_time), -1);
  });
  blockflow::detail::ForkServer forks(pair[0], /*server=*/0, {}, std::chrono::milliseconds(2000));
  auto first = forks.fork_worker({"blockflow-worker"}, {}, "/nonexistent");
  auto second = forks.fork_worker({"blockflow-worker"}, {}, "/nonexistent");
  gave_up.set_value();
  ::shutdown(pair[0], SHUT_WR);  // a server still waiting for a request (a test gone wrong) stops
  server.join();
  REQUIRE(first.ok());
  CHECK(first->pid == on_time);
  CHECK(first->id == 1);
  REQUIRE_FALSE(second.ok());
  CHECK_THAT(std::string(second.status().message()), Contains("did not answer within 2000 ms"));
  // The first worker's status is still read; on the way, the late answer's worker is killed.
  CHECK(forks.exit_status(1, std::chrono::seconds(30)) == std::optional<int>(9));
  int status = 0;
  REQUIRE(::waitpid(late, &status, 0) == late);
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGKILL);
  // Not asked again.
  auto third = forks.fork_worker({"blockflow-worker"}, {}, "/nonexistent");
  REQUIRE_FALSE(third.ok());
  CHECK_THAT(std::string(third.status().message()), Contains("left a fork unanswered"));
  ::kill(on_time, SIGKILL);
  (void)::waitpid(on_time, &status, 0);
  ::close(first->pidfd);
  ::close(pair[1]);
}

TEST_CASE("an answer whose pidfd this process had no descriptor for: the server is asked to kill that worker",
          "[worker]") {
  using namespace fork_server_test;
  int pair[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) == 0);
  const pid_t worker = spawn_sleeper();
  REQUIRE(worker > 0);
  const int worker_pidfd = static_cast<int>(::syscall(SYS_pidfd_open, worker, 0));
  REQUIRE(worker_pidfd >= 0);
  // The server's end, played by this thread: it answers the fork with the worker's pidfd, then
  // takes the next message, which must ask for that worker's death.
  std::string next(65536, '\0');
  std::thread server([&] {
    std::string request(65536, '\0');
    (void)::recv(pair[1], request.data(), request.size(), 0);
    // Kept open until the end: closing it here could free a number for the answer's descriptor.
    (void)blockflow::detail::send_datagram(pair[1], fmt::format(R"({{"pid":{},"id":7}})", worker), worker_pidfd);
    const ssize_t n = ::recv(pair[1], next.data(), next.size(), 0);
    next.resize(n > 0 ? static_cast<std::size_t>(n) : 0);
  });
  blockflow::detail::ForkServer forks(pair[0], /*server=*/0, {}, std::chrono::milliseconds(20000));
  // No descriptor number is free here while the answer is read (RLIMIT_NOFILE lowered and filled).
  rlimit was{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &was) == 0);
  rlimit low = was;
  low.rlim_cur = std::min<rlim_t>(was.rlim_cur, 512);
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &low) == 0);
  std::vector<int> fillers;
  for (int fd; (fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0;) fillers.push_back(fd);
  auto forked = forks.fork_worker({"blockflow-worker"}, {}, "/nonexistent");
  for (const int fd : fillers) ::close(fd);
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &was) == 0);
  ::shutdown(pair[0], SHUT_WR);  // a server still waiting (a test gone wrong) stops
  server.join();
  REQUIRE_FALSE(forked.ok());
  CHECK(forked.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(forked.status().message()),
             Contains(fmt::format("lost the pidfd of worker {}", worker)) && Contains("RLIMIT_NOFILE"));
  CHECK(next == R"({"kill":7})");
  ::close(worker_pidfd);
  ::kill(worker, SIGKILL);
  int status = 0;
  (void)::waitpid(worker, &status, 0);
  ::close(pair[1]);
}

TEST_CASE("a forked worker takes the application's working directory, umask and limits of the moment it is asked for",
          "[.][fork_server]") {
  REQUIRE(fork_server_running());
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / fmt::format("bf-fork-cwd-{}", ::getpid());
  std::filesystem::create_directories(dir);
  struct Removed {
    std::filesystem::path dir;
    ~Removed() { test::remove_tree(dir.string()); }
  } removed{dir};
  const auto was_dir = std::filesystem::current_path();
  const mode_t was_mask = ::umask(027);
  rlimit was_files{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &was_files) == 0);
  REQUIRE(was_files.rlim_cur > 256);
  rlimit files = was_files;
  files.rlim_cur -= 7;  // the fork server keeps the limit it started with
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &files) == 0);
  std::filesystem::current_path(dir);
  auto w = make_worker(test::test_worker("w8"));
  Session session;
  session.add_site(w).add_block(test::plugin_block("a", "affine", "w8")).add_path(Path::chain("t", {"a"}));
  const absl::Status started = session.start();
  std::filesystem::current_path(was_dir);
  ::umask(was_mask);
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &was_files) == 0);
  REQUIRE(started.ok());
  REQUIRE(w->stats().forked);
  const pid_t pid = static_cast<pid_t>(w->pid());
  CHECK(std::filesystem::read_symlink(fmt::format("/proc/{}/cwd", pid)) == std::filesystem::canonical(dir));
  std::ifstream status(fmt::format("/proc/{}/status", pid));
  std::string line, umask_line;
  while (std::getline(status, line)) {
    if (line.rfind("Umask:", 0) == 0) umask_line = line;
  }
  CHECK(umask_line == "Umask:\t0027");
  rlimit seen{};
  REQUIRE(::prlimit(pid, RLIMIT_NOFILE, nullptr, &seen) == 0);
  CHECK(seen.rlim_cur == files.rlim_cur);
}

// Last of the [fork_server] cases (Catch runs them in this order): it ends the process's fork server.
TEST_CASE("a fork server that dies is logged with its signal; later workers start as programs and serve",
          "[.][fork_server]") {
  test::LogLines log;
  pid_t server = 0;
  {
    auto w = make_worker(test::test_worker("w6"));
    Session session;
    session.add_site(w).add_block(test::plugin_block("a", "affine", "w6")).add_path(Path::chain("t", {"a"}));
    test::require_started(session);
    REQUIRE(w->stats().forked);
    server = parent_of(w->pid());
  }
  REQUIRE(server > 0);
  REQUIRE(server != ::getpid());
  REQUIRE(::kill(server, SIGKILL) == 0);
  const std::string line = fmt::format("the fork server (pid {}) killed by signal 9", server);
  CHECK(test::eventually([&] {
    (void)blockflow::detail::ForkServer::get();  // notices the hung-up socket
    return log.contains(line);
  }));
  CHECK_FALSE(fork_server_running());
  auto w = make_worker(test::test_worker("w7"));
  Session session;
  session.add_site(w).add_block(test::plugin_block("a", "affine", "w7")).add_path(Path::chain("t", {"a"}));
  test::require_started(session);
  CHECK_FALSE(w->stats().forked);
  CHECK(parent_of(w->pid()) == ::getpid());
  Result r = session.submit("t", at::ones({2})).get();
  REQUIRE(r.ok());
  CHECK(at::allclose(r.output(), at::full({2}, 4.0)));
}
