#pragma once
// Internal: the application's end of its fork server (blockflow/worker/fork_server.hpp).
//
// The server process (lib/worker/fork_server.cpp) forks a worker for each request it is sent over a
// SOCK_SEQPACKET socket pair: the worker's command line (blockflow-worker's), its whole environment
// and where blockflow-worker lies. It answers with the worker's pid and a pidfd for it (SCM_RIGHTS),
// reaps its workers, and reports each one's wait status. This end serialises the requests of every
// site of the process.

#include <absl/status/statusor.h>
#include <nlohmann/json.hpp>

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace blockflow::detail {

class ForkServer {
 public:
  /// This process's fork server, to fork from; null when none was started, it is gone, or it left
  /// a fork unanswered (asked for no more).
  static ForkServer* get();
  /// This process's fork server while its socket is open: its workers' statuses may still come
  /// (exit_status()), even after it left a fork unanswered.
  static ForkServer* reporting();

  struct Forked {
    pid_t pid = 0;
    int pidfd = -1;       ///< owned by the caller (close-on-exec)
    std::uint64_t id = 0;  ///< the server's number for this fork (1, 2, ...): what exit_status() takes
  };
  /// Forks a worker running blockflow-worker's `argv` (its "--parent" value is replaced by the
  /// server's pid, the worker's parent) with exactly `environment`; `launcher_dir` is where
  /// blockflow-worker lies (the runtime module is looked for from there). Unavailable when the
  /// server is gone.
  absl::StatusOr<Forked> fork_worker(const std::vector<std::string>& argv, const std::vector<std::string>& environment,
                                     const std::string& launcher_dir);
  /// The wait status of the worker of fork `id` (Forked::id) once the server has reaped it; waits
  /// up to `wait`. By fork, not by pid: a later worker may get the pid of one whose status is unread.
  std::optional<int> exit_status(std::uint64_t id, std::chrono::milliseconds wait);
  /// Why a worker with `environment` cannot be forked from the server: "" when it can, else the
  /// variable read when a library loads whose value differs from the server's (e.g.
  /// "GOMP_SPINCOUNT=10000 (the fork server has it unset)").
  [[nodiscard]] std::string unforkable(const std::vector<std::string>& environment) const;

  /// The application's end: `socket` (owned; -1: none, for tests of unforkable()), the server's
  /// pid, and the environment the server has. The process's one (get()) is never destroyed. A fork
  /// not answered within `answer_timeout` fails, and no fork is asked for again.
  ForkServer(int socket, pid_t server, std::vector<std::string> environment,
             std::chrono::milliseconds answer_timeout = std::chrono::seconds(10));
  ~ForkServer();
  ForkServer(const ForkServer&) = delete;
  ForkServer& operator=(const ForkServer&) = delete;

 private:
  struct State;
  // With forks left unanswered: reads what has come (without waiting), so that a late answer's
  // worker is killed at the next look at the server, not only when another worker exits.
  void drain_late_answers();
  std::unique_ptr<State> state_;
};

/// One datagram of the fork server's protocol on `socket` (SOCK_SEQPACKET), with `fd` attached
/// (SCM_RIGHTS) when it is not -1 (the caller keeps it); false, errno set, when it was not sent.
bool send_datagram(int socket, const std::string& text, int fd);

/// "NAME=VALUE" entries by name (fork_environment.cpp, as the rest below).
std::map<std::string, std::string> by_name(const std::vector<std::string>& environment);

/// Whether mallopt() applies the glibc tuning variable `name` (MALLOC_ARENA_MAX, ...).
bool applied_by_mallopt(const std::string& name);

/// True for an environment variable that a library reads when it loads (so a forked process keeps
/// its parent's value), except glibc's MALLOC_* settings that mallopt() can apply afterwards.
bool read_when_loaded(const std::string& name);

/// Applies glibc's MALLOC_* tuning variables of `environment` with mallopt() (a forked worker's
/// allocator was set up before they were given).
void apply_malloc_environment(const std::vector<std::string>& environment);

/// This process's working directory, umask and resource limits now, for a fork request: a forked
/// worker takes them as an exec'd one inherits them (not the server's, from when it started).
nlohmann::json process_context();

/// In a forked worker: takes on process_context()'s directory, umask and limits, as far as it can.
void apply_process_context(const nlohmann::json& context);

}  // namespace blockflow::detail
