#pragma once
// Internal: one process's end of a zero-copy data link to one peer process, the one piece of
// transport under every zero-copy edge of the library: a shm:// or cuda:// sender, each sender a
// receiver accepted (shm_channel.cpp), a worker site and its worker (lib/worker), either side.
//
// It carries the release protocol. A message's tensors cross as handles to the sender's memory
// (ZeroCopyEnds); the receiver's tensors are views of it, and each one's death gives its handle back
// on the link it came by, in kRelease messages (ReleaseOutbox: from any thread, never blocking); the
// sender's read() takes those releases, which free its slots, and returns everything else. A
// tensor keeps its link open, so a producer that reclaims its slots when a link closes never takes
// them back from under a live tensor.

#include <blockflow/channel/detail/packet_link.hpp>
#include <blockflow/channel/detail/tensor_codec.hpp>
#include <blockflow/channel/detail/zero_copy_ends.hpp>

#include <absl/status/status.h>
#include <absl/time/time.h>
#include <blockflow/core/detail/mutex.hpp>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

namespace blockflow::detail {

/// A consumer gives the producer's handles back in kRelease messages of at most this many handles
/// (the longest message).
inline constexpr std::size_t kReleasesPerMessage = wire::kMaxMessageBytes / wire::kShmHandleBytes;

/// The kRelease message for `count` handles from `first` (at most kReleasesPerMessage).
wire::Header release_message(const wire::ShmHandle* first, std::size_t count);

/// Sends `count` handles from `first` back to their producer on `link`, kReleasesPerMessage a
/// packet, from any thread; `wait` as PacketLink::send(). Returns how many went out; when not all
/// did, `why` (if given) gets the failed packet's status (Unavailable: the producer is gone, and it
/// reclaimed every slot it had lent).
std::size_t send_releases(PacketLink& link, const wire::ShmHandle* first, std::size_t count, bool wait = true,
                          absl::Status* why = nullptr);

/// Runs `step` every `period` on a thread of its own, detached, until it returns false: the
/// process-wide helpers that finish what an object gone or going left behind. False, logged, when
/// no thread could be made (the process is at its thread limit, say): the caller keeps its work
/// listed and tries again at its next call. Never throws: callers run in tensor deleters.
bool run_detached_until_done(std::function<bool()> step, absl::Duration period) noexcept;

/// Releases on their way back to one producer over `link`, for a consumer whose tensors die on any
/// thread (a block's, a CUDA callback's): give() never blocks. What the link cannot take now (the
/// producer's queue holds a few packets) waits here and leaves in one packet with the next give(),
/// or within milliseconds from a process-wide retrying thread (bounded: one handle per slot the
/// consumer holds); once the producer is gone it is dropped (the producer reclaimed every slot).
/// Tensors hold their outbox, and the outbox its link. Thread-safe; made by std::make_shared.
class ReleaseOutbox : public std::enable_shared_from_this<ReleaseOutbox> {
 public:
  explicit ReleaseOutbox(std::shared_ptr<PacketLink> link) : link_(std::move(link)) {}
  void give(const wire::ShmHandle& handle);
  void flush();
  /// Releases wait for room on the link.
  [[nodiscard]] bool pending() const { return waiting_count_.load(std::memory_order_relaxed) > 0; }

 private:
  void send_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const std::shared_ptr<PacketLink> link_;
  blockflow::detail::Mutex mu_;
  std::vector<wire::ShmHandle> waiting_ ABSL_GUARDED_BY(mu_);
  std::atomic<std::size_t> waiting_count_{0};
  std::atomic<bool> retrying_{false};  // listed for the retrying thread
};

/// read() takes at most this many release packets in one call before it returns kNothing, so that
/// a peer streaming releases cannot keep its caller from its other duties (stop flags, heartbeats).
inline constexpr int kReleasePacketsPerRead = 64;

/// Thread safety: read() from one thread at a time; send() and flush_releases() from any; the
/// releases of the tensors read() made leave from whatever thread those die on.
class ZeroCopyLink {
 public:
  /// `ends`: this process's pools, whose slots the peer's releases free. The peer's pools, which its
  /// messages' handles name, are mapped as their descriptors come on this link.
  ZeroCopyLink(std::shared_ptr<PacketLink> link, std::shared_ptr<ZeroCopyEnds> ends);
  ZeroCopyLink(const ZeroCopyLink&) = delete;
  ZeroCopyLink& operator=(const ZeroCopyLink&) = delete;

  struct Packet {
    enum class Kind {
      kNothing,    ///< nothing but releases came in time (or kReleasePacketsPerRead of them)
      kClosed,     ///< the peer closed its end (or shut its sending side down): nothing more comes
      kMalformed,  ///< a packet or message that could not be read, dropped; `malformed` says why
      kMessage,    ///< `message`: anything but a release
    };
    Kind kind = Kind::kNothing;
    absl::Status malformed;
    std::optional<std::uint64_t> request_id;  ///< kMalformed: the request it names, when readable
    std::optional<std::uint32_t> node;         ///< kMalformed: with request_id, the node it names
    DecodedMessage message;
    std::int64_t received_ns = 0;  ///< kMessage, kMalformed: when it was taken off the link (before decoding)
  };
  /// Reads what the peer sent, one thread at a time: releases are taken as they come (our slots
  /// free again, up to kReleasePacketsPerRead packets a call) and the first other packet is
  /// returned, its tensors views of the peer's memory.
  /// Waits up to `timeout_ms` for the first packet, polling for up to `spin` first while packets
  /// stream (PacketLink::receive()); after a release, only for up to `spin` again (the message a
  /// release precedes is often right behind it). `parked`: for messages that carry parked
  /// references (a worker's direct edges); without one they are malformed.
  Packet read(int timeout_ms, absl::Duration spin = absl::ZeroDuration(), const ParkedResolver* parked = nullptr);

  /// Sends one message, its tensors as the handles `stager` makes (send_packet()); a handle staged
  /// for a message that is not sent goes back to our pool. Any thread; `wait` as PacketLink::send().
  absl::Status send(const wire::Header& header, const Tensors& tensors, const ShmStager* stager = nullptr,
                    bool wait = true, std::uint64_t* bytes_copied = nullptr);

  /// Releases a full link could not take at once leave now if it can (a process-wide thread retries
  /// them too, within milliseconds).
  void flush_releases();

  [[nodiscard]] int fd() const { return link_->fd(); }
  [[nodiscard]] ZeroCopyEnds& ends() const { return *ends_; }
  /// The peer, process `pid`, died: the pools it made are retired, so that the processes this one
  /// relayed their slots to let go of them too (nothing else would tell them).
  void peer_died(std::int64_t pid) { given_.retire_made_by(pid); }

 private:
  const std::shared_ptr<PacketLink> link_;
  const std::shared_ptr<ZeroCopyEnds> ends_;
  const std::shared_ptr<ReleaseOutbox> outbox_;  // every tensor read from this link holds it
  ShmConsumer given_;  // the peer's pools, as their descriptors come on this link (read()'s thread)
  static constexpr std::int64_t kRetireCheckNs = 1'000'000'000;
  std::vector<std::uint64_t> retiring_;  // read()'s: seen retired, forgotten once the link is seen empty
  bool forget_due_ = false;              // read()'s: retiring_ taken, forget() not called yet
  std::int64_t retire_check_ns_ = 0;
  const ShmResolver resolver_;
  const ShmUnstager unstage_;
};

}  // namespace blockflow::detail
