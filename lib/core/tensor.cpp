#include <blockflow/core/tensor.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace blockflow {

std::string describe(const Tensor& tensor) {
  if (!tensor.defined()) return "undefined tensor";
  return fmt::format("[{}] {} {}", fmt::join(tensor.sizes(), ", "), std::string(tensor.dtype().name()),
                     tensor.device().str());
}

std::size_t byte_size(const Tensor& tensor) {
  return tensor.defined() ? static_cast<std::size_t>(tensor.numel()) * tensor.element_size() : 0;
}

}  // namespace blockflow
