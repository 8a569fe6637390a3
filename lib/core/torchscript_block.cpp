#include <blockflow/core/torchscript_block.hpp>
#include <blockflow/core/detail/exception_text.hpp>
#include <blockflow/core/detail/log.hpp>
#include <blockflow/core/detail/opaque_layout.hpp>
#include <blockflow/core/detail/weight_swap.hpp>

#include <fmt/format.h>
#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/runtime/graph_iterator.h>
#include <torch/script.h>

#include <array>
#include <filesystem>
#include <functional>
#include <mutex>

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

// The forward graph's input, when the graph has exactly one and its only use is an
// aten::to_mkldnn without a dtype; else null.
torch::jit::Node* entry_reorder(torch::jit::Graph& graph) {
  if (graph.inputs().size() != 2) return nullptr;  // self and one tensor
  torch::jit::Value* input = graph.inputs()[1];
  if (input->uses().size() != 1) return nullptr;
  torch::jit::Node* node = input->uses()[0].user;
  if (node->kind() != c10::Symbol::fromQualString("aten::to_mkldnn")) return nullptr;
  if (node->inputs().size() > 1 && !node->input(1)->mustBeNone()) return nullptr;
  return node;
}

// The node producing the graph's one output, when it is an aten::to_dense without a dtype used
// by nothing else; else null.
torch::jit::Node* exit_reorder(torch::jit::Graph& graph) {
  if (graph.outputs().size() != 1) return nullptr;
  torch::jit::Value* output = graph.outputs()[0];
  torch::jit::Node* node = output->node();
  if (node->kind() != c10::Symbol::fromQualString("aten::to_dense") || output->uses().size() != 1) return nullptr;
  if (node->inputs().size() > 1 && !node->input(1)->mustBeNone()) return nullptr;
  return node;
}

// Whether `module` holds prepacked weights that their library allocates itself: quantized ones
// (fbgemm, qnnpack) or XNNPACK's, custom classes of torch.classes.quantized / .xnnpack, as an
// attribute of it or of a submodule, or as a constant of a method's graph (a frozen module), alone
// or inside a list, tuple or optional. (oneDNN's op contexts, torch.classes.mkldnn, allocate through
// libtorch: they are captured.)
bool holds_own_packed(const torch::jit::Module& module) {
  std::function<bool(const c10::TypePtr&)> quantized = [&](const c10::TypePtr& type) {
    if (type == nullptr) return false;
    const std::string name = type->str();
    if (name.rfind("__torch__.torch.classes.quantized.", 0) == 0 || name.rfind("__torch__.torch.classes.xnnpack.", 0) == 0) {
      return true;
    }
    for (const auto& contained : type->containedTypes()) {
      if (quantized(contained)) return true;
    }
    return false;
  };
  for (const auto& m : module.modules()) {
    for (const auto& attribute : m.named_attributes(/*recurse=*/false)) {
      if (quantized(attribute.value.type())) return true;
    }
  }
  for (const auto& method : module.get_methods()) {
    std::shared_ptr<torch::jit::Graph> graph = method.graph();
    for (torch::jit::DepthFirstGraphNodeIterator it(graph); auto* node = it.next();) {
      for (const auto* output : node->outputs()) {
        if (quantized(output->type())) return true;
      }
    }
  }
  return false;
}

// A copy of `graph` without its entry reorder (opaque_in) and/or its exit reorder (opaque_out).
std::shared_ptr<torch::jit::Graph> without_reorders(torch::jit::Graph& graph, bool opaque_in, bool opaque_out) {
  auto copy = graph.copy();
  if (opaque_in) {
    torch::jit::Node* node = entry_reorder(*copy);
    node->output()->replaceAllUsesWith(copy->inputs()[1]);
    node->destroy();
  }
  if (opaque_out) {
    torch::jit::Node* node = exit_reorder(*copy);
    torch::jit::Value* kept = node->input(0);
    copy->eraseOutput(0);
    copy->registerOutput(kept);
    node->destroy();
  }
  return copy;
}

class TorchScriptBlock final : public Block, public detail::OpaqueLayout {
 public:
  TorchScriptBlock(std::string name, BlockOptions options, torch::jit::Module module)
      : Block(std::move(name), std::move(options)), module_(std::move(module)) {}

  // Whether it holds prepacked weights that their library allocates itself. Looked for once, when
  // first asked (only a load that swapping captured asks).
  [[nodiscard]] bool own_packed_weights() const {
    std::call_once(packed_checked_, [this] { own_packed_ = holds_own_packed(module_); });
    return own_packed_;
  }

  std::string_view kind() const override { return "torchscript"; }

  absl::StatusOr<Tensors> forward(Tensors&& inputs) override { return forward_layout(std::move(inputs), false); }

  // Prepares the variants of the forward graph without reorders, when the optimized graph has them.
  void find_reorders() {
    forward_schema_ = &module_.get_method("forward").function().getSchema();  // looked up once, not per request
    const auto graph = module_.get_method("forward").graph();
    const bool in = entry_reorder(*graph) != nullptr;
    const bool out = exit_reorder(*graph) != nullptr;
    for (int v = 1; v < 4; ++v) {
      const bool opaque_in = (v & 2) != 0;
      const bool opaque_out = (v & 1) != 0;
      if ((opaque_in && !in) || (opaque_out && !out)) continue;
      // A fixed qualified name: the block's own may hold ".." or end in ".", which c10 refuses.
      variants_[static_cast<std::size_t>(v)] = std::make_unique<torch::jit::GraphFunction>(
          fmt::format("blockflow.variant.forward_{}{}", opaque_in ? "opaque" : "dense", opaque_out ? "_opaque" : ""),
          without_reorders(*graph, opaque_in, opaque_out), nullptr);
    }
  }

  bool takes_opaque() const override { return variants_[2] != nullptr; }
  bool gives_opaque() const override { return variants_[1] != nullptr; }

  absl::StatusOr<Tensors> forward_layout(Tensors&& inputs, bool opaque_output) override {
    bool opaque_in = detail::is_opaque(inputs);
    if (opaque_in && !takes_opaque()) {
      inputs.front() = inputs.front().to_dense();
      opaque_in = false;
    }
    auto& variant = variants_[static_cast<std::size_t>((opaque_in ? 2 : 0) + (opaque_output && gives_opaque() ? 1 : 0))];
    c10::IValue value;
    if (variant == nullptr) {
      std::vector<c10::IValue> args(inputs.begin(), inputs.end());
      inputs.clear();  // the module holds the only references now
      value = module_.forward(std::move(args));
    } else {
      torch::jit::Stack stack;
      stack.reserve(inputs.size() + 1);
      stack.emplace_back(module_._ivalue());
      for (auto& t : inputs) stack.emplace_back(std::move(t));
      inputs.clear();
      // As forward() does: the inputs checked against its signature (too many, wrong types) and its
      // defaults filled in. A variant's graph alone would bind whatever the stack holds.
      forward_schema_->checkAndNormalizeInputs(stack, {});
      variant->run(stack);
      value = torch::jit::pop(stack);
    }
    Tensors out;
    if (auto status = flatten(value, out); !status.ok()) return status;
    return out;
  }

 private:
  torch::jit::Module module_;
  mutable std::once_flag packed_checked_;
  mutable bool own_packed_ = false;
  // Indexed by (opaque input ? 2 : 0) + (opaque output ? 1 : 0); [0] is the module's forward().
  std::array<std::unique_ptr<torch::jit::GraphFunction>, 4> variants_;
  const c10::FunctionSchema* forward_schema_ = nullptr;  // the module's forward's (find_reorders()), for the variants
};

}  // namespace

namespace detail {
bool swaps_whole(const Block& block) {
  const auto* module = dynamic_cast<const TorchScriptBlock*>(&block);
  return module == nullptr || !module->own_packed_weights();
}
}  // namespace detail

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
  } catch (...) {  // e.g. torch::jit::ErrorReport (a model from a newer PyTorch), std::bad_alloc
    return absl::InvalidArgumentError(fmt::format("block '{}': '{}' is not a loadable TorchScript file: {}", name,
                                                  file, detail::current_exception_text()));
  }
  module.eval();
  bool optimized = false;
  if (ts_options.freeze) {
    // Some modules (e.g. with attributes mutated in forward) cannot be frozen: run them as loaded.
    // optimize_for_inference() rewrites the frozen graph in place (a copy would keep the frozen
    // weights beside the reordered ones: a second copy of every weight): should one of its passes fail
    // half way, the module is frozen again from the loaded one and runs unoptimised.
    const torch::jit::Module loaded = module;
    bool frozen = false;
    try {
      module = torch::jit::freeze(module);
      frozen = true;
    } catch (...) {
      detail::log(LogLevel::kWarning, fmt::format("block '{}': '{}' cannot be frozen ({}): it runs as loaded", name, file,
                                                  detail::current_exception_text()));
    }
    if (frozen && ts_options.optimize_for_inference && device.is_cpu()) {
      try {
        module = torch::jit::optimize_for_inference(module);
        optimized = true;
      } catch (...) {
        detail::log(LogLevel::kWarning, fmt::format("block '{}': optimize_for_inference failed on '{}' ({}): it runs "
                                                    "frozen, unoptimised", name, file, detail::current_exception_text()));
        try {
          module = torch::jit::freeze(loaded);
        } catch (...) {
          module = loaded;
        }
      }
    }
  }
  const std::string block_name = name;
  try {
    auto block = std::make_shared<TorchScriptBlock>(std::move(name), std::move(options), std::move(module));
    if (optimized) block->find_reorders();
    return std::shared_ptr<Block>(std::move(block));
  } catch (...) {
    return absl::InternalError(fmt::format("block '{}' from '{}': {}", block_name, file, detail::current_exception_text()));
  }
}

}  // namespace blockflow
