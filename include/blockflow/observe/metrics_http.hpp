#pragma once
/// @file
/// @brief Exporting a session's metrics to monitoring tools: a small HTTP endpoint that Prometheus
/// scrapes, and a file for node_exporter's textfile collector.

#include <blockflow/core/metrics.hpp>

#include <absl/status/status.h>

#include <memory>
#include <string>

namespace blockflow {

class Session;

/// @brief Serves `GET /metrics` (Prometheus text, MetricsSnapshot::to_prometheus()) and
/// `GET /metrics.json` (MetricsSnapshot::to_json()) of a session on its own thread, up to 64
/// connections at once (poll()); each connection has 2 s to send its request and 2 s to take the
/// reply, so a client that trickles bytes holds no scrape back. With 64 open, a new client is still
/// taken: the connection that has waited longest for its request is closed for it. A snapshot that
/// cannot be written (out of memory) is a 500, never the end of the thread. Binds 127.0.0.1 unless
/// another address is named ("0.0.0.0:9464" for every interface).
/// The session must outlive the server.
class MetricsHttpServer {
 public:
  /// @brief `address` is "IPV4-ADDRESS:PORT" (a dotted address, not a host name: "127.0.0.1:9464",
  /// "0.0.0.0:9464"); port 0 takes a free one (see port()). Throws std::runtime_error naming the
  /// address when it is not of that form or cannot be bound.
  explicit MetricsHttpServer(const Session& session, const std::string& address = "127.0.0.1:9464");
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  [[nodiscard]] int port() const;
  [[nodiscard]] std::uint64_t requests_served() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// @brief Writes the snapshot's Prometheus text to `path` atomically (a temporary file renamed
/// over it), as node_exporter's textfile collector expects (name it *.prom).
absl::Status write_prometheus_file(const MetricsSnapshot& snapshot, const std::string& path);

}  // namespace blockflow
