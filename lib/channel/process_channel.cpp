// ProcessChannel::open(): the URI's scheme picks the backend; names and directories are checked
// here, once for all backends.
#include "process_channel_impl.hpp"

#include <blockflow/channel/detail/runtime_dir.hpp>
#include <blockflow/core/detail/clock.hpp>
#include <blockflow/core/names.hpp>

#include <fmt/format.h>

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace blockflow {
namespace detail {

SendOutcome refused(Envelope&& envelope, absl::Status status) {
  SendOutcome out{std::move(status), std::nullopt};
  out.displaced = std::move(envelope);
  return out;
}

absl::Status named(const std::string& uri, const absl::Status& status) {
  if (status.ok()) return status;
  return absl::Status(status.code(), fmt::format("{}: {}", uri, std::string(status.message())));
}

absl::StatusOr<at::Tensor> named(const std::string& uri, absl::StatusOr<at::Tensor> t) {
  if (t.ok()) return t;
  return named(uri, t.status());
}

wire::Header data_header(const Envelope& envelope) {
  wire::Header h;
  h.kind = wire::MessageKind::kData;
  h.request_id = envelope.request_id;
  h.node = envelope.node;
  h.times.sent_ns = now_ns();
  return h;
}

Envelope envelope_of(DecodedMessage&& message) {
  Envelope e;
  e.request_id = message.header.request_id;
  e.node = message.header.node;
  e.tensors = std::move(message.tensors);
  e.sent_ns = now_ns();
  return e;
}

absl::Status check_private_directory(const std::string& dir, const std::string& uri) {
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) {
    return absl::NotFoundError(fmt::format("{}: directory '{}': {}", uri, dir, std::strerror(errno)));
  }
  if (!S_ISDIR(st.st_mode)) return absl::PermissionDeniedError(fmt::format("{}: '{}' is not a directory", uri, dir));
  if (st.st_uid != ::geteuid()) {
    return absl::PermissionDeniedError(fmt::format("{}: directory '{}' belongs to another user (uid {})", uri, dir, st.st_uid));
  }
  if ((st.st_mode & 077) != 0) {
    return absl::PermissionDeniedError(
        fmt::format("{}: directory '{}' is open to other users (mode {:o}); it must be 0700", uri, dir, st.st_mode & 0777));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> channel_directory(const std::string& uri) {
  const std::string dir = fmt::format("{}/blockflow-channels-{}", runtime_root(), ::geteuid());
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::UnavailableError(fmt::format("{}: cannot create '{}': {}", uri, dir, std::strerror(errno)));
  }
  if (auto status = check_private_directory(dir, uri); !status.ok()) return status;
  return dir;
}

bool unix_socket_live(const std::string& path, int type) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path.size() >= sizeof(address.sun_path)) return false;
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  // Never waits: a listener whose backlog is full (it is not accepting now) answers EAGAIN, and is live.
  const int fd = ::socket(AF_UNIX, type | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return false;
  const bool live = ::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0 ||
                    errno == EAGAIN || errno == EINPROGRESS;
  ::close(fd);
  return live;
}

namespace {

absl::StatusOr<std::string> named_socket(const std::string& uri, std::string_view name, std::string_view suffix) {
  if (auto status = check_name("channel", name); !status.ok()) {
    return absl::InvalidArgumentError(fmt::format("{}: {}", uri, std::string(status.message())));
  }
  auto dir = channel_directory(uri);
  if (!dir.ok()) return dir.status();
  return fmt::format("{}/{}{}", *dir, name, suffix);
}

}  // namespace
}  // namespace detail

absl::StatusOr<std::unique_ptr<ProcessChannel>> ProcessChannel::open(std::string_view uri_view, ChannelRole role,
                                                                   ProcessChannelOptions options) {
  const std::string uri(uri_view);
  if (options.capacity == 0) return absl::InvalidArgumentError(fmt::format("{}: capacity must be at least 1", uri));
  const auto scheme_end = uri.find("://");
  const std::string scheme = scheme_end == std::string::npos ? "" : uri.substr(0, scheme_end);
  const std::string rest = scheme_end == std::string::npos ? "" : uri.substr(scheme_end + 3);
  if (scheme != "tcp" && (options.receiver_security.curve() || options.sender_security.curve())) {
    return absl::InvalidArgumentError(fmt::format(
        "{}: CURVE keys (receiver_security, sender_security) are for tcp:// channels; shm:// and ipc:// are "
        "guarded by the channel directory's mode",
        uri));
  }
  if (scheme == "shm") {
    auto path = detail::named_socket(uri, rest, ".shm");
    if (!path.ok()) return path.status();
    return detail::open_shm_channel(uri, *path, role, options);
  }
  if (scheme == "ipc") {
    std::string path;
    if (!rest.empty() && rest.front() == '/') {
      if (rest.find("/../") != std::string::npos || rest.find("/./") != std::string::npos || rest.back() == '/') {
        return absl::InvalidArgumentError(fmt::format("{}: the path must be absolute and plain (no . or ..)", uri));
      }
      if (auto status = detail::check_private_directory(rest.substr(0, std::max<std::size_t>(1, rest.rfind('/'))), uri);
          !status.ok()) {
        return status;
      }
      path = rest;
    } else {
      auto named = detail::named_socket(uri, rest, ".ipc");
      if (!named.ok()) return named.status();
      path = *named;
    }
    return detail::open_zmq_channel(uri, "ipc://" + path, role, options);
  }
  if (scheme == "tcp") {
    const auto colon = rest.rfind(':');
    const bool any_port = colon != std::string::npos && rest.compare(colon + 1, std::string::npos, "*") == 0;
    if (rest.empty() || colon == std::string::npos || colon == 0 || colon + 1 == rest.size() ||
        (!any_port && rest.find_first_not_of("0123456789", colon + 1) != std::string::npos)) {
      return absl::InvalidArgumentError(fmt::format("{}: expected tcp://HOST:PORT", uri));
    }
    if (any_port && role == ChannelRole::kSender) {
      return absl::InvalidArgumentError(fmt::format("{}: a sender needs the receiver's port (tcp://HOST:*: receivers only)", uri));
    }
    return detail::open_zmq_channel(uri, uri, role, options);
  }
  if (scheme == "cuda") {
    auto path = detail::named_socket(uri, rest, ".cuda");
    if (!path.ok()) return path.status();
    return detail::open_shm_channel(uri, *path, role, options, /*cuda=*/true);
  }
  return absl::InvalidArgumentError(fmt::format(
      "{}: unknown channel URI (expected shm://NAME, cuda://NAME, ipc://NAME, ipc:///ABS/PATH or tcp://HOST:PORT)", uri));
}

}  // namespace blockflow
