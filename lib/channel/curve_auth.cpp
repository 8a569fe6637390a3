// The server side of CURVE: a ZAP handler per context, socket monitors for handshakes that fail
// before ZAP is asked, and the rule for plain-TCP binds (blockflow/curve.hpp, docs/security.md).

#include <blockflow/core/detail/auth_failures.hpp>
#include <blockflow/channel/detail/curve_auth.hpp>
#include <blockflow/channel/detail/zmq_calls.hpp>
#include <blockflow/channel/detail/curve_keys.hpp>
#include <blockflow/core/detail/log.hpp>
#include <blockflow/core/names.hpp>

#include <fmt/format.h>
#include <zmq_addon.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace blockflow::detail {

absl::Status check_tcp_bind(const std::string& endpoint, const ServerSecurity& security, std::string_view what) {
  if (endpoint.rfind("tcp://", 0) != 0) return absl::OkStatus();
  // ZeroMQ reads "tcp://SOURCE;ADDRESS" as a source address, then the one to use: what is bound is
  // not the host this check would read.
  if (endpoint.find(';') != std::string::npos) {
    return absl::InvalidArgumentError(fmt::format("{} '{}': a source address (';') is not supported", what, endpoint));
  }
  const auto colon = endpoint.rfind(':');
  std::string host = endpoint.substr(6, colon == std::string::npos || colon < 6 ? std::string::npos : colon - 6);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  const bool loopback = host == "localhost" || host == "::1" || host == "lo" || host.rfind("127.", 0) == 0;
  const bool everywhere = host == "*" || host == "0.0.0.0" || host == "::";
  if (loopback) return absl::OkStatus();
  if (security.curve()) {
    if (everywhere) log(LogLevel::kInfo, fmt::format("{} '{}' listens on every interface (CURVE keys required)", what, endpoint));
    return absl::OkStatus();
  }
  if (!security.insecure) {
    return absl::FailedPreconditionError(fmt::format(
        "{} '{}': a TCP endpoint beyond the loopback needs CURVE keys (ServerSecurity::secret_key_file and "
        "authorized_keys_dir, made with `blockflowctl keygen`), or ServerSecurity::insecure to serve plain TCP",
        what, endpoint));
  }
  log(LogLevel::kWarning, fmt::format("{} '{}' serves plain TCP beyond the loopback (insecure): whoever reaches {} can "
                                      "use it and read its traffic",
                                      what, endpoint, everywhere ? "this host" : host));
  return absl::OkStatus();
}

struct CurveServer::State {
  zmq::context_t* context = nullptr;
  std::string what;  // guarded by mu once the thread runs
  std::string dir;
  KeyFile keys;
  std::map<std::string, std::string> allowed;  // binary key -> name

  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> only_by_domain;     // domain "N" -> the one name admitted ("" = any)
  std::vector<std::string> pending_monitors;   // endpoints the thread has yet to connect
  std::size_t monitors_connected = 0;
  bool ready = false;
  std::string thread_error;

  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> failures{0};
  RateLimitedLog noisy;
  std::thread thread;

  void refuse(const std::string& why) {
    ++failures;
    ++auth_failure_counter();
    std::string label;
    {
      std::lock_guard lock(mu);
      label = what;
    }
    noisy.log(LogLevel::kWarning, fmt::format("{}: refused a peer: {}", label, why));
  }

  // One ZAP request -> one reply (RFC 27): version, request id, status code, text, user id, metadata.
  void answer(zmq::socket_t& zap) {
    std::vector<zmq::message_t> req;
    if (!zmq::recv_multipart(zap, std::back_inserter(req), zmq::recv_flags::dontwait)) return;
    auto reply = [&](const char* code, const std::string& text, const std::string& user) {
      const std::string request_id = req.size() > 1 ? req[1].to_string() : "";
      std::array<zmq::const_buffer, 6> parts{zmq::str_buffer("1.0"), zmq::buffer(request_id), zmq::buffer(code, 3),
                                             zmq::buffer(text), zmq::buffer(user), zmq::const_buffer()};
      zmq::send_multipart(zap, parts);
    };
    if (req.size() < 6 || req[0].to_string_view() != "1.0") return reply("400", "malformed ZAP request", "");
    const std::string domain = req[2].to_string(), address = req[3].to_string(), mechanism = req[5].to_string();
    if (mechanism != "CURVE" || req.size() < 7 || req[6].size() != 32) {
      refuse(fmt::format("{} from {} (CURVE required)", mechanism, address));
      return reply("400", "CURVE required", "");
    }
    const std::string key = req[6].to_string();
    std::optional<std::string> only;
    {
      std::lock_guard lock(mu);
      std::size_t index = only_by_domain.size();
      try {
        index = std::stoul(domain);
      } catch (const std::exception&) {
      }
      if (index < only_by_domain.size()) only = only_by_domain[index];
    }
    if (!only) {  // refused outside `mu`: refuse() takes it
      refuse(fmt::format("unknown ZAP domain '{}' for {} from {}", domain, key_fingerprint_binary(key), address));
      return reply("400", "unknown domain", "");
    }
    const auto it = allowed.find(key);
    if (it == allowed.end()) {
      refuse(fmt::format("key {} from {} is not in {}", key_fingerprint_binary(key), address, dir));
      return reply("400", "unknown key", "");
    }
    if (!only->empty() && it->second != *only) {
      refuse(fmt::format("key {} from {} is '{}', not '{}'", key_fingerprint_binary(key), address, it->second, *only));
      return reply("400", "key of another peer", "");
    }
    reply("200", "OK", it->second);
  }

  // A socket monitor event: frame 1 = u16 event + u32 value, frame 2 = the endpoint.
  void monitor_event(zmq::socket_t& monitor) {
    std::vector<zmq::message_t> event;
    if (!zmq::recv_multipart(monitor, std::back_inserter(event), zmq::recv_flags::dontwait) || event.size() < 2 ||
        event[0].size() < 6) {
      return;
    }
    std::uint16_t id = 0;
    std::memcpy(&id, event[0].data(), sizeof id);
    if (id == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL || id == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) {
      refuse(fmt::format("a handshake on {} failed before its key was known (no CURVE, or a wrong server key)",
                         event[1].to_string()));
    }
  }

  void run() {
    std::vector<zmq::socket_t> monitors;
    try {
      zmq::socket_t zap(*context, zmq::socket_type::rep);
      zap.set(zmq::sockopt::linger, 0);
      try {
        zap.bind("inproc://zeromq.zap.01");
      } catch (const zmq::error_t& e) {
        std::lock_guard lock(mu);
        thread_error = e.what();
        ready = true;
        cv.notify_all();
        return;
      }
      {
        std::lock_guard lock(mu);
        ready = true;
        cv.notify_all();
      }
      while (!stop.load()) {
        {
          std::lock_guard lock(mu);
          for (const auto& endpoint : pending_monitors) {
            monitors.emplace_back(*context, zmq::socket_type::pair).connect(endpoint);
            monitors.back().set(zmq::sockopt::linger, 0);
          }
          monitors_connected += pending_monitors.size();
          if (!pending_monitors.empty()) cv.notify_all();
          pending_monitors.clear();
        }
        // Only the context's end stops the handler: a signal (EINTR) or one bad request does not.
        // (Secured sockets refuse every peer while no handler runs: ZMQ_ZAP_ENFORCE_DOMAIN.)
        try {
          std::vector<zmq::pollitem_t> items{{zap.handle(), 0, ZMQ_POLLIN, 0}};
          for (auto& m : monitors) items.push_back({m.handle(), 0, ZMQ_POLLIN, 0});
          poll_items(items, std::chrono::milliseconds(50));
          if ((items[0].revents & ZMQ_POLLIN) != 0) answer(zap);
          for (std::size_t i = 0; i < monitors.size(); ++i) {
            if ((items[i + 1].revents & ZMQ_POLLIN) != 0) monitor_event(monitors[i]);
          }
        } catch (const zmq::error_t& e) {
          if (e.num() == ETERM) throw;
          std::string label;
          {
            std::lock_guard lock(mu);
            label = what;
          }
          noisy.log(LogLevel::kWarning, fmt::format("{}: authentication: {} (going on)", label, e.what()));
        }
      }
    } catch (const zmq::error_t& e) {  // the context was terminated under us
      std::lock_guard lock(mu);
      log(LogLevel::kError, fmt::format("{}: authentication thread stopped: {}", what, e.what()));
    }
  }
};

absl::StatusOr<std::unique_ptr<CurveServer>> CurveServer::start(zmq::context_t& context, const ServerSecurity& security,
                                                                 std::string what) {
  auto state = std::make_unique<State>();
  state->context = &context;
  state->what = std::move(what);
  state->dir = security.authorized_keys_dir;
  std::string error;
  if (!read_key_file(security.secret_key_file, true, state->keys, error)) {
    return absl::InvalidArgumentError(fmt::format("{}: {}", state->what, error));
  }
  if (state->dir.empty()) {
    return absl::InvalidArgumentError(
        fmt::format("{}: CURVE needs an authorized_keys_dir (the .key files of the peers it admits)", state->what));
  }
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::directory_iterator it(state->dir, ec), end;
  if (ec) return absl::InvalidArgumentError(fmt::format("{}: authorized keys directory '{}': {}", state->what, state->dir, ec.message()));
  std::map<std::string, std::string> file_of;  // binary key -> file, for duplicates
  for (; it != end; it.increment(ec)) {
    if (ec) break;
    const fs::path path = it->path();
    if (path.extension() != ".key") continue;
    const std::string name = path.stem().string();
    if (auto status = check_name("key", name); !status.ok()) {
      return absl::InvalidArgumentError(fmt::format("{}: authorized key file '{}': {}", state->what, path.string(),
                                                    std::string(status.message())));
    }
    KeyFile key;
    if (!read_key_file(path.string(), false, key, error)) return absl::InvalidArgumentError(fmt::format("{}: {}", state->what, error));
    std::string binary(32, '\0');
    zmq_z85_decode(reinterpret_cast<std::uint8_t*>(binary.data()), key.public_key.c_str());
    if (auto [at, fresh] = file_of.emplace(binary, path.string()); !fresh) {
      return absl::InvalidArgumentError(fmt::format("{}: '{}' and '{}' hold the same key: a key names one peer",
                                                    state->what, at->second, path.string()));
    }
    state->allowed.emplace(std::move(binary), name);
  }
  if (ec) return absl::InvalidArgumentError(fmt::format("{}: authorized keys directory '{}': {}", state->what, state->dir, ec.message()));

  // The handler is bound before start() returns and stays until the destructor, which runs after
  // the secured sockets are closed; should it go before them, they refuse every peer (secure()).
  State* s = state.get();
  s->thread = std::thread([s] { s->run(); });
  std::unique_lock lock(s->mu);
  s->cv.wait(lock, [s] { return s->ready; });
  if (!s->thread_error.empty()) {
    lock.unlock();
    s->thread.join();
    return absl::InternalError(fmt::format("{}: cannot start the ZAP handler: {}", s->what, s->thread_error));
  }
  lock.unlock();
  return std::unique_ptr<CurveServer>(new CurveServer(std::move(state)));
}

CurveServer::CurveServer(std::unique_ptr<State> state) : state_(std::move(state)) {}

CurveServer::~CurveServer() {
  state_->stop = true;
  if (state_->thread.joinable()) state_->thread.join();
}

void CurveServer::secure(zmq::socket_t& socket, const std::string& only) {
  State& s = *state_;
  std::unique_lock lock(s.mu);
  const std::size_t domain = s.only_by_domain.size();
  s.only_by_domain.push_back(only);
  socket.set(zmq::sockopt::curve_server, 1);
  socket.set(zmq::sockopt::curve_secretkey, s.keys.secret_key);
  socket.set(zmq::sockopt::zap_domain, std::to_string(domain));
  // Without it, libzmq admits every CURVE client of a context whose ZAP handler has gone (the
  // handler thread's end, a bug): with it, it refuses them. A draft option in libzmq 4.3's header
  // (ZMQ_ZAP_ENFORCE_DOMAIN), which the library takes.
  constexpr int kZapEnforceDomain = 93;
  const int enforce = 1;
  if (zmq_setsockopt(socket.handle(), kZapEnforceDomain, &enforce, sizeof enforce) != 0) {
    log(LogLevel::kWarning, fmt::format("{}: this libzmq cannot refuse peers when no ZAP handler runs (ZMQ_ZAP_ENFORCE_DOMAIN: "
                                        "{})", s.what, zmq_strerror(zmq_errno())));
  }
  const std::string monitor = fmt::format("inproc://blockflow-curve-monitor-{}-{}", static_cast<const void*>(&s), domain);
  if (zmq_socket_monitor(socket.handle(), monitor.c_str(),
                         ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) != 0) {
    log(LogLevel::kWarning, fmt::format("{}: no handshake monitor: {}", s.what, zmq_strerror(zmq_errno())));
    return;
  }
  s.pending_monitors.push_back(monitor);
  const std::size_t want = s.monitors_connected + s.pending_monitors.size();
  s.cv.wait(lock, [&] { return s.monitors_connected >= want || s.stop.load(); });
}

void CurveServer::describe(std::string what) {
  std::lock_guard lock(state_->mu);
  state_->what = std::move(what);
}

std::uint64_t CurveServer::failures() const { return state_->failures.load(); }

std::vector<std::string> CurveServer::authorized() const {
  std::vector<std::string> names;
  for (const auto& [key, name] : state_->allowed) names.push_back(name);
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace blockflow::detail
