#pragma once
/// @file
/// @brief A fork server for worker processes: a copy of the application made at the start of
/// main(), with libtorch already loaded, from which worker processes are forked instead of started
/// as new programs that each load libtorch again (docs/workers.md, "Fork server").
///
/// @code
/// int main(int argc, char** argv) {
///   if (auto started = blockflow::start_fork_server(); !started.ok()) std::cerr << started << "\n";
///   ...  // sessions made from here on fork their workers from it
/// }
/// @endcode
///
/// Starting a worker process then costs a fork and the worker's own blocks, not libtorch's start
/// (about 0.3 s of CPU per worker on the build machine, paid by every worker at once on a cold
/// start). A worker is forked when WorkerOptions::fork is on (the default), its executable is the
/// default blockflow-worker, and its environment sets every variable that libraries read when they
/// load (OpenMP's GOMP_* and OMP_*, glibc's LD_* and GLIBC_TUNABLES, the sanitizers', MKL's, ...)
/// to what this process had when the server started: a forked worker cannot read those again.
/// glibc's MALLOC_* tuning variables are the exception: the forked worker applies them with
/// mallopt(). A worker that differs is started as a new program, and the session logs once per
/// worker which variable kept it from being forked. WorkerOptions::environment's default sets
/// GOMP_SPINCOUNT=10000: start the application with it in its environment, or set
/// WorkerOptions::environment without it, for those workers to be forked.
#include <absl/status/status.h>

namespace blockflow {

/// @brief Starts this process's fork server. Call it first in main(), before anything has started
/// a thread: the server is a fork of this process as it is then, and every worker is a fork of the
/// server, so neither may inherit a lock that another thread held or an OpenMP team (libtorch makes
/// one at its first parallel op). It also must run before CUDA is initialised.
///
/// The server lives until this process exits (it dies with it) and reaps the workers it forks;
/// each worker dies with the server. A second call returns OK and starts nothing.
/// @return FailedPrecondition naming the thread count when the process has more than one thread;
/// Unavailable where pidfd_open() is missing (Linux < 5.3); Internal when the server cannot be made.
absl::Status start_fork_server();

/// @brief Whether this process's fork server was started and still answers.
bool fork_server_running();

}  // namespace blockflow
