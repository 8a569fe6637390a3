#pragma once
// Internal: what blockflow-worker does after its start-up (lib/worker/worker_launch.cpp), callable
// from its main() and from a worker forked by a fork server (fork_server.hpp), which runs no new
// executable. Linked into both without libtorch or BlockFlow.

#include <string>

namespace blockflow::detail {

/// "blockflow-worker NAME (pid P)" once launch_worker() has read the command line, "blockflow-worker"
/// before: what the worker's messages on stderr (its host's) begin with.
std::string& worker_label();

/// Installs the handlers that print a crashing worker's stack on stderr before it dies of the signal.
void log_worker_crashes();

/// Parses `argv` as blockflow-worker's command line and runs the worker: says hello, waits for its
/// configuration, loads the runtime module (libblockflow_worker_runtime.so: $BLOCKFLOW_WORKER_RUNTIME,
/// else in `launcher_dir`, else in its ../lib*; `launcher_dir` "" is this executable's directory) and
/// serves until its host stops it or goes away. Returns the exit status; throws
/// std::invalid_argument for a bad command line and std::runtime_error when no runtime loads.
int launch_worker(int argc, char** argv, const std::string& launcher_dir);

}  // namespace blockflow::detail
