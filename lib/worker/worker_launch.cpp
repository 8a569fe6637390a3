// The work of blockflow-worker (worker_launcher.cpp) after its start-up, as a function: parsing its
// command line, the hello and configuration handshake, loading the runtime module and serving. The
// executable calls it from main(); a worker forked from a fork server (fork_server.cpp) calls it in
// the forked child, where libtorch is already loaded.
//
// Links neither libtorch nor BlockFlow (only libzmq, fmt and the CURVE key reader), so that an idle
// blockflow-worker costs a few MB.

#include <blockflow/channel/detail/curve_keys.hpp>
#include <blockflow/channel/detail/zmq_calls.hpp>
#include <blockflow/core/detail/flag_number.hpp>
#include <blockflow/core/detail/utf8_text.hpp>
#include <blockflow/worker/detail/launch_worker.hpp>
#include <blockflow/worker/detail/worker_launch.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <dlfcn.h>
#include <execinfo.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Args {
  std::string name, control, requests, results;
  pid_t parent = 0;
  bool join = false;  // on another host: --join; no parent
  bool once = false;
  std::vector<std::string> plugins;  // --plugin (join): canonical paths
  std::string models;                // --models (join): canonical directory, "" when not given
  std::string key, session_key;      // --key, --session-key (join): CURVE key files, both or neither
};

constexpr const char* kUsage =
    "usage: blockflow-worker --join tcp://SESSION_HOST:PORT --name NAME [--plugin LIB.so]... [--models DIR]\n"
    "                        [--key NAME.key_secret --session-key SESSION.key] [--once]\n"
    "       (--plugin: a plugin the session may ask for; --models: where its TorchScript files may lie;\n"
    "        --key, --session-key: talk CURVE, with this worker's key pair and the session's public key,\n"
    "        made with `blockflowctl keygen`)\n"
    "   or: blockflow-worker --name N --control EP --requests EP --results EP --parent PID "
    "(how a session starts its child workers)";

// The allowed files as the runtime compares them: canonical (symbolic links resolved), and there.
void canonicalize_allowed(Args& a) {
  namespace fs = std::filesystem;
  std::error_code ec;
  for (auto& p : a.plugins) {
    const fs::path c = fs::canonical(p, ec);
    if (ec || !fs::is_regular_file(c)) throw std::invalid_argument(fmt::format("--plugin {}: no such file", p));
    p = c.string();
  }
  if (a.models.empty()) return;
  const fs::path c = fs::canonical(a.models, ec);
  if (ec || !fs::is_directory(c)) throw std::invalid_argument(fmt::format("--models {}: no such directory", a.models));
  a.models = c.string();
}

// Both key files or neither, and readable now: a typo fails at start, not as a silent refusal.
void check_keys(const Args& a) {
  if (a.key.empty() && a.session_key.empty()) return;
  if (a.key.empty() || a.session_key.empty()) {
    throw std::invalid_argument("CURVE needs both --key (this worker's NAME.key_secret) and --session-key (the session's .key)");
  }
  blockflow::detail::KeyFile pair, session;
  std::string error;
  if (!blockflow::detail::read_key_file(a.key, /*need_secret=*/true, pair, error) ||
      !blockflow::detail::read_key_file(a.session_key, /*need_secret=*/false, session, error)) {
    throw std::invalid_argument(error);
  }
}

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
    else if (k == "--parent") a.parent = blockflow::detail::flag_number<pid_t>(k, v, 1, std::numeric_limits<pid_t>::max());
    else if (k == "--plugin") a.plugins.push_back(v);
    else if (k == "--models") a.models = v;
    else if (k == "--key") a.key = v;
    else if (k == "--session-key") a.session_key = v;
    else throw std::invalid_argument(fmt::format("unknown argument {}\n{}", k, kUsage));
  }
  if (a.join) {
    if (a.name.empty() || a.control.rfind("tcp://", 0) != 0 || a.parent != 0) {
      throw std::invalid_argument(fmt::format("--join takes tcp://HOST:PORT and a --name\n{}", kUsage));
    }
    canonicalize_allowed(a);
    check_keys(a);
  } else if (!a.plugins.empty() || !a.models.empty() || !a.key.empty() || !a.session_key.empty()) {
    throw std::invalid_argument(
        "--plugin, --models, --key and --session-key are for --join (a child worker loads what its session names "
        "and talks to it on this host)");
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

// The runtime module: $BLOCKFLOW_WORKER_RUNTIME, else in `launcher_dir` (a build tree), else in
// its ../lib* (an install).
BlockflowWorkerServeFn load_runtime(const std::filesystem::path& dir) {
  static BlockflowWorkerServeFn serve = nullptr;
  if (serve != nullptr) return serve;
  namespace fs = std::filesystem;
  std::vector<fs::path> candidates;
  if (const char* env = std::getenv("BLOCKFLOW_WORKER_RUNTIME"); env != nullptr && *env != '\0') candidates.emplace_back(env);
  std::error_code ec;
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

// A joining worker's view of its handshakes: a refused key or a wrong session key shows on this
// host's terminal (once per kind), and a session that never answers gets a hint after 10 s.
class HandshakeWatch {
 public:
  HandshakeWatch(zmq::context_t& context, zmq::socket_t& control, const Args& args) : args_(args), started_(now_ns()) {
    if (!args.join) return;
    const std::string endpoint = fmt::format("inproc://blockflow-worker-handshake-{}", reinterpret_cast<std::uintptr_t>(this));
    if (zmq_socket_monitor(control.handle(), endpoint.c_str(),
                           ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                               ZMQ_EVENT_HANDSHAKE_FAILED_AUTH | ZMQ_EVENT_HANDSHAKE_SUCCEEDED) != 0) {
      return;  // no monitor: the silence hint still comes
    }
    monitor_ = zmq::socket_t(context, zmq::socket_type::pair);
    monitor_.set(zmq::sockopt::linger, 0);
    monitor_.connect(endpoint);
  }
  void* handle() { return monitor_ ? monitor_.handle() : nullptr; }

  void report() {
    std::vector<zmq::message_t> event;
    if (!zmq::recv_multipart(monitor_, std::back_inserter(event), zmq::recv_flags::dontwait) || event.empty() ||
        event[0].size() < 6) {
      return;
    }
    std::uint16_t kind = 0;
    std::uint32_t value = 0;
    std::memcpy(&kind, event[0].data(), sizeof kind);
    std::memcpy(&value, static_cast<const char*>(event[0].data()) + 2, sizeof value);
    if (kind == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
      answered_ = true;
      return;
    }
    if (reported_.count(kind) != 0) return;
    reported_.insert(kind);
    const char* why = kind == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH
                          ? "the session refused this worker's key (it admits a worker NAME only with the key it holds as NAME.key)"
                      : args_.key.empty() ? "the session talks CURVE: start this worker with --key and --session-key"
                                          : "check --session-key: it must be the session's public key";
    std::cerr << fmt::format("blockflow-worker {}: handshake with {} failed ({}, {}): {}\n", args_.name, args_.control,
                             kind == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH ? "refused" : "protocol", value, why);
  }

  void hint_if_silent() {
    if (answered_ || hinted_ || now_ns() - started_ < 10'000'000'000) return;
    hinted_ = true;
    std::cerr << fmt::format("blockflow-worker {}: no answer from {} for 10 s; still trying (is the session started, "
                             "with a worker '{}' listening there{}?)\n",
                             args_.name, args_.control, args_.name,
                             args_.key.empty() ? ", and without CURVE keys" : ", and holding this worker's public key");
  }

 private:
  const Args& args_;
  const std::int64_t started_;
  zmq::socket_t monitor_;
  std::set<std::uint16_t> reported_;
  bool answered_ = false, hinted_ = false;
};

// One incarnation: hello, configuration, then the runtime serves. Returns its exit status.
int serve_once(const Args& args, const std::filesystem::path& launcher_dir, int incarnation, bool& stopped_by_host) {
  zmq::context_t context(1);
  zmq::socket_t control(context, zmq::socket_type::dealer);
  control.set(zmq::sockopt::routing_id, fmt::format("{}-{}-{}", args.name, ::getpid(), incarnation));
  control.set(zmq::sockopt::linger, 0);
  if (!args.key.empty()) {
    std::string error;
    if (!blockflow::detail::configure_curve_client(control, args.key, args.session_key, error)) {
      throw std::invalid_argument(error);
    }
  }
  HandshakeWatch watch(context, control, args);
  control.connect(args.control);
  auto send = [&](const nlohmann::json& m) { (void)control.send(zmq::buffer(blockflow::detail::dump_json(m)), zmq::send_flags::none); };
  // Says hello (a joining worker again every second: the session may not be listening yet, or may
  // be busy with another worker of the same name) until the configuration arrives.
  std::optional<std::string> config;
  std::int64_t next_hello = 0;
  // A child whose configuration never comes gives up (its site may have moved on: a fork server
  // that answered too late forks a worker nobody waits for any more).
  constexpr std::int64_t kConfigWaitNs = std::int64_t{300} * 1'000'000'000;
  const std::int64_t give_up = now_ns() + kConfigWaitNs;
  while (!config && (args.join || (::getppid() == args.parent && now_ns() < give_up))) {
    if (now_ns() >= next_hello) {
      send({{"type", "hello"}, {"pid", ::getpid()}, {"name", args.name}, {"rss_bytes", rss_bytes()}});
      next_hello = args.join ? now_ns() + 1'000'000'000 : std::numeric_limits<std::int64_t>::max();
    }
    zmq::pollitem_t items[] = {{control.handle(), 0, ZMQ_POLLIN, 0}, {watch.handle(), 0, ZMQ_POLLIN, 0}};
    blockflow::detail::poll_items(items, watch.handle() != nullptr ? 2 : 1, std::chrono::milliseconds(200));
    if ((items[1].revents & ZMQ_POLLIN) != 0) watch.report();
    watch.hint_if_silent();
    if ((items[0].revents & ZMQ_POLLIN) == 0) continue;
    zmq::message_t message;
    if (!control.recv(message, zmq::recv_flags::dontwait)) continue;
    const auto json = nlohmann::json::parse(message.to_string(), nullptr, false);
    if (!json.is_discarded() && json.value("type", "") == "config") config = message.to_string();
  }
  if (!config) return 1;  // the parent died while we waited (or nobody configured us in time)
  BlockflowWorkerServeFn serve = nullptr;
  try {
    serve = load_runtime(launcher_dir);
  } catch (const std::exception& e) {
    send({{"type", "load_error"}, {"message", fmt::format("worker {}: {}", args.name, e.what())}});
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // let the message leave
    throw;
  }
  std::vector<const char*> plugins;
  for (const auto& p : args.plugins) plugins.push_back(p.c_str());
  BlockflowWorkerLaunch launch{args.name.c_str(),     args.control.c_str(), args.requests.c_str(),
                               args.results.c_str(),  static_cast<long>(args.parent), args.join ? 1 : 0,
                               control.handle(),      config->c_str(),      0,
                               plugins.data(),        static_cast<int>(plugins.size()),
                               args.models.empty() ? nullptr : args.models.c_str(),
                               args.key.empty() ? nullptr : args.key.c_str(),
                               args.session_key.empty() ? nullptr : args.session_key.c_str()};
  const int rc = serve(&launch);
  stopped_by_host = launch.stopped_by_host != 0;
  return rc;
}


// A worker that crashes logs its stack on stderr (the host's log) before it dies of the signal, so
// that "worker w1 killed by signal 11" comes with a where.
char crash_header[160] = "blockflow-worker: fatal signal; stack:\n";  // named once the command line is read

void log_crash(int sig) {
  void* frames[64];
  const int n = ::backtrace(frames, 64);
  (void)!::write(STDERR_FILENO, crash_header, std::strlen(crash_header));
  ::backtrace_symbols_fd(frames, n, STDERR_FILENO);
  std::signal(sig, SIG_DFL);
  ::raise(sig);
}

}  // namespace

namespace blockflow::detail {

std::string& worker_label() {
  static std::string label = "blockflow-worker";
  return label;
}

void log_worker_crashes() {
  // backtrace() loads libgcc_s on its first call (malloc, dlopen): make that call here, so that the
  // handler's call stays async-signal-safe (a crash inside malloc would otherwise deadlock in it).
  void* first[1];
  (void)::backtrace(first, 1);
  for (int sig : {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT}) std::signal(sig, log_crash);
}

int launch_worker(int argc, char** argv, const std::string& launcher_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path dir = launcher_dir.empty() ? fs::read_symlink("/proc/self/exe", ec).parent_path() : fs::path(launcher_dir);
  Args args = parse(argc, argv);
  // Workers share their host's stderr: what one prints says which it is.
  worker_label() = fmt::format("blockflow-worker {} (pid {})", args.name, ::getpid());
  std::snprintf(crash_header, sizeof(crash_header), "%s: fatal signal; stack:\n", worker_label().c_str());
  if (!args.join) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // no orphans: die with the host
    if (::getppid() != args.parent) return 1;  // the host died before the line above
    bool stopped = false;
    return serve_once(args, dir, 0, stopped);
  }
  std::cerr << fmt::format("blockflow-worker {}: joining {}; allowed: {} plugin(s), TorchScript files {}\n", args.name,
                           args.control, args.plugins.size(), args.models.empty() ? "none (no --models)" : "in " + args.models);
  for (int incarnation = 0;; ++incarnation) {
    bool stopped = false;
    const int rc = serve_once(args, dir, incarnation, stopped);
    if (args.once) return rc;
    std::cerr << fmt::format("blockflow-worker {}: {}; joining again\n", args.name,
                             stopped ? "stopped by the session" : "the session went silent");
    std::this_thread::sleep_for(std::chrono::seconds(1));
  }
}

}  // namespace blockflow::detail
