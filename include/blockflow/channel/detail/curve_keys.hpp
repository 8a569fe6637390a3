#pragma once
// Internal: CURVE key files and the client side of a CURVE connection, in plain C++ and libzmq so
// that blockflow-worker (which links neither BlockFlow nor Abseil) shares them with the library.
// The file format is documented in blockflow/curve.hpp.

#include <zmq.hpp>

#include <string>

namespace blockflow::detail {

struct KeyFile {
  std::string public_key;  // Z85, 40 characters
  std::string secret_key;  // Z85, empty in a public key file
};

/// Reads a key file. With `need_secret` the file must hold a secret key and be readable by its
/// owner only. False with `error` naming the file and the problem.
bool read_key_file(const std::string& path, bool need_secret, KeyFile& out, std::string& error);

/// Writes DIR/NAME.key_secret (mode 0600) and DIR/NAME.key (0644) for `pair` (blockflow/curve.hpp
/// has the format), never over existing files. 0, or an errno value (EEXIST, EINVAL for a name or
/// key that is not valid) with `error` naming the file or the name.
int write_key_files(const std::string& dir, const std::string& name, const KeyFile& pair, std::string& error);

/// 16 hex digits of the first 8 bytes of a Z85 public key ("?" for a malformed one).
std::string key_fingerprint(const std::string& public_key_z85);
/// The same for a 32-byte binary key (as a ZAP request carries it).
std::string key_fingerprint_binary(const std::string& key32);

/// A CURVE client's keys: its own pair and the server's public key.
struct CurveClientKeys {
  KeyFile own;
  std::string server_public_key;  // Z85
};
/// Reads them from the two files. False with `error` naming the file at fault.
bool read_curve_client_keys(const std::string& secret_key_file, const std::string& server_key_file,
                            CurveClientKeys& out, std::string& error);
/// Makes `socket` a CURVE client with `keys`. Call before connect().
void apply_curve_client(zmq::socket_t& socket, const CurveClientKeys& keys);

/// Makes `socket` a CURVE client: its pair from `secret_key_file`, the server's public key from
/// `server_key_file`. Call before connect(). False with `error` naming the file at fault.
bool configure_curve_client(zmq::socket_t& socket, const std::string& secret_key_file,
                            const std::string& server_key_file, std::string& error);

}  // namespace blockflow::detail
