#pragma once
// Internal: the tensors a block's warm-up (and profiling) runs on. BlockOptions::input_shapes may
// hold -1 (any size; validate() refuses other negative dimensions); the warm-up's zeros take it as 1.

#include <blockflow/core/block.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace blockflow::detail {

/// `shape` with each negative dimension (any size) as 1: the shape of the warm-up's zeros.
inline std::vector<std::int64_t> warm_up_shape(std::vector<std::int64_t> shape) {
  for (auto& d : shape) d = d < 0 ? 1 : d;
  return shape;
}

/// At most how many elements the warm-up's zeros of `shape` take (every dimension counted as at
/// least 1); nullopt when 64 bits cannot count them.
inline std::optional<std::int64_t> warm_up_elements(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (const std::int64_t d : shape) {
    if (__builtin_mul_overflow(n, std::max<std::int64_t>(d, 1), &n)) return std::nullopt;
  }
  return n;
}

/// Zeros of the block's input_shapes (-1 read as 1) and input_dtypes (float32 when none), on its
/// device: what warm-up runs it on.
Tensors warm_up_inputs(const Block& block);
/// The same for a block's options, on `device`.
Tensors warm_up_inputs(const BlockOptions& options, c10::Device device);

}  // namespace blockflow::detail
