#include <blockflow/core/path.hpp>
#include <blockflow/core/detail/exception_text.hpp>

#include <ATen/ATen.h>
#include <fmt/format.h>

namespace blockflow {
namespace {

// The first tensor of every input, or an error naming the rule.
absl::StatusOr<Tensors> firsts(const std::string& rule, const std::vector<Tensors>& inputs) {
  Tensors out;
  out.reserve(inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].empty()) return absl::InvalidArgumentError(fmt::format("{}: input {} has no tensor", rule, i));
    out.push_back(inputs[i].front());
  }
  return out;
}

}  // namespace

Combine Combine::pack() {
  return Combine("pack", [](std::vector<Tensors>&& inputs) -> absl::StatusOr<Tensors> {
    Tensors out;
    for (auto& list : inputs) {
      for (auto& tensor : list) out.push_back(std::move(tensor));
    }
    return out;
  });
}

Combine Combine::mean() {
  return Combine("mean", [](std::vector<Tensors>&& inputs) -> absl::StatusOr<Tensors> {
    auto tensors = firsts("mean", inputs);
    if (!tensors.ok()) return tensors.status();
    for (const auto& t : *tensors) {
      if (!t.sizes().equals(tensors->front().sizes())) {
        return absl::InvalidArgumentError(fmt::format("mean: shapes differ: {} vs {}",
                                                      describe(tensors->front()), describe(t)));
      }
    }
    return Tensors{at::stack(*tensors).mean(0)};
  });
}

Combine Combine::concat(std::int64_t dim) {
  return Combine(fmt::format("concat(dim={})", dim), [dim](std::vector<Tensors>&& inputs) -> absl::StatusOr<Tensors> {
    auto tensors = firsts("concat", inputs);
    if (!tensors.ok()) return tensors.status();
    try {
      return Tensors{at::cat(*tensors, dim)};
    } catch (const c10::Error& e) {
      return absl::InvalidArgumentError(fmt::format("concat(dim={}): {}", dim, e.what_without_backtrace()));
    }
  });
}

Combine Combine::custom(std::string name, Fn fn) {
  if (!fn) throw std::invalid_argument(fmt::format("combine rule '{}' has an empty function", name));
  return Combine(std::move(name), std::move(fn));
}

absl::StatusOr<Tensors> Combine::apply(std::vector<Tensors>&& inputs) const {
  try {
    return fn_(std::move(inputs));
  } catch (...) {
    return absl::InternalError(fmt::format("combine rule '{}' raised: {}", name_, detail::current_exception_text()));
  }
}

Path Path::chain(std::string task, const std::vector<std::string>& blocks) {
  Path path(std::move(task));
  for (const auto& block : blocks) path.then(block);
  return path;
}

Path& Path::then(std::string block) {
  std::vector<std::string> inputs;
  if (!nodes_.empty()) inputs.push_back(nodes_.back().name);
  return node(std::move(block), std::move(inputs));
}

Path& Path::node(std::string block, std::vector<std::string> inputs, Combine combine) {
  PathNode n{block, std::move(block), std::move(inputs), std::move(combine)};
  nodes_.push_back(std::move(n));
  return *this;
}

Path& Path::join(std::string name, std::vector<std::string> inputs, Combine combine) {
  nodes_.push_back(PathNode{std::move(name), std::string(), std::move(inputs), std::move(combine)});
  return *this;
}

}  // namespace blockflow
