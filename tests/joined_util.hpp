#pragma once
// Helpers for the tests of workers that join over TCP: a free port, and `blockflow-worker` started
// as an operator on another host would start it.

#include "worker_util.hpp"

#include <fcntl.h>
#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace blockflow::test {

/// A TCP port on the loopback nobody listens on right now (the kernel's choice for an ephemeral bind).
inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0);
  socklen_t length = sizeof address;
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0);
  ::close(fd);
  return ntohs(address.sin_port);
}

/// `blockflow-worker args...`; its stderr goes to `log` when one is given. Killed (SIGKILL) and
/// reaped by the destructor if it still runs.
class WorkerProcess {
 public:
  explicit WorkerProcess(const std::vector<std::string>& args, std::string log = "") : log_(std::move(log)) {
    std::vector<std::string> all = {BLOCKFLOW_TEST_WORKER};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    if (!log_.empty()) {
      posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    }
    const int rc = ::posix_spawn(&pid_, BLOCKFLOW_TEST_WORKER, &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    REQUIRE(rc == 0);
  }
  /// `blockflow-worker --join endpoint --name name --once more...`.
  static std::vector<std::string> join_args(const std::string& endpoint, const std::string& name,
                                            const std::vector<std::string>& more = {}) {
    std::vector<std::string> args = {"--join", endpoint, "--name", name, "--once"};
    args.insert(args.end(), more.begin(), more.end());
    return args;
  }
  ~WorkerProcess() {
    if (pid_ > 0) kill();
  }
  WorkerProcess(const WorkerProcess&) = delete;
  WorkerProcess& operator=(const WorkerProcess&) = delete;

  pid_t pid() const { return pid_; }
  /// Its wait status once it has exited within `within`, else nullopt (it keeps running).
  std::optional<int> exit_status(std::chrono::milliseconds within) {
    if (pid_ <= 0) return exited_;
    const auto deadline = std::chrono::steady_clock::now() + within;
    int status = 0;
    do {
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = 0;
        exited_ = status;
        return status;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    } while (std::chrono::steady_clock::now() < deadline);
    return std::nullopt;
  }
  /// SIGKILL, then reaps it.
  void kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = 0;
    exited_ = status;
  }
  /// What it wrote on stderr so far (with a log).
  std::string log() const {
    std::stringstream text;
    text << std::ifstream(log_).rdbuf();
    return text.str();
  }

 private:
  std::string log_;
  pid_t pid_ = 0;
  std::optional<int> exited_;
};

}  // namespace blockflow::test
