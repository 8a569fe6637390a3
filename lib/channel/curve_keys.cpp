// CURVE key files (format in blockflow/curve.hpp) and the client side of CURVE. Plain C++ and
// libzmq: compiled into the library and into blockflow-worker.

#include <blockflow/channel/detail/curve_keys.hpp>
#include <blockflow/core/detail/name_rule.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <sstream>

namespace blockflow::detail {
namespace {

// The quoted value of `field = "..."` on a line, or "" when the line is not that field.
std::string field_value(const std::string& line, const std::string& field) {
  const auto start = line.find_first_not_of(" \t");
  if (start == std::string::npos || line.compare(start, field.size(), field) != 0) return "";
  const auto open = line.find('"', start + field.size());
  if (open == std::string::npos || line.find_first_not_of(" \t=", start + field.size()) != open) return "";
  const auto close = line.find('"', open + 1);
  if (close == std::string::npos) return "";
  return line.substr(open + 1, close - open - 1);
}

bool valid_z85_key(const std::string& z85) {
  std::uint8_t binary[32];
  return z85.size() == 40 && zmq_z85_decode(binary, z85.c_str()) != nullptr;
}

std::string hex8(const std::uint8_t* bytes) {
  char out[17];
  for (int i = 0; i < 8; ++i) std::snprintf(out + 2 * i, 3, "%02x", bytes[i]);
  return std::string(out, 16);
}

// Creates `path` exclusively with `mode` and writes `text`: 0 or errno, with `error` set.
int write_new_file(const std::string& path, const std::string& text, mode_t mode, std::string& error) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  if (fd < 0) {
    const int e = errno;
    error = e == EEXIST ? "'" + path + "' exists already: not overwritten"
                        : "cannot create '" + path + "': " + std::strerror(e);
    return e;
  }
  ::fchmod(fd, mode);  // whatever the umask
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = n < 0 ? errno : EIO;
      ::close(fd);
      ::unlink(path.c_str());
      error = "cannot write '" + path + "': " + std::strerror(e);
      return e;
    }
    done += static_cast<std::size_t>(n);
  }
  ::close(fd);
  return 0;
}

}  // namespace

int write_key_files(const std::string& dir, const std::string& name, const KeyFile& pair, std::string& error) {
  if (const char* problem = name_problem(name)) {
    error = "key name '" + name + "' " + problem + " (names are 1 to 64 characters from A-Z a-z 0-9 _ . -, not starting with . or -)";
    return EINVAL;
  }
  if (!valid_z85_key(pair.public_key) || !valid_z85_key(pair.secret_key)) {
    error = "key pair '" + name + "' is not two 40-character Z85 keys";
    return EINVAL;
  }
  const std::string base = (dir.empty() ? std::string(".") : dir) + "/" + name;
  const std::string header = "# BlockFlow CURVE key of '" + name + "' (blockflowctl keygen), fingerprint " +
                             key_fingerprint(pair.public_key) + "\n";
  const std::string public_line = "    public-key = \"" + pair.public_key + "\"\n";
  if (int e = write_new_file(base + ".key_secret",
                             header + "# SECRET: keep it on this host, mode 0600\ncurve\n" + public_line +
                                 "    secret-key = \"" + pair.secret_key + "\"\n",
                             0600, error)) {
    return e;
  }
  const int e = write_new_file(base + ".key",
                               header + "# public: copy it into the authorized keys directory of the peers that admit '" +
                                   name + "'\ncurve\n" + public_line,
                               0644, error);
  // Never leave a secret key beside a public key of another pair: the secret file was made by this call.
  if (e != 0) ::unlink((base + ".key_secret").c_str());
  return e;
}

bool read_key_file(const std::string& path, bool need_secret, KeyFile& out, std::string& error) {
  // Only a regular file is opened (never a device or a FIFO), and what was opened is looked at again:
  // the file checked is the file read, even when the name was swapped in between.
  struct stat named {};
  if (::stat(path.c_str(), &named) != 0) {
    error = "key file '" + path + "': " + std::strerror(errno);
    return false;
  }
  if (!S_ISREG(named.st_mode)) {
    error = "key file '" + path + "' is not a regular file";
    return false;
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    error = "key file '" + path + "': " + std::strerror(errno);
    return false;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_dev != named.st_dev || st.st_ino != named.st_ino) {
    ::close(fd);
    error = "key file '" + path + "' changed while it was opened: not read";
    return false;
  }
  std::string text;
  char buffer[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int e = errno;
      ::close(fd);
      error = "key file '" + path + "' cannot be read: " + std::strerror(e);
      return false;
    }
    if (n == 0 || text.size() > 65536) break;  // a key file is a few lines; more is something else
    text.append(buffer, static_cast<std::size_t>(n));
  }
  ::close(fd);
  std::istringstream in(text);
  KeyFile keys;
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) {
    if (++lines > 64) break;  // a key file is a few lines; this is something else
    if (auto v = field_value(line, "public-key"); !v.empty()) keys.public_key = v;
    if (auto v = field_value(line, "secret-key"); !v.empty()) keys.secret_key = v;
  }
  if (!valid_z85_key(keys.public_key)) {
    error = "key file '" + path + "' has no valid public-key line (40 Z85 characters in quotes)";
    return false;
  }
  if (need_secret && !valid_z85_key(keys.secret_key)) {
    error = "key file '" + path + "' has no valid secret-key line: is it the .key_secret file?";
    return false;
  }
  if (need_secret && (st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    error = "secret key file '" + path + "' is readable by others (mode " + mode + "); chmod 600 it";
    return false;
  }
  if (!keys.secret_key.empty() && need_secret) {
    char derived[41];
    if (zmq_curve_public(derived, keys.secret_key.c_str()) != 0 || keys.public_key != derived) {
      error = "key file '" + path + "': its public key does not belong to its secret key";
      return false;
    }
  }
  if (!need_secret) keys.secret_key.clear();
  out = std::move(keys);
  return true;
}

std::string key_fingerprint(const std::string& public_key_z85) {
  std::uint8_t binary[32];
  if (public_key_z85.size() != 40 || zmq_z85_decode(binary, public_key_z85.c_str()) == nullptr) return "?";
  return hex8(binary);
}

std::string key_fingerprint_binary(const std::string& key32) {
  if (key32.size() != 32) return "?";
  return hex8(reinterpret_cast<const std::uint8_t*>(key32.data()));
}

bool read_curve_client_keys(const std::string& secret_key_file, const std::string& server_key_file,
                            CurveClientKeys& out, std::string& error) {
  if (server_key_file.empty()) {
    error = "a CURVE client needs the server's public key file besides its own secret key file";
    return false;
  }
  KeyFile server;
  if (!read_key_file(secret_key_file, true, out.own, error) || !read_key_file(server_key_file, false, server, error)) {
    return false;
  }
  out.server_public_key = server.public_key;
  return true;
}

void apply_curve_client(zmq::socket_t& socket, const CurveClientKeys& keys) {
  socket.set(zmq::sockopt::curve_serverkey, keys.server_public_key);
  socket.set(zmq::sockopt::curve_publickey, keys.own.public_key);
  socket.set(zmq::sockopt::curve_secretkey, keys.own.secret_key);
}

bool configure_curve_client(zmq::socket_t& socket, const std::string& secret_key_file,
                            const std::string& server_key_file, std::string& error) {
  CurveClientKeys keys;
  if (!read_curve_client_keys(secret_key_file, server_key_file, keys, error)) return false;
  apply_curve_client(socket, keys);
  return true;
}

}  // namespace blockflow::detail
