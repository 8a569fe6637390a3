#include <blockflow/core/torchscript_block.hpp>

#include <fmt/format.h>
#include <torch/script.h>

#include <filesystem>

namespace blockflow {
namespace {

// Appends the tensors of a TorchScript value (tensor, tuple or list, nested) to `out`.
absl::Status flatten(const c10::IValue& value, Tensors& out) {
  if (value.isTensor()) {
    out.push_back(value.toTensor());
  } else if (value.isTuple()) {
    for (const auto& element : value.toTupleRef().elements()) {
      if (auto status = flatten(element, out); !status.ok()) return status;
    }
  } else if (value.isTensorList()) {
    const auto list = value.toTensorList();
    for (std::size_t i = 0; i < list.size(); ++i) out.push_back(list.get(i));
  } else if (value.isList()) {
    for (const c10::IValue& element : value.toListRef()) {
      if (auto status = flatten(element, out); !status.ok()) return status;
    }
  } else {
    return absl::InvalidArgumentError(
        fmt::format("forward returned a {}, expected a tensor or a tuple/list of tensors", value.tagKind()));
  }
  return absl::OkStatus();
}

class TorchScriptBlock final : public Block {
 public:
  TorchScriptBlock(std::string name, BlockOptions options, torch::jit::Module module)
      : Block(std::move(name), std::move(options)), module_(std::move(module)) {}

  std::string_view kind() const override { return "torchscript"; }

  absl::StatusOr<Tensors> forward(Tensors&& inputs) override {
    std::vector<c10::IValue> args(inputs.begin(), inputs.end());
    inputs.clear();  // the module holds the only references now
    c10::IValue value = module_.forward(std::move(args));
    Tensors out;
    if (auto status = flatten(value, out); !status.ok()) return status;
    return out;
  }

 private:
  torch::jit::Module module_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<Block>> load_torchscript_block(std::string name, const std::string& file,
                                                              BlockOptions options, TorchScriptOptions ts_options) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(file, ec)) {
    return absl::NotFoundError(fmt::format("block '{}': TorchScript file '{}' not found", name, file));
  }
  if (auto status = validate(name, options); !status.ok()) return status;
  const c10::Device device(options.device);
  torch::jit::Module module;
  try {
    module = torch::jit::load(file, device);
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(fmt::format("block '{}': '{}' is not a loadable TorchScript file: {}", name,
                                                  file, e.what_without_backtrace()));
  }
  module.eval();
  if (ts_options.freeze) {
    try {
      module = torch::jit::freeze(module);
      if (ts_options.optimize_for_inference && device.is_cpu()) module = torch::jit::optimize_for_inference(module);
    } catch (const c10::Error&) {
      // Some modules (e.g. with attributes mutated in forward) cannot be frozen: run them as loaded.
    }
  }
  return std::shared_ptr<Block>(std::make_shared<TorchScriptBlock>(std::move(name), std::move(options), std::move(module)));
}

}  // namespace blockflow
