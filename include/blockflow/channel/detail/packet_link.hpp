#pragma once
// Internal: the data link of the zero-copy channels ("shm", "cuda") between a session and a worker
// on the same host. A connected AF_UNIX SOCK_SEQPACKET socket: its messages are handles and
// releases (a few hundred bytes), never tensor bytes, so the ZeroMQ machinery (an I/O thread on
// each side, a sender thread) only adds wake-ups. Here a block thread's send() lands directly in
// the peer's receiving thread.
//
// One packet carries one wire message (header frame + handle frames): u32 frame count, one u32 size
// per frame (little-endian), then the frames back to back. The kernel keeps packets whole, so any
// number of threads may send on one link; one thread receives. The first packet that names a memory
// pool of the sender's carries the pool's descriptor too (SCM_RIGHTS): pools are sealed memfds that
// no other process can open by name (shm_pool.hpp).

#include <absl/container/flat_hash_map.h>
#include <absl/status/statusor.h>
#include <blockflow/core/detail/mutex.hpp>
#include <absl/time/time.h>
#include <zmq.hpp>

#include <sys/socket.h>
#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace blockflow::detail {

/// The largest packet: a header with the longest message (64 KB) and 64 tensors of 8 dimensions,
/// plus their handles (~78 KB in all), fits; the kernel refuses one SEQPACKET message larger than
/// the socket's send buffer (net.core.wmem_default, ~208 KB), so stay below it.
inline constexpr std::size_t kMaxPacketBytes = std::size_t{128} << 10;

/// Builds the packet of `frames` (count, sizes, bytes). For tests and fuzzing.
std::string encode_packet(const std::vector<std::string_view>& frames);
/// Splits a packet into frames; InvalidArgument naming what is wrong (too short, a frame count over
/// the limit, sizes that do not add up to the packet's length).
absl::StatusOr<std::vector<zmq::message_t>> decode_packet(const void* data, std::size_t size);

/// The average gap between arrivals (exponential, weight 1/4), to tell a stream (spin before
/// sleeping: the next one follows closely) from sparse traffic (sleep at once). Not thread-safe.
class ArrivalGaps {
 public:
  void note(std::int64_t arrived_ns) {
    if (last_ns_ == 0) {
      // The first: no gap yet.
    } else if (mean_ns_ == kNoStream) {
      mean_ns_ = arrived_ns - last_ns_;
    } else {
      mean_ns_ += (arrived_ns - last_ns_ - mean_ns_) / 4;
    }
    last_ns_ = arrived_ns;
  }
  /// True while arrivals come less than kStreamGapFactor x `spin` apart on average.
  [[nodiscard]] bool streaming(absl::Duration spin) const { return mean_ns_ < kStreamGapFactor * absl::ToInt64Nanoseconds(spin); }
  [[nodiscard]] std::int64_t mean_ns() const { return mean_ns_; }
  static constexpr int kStreamGapFactor = 4;

 private:
  static constexpr std::int64_t kNoStream = std::int64_t{1} << 40;  // ~18 min: fewer than 2 arrivals yet
  std::int64_t last_ns_ = 0;
  std::int64_t mean_ns_ = kNoStream;
};

/// Descriptors that came with a packet (SCM_RIGHTS), closed with this object unless taken.
class ReceivedFds {
 public:
  ReceivedFds() = default;
  ReceivedFds(ReceivedFds&& other) noexcept : fds_(std::exchange(other.fds_, {})) {}
  ReceivedFds& operator=(ReceivedFds&& other) noexcept;
  ReceivedFds(const ReceivedFds&) = delete;
  ReceivedFds& operator=(const ReceivedFds&) = delete;
  ~ReceivedFds() { close_all(); }
  void add(int fd) { fds_.push_back(fd); }
  /// The descriptors, each now the caller's to close.
  [[nodiscard]] std::vector<int> take() { return std::exchange(fds_, {}); }
  [[nodiscard]] std::size_t size() const { return fds_.size(); }

 private:
  void close_all();
  std::vector<int> fds_;
};

/// At most this many descriptors come with one packet (one per tensor: kMaxTensors); a packet with
/// more is malformed (the kernel closes those that did not fit).
inline constexpr std::size_t kMaxPacketFds = 64;

/// A descriptor to send with a packet, once per link: `key` names what it is (a memory pool's id).
/// `keep` holds whatever keeps `fd` open, and `resend` valid: while `*resend` is not 0 (a pool its
/// producer retired, relayed on), the descriptor goes with every packet naming the key, as the peer
/// may have let go of it; once `keep` is gone from this process, nothing here can name the key.
struct LinkFd {
  std::uint64_t key = 0;
  int fd = -1;
  std::shared_ptr<const void> keep;
  const std::atomic<std::uint64_t>* resend = nullptr;
};

class PacketLink {
 public:
  explicit PacketLink(int fd);  ///< takes ownership of a connected SOCK_SEQPACKET socket
  ~PacketLink();
  PacketLink(const PacketLink&) = delete;
  PacketLink& operator=(const PacketLink&) = delete;

  /// Connects to a PacketListener's path.
  static absl::StatusOr<std::shared_ptr<PacketLink>> connect(const std::string& path);
  /// Two connected ends in this process (tests, benchmarks).
  static absl::StatusOr<std::pair<std::shared_ptr<PacketLink>, std::shared_ptr<PacketLink>>> pair();

  /// Sends one packet; thread-safe. Waits while the peer's receive queue is full, up to the send
  /// timeout if one is set (DeadlineExceeded then); `wait` false: ResourceExhausted at once.
  /// Unavailable when the peer has gone or no longer reads (it shut its reading side down: it may
  /// still send); Internal for another error of this packet (the link is not known to be down);
  /// InvalidArgument for a packet over kMaxPacketBytes.
  absl::Status send(const std::vector<std::string_view>& frames, bool wait = true);
  /// send() for a packet that names things by `keys` (the pools its handles name): the descriptor
  /// of each key this link has not carried yet goes with it (SCM_RIGHTS), from `fd_of(key)` (a
  /// LinkFd with fd -1: the packet goes without it, and the peer refuses what names it). The peer
  /// is sure to hold a key's descriptor before any later packet naming it reaches it: a key counts
  /// as carried once the packet carrying it was queued, and senders of a packet with a new key
  /// take turns. A key is remembered while what keeps its descriptor lives (pools are trimmed and
  /// made again over a link's life: past kCarriedPruneAt keys, those gone are dropped).
  absl::Status send(const std::vector<std::string_view>& frames, bool wait, const std::vector<std::uint64_t>& keys,
                    const std::function<LinkFd(std::uint64_t)>& fd_of);
  /// Stops reading (the link's state is lost: a descriptor the peer counts as carried did not
  /// arrive): this end's receive() sees the link closed once what is queued is read, and the peer's
  /// next send fails; this end still sends (the releases of the tensors it gave out), so the peer
  /// reclaims nothing while they live (it does once this end's socket closes).
  void shut_down();
  /// Bounds how long send() waits for room (SO_SNDTIMEO); none by default.
  void set_send_timeout(absl::Duration timeout);

  struct Received {
    bool closed = false;                        ///< the peer closed its end (nothing else is set)
    absl::StatusOr<std::vector<zmq::message_t>> frames = std::vector<zmq::message_t>{};  ///< or why the packet is malformed
    ReceivedFds fds;  ///< the descriptors that came with it (at most kMaxPacketFds)
  };
  /// Receives one packet; one thread at a time. While packets come in a stream (the recent gaps
  /// between them average under kStreamGapFactor x `spin`), it polls for up to `spin` first, so a
  /// packet that follows closely is taken without a sleep and a wake-up; otherwise, and after the
  /// spin, it sleeps, up to `timeout_ms` (-1: forever). A link whose packets come milliseconds apart
  /// (a pipeline stage) therefore never spins and takes no core from the blocks. An infinite `spin`
  /// (WorkerOptions::busy_poll) polls for the whole `timeout_ms` and never sleeps. nullopt when
  /// nothing came.
  std::optional<Received> receive(int timeout_ms, absl::Duration spin = absl::ZeroDuration());
  /// How far apart, in units of the spin, packets may come on average for the link to spin.
  static constexpr int kStreamGapFactor = ArrivalGaps::kStreamGapFactor;
  /// The average gap between the last packets received (exponential, weight 1/4), in ns.
  [[nodiscard]] std::int64_t mean_gap_ns() const { return gaps_.mean_ns(); }

  [[nodiscard]] int fd() const { return fd_; }
  static constexpr std::size_t kCarriedPruneAt = 1024;

 private:
  absl::Status send_message(msghdr& message, bool wait);

  int fd_;
  std::vector<char> buffer_;  // the receiving thread's, as are the two below
  ArrivalGaps gaps_;
  std::atomic<std::int64_t> send_timeout_ns_{-1};  // set_send_timeout()'s (-1: none), for a packet with a new key
  blockflow::detail::Mutex carry_mu_;  // held across the (never waiting) send of a packet with a key not yet carried
  struct Carried {
    std::weak_ptr<const void> alive;
    const std::atomic<std::uint64_t>* resend = nullptr;
  };
  absl::flat_hash_map<std::uint64_t, Carried> carried_ ABSL_GUARDED_BY(carry_mu_);
};

/// An exclusive hold on a listener's path: an advisory lock (flock) on "<path>.lock", beside it in
/// its private directory. Of two processes binding one path at once, one holds it and the other is
/// refused; a listener holds it for its life, so that none unlinks another's socket. The holder
/// unlinks the lock file before it lets go; a taker that locked a file unlinked meanwhile (not the
/// one at the path any more) tries again, so two never hold one path.
class PathLock {
 public:
  /// AlreadyExists when another holds it (a live listener, or one about to bind).
  static absl::StatusOr<PathLock> take(const std::string& path);
  PathLock(PathLock&& other) noexcept : fd_(std::exchange(other.fd_, -1)), file_(std::move(other.file_)) {}
  PathLock& operator=(PathLock&& other) noexcept;
  PathLock(const PathLock&) = delete;
  PathLock& operator=(const PathLock&) = delete;
  ~PathLock();

 private:
  PathLock(int fd, std::string file) : fd_(fd), file_(std::move(file)) {}
  void let_go() noexcept;
  int fd_ = -1;
  std::string file_;
};

/// The listening end, bound at a path (in a private 0700 directory).
class PacketListener {
 public:
  /// Takes the path's lock (PathLock::take(), unless `lock` is given: held since before the bind),
  /// then binds, replacing a socket file a dead listener left.
  static absl::StatusOr<std::unique_ptr<PacketListener>> bind(const std::string& path,
                                                              std::optional<PathLock> lock = std::nullopt);
  ~PacketListener();
  PacketListener(const PacketListener&) = delete;
  PacketListener& operator=(const PacketListener&) = delete;

  struct Accepted {
    std::shared_ptr<PacketLink> link;
    pid_t peer_pid = 0;  ///< from the kernel (SO_PEERCRED), not from the peer's word
    uid_t peer_uid = static_cast<uid_t>(-1);  ///< likewise; -1 when the kernel did not say
  };
  /// Accepts a pending connection, if any (never waits). A connection this process has no
  /// descriptor (or memory) for stays pending: error() says why, and accept() and poll_fd() leave
  /// it alone for kAcceptBackoff (a poll on a listener with a connection pending would not wait).
  std::optional<Accepted> accept();
  /// The descriptor to poll for connections: -1 (ignored by poll) while accept() backs off.
  [[nodiscard]] int poll_fd() const;
  /// Why the last connection could not be taken; OK once one is taken. Any thread.
  [[nodiscard]] absl::Status error() const;
  static constexpr std::int64_t kAcceptBackoffNs = 100'000'000;

  [[nodiscard]] int fd() const { return fd_; }
  [[nodiscard]] const std::string& path() const { return path_; }

 private:
  PacketListener(int fd, std::string path, PathLock lock) : fd_(fd), path_(std::move(path)), lock_(std::move(lock)) {}
  int fd_;
  std::string path_;
  PathLock lock_;  // released after the socket is unlinked and closed
  std::atomic<std::int64_t> accept_after_ns_{0};
  mutable blockflow::detail::Mutex error_mu_;
  absl::Status error_ ABSL_GUARDED_BY(error_mu_);
};

}  // namespace blockflow::detail
