#pragma once
/// @file
/// @brief TensorMQ for any two processes: cross-process TensorChannels opened by a URI, with no
/// Session on either side.
///
/// One process opens the receiving end, another the sending end of the same URI:
///
/// | URI | what crosses | bytes copied |
/// |---|---|---|
/// | `shm://NAME` | a handle to a slot of the sender's shared-memory pools (sealed memfds, passed over a 0600 socket); the receiver's tensor is a view of the slot, and the slot goes back to the sender when that tensor dies | 0 when the sender wrote its tensor in `empty()`; else one copy into a slot |
/// | `cuda://NAME` | for a CUDA tensor, the CUDA IPC handle of its allocation and an interprocess event recorded on the sender's current stream after it was written; the receiver's tensor is a view of the sender's device memory, its stream made to wait on the event; CPU tensors as over `shm://` | 0 (`empty()` makes the tensor on the current CUDA device) |
/// | `ipc://NAME` or `ipc:///ABS/PATH` | the serialized wire format (docs/wire-format.md) over a ZeroMQ Unix socket | the socket's (kernel) copies only |
/// | `tcp://HOST:PORT` | the same over TCP (the receiver binds HOST:PORT, the sender connects) | the socket's (kernel) copies only |
///
/// `cuda://` opens only where CUDA can carry tensors between processes (a CUDA build and a visible
/// device; FailedPrecondition naming the URI otherwise, for either end), and a sender checks at
/// connection that it can open the receiver's CUDA memory (a probe the receiver publishes beside
/// its socket): two processes in different PID namespaces are refused, never served by copies.
///
/// `shm://NAME`, `cuda://NAME` and `ipc://NAME` rendezvous in this user's channel directory
/// (`$XDG_RUNTIME_DIR/blockflow-channels-UID`, else `/tmp/blockflow-channels-UID`, mode 0700, checked
/// to be ours); NAME follows the name rule of names.hpp, so it is never a path. `ipc:///ABS/PATH`
/// binds where it says, in a directory that must be ours and closed to others (mode 0700). On a
/// `shm://` link the receiver accepts only senders of its own user id (SO_PEERCRED). `tcp://` is
/// authenticated and encrypted with ZeroMQ CURVE when the receiver has keys
/// (ProcessChannelOptions::receiver_security: its pair and the directory of the senders' public
/// keys it admits) and the sender holds its own pair and the receiver's public key
/// (sender_security); keys are made with `blockflowctl keygen` (curve.hpp). A tcp:// receiver
/// without keys binds only the loopback, unless receiver_security.insecure says otherwise.
///
/// Contract (the TensorChannel one, per end):
/// - the **receiver** binds at once (AlreadyExists when a live receiver holds the URI, even one not
///   accepting now, and for the second of two opened at once on a shm:// or cuda:// URI: a lock file
///   beside its socket decides; a socket left by a dead one is replaced); `send()` fails (FailedPrecondition). Several senders may feed one
///   receiver. A shm:// receiver has no thread of its own: receive() reads the senders' links (one
///   caller at a time), and what it has not read yet waits in the kernel's socket buffers, which
///   push back on the senders; with kDropOldest, receive() returns the newest envelope there and
///   drops the older ones (counted in `dropped`; their slots go back): a consumer that wants the
///   latest frame. An ipc:// or tcp:// receiver queues up to `capacity` envelopes (ZeroMQ's
///   high-water mark), then pushes back. drain() returns nothing: nothing is queued in this process.
/// - the **sender** connects on its first send() and again after the receiver went away (a shm://
///   or cuda:// receiver accepts senders while a receive() runs, and lets 8 wait meanwhile: past
///   those, a connect is refused at once, and kBlock tries again until `send_timeout`); with
///   kBlock, send() waits up to `send_timeout` for a receiver and (shm) for a free slot, then fails
///   with DeadlineExceeded; with kReject or kDropOldest it does not wait (Unavailable without a
///   receiver, ResourceExhausted without a slot or room in the receiver's queue). Internal: the
///   socket failed otherwise (the link stays). A failed send returns the envelope in `displaced`.
///   `receive()` returns nullopt at once and `drain()` nothing.
/// - an envelope carries `request_id`, `node` and up to 64 tensors (CPU; any layout: non-contiguous
///   tensors are made contiguous first, a copy counted in `bytes_copied`); `local` stays behind.
/// - lifetimes (shm://, cuda://): a tensor the receiver gave out stays valid after the receiver is
///   closed or destroyed, until it dies: the sender never takes its slot back under it. A receiver
///   that closes stops its senders at once (their next send fails: Unavailable, or with kBlock a
///   wait of up to `send_timeout`, "stopped reading"), drops what they sent and it had not taken
///   (counted in `dropped`, slots released), and frees the URI for a new receiver; a sender goes on
///   with that one once every tensor of the old one has died. A sender whose receiver dies (even by
///   SIGKILL) takes back every slot the receiver held (ShmEdgeStats::reclaims) and goes on with the
///   next receiver. Envelopes a receiver had not taken are lost with it: a channel is a hand-off,
///   not a persistent queue. A sender that closes stops sending; the receiver still gets what it
///   sent. Tensors a sender relayed from a third process's slot (received over shm://, sent on
///   unchanged) stay held for the receiver after the sender is destroyed, until released.
/// - errors name the URI.

#include <blockflow/channel/channel.hpp>
#include <blockflow/channel/curve.hpp>
#include <blockflow/channel/wire_format.hpp>
#include <blockflow/core/remote_site.hpp>

#include <absl/status/statusor.h>
#include <absl/time/time.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace blockflow {

/// @brief Which end of a cross-process channel this process holds.
enum class ChannelRole { kSender, kReceiver };

/// @brief Settings of a ProcessChannel. Each end reads the fields for its role.
struct ProcessChannelOptions {
  /// ipc:// and tcp://: envelopes queued on each side before the sender is pushed back (at least 1).
  std::size_t capacity = 16;
  /// Sender: whether send() waits (kBlock) or fails at once (kReject, kDropOldest) when it cannot
  /// hand over now. shm:// receiver: kDropOldest makes receive() return the newest envelope.
  FullPolicy full_policy = FullPolicy::kBlock;
  /// shm:// receiver: while envelopes stream (less than 4 of these apart on average), receive()
  /// polls this long before it sleeps, so that the next one is taken without a wake-up. 0: never.
  absl::Duration receive_spin = absl::Microseconds(50);
  /// Sender, kBlock: how long send() waits for a receiver and for a free slot.
  absl::Duration send_timeout = absl::Seconds(10);
  /// Sender, shm://: slots per pool (one pool per power-of-two size class) and the bound on all
  /// pools. Free slots are the sender's credits: at most this many tensors are in flight.
  std::size_t shm_slots_per_pool = 4;
  std::size_t shm_max_bytes = std::size_t{256} << 20;
  /// ipc:// and tcp:// receiver: the largest frame (one tensor's bytes, or the header) it takes. A
  /// sender that sends a larger one is disconnected before the frame is held in memory (libzmq's
  /// ZMQ_MAXMSGSIZE). The default is the wire format's own bound; a receiver that knows its tensors
  /// sets it lower, so that no sender can make it buffer more.
  std::uint64_t max_frame_bytes = wire::kMaxTensorBytes;
  /// tcp:// receiver: CURVE keys and the senders admitted (curve.hpp). A sender with another key,
  /// or none, is refused at its handshake (counted in `blockflow_auth_failures_total`, logged with
  /// the URI and the key's fingerprint) and nothing it sends arrives. Without keys, a bind beyond
  /// the loopback is refused (FailedPrecondition) unless `insecure`.
  ServerSecurity receiver_security;
  /// tcp:// sender: its key pair and the receiver's public key (a receiver with keys accepts only
  /// CURVE senders). Without keys, plain TCP.
  ClientSecurity sender_security;
};

/// @brief One end of a cross-process channel. Thread-safe, like every TensorChannel.
class ProcessChannel : public TensorChannel {
 public:
  /// @brief Opens the `role` end of `uri` (see the top of this file). InvalidArgument naming the URI
  /// for an unknown scheme or a bad name; PermissionDenied for a directory that is not ours or is
  /// open to others; AlreadyExists when a live receiver holds the URI; Unavailable when a socket
  /// cannot be bound.
  static absl::StatusOr<std::unique_ptr<ProcessChannel>> open(std::string_view uri, ChannelRole role,
                                                             ProcessChannelOptions options = {});

  /// @brief A contiguous CPU tensor to fill and send. On a shm:// sender its bytes lie in one of
  /// the channel's slots, so sending it copies nothing; the slot is free again once this tensor and
  /// the receiver's views of it are gone. Elsewhere a plain at::empty(). Waits for a slot as send()
  /// does. Errors name the URI: InvalidArgument for a negative size or a size in bytes that
  /// overflows 64 bits; ResourceExhausted for a tensor larger than the sender's pools may hold
  /// (`shm_max_bytes`); DeadlineExceeded when no slot came free in time.
  virtual absl::StatusOr<at::Tensor> empty(at::IntArrayRef sizes, at::ScalarType dtype = at::kFloat) = 0;

  /// @brief The URI as opened; for a receiver opened as `tcp://HOST:*` (a free port chosen by the
  /// system), `tcp://HOST:PORT` with the port it got, for its senders.
  [[nodiscard]] virtual const std::string& uri() const = 0;
  [[nodiscard]] virtual ChannelRole role() const = 0;
  /// @brief Sender: a receiver is attached now (one that stopped reading, shm:// and cuda://, is
  /// noticed by the next send). Receiver: at least one sender is.
  [[nodiscard]] virtual bool connected() const = 0;
  /// @brief Sender: waits until what was sent no longer needs this process. shm://: until the
  /// receivers have let go of every slot and relayed tensor sent to them (what they hold stays
  /// readable after the sender exits, but a relayed tensor's slot goes back to its origin process,
  /// and CUDA memory to its allocator); tensors of this process's own, made by empty() and not sent, are not waited for;
  /// DeadlineExceeded naming the slots still held. ipc:// and tcp://: OK at once (ZeroMQ keeps sending what it queued for up to
  /// `send_timeout` after the end is destroyed). Receiver: OK at once.
  virtual absl::Status flush(absl::Time deadline) {
    (void)deadline;
    return absl::OkStatus();
  }
  /// @brief shm:// sender: its pools' figures (slots in use, releases, reclaims, bytes staged).
  /// Zeros elsewhere.
  [[nodiscard]] virtual ShmEdgeStats shm_stats() const { return {}; }
};

/// @brief ProcessChannel::open().
inline absl::StatusOr<std::unique_ptr<ProcessChannel>> open_channel(std::string_view uri, ChannelRole role,
                                                                    ProcessChannelOptions options = {}) {
  return ProcessChannel::open(uri, role, options);
}

}  // namespace blockflow
