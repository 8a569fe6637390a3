// The tensor codec (blockflow/channel/detail/tensor_codec.hpp) on shapes at the edge of what i64
// holds: what it cannot describe is an error naming the tensor, never an exception.
#include <blockflow/channel/detail/packet_link.hpp>
#include <blockflow/channel/detail/shm_pool.hpp>
#include <blockflow/channel/detail/tensor_codec.hpp>

#include <ATen/ATen.h>

#include <catch2/catch.hpp>

#include <cstdint>

using Catch::Matchers::Contains;

TEST_CASE("an empty tensor whose other dimensions overflow i64 is refused by the encoder, named", "[wire]") {
  const std::int64_t big = std::int64_t{1} << 62;
  // libtorch makes it (its element count reaches 0 before any overflow), but no contiguous strides
  // describe it, and a receiver could not make it: the send fails, it does not throw.
  const at::Tensor empty = at::empty_strided({0, big, big}, {0, 0, 0});
  REQUIRE(empty.numel() == 0);
  absl::StatusOr<blockflow::detail::EncodedMessage> encoded = absl::UnknownError("not run");
  REQUIRE_NOTHROW(encoded = blockflow::detail::encode_message(blockflow::wire::Header{}, {empty}, nullptr, nullptr));
  REQUIRE_FALSE(encoded.ok());
  CHECK(absl::IsInvalidArgument(encoded.status()));
  CHECK_THAT(std::string(encoded.status().message()), Contains("tensor 0:") && Contains("overflows i64"));
  // Within i64 it goes, and comes back the same.
  const at::Tensor fine = at::empty({0, 4, std::int64_t{1} << 40});
  auto ok = blockflow::detail::encode_message(blockflow::wire::Header{}, {fine}, nullptr, nullptr);
  REQUIRE(ok.ok());
  REQUIRE(ok->tensors.size() == 1);
  CHECK(ok->tensors[0].sizes() == fine.sizes());
}

TEST_CASE("a sparse tensor is refused by the encoder, named", "[wire]") {
  const at::Tensor sparse = at::eye(3).to_sparse();
  absl::StatusOr<blockflow::detail::EncodedMessage> encoded = absl::UnknownError("not run");
  REQUIRE_NOTHROW(encoded = blockflow::detail::encode_message(blockflow::wire::Header{}, {at::ones({2}), sparse}, nullptr, nullptr));
  REQUIRE_FALSE(encoded.ok());
  CHECK(absl::IsInvalidArgument(encoded.status()));
  CHECK_THAT(std::string(encoded.status().message()), Contains("tensor 1 has layout Sparse"));
}

TEST_CASE("a placeholder (meta) tensor is refused on a zero-copy link too, named; the stager names no wrong channel",
          "[wire]") {
  using namespace blockflow::detail;
  auto link = PacketLink::pair();
  REQUIRE(link.ok());
  ShmProducer producer;
  const ShmStager stage = make_stager(producer, absl::ZeroDuration());
  const at::Tensor placeholder = at::empty({2}, at::kMeta);
  const absl::Status sent = send_packet(*link->first, blockflow::wire::Header{}, {at::ones({2}), placeholder}, nullptr, &stage);
  CHECK(absl::IsInvalidArgument(sent));
  CHECK_THAT(std::string(sent.message()), Contains("tensor 1 is a placeholder without bytes (meta device)"));
  CHECK(producer.stats().slots_in_use == 0);  // refused before anything was staged
  const auto staged = stage(placeholder);
  REQUIRE_FALSE(staged.ok());
  CHECK_THAT(std::string(staged.status().message()), Contains("cannot cross a zero-copy channel") && !Contains("use channel"));
}

TEST_CASE("the wire's dtype names are the ones deployments and messages use", "[wire]") {
  for (int code = 1; code <= 10; ++code) {
    const auto dtype = static_cast<blockflow::wire::DType>(code);
    auto type = blockflow::detail::from_wire_dtype(dtype);
    REQUIRE(type.ok());
    INFO(code);
    CHECK(blockflow::wire::to_string(dtype) == blockflow::dtype_name(*type));
    CHECK(blockflow::parse_dtype(blockflow::wire::to_string(dtype)) == *type);
  }
  CHECK(blockflow::dtype_name(at::kComplexDouble).empty());
  CHECK_FALSE(blockflow::parse_dtype("long").has_value());
  CHECK(blockflow::describe(at::zeros({2}, at::kLong)) == "[2] int64 cpu");
}
