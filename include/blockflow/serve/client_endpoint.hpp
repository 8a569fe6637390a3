#pragma once
/// @file
/// @brief Remote clients: a session endpoint where other processes submit (task, tensors) over
/// ZeroMQ in the wire format (docs/wire-format.md), and a small C++ client for it. Part of the
/// optional `blockflow::workers` target.

#include <blockflow/channel/curve.hpp>
#include <blockflow/core/session.hpp>

#include <absl/status/statusor.h>
#include <absl/time/time.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace blockflow {

/// @brief What one client of a ClientEndpoint may hold, and how the endpoint authenticates clients.
struct ClientEndpointOptions {
  /// CURVE keys and the admitted clients (curve.hpp). Without keys, a TCP endpoint beyond the
  /// loopback is refused unless `security.insecure`.
  ServerSecurity security;
  /// A request larger than this (all its frames together) is refused with an InvalidArgument reply
  /// naming the limit; a single frame above it is dropped by ZeroMQ before it is read whole, and the
  /// connection closed. No tensor decodes to more elements than its bytes hold (docs/wire-format.md),
  /// so this bounds the elements of a request too. Not bounded: ZeroMQ holds the frames of one
  /// message until its last has come, and has no limit on how many frames a message has, so a peer
  /// allowed to connect can make it buffer many frames below this size before the request is refused.
  std::size_t max_request_bytes = std::size_t{256} << 20;
  /// Requests of one client inside the session at once; more get ResourceExhausted at once, naming
  /// the limit. A client is one connection (a ZeroMQ routing id): a peer that opens several gets
  /// this much on each, so the endpoint-wide bounds below hold every client together.
  std::size_t max_in_flight_per_client = 1024;
  /// Bytes of one client's requests (all their frames) inside the session at once: a request that
  /// would pass it gets ResourceExhausted at once, naming the limit. The session holds a request's
  /// tensors until it resolves.
  std::size_t max_in_flight_bytes_per_client = std::size_t{1} << 30;
  /// Requests of every client together inside the session at once; beyond, ResourceExhausted.
  std::size_t max_in_flight = 4096;
  /// Bytes of every client's requests together inside the session at once; beyond, ResourceExhausted.
  std::size_t max_in_flight_bytes = std::size_t{4} << 30;
  /// Bytes of replies waiting for one client that does not read them (beyond what ZeroMQ buffers:
  /// 16 replies). Replies that would go beyond are dropped and counted (dropped_replies()); the
  /// client's requests time out, and no other client waits for it.
  std::size_t max_backlog_bytes_per_client = std::size_t{64} << 20;
  /// The same for every client together: while replies of this many bytes wait for clients that do
  /// not read, new ones that cannot go at once are dropped and counted too.
  std::size_t max_backlog_bytes = std::size_t{512} << 20;
};

/// @brief Serves a session to remote clients on a ROUTER socket.
///
/// A client sends a kSubmit message (target = task, request_id of its choosing, tensors) and gets
/// back a kReply with the same request_id: the outputs, or status_code/message naming the block and
/// the cause. Malformed frames are counted, logged and dropped; when their request id is readable
/// the client gets an InvalidArgument reply naming the problem. `tcp://` endpoints should name
/// 127.0.0.1 unless clients on other hosts must reach it (`tcp://*:port` binds every interface).
/// One thread owns the socket and never blocks on a client: a client that does not read its replies
/// loses them (ClientEndpointOptions), the others are served; a request for a task whose first
/// block's queue is full (policy block) is handed to a compute lane, which queues it in order,
/// rather than holding that thread (each client has at most max_in_flight_per_client). Thread-safe.
///
/// Lifetime: the endpoint does not own the session, and requests it submitted may still be inside
/// the session when it stops. Their completion callbacks hold a small shared outbox, never the
/// endpoint itself, so:
/// - stopping or destroying the endpoint first is always safe: a request that completes afterwards
///   is dropped (counted in dropped_replies() while the endpoint exists; its client times out);
/// - destroying the session first is safe once no new request can reach it: stop() (or destroy)
///   the endpoint before the session dies, since the endpoint's thread calls Session::submit() for
///   each request it receives. Requests the session cancels on its way down are still answered
///   (Cancelled) if the endpoint serves, or dropped after stop().
/// Declaring the endpoint after its session, as below, gets both right.
/// @code
/// blockflow::Session session;  // ... blocks, paths, start()
/// blockflow::ClientEndpoint endpoint(session, "tcp://127.0.0.1:5555");  // destroyed first
/// @endcode
class ClientEndpoint {
 public:
  /// @brief Binds `endpoint` ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:*", "ipc:///run/x/client")
  /// and starts serving. Throws std::runtime_error naming the endpoint when it cannot bind, when a
  /// key file is unusable, or when a plain-TCP endpoint beyond the loopback is not marked insecure.
  ClientEndpoint(Session& session, const std::string& endpoint, ClientEndpointOptions options = {});
  ~ClientEndpoint();
  ClientEndpoint(const ClientEndpoint&) = delete;
  ClientEndpoint& operator=(const ClientEndpoint&) = delete;

  /// @brief The bound endpoint, with the port resolved when it was "*".
  [[nodiscard]] const std::string& endpoint() const;
  [[nodiscard]] std::uint64_t malformed_frames() const;
  [[nodiscard]] std::uint64_t served() const;
  /// @brief Replies that nobody sent: their request completed after stop() (or was queued, unsent,
  /// when stop() came), their client was gone, or its backlog was full (a client that does not read).
  [[nodiscard]] std::uint64_t dropped_replies() const;
  /// @brief Clients refused by CURVE (curve.hpp) since the endpoint started.
  [[nodiscard]] std::uint64_t auth_failures() const;
  /// @brief Requests of every client inside the session, or answered but not yet taken by the
  /// endpoint's thread; after stop(), what was left then.
  [[nodiscard]] std::size_t in_flight() const;
  /// @brief drain() has begun: new requests are refused (Unavailable).
  [[nodiscard]] bool draining() const;
  /// @brief Stops serving: joins the socket thread, which sends nothing more, and closes the socket
  /// (clients can no longer connect; their requests fail at their timeout). Requests still in the
  /// session are answered by nobody (their clients time out); their replies are dropped and counted
  /// in dropped_replies(). Idempotent; the destructor calls it.
  void stop();
  /// @brief Stops gracefully: new requests get Unavailable ("... is stopping") at once, while the
  /// requests inside the session are answered as they complete; once none is left and every reply
  /// has gone (or `timeout` has passed: what is left then is dropped), stop().
  void drain(absl::Duration timeout);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// @brief A synchronous client of a ClientEndpoint. Not thread-safe: one per thread.
class RemoteClient {
 public:
  /// @brief Connects to `endpoint`; with `security.curve()`, as a CURVE client (throws
  /// std::runtime_error naming the key file at fault). A malformed endpoint throws std::runtime_error
  /// naming it. A server that refuses the key never answers:
  /// submit() then ends in DeadlineExceeded.
  explicit RemoteClient(const std::string& endpoint, absl::Duration timeout = absl::Seconds(60),
                        const ClientSecurity& security = {});
  ~RemoteClient();
  RemoteClient(const RemoteClient&) = delete;
  RemoteClient& operator=(const RemoteClient&) = delete;

  /// @brief Submits and waits for the reply. DeadlineExceeded after the timeout; otherwise the
  /// outputs or the session's error status.
  absl::StatusOr<Tensors> submit(const std::string& task, const Tensors& inputs);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace blockflow
