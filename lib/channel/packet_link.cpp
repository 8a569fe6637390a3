#include <blockflow/channel/detail/packet_link.hpp>
#include <blockflow/core/detail/clock.hpp>
#include <blockflow/channel/wire_format.hpp>

#include <fmt/format.h>

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

namespace blockflow::detail {
namespace {

// Header frame + one handle per tensor.
constexpr std::uint32_t kMaxFrames = static_cast<std::uint32_t>(wire::kMaxTensors) + 1;

void put_u32(char* at, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) at[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
std::uint32_t get_u32(const unsigned char* at) {
  return static_cast<std::uint32_t>(at[0]) | static_cast<std::uint32_t>(at[1]) << 8 |
         static_cast<std::uint32_t>(at[2]) << 16 | static_cast<std::uint32_t>(at[3]) << 24;
}

// "N of this process's M descriptors are open" (RLIMIT_NOFILE's soft limit), for an error that
// may come from running out of them.
std::string descriptors_in_use() {
  rlimit limit{};
  const bool limited = ::getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) {  // counting takes a descriptor too
    return limited ? fmt::format("all of this process's {} descriptors (RLIMIT_NOFILE) are open", limit.rlim_cur)
                   : std::string("this process can open no descriptor");
  }
  std::size_t open = 0;
  while (const dirent* entry = ::readdir(dir)) open += entry->d_name[0] != '.';
  ::closedir(dir);
  --open;  // the directory's own
  if (!limited) return fmt::format("{} descriptors are open here", open);
  return fmt::format("{} of this process's {} descriptors (RLIMIT_NOFILE) are open", open, limit.rlim_cur);
}

std::string table_of(const std::vector<std::string_view>& frames) {
  std::string table(4 * (frames.size() + 1), '\0');
  put_u32(table.data(), static_cast<std::uint32_t>(frames.size()));
  for (std::size_t i = 0; i < frames.size(); ++i) put_u32(table.data() + 4 * (i + 1), static_cast<std::uint32_t>(frames[i].size()));
  return table;
}

absl::StatusOr<sockaddr_un> address_of(const std::string& path) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(fmt::format("socket path '{}' is longer than {} bytes", path, sizeof(address.sun_path) - 1));
  }
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  return address;
}

}  // namespace

std::string encode_packet(const std::vector<std::string_view>& frames) {
  std::string packet = table_of(frames);
  for (const auto& f : frames) packet.append(f.data(), f.size());
  return packet;
}

absl::StatusOr<std::vector<zmq::message_t>> decode_packet(const void* data, std::size_t size) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  if (size < 4) return absl::InvalidArgumentError(fmt::format("packet of {} bytes: shorter than its frame count", size));
  const std::uint32_t count = get_u32(bytes);
  if (count == 0 || count > kMaxFrames) {
    return absl::InvalidArgumentError(fmt::format("packet with {} frames (1 to {} allowed)", count, kMaxFrames));
  }
  const std::size_t table = 4 * (static_cast<std::size_t>(count) + 1);
  if (size < table) return absl::InvalidArgumentError(fmt::format("packet of {} bytes: truncated frame table", size));
  std::size_t total = table;
  for (std::uint32_t i = 0; i < count; ++i) total += get_u32(bytes + 4 * (i + 1));
  if (total != size) {
    return absl::InvalidArgumentError(fmt::format("packet of {} bytes, but its frame table adds up to {}", size, total));
  }
  std::vector<zmq::message_t> frames;
  frames.reserve(count);
  std::size_t at = table;
  for (std::uint32_t i = 0; i < count; ++i) {
    const std::size_t n = get_u32(bytes + 4 * (i + 1));
    frames.emplace_back(bytes + at, n);
    at += n;
  }
  return frames;
}

PacketLink::PacketLink(int fd) : fd_(fd) {}
PacketLink::~PacketLink() { ::close(fd_); }

absl::StatusOr<std::shared_ptr<PacketLink>> PacketLink::connect(const std::string& path) {
  auto address = address_of(path);
  if (!address.ok()) return address.status();
  // Non-blocking while it connects: a listener whose backlog is full (it is not accepting now)
  // refuses at once (EAGAIN) instead of holding the caller for as long as it does not accept.
  const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::UnavailableError(fmt::format("data link: socket: {}", std::strerror(errno)));
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&*address), sizeof(*address)) != 0) {
    const int e = errno;
    ::close(fd);
    return absl::UnavailableError(fmt::format("data link: cannot connect to '{}': {}", path,
                                              e == EAGAIN ? "it accepts no connection now (its backlog is full)"
                                                          : std::strerror(e)));
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {  // blocking from here, as links are
    const int e = errno;
    ::close(fd);
    return absl::UnavailableError(fmt::format("data link: fcntl: {}", std::strerror(e)));
  }
  return std::make_shared<PacketLink>(fd);
}

absl::StatusOr<std::pair<std::shared_ptr<PacketLink>, std::shared_ptr<PacketLink>>> PacketLink::pair() {
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fds) != 0) {
    return absl::UnavailableError(fmt::format("data link: socketpair: {}", std::strerror(errno)));
  }
  return std::pair{std::make_shared<PacketLink>(fds[0]), std::make_shared<PacketLink>(fds[1])};
}

ReceivedFds& ReceivedFds::operator=(ReceivedFds&& other) noexcept {
  if (this != &other) {
    close_all();
    fds_ = std::exchange(other.fds_, {});
  }
  return *this;
}

void ReceivedFds::close_all() {
  for (const int fd : fds_) ::close(fd);
  fds_.clear();
}

absl::Status PacketLink::send(const std::vector<std::string_view>& frames, bool wait) {
  return send(frames, wait, {}, nullptr);
}

absl::Status PacketLink::send(const std::vector<std::string_view>& frames, bool wait, const std::vector<std::uint64_t>& keys,
                              const std::function<LinkFd(std::uint64_t)>& fd_of) {
  const std::string table = table_of(frames);
  std::vector<iovec> parts;
  parts.reserve(frames.size() + 1);
  parts.push_back({const_cast<char*>(table.data()), table.size()});
  std::size_t total = table.size();
  for (const auto& f : frames) {
    parts.push_back({const_cast<char*>(f.data()), f.size()});
    total += f.size();
  }
  if (total > kMaxPacketBytes) {
    return absl::InvalidArgumentError(fmt::format("data link: a packet of {} bytes exceeds {}", total, kMaxPacketBytes));
  }
  msghdr message{};
  message.msg_iov = parts.data();
  message.msg_iovlen = parts.size();
  if (keys.empty()) return send_message(message, wait);
  // A packet whose keys were all carried goes at once. One with a new key is sent under carry_mu_,
  // never waiting there (a sender that may not wait is held up for microseconds at most): another
  // packet with that key waits for it, rather than carry it twice or overtake it. While the peer's
  // queue is full it waits for room without the lock, then looks again.
  const std::int64_t timeout_ns = send_timeout_ns_.load(std::memory_order_relaxed);
  const absl::Time deadline = timeout_ns < 0 ? absl::InfiniteFuture() : absl::Now() + absl::Nanoseconds(timeout_ns);
  while (true) {
    std::vector<LinkFd> attach;
    carry_mu_.Lock();
    for (const std::uint64_t key : keys) {
      if (std::any_of(attach.begin(), attach.end(), [&](const LinkFd& a) { return a.key == key; })) continue;
      if (auto it = carried_.find(key); it != carried_.end()) {
        const auto alive = it->second.alive.lock();
        if (alive && (it->second.resend == nullptr || it->second.resend->load(std::memory_order_acquire) == 0)) continue;
      }
      LinkFd fd = fd_of ? fd_of(key) : LinkFd{};
      if (fd.fd >= 0) attach.push_back(std::move(fd));
    }
    if (attach.empty()) {
      carry_mu_.Unlock();
      return send_message(message, wait);
    }
    if (attach.size() > kMaxPacketFds) {
      carry_mu_.Unlock();
      return absl::InvalidArgumentError(fmt::format("data link: a packet naming {} new pools (at most {})", attach.size(), kMaxPacketFds));
    }
    std::vector<char> control(CMSG_SPACE(sizeof(int) * attach.size()), 0);
    message.msg_control = control.data();
    message.msg_controllen = control.size();
    cmsghdr* c = CMSG_FIRSTHDR(&message);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * attach.size());
    for (std::size_t i = 0; i < attach.size(); ++i) {
      std::memcpy(CMSG_DATA(c) + i * sizeof(int), &attach[i].fd, sizeof(int));
    }
    absl::Status sent = send_message(message, /*wait=*/false);
    if (sent.ok()) {
      for (const auto& a : attach) carried_.insert_or_assign(a.key, Carried{a.keep, a.resend});
      // Keys whose descriptor is gone from this process (a pool trimmed) can never be named again.
      if (carried_.size() > kCarriedPruneAt) absl::erase_if(carried_, [](const auto& c) { return c.second.alive.expired(); });
    }
    carry_mu_.Unlock();
    message.msg_control = nullptr;
    message.msg_controllen = 0;
    if (!wait || sent.code() != absl::StatusCode::kResourceExhausted) return sent;
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError("data link: the peer's receive queue stayed full for the send timeout");
    }
    pollfd item{fd_, POLLOUT, 0};
    (void)::poll(&item, 1, left == absl::InfiniteDuration() ? 100 : static_cast<int>(std::min<std::int64_t>(100, absl::ToInt64Milliseconds(left) + 1)));
  }
}

absl::Status PacketLink::send_message(msghdr& message, bool wait) {
  while (true) {
    const ssize_t n = ::sendmsg(fd_, &message, MSG_NOSIGNAL | (wait ? 0 : MSG_DONTWAIT));
    if (n >= 0) return absl::OkStatus();
    const int e = errno;
    switch (e) {
      case EINTR:
        continue;
      case EPIPE:  // the peer closed its end or stopped reading (shutdown(SHUT_RD))
      case ECONNRESET:
      case ENOTCONN:
        return absl::UnavailableError(fmt::format("data link: the peer is gone or no longer reads ({})", std::strerror(e)));
      case EAGAIN:  // the peer's queue is full: at once (`wait` false), or for the send timeout
        return wait ? absl::DeadlineExceededError("data link: the peer's receive queue stayed full for the send timeout")
                    : absl::ResourceExhaustedError("data link: the peer's receive queue is full");
      default:  // ENOBUFS, ENOMEM, EMSGSIZE...: this packet failed, the link is not known to be down
        return absl::InternalError(fmt::format("data link: send: {}", std::strerror(e)));
    }
  }
}

void PacketLink::shut_down() { (void)::shutdown(fd_, SHUT_RD); }

void PacketLink::set_send_timeout(absl::Duration timeout) {
  send_timeout_ns_.store(std::max<std::int64_t>(0, absl::ToInt64Nanoseconds(timeout)), std::memory_order_relaxed);
  const std::int64_t us = std::max<std::int64_t>(1, absl::ToInt64Microseconds(timeout));
  const timeval tv{static_cast<time_t>(us / 1000000), static_cast<suseconds_t>(us % 1000000)};
  (void)::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

std::optional<PacketLink::Received> PacketLink::receive(int timeout_ms, absl::Duration spin) {
  if (buffer_.empty()) buffer_.resize(kMaxPacketBytes);
  // An infinite spin (WorkerOptions::busy_poll): poll for the whole timeout and never sleep.
  const bool busy = spin == absl::InfiniteDuration();
  const std::int64_t spin_end_ns =
      busy ? (timeout_ms < 0 ? std::numeric_limits<std::int64_t>::max() : now_ns() + std::int64_t{timeout_ms} * 1000000)
      : gaps_.streaming(spin) ? now_ns() + absl::ToInt64Nanoseconds(spin)
                              : 0;
  bool waited = false;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxPacketFds)];
  while (true) {
    iovec part{buffer_.data(), buffer_.size()};
    msghdr message{};
    message.msg_iov = &part;
    message.msg_iovlen = 1;
    message.msg_control = control;
    message.msg_controllen = sizeof(control);
    const ssize_t n = ::recvmsg(fd_, &message, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (waited) return std::nullopt;
      if (spin_end_ns != 0 && now_ns() < spin_end_ns) continue;
      if (busy) return std::nullopt;
      pollfd item{fd_, POLLIN, 0};
      if (::poll(&item, 1, timeout_ms) <= 0) return std::nullopt;  // timeout (or EINTR: the caller loops)
      waited = true;
      continue;
    }
    gaps_.note(now_ns());
    Received out;
    // Descriptors first, whatever else is wrong with the packet: each one is ours to close.
    for (cmsghdr* c = CMSG_FIRSTHDR(&message); n >= 0 && c != nullptr; c = CMSG_NXTHDR(&message, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (std::size_t i = 0; i < count; ++i) {
        int fd = -1;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        out.fds.add(fd);
      }
    }
    if (n <= 0) {  // 0: the peer closed its end; an error: the link is broken either way
      out.closed = true;
      return out;
    }
    if ((message.msg_flags & MSG_TRUNC) != 0) {
      out.frames = absl::InvalidArgumentError(fmt::format("packet larger than {} bytes", kMaxPacketBytes));
      return out;
    }
    if ((message.msg_flags & MSG_CTRUNC) != 0) {  // descriptors lost (too many, or ours ran out)
      // Each pool a consumer maps holds a descriptor: a process receiving from very many senders
      // may need a higher limit (docs/security.md).
      out.frames = absl::InvalidArgumentError(
          fmt::format("packet whose descriptors did not all arrive (at most {} a packet; {})", kMaxPacketFds, descriptors_in_use()));
      shut_down();  // the peer counts them as carried
      return out;
    }
    out.frames = decode_packet(buffer_.data(), static_cast<std::size_t>(n));
    return out;
  }
}

absl::StatusOr<PathLock> PathLock::take(const std::string& path) {
  std::string file = path + ".lock";
  for (int attempt = 0; attempt < 16; ++attempt) {
    const int fd = ::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) return absl::UnavailableError(fmt::format("data link: cannot open '{}': {}", file, std::strerror(errno)));
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int e = errno;
      ::close(fd);
      if (e == EWOULDBLOCK) return absl::AlreadyExistsError(fmt::format("data link: another listener holds '{}'", path));
      return absl::UnavailableError(fmt::format("data link: cannot lock '{}': {}", file, std::strerror(e)));
    }
    // Locked: still the file at the path? Its last holder may have unlinked it meanwhile.
    struct stat held {}, named {};
    if (::fstat(fd, &held) == 0 && ::stat(file.c_str(), &named) == 0 && held.st_dev == named.st_dev &&
        held.st_ino == named.st_ino) {
      return PathLock(fd, std::move(file));
    }
    ::close(fd);
  }
  return absl::UnavailableError(fmt::format("data link: cannot lock '{}': it keeps being replaced", file));
}

void PathLock::let_go() noexcept {
  if (fd_ < 0) return;
  ::unlink(file_.c_str());  // while still held: a taker that opened it finds it gone, and tries again
  ::close(fd_);              // the lock goes with the descriptor
  fd_ = -1;
}

PathLock& PathLock::operator=(PathLock&& other) noexcept {
  if (this != &other) {
    let_go();
    fd_ = std::exchange(other.fd_, -1);
    file_ = std::move(other.file_);
  }
  return *this;
}

PathLock::~PathLock() { let_go(); }

absl::StatusOr<std::unique_ptr<PacketListener>> PacketListener::bind(const std::string& path, std::optional<PathLock> lock) {
  auto address = address_of(path);
  if (!address.ok()) return address.status();
  if (!lock) {
    auto taken = PathLock::take(path);
    if (!taken.ok()) return taken.status();
    lock.emplace(*std::move(taken));
  }
  const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::UnavailableError(fmt::format("data link: socket: {}", std::strerror(errno)));
  ::unlink(path.c_str());
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&*address), sizeof(*address)) != 0 || ::listen(fd, 8) != 0) {
    const int e = errno;
    ::close(fd);
    return absl::UnavailableError(fmt::format("data link: cannot bind '{}': {}", path, std::strerror(e)));
  }
  return std::unique_ptr<PacketListener>(new PacketListener(fd, path, *std::move(lock)));
}

PacketListener::~PacketListener() {
  // Unlinked while still listening: once the socket is closed, a new listener may bind this path
  // (unix_socket_live() says it is free), and its file must not be unlinked by us.
  ::unlink(path_.c_str());
  ::close(fd_);
}

std::optional<PacketListener::Accepted> PacketListener::accept() {
  if (now_ns() < accept_after_ns_.load(std::memory_order_relaxed)) return std::nullopt;
  const int fd = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    if (error == EMFILE || error == ENFILE || error == ENOBUFS || error == ENOMEM) {
      accept_after_ns_.store(now_ns() + kAcceptBackoffNs, std::memory_order_relaxed);
      const std::string why = fmt::format("{}: a connection could not be accepted: {} ({})", path_, std::strerror(error),
                                          error == ENOBUFS || error == ENOMEM ? "out of memory" : descriptors_in_use());
      MutexLock lock(&error_mu_);
      error_ = absl::ResourceExhaustedError(why);
    }
    if (error == EAGAIN || error == EWOULDBLOCK) {  // none pending: what held one up is over
      MutexLock lock(&error_mu_);
      error_ = absl::OkStatus();
    }
    return std::nullopt;  // ECONNABORTED and the like: that one is gone
  }
  {
    MutexLock lock(&error_mu_);
    error_ = absl::OkStatus();
  }
  Accepted out;
  ucred credentials{};
  socklen_t length = sizeof(credentials);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &credentials, &length) == 0) {
    out.peer_pid = credentials.pid;
    out.peer_uid = credentials.uid;
  }
  out.link = std::make_shared<PacketLink>(fd);
  return out;
}

int PacketListener::poll_fd() const {
  return now_ns() < accept_after_ns_.load(std::memory_order_relaxed) ? -1 : fd_;
}

absl::Status PacketListener::error() const {
  MutexLock lock(&error_mu_);
  return error_;
}

}  // namespace blockflow::detail
