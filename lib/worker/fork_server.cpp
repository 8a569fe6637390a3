// The fork server (blockflow/worker/fork_server.hpp): its process, which forks workers on request
// and reaps them, and the application's end of it (detail/fork_server.hpp).
//
// Messages are JSON, one per SOCK_SEQPACKET datagram:
//   application -> server  {"argv": [...], "environment": [...], "launcher_dir": "...", "context": {"cwd": "...",
//                          "umask": N, "rlimits": [[RESOURCE, CUR, MAX], ...]}} (fork_environment.cpp)
//                          {"kill": ID}: kill the worker of fork ID, not yet reaped (its answer
//                          came without its pidfd); not answered
//   server -> application  {"pid": N, "id": ID} with the worker's pidfd (SCM_RIGHTS), or {"error": "..."};
//                          {"exited": N, "id": ID, "status": WAIT_STATUS} whenever it has reaped a worker.
#include <blockflow/core/detail/log.hpp>
#include <blockflow/core/detail/omp_width.hpp>
#include <blockflow/worker/fork_server.hpp>
#include <blockflow/worker/detail/child_process.hpp>
#include <blockflow/worker/detail/fork_server.hpp>
#include <blockflow/worker/detail/launch_worker.hpp>
#include <blockflow/core/detail/process_state.hpp>

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/passes/freeze_module.h>
#include <torch/csrc/jit/passes/frozen_graph_optimizations.h>

#include <dirent.h>
#include <fcntl.h>
#include <malloc.h>
#include <pthread.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

namespace blockflow {
namespace detail {

namespace {
constexpr std::size_t kMaxMessage = 256 * 1024;
}  // namespace

bool send_datagram(int socket, const std::string& text, int fd) {
  if (text.size() > kMaxMessage) {
    errno = EMSGSIZE;
    return false;
  }
  iovec iov{const_cast<char*>(text.data()), text.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
  }
  while (true) {
    if (::sendmsg(socket, &msg, MSG_NOSIGNAL) == static_cast<ssize_t>(text.size())) return true;
    if (errno != EINTR) return false;
  }
}

namespace {

enum class Received { kMessage, kNone, kClosed };

// Receives one datagram (`flags`: MSG_DONTWAIT or 0); a file descriptor that came with it goes to
// `fd` (close-on-exec), or is closed when `fd` is null. `descriptors_lost` (when not null) tells
// whether descriptors sent with it were dropped (MSG_CTRUNC: this process had no free descriptor
// number, RLIMIT_NOFILE).
Received receive_message(int socket, int flags, std::string& text, int* fd, bool* descriptors_lost = nullptr) {
  text.resize(kMaxMessage);
  iovec iov{text.data(), text.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t n = 0;
  do {
    n = ::recvmsg(socket, &msg, flags | MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK ? Received::kNone : Received::kClosed;
  if (n == 0) return Received::kClosed;
  text.resize(static_cast<std::size_t>(n));
  if (descriptors_lost != nullptr) *descriptors_lost = (msg.msg_flags & MSG_CTRUNC) != 0;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    int received = -1;
    std::memcpy(&received, CMSG_DATA(c), sizeof received);
    if (fd != nullptr && *fd < 0) *fd = received;
    else ::close(received);
  }
  return Received::kMessage;
}

int pidfd_open(pid_t pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); }

// --- the server process -------------------------------------------------------------------------

// This process's open descriptors, read from /proc/self/fd (the directory's own excepted).
std::vector<int> open_descriptors() {
  std::vector<int> open;
  if (DIR* fds = ::opendir("/proc/self/fd")) {
    while (const dirent* entry = ::readdir(fds)) {
      const int fd = std::atoi(entry->d_name);
      if (entry->d_name[0] == '.' || fd == ::dirfd(fds)) continue;
      open.push_back(fd);
    }
    ::closedir(fds);
  }
  return open;
}

// What exec would have done: caught signals back to their default (ignored ones stay ignored), and
// the descriptors marked close-on-exec closed.
void as_if_exec() {
  for (int sig = 1; sig < NSIG; ++sig) {
    struct sigaction action {};
    if (sig == SIGKILL || sig == SIGSTOP || ::sigaction(sig, nullptr, &action) != 0) continue;
    if ((action.sa_flags & SA_SIGINFO) != 0 || (action.sa_handler != SIG_DFL && action.sa_handler != SIG_IGN)) {
      ::signal(sig, SIG_DFL);
    }
  }
  for (const int fd : open_descriptors()) {
    const int flags = ::fcntl(fd, F_GETFD);
    if (flags >= 0 && (flags & FD_CLOEXEC) != 0) ::close(fd);
  }
}

// A forked worker: started as if exec'd, with the environment an exec'd one would have, then
// blockflow-worker's work. Never returns: nothing may unwind into the application's main().
[[noreturn]] void run_worker(const nlohmann::json& request, const sigset_t& mask) noexcept {
  int rc = 2;
  try {
    ::sigprocmask(SIG_SETMASK, &mask, nullptr);
    as_if_exec();
    const auto environment = request.at("environment").get<std::vector<std::string>>();
    ::clearenv();
    for (const auto& e : environment) ::putenv(::strdup(e.c_str()));  // putenv keeps the string
    apply_malloc_environment(environment);
    apply_process_context(request.value("context", nlohmann::json::object()));  // the application's, at the request
    ::prctl(PR_SET_NAME, "bf-worker");  // 15 characters at most
    auto args = request.at("argv").get<std::vector<std::string>>();
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    log_worker_crashes();
    rc = launch_worker(static_cast<int>(args.size()), argv.data(), request.at("launcher_dir").get<std::string>());
  } catch (const std::exception& e) {
    std::cerr << blockflow::detail::worker_label() << ": " << e.what() << "\n";
  } catch (...) {
    std::cerr << blockflow::detail::worker_label() << ": unknown exception\n";
  }
  std::fflush(nullptr);
  ::_exit(rc);  // not exit(): the application's atexit handlers and static destructors are not the worker's
}

// The server's children by pid, each with the number of its fork: a report names both, so that a
// status is never taken for that of a later worker that got the same pid.
struct Children {
  std::map<pid_t, std::uint64_t> ids;
  std::uint64_t forks = 0;
};

// Forks the worker a request asks for and answers it; or kills the worker a request names.
void fork_one(int socket, int signals, const std::string& text, const sigset_t& mask, Children& children) {
  nlohmann::json request = nlohmann::json::parse(text, nullptr, false);
  if (!request.is_discarded() && request.contains("kill")) {
    // A child not yet reaped: its pid cannot have gone to another process.
    const auto id = request["kill"].is_number_unsigned() ? request["kill"].get<std::uint64_t>() : 0;
    for (const auto& [pid, fork] : children.ids) {
      if (fork == id) ::kill(pid, SIGKILL);
    }
    return;
  }
  if (request.is_discarded() || !request.contains("argv") || !request.contains("environment") ||
      !request.contains("launcher_dir")) {
    (void)send_datagram(socket, nlohmann::json{{"error", "malformed request"}}.dump(), -1);
    return;
  }
  auto& argv = request["argv"];
  for (std::size_t i = 0; i + 1 < argv.size(); ++i) {
    if (argv[i] == "--parent") argv[i + 1] = std::to_string(::getpid());  // the worker's parent is this process
  }
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(signals);
    ::close(socket);
    run_worker(request, mask);
  }
  if (child < 0) {
    (void)send_datagram(socket, nlohmann::json{{"error", fmt::format("fork: {}", std::strerror(errno))}}.dump(), -1);
    return;
  }
  const int pidfd = pidfd_open(child);  // not reaped before this: only this thread reaps
  if (pidfd < 0) {  // unreachable without it: it must not live on beside the worker started instead
    const int error = errno;
    ::kill(child, SIGKILL);
    (void)send_datagram(socket, nlohmann::json{{"error", fmt::format("pidfd_open: {}", std::strerror(error))}}.dump(), -1);
    return;
  }
  const std::uint64_t id = ++children.forks;
  children.ids[child] = id;
  if (!send_datagram(socket, nlohmann::json{{"pid", child}, {"id", id}}.dump(), pidfd)) ::kill(child, SIGKILL);  // nobody knows of it
  ::close(pidfd);
}

[[noreturn]] void serve_loop(int socket, pid_t application);

// Makes libtorch's lazily made state once, here, so that no forked worker makes it again: the
// TorchScript compiler and executor, freezing and optimize_for_inference's passes, oneDNN's start.
// A small convolution module goes through them as a block's load and warm-up would. With one
// OpenMP thread: a team made here would not exist in the forked workers. Measured on the build
// machine (2 cores): four children forked after it loaded, optimised and ran one ResNet50 block
// each (one thread) in 240-261 ms, against 297-335 ms without; it takes about 30 ms, while the
// application goes on with its own start.
void prepare_libtorch() noexcept {
  try {
    (void)at::get_num_threads();  // this thread's lazy setting of its OpenMP width first, so that the next line holds
    struct Width {  // restored however this ends: forked workers' main threads inherit it
      int width = detail::thread_omp_width();
      ~Width() { detail::set_thread_omp_width(width); }
    } restore;
    detail::set_thread_omp_width(1);
    {
      torch::jit::Module module("blockflow_prepare");
      module.register_parameter("w", at::ones({8, 3, 3, 3}), /*is_buffer=*/false);
      module.define("def forward(self, x):\n  return torch.relu(torch.conv2d(x, self.w))\n");
      module.eval();
      torch::jit::Module frozen = torch::jit::freeze(module);
      torch::jit::Module optimized = torch::jit::optimize_for_inference(frozen);
      c10::InferenceMode inference_mode;
      for (int run = 0; run < 2; ++run) (void)optimized.forward({at::zeros({1, 3, 16, 16})});
    }
  } catch (...) {  // only time is lost
  }
}

// The server process's body. Never returns: nothing may unwind into the application's main().
[[noreturn]] void serve(int socket, pid_t application) noexcept {
  try {
    serve_loop(socket, application);
  } catch (...) {
  }
  ::_exit(1);
}

[[noreturn]] void serve_loop(int socket, pid_t application) {
  ::prctl(PR_SET_NAME, "bf-forkserver");
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // dies with the application (its workers then die with it)
  if (::getppid() != application) ::_exit(0);
  // The application's descriptors are not the server's: it keeps 0-2 and its socket, as a spawned
  // worker gets 0-2 only (child_process.cpp), so no forked worker holds a pipe end, file or socket
  // of the application open for its whole life either.
  for (const int fd : open_descriptors()) {
    if (fd > 2 && fd != socket) ::close(fd);
  }
  ::signal(SIGCHLD, SIG_DFL);  // reaped here, whatever the application had set
  sigset_t chld, mask;
  sigemptyset(&chld);
  sigaddset(&chld, SIGCHLD);
  ::sigprocmask(SIG_BLOCK, &chld, &mask);
  const int signals = ::signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
  if (signals < 0) ::_exit(1);
  prepare_libtorch();
  std::string text;
  Children children;
  while (true) {
    pollfd fds[2] = {{socket, POLLIN, 0}, {signals, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      ::_exit(1);
    }
    if ((fds[1].revents & POLLIN) != 0) {
      signalfd_siginfo info{};
      while (::read(signals, &info, sizeof info) == static_cast<ssize_t>(sizeof info)) {
      }
      int status = 0;
      for (pid_t p; (p = ::waitpid(-1, &status, WNOHANG)) > 0;) {
        const auto it = children.ids.find(p);
        if (it == children.ids.end()) continue;  // not a worker (none else is forked here)
        (void)send_datagram(socket, nlohmann::json{{"exited", p}, {"id", it->second}, {"status", status}}.dump(), -1);
        children.ids.erase(it);
      }
    }
    if ((fds[0].revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
      if (receive_message(socket, 0, text, nullptr) != Received::kMessage) ::_exit(0);  // the application is gone
      fork_one(socket, signals, text, mask, children);
    }
  }
}

std::atomic<ForkServer*> the_server{nullptr};

}  // namespace

// --- the application's end ----------------------------------------------------------------------

struct ForkServer::State {
  int socket = -1;
  pid_t server = 0;
  std::map<std::string, std::string> environment;  // the server's, by name
  std::mutex mu;
  bool gone = false;                  // the server closed its end
  // It let a fork go unanswered past answer_timeout: asked for no more forks, but still read (its
  // statuses, and the late answers, whose workers nobody supervises and are killed).
  bool unanswered = false;
  int abandoned = 0;  // forks asked for whose answers nobody waits for (the server answers in order)
  std::chrono::milliseconds answer_timeout{10'000};
  std::map<std::uint64_t, int> exits;  // wait statuses reported and not yet asked for, by fork number
};

ForkServer::ForkServer(int socket, pid_t server, std::vector<std::string> environment,
                       std::chrono::milliseconds answer_timeout)
    : state_(std::make_unique<State>()) {
  state_->answer_timeout = answer_timeout;
  state_->socket = socket;
  state_->server = server;
  state_->environment = by_name(environment);
}

ForkServer::~ForkServer() {
  if (state_->socket >= 0) ::close(state_->socket);
}

namespace {

// The server's socket hung up: it has exited or is exiting. Reaped on a thread of its own, which
// waits for as long as that takes (a WNOHANG look right after the hang-up may come too early and
// leave a zombie).
void reap_server(pid_t server) {
  std::thread([server] {
    int status = 0, rc = 0;
    while ((rc = ::waitpid(server, &status, 0)) < 0 && errno == EINTR) {
    }
    log(LogLevel::kWarning, fmt::format("the fork server (pid {}) {}: workers start as new processes from now on",
                                        server, rc == server ? describe_exit(status) : "ended"));
  }).detach();
}

}  // namespace

ForkServer* ForkServer::reporting() {
  ForkServer* s = the_server.load(std::memory_order_acquire);
  if (s == nullptr) return nullptr;
  {
    std::lock_guard lock(s->state_->mu);
    if (!s->state_->gone) {  // a server that died shows as a hung-up socket
      pollfd p{s->state_->socket, 0, 0};
      s->state_->gone = ::poll(&p, 1, 0) == 1 && (p.revents & (POLLHUP | POLLERR)) != 0;
      if (s->state_->gone) reap_server(s->state_->server);  // no zombie left
    }
    if (s->state_->gone) return nullptr;
  }
  s->drain_late_answers();
  return s;
}

ForkServer* ForkServer::get() {
  ForkServer* s = reporting();
  if (s == nullptr) return nullptr;
  std::lock_guard lock(s->state_->mu);
  return s->state_->unanswered ? nullptr : s;
}

namespace {

// Takes in one message (waiting up to `timeout_ms`, -1: until one comes); the reply of a fork goes
// to `reply` (and its pidfd to `fd`), reaped workers' statuses to `exits` (by fork number). kClosed
// once the server is gone; kNone when nothing came in time.
// An answer that comes while `abandoned` > 0 is one whose fork timed out: its worker is killed.
Received take_one(int socket, int timeout_ms, std::map<std::uint64_t, int>& exits, int& abandoned,
                  std::optional<nlohmann::json>* reply, int* fd) {
  pollfd p{socket, POLLIN, 0};
  int ready = 0;
  do {
    ready = ::poll(&p, 1, timeout_ms);
  } while (ready < 0 && errno == EINTR);
  if (ready <= 0) return Received::kNone;
  std::string text;
  int received_fd = -1;
  bool descriptors_lost = false;
  const Received r = receive_message(socket, MSG_DONTWAIT, text, &received_fd, &descriptors_lost);
  if (r != Received::kMessage) return r;
  auto m = nlohmann::json::parse(text, nullptr, false);
  if (!m.is_discarded() && !m.contains("exited") && m.contains("pid") && received_fd < 0) {
    // A worker this end cannot supervise (no pidfd came: e.g. none was free here) must not live
    // on: the server, its parent, kills it (by fork number, never by a pid that may be reused).
    (void)send_datagram(socket, nlohmann::json{{"kill", m.value("id", std::uint64_t{0})}}.dump(), -1);
    m["descriptors_lost"] = descriptors_lost;
  }
  if (!m.is_discarded() && m.contains("exited")) {
    exits[m.value("id", std::uint64_t{0})] = m.value("status", 0);
    if (exits.size() > 4096) exits.erase(exits.begin());  // statuses nobody asked for stay bounded
  } else if (!m.is_discarded() && abandoned > 0) {
    --abandoned;
    if (received_fd >= 0) (void)::syscall(SYS_pidfd_send_signal, received_fd, SIGKILL, nullptr, 0);
  } else if (!m.is_discarded() && reply != nullptr) {
    *reply = m;
    if (fd != nullptr) *fd = std::exchange(received_fd, -1);
  }
  if (received_fd >= 0) ::close(received_fd);
  return Received::kMessage;
}

}  // namespace

absl::StatusOr<ForkServer::Forked> ForkServer::fork_worker(const std::vector<std::string>& argv,
                                                           const std::vector<std::string>& environment,
                                                           const std::string& launcher_dir) {
  State& s = *state_;
  std::lock_guard lock(s.mu);
  if (s.gone) return absl::UnavailableError("the fork server is gone");
  if (s.unanswered) return absl::UnavailableError("the fork server left a fork unanswered");
  std::string request;
  try {
    request = nlohmann::json{{"argv", argv}, {"environment", environment}, {"launcher_dir", launcher_dir},
                             {"context", process_context()}}.dump();
  } catch (const nlohmann::json::exception& e) {  // e.g. a variable whose value is not UTF-8
    return absl::InvalidArgumentError(fmt::format("its command line or environment cannot be sent: {}", e.what()));
  }
  if (!send_datagram(s.socket, request, -1)) {
    const int error = errno;
    if (error != EMSGSIZE) {
      s.gone = true;
      reap_server(s.server);
    }
    return absl::UnavailableError(fmt::format("cannot reach the fork server: {}", std::strerror(error)));
  }
  std::optional<nlohmann::json> reply;
  int fd = -1;
  const auto deadline = std::chrono::steady_clock::now() + s.answer_timeout;
  while (!reply) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      // A server that does not answer is not asked again; its answer, should it come, is read and
      // its worker killed (nobody supervises it), and its workers' statuses are still read.
      s.unanswered = true;
      ++s.abandoned;
      return absl::UnavailableError(
          fmt::format("the fork server did not answer within {} ms", s.answer_timeout.count()));
    }
    if (take_one(s.socket, static_cast<int>(left.count()), s.exits, s.abandoned, &reply, &fd) == Received::kClosed) {
      s.gone = true;
      reap_server(s.server);
      return absl::UnavailableError("the fork server is gone");
    }
  }
  if (reply->contains("error")) {
    if (fd >= 0) ::close(fd);
    return absl::UnavailableError(fmt::format("the fork server could not fork: {}", reply->value("error", "")));
  }
  Forked out;
  out.pid = reply->value("pid", pid_t{0});
  out.pidfd = fd;
  out.id = reply->value("id", std::uint64_t{0});
  if (out.pid <= 0 || out.pidfd < 0 || out.id == 0) {
    if (fd >= 0) {  // a worker nobody could supervise must not live on
      (void)::syscall(SYS_pidfd_send_signal, fd, SIGKILL, nullptr, 0);
      ::close(fd);
    }
    if (out.pid > 0 && reply->value("descriptors_lost", false)) {
      return absl::ResourceExhaustedError(fmt::format(
          "the fork server's answer lost the pidfd of worker {} (this process had no free descriptor: "
          "RLIMIT_NOFILE); the server killed it",
          out.pid));
    }
    return absl::UnavailableError(out.pid > 0 ? fmt::format("the fork server answered without a pidfd for worker {}; "
                                                            "the server killed it",
                                                            out.pid)
                                              : std::string("the fork server answered without a process"));
  }
  return out;
}

void ForkServer::drain_late_answers() {
  State& s = *state_;
  std::lock_guard lock(s.mu);
  while (!s.gone && s.abandoned > 0) {
    const Received r = take_one(s.socket, 0, s.exits, s.abandoned, nullptr, nullptr);
    if (r == Received::kClosed) {
      s.gone = true;
      reap_server(s.server);
    }
    if (r != Received::kMessage) return;
  }
}

std::optional<int> ForkServer::exit_status(std::uint64_t id, std::chrono::milliseconds wait) {
  State& s = *state_;
  std::lock_guard lock(s.mu);
  const auto deadline = std::chrono::steady_clock::now() + wait;
  while (true) {
    if (auto it = s.exits.find(id); it != s.exits.end()) {
      const int status = it->second;
      s.exits.erase(it);
      return status;
    }
    if (s.gone) return std::nullopt;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    // Past the deadline: only what has arrived already (a zero wait reads without blocking).
    const Received r =
        take_one(s.socket, static_cast<int>(std::max<std::int64_t>(0, left.count())), s.exits, s.abandoned, nullptr, nullptr);
    if (r == Received::kClosed) {
      s.gone = true;
      reap_server(s.server);
    }
    if (r == Received::kNone && left.count() <= 0) return std::nullopt;
  }
}

std::string ForkServer::unforkable(const std::vector<std::string>& environment) const {
  const auto wanted = by_name(environment);
  const auto& have = state_->environment;
  auto differs = [&](const std::string& name) -> std::string {
    const auto w = wanted.find(name);
    const auto h = have.find(name);
    if (w != wanted.end() && h != have.end() && w->second == h->second) return "";
    if (w == wanted.end() && h == have.end()) return "";
    if (w != wanted.end() && applied_by_mallopt(name)) return "";  // mallopt() applies it
    return fmt::format("{} (the fork server has {})", w == wanted.end() ? name + " unset" : name + "=" + w->second,
                       h == have.end() ? "it unset" : name + "=" + h->second);
  };
  for (const auto& [name, value] : wanted) {
    if (!read_when_loaded(name)) continue;
    if (auto why = differs(name); !why.empty()) return why;
  }
  for (const auto& [name, value] : have) {
    if (!read_when_loaded(name)) continue;
    if (auto why = differs(name); !why.empty()) return why;
  }
  return "";
}

}  // namespace detail

absl::Status start_fork_server() {
  static std::mutex starting;
  std::lock_guard lock(starting);
  if (detail::the_server.load() != nullptr) return absl::OkStatus();
  if (const int threads = detail::process_threads(0); threads != 1) {
    return absl::FailedPreconditionError(fmt::format(
        "start_fork_server(): this process has {} threads; call it first in main(), before anything starts a thread",
        threads));
  }
  int pair[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) != 0) {
    return absl::InternalError(fmt::format("start_fork_server(): socketpair: {}", std::strerror(errno)));
  }
  // What libraries read when they loaded: the environment the process started with (a setenv()
  // in main() before this call came too late for them).
  std::vector<std::string> environment;
  {
    std::ifstream initial("/proc/self/environ", std::ios::binary);
    for (std::string entry; std::getline(initial, entry, '\0');) {
      if (!entry.empty()) environment.push_back(entry);
    }
  }
  if (const int probe = detail::pidfd_open(::getpid()); probe >= 0) {
    ::close(probe);
  } else {
    return absl::UnavailableError(fmt::format("start_fork_server(): pidfd_open: {} (Linux 5.3 or later needed)",
                                              std::strerror(errno)));
  }
  const pid_t application = ::getpid();
  std::fflush(nullptr);  // nothing buffered is written twice
  const pid_t server = ::fork();
  if (server < 0) {
    const int error = errno;
    ::close(pair[0]);
    ::close(pair[1]);
    return absl::InternalError(fmt::format("start_fork_server(): fork: {}", std::strerror(error)));
  }
  if (server == 0) {
    ::close(pair[0]);
    detail::serve(pair[1], application);
  }
  ::close(pair[1]);
  detail::the_server.store(new detail::ForkServer(pair[0], server, std::move(environment)), std::memory_order_release);
  // A child this process forks without exec is not the server's owner: it starts its workers as programs.
  (void)::pthread_atfork(nullptr, nullptr, [] { detail::the_server.store(nullptr); });
  return absl::OkStatus();
}

bool fork_server_running() { return detail::ForkServer::get() != nullptr; }

}  // namespace blockflow
