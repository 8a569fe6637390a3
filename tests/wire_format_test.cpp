// Wire header codec: every field survives a round trip, and every malformed frame is rejected with
// InvalidArgument naming the field and the problem (never a crash, never a read past the frame).
#include <blockflow/channel/wire_format.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

using namespace blockflow::wire;
using Catch::Matchers::Contains;
using Catch::Matchers::Equals;

namespace {

// A tensor with contiguous strides and the byte count they need.
TensorDesc contiguous(DType dtype, std::vector<std::int64_t> shape) {
  TensorDesc t;
  t.dtype = dtype;
  t.strides = contiguous_strides(shape);
  std::uint64_t numel = 1;
  for (auto d : shape) numel *= static_cast<std::uint64_t>(d);
  t.byte_count = numel * element_size(dtype);
  t.shape = std::move(shape);
  return t;
}

TensorDesc strided(DType dtype, std::vector<std::int64_t> shape, std::vector<std::int64_t> strides,
                   std::uint64_t byte_count) {
  TensorDesc t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.strides = std::move(strides);
  t.byte_count = byte_count;
  return t;
}

// A header that sets every field to a distinct, non-default value.
Header full_header() {
  Header h;
  h.kind = MessageKind::kResult;
  h.request_id = 0xFEDCBA9876543210ULL;
  h.path_id = 0xA1B2C3D4;
  h.node = 7;
  h.target = "block2";
  h.times = {
      1, -2, 3'000'000'000'000LL, std::numeric_limits<std::int64_t>::max(), std::numeric_limits<std::int64_t>::min(),
      6};
  h.status_code = 13;  // absl::StatusCode::kInternal
  h.message = "block 'thrower': forward raised: disk on fire";
  h.tensors = {
      contiguous(DType::kFloat32, {2, 3}),
      contiguous(DType::kInt64, {}),                                      // 0-dim scalar: 8 bytes
      contiguous(DType::kUInt8, {4, 0, 5}),                               // empty: 0 bytes
      strided(DType::kFloat16, {2, 3}, {1, 2}, 2 * (1 + 1 * 1 + 2 * 2)),  // transposed view
      strided(DType::kBFloat16, {3, 4}, {4, 1}, 2 * 12),                  // contiguous, given explicitly
      contiguous(DType::kBool, {1, 2, 1, 2, 1, 2, 1, 2}),                 // kMaxDims
  };
  return h;
}

// A header with no target or message, so the first tensor descriptor starts at byte 88.
Header one_tensor(TensorDesc t) {
  Header h;
  h.request_id = 99;
  h.tensors.push_back(std::move(t));
  return h;
}

constexpr std::size_t kTensor0 = kFixedHeaderBytes;

template <typename T>
void poke(std::string& bytes, std::size_t offset, T value) {
  auto bits = static_cast<std::make_unsigned_t<T>>(value);
  for (std::size_t i = 0; i < sizeof(T); ++i) bytes.at(offset + i) = static_cast<char>((bits >> (8 * i)) & 0xFF);
}

absl::StatusOr<Header> decode(const std::string& bytes) {
  return decode_header(bytes.data(), bytes.size());
}

// The frame must be rejected with InvalidArgument; returns the message.
std::string rejection(const std::string& bytes) {
  auto decoded = decode(bytes);
  REQUIRE_FALSE(decoded.ok());
  CHECK(absl::IsInvalidArgument(decoded.status()));
  return std::string(decoded.status().message());
}

}  // namespace

TEST_CASE("every header field survives a round trip", "[wire]") {
  const Header h = full_header();
  const std::string bytes = encode_header(h);
  std::size_t expected_size = kFixedHeaderBytes + h.target.size() + h.message.size();
  for (const auto& t : h.tensors) expected_size += kTensorDescFixedBytes + 16 * t.shape.size();
  CHECK(bytes.size() == expected_size);

  auto decoded = decode(bytes);
  INFO(decoded.status().ToString());
  REQUIRE(decoded.ok());
  const Header& d = *decoded;
  CHECK(d.kind == h.kind);
  CHECK(d.request_id == h.request_id);
  CHECK(d.path_id == h.path_id);
  CHECK(d.node == h.node);
  CHECK(d.target == h.target);
  CHECK(d.times.submitted_ns == 1);
  CHECK(d.times.arrived_ns == -2);
  CHECK(d.times.dequeued_ns == 3'000'000'000'000LL);
  CHECK(d.times.compute_start_ns == std::numeric_limits<std::int64_t>::max());
  CHECK(d.times.compute_end_ns == std::numeric_limits<std::int64_t>::min());
  CHECK(d.times.sent_ns == 6);
  CHECK(d.status_code == 13);
  CHECK(d.message == h.message);
  REQUIRE(d.tensors.size() == h.tensors.size());
  for (std::size_t i = 0; i < h.tensors.size(); ++i) {
    INFO("tensor " << i);
    CHECK(d.tensors[i].dtype == h.tensors[i].dtype);
    CHECK(d.tensors[i].shape == h.tensors[i].shape);
    CHECK(d.tensors[i].strides == h.tensors[i].strides);
    CHECK(d.tensors[i].byte_count == h.tensors[i].byte_count);
  }
  CHECK(d == h);
  CHECK(encode_header(d) == bytes);  // the encoding is canonical
}

TEST_CASE("the fixed part has the documented byte layout", "[wire]") {
  Header h;
  h.kind = MessageKind::kSubmit;
  h.request_id = 0x0102030405060708ULL;
  h.node = 5;
  h.target = "task";
  h.times.submitted_ns = 0x10;
  h.times.sent_ns = 0x60;
  h.status_code = 3;
  h.message = "m";
  h.tensors.push_back(contiguous(DType::kInt32, {2}));
  const std::string b = encode_header(h);
  auto byte = [&](std::size_t i) { return static_cast<unsigned>(static_cast<unsigned char>(b.at(i))); };
  CHECK(b.substr(0, 4) == "BLFW");
  CHECK(byte(4) == 4);
  CHECK(byte(5) == 0);
  CHECK(byte(6) == 4);
  CHECK(byte(7) == 0);
  CHECK(byte(8) == 0x08);
  CHECK(byte(15) == 0x01);
  CHECK(b.substr(16, 4) == std::string(4, '\0'));  // reserved
  CHECK(byte(20) == 5);
  CHECK(byte(24) == 0x10);
  CHECK(byte(64) == 0x60);
  CHECK(byte(72) == 3);
  CHECK(byte(76) == 4);  // target_len
  CHECK(byte(78) == 1);  // num_tensors
  CHECK(byte(80) == 1);  // message_len
  CHECK(b.substr(88, 4) == "task");
  CHECK(b.substr(92, 1) == "m");
  CHECK(byte(93) == 8);       // dtype int32
  CHECK(byte(94) == 1);       // ndim
  CHECK(byte(93 + 8) == 8);   // byte_count
  CHECK(byte(93 + 16) == 2);  // shape[0]
  CHECK(byte(93 + 24) == 1);  // strides[0]
  CHECK(b.size() == 93 + 32);
}

TEST_CASE("bytes 16..20 (Header::path_id) are reserved: written 0, ignored on receipt", "[wire]") {
  Header h = one_tensor(contiguous(DType::kFloat32, {2}));
  h.node = 3;
  const std::string zero = encode_header(h);
  CHECK(zero.substr(16, 4) == std::string(4, '\0'));  // what every sender writes
  // Whatever a peer put there, the frame is accepted and nothing else in it changes.
  std::string other = zero;
  poke(other, 16, std::uint32_t{0xDEADBEEF});
  auto d = decode(other);
  INFO(d.status().ToString());
  REQUIRE(d.ok());
  CHECK(d->node == 3);
  CHECK(d->request_id == 99);
  Header without = *d;
  without.path_id = 0;
  CHECK(without == h);
  CHECK(peek_request_id(other.data(), other.size()) == std::optional<std::uint64_t>(99));
  // Unlike the reserved word at byte 84, which must be 0.
  std::string reserved = zero;
  poke(reserved, 84, std::uint32_t{1});
  CHECK_THAT(rejection(reserved), Contains("reserved"));
}

TEST_CASE("every kind and dtype round trips; limits are reachable", "[wire]") {
  for (auto kind :
       {MessageKind::kData, MessageKind::kResult, MessageKind::kError, MessageKind::kSubmit, MessageKind::kReply,
        MessageKind::kRelease, MessageKind::kForward, MessageKind::kDrop}) {
    Header h;
    h.kind = kind;
    auto d = decode(encode_header(h));
    REQUIRE(d.ok());
    CHECK(d->kind == kind);
    CHECK(to_string(kind) != "unknown");
  }
  Header h;
  for (int code = 1; code <= 10; ++code) h.tensors.push_back(contiguous(static_cast<DType>(code), {3, 2}));
  h.target.assign(kMaxNameBytes, 't');
  h.message.assign(kMaxMessageBytes, 'm');
  auto d = decode(encode_header(h));
  INFO(d.status().ToString());
  REQUIRE(d.ok());
  CHECK(*d == h);

  Header many;
  many.tensors.assign(kMaxTensors, contiguous(DType::kFloat64, {1, 2, 3, 4, 5, 6, 7, 8}));
  auto m = decode(encode_header(many));
  REQUIRE(m.ok());
  CHECK(m->tensors.size() == static_cast<std::size_t>(kMaxTensors));
}

TEST_CASE("element sizes, names and contiguous strides", "[wire]") {
  CHECK(element_size(DType::kFloat32) == 4);
  CHECK(element_size(DType::kFloat64) == 8);
  CHECK(element_size(DType::kFloat16) == 2);
  CHECK(element_size(DType::kBFloat16) == 2);
  CHECK(element_size(DType::kInt8) == 1);
  CHECK(element_size(DType::kUInt8) == 1);
  CHECK(element_size(DType::kInt16) == 2);
  CHECK(element_size(DType::kInt32) == 4);
  CHECK(element_size(DType::kInt64) == 8);
  CHECK(element_size(DType::kBool) == 1);
  CHECK(element_size(static_cast<DType>(0)) == 0);
  CHECK(element_size(static_cast<DType>(77)) == 0);
  CHECK(to_string(DType::kBFloat16) == "bfloat16");
  CHECK(to_string(static_cast<DType>(77)) == "unknown");
  CHECK(to_string(MessageKind::kReply) == "reply");
  CHECK(to_string(static_cast<MessageKind>(9)) == "unknown");

  CHECK(contiguous_strides({2, 3, 4}) == std::vector<std::int64_t>{12, 4, 1});
  CHECK(contiguous_strides({}).empty());
  CHECK(contiguous_strides({2, 0, 3}) == std::vector<std::int64_t>{3, 3, 1});
  CHECK_THROWS_AS(contiguous_strides({2, -1}), std::invalid_argument);
  CHECK(contiguous_strides({std::int64_t{1} << 62, 2}) == std::vector<std::int64_t>{2, 1});  // only strides must fit
  CHECK_THROWS_AS(contiguous_strides({2, std::int64_t{1} << 62, std::int64_t{1} << 62}), std::invalid_argument);
}

TEST_CASE("a frame truncated at any length is rejected without reading past it", "[wire]") {
  const std::string full = encode_header(full_header());
  for (std::size_t n = 0; n < full.size(); ++n) {
    // An exactly sized heap copy, so a sanitizer build catches any read past the end.
    std::vector<unsigned char> prefix(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(n));
    auto decoded = decode_header(prefix.data(), prefix.size());
    INFO("length " << n);
    REQUIRE_FALSE(decoded.ok());
    CHECK(absl::IsInvalidArgument(decoded.status()));
    CHECK_THAT(std::string(decoded.status().message()), Contains("truncated"));
  }
  CHECK_THAT(rejection(full.substr(0, 40)), Equals("wire header: truncated: 40 bytes, need at least 88"));
  CHECK_THAT(rejection(full.substr(0, 90)), Contains("wire header: truncated: 90 bytes"));
  const std::size_t tensors_start = kFixedHeaderBytes + full_header().target.size() + full_header().message.size();
  CHECK_THAT(rejection(full.substr(0, tensors_start + 20)), Contains("tensor 0: truncated"));
  CHECK_FALSE(decode_header(nullptr, 0).ok());
}

TEST_CASE("bad magic, version, kind, flags and reserved fields are rejected", "[wire]") {
  const std::string good = encode_header(one_tensor(contiguous(DType::kFloat32, {2, 3})));
  REQUIRE(decode(good).ok());

  auto bad = good;
  poke<std::uint32_t>(bad, 0, 0x12345678);
  CHECK_THAT(rejection(bad), Equals("wire header: bad magic 0x12345678"));

  bad = good;
  poke<std::uint16_t>(bad, 4, 7);
  CHECK_THAT(rejection(bad), Equals("wire header: version 7 not supported (expected 4)"));

  for (std::uint8_t kind : {0, 9, 10, 255}) {
    bad = good;
    poke<std::uint8_t>(bad, 6, kind);
    CHECK_THAT(rejection(bad), Equals("wire header: unknown message kind " + std::to_string(kind)));
  }

  for (std::uint8_t flags : {0x10, 0x80, 0xFF}) {
    bad = good;
    poke<std::uint8_t>(bad, 7, flags);
    CHECK_THAT(rejection(bad), Contains("wire header: flags") && Contains("unknown bits"));
  }

  bad = good;
  poke<std::uint32_t>(bad, 84, 0xDEAD);
  CHECK_THAT(rejection(bad), Contains("wire header: reserved") && Contains("must be 0"));

  for (std::size_t offset : {kTensor0 + 2, kTensor0 + 3, kTensor0 + 4, kTensor0 + 7}) {
    bad = good;
    poke<std::uint8_t>(bad, offset, 1);
    CHECK_THAT(rejection(bad), Contains("tensor 0: reserved"));
  }
}

TEST_CASE("limits on names, message, tensor count and status code are enforced", "[wire]") {
  const std::string good = encode_header(Header{});

  auto bad = good;
  poke<std::uint16_t>(bad, 76, 256);
  bad += std::string(256, 'x');
  CHECK_THAT(rejection(bad), Equals("wire header: target length 256 exceeds 255"));

  bad = good;
  poke<std::uint32_t>(bad, 80, 65537);
  CHECK_THAT(rejection(bad), Equals("wire header: message length 65537 exceeds 65536"));

  bad = good;
  poke<std::uint16_t>(bad, 78, 65);
  CHECK_THAT(rejection(bad), Equals("wire header: 65 tensors exceeds limit 64"));

  for (std::int32_t code : {-1, 17}) {
    bad = good;
    poke<std::int32_t>(bad, 72, code);
    CHECK_THAT(rejection(bad), Contains("status code " + std::to_string(code)));
  }

  // The encoder refuses what the decoder would reject for size.
  Header h;
  h.target.assign(kMaxNameBytes + 1, 'x');
  CHECK_THROWS_AS(encode_header(h), std::invalid_argument);
  h = Header{};
  h.message.assign(kMaxMessageBytes + 1, 'x');
  CHECK_THROWS_AS(encode_header(h), std::invalid_argument);
  h = Header{};
  h.tensors.assign(kMaxTensors + 1, contiguous(DType::kInt8, {1}));
  CHECK_THROWS_AS(encode_header(h), std::invalid_argument);
  h = one_tensor(contiguous(DType::kInt8, {1, 1, 1, 1, 1, 1, 1, 1, 1}));
  CHECK_THROWS_AS(encode_header(h), std::invalid_argument);
  h = one_tensor(strided(DType::kInt8, {2, 2}, {1}, 4));
  CHECK_THROWS_AS(encode_header(h), std::invalid_argument);
}

TEST_CASE("unknown dtypes and too many dimensions are rejected", "[wire]") {
  const std::string good = encode_header(one_tensor(contiguous(DType::kFloat32, {2, 3})));
  for (std::uint8_t code : {0, 11, 77}) {
    auto bad = good;
    poke<std::uint8_t>(bad, kTensor0, code);
    CHECK_THAT(rejection(bad), Equals("tensor 0: dtype code " + std::to_string(code) + " unknown"));
  }
  auto bad = good;
  poke<std::uint8_t>(bad, kTensor0 + 1, 9);
  bad += std::string(16 * 7, '\0');  // room for 9 dims, so only ndim is wrong
  CHECK_THAT(rejection(bad), Equals("tensor 0: ndim 9 exceeds 8"));
}

TEST_CASE("a byte count that does not match the layout is rejected, naming the tensor", "[wire]") {
  Header h = full_header();
  h.tensors[1] = contiguous(DType::kFloat32, {2, 3});
  h.tensors[1].byte_count = 100;
  CHECK_THAT(rejection(encode_header(h)),
             Equals("tensor 1: byte count 100 does not match shape [2, 3] x float32 (24 bytes)"));

  // Strides are part of the layout: a transposed view of [2, 3] spans the same 6 elements...
  CHECK(decode(encode_header(one_tensor(strided(DType::kFloat32, {2, 3}, {1, 2}, 24)))).ok());
  // ...a strided one spans more, and the message shows the strides.
  CHECK_THAT(rejection(encode_header(one_tensor(strided(DType::kFloat32, {2, 3}, {6, 2}, 24)))),
             Equals("tensor 0: byte count 24 does not match shape [2, 3] strides [6, 2] x float32 (44 bytes)"));
  // An empty tensor needs 0 bytes whatever its strides; a scalar needs one element.
  CHECK(decode(encode_header(one_tensor(strided(DType::kInt64, {0, 5}, {100, 7}, 0)))).ok());
  CHECK_THAT(rejection(encode_header(one_tensor(strided(DType::kInt64, {}, {}, 0)))), Contains("(8 bytes)"));
}

TEST_CASE("zero and overlapping strides are refused: 130 bytes never decode as 1 GiB", "[wire]") {
  // The amplification: shape [2^28], stride [0], over a 4-byte frame.
  CHECK_THAT(rejection(encode_header(one_tensor(strided(DType::kFloat32, {std::int64_t{1} << 28}, {0}, 4)))),
             Contains("tensor 0: shape [268435456] strides [0] x float32 holds 268435456 elements in 4 bytes: "
                      "elements may not overlap"));
  CHECK_THAT(rejection(encode_header(one_tensor(strided(DType::kBFloat16, {3, 4}, {0, 1}, 8)))),
             Contains("elements may not overlap"));                                 // a broadcast along dim 0
  CHECK_THAT(rejection(encode_header(one_tensor(strided(DType::kUInt8, {4, 4}, {2, 1}, 10)))),
             Contains("elements may not overlap"));                                 // rows overlapping
  // Overlapping elements in as many bytes as elements: (0, 1) and (1, 0) share byte 3.
  CHECK_THAT(rejection(encode_header(one_tensor(strided(DType::kUInt8, {2, 2}, {3, 3}, 7)))),
             Contains("elements may not overlap"));
  // A count that wraps 64 bits once multiplied by the element size: 2^62 floats in 4 bytes.
  CHECK_THAT(rejection(encode_header(one_tensor(strided(DType::kFloat32, {std::int64_t{1} << 62}, {0}, 4)))),
             Contains("elements may not overlap"));
  CHECK_THAT(rejection(encode_header(one_tensor(strided(DType::kFloat32, {std::int64_t{1} << 61, 2}, {0, 1}, 8)))),
             Contains("elements may not overlap"));
  CHECK(decode(encode_header(one_tensor(strided(DType::kUInt8, {4, 4}, {8, 1}, 28)))).ok());  // rows with gaps
  CHECK(decode(encode_header(one_tensor(strided(DType::kUInt8, {2, 3, 4}, {1, 8, 2}, 24)))).ok());  // a permutation
  CHECK(decode(encode_header(one_tensor(strided(DType::kUInt8, {4, 1}, {1, 0}, 4)))).ok());   // stride 0 on a size-1 dim
}

TEST_CASE("negative dimensions and strides are rejected", "[wire]") {
  CHECK_THAT(rejection(encode_header(one_tensor(strided(DType::kFloat32, {2, -1}, {1, 1}, 0)))),
             Contains("tensor 0: negative dimension"));
  CHECK_THAT(rejection(encode_header(one_tensor(strided(DType::kFloat32, {2, 3}, {-3, 1}, 24)))),
             Contains("tensor 0: negative stride"));
}

TEST_CASE("sizes that overflow 64 bits or exceed the tensor limit are rejected", "[wire]") {
  const std::int64_t big = std::int64_t{1} << 62;
  const std::int64_t max = std::numeric_limits<std::int64_t>::max();
  // numel overflows, whether the strides are contiguous or all zero.
  CHECK_THAT(rejection(encode_header(one_tensor(strided(DType::kFloat32, {big, big}, {big, 1}, 16)))),
             Contains("tensor 0: size overflow"));
  CHECK_THAT(rejection(encode_header(one_tensor(strided(DType::kFloat32, {big, big}, {0, 0}, 4)))),
             Contains("tensor 0: size overflow"));
  // (dim - 1) * stride, the sum, and the final multiplication by the element size.
  CHECK_THAT(rejection(encode_header(one_tensor(strided(DType::kUInt8, {4}, {max}, 0)))), Contains("size overflow"));
  CHECK_THAT(rejection(encode_header(one_tensor(strided(DType::kUInt8, {2, 2, 2}, {max, max, max}, 0)))),
             Contains("size overflow"));
  CHECK_THAT(rejection(encode_header(one_tensor(strided(DType::kInt64, {std::int64_t{1} << 61}, {1}, 0)))),
             Contains("size overflow"));
  // An empty tensor whose other dimensions multiply past i64 is one libtorch cannot make (it
  // multiplies them in order), wherever the zero is; within i64 it is fine.
  CHECK_THAT(rejection(encode_header(one_tensor(strided(DType::kFloat32, {big, big, 0}, {0, 0, 0}, 0)))),
             Contains("tensor 0: size overflow"));
  CHECK_THAT(rejection(encode_header(one_tensor(strided(DType::kFloat32, {0, big, big}, {0, 0, 0}, 0)))),
             Contains("tensor 0: size overflow"));
  CHECK(decode(encode_header(one_tensor(strided(DType::kFloat32, {big, 0, 1}, {0, 0, 0}, 0)))).ok());

  const std::uint64_t over = kMaxTensorBytes + 1;
  CHECK_THAT(rejection(encode_header(one_tensor(contiguous(DType::kUInt8, {static_cast<std::int64_t>(over)})))),
             Equals("tensor 0: byte count 17179869185 exceeds limit 17179869184"));
  CHECK(
      decode(encode_header(one_tensor(contiguous(DType::kUInt8, {static_cast<std::int64_t>(kMaxTensorBytes)})))).ok());
}

TEST_CASE("trailing bytes are rejected", "[wire]") {
  CHECK_THAT(rejection(encode_header(full_header()) + std::string(12, '\0')), Equals("wire header: 12 trailing bytes"));
}

TEST_CASE("peek_request_id reads the id of an otherwise malformed header", "[wire]") {
  std::string bytes = encode_header(one_tensor(contiguous(DType::kFloat32, {2, 3})));
  poke<std::uint8_t>(bytes, kTensor0, 77);
  REQUIRE_FALSE(decode(bytes).ok());
  CHECK(peek_request_id(bytes.data(), bytes.size()) == std::optional<std::uint64_t>(99));
  CHECK(peek_request_id(bytes.data(), 16) == std::optional<std::uint64_t>(99));
  CHECK_FALSE(peek_request_id(bytes.data(), 15).has_value());
  CHECK_FALSE(peek_request_id(nullptr, 0).has_value());

  auto bad = bytes;
  poke<std::uint32_t>(bad, 0, 0x12345678);
  CHECK_FALSE(peek_request_id(bad.data(), bad.size()).has_value());
  bad = bytes;
  poke<std::uint16_t>(bad, 4, 1);
  CHECK_FALSE(peek_request_id(bad.data(), bad.size()).has_value());
  CHECK_FALSE(peek_node(bad.data(), bad.size()).has_value());  // no node without a readable header

  Header at_node = one_tensor(contiguous(DType::kFloat32, {2, 3}));
  at_node.node = 7;
  std::string torn = encode_header(at_node);
  poke<std::uint8_t>(torn, kTensor0, 77);
  CHECK(peek_node(torn.data(), torn.size()) == std::optional<std::uint32_t>(7));
  CHECK(peek_node(torn.data(), 24) == std::optional<std::uint32_t>(7));
  CHECK_FALSE(peek_node(torn.data(), 23).has_value());
}

TEST_CASE("check_frames compares frame count and sizes with the header", "[wire]") {
  const Header h = full_header();
  std::vector<std::size_t> sizes;
  for (const auto& t : h.tensors) sizes.push_back(t.byte_count);
  CHECK(check_frames(h, sizes).ok());

  auto missing = sizes;
  missing.pop_back();
  auto status = check_frames(h, missing);
  CHECK(absl::IsInvalidArgument(status));
  CHECK_THAT(std::string(status.message()), Equals("wire message: 5 tensor frames, header describes 6 tensors"));

  auto wrong = sizes;
  wrong[1] = 7;
  status = check_frames(h, wrong);
  CHECK(absl::IsInvalidArgument(status));
  CHECK_THAT(std::string(status.message()), Equals("tensor 1: frame is 7 bytes, header says 8"));

  CHECK(check_frames(Header{}, {}).ok());
}

TEST_CASE("shm handles: round trip, frames checked as handles, release lists validated", "[wire]") {
  ShmHandle h;
  h.pool_id = 0x0123456789ABCDEFull;
  h.slot = 7;
  h.generation = 42;
  h.offset = 4096;
  const std::string record = encode_shm_handle(h);
  REQUIRE(record.size() == kShmHandleBytes);
  auto back = decode_shm_handle(record.data(), record.size());
  REQUIRE(back.ok());
  CHECK(*back == h);
  CHECK_THAT(std::string(decode_shm_handle(record.data(), 31).status().message()), Contains("31 bytes, need 32"));
  std::string unknown = record;
  unknown[12] = 2;
  CHECK_THAT(std::string(decode_shm_handle(unknown.data(), unknown.size()).status().message()),
             Contains("memory kind 2 unknown"));
  h.memory = kCudaMemory;  // a CUDA record: same layout, memory 1
  const std::string cuda = encode_shm_handle(h);
  CHECK(static_cast<unsigned char>(cuda[12]) == 1);
  auto cuda_back = decode_shm_handle(cuda.data(), cuda.size());
  REQUIRE(cuda_back.ok());
  CHECK(cuda_back->memory == kCudaMemory);
  CHECK(*cuda_back == h);

  Header header = one_tensor(contiguous(DType::kFloat32, {256, 56, 56}));
  header.flags = kFlagShmHandles;
  auto decoded = decode(encode_header(header));
  REQUIRE(decoded.ok());
  CHECK(decoded->flags == kFlagShmHandles);
  CHECK(check_frames(*decoded, {kShmHandleBytes}).ok());
  CHECK_THAT(std::string(check_frames(*decoded, {256 * 56 * 56 * 4}).message()),
             Contains("tensor 0: handle frame is 3211264 bytes, a shm handle is 32"));

  h.slot = 8;
  auto list = decode_releases(encode_releases({h, h}));
  REQUIRE(list.ok());
  CHECK(list->size() == 2);
  CHECK(list->at(1) == h);
  CHECK_THAT(std::string(decode_releases(std::string(40, '\0')).status().message()),
             Contains("40 bytes is not a whole number of 32-byte handles"));
}

TEST_CASE("parked references: frames checked as 8-byte ids, exclusive with shm handles; drop lists validated", "[wire]") {
  Header header = one_tensor(contiguous(DType::kFloat32, {256, 56, 56}));
  header.kind = MessageKind::kForward;
  header.flags = kFlagParked | kFlagReleaseAfter | kFlagParkOutputs;
  header.message = "ipc:///run/blockflow-x/peer";
  auto decoded = decode(encode_header(header));
  REQUIRE(decoded.ok());
  CHECK(*decoded == header);
  CHECK(to_string(MessageKind::kForward) == "forward");
  CHECK(to_string(MessageKind::kDrop) == "drop");
  CHECK(check_frames(*decoded, {kParkedRefBytes}).ok());
  CHECK_THAT(std::string(check_frames(*decoded, {256 * 56 * 56 * 4}).message()),
             Equals("tensor 0: parked reference frame is 3211264 bytes, need 8"));
  decoded->flags |= kFlagShmHandles;
  CHECK_THAT(std::string(check_frames(*decoded, {kParkedRefBytes}).message()), Contains("exclude each other"));

  const std::string ids = encode_parked_ids({1, 0xFFFFFFFFFFFFFFFFull, 42});
  REQUIRE(ids.size() == 3 * kParkedRefBytes);
  auto back = decode_parked_ids(ids.data(), ids.size());
  REQUIRE(back.ok());
  CHECK(*back == std::vector<std::uint64_t>{1, 0xFFFFFFFFFFFFFFFFull, 42});
  CHECK(static_cast<unsigned char>(ids[0]) == 1);  // little-endian
  CHECK_THAT(std::string(decode_parked_ids(ids.data(), 12).status().message()),
             Contains("12 bytes is not a whole number of 8-byte ids"));
  CHECK(decode_parked_ids(nullptr, 0).ok());
}
