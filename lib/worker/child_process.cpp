// A worker process, started by posix_spawn or forked from the fork server (child_process.hpp).
#include <blockflow/worker/detail/child_process.hpp>
#include <blockflow/worker/detail/fork_server.hpp>
#include <blockflow/core/detail/process_state.hpp>

#include <fmt/format.h>

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <thread>
#include <utility>

namespace blockflow::detail {

namespace {
constexpr int kPidfdIdType = 3;  // P_PIDFD (Linux 5.4), which older C libraries do not name
}  // namespace

std::string describe_exit(int status) {
  if (WIFSIGNALED(status)) return fmt::format("killed by signal {}", WTERMSIG(status));
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  return "stopped";
}

absl::StatusOr<ChildProcess> ChildProcess::start(const Spec& spec, std::string* not_forked) {
  ChildProcess out;
  if (ForkServer* server = spec.fork ? ForkServer::get() : nullptr; server != nullptr) {
    std::string why = server->unforkable(spec.environment);
    if (why.empty()) {
      const std::string dir = std::filesystem::path(spec.executable).parent_path().string();
      auto forked = server->fork_worker(spec.argv, spec.environment, dir);
      if (forked.ok()) {
        out.pid_ = forked->pid;
        out.pidfd_ = forked->pidfd;
        out.fork_id_ = forked->id;
        return out;
      }
      why = std::string(forked.status().message());
    }
    if (not_forked != nullptr) *not_forked = why;
  }
  std::vector<std::string> args = spec.argv, env = spec.environment;
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  // The worker gets standard input, output and error, and nothing else of this process: no
  // descriptor the application left inheritable (a pipe's end, a listening socket), and none of
  // ours opened at this moment on another thread without close-on-exec (an ifstream). Nor the
  // signal mask of the thread starting it (a site's control thread, or whoever called start()).
  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attributes;
  posix_spawn_file_actions_init(&actions);
  posix_spawnattr_init(&attributes);
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 34))
  (void)posix_spawn_file_actions_addclosefrom_np(&actions, 3);
#endif
  sigset_t none;
  sigemptyset(&none);
  (void)posix_spawnattr_setsigmask(&attributes, &none);
  (void)posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETSIGMASK);
  pid_t child = 0;
  const int rc = ::posix_spawn(&child, spec.executable.c_str(), &actions, &attributes, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attributes);
  if (rc != 0) return absl::UnavailableError(fmt::format("cannot start '{}': {}", spec.executable, std::strerror(rc)));
  out.pid_ = child;
  // Our unreaped child keeps its pid, but an application that ignores SIGCHLD (or reaps on its
  // own) lets the kernel give it to another process the moment it exits: signals and waits go
  // through a pidfd, which names this process only. Without one (an old kernel), by pid as before.
  out.pidfd_ = static_cast<int>(::syscall(SYS_pidfd_open, child, 0));  // close-on-exec
  return out;
}

ChildProcess::ChildProcess(ChildProcess&& other) noexcept
    : pid_(std::exchange(other.pid_, 0)), pidfd_(std::exchange(other.pidfd_, -1)), fork_id_(std::exchange(other.fork_id_, 0)),
      gone_since_(std::exchange(other.gone_since_, std::nullopt)) {}

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  if (this != &other) {
    reset();
    pid_ = std::exchange(other.pid_, 0);
    pidfd_ = std::exchange(other.pidfd_, -1);
    fork_id_ = std::exchange(other.fork_id_, 0);
    gone_since_ = std::exchange(other.gone_since_, std::nullopt);
  }
  return *this;
}

ChildProcess::~ChildProcess() { reset(); }

void ChildProcess::reset() {
  if (pidfd_ >= 0) ::close(pidfd_);
  pidfd_ = -1;
  pid_ = 0;
  fork_id_ = 0;
  gone_since_.reset();
}

std::optional<std::string> ChildProcess::exited() {
  if (pid_ == 0) return std::nullopt;
  if (fork_id_ == 0 && pidfd_ >= 0) {  // spawned: reap this very process, whatever its pid is now
    siginfo_t info{};
    if (::waitid(static_cast<idtype_t>(kPidfdIdType), static_cast<id_t>(pidfd_), &info, WEXITED | WNOHANG) == 0) {
      if (info.si_pid == 0) return std::nullopt;  // still running
      std::string how = info.si_code == CLD_EXITED ? fmt::format("exited with status {}", info.si_status)
                                                   : fmt::format("killed by signal {}", info.si_status);
      reset();
      return how;
    }
    if (errno == ECHILD) {
      reset();  // reaped by someone else (the application ignores SIGCHLD): how is not known
      return std::string("exited");
    }
    // EINVAL: a kernel with pidfd_open() but not waitid(P_PIDFD) (Linux 5.3): by pid below, which
    // is this process's while it is unreaped (the pidfd still serves kill()).
  }
  if (pidfd_ < 0 || fork_id_ == 0) {
    int status = 0;
    const pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == 0 || (r < 0 && errno != ECHILD)) return std::nullopt;
    // ECHILD: reaped by someone else (the application ignores SIGCHLD): how is not known.
    std::string how = r == pid_ ? describe_exit(status) : "exited";
    reset();
    return how;
  }
  pollfd p{pidfd_, POLLIN, 0};  // readable once the process has exited
  if (::poll(&p, 1, 0) != 1) return std::nullopt;
  // The server reaps it and reports its status at once: until that report is read (exiting() is
  // true meanwhile), nothing waits for it here. A server gone, or silent for 10 s, leaves it unknown.
  const auto now = std::chrono::steady_clock::now();
  if (!gone_since_) gone_since_ = now;
  ForkServer* server = ForkServer::reporting();
  const auto status = server != nullptr ? server->exit_status(fork_id_, std::chrono::milliseconds(0)) : std::nullopt;
  if (!status && server != nullptr && now - *gone_since_ < std::chrono::seconds(10)) return std::nullopt;
  reset();
  return status ? describe_exit(*status) : std::string("exited");
}

bool ChildProcess::exiting() const {
  if (pid_ == 0) return true;
  if (pidfd_ >= 0) {  // gone once the pidfd is readable; until then the pid is still this process's
    pollfd p{pidfd_, POLLIN, 0};
    if (::poll(&p, 1, 0) == 1) return true;
  }
  return process_exiting(pid_);
}

void ChildProcess::kill() const {
  if (pid_ == 0) return;
  if (pidfd_ >= 0) (void)::syscall(SYS_pidfd_send_signal, pidfd_, SIGKILL, nullptr, 0);
  else (void)::kill(pid_, SIGKILL);
}

std::string ChildProcess::stop(std::chrono::milliseconds grace) {
  const auto deadline = std::chrono::steady_clock::now() + grace;
  while (std::chrono::steady_clock::now() < deadline) {
    if (auto how = exited()) return *how;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill();
  // A process in an uninterruptible sleep (a driver's teardown, a read from a dead NFS server)
  // outlives SIGKILL: it is not waited for beyond kKilledWait, lest its site's stop() and the
  // session's shutdown() wait with it. A thread of its own reaps a spawned one when it goes (the
  // fork server reaps those it forked).
  const auto killed_deadline = std::chrono::steady_clock::now() + kKilledWait;
  while (std::chrono::steady_clock::now() < killed_deadline) {
    if (auto how = exited()) return *how;
    if (pid_ == 0) return "gone";
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const std::string how = fmt::format("did not exit within {} s of SIGKILL (pid {}; reaped once it does)",
                                      std::chrono::duration_cast<std::chrono::seconds>(kKilledWait).count(), pid_);
  if (fork_id_ == 0 && pidfd_ >= 0) {
    const int pidfd = std::exchange(pidfd_, -1);
    try {
      std::thread([pidfd] {
        siginfo_t info{};
        (void)::waitid(static_cast<idtype_t>(kPidfdIdType), static_cast<id_t>(pidfd), &info, WEXITED);
        ::close(pidfd);
      }).detach();
    } catch (const std::system_error&) {  // no thread: it stays a zombie once it exits
      ::close(pidfd);
    }
  }
  reset();
  return how;
}

}  // namespace blockflow::detail
