#include <blockflow/control_endpoint.hpp>
#include <blockflow/detail/metrics_json.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <zmq.hpp>

#include <atomic>
#include <stdexcept>
#include <thread>

namespace blockflow {
namespace {

nlohmann::json error(const std::string& message) { return {{"ok", false}, {"error", message}}; }

}  // namespace

struct ControlEndpoint::Impl {
  Session& session;
  std::string models_dir, endpoint;
  zmq::context_t context{1};
  zmq::socket_t socket{context, zmq::socket_type::rep};
  std::atomic<bool> stopping{false};
  std::atomic<std::uint64_t> served{0};
  std::thread thread;

  Impl(Session& s, std::string dir) : session(s), models_dir(std::move(dir)) {}

  nlohmann::json handle(const std::string& text) {
    const auto request = nlohmann::json::parse(text, nullptr, false);
    if (request.is_discarded() || !request.is_object()) return error("control: a request is a JSON object");
    if (!request.contains("cmd") || !request["cmd"].is_string()) return error("control: a request needs a string \"cmd\"");
    const std::string cmd = request["cmd"].get<std::string>();
    if (cmd == "apply") {
      if (!request.contains("deployment")) return error("control: apply needs \"deployment\"");
      auto deployment = Deployment::parse(request["deployment"].dump(), models_dir);
      if (!deployment.ok()) return error(std::string(deployment.status().message()));
      auto version = session.apply(*deployment);
      if (!version.ok()) return error(std::string(version.status().message()));
      return {{"ok", true}, {"version", *version}};
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
      return {{"ok", true},   {"version", m.version}, {"uptime_s", m.uptime_s}, {"in_flight", m.in_flight},
              {"tasks", tasks}, {"blocks", blocks},    {"workers", workers}};
    }
    if (cmd == "metrics") {
      const MetricsSnapshot m = session.metrics();
      return {{"ok", true}, {"metrics", nlohmann::json(m)}, {"prometheus", m.to_prometheus()}};
    }
    if (cmd == "sampling") {
      if (!request.contains("enabled") || !request["enabled"].is_boolean()) {
        return error("control: sampling needs a boolean \"enabled\"");
      }
      const auto period = request.value("period_ms", 100);
      if (period <= 0) return error("control: period_ms must be > 0");
      session.set_sampling(request["enabled"].get<bool>(), absl::Milliseconds(period));
      return {{"ok", true}};
    }
    return error(fmt::format("control: unknown cmd '{}' (apply, status, metrics, sampling)", cmd));
  }

  void main() {
    while (!stopping) {
      zmq::pollitem_t item{socket.handle(), 0, ZMQ_POLLIN, 0};
      zmq::poll(&item, 1, std::chrono::milliseconds(100));
      if ((item.revents & ZMQ_POLLIN) == 0) continue;
      zmq::message_t message;
      if (!socket.recv(message, zmq::recv_flags::dontwait)) continue;
      nlohmann::json reply;
      try {
        reply = handle(message.to_string());
      } catch (const std::exception& e) {  // never let a request take the endpoint down
        reply = error(fmt::format("control: {}", e.what()));
      }
      (void)socket.send(zmq::buffer(reply.dump()), zmq::send_flags::none);
      ++served;
    }
  }
};

ControlEndpoint::ControlEndpoint(Session& session, const std::string& endpoint, std::string models_dir)
    : impl_(std::make_unique<Impl>(session, std::move(models_dir))) {
  Impl& s = *impl_;
  s.socket.set(zmq::sockopt::linger, 0);
  s.socket.set(zmq::sockopt::maxmsgsize, std::int64_t{64} << 20);
  try {
    s.socket.bind(endpoint);
  } catch (const zmq::error_t& e) {
    throw std::runtime_error(fmt::format("control endpoint '{}': cannot bind: {}", endpoint, e.what()));
  }
  s.endpoint = s.socket.get(zmq::sockopt::last_endpoint);
  s.thread = std::thread([&s] { s.main(); });
}

ControlEndpoint::~ControlEndpoint() {
  impl_->stopping = true;
  impl_->thread.join();
}

const std::string& ControlEndpoint::endpoint() const { return impl_->endpoint; }
std::uint64_t ControlEndpoint::requests_served() const { return impl_->served.load(); }

}  // namespace blockflow
