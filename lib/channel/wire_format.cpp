#include <blockflow/channel/wire_format.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <utility>
#include <vector>
#include <limits>
#include <stdexcept>
#include <type_traits>

namespace blockflow::wire {
namespace {

// Byte offsets of the fixed part (docs/wire-format.md has the same table).
constexpr std::size_t kOffMagic = 0;
constexpr std::size_t kOffVersion = 4;
constexpr std::size_t kOffKind = 6;
constexpr std::size_t kOffFlags = 7;
constexpr std::size_t kOffRequestId = 8;
constexpr std::size_t kOffPathId = 16;  // reserved (Header::path_id): senders write 0, receivers ignore it
constexpr std::size_t kOffNode = 20;
constexpr std::size_t kOffTimes = 24;
constexpr std::size_t kOffStatusCode = 72;
constexpr std::size_t kOffTargetLen = 76;
constexpr std::size_t kOffNumTensors = 78;
constexpr std::size_t kOffMessageLen = 80;
constexpr std::size_t kOffReserved = 84;
static_assert(kOffReserved + 4 == kFixedHeaderBytes);

// absl::StatusCode runs from kOk (0) to kUnauthenticated (16); anything else is not a status.
constexpr std::int32_t kMaxStatusCode = 16;

// Little-endian by construction, byte by byte, so the host's byte order never matters.
template <typename T>
void put(std::string& out, T value) {
  using U = std::make_unsigned_t<T>;
  auto bits = static_cast<U>(value);
  for (std::size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<char>((bits >> (8 * i)) & 0xFF));
}

template <typename T>
T load(const unsigned char* p) {
  using U = std::make_unsigned_t<T>;
  U bits = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) bits |= static_cast<U>(static_cast<U>(p[i]) << (8 * i));
  return static_cast<T>(bits);
}

absl::Status header_error(std::string_view what) {
  return absl::InvalidArgumentError(fmt::format("wire header: {}", what));
}

absl::Status tensor_error(std::size_t index, std::string_view what) {
  return absl::InvalidArgumentError(fmt::format("tensor {}: {}", index, what));
}

std::string truncated(std::size_t size, std::size_t need) {
  return fmt::format("truncated: {} bytes, need at least {}", size, need);
}

bool known_kind(std::uint8_t code) {
  return code >= static_cast<std::uint8_t>(MessageKind::kData) &&
         code <= static_cast<std::uint8_t>(MessageKind::kDrop);
}

// Bytes a tensor with this layout spans, or nullopt if a product or sum overflows. The element count
// must also fit in i64 (libtorch counts elements in i64), even when zero strides keep the span small.
// So must the product of the dimensions with zeros counted as ones: libtorch multiplies them left to
// right when it makes the tensor (and contiguous_strides() does), so [2^62, 2^62, 0] would throw there.
std::optional<std::uint64_t> required_bytes(const TensorDesc& desc) {
  std::int64_t extent = 1;
  for (std::int64_t d : desc.shape) {
    if (__builtin_mul_overflow(extent, std::max<std::int64_t>(d, 1), &extent)) return std::nullopt;
  }
  for (std::int64_t d : desc.shape) {
    if (d == 0) return 0;
  }
  std::uint64_t numel = 1;
  for (std::int64_t d : desc.shape) {
    if (__builtin_mul_overflow(numel, static_cast<std::uint64_t>(d), &numel)) return std::nullopt;
  }
  if (numel > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) return std::nullopt;
  std::uint64_t span = 1;
  for (std::size_t i = 0; i < desc.shape.size(); ++i) {
    std::uint64_t term = 0;
    if (__builtin_mul_overflow(static_cast<std::uint64_t>(desc.shape[i] - 1),
                               static_cast<std::uint64_t>(desc.strides[i]), &term) ||
        __builtin_add_overflow(span, term, &span)) {
      return std::nullopt;
    }
  }
  std::uint64_t bytes = 0;
  if (__builtin_mul_overflow(span, static_cast<std::uint64_t>(element_size(desc.dtype)), &bytes)) return std::nullopt;
  return bytes;
}

// "shape [2, 3] x float32", with the strides when they are not the contiguous ones.
std::string describe_layout(const TensorDesc& desc) {
  std::vector<std::int64_t> contiguous;
  try {
    contiguous = contiguous_strides(desc.shape);
  } catch (const std::invalid_argument&) {
    // Only reachable for shapes that already failed the overflow check; show the strides then.
  }
  if (contiguous == desc.strides) {
    return fmt::format("shape [{}] x {}", fmt::join(desc.shape, ", "), to_string(desc.dtype));
  }
  return fmt::format("shape [{}] strides [{}] x {}", fmt::join(desc.shape, ", "), fmt::join(desc.strides, ", "),
                     to_string(desc.dtype));
}

// Dims and strides non-negative, byte count within the cap and equal to what the layout spans.
absl::Status validate_layout(std::size_t index, const TensorDesc& desc) {
  for (std::size_t d = 0; d < desc.shape.size(); ++d) {
    if (desc.shape[d] < 0) {
      return tensor_error(index, fmt::format("negative dimension {} at index {}", desc.shape[d], d));
    }
    if (desc.strides[d] < 0) {
      return tensor_error(index, fmt::format("negative stride {} at index {}", desc.strides[d], d));
    }
  }
  if (desc.byte_count > kMaxTensorBytes) {
    return tensor_error(index, fmt::format("byte count {} exceeds limit {}", desc.byte_count, kMaxTensorBytes));
  }
  auto need = required_bytes(desc);
  if (!need) return tensor_error(index, fmt::format("size overflow in {}", describe_layout(desc)));
  if (*need != desc.byte_count) {
    return tensor_error(index, fmt::format("byte count {} does not match {} ({} bytes)", desc.byte_count,
                                           describe_layout(desc), *need));
  }
  // Elements may not share bytes (a zero or overlapping stride): a 4-byte frame must not decode as
  // 2^28 floats that every later copy materialises (the amplification of a broadcast view). The
  // dims of more than one element, by stride, must each step past the span of those before it
  // (what permutations and unit-step slices of a dense tensor satisfy; a few layouts that do not
  // overlap, stepped slices among them, are refused too).
  std::uint64_t numel = 1;
  for (std::int64_t d : desc.shape) numel *= static_cast<std::uint64_t>(d);  // no overflow: checked above
  std::vector<std::pair<std::uint64_t, std::uint64_t>> dims;  // (stride, size), in elements
  for (std::size_t d = 0; d < desc.shape.size(); ++d) {
    if (desc.shape[d] > 1) dims.emplace_back(static_cast<std::uint64_t>(desc.strides[d]), static_cast<std::uint64_t>(desc.shape[d]));
  }
  std::sort(dims.begin(), dims.end());
  bool overlap = false;
  std::uint64_t spanned = 1;  // elements the dims so far step over
  for (const auto& [stride, size] : dims) {
    overlap = overlap || stride < spanned || __builtin_mul_overflow(stride, size, &spanned);
  }
  if (numel > 0 && overlap) {
    return tensor_error(index, fmt::format("{} holds {} elements in {} bytes: elements may not overlap (zero or "
                                           "overlapping strides are refused)", describe_layout(desc), numel,
                                           desc.byte_count));
  }
  return absl::OkStatus();
}

// Decodes the tensor descriptor at `*pos`, advancing it past the descriptor.
absl::StatusOr<TensorDesc> decode_tensor(std::size_t index, const unsigned char* p, std::size_t size,
                                         std::size_t* pos) {
  if (size - *pos < kTensorDescFixedBytes) return tensor_error(index, truncated(size, *pos + kTensorDescFixedBytes));
  const unsigned char* t = p + *pos;
  const std::uint8_t dtype_code = t[0];
  const std::uint8_t ndim = t[1];
  TensorDesc desc;
  desc.dtype = static_cast<DType>(dtype_code);
  if (element_size(desc.dtype) == 0) return tensor_error(index, fmt::format("dtype code {} unknown", dtype_code));
  if (ndim > kMaxDims) return tensor_error(index, fmt::format("ndim {} exceeds {}", ndim, kMaxDims));
  if (load<std::uint16_t>(t + 2) != 0 || load<std::uint32_t>(t + 4) != 0) {
    return tensor_error(index, "reserved bytes 2..8 must be 0");
  }
  desc.byte_count = load<std::uint64_t>(t + 8);
  *pos += kTensorDescFixedBytes;

  const std::size_t dims_bytes = std::size_t{16} * ndim;
  if (size - *pos < dims_bytes) return tensor_error(index, truncated(size, *pos + dims_bytes));
  desc.shape.resize(ndim);
  desc.strides.resize(ndim);
  for (std::size_t d = 0; d < ndim; ++d) desc.shape[d] = load<std::int64_t>(p + *pos + 8 * d);
  *pos += std::size_t{8} * ndim;
  for (std::size_t d = 0; d < ndim; ++d) desc.strides[d] = load<std::int64_t>(p + *pos + 8 * d);
  *pos += std::size_t{8} * ndim;

  if (auto status = validate_layout(index, desc); !status.ok()) return status;
  return desc;
}

// Magic and version first, so a frame from something else (or a newer BlockFlow) says so rather
// than "truncated".
absl::Status check_preamble(const unsigned char* p, std::size_t size) {
  if (size >= 4) {
    if (auto magic = load<std::uint32_t>(p + kOffMagic); magic != kMagic) {
      return header_error(fmt::format("bad magic 0x{:08X}", magic));
    }
  }
  if (size >= 6) {
    if (auto version = load<std::uint16_t>(p + kOffVersion); version != kVersion) {
      return header_error(fmt::format("version {} not supported (expected {})", version, kVersion));
    }
  }
  if (size < kFixedHeaderBytes) return header_error(truncated(size, kFixedHeaderBytes));
  return absl::OkStatus();
}

// The fixed part's flags, kind, reserved word, limits and status code.
absl::Status check_fixed(const unsigned char* p) {
  if (const std::uint8_t flags = p[kOffFlags]; (flags & ~kKnownFlags) != 0)
    return header_error(fmt::format("flags 0x{:02X} has unknown bits", flags));
  if (const std::uint8_t kind = p[kOffKind]; !known_kind(kind)) {
    return header_error(fmt::format("unknown message kind {}", kind));
  }
  if (auto reserved = load<std::uint32_t>(p + kOffReserved); reserved != 0) {
    return header_error(fmt::format("reserved field 0x{:08X} must be 0", reserved));
  }
  if (auto len = load<std::uint16_t>(p + kOffTargetLen); len > kMaxNameBytes) {
    return header_error(fmt::format("target length {} exceeds {}", len, kMaxNameBytes));
  }
  if (auto len = load<std::uint32_t>(p + kOffMessageLen); len > kMaxMessageBytes) {
    return header_error(fmt::format("message length {} exceeds {}", len, kMaxMessageBytes));
  }
  if (auto count = load<std::uint16_t>(p + kOffNumTensors); count > kMaxTensors) {
    return header_error(fmt::format("{} tensors exceeds limit {}", count, kMaxTensors));
  }
  if (auto code = load<std::int32_t>(p + kOffStatusCode); code < 0 || code > kMaxStatusCode) {
    return header_error(fmt::format("status code {} unknown", code));
  }
  return absl::OkStatus();
}

void check_encodable(const Header& header) {
  if (auto status = encodable(header); !status.ok()) {
    throw std::invalid_argument(fmt::format("encode_header: {}", std::string(status.message())));
  }
}

}  // namespace

absl::Status encodable(const Header& header) {
  if (header.target.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(fmt::format("target is {} bytes, limit {}", header.target.size(), kMaxNameBytes));
  }
  if (header.message.size() > kMaxMessageBytes) {
    return absl::InvalidArgumentError(fmt::format("message is {} bytes, limit {}", header.message.size(), kMaxMessageBytes));
  }
  if (header.tensors.size() > static_cast<std::size_t>(kMaxTensors)) {
    return absl::InvalidArgumentError(fmt::format("{} tensors, limit {}", header.tensors.size(), kMaxTensors));
  }
  for (std::size_t i = 0; i < header.tensors.size(); ++i) {
    const auto& t = header.tensors[i];
    if (t.shape.size() > static_cast<std::size_t>(kMaxDims)) {
      return absl::InvalidArgumentError(fmt::format("tensor {}: ndim {} exceeds {}", i, t.shape.size(), kMaxDims));
    }
    if (t.strides.size() != t.shape.size()) {
      return absl::InvalidArgumentError(fmt::format("tensor {}: {} strides for {} dimensions", i, t.strides.size(), t.shape.size()));
    }
  }
  return absl::OkStatus();
}

std::size_t element_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kInt8: return 1;
    case DType::kUInt8: return 1;
    case DType::kInt16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kBool: return 1;
  }
  return 0;  // a code read off the wire that names no dtype
}

std::string_view to_string(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt8: return "int8";
    case DType::kUInt8: return "uint8";
    case DType::kInt16: return "int16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kBool: return "bool";
  }
  return "unknown";
}

std::string_view to_string(MessageKind kind) {
  switch (kind) {
    case MessageKind::kData: return "data";
    case MessageKind::kResult: return "result";
    case MessageKind::kError: return "error";
    case MessageKind::kSubmit: return "submit";
    case MessageKind::kReply: return "reply";
    case MessageKind::kRelease: return "release";
    case MessageKind::kForward: return "forward";
    case MessageKind::kDrop: return "drop";
  }
  return "unknown";
}

bool operator==(const TensorDesc& a, const TensorDesc& b) {
  return a.dtype == b.dtype && a.shape == b.shape && a.strides == b.strides && a.byte_count == b.byte_count;
}

bool operator==(const Timestamps& a, const Timestamps& b) {
  return a.submitted_ns == b.submitted_ns && a.arrived_ns == b.arrived_ns && a.dequeued_ns == b.dequeued_ns &&
         a.compute_start_ns == b.compute_start_ns && a.compute_end_ns == b.compute_end_ns && a.sent_ns == b.sent_ns;
}

bool operator==(const Header& a, const Header& b) {
  return a.kind == b.kind && a.flags == b.flags && a.request_id == b.request_id && a.path_id == b.path_id && a.node == b.node &&
         a.target == b.target && a.times == b.times && a.status_code == b.status_code && a.message == b.message &&
         a.tensors == b.tensors;
}

std::string encode_header(const Header& header) {
  check_encodable(header);
  std::size_t size = kFixedHeaderBytes + header.target.size() + header.message.size();
  for (const auto& t : header.tensors) size += kTensorDescFixedBytes + 16 * t.shape.size();

  std::string out;
  out.reserve(size);
  put(out, kMagic);
  put(out, kVersion);
  put(out, static_cast<std::uint8_t>(header.kind));
  put(out, header.flags);
  put(out, header.request_id);
  put(out, header.path_id);
  put(out, header.node);
  for (std::int64_t t : {header.times.submitted_ns, header.times.arrived_ns, header.times.dequeued_ns,
                         header.times.compute_start_ns, header.times.compute_end_ns, header.times.sent_ns}) {
    put(out, t);
  }
  put(out, header.status_code);
  put(out, static_cast<std::uint16_t>(header.target.size()));
  put(out, static_cast<std::uint16_t>(header.tensors.size()));
  put(out, static_cast<std::uint32_t>(header.message.size()));
  put(out, std::uint32_t{0});  // reserved
  out += header.target;
  out += header.message;
  for (const auto& t : header.tensors) {
    put(out, static_cast<std::uint8_t>(t.dtype));
    put(out, static_cast<std::uint8_t>(t.shape.size()));
    put(out, std::uint16_t{0});
    put(out, std::uint32_t{0});
    put(out, t.byte_count);
    for (std::int64_t d : t.shape) put(out, d);
    for (std::int64_t s : t.strides) put(out, s);
  }
  return out;
}

absl::StatusOr<Header> decode_header(const void* data, std::size_t size) {
  if (data == nullptr && size != 0) return header_error("null data");
  const auto* p = static_cast<const unsigned char*>(data);
  if (auto status = check_preamble(p, size); !status.ok()) return status;
  if (auto status = check_fixed(p); !status.ok()) return status;

  const std::size_t target_len = load<std::uint16_t>(p + kOffTargetLen);
  const std::size_t message_len = load<std::uint32_t>(p + kOffMessageLen);
  const std::size_t num_tensors = load<std::uint16_t>(p + kOffNumTensors);
  std::size_t pos = kFixedHeaderBytes + target_len + message_len;
  if (size < pos) return header_error(truncated(size, pos));

  Header header;
  header.kind = static_cast<MessageKind>(p[kOffKind]);
  header.flags = p[kOffFlags];
  header.request_id = load<std::uint64_t>(p + kOffRequestId);
  header.path_id = load<std::uint32_t>(p + kOffPathId);  // reserved: not checked, kept for a canonical re-encoding
  header.node = load<std::uint32_t>(p + kOffNode);
  std::int64_t* times[] = {&header.times.submitted_ns,     &header.times.arrived_ns,     &header.times.dequeued_ns,
                           &header.times.compute_start_ns, &header.times.compute_end_ns, &header.times.sent_ns};
  for (std::size_t i = 0; i < 6; ++i) *times[i] = load<std::int64_t>(p + kOffTimes + 8 * i);
  header.status_code = load<std::int32_t>(p + kOffStatusCode);
  header.target.assign(reinterpret_cast<const char*>(p + kFixedHeaderBytes), target_len);
  header.message.assign(reinterpret_cast<const char*>(p + kFixedHeaderBytes + target_len), message_len);

  header.tensors.reserve(num_tensors);
  for (std::size_t i = 0; i < num_tensors; ++i) {
    auto tensor = decode_tensor(i, p, size, &pos);
    if (!tensor.ok()) return tensor.status();
    header.tensors.push_back(*std::move(tensor));
  }
  if (pos != size) return header_error(fmt::format("{} trailing bytes", size - pos));
  return header;
}

absl::Status check_frames(const Header& header, const std::vector<std::size_t>& frame_sizes) {
  if (frame_sizes.size() != header.tensors.size()) {
    return absl::InvalidArgumentError(fmt::format("wire message: {} tensor frames, header describes {} tensors",
                                                  frame_sizes.size(), header.tensors.size()));
  }
  const bool handles = (header.flags & kFlagShmHandles) != 0;
  const bool parked = (header.flags & kFlagParked) != 0;
  if (handles && parked) return header_error("flags 0x01 (shm handles) and 0x04 (parked) exclude each other");
  for (std::size_t i = 0; i < frame_sizes.size(); ++i) {
    if (handles && frame_sizes[i] != kShmHandleBytes) {
      return tensor_error(i, fmt::format("handle frame is {} bytes, a shm handle is {}", frame_sizes[i], kShmHandleBytes));
    }
    if (parked && frame_sizes[i] != kParkedRefBytes) {
      return tensor_error(i, fmt::format("parked reference frame is {} bytes, need {}", frame_sizes[i], kParkedRefBytes));
    }
    if (!handles && !parked && frame_sizes[i] != header.tensors[i].byte_count) {
      return tensor_error(
          i, fmt::format("frame is {} bytes, header says {}", frame_sizes[i], header.tensors[i].byte_count));
    }
  }
  return absl::OkStatus();
}

bool operator==(const ShmHandle& a, const ShmHandle& b) {
  return a.pool_id == b.pool_id && a.slot == b.slot && a.memory == b.memory && a.generation == b.generation &&
         a.offset == b.offset;
}

std::string encode_shm_handle(const ShmHandle& h) {
  std::string out;
  out.reserve(kShmHandleBytes);
  put(out, h.pool_id);
  put(out, h.slot);
  put(out, h.memory);
  put(out, h.generation);
  put(out, h.offset);
  return out;
}

absl::StatusOr<ShmHandle> decode_shm_handle(const void* data, std::size_t size) {
  if (data == nullptr || size != kShmHandleBytes) {
    return absl::InvalidArgumentError(fmt::format("shm handle: {} bytes, need {}", size, kShmHandleBytes));
  }
  const auto* p = static_cast<const unsigned char*>(data);
  const auto memory = load<std::uint32_t>(p + 12);
  if (memory != kHostMemory && memory != kCudaMemory) {
    return absl::InvalidArgumentError(fmt::format("shm handle: memory kind {} unknown (0 host, 1 CUDA)", memory));
  }
  ShmHandle h;
  h.memory = memory;
  h.pool_id = load<std::uint64_t>(p);
  h.slot = load<std::uint32_t>(p + 8);
  h.generation = load<std::uint64_t>(p + 16);
  h.offset = load<std::uint64_t>(p + 24);
  return h;
}

std::string encode_releases(const std::vector<ShmHandle>& handles) {
  std::string out;
  for (const auto& h : handles) out += encode_shm_handle(h);
  return out;
}

absl::StatusOr<std::vector<ShmHandle>> decode_releases(const std::string& message) {
  if (message.size() % kShmHandleBytes != 0) {
    return absl::InvalidArgumentError(
        fmt::format("release message: {} bytes is not a whole number of {}-byte handles", message.size(), kShmHandleBytes));
  }
  std::vector<ShmHandle> out;
  for (std::size_t at = 0; at < message.size(); at += kShmHandleBytes) {
    auto h = decode_shm_handle(message.data() + at, kShmHandleBytes);
    if (!h.ok()) return h.status();
    out.push_back(*h);
  }
  return out;
}

std::string encode_parked_ids(const std::vector<std::uint64_t>& ids) {
  std::string out;
  out.reserve(ids.size() * kParkedRefBytes);
  for (const std::uint64_t id : ids) put(out, id);
  return out;
}

absl::StatusOr<std::vector<std::uint64_t>> decode_parked_ids(const void* data, std::size_t size) {
  if (size % kParkedRefBytes != 0 || (data == nullptr && size != 0)) {
    return absl::InvalidArgumentError(
        fmt::format("parked ids: {} bytes is not a whole number of {}-byte ids", size, kParkedRefBytes));
  }
  std::vector<std::uint64_t> out;
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t at = 0; at < size; at += kParkedRefBytes) out.push_back(load<std::uint64_t>(p + at));
  return out;
}

std::optional<std::uint64_t> peek_request_id(const void* data, std::size_t size) {
  if (data == nullptr || size < kOffRequestId + 8) return std::nullopt;
  const auto* p = static_cast<const unsigned char*>(data);
  if (load<std::uint32_t>(p + kOffMagic) != kMagic || load<std::uint16_t>(p + kOffVersion) != kVersion)
    return std::nullopt;
  return load<std::uint64_t>(p + kOffRequestId);
}

std::optional<std::uint32_t> peek_node(const void* data, std::size_t size) {
  if (size < kOffNode + 4 || !peek_request_id(data, size)) return std::nullopt;
  return load<std::uint32_t>(static_cast<const unsigned char*>(data) + kOffNode);
}

std::vector<std::int64_t> contiguous_strides(const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> strides(shape.size());
  std::int64_t running = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    if (shape[i] < 0) throw std::invalid_argument(fmt::format("contiguous_strides: negative dimension {}", shape[i]));
    strides[i] = running;
    // A 0 dimension counts as 1, as in libtorch, so the other strides stay meaningful.
    if (i > 0 && __builtin_mul_overflow(running, std::max<std::int64_t>(shape[i], 1), &running)) {
      throw std::invalid_argument(fmt::format("contiguous_strides: shape [{}] overflows i64", fmt::join(shape, ", ")));
    }
  }
  return strides;
}

}  // namespace blockflow::wire
