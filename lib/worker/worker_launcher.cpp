// blockflow-worker: hosts blocks of a session in a child process (or on another host).
//
// Started by the session (posix_spawn) with the endpoints of its private directory, it says hello
// over the control channel and waits for its configuration. This executable links neither libtorch
// nor BlockFlow, so an idle worker costs a few MB: only when the configuration has arrived does it
// load the worker runtime (libblockflow_worker_runtime.so, beside it or in ../lib), which builds
// and warms the blocks up and serves them. It dies with its parent (PR_SET_PDEATHSIG) and exits if
// the parent changed before that was set.
//
// On another host it is started by hand (or by systemd) and joins a session over TCP:
//
//   blockflow-worker --join tcp://SESSION_HOST:PORT --name NAME [--plugin LIB.so]... [--models DIR]
//                    [--key NAME.key_secret --session-key SESSION.key] [--once]
//
// where the session has a worker NAME with WorkerOptions::listen = "tcp://ADDR:PORT". When the
// session stops it, or goes silent, the worker drops its blocks and joins again (--once: exits).
// Nothing from the wire chooses code or files: such a worker loads only the plugins given with
// --plugin and TorchScript files inside --models (symbolic links and `..` resolved); a session
// configuration that names anything else fails its start, naming the path and the option.
// With --key and --session-key every socket to the session talks CURVE (blockflow/curve.hpp): the
// session admits only the key it holds as NAME.key, and the worker only the session's key.

#include <blockflow/worker/detail/launch_worker.hpp>

#include <exception>
#include <iostream>

int main(int argc, char** argv) try {
  blockflow::detail::log_worker_crashes();
  return blockflow::detail::launch_worker(argc, argv, "");
} catch (const std::exception& e) {
  std::cerr << blockflow::detail::worker_label() << ": " << e.what() << "\n";
  return 2;
}
