#pragma once
// Internal: tensors <-> ZeroMQ multipart messages in the wire format (docs/wire-format.md).
// Sending never copies a contiguous tensor's bytes: ZeroMQ reads them from the tensor, which stays
// alive until ZeroMQ releases the frame. Receiving builds tensors over the frames' buffers.

#include <blockflow/tensor.hpp>
#include <blockflow/wire_format.hpp>

#include <absl/status/statusor.h>
#include <zmq.hpp>

#include <vector>

namespace blockflow::detail {

absl::StatusOr<wire::DType> to_wire_dtype(at::ScalarType type);
absl::StatusOr<at::ScalarType> from_wire_dtype(wire::DType type);

/// Fills header.tensors from `tensors` and sends header + one frame per tensor. Non-contiguous
/// tensors are made contiguous first (the only copy; counted in `bytes_copied`). CPU tensors only.
/// Returns false when `flags` has dontwait and the socket would block.
absl::StatusOr<bool> send_message(zmq::socket_t& socket, wire::Header header, const Tensors& tensors,
                                  zmq::send_flags flags = zmq::send_flags::none, std::uint64_t* bytes_copied = nullptr);

struct DecodedMessage {
  wire::Header header;
  Tensors tensors;
  std::uint64_t bytes_copied = 0;  ///< copies made because a frame was misaligned for its dtype
};

/// Validates and decodes a received multipart message. Tensors are views over the frames (kept
/// alive by the tensors). Errors name the problem (see wire::decode_header).
absl::StatusOr<DecodedMessage> decode_message(std::vector<zmq::message_t>&& frames);

}  // namespace blockflow::detail
