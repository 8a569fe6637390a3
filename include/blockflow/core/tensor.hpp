#pragma once
/// @file
/// @brief The tensor types that flow between blocks.

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace blockflow {

/// @brief A libtorch tensor. BlockFlow never copies one it hands from block to block in a process.
using Tensor = at::Tensor;

/// @brief What a block consumes and produces: one tensor, or several (TorchScript tuples/lists).
using Tensors = std::vector<Tensor>;

/// @brief "[1, 3, 224, 224] float32 cpu": shape, dtype and device of a tensor, for messages.
std::string describe(const Tensor& tensor);

/// @brief Number of bytes of the tensor's elements (numel * element size).
std::size_t byte_size(const Tensor& tensor);

}  // namespace blockflow
