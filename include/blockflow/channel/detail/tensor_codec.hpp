#pragma once
// Internal: tensors <-> ZeroMQ multipart messages in the wire format (docs/wire-format.md).
// Sending never copies a contiguous tensor's bytes: ZeroMQ reads them from the tensor, which stays
// alive until ZeroMQ releases the frame. Receiving builds tensors over the frames' buffers.

#include <blockflow/channel/detail/packet_link.hpp>
#include <blockflow/channel/detail/shm_pool.hpp>
#include <blockflow/core/tensor.hpp>
#include <blockflow/channel/wire_format.hpp>

#include <absl/time/time.h>
#include <absl/status/statusor.h>
#include <zmq.hpp>

#include <algorithm>
#include <functional>
#include <vector>

namespace blockflow::detail {

absl::StatusOr<wire::DType> to_wire_dtype(at::ScalarType type);
absl::StatusOr<at::ScalarType> from_wire_dtype(wire::DType type);

/// Fills header.tensors from `tensors` and sends header + one frame per tensor. Non-contiguous
/// tensors are made contiguous first (the only copy; counted in `bytes_copied`). CPU tensors only.
/// Returns false when `flags` has dontwait and the socket would block.
/// With a `stager`, each tensor goes into shared memory and its frame is the handle (kFlagShmHandles).
using ShmStager = std::function<absl::StatusOr<wire::ShmHandle>(const at::Tensor& contiguous)>;
absl::StatusOr<bool> send_message(zmq::socket_t& socket, wire::Header header, const Tensors& tensors,
                                  zmq::send_flags flags = zmq::send_flags::none, std::uint64_t* bytes_copied = nullptr,
                                  const ShmStager* stager = nullptr);
/// Gives a staged handle back to its producer (ZeroCopyEnds::release()): for handles staged for a
/// message that is not sent after all.
using ShmUnstager = std::function<void(const wire::ShmHandle&)>;
/// Sends the same message as one packet on a zero-copy channel's data link: every tensor as its
/// handle (a `stager` is needed when there are tensors). Thread-safe as PacketLink::send(). When a
/// tensor cannot be staged or the packet cannot be sent, the handles staged for it go back through
/// `unstage` (else they stay leased until the consumer's death reclaims them). `wait`: as
/// PacketLink::send().
absl::Status send_packet(PacketLink& link, wire::Header header, const Tensors& tensors,
                         std::uint64_t* bytes_copied = nullptr, const ShmStager* stager = nullptr,
                         const ShmUnstager* unstage = nullptr, bool wait = true);

/// What send_message() and send_packet() put on the wire: the encoded header, then the handles
/// (with a stager) or the contiguous tensors whose bytes follow.
struct EncodedMessage {
  std::string header;
  std::vector<std::string> handles;
  std::vector<wire::ShmHandle> staged;  ///< the handles, decoded
  std::vector<at::Tensor> tensors;
};
absl::StatusOr<EncodedMessage> encode_message(wire::Header header, const Tensors& tensors,
                                             std::uint64_t* bytes_copied, const ShmStager* stager,
                                             const ShmUnstager* unstage = nullptr);
/// send_message() in two steps, for a caller that may try the same send again (a socket with a
/// send timeout): encode_for_socket() encodes once (placeholders on the meta device refused, as
/// send_message() does); send_encoded() sends, false when the socket did not take the message
/// (nothing of it was sent: try again with the same one).
absl::StatusOr<EncodedMessage> encode_for_socket(wire::Header header, const Tensors& tensors,
                                                std::uint64_t* bytes_copied, const ShmStager* stager);
bool send_encoded(zmq::socket_t& socket, const EncodedMessage& encoded, zmq::send_flags flags);

/// Sends `header`, its tensor descriptors filled from `described`, followed by `frames` in place of
/// the tensors' bytes: the kParkedRefBytes references of parked tensors (sets kFlagParked). The
/// tensors themselves may be placeholders on the meta device.
absl::StatusOr<bool> send_references(zmq::socket_t& socket, wire::Header header, const Tensors& described,
                                     const std::vector<std::string>& frames,
                                     zmq::send_flags flags = zmq::send_flags::none);

/// How long a stager waits for a free slot (or CUDA record): up to `each` per tensor, and never past
/// `until`. A stager made for one send takes the send's deadline (until_deadline()), so that a send
/// of several tensors waits no longer than one; a stager kept for many sends takes `each` alone.
struct StageWait {
  absl::Duration each = absl::ZeroDuration();
  absl::Time until = absl::InfiniteFuture();
  StageWait(absl::Duration each_tensor) : each(each_tensor) {}  // NOLINT(google-explicit-constructor)
  static StageWait until_deadline(absl::Time deadline) {
    StageWait w(absl::InfiniteDuration());
    w.until = deadline;
    return w;
  }
  [[nodiscard]] absl::Time deadline() const { return std::min(absl::Now() + each, until); }
};

/// A stager for `producer`: a tensor that already lies in a slot it leased (make_shm_allocator())
/// crosses as its handle, nothing copied; any other is copied into a free slot, waiting as `wait`
/// says for a credit.
ShmStager make_stager(ShmProducer& producer, StageWait wait);

/// Allocates a contiguous CPU tensor directly in one of `producer`'s slots: write the output there
/// and send it, and the hand-off copies nothing (ShmEdgeStats::bytes_staged stays put). The slot
/// returns to the pool when this tensor and the consumer's views of it are all gone.
using ShmAllocator = std::function<absl::StatusOr<at::Tensor>(at::IntArrayRef sizes, at::ScalarType dtype)>;
ShmAllocator make_shm_allocator(ShmProducer& producer, absl::Duration wait);

/// The bytes of a contiguous tensor of `sizes` and `dtype`; InvalidArgument for a negative size
/// or a product that overflows (what ProcessChannel::empty() is asked for comes from its caller).
absl::StatusOr<std::size_t> contiguous_bytes(at::IntArrayRef sizes, at::ScalarType dtype);
/// at::empty() with its sizes checked as above (its exceptions never cross a StatusOr API).
absl::StatusOr<at::Tensor> checked_empty(at::IntArrayRef sizes, at::ScalarType dtype, at::Device device);

struct DecodedMessage {
  wire::Header header;
  Tensors tensors;
  std::uint64_t bytes_copied = 0;  ///< copies made because a frame was misaligned for its dtype
};

/// Validates and decodes a received multipart message. Tensors are views over the frames (kept
/// alive by the tensors). Errors name the problem (see wire::decode_header).
/// Messages with kFlagShmHandles need a `resolver` (else they are rejected, named): `resolve` builds
/// a tensor over the producer's memory; `release` gives back a handle that will not become one (a
/// message refused part-way: decode_message() releases its handles from the failing one on).
struct ShmResolver {
  std::function<absl::StatusOr<at::Tensor>(const wire::TensorDesc&, const wire::ShmHandle&, at::ScalarType)> resolve;
  std::function<void(const wire::ShmHandle&)> release;
};
/// Messages with kFlagParked need a `parked` resolver, which makes the tensor a reference frame
/// stands for (else they are rejected, named).
using ParkedResolver = std::function<absl::StatusOr<at::Tensor>(const wire::TensorDesc&, std::uint64_t id,
                                                                at::ScalarType)>;
absl::StatusOr<DecodedMessage> decode_message(std::vector<zmq::message_t>&& frames,
                                              const ShmResolver* resolver = nullptr,
                                              const ParkedResolver* parked = nullptr);
/// A resolver building tensors over `consumer`'s mapped slots; `release` runs with the handle when
/// such a tensor (and every view of it) dies, on whatever thread that happens.
ShmResolver make_resolver(ShmConsumer& consumer, std::function<void(const wire::ShmHandle&)> release);

}  // namespace blockflow::detail
