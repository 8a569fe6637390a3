// libFuzzer target for the wire header codec: decode_header must never crash or read past the
// frame, and whatever it accepts must re-encode to the very same bytes (the format is canonical:
// reserved fields are 0 and the length is exact) and decode again to the same header.
//
// Built with clang by cmake/BlockflowFuzz.cmake. If BLOCKFLOW_FUZZ_SEED_DIR names a directory, a few
// valid frames are written there before fuzzing starts, so the ctest that passes that directory as
// its corpus begins from real headers instead of searching for the magic.
#include <blockflow/channel/wire_format.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

namespace wire = blockflow::wire;

wire::TensorDesc contiguous(wire::DType dtype, std::vector<std::int64_t> shape) {
  wire::TensorDesc t;
  t.dtype = dtype;
  t.strides = wire::contiguous_strides(shape);
  std::uint64_t numel = 1;
  for (auto d : shape) numel *= static_cast<std::uint64_t>(d);
  t.byte_count = numel * wire::element_size(dtype);
  t.shape = std::move(shape);
  return t;
}

std::vector<wire::Header> seed_headers() {
  wire::Header data;
  data.request_id = 1;
  data.target = "block1";
  data.tensors = {contiguous(wire::DType::kFloat32, {1, 3, 4, 4}), contiguous(wire::DType::kInt64, {})};

  wire::Header error;
  error.kind = wire::MessageKind::kError;
  error.request_id = 2;
  error.status_code = 13;
  error.message = "block 'b': forward raised";

  wire::Header reply;
  reply.kind = wire::MessageKind::kReply;
  reply.request_id = 3;
  reply.path_id = 1;
  reply.node = 2;
  reply.times = {1, 2, 3, 4, 5, 6};
  wire::TensorDesc view;
  view.dtype = wire::DType::kFloat16;
  view.shape = {2, 3, 0};
  view.strides = {1, 2, 6};
  reply.tensors = {view, contiguous(wire::DType::kBool, {1, 1, 1, 1, 1, 1, 1, 2})};
  return {data, error, reply};
}

void write_seeds(const char* dir) {
  auto headers = seed_headers();
  for (std::size_t i = 0; i < headers.size(); ++i) {
    const std::string bytes = wire::encode_header(headers[i]);
    const std::string path = std::string(dir) + "/seed-" + std::to_string(i);
    if (std::FILE* f = std::fopen(path.c_str(), "wb")) {
      std::fwrite(bytes.data(), 1, bytes.size(), f);
      std::fclose(f);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  if (const char* dir = std::getenv("BLOCKFLOW_FUZZ_SEED_DIR")) write_seeds(dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  auto id = wire::peek_request_id(data, size);
  auto decoded = wire::decode_header(data, size);
  if (!decoded.ok()) {
    if (!absl::IsInvalidArgument(decoded.status())) std::abort();
    return 0;
  }
  // Anything decodable has a readable id.
  if (!id || *id != decoded->request_id) std::abort();
  const std::string again = wire::encode_header(*decoded);
  if (again.size() != size || again.compare(0, size, reinterpret_cast<const char*>(data), size) != 0) std::abort();
  auto redecoded = wire::decode_header(again.data(), again.size());
  if (!redecoded.ok() || *redecoded != *decoded) std::abort();
  std::vector<std::size_t> frames;
  const bool handles = (decoded->flags & wire::kFlagShmHandles) != 0;
  const bool parked = (decoded->flags & wire::kFlagParked) != 0;
  for (const auto& t : decoded->tensors) {
    frames.push_back(handles  ? wire::kShmHandleBytes
                     : parked ? wire::kParkedRefBytes
                              : static_cast<std::size_t>(t.byte_count));
  }
  // Frames as the flags say are accepted, unless the two kinds of reference are both claimed.
  const absl::Status frames_status = wire::check_frames(*decoded, frames);
  if (frames_status.ok() == (handles && parked)) std::abort();
  if (!frames_status.ok() && !absl::IsInvalidArgument(frames_status)) std::abort();
  // Parked-id lists (a drop's message) decode or fail cleanly and re-encode exactly.
  auto ids = wire::decode_parked_ids(decoded->message.data(), decoded->message.size());
  if (ids.ok() && wire::encode_parked_ids(*ids) != decoded->message) std::abort();
  // Release lists and handles decode or fail cleanly, whatever the bytes.
  auto releases = wire::decode_releases(decoded->message);
  if (releases.ok() && wire::encode_releases(*releases) != decoded->message) std::abort();
  if (size >= wire::kShmHandleBytes) (void)wire::decode_shm_handle(data + size - wire::kShmHandleBytes, wire::kShmHandleBytes);
  return 0;
}
