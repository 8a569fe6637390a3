#include <blockflow/core/tensor.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace blockflow {

std::string describe(const Tensor& tensor) {
  if (!tensor.defined()) return "undefined tensor";
  const std::string_view name = dtype_name(tensor.scalar_type());
  return fmt::format("[{}] {} {}", fmt::join(tensor.sizes(), ", "),
                     name.empty() ? std::string(tensor.dtype().name()) : std::string(name),
                     tensor.device().str());
}

std::size_t byte_size(const Tensor& tensor) {
  return tensor.defined() ? static_cast<std::size_t>(tensor.numel()) * tensor.element_size() : 0;
}

namespace {
struct NamedDtype {
  at::ScalarType dtype;
  std::string_view name;
};
constexpr NamedDtype kDtypes[] = {
    {at::kFloat, "float32"}, {at::kDouble, "float64"}, {at::kHalf, "float16"}, {at::kBFloat16, "bfloat16"},
    {at::kChar, "int8"},     {at::kByte, "uint8"},     {at::kShort, "int16"},  {at::kInt, "int32"},
    {at::kLong, "int64"},    {at::kBool, "bool"},
};
}  // namespace

std::string_view dtype_name(at::ScalarType dtype) {
  for (const auto& d : kDtypes) {
    if (d.dtype == dtype) return d.name;
  }
  return {};
}

std::optional<at::ScalarType> parse_dtype(std::string_view name) {
  for (const auto& d : kDtypes) {
    if (d.name == name) return d.dtype;
  }
  return std::nullopt;
}

std::string_view dtype_names() {
  static const std::string names = [] {  // the table's names, in its order
    std::string all;
    for (const auto& d : kDtypes) all += (all.empty() ? "" : ", ") + std::string(d.name);
    return all;
  }();
  return names;
}

std::vector<std::string> dtype_names(const std::vector<at::ScalarType>& dtypes) {
  std::vector<std::string> names;
  names.reserve(dtypes.size());
  for (const at::ScalarType t : dtypes) names.emplace_back(dtype_name(t));
  return names;
}

}  // namespace blockflow
