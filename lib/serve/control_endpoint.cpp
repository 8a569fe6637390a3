#include <blockflow/serve/control_endpoint.hpp>
#include <blockflow/channel/detail/curve_auth.hpp>
#include <blockflow/channel/detail/ipc_socket_file.hpp>
#include <blockflow/channel/detail/zmq_calls.hpp>
#include <blockflow/core/detail/json_integer.hpp>
#include <blockflow/core/detail/log.hpp>
#include <blockflow/core/detail/utf8_text.hpp>
#include <blockflow/deploy/detail/deployment_json.hpp>
#include <blockflow/observe/detail/metrics_json.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace blockflow {
namespace {

nlohmann::json error(const std::string& message) { return {{"ok", false}, {"error", message}}; }

}  // namespace

struct ControlEndpoint::Impl {
  // A request's routing frames (ROUTER: the peer's identity, then the empty delimiter of REQ).
  using Envelope = std::vector<zmq::message_t>;
  struct Apply {
    Envelope envelope;
    Deployment deployment;
  };
  static constexpr std::size_t kMaxQueuedApplies = 4;
  static constexpr std::size_t kMaxRoutingBytes = 1024;  // the frames before a request's own
  static constexpr std::size_t kMaxFrames = 16;          // a request's, with its routing frames

  Session& session;
  const ControlOptions options;
  std::string endpoint;
  std::optional<detail::IpcSocketFile> socket_file;  // an ipc:// endpoint's
  detail::RateLimitedLog noisy;  // what a client can make happen again and again
  zmq::context_t context{1};
  std::unique_ptr<detail::CurveServer> curve;  // after the socket's close, before the context's
  zmq::socket_t socket{context, zmq::socket_type::router};
  // The updater thread rings the serving thread through this pair when a reply is ready.
  zmq::socket_t bell_in{context, zmq::socket_type::pair}, bell_out{context, zmq::socket_type::pair};
  std::atomic<bool> stopping{false};
  std::atomic<bool> updating{false};
  std::atomic<std::uint64_t> served{0};
  std::mutex mu;  // applies, replies, bell_out
  std::condition_variable work;
  std::deque<Apply> applies;
  std::deque<std::pair<Envelope, nlohmann::json>> replies;
  std::thread thread, updater;

  Impl(Session& s, ControlOptions o) : session(s), options(std::move(o)) {}

  // The reply to `text`, or null for an apply queued for the updater thread (which replies).
  nlohmann::json handle(const std::string& text, Envelope& envelope) {
    if (text.size() > options.max_message_bytes) {
      return error(fmt::format("control: a request of {} bytes is over the limit of {} (ControlOptions::max_message_bytes)",
                               text.size(), options.max_message_bytes));
    }
    if (auto depth = detail::check_json_depth(text); !depth.ok()) {
      return error(fmt::format("control: {}", std::string(depth.message())));
    }
    const auto request = nlohmann::json::parse(text, nullptr, false);
    if (request.is_discarded() || !request.is_object()) return error("control: a request is a JSON object");
    if (!request.contains("cmd") || !request["cmd"].is_string()) return error("control: a request needs a string \"cmd\"");
    const std::string cmd = request["cmd"].get<std::string>();
    if (cmd == "apply") {
      if (!request.contains("deployment")) return error("control: apply needs \"deployment\"");
      // Read again in the sender's key order: a deployment's tasks keep the file's order (Deployment::order).
      const auto ordered = nlohmann::ordered_json::parse(text, nullptr, false);
      auto deployment = Deployment::parse(ordered["deployment"].dump(), options.models_dir, /*confine_to_models_dir=*/true);
      if (!deployment.ok()) return error(std::string(deployment.status().message()));
      deployment->keep_code_blocks = true;  // what code added, the wire cannot take away for good
      if (const auto workers = deployment->workers().size(); workers > options.max_workers) {
        return error(fmt::format("control: the deployment names {} worker placements, over the limit of {} "
                                 "(ControlOptions::max_workers)", workers, options.max_workers));
      }
      if (deployment->blocks.size() > options.max_blocks) {
        return error(fmt::format("control: the deployment has {} blocks, over the limit of {} (ControlOptions::max_blocks)",
                                 deployment->blocks.size(), options.max_blocks));
      }
      if (const auto tasks = deployment->tasks.size() + deployment->graphs.size(); tasks > options.max_tasks) {
        return error(fmt::format("control: the deployment has {} tasks, over the limit of {} (ControlOptions::max_tasks)",
                                 tasks, options.max_tasks));
      }
      std::lock_guard lock(mu);
      if (applies.size() >= kMaxQueuedApplies) {
        return error(fmt::format("control: {} updates already wait to be applied; send this one again later",
                                 applies.size()));
      }
      applies.push_back({std::move(envelope), *std::move(deployment)});
      work.notify_one();
      return nullptr;  // answered by the updater thread once applied
    }
    if (cmd == "status") {
      const MetricsSnapshot m = session.metrics();
      nlohmann::json tasks = nlohmann::json::array(), blocks = nlohmann::json::array(), workers = nlohmann::json::array();
      for (const auto& p : m.paths) {
        if (p.active) tasks.push_back(p.task);
      }
      for (const auto& b : m.blocks) {
        blocks.push_back({{"name", b.name}, {"placement", b.placement}, {"processed", b.processed}, {"failed", b.failed}});
      }
      for (const auto& s : m.sites) workers.push_back({{"name", s.name}, {"pid", s.pid}, {"restarts", s.restarts}});
      return {{"ok", true},     {"version", m.version}, {"uptime_s", m.uptime_s}, {"in_flight", m.in_flight},
              {"tasks", tasks},  {"blocks", blocks},    {"workers", workers},   {"updating", updating.load()}};
    }
    if (cmd == "metrics") {
      const MetricsSnapshot m = session.metrics();
      return {{"ok", true}, {"metrics", nlohmann::json(m)}, {"prometheus", m.to_prometheus()}};
    }
    if (cmd == "sampling") {
      if (!request.contains("enabled") || !request["enabled"].is_boolean()) {
        return error("control: sampling needs a boolean \"enabled\"");
      }
      int period = 100;
      if (request.contains("period_ms")) {
        auto given = detail::json_integer<int>(request["period_ms"], 1, 3'600'000);
        if (!given) return error("control: sampling's \"period_ms\" must be a whole number of milliseconds from 1 to 3600000");
        period = *given;
      }
      session.set_sampling(request["enabled"].get<bool>(), absl::Milliseconds(period));
      return {{"ok", true}};
    }
    return error(fmt::format("control: unknown cmd '{}' (apply, status, metrics, sampling)", detail::key_excerpt(cmd)));
  }

  // Runs the queued applies one at a time, so that status and metrics are answered meanwhile.
  void updater_main() {
    while (true) {
      Apply next;
      {
        std::unique_lock lock(mu);
        work.wait(lock, [&] { return stopping || !applies.empty(); });
        if (stopping) return;
        next = std::move(applies.front());
        applies.pop_front();
        updating = true;
      }
      nlohmann::json reply;
      try {
        auto version = session.apply(next.deployment);
        reply = version.ok() ? nlohmann::json{{"ok", true}, {"version", *version}} : error(std::string(version.status().message()));
      } catch (const std::exception& e) {
        reply = error(fmt::format("control: {}", e.what()));
      }
      std::lock_guard lock(mu);
      updating = false;
      replies.emplace_back(std::move(next.envelope), std::move(reply));
      (void)bell_out.send(zmq::message_t(), zmq::send_flags::dontwait);
    }
  }

  void send(Envelope&& envelope, const nlohmann::json& reply) {
    for (auto& frame : envelope) (void)socket.send(std::move(frame), zmq::send_flags::sndmore);
    (void)socket.send(zmq::buffer(detail::dump_json(reply)), zmq::send_flags::dontwait);
    ++served;
  }

  void main() {
    while (!stopping) {
      try {
        turn();
      } catch (const std::exception& e) {  // out of memory, an unexpected ZeroMQ error: the endpoint goes on
        noisy.log(LogLevel::kWarning, fmt::format("control endpoint {}: {} (the endpoint goes on)", endpoint, e.what()));
        std::this_thread::sleep_for(std::chrono::milliseconds(10));  // no spinning on an error that stays
      }
    }
  }

  // One turn of the endpoint's thread: the updater's replies out, then one request in.
  void turn() {
    zmq::pollitem_t items[] = {{socket.handle(), 0, ZMQ_POLLIN, 0}, {bell_in.handle(), 0, ZMQ_POLLIN, 0}};
    detail::poll_items(items, 2, std::chrono::milliseconds(100));
    if ((items[1].revents & ZMQ_POLLIN) != 0) {
      zmq::message_t ring;
      while (bell_in.recv(ring, zmq::recv_flags::dontwait)) {
      }
      std::deque<std::pair<Envelope, nlohmann::json>> ready;
      {
        std::lock_guard lock(mu);
        ready.swap(replies);
      }
      for (auto& [envelope, reply] : ready) send(std::move(envelope), reply);
    }
    if ((items[0].revents & ZMQ_POLLIN) == 0) return;
    std::vector<zmq::message_t> frames;
    // Everything up to the empty delimiter routes the reply back; the last frame is the request.
    // A REQ client's routing frames are a few, of a few bytes: more frames, or larger ones (a
    // client getting around max_message_bytes, whose reply would send them all back), are dropped
    // unanswered.
    if (detail::receive_frames_at_most(socket, frames, kMaxFrames, zmq::recv_flags::dontwait) != detail::Receipt::kMessage) {
      return;
    }
    if (frames.size() < 2) return;
    std::size_t routing_bytes = 0;
    for (std::size_t i = 0; i + 1 < frames.size(); ++i) routing_bytes += frames[i].size();
    if (routing_bytes > kMaxRoutingBytes) return;
    Envelope envelope;
    for (std::size_t i = 0; i + 1 < frames.size(); ++i) envelope.push_back(std::move(frames[i]));
    const std::string text = frames.back().to_string();
    nlohmann::json reply;
    try {
      reply = handle(text, envelope);
    } catch (const std::exception& e) {  // never let a request take the endpoint down
      reply = error(fmt::format("control: {}", e.what()));
    }
    if (!reply.is_null()) send(std::move(envelope), reply);
  }
};

ControlEndpoint::ControlEndpoint(Session& session, const std::string& endpoint, std::string models_dir)
    : ControlEndpoint(session, endpoint, [&] {
        ControlOptions o;
        o.models_dir = std::move(models_dir);
        return o;
      }()) {}

ControlEndpoint::ControlEndpoint(Session& session, const std::string& endpoint, ControlOptions options)
    : impl_(std::make_unique<Impl>(session, std::move(options))) {
  Impl& s = *impl_;
  if (auto status = detail::check_tcp_bind(endpoint, s.options.security, "control endpoint"); !status.ok()) {
    throw std::runtime_error(std::string(status.message()));
  }
  if (s.options.security.curve()) {
    auto curve = detail::CurveServer::start(s.context, s.options.security, fmt::format("control endpoint '{}'", endpoint));
    if (!curve.ok()) throw std::runtime_error(std::string(curve.status().message()));
    s.curve = *std::move(curve);
    s.curve->secure(s.socket);
  }
  s.socket.set(zmq::sockopt::linger, 0);
  // A REQ client has one request out at a time; a DEALER that sends many and never reads would make
  // ZeroMQ buffer 1000 full replies (metrics: the whole snapshot each): beyond 16, replies are dropped.
  s.socket.set(zmq::sockopt::sndhwm, 16);
  s.socket.set(zmq::sockopt::maxmsgsize, static_cast<std::int64_t>(2 * s.options.max_message_bytes));
  try {
    s.socket.bind(endpoint);
  } catch (const zmq::error_t& e) {
    throw std::runtime_error(fmt::format("control endpoint '{}': cannot bind: {}", endpoint, e.what()));
  }
  s.endpoint = s.socket.get(zmq::sockopt::last_endpoint);
  s.socket_file = detail::IpcSocketFile::of(s.endpoint);  // libzmq 4.3 leaves it: removed when the endpoint goes
  if (s.curve) s.curve->describe(fmt::format("control endpoint '{}'", s.endpoint));
  const std::string bell = fmt::format("inproc://control-bell-{}", static_cast<const void*>(&s));
  s.bell_in.bind(bell);
  s.bell_out.connect(bell);
  s.thread = std::thread([&s] { s.main(); });
  try {
    s.updater = std::thread([&s] { s.updater_main(); });
  } catch (const std::system_error& e) {  // no thread left (RLIMIT_NPROC): the serving one stops first
    {
      std::lock_guard lock(s.mu);
      s.stopping = true;
    }
    s.work.notify_all();
    s.thread.join();
    s.socket.close();
    if (s.socket_file) s.socket_file->remove();
    s.curve.reset();
    throw std::runtime_error(fmt::format("control endpoint '{}': cannot start its updater thread: {}", s.endpoint, e.what()));
  }
}

ControlEndpoint::~ControlEndpoint() {
  Impl& s = *impl_;
  {
    std::lock_guard lock(s.mu);
    s.stopping = true;
    s.applies.clear();  // never started: nobody waits for them once the endpoint is gone
  }
  s.work.notify_all();
  s.thread.join();
  // Its apply in progress is cancelled rather than waited for; one that waits behind another
  // thread's apply() (the application's, a re-plan) is not that one's cancel.
  while (s.updating.load()) {
    s.session.cancel_update_from(s.updater.get_id());
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  s.updater.join();
  s.socket.close();  // before the authenticator and the context
  if (s.socket_file) s.socket_file->remove();
  s.curve.reset();
}

const std::string& ControlEndpoint::endpoint() const { return impl_->endpoint; }
std::uint64_t ControlEndpoint::requests_served() const { return impl_->served.load(); }
std::uint64_t ControlEndpoint::auth_failures() const { return impl_->curve ? impl_->curve->failures() : 0; }

}  // namespace blockflow
