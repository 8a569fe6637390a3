#pragma once
// Internal: the server side of CURVE (blockflow/curve.hpp) for the sockets of one ZeroMQ context,
// and the rule for plain-TCP binds.

#include <blockflow/channel/curve.hpp>

#include <absl/status/status.h>
#include <absl/status/statusor.h>
#include <zmq.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace blockflow::detail {

/// OK for `ipc://`, `inproc://` and loopback TCP endpoints, and for any TCP endpoint with CURVE
/// keys (a bind to every interface is logged at info level). A plain-TCP endpoint beyond the
/// loopback: FailedPrecondition naming `what` and the endpoint, unless `security.insecure` (then a
/// warning is logged).
absl::Status check_tcp_bind(const std::string& endpoint, const ServerSecurity& security, std::string_view what);

/// The ZAP handler (ZeroMQ RFC 27) of one context, on a thread of its own, and the CURVE server
/// settings of the sockets it guards. Keys are read once, by start(). Refusals are counted here and
/// in auth_failure_counter(), and logged (rate-limited) with `what`, the peer's address and the
/// key's fingerprint. Destroy it after the sockets it secured and before their context.
class CurveServer {
 public:
  static absl::StatusOr<std::unique_ptr<CurveServer>> start(zmq::context_t& context, const ServerSecurity& security,
                                                            std::string what);
  ~CurveServer();
  CurveServer(const CurveServer&) = delete;
  CurveServer& operator=(const CurveServer&) = delete;

  /// Makes `socket` a CURVE server; call before bind(). It admits the keys of the authorized
  /// directory, or only the key named `only` when that is not empty. Handshakes that fail before
  /// the key is known (no CURVE, a wrong server key) are counted too.
  void secure(zmq::socket_t& socket, const std::string& only = "");

  /// Renames the server in its log lines (say, once its port is known).
  void describe(std::string what);

  [[nodiscard]] std::uint64_t failures() const;
  /// The names of the keys admitted (file names without `.key`), sorted.
  [[nodiscard]] std::vector<std::string> authorized() const;

  struct State;

 private:
  explicit CurveServer(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace blockflow::detail
