#pragma once
/// @file
/// @brief The versioned binary header of BlockFlow's serialized ZeroMQ channel (frame 0 of every
/// multipart message; frames 1..n carry the raw bytes of the n tensors it describes).
///
/// The codec deals in bytes and plain structs only: no libtorch, no ZeroMQ, so it builds fast, runs
/// under a fuzzer and can be reimplemented by a client in any language from docs/wire-format.md.
/// Every field is validated on decode; nothing in a frame is ever executed or trusted for a size.
/// All functions are thread-safe (they have no shared state).
///
/// @code
/// blockflow::wire::Header h;
/// h.kind = blockflow::wire::MessageKind::kData;
/// h.request_id = 42;
/// h.target = "block2";
/// h.tensors.push_back({blockflow::wire::DType::kFloat32, {2, 3}, {3, 1}, 24});
/// std::string frame0 = blockflow::wire::encode_header(h);
/// auto decoded = blockflow::wire::decode_header(frame0.data(), frame0.size());  // ok, == h
/// @endcode

#include <absl/status/status.h>
#include <absl/status/statusor.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace blockflow::wire {

inline constexpr std::uint32_t kMagic = 0x57464C42;  ///< bytes 'B','L','F','W' on the wire (little-endian u32)
/// Bumped on any change of layout, meaning or rule (docs/wire-format.md, "Versioning"); 2: shm
/// handles, release; 3: CUDA handles; 4: parked outputs.
inline constexpr std::uint16_t kVersion = 4;
inline constexpr int kMaxDims = 8;
inline constexpr int kMaxTensors = 64;
inline constexpr std::size_t kMaxNameBytes = 255;                          ///< limit of Header::target
inline constexpr std::size_t kMaxMessageBytes = 65536;                     ///< limit of Header::message
inline constexpr std::uint64_t kMaxTensorBytes = std::uint64_t{16} << 30;  ///< 16 GiB per tensor
inline constexpr std::size_t kFixedHeaderBytes = 88;      ///< the fixed part, before target/message/tensors
inline constexpr std::size_t kTensorDescFixedBytes = 16;  ///< a tensor descriptor before shape/strides

/// @brief What a message is. Values are the wire codes (docs/wire-format.md, "Codes").
enum class MessageKind : std::uint8_t {
  kData = 1,     ///< tensors for hop `node` of a request; `target` names the block
  kResult = 2,   ///< a block's outputs for the request
  kError = 3,    ///< the request failed at this hop: `status_code` and `message` say why; no tensors
  kSubmit = 4,   ///< a new request (client to session) for the task named by `target`
  kReply = 5,    ///< the final answer to a kSubmit: outputs, or `status_code` != 0 and `message`
  /// Shared-memory slots given back to their producer: `message` holds whole ShmHandle records
  /// (kShmHandleBytes each); no tensors.
  kRelease = 6,
  /// Host to a worker holding parked outputs: send the parked tensors its frames name to the
  /// worker at the endpoint in `message`, as a kData for block `target`, hop `node`.
  kForward = 7,
  /// Host to such a worker: forget the parked tensors whose ids `message` lists (u64 each); no tensors.
  kDrop = 8,
};

/// @brief Header flag: each tensor frame is a kShmHandleBytes ShmHandle naming a slot of a shared-memory
/// pool that holds the tensor's bytes, instead of the bytes themselves (the zero-copy channel).
inline constexpr std::uint8_t kFlagShmHandles = 0x01;
/// @brief kData flag: the worker may keep this hop's outputs in its process (park them) and reply
/// with references, because the next hops run in workers it can reach directly.
inline constexpr std::uint8_t kFlagParkOutputs = 0x02;
/// @brief kResult / kForward flag: each tensor frame is a kParkedRefBytes reference (u64 id) to a
/// tensor parked in the sending (kResult) or receiving (kForward) worker, not its bytes.
inline constexpr std::uint8_t kFlagParked = 0x04;
/// @brief kForward flag: the worker forgets the named parked tensors once it has sent them.
inline constexpr std::uint8_t kFlagReleaseAfter = 0x08;
inline constexpr std::uint8_t kKnownFlags = kFlagShmHandles | kFlagParkOutputs | kFlagParked | kFlagReleaseAfter;
inline constexpr std::size_t kParkedRefBytes = 8;
inline constexpr std::size_t kShmHandleBytes = 32;

/// @brief Where a tensor's bytes lie in a producer's shared-memory pool: pool (random 64-bit id; the
/// sealed memfd is named "blockflow-<16 hex digits>"), slot, the slot's generation when it was leased
/// (a stale or forged handle does not match), and the byte offset of the data inside the slot.
/// `memory` says where the bytes are: kHostMemory (the slot holds them) or kCudaMemory (the slot
/// holds a record naming a CUDA IPC allocation and event; `offset` is then the data's offset inside
/// that allocation; see docs/wire-format.md).
/// Wire layout (little-endian): u64 pool_id, u32 slot, u32 memory, u64 generation, u64 offset.
inline constexpr std::uint32_t kHostMemory = 0;
inline constexpr std::uint32_t kCudaMemory = 1;
struct ShmHandle {
  std::uint64_t pool_id = 0;
  std::uint32_t slot = 0;
  std::uint64_t generation = 0;
  std::uint64_t offset = 0;
  std::uint32_t memory = kHostMemory;  ///< bytes 12..16 on the wire
};
bool operator==(const ShmHandle& a, const ShmHandle& b);
[[nodiscard]] std::string encode_shm_handle(const ShmHandle& handle);
/// @brief InvalidArgument naming the problem for a wrong size or an unknown memory kind.
[[nodiscard]] absl::StatusOr<ShmHandle> decode_shm_handle(const void* data, std::size_t size);
/// @brief The message of a kRelease: the handles' records one after the other.
[[nodiscard]] std::string encode_releases(const std::vector<ShmHandle>& handles);
[[nodiscard]] absl::StatusOr<std::vector<ShmHandle>> decode_releases(const std::string& message);
/// @brief A parked tensor's reference frame / the message of a kDrop: u64 ids, little-endian.
[[nodiscard]] std::string encode_parked_ids(const std::vector<std::uint64_t>& ids);
/// @brief InvalidArgument naming the problem when `size` is not a whole number of u64 ids.
[[nodiscard]] absl::StatusOr<std::vector<std::uint64_t>> decode_parked_ids(const void* data, std::size_t size);

/// @brief Element type of a tensor. Values are the wire codes.
enum class DType : std::uint8_t {
  kFloat32 = 1,
  kFloat64 = 2,
  kFloat16 = 3,
  kBFloat16 = 4,
  kInt8 = 5,
  kUInt8 = 6,
  kInt16 = 7,
  kInt32 = 8,
  kInt64 = 9,
  kBool = 10,
};

/// @brief Bytes per element; 0 for a value that is not a known dtype.
[[nodiscard]] std::size_t element_size(DType dtype);
/// @brief "float32", "bfloat16", "bool", ...; "unknown" for a value that is not a known dtype.
[[nodiscard]] std::string_view to_string(DType dtype);
/// @brief "data", "result", "error", "submit", "reply", "release", "forward", "drop"; "unknown"
/// for a value that is not a known kind.
[[nodiscard]] std::string_view to_string(MessageKind kind);

/// @brief Layout of one tensor frame. Strides are in elements, one per dimension; `byte_count` is
/// the size of the frame: element_size * (numel == 0 ? 0 : 1 + sum((shape[i] - 1) * strides[i])).
struct TensorDesc {
  DType dtype = DType::kFloat32;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;
  std::uint64_t byte_count = 0;
};

/// @brief Steady-clock times (ns) along one hop, filled by whoever knows them; 0 where unknown.
struct Timestamps {
  std::int64_t submitted_ns = 0, arrived_ns = 0, dequeued_ns = 0, compute_start_ns = 0, compute_end_ns = 0, sent_ns = 0;
};

/// @brief Frame 0 of a message, decoded. Value type.
struct Header {
  MessageKind kind = MessageKind::kData;
  /// 0, or kFlagShmHandles, kFlagParkOutputs, kFlagParked, kFlagReleaseAfter or'ed (kKnownFlags;
  /// kFlagShmHandles and kFlagParked exclude each other).
  std::uint8_t flags = 0;
  std::uint64_t request_id = 0;
  /// Bytes 16..20, reserved: a sender leaves them 0; a receiver ignores them (it neither rejects a
  /// nonzero value nor acts on it). Decoded as they are only so that encoding stays canonical.
  /// (Once documented as a path index; no version of BlockFlow ever set or read one.)
  std::uint32_t path_id = 0;
  std::uint32_t node = 0;     ///< hop: node index in the request's path
  std::string target;         ///< block name (kData), task name (kSubmit); may be empty; <= kMaxNameBytes
  Timestamps times;
  std::int32_t status_code = 0;  ///< absl::StatusCode value for kError / failed kReply; 0 = OK
  std::string message;           ///< error message, <= kMaxMessageBytes
  std::vector<TensorDesc> tensors;
};

bool operator==(const TensorDesc& a, const TensorDesc& b);
inline bool operator!=(const TensorDesc& a, const TensorDesc& b) {
  return !(a == b);
}
bool operator==(const Timestamps& a, const Timestamps& b);
inline bool operator!=(const Timestamps& a, const Timestamps& b) {
  return !(a == b);
}
bool operator==(const Header& a, const Header& b);
inline bool operator!=(const Header& a, const Header& b) {
  return !(a == b);
}

/// @brief OK when encode_header() can encode `header`; otherwise InvalidArgument naming the field
/// over its limit (what encode_header() would throw).
[[nodiscard]] absl::Status encodable(const Header& header);

/**
 * @brief Encodes a header as frame 0.
 *
 * Checks only what the layout needs (it does not check dtype codes or byte counts, so tests can
 * build malformed frames): throws std::invalid_argument naming the field if a limit is exceeded
 * (target or message too long, more than kMaxTensors tensors, more than kMaxDims dimensions, strides
 * not given for each dimension).
 */
[[nodiscard]] std::string encode_header(const Header& header);

/**
 * @brief Decodes and validates frame 0.
 *
 * Every failure is InvalidArgument, and its message names the field and the problem, e.g.
 * "wire header: bad magic 0x12345678", "wire header: truncated: 40 bytes, need at least 88",
 * "tensor 1: byte count 100 does not match shape [2, 3] x float32 (24 bytes)". Never reads outside
 * [data, data + size).
 */
[[nodiscard]] absl::StatusOr<Header> decode_header(const void* data, std::size_t size);

/// @brief Checks the tensor frames' sizes against a decoded header: as many frames as tensors, and
/// each frame exactly `byte_count` long (kShmHandleBytes with kFlagShmHandles, kParkedRefBytes with
/// kFlagParked). InvalidArgument
/// naming the tensor index otherwise.
[[nodiscard]] absl::Status check_frames(const Header& header, const std::vector<std::size_t>& frame_sizes);

/// @brief The request id of a frame that may be otherwise malformed, so the affected request can be
/// failed with a clear error. nullopt unless the magic and version are right and the id is inside
/// the frame (bytes 8..16).
[[nodiscard]] std::optional<std::uint64_t> peek_request_id(const void* data, std::size_t size);
/// @brief The same for the node the frame is for (bytes 20..24): with its request id, what an error
/// reply to a frame that cannot be decoded must name, so that it fails that request's node only.
[[nodiscard]] std::optional<std::uint32_t> peek_node(const void* data, std::size_t size);

/// @brief Contiguous row-major strides (in elements) for `shape`; a 0 dimension counts as 1, as in
/// libtorch. Throws std::invalid_argument for a negative dimension or a stride that overflows i64.
[[nodiscard]] std::vector<std::int64_t> contiguous_strides(const std::vector<std::int64_t>& shape);

}  // namespace blockflow::wire
