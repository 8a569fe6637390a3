#pragma once
/// @file
/// @brief Authenticated, encrypted TCP: ZeroMQ CURVE keys and the security settings of every TCP
/// endpoint (client endpoint, control endpoint, worker join, tcp:// channels). Part of the optional
/// `blockflow::channels` target. docs/security.md has the threat model.
///
/// Keys live in files (`blockflowctl keygen NAME` writes a pair):
/// - `NAME.key`: the public key, to be copied to whoever must accept this peer;
/// - `NAME.key_secret`: public and secret key, mode 0600; a secret file that its group or others
///   can read is refused.
/// Both hold lines `public-key = "<40 Z85 characters>"` (and `secret-key = "..."`); lines starting
/// with `#` are comments.
///
/// A server (ServerSecurity) has its own pair and a directory of the public keys it admits (its
/// `authorized_keys_dir`): a peer is known by the name of its key file, `w1.key` being the key of
/// `w1`. A worker named `w1` that joins a session over TCP must hold the key the session knows as
/// `w1`: any other key, even one the directory admits, is refused. Every refusal (unknown key, no
/// key, wrong server key) is counted in `MetricsSnapshot::auth_failures`
/// (`blockflow_auth_failures_total`) and logged with the endpoint and the key's fingerprint.
///
/// A TCP endpoint bound to an address other than the loopback without keys is refused unless its
/// ServerSecurity says `insecure` (then a warning is logged). `ipc://` endpoints and shared memory
/// are protected by file modes (0700 private directories), not by keys.

#include <absl/status/status.h>
#include <absl/status/statusor.h>

#include <string>

namespace blockflow {

/// @brief A CURVE key pair in Z85 text (40 characters each).
struct CurveKeyPair {
  std::string public_key;
  std::string secret_key;
};

/// @brief A fresh key pair from libsodium (through libzmq). Fails only when libzmq lacks CURVE.
absl::StatusOr<CurveKeyPair> generate_curve_keypair();

/// @brief Writes `DIR/NAME.key` (public key, mode 0644) and `DIR/NAME.key_secret` (both, mode
/// 0600). NAME follows check_name(); existing files are not overwritten (AlreadyExists).
absl::Status write_curve_keypair(const std::string& dir, const std::string& name, const CurveKeyPair& pair);

/// @brief The public key of a `.key` or `.key_secret` file; the error names the file.
absl::StatusOr<std::string> read_curve_public_key(const std::string& path);

/// @brief The pair of a `.key_secret` file; refused when the file is readable by group or others.
absl::StatusOr<CurveKeyPair> read_curve_keypair(const std::string& path);

/// @brief A short form of a public key for logs and for comparing by eye: 16 hex digits of its
/// first 8 bytes, e.g. "3f9a01c4d2e87b10".
std::string curve_fingerprint(const std::string& public_key);

/// @brief How a TCP server endpoint authenticates its peers.
struct ServerSecurity {
  /// This server's `.key_secret` file. Empty: no CURVE (plain TCP).
  std::string secret_key_file;
  /// The directory of the `.key` files of the peers admitted (read when the endpoint starts; a
  /// peer's name is its file's name without `.key`). Required with secret_key_file.
  std::string authorized_keys_dir;
  /// Allows a plain-TCP bind to an address other than the loopback (logged as a warning). Without
  /// it such a bind is refused.
  bool insecure = false;

  [[nodiscard]] bool curve() const { return !secret_key_file.empty(); }
};

/// @brief How a client (RemoteClient, blockflowctl, a joining worker) authenticates itself and the
/// server it reaches.
struct ClientSecurity {
  std::string secret_key_file;  ///< this peer's `.key_secret` file; empty: no CURVE
  std::string server_key_file;  ///< the server's `.key` file; required with secret_key_file

  [[nodiscard]] bool curve() const { return !secret_key_file.empty(); }
};

}  // namespace blockflow
