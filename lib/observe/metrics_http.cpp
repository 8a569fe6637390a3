#include <blockflow/observe/metrics_http.hpp>
#include <blockflow/core/session.hpp>

#include <fmt/format.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

namespace blockflow {

namespace {

// At most this many at once. A new client is still taken when they are all open: the one that has
// waited longest for its request head makes room (so idle connections cannot keep a scraper out),
// unless every one is being answered.
constexpr std::size_t kMaxConnections = 64;
constexpr std::size_t kMaxRequestHead = 8192;
constexpr std::int64_t kDeadlineMs = 2000;          // per connection, whole request; then whole reply
constexpr std::int64_t kAcceptBackoffMs = 100;      // after accept() found no descriptor free
constexpr std::int64_t kLingerMs = 500;             // reply sent: what the client still sends is read until its EOF

std::int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// One client: its request head as it arrives, then its reply as it leaves, then (closing) what it
// still sends, read and discarded until it closes too: closing with unread bytes would reset the
// connection and could lose the reply's end (a POST's body, a pipelined request). Each phase has a
// deadline for the whole of it, so a client trickling a byte at a time cannot hold the server.
struct Connection {
  int fd = -1;
  std::string in, out;
  std::size_t sent = 0;
  std::int64_t deadline_ms = 0;
  bool replying = false;
  bool closing = false;
};

// A connection a new client may take the place of: one still waiting for its request head, or
// one whose reply has gone.
bool evictable(const Connection& c) { return !c.replying || c.closing; }

}  // namespace

struct MetricsHttpServer::Impl {
  const Session& session;
  int fd = -1;
  int port = 0;
  std::atomic<bool> stopping{false};
  std::atomic<std::uint64_t> served{0};
  std::atomic<std::uint64_t> evicted{0};  // connections closed before their request came, to make room
  std::thread thread;

  explicit Impl(const Session& s) : session(s) {}

  // The reply to a complete request head; a 500 when the snapshot cannot be made or written (out
  // of memory, a name that is not UTF-8): nothing thrown may end this thread, or the process.
  std::string respond(const std::string& request) const {
    try {
      return respond_or_throw(request);
    } catch (const std::exception& e) {
      const std::string body = fmt::format("the metrics could not be written: {}\n", e.what());
      return fmt::format("HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n"
                         "Connection: close\r\n\r\n", body.size()) + body;
    } catch (...) {
      return "HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
    }
  }

  std::string respond_or_throw(const std::string& request) const {
    std::string status = "200 OK", type, body;
    const auto line_end = request.find("\r\n");
    const std::string line = request.substr(0, line_end);
    const auto sp1 = line.find(' '), sp2 = line.rfind(' ');
    const std::string method = line.substr(0, sp1);
    std::string target = sp1 != std::string::npos && sp2 > sp1 ? line.substr(sp1 + 1, sp2 - sp1 - 1) : "";
    target = target.substr(0, target.find('?'));
    std::string extra;
    if (method != "GET") {
      status = "405 Method Not Allowed";
      extra = "Allow: GET\r\n";
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
    return fmt::format("HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\n{}Connection: close\r\n\r\n", status,
                       type, body.size(), extra) + body;
  }

  // Reads what `c` sent; once the head is whole, prepares the reply. False: close it.
  bool on_readable(Connection& c) {
    char buffer[1024];
    const ssize_t n = ::recv(c.fd, buffer, sizeof buffer, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return false;
    if (n > 0) c.in.append(buffer, static_cast<std::size_t>(n));
    if (c.in.find("\r\n\r\n") == std::string::npos) return c.in.size() < kMaxRequestHead;
    c.out = respond(c.in);
    c.in = std::string();
    c.replying = true;
    c.deadline_ms = now_ms() + kDeadlineMs;
    return true;
  }

  // Sends what `c` can take now; once all has gone, our side ends (FIN) and `c` is closing. False:
  // close it (gone).
  bool on_writable(Connection& c) {
    const ssize_t n = ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) return errno == EAGAIN || errno == EINTR;
    c.sent += static_cast<std::size_t>(n);
    if (c.sent < c.out.size()) return true;
    ++served;
    ::shutdown(c.fd, SHUT_WR);
    c.out = std::string();
    c.closing = true;
    c.deadline_ms = now_ms() + kLingerMs;
    return true;
  }

  // Reads and drops what a closing `c` still sends. False: it has closed its side (or failed).
  static bool on_closing_readable(Connection& c) {
    char buffer[1024];
    const ssize_t n = ::recv(c.fd, buffer, sizeof buffer, MSG_DONTWAIT);
    return n > 0 || (n < 0 && (errno == EAGAIN || errno == EINTR));
  }

  // One thread serves every connection at once (poll), each within its deadlines.
  void main() {
    std::vector<Connection> open;
    std::vector<pollfd> polled;
    // While accept() fails for want of descriptors (or memory), the pending connection keeps the
    // listener readable: it is left unpolled for a while instead of spinning.
    std::int64_t accept_after_ms = 0;
    while (!stopping) {
      try {
        turn(open, polled, accept_after_ms);
      } catch (...) {  // out of memory: the connections stay as they were; the thread goes on
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    for (const auto& c : open) ::close(c.fd);
  }

  // One poll and what it found. An exception (out of memory) leaves `open` whole: nothing is moved
  // out of it before the allocations that could throw.
  void turn(std::vector<Connection>& open, std::vector<pollfd>& polled, std::int64_t& accept_after_ms) {
    polled.clear();
    const bool room = open.size() < kMaxConnections || std::any_of(open.begin(), open.end(), evictable);
    const bool accepting = room && now_ms() >= accept_after_ms;
    polled.push_back({accepting ? fd : -1, POLLIN, 0});
    for (const auto& c : open) polled.push_back({c.fd, static_cast<short>(c.replying && !c.closing ? POLLOUT : POLLIN), 0});
    (void)::poll(polled.data(), polled.size(), 100);
    const std::int64_t now = now_ms();
    std::vector<Connection> kept;
    kept.reserve(open.size());  // the moves below allocate nothing
    for (std::size_t i = 0; i < open.size(); ++i) {
      Connection& c = open[i];
      const short ready = polled[i + 1].revents;
      bool keep = now < c.deadline_ms;
      if (keep && (ready & (POLLERR | POLLHUP | POLLNVAL)) != 0 && (ready & POLLIN) == 0) keep = false;
      if (keep && (ready & POLLIN) != 0 && c.closing) {
        keep = on_closing_readable(c);
      } else if (keep && (ready & POLLIN) != 0 && !c.replying) {
        try {
          keep = on_readable(c);
        } catch (...) {  // no memory for its request or reply: this connection is closed
          keep = false;
        }
      }
      if (keep && (ready & POLLOUT) != 0 && c.replying && !c.closing) keep = on_writable(c);
      if (keep) {
        kept.push_back(std::move(c));
      } else {
        ::close(c.fd);
      }
    }
    open.swap(kept);
    // Room again after this turn (a connection may have begun its reply): none, and the client
    // waits in the listen backlog rather than being accepted and closed at once.
    const bool room_now = open.size() < kMaxConnections || std::any_of(open.begin(), open.end(), evictable);
    if ((polled[0].revents & POLLIN) != 0 && room_now) {
      const int client = ::accept4(fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (client >= 0) {
        if (open.size() >= kMaxConnections) {  // one whose reply has gone, else the oldest still waiting, makes room
          auto oldest = std::find_if(open.begin(), open.end(), [](const Connection& c) { return c.closing; });
          if (oldest == open.end()) {
            for (auto it = open.begin(); it != open.end(); ++it) {
              if (!it->replying && (oldest == open.end() || it->deadline_ms < oldest->deadline_ms)) oldest = it;
            }
          }
          if (oldest != open.end()) {
            ::close(oldest->fd);
            open.erase(oldest);
            ++evicted;
          }
        }
        bool held = false;
        if (open.size() < kMaxConnections) {  // else every one began its reply: never more than 64 held
          try {
            open.push_back({client, {}, {}, 0, now + kDeadlineMs, false});
            held = true;
          } catch (...) {  // no memory to hold it: not left open
          }
        }
        if (!held) ::close(client);
      } else if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        accept_after_ms = now + kAcceptBackoffMs;
      }
    }
  }
};

MetricsHttpServer::MetricsHttpServer(const Session& session, const std::string& address)
    : impl_(std::make_unique<Impl>(session)) {
  const auto colon = address.rfind(':');
  if (colon == std::string::npos) throw std::runtime_error(fmt::format("metrics endpoint '{}': expected HOST:PORT", address));
  const std::string host = address.substr(0, colon);
  const std::string port_text = address.substr(colon + 1);
  int port = -1;
  if (port_text.empty() || port_text.size() > 5 || port_text.find_first_not_of("0123456789") != std::string::npos ||
      (port = std::stoi(port_text)) > 65535) {
    throw std::runtime_error(fmt::format("metrics endpoint '{}': bad port (0-65535)", address));
  }
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<std::uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &sa.sin_addr) != 1) {
    throw std::runtime_error(fmt::format("metrics endpoint '{}': '{}' is not an IPv4 address", address, host));
  }
  Impl& s = *impl_;
  s.fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s.fd < 0) throw std::runtime_error(fmt::format("metrics endpoint '{}': no socket: {}", address, std::strerror(errno)));
  const int one = 1;
  ::setsockopt(s.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(s.fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 || ::listen(s.fd, 16) != 0) {
    const std::string why = std::strerror(errno);
    if (s.fd >= 0) ::close(s.fd);
    throw std::runtime_error(fmt::format("metrics endpoint '{}': cannot bind: {}", address, why));
  }
  socklen_t length = sizeof sa;
  ::getsockname(s.fd, reinterpret_cast<sockaddr*>(&sa), &length);
  s.port = ntohs(sa.sin_port);
  try {
    s.thread = std::thread([&s] { s.main(); });
  } catch (...) {  // no thread (EAGAIN): the listening socket is not left open
    ::close(s.fd);
    throw;
  }
}

MetricsHttpServer::~MetricsHttpServer() {
  impl_->stopping = true;
  impl_->thread.join();
  ::close(impl_->fd);
}

int MetricsHttpServer::port() const { return impl_->port; }
std::uint64_t MetricsHttpServer::requests_served() const { return impl_->served.load(); }

absl::Status write_prometheus_file(const MetricsSnapshot& snapshot, const std::string& path) {
  // A temporary of its own (a random name made with O_EXCL, so no planted file or link is followed,
  // and two writers never share one), renamed over `path`; removed on every error.
  // The text first: nothing is left behind when making it fails (out of memory throws).
  std::string text;
  try {
    text = snapshot.to_prometheus();
  } catch (const std::exception& e) {
    return absl::ResourceExhaustedError(fmt::format("cannot write the metrics for '{}': {}", path, e.what()));
  }
  std::string temporary = path + ".tmp.XXXXXX";
  const int fd = ::mkostemp(temporary.data(), O_CLOEXEC);
  if (fd < 0) return absl::UnavailableError(fmt::format("cannot create a temporary next to '{}': {}", path, std::strerror(errno)));
  auto fail = [&](const std::string& what) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    ::unlink(temporary.c_str());
    return absl::UnavailableError(fmt::format("{} '{}': {}", what, temporary, why));
  };
  if (::fchmod(fd, 0644) != 0) return fail("cannot set the mode of");  // read by node_exporter's user
  for (std::size_t written = 0; written < text.size();) {
    const ssize_t n = ::write(fd, text.data() + written, text.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return fail("cannot write");
    written += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0) return fail("cannot flush");  // renamed over `path` only once it is on disk
  if (::close(fd) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(temporary.c_str());
    return absl::UnavailableError(fmt::format("cannot write '{}': {}", temporary, why));
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(temporary.c_str());
    return absl::UnavailableError(fmt::format("cannot rename '{}' to '{}': {}", temporary, path, why));
  }
  return absl::OkStatus();
}

}  // namespace blockflow
