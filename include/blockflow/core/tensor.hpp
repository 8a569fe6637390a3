#pragma once
/// @file
/// @brief The tensor types that flow between blocks.

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <string_view>
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

/// @brief The name BlockFlow gives a dtype in deployments, profiles and messages: "float32",
/// "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64" or "bool" (the
/// dtypes channels carry); empty for any other dtype.
std::string_view dtype_name(at::ScalarType dtype);

/// @brief The dtype dtype_name() gives `name`; nullopt for a name not in that list.
std::optional<at::ScalarType> parse_dtype(std::string_view name);

/// @brief dtype_name()'s names, comma-separated, for messages that list what is accepted.
std::string_view dtype_names();

/// @brief dtype_name() of each of `dtypes` (BlockOptions::input_dtypes as a deployment writes it).
std::vector<std::string> dtype_names(const std::vector<at::ScalarType>& dtypes);

}  // namespace blockflow
