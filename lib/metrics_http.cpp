#include <blockflow/metrics_http.hpp>
#include <blockflow/session.hpp>

#include <fmt/format.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <thread>

namespace blockflow {

struct MetricsHttpServer::Impl {
  const Session& session;
  int fd = -1;
  int port = 0;
  std::atomic<bool> stopping{false};
  std::atomic<std::uint64_t> served{0};
  std::thread thread;

  explicit Impl(const Session& s) : session(s) {}

  // Reads the request head (up to 8 KiB, 2 s) and answers; one connection at a time.
  void serve(int client) {
    std::string request;
    char buffer[1024];
    while (request.find("\r\n\r\n") == std::string::npos && request.size() < 8192) {
      pollfd p{client, POLLIN, 0};
      if (::poll(&p, 1, 2000) <= 0) return;
      const ssize_t n = ::recv(client, buffer, sizeof buffer, 0);
      if (n <= 0) return;
      request.append(buffer, static_cast<std::size_t>(n));
    }
    std::string status = "200 OK", type, body;
    const auto line_end = request.find("\r\n");
    const std::string line = request.substr(0, line_end);
    const auto sp1 = line.find(' '), sp2 = line.rfind(' ');
    const std::string method = line.substr(0, sp1);
    std::string target = sp1 != std::string::npos && sp2 > sp1 ? line.substr(sp1 + 1, sp2 - sp1 - 1) : "";
    target = target.substr(0, target.find('?'));
    if (method != "GET") {
      status = "405 Method Not Allowed";
      type = "text/plain";
      body = "only GET\n";
    } else if (target == "/metrics") {
      type = "text/plain; version=0.0.4; charset=utf-8";
      body = session.metrics().to_prometheus();
    } else if (target == "/metrics.json") {
      type = "application/json";
      body = session.metrics().to_json(1) + "\n";
    } else {
      status = "404 Not Found";
      type = "text/plain";
      body = "BlockFlow metrics: GET /metrics (Prometheus) or /metrics.json\n";
    }
    const std::string head = fmt::format("HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                                         status, type, body.size());
    const std::string response = head + body;
    std::size_t sent = 0;
    while (sent < response.size()) {
      const ssize_t n = ::send(client, response.data() + sent, response.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return;
      sent += static_cast<std::size_t>(n);
    }
    ++served;
  }

  void main() {
    while (!stopping) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      const int client = ::accept4(fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (client < 0) continue;
      serve(client);
      ::close(client);
    }
  }
};

MetricsHttpServer::MetricsHttpServer(const Session& session, const std::string& address)
    : impl_(std::make_unique<Impl>(session)) {
  const auto colon = address.rfind(':');
  if (colon == std::string::npos) throw std::runtime_error(fmt::format("metrics endpoint '{}': expected HOST:PORT", address));
  const std::string host = address.substr(0, colon);
  int port = 0;
  try {
    port = std::stoi(address.substr(colon + 1));
  } catch (const std::exception&) {
    throw std::runtime_error(fmt::format("metrics endpoint '{}': bad port", address));
  }
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<std::uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &sa.sin_addr) != 1) {
    throw std::runtime_error(fmt::format("metrics endpoint '{}': '{}' is not an IPv4 address", address, host));
  }
  Impl& s = *impl_;
  s.fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  ::setsockopt(s.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (s.fd < 0 || ::bind(s.fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 || ::listen(s.fd, 16) != 0) {
    const std::string why = std::strerror(errno);
    if (s.fd >= 0) ::close(s.fd);
    throw std::runtime_error(fmt::format("metrics endpoint '{}': cannot bind: {}", address, why));
  }
  socklen_t length = sizeof sa;
  ::getsockname(s.fd, reinterpret_cast<sockaddr*>(&sa), &length);
  s.port = ntohs(sa.sin_port);
  s.thread = std::thread([&s] { s.main(); });
}

MetricsHttpServer::~MetricsHttpServer() {
  impl_->stopping = true;
  impl_->thread.join();
  ::close(impl_->fd);
}

int MetricsHttpServer::port() const { return impl_->port; }
std::uint64_t MetricsHttpServer::requests_served() const { return impl_->served.load(); }

absl::Status write_prometheus_file(const MetricsSnapshot& snapshot, const std::string& path) {
  const std::string temporary = fmt::format("{}.tmp.{}", path, ::getpid());
  {
    std::ofstream out(temporary, std::ios::trunc);
    out << snapshot.to_prometheus();
    if (!out.flush()) return absl::UnavailableError(fmt::format("cannot write '{}'", temporary));
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(temporary.c_str());
    return absl::UnavailableError(fmt::format("cannot rename '{}' to '{}': {}", temporary, path, why));
  }
  return absl::OkStatus();
}

}  // namespace blockflow
