// CURVE key pairs and key files: the public side of blockflow/curve.hpp.

#include <blockflow/channel/curve.hpp>
#include <blockflow/channel/detail/curve_keys.hpp>
#include <blockflow/core/names.hpp>

#include <fmt/format.h>
#include <zmq.h>

#include <cerrno>

namespace blockflow {

absl::StatusOr<CurveKeyPair> generate_curve_keypair() {
  char public_key[41], secret_key[41];
  if (zmq_curve_keypair(public_key, secret_key) != 0) {
    return absl::UnimplementedError(fmt::format("this libzmq cannot make CURVE keys: {}", zmq_strerror(zmq_errno())));
  }
  return CurveKeyPair{public_key, secret_key};
}

absl::Status write_curve_keypair(const std::string& dir, const std::string& name, const CurveKeyPair& pair) {
  if (auto status = check_name("key", name); !status.ok()) return status;
  std::string error;
  switch (detail::write_key_files(dir, name, {pair.public_key, pair.secret_key}, error)) {
    case 0: return absl::OkStatus();
    case EEXIST: return absl::AlreadyExistsError(error);
    case EINVAL: return absl::InvalidArgumentError(error);
    default: return absl::UnavailableError(error);
  }
}

absl::StatusOr<std::string> read_curve_public_key(const std::string& path) {
  detail::KeyFile keys;
  std::string error;
  if (!detail::read_key_file(path, false, keys, error)) return absl::InvalidArgumentError(error);
  return keys.public_key;
}

absl::StatusOr<CurveKeyPair> read_curve_keypair(const std::string& path) {
  detail::KeyFile keys;
  std::string error;
  if (!detail::read_key_file(path, true, keys, error)) return absl::InvalidArgumentError(error);
  return CurveKeyPair{keys.public_key, keys.secret_key};
}

std::string curve_fingerprint(const std::string& public_key) { return detail::key_fingerprint(public_key); }

}  // namespace blockflow
