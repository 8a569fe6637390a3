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
//   blockflow-worker --join tcp://SESSION_HOST:PORT --name NAME [--once]
//
// where the session has a worker NAME with WorkerOptions::listen = "tcp://ADDR:PORT". When the
// session stops it, or goes silent, the worker drops its blocks and joins again (--once: exits).

#include <blockflow/detail/worker_launch.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <zmq.hpp>

#include <dlfcn.h>
#include <execinfo.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <optional>
#include <stdexcept>
#include <thread>

namespace {

struct Args {
  std::string name, control, requests, results;
  pid_t parent = 0;
  bool join = false;  // on another host: --join; no parent
  bool once = false;
};

constexpr const char* kUsage =
    "usage: blockflow-worker --join tcp://SESSION_HOST:PORT --name NAME [--once]\n"
    "   or: blockflow-worker --name N --control EP --requests EP --results EP --parent PID "
    "(how a session starts its child workers)";

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--once") {
      a.once = true;
      --i;
      continue;
    }
    if (i + 1 >= argc) throw std::invalid_argument(fmt::format("{} needs a value\n{}", k, kUsage));
    const std::string v = argv[i + 1];
    if (k == "--name") a.name = v;
    else if (k == "--join") {
      a.control = v;
      a.join = true;
    } else if (k == "--control") a.control = v;
    else if (k == "--requests") a.requests = v;
    else if (k == "--results") a.results = v;
    else if (k == "--parent") a.parent = static_cast<pid_t>(std::stol(v));
    else throw std::invalid_argument(fmt::format("unknown argument {}\n{}", k, kUsage));
  }
  if (a.join) {
    if (a.name.empty() || a.control.rfind("tcp://", 0) != 0 || a.parent != 0) {
      throw std::invalid_argument(fmt::format("--join takes tcp://HOST:PORT and a --name\n{}", kUsage));
    }
  } else if (a.name.empty() || a.control.empty() || a.requests.empty() || a.results.empty() || a.parent == 0) {
    throw std::invalid_argument(kUsage);
  }
  return a;
}

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::int64_t rss_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * ::sysconf(_SC_PAGESIZE);
}

// The runtime module: $BLOCKFLOW_WORKER_RUNTIME, else beside this executable (a build tree), else
// in ../lib* (an install).
BlockflowWorkerServeFn load_runtime() {
  static BlockflowWorkerServeFn serve = nullptr;
  if (serve != nullptr) return serve;
  namespace fs = std::filesystem;
  std::vector<fs::path> candidates;
  if (const char* env = std::getenv("BLOCKFLOW_WORKER_RUNTIME"); env != nullptr && *env != '\0') candidates.emplace_back(env);
  std::error_code ec;
  const fs::path dir = fs::read_symlink("/proc/self/exe", ec).parent_path();
  const char* file = "libblockflow_worker_runtime.so";
  candidates.push_back(dir / file);
  for (const char* lib : {"lib", "lib64", "lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu"}) {
    candidates.push_back(dir.parent_path() / lib / file);
  }
  std::string tried;
  for (const auto& c : candidates) {
    if (!fs::exists(c, ec)) {
      tried += " " + c.string();
      continue;
    }
    void* handle = ::dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) throw std::runtime_error(fmt::format("cannot load {}: {}", c.string(), ::dlerror()));
    serve = reinterpret_cast<BlockflowWorkerServeFn>(::dlsym(handle, "blockflow_worker_serve"));
    if (serve == nullptr) throw std::runtime_error(fmt::format("{} lacks blockflow_worker_serve", c.string()));
    return serve;
  }
  throw std::runtime_error("worker runtime not found; tried" + tried);
}

// One incarnation: hello, configuration, then the runtime serves. Returns its exit status.
int serve_once(const Args& args, int incarnation, bool& stopped_by_host) {
  zmq::context_t context(1);
  zmq::socket_t control(context, zmq::socket_type::dealer);
  control.set(zmq::sockopt::routing_id, fmt::format("{}-{}-{}", args.name, ::getpid(), incarnation));
  control.set(zmq::sockopt::linger, 0);
  control.connect(args.control);
  auto send = [&](const nlohmann::json& m) { (void)control.send(zmq::buffer(m.dump()), zmq::send_flags::none); };
  // Says hello (a joining worker again every second: the session may not be listening yet, or may
  // be busy with another worker of the same name) until the configuration arrives.
  std::optional<std::string> config;
  std::int64_t next_hello = 0;
  while (!config && (args.join || ::getppid() == args.parent)) {
    if (now_ns() >= next_hello) {
      send({{"type", "hello"}, {"pid", ::getpid()}, {"name", args.name}, {"rss_bytes", rss_bytes()}});
      next_hello = args.join ? now_ns() + 1'000'000'000 : std::numeric_limits<std::int64_t>::max();
    }
    zmq::pollitem_t item{control.handle(), 0, ZMQ_POLLIN, 0};
    zmq::poll(&item, 1, std::chrono::milliseconds(200));
    if ((item.revents & ZMQ_POLLIN) == 0) continue;
    zmq::message_t message;
    if (!control.recv(message, zmq::recv_flags::dontwait)) continue;
    const auto json = nlohmann::json::parse(message.to_string(), nullptr, false);
    if (!json.is_discarded() && json.value("type", "") == "config") config = message.to_string();
  }
  if (!config) return 1;  // the parent died while we waited
  BlockflowWorkerServeFn serve = nullptr;
  try {
    serve = load_runtime();
  } catch (const std::exception& e) {
    send({{"type", "load_error"}, {"message", fmt::format("worker {}: {}", args.name, e.what())}});
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // let the message leave
    throw;
  }
  BlockflowWorkerLaunch launch{args.name.c_str(), args.control.c_str(), args.requests.c_str(), args.results.c_str(),
                               static_cast<long>(args.parent), args.join ? 1 : 0, control.handle(), config->c_str(), 0};
  const int rc = serve(&launch);
  stopped_by_host = launch.stopped_by_host != 0;
  return rc;
}

}  // namespace

// A worker that crashes logs its stack on stderr (the host's log) before it dies of the signal, so
// that "worker w1 killed by signal 11" comes with a where.
void log_crash(int sig) {
  void* frames[64];
  const int n = ::backtrace(frames, 64);
  static const char header[] = "blockflow-worker: fatal signal; stack:\n";
  (void)!::write(STDERR_FILENO, header, sizeof(header) - 1);
  ::backtrace_symbols_fd(frames, n, STDERR_FILENO);
  std::signal(sig, SIG_DFL);
  ::raise(sig);
}

int main(int argc, char** argv) try {
  for (int sig : {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT}) std::signal(sig, log_crash);
  Args args = parse(argc, argv);
  if (!args.join) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // no orphans: die with the host
    if (::getppid() != args.parent) return 1;  // the host died before the line above
    bool stopped = false;
    return serve_once(args, 0, stopped);
  }
  std::cerr << fmt::format("blockflow-worker {}: joining {}\n", args.name, args.control);
  for (int incarnation = 0;; ++incarnation) {
    bool stopped = false;
    const int rc = serve_once(args, incarnation, stopped);
    if (args.once) return rc;
    std::cerr << fmt::format("blockflow-worker {}: {}; joining again\n", args.name,
                             stopped ? "stopped by the session" : "the session went silent");
    std::this_thread::sleep_for(std::chrono::seconds(1));
  }
} catch (const std::exception& e) {
  std::cerr << "blockflow-worker: " << e.what() << "\n";
  return 2;
}
