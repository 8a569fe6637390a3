#pragma once
/// @file
/// @brief TensorChannel: the interface of a block's input queue, and the Envelope and ChannelStats
/// shapes that hand-offs share.
///
/// A channel is one direction of a hand-off. Backends: the in-process InProcessChannel
/// (inproc_channel.hpp), which moves references and serves as every block's input queue; and the
/// cross-process ProcessChannel (process_channel.hpp), opened by URI by two processes that need no
/// Session: `shm://` (zero-copy shared memory), `ipc://` and `tcp://` (the serialized wire format).
/// Inside a session, a block placed in a worker is reached through its RemoteSite
/// (core/remote_site.hpp; WorkerSite in worker/worker_site.hpp), which carries the same kinds of
/// hand-off and reports its data channel's counters as ChannelStats in SiteStats::data.

#include <blockflow/core/tensor.hpp>

#include <absl/status/status.h>
#include <absl/time/time.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace blockflow {

namespace detail {
struct RequestState;
}

/// @brief What a bounded queue does when a message arrives and it is full.
enum class FullPolicy {
  kBlock,       ///< the sender waits until there is room (or the channel closes)
  kReject,      ///< the new message is refused; its request fails with ResourceExhausted
  kDropOldest,  ///< the oldest queued message is evicted; its request fails with ResourceExhausted
};

/// @brief "block", "reject" or "drop-oldest".
std::string_view to_string(FullPolicy policy);

/// @brief One request's tensors on their way to one node of the request's path.
///
/// A RemoteSite carries `request_id`, `node` and the tensors to another process; `local` is the
/// in-process shortcut to the request's state and is never serialised.
struct Envelope {
  std::uint64_t request_id = 0;
  std::uint32_t node = 0;      ///< index of the receiving node in the request's path plan
  Tensors tensors;
  std::int64_t sent_ns = 0;    ///< steady-clock time the channel accepted it (set by the channel)
  std::shared_ptr<detail::RequestState> local;
  /// Set by the session for a block at a remote site when every next block of the path runs at a
  /// site with a RemoteSite::peer_endpoint(): the site may keep the outputs where they were made and
  /// report placeholders that only such sites can take.
  bool outputs_may_stay = false;
  /// Steady-clock time a full queue (policy block) first made its sender wait for room, set by the
  /// channel (and kept when the sender tries again); 0: accepted at once. The wait for room is
  /// waiting for the block, not hand-off overhead: see arrived_ns().
  std::int64_t offered_ns = 0;

  /// When it reached the block: the first offer to a full queue, else when the queue accepted it.
  [[nodiscard]] std::int64_t arrived_ns() const noexcept {
    return offered_ns != 0 && offered_ns < sent_ns ? offered_ns : sent_ns;
  }
};

/// @brief Counters of one channel: a block's input queue, or a site's data channel (SiteStats::data).
/// Zero-copy channels report `bytes_copied == 0`.
struct ChannelStats {
  /// "inproc" (an InProcessChannel); for a worker's data channel "zmq-ipc", "zmq-tcp" (a joined
  /// worker), "shm" or "cuda".
  std::string kind;
  std::uint64_t sent = 0;
  std::uint64_t received = 0;
  std::uint64_t rejected = 0;
  std::uint64_t dropped = 0;
  std::uint64_t bytes_copied = 0;
  std::size_t depth = 0;
  std::size_t capacity = 0;
  std::size_t high_watermark = 0;
  /// Envelopes queued while the queue was full, by InProcessChannel::send_past_capacity() (a
  /// session's compute lanes that would otherwise wait on each other, docs/lanes.md).
  std::uint64_t past_capacity = 0;
};

/// @brief The outcome of TensorChannel::send().
///
/// `status` is OK when the envelope was accepted. ResourceExhausted: refused by kReject (the
/// envelope comes back in `displaced`). Cancelled: the channel is closed (the envelope comes back
/// in `displaced`). With kDropOldest the status is OK and `displaced` holds the evicted envelope.
/// Whoever receives a displaced envelope must resolve its request.
struct [[nodiscard]] SendOutcome {
  absl::Status status;
  std::optional<Envelope> displaced;
};

/// @brief One direction of a tensor hand-off. Implementations are thread-safe: any number of
/// threads may send and receive concurrently.
class TensorChannel {
 public:
  virtual ~TensorChannel() = default;

  /// @brief Hands the envelope over, applying the channel's FullPolicy when it is full.
  /// With kBlock this waits until a receiver makes room or close() is called.
  virtual SendOutcome send(Envelope&& envelope) = 0;

  /// @brief Waits for the next envelope until `deadline`. Returns nullopt on timeout, or once the
  /// channel is closed (envelopes still queued then stay there for drain()). Woken by send() and
  /// close().
  [[nodiscard]] virtual std::optional<Envelope> receive(absl::Time deadline) = 0;

  /// @brief Refuses further sends and wakes every waiting sender and receiver. Idempotent.
  virtual void close() = 0;

  /// @brief Removes and returns everything still queued (used after close() to fail requests).
  [[nodiscard]] virtual std::vector<Envelope> drain() = 0;

  [[nodiscard]] virtual bool closed() const = 0;
  [[nodiscard]] virtual ChannelStats stats() const = 0;
  /// @brief What the backend is: "inproc" (InProcessChannel), "shm", "cuda", "zmq-ipc" or "zmq-tcp" (ProcessChannel).
  [[nodiscard]] virtual std::string_view kind() const = 0;
};

}  // namespace blockflow
