// The tensor codec (blockflow/channel/detail/tensor_codec.hpp) on shapes at the edge of what i64
// holds: what it cannot describe is an error naming the tensor, never an exception.
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
