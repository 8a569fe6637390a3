// metrics_http_bench: the metrics HTTP endpoint under slow clients, against cpp-httplib, same run.
//
//   metrics_http_bench [--tricklers K] [--scrapes N] [--trickle-ms MS]
//
// For each server: K clients each open a connection and send a request head one byte every MS
// milliseconds (reconnecting when the server closes them), while a well-behaved client scrapes
// GET /metrics N times. One JSON line per server: the threads the server added to the process,
// the scrapes' latency p50/max and how many took longer than 5 s. The servers serve the same
// session's MetricsSnapshot::to_prometheus().
//
// The cpp-httplib line is there when the build found Debian's libcpp-httplib-dev (it is not a
// BlockFlow dependency; install it to compare: apt-get install libcpp-httplib-dev). It is why
// BlockFlow keeps its own poll() server (docs/metrics.md, "The HTTP endpoint").
#include <blockflow/core/block.hpp>
#include <blockflow/observe/metrics_http.hpp>
#include <blockflow/core/path.hpp>
#include <blockflow/core/session.hpp>

#include "bench_util.hpp"

#include <fmt/format.h>

#if defined(BLOCKFLOW_HAVE_HTTPLIB)
#include <httplib.h>
#endif

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace bf = blockflow;
using Clock = std::chrono::steady_clock;

namespace {

int connect_loopback(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<std::uint16_t>(port));
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0) return fd;
  if (fd >= 0) ::close(fd);
  return -1;
}

// One scrape: its latency in ms, or a negative value when no whole 200 reply came within 5 s.
double scrape(int port) {
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::seconds(5);
  const int fd = connect_loopback(port);
  if (fd < 0) return -1;
  const std::string request = "GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
  std::string reply;
  bool ok = ::send(fd, request.data(), request.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(request.size());
  while (ok) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      ok = false;
      break;
    }
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    char buffer[4096];
    const ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
    if (n <= 0) break;  // the server closed: the reply is whole
    reply.append(buffer, static_cast<std::size_t>(n));
  }
  ::close(fd);
  if (!ok || reply.rfind("HTTP/1.1 200", 0) != 0) return -1;
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// K slow clients: each sends a request head a byte at a time and reconnects when closed.
class Tricklers {
 public:
  Tricklers(int port, int count, int every_ms) {
    for (int i = 0; i < count; ++i) {
      threads_.emplace_back([this, port, every_ms] {
        const std::string head = "GET /metrics HTTP/1.1\r\nHost: localhost\r\nX-Slow: ";
        int fd = -1;
        std::size_t at = 0;
        while (!stop_) {
          if (fd < 0) {
            fd = connect_loopback(port);
            at = 0;
          }
          const char byte = at < head.size() ? head[at] : 'x';
          if (fd >= 0 && ::send(fd, &byte, 1, MSG_NOSIGNAL) != 1) {
            ::close(fd);
            fd = -1;
            continue;
          }
          ++at;
          for (int waited = 0; waited < every_ms && !stop_; waited += 10) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        if (fd >= 0) ::close(fd);
      });
    }
  }
  ~Tricklers() {
    stop_ = true;
    for (auto& t : threads_) t.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

void measure(const std::string& server, int port, int threads_added, int tricklers, int scrapes, int trickle_ms) {
  std::vector<double> latencies;
  int slow = 0;
  {
    Tricklers slow_clients(port, tricklers, trickle_ms);
    std::this_thread::sleep_for(std::chrono::milliseconds(500));  // every slow client is connected
    for (int i = 0; i < scrapes; ++i) {
      const double ms = scrape(port);
      if (ms < 0) {
        ++slow;
      } else {
        latencies.push_back(ms);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }
  std::sort(latencies.begin(), latencies.end());
  const double p50 = latencies.empty() ? -1 : bf::bench::percentile(latencies, 0.5);  // nearest rank, as every bench
  const double max = latencies.empty() ? -1 : latencies.back();
  fmt::print(R"({{"bench":"metrics_http","server":"{}",{},"threads_added":{},"tricklers":{},"trickle_ms":{},)"
             R"("scrapes":{},"scrape_p50_ms":{:.2f},"scrape_max_ms":{:.2f},"scrapes_over_5s":{}}})"
             "\n",
             server, bf::bench::machine_json(), threads_added, tricklers, trickle_ms, scrapes, p50, max, slow);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  int tricklers = 16, scrapes = 10, trickle_ms = 1000;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string arg = argv[i];
    if (arg == "--tricklers") tricklers = std::stoi(argv[i + 1]);
    if (arg == "--scrapes") scrapes = std::stoi(argv[i + 1]);
    if (arg == "--trickle-ms") trickle_ms = std::stoi(argv[i + 1]);
  }
  bf::Session session;
  session.add_block(bf::Block::callable("id", [](bf::Tensors&& in) -> absl::StatusOr<bf::Tensors> { return std::move(in); }))
      .add_path(bf::Path::chain("t", {"id"}));
  if (auto status = session.start(); !status.ok()) {
    fmt::print(stderr, "metrics_http_bench: {}\n", status.ToString());
    return 1;
  }
  {
    const int before = bf::bench::process_threads();
    bf::MetricsHttpServer ours(session, "127.0.0.1:0");
    measure("blockflow", ours.port(), bf::bench::process_threads() - before, tricklers, scrapes, trickle_ms);
  }
#if defined(BLOCKFLOW_HAVE_HTTPLIB)
  // Its defaults (a pool of max(8, cores - 1) threads, a 5 s timeout per read), then its read
  // timeout at 1 s: a timeout per read, not per request, so a client sending a byte a second
  // within it still holds a pool thread.
  for (const int read_timeout_s : {0, 1}) {
    const int before = bf::bench::process_threads();
    httplib::Server theirs;
    if (read_timeout_s > 0) theirs.set_read_timeout(read_timeout_s, 0);
    theirs.Get("/metrics", [&session](const httplib::Request&, httplib::Response& res) {
      res.set_content(session.metrics().to_prometheus(), "text/plain; version=0.0.4; charset=utf-8");
    });
    const int port = theirs.bind_to_any_port("127.0.0.1");
    std::thread listener([&theirs] { theirs.listen_after_bind(); });
    while (!theirs.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const std::string name = read_timeout_s > 0 ? fmt::format("cpp-httplib {} read timeout {} s", CPPHTTPLIB_VERSION, read_timeout_s)
                                                : fmt::format("cpp-httplib {} defaults", CPPHTTPLIB_VERSION);
    measure(name, port, bf::bench::process_threads() - before, tricklers, scrapes, read_timeout_s > 0 ? std::min(trickle_ms, 500) : trickle_ms);
    theirs.stop();
    listener.join();
  }
#else
  fmt::print(stderr, "metrics_http_bench: built without cpp-httplib (apt-get install libcpp-httplib-dev, then reconfigure)\n");
#endif
  session.shutdown();
  return 0;
}
