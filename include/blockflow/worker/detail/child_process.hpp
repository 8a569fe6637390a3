#pragma once
// Internal: a worker process a WorkerSite started, by posix_spawn of its executable or forked from
// the process's fork server (fork_server.hpp), and what the site does with it: see whether it has
// exited (reaping it), kill it, wait for it. A forked worker is the fork server's child: it is
// reached through a pidfd (no signal can reach another process that took its pid) and its wait
// status comes from the server.

#include <absl/status/statusor.h>

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace blockflow::detail {

class ChildProcess {
 public:
  struct Spec {
    std::string executable;                ///< blockflow-worker, or the one WorkerOptions names
    std::vector<std::string> argv;         ///< argv[0] included
    std::vector<std::string> environment;  ///< the whole environment ("NAME=VALUE")
    /// Fork it from the fork server when one runs and the environment allows (the executable must be
    /// BlockFlow's blockflow-worker: the forked process runs its code, not the file's).
    bool fork = false;
  };
  /// Starts the process. With spec.fork and a fork server running that cannot take it,
  /// `not_forked` gets why (the variable at fault, or the server's error) and the process is
  /// started by posix_spawn instead. The error names the executable.
  static absl::StatusOr<ChildProcess> start(const Spec& spec, std::string* not_forked);

  ChildProcess() = default;
  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess();  ///< lets go of the process (does not kill it)

  [[nodiscard]] pid_t pid() const { return pid_; }
  [[nodiscard]] bool forked() const { return fork_id_ != 0; }
  /// How it ended ("killed by signal 9", "exited with status 1") once it has, reaping it; nullopt
  /// while it runs (and, for a forked worker, until the fork server's report of its status has
  /// come: exiting() is true meanwhile). Does not wait for that report (it may wait for the fork
  /// server's lock while another site's fork is answered). After a value, the object holds no process.
  std::optional<std::string> exited();
  /// True once it has begun to exit (detail::process_exiting()), or is gone.
  [[nodiscard]] bool exiting() const;
  /// SIGKILL.
  void kill() const;
  /// Waits up to `grace` for it to exit, then kills it and waits for that, kKilledWait at most;
  /// returns how it ended (or that it did not). After it, the object holds no process.
  std::string stop(std::chrono::milliseconds grace);
  static constexpr std::chrono::seconds kKilledWait{30};

 private:
  void reset();
  pid_t pid_ = 0;
  int pidfd_ = -1;               // signals and waits go through it: never to a process that reused the pid
  std::uint64_t fork_id_ = 0;    // a forked worker's: the fork server's number for it (its status's key)
  std::optional<std::chrono::steady_clock::time_point> gone_since_;  // a forked worker's exit seen, its status not yet read
};

/// "killed by signal N", "exited with status N" or "stopped", for a waitpid() status.
std::string describe_exit(int status);

}  // namespace blockflow::detail
