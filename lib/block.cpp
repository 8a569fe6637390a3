#include <blockflow/block.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <stdexcept>

namespace blockflow {
namespace {

c10::Device parse_device(const std::string& block, const std::string& device) {
  try {
    return c10::Device(device);
  } catch (const std::exception&) {
    throw std::invalid_argument(fmt::format("block '{}': invalid device '{}' (expected cpu, cuda or cuda:N)",
                                            block, device));
  }
}

class CallableBlock final : public Block {
 public:
  CallableBlock(std::string name, Fn fn, BlockOptions options)
      : Block(std::move(name), std::move(options)), fn_(std::move(fn)) {}
  std::string_view kind() const override { return "callable"; }
  absl::StatusOr<Tensors> forward(Tensors&& inputs) override { return fn_(std::move(inputs)); }

 private:
  Fn fn_;
};

}  // namespace

Block::Block(std::string name, BlockOptions options)
    : name_(std::move(name)), options_(std::move(options)), device_(parse_device(name_, options_.device)) {
  if (name_.empty()) throw std::invalid_argument("a block needs a non-empty name");
  if (options_.workers < 1) throw std::invalid_argument(fmt::format("block '{}': workers must be >= 1", name_));
  if (options_.queue_capacity < 1) {
    throw std::invalid_argument(fmt::format("block '{}': queue_capacity must be >= 1", name_));
  }
}

Block::~Block() = default;

std::shared_ptr<Block> Block::callable(std::string name, Fn fn, BlockOptions options) {
  if (!fn) throw std::invalid_argument(fmt::format("block '{}': the callable is empty", name));
  return std::make_shared<CallableBlock>(std::move(name), std::move(fn), std::move(options));
}

absl::Status check_inputs(const Block& block, const Tensors& inputs) {
  const auto& shapes = block.options().input_shapes;
  if (shapes.empty()) return absl::OkStatus();
  if (inputs.size() != shapes.size()) {
    return absl::InvalidArgumentError(
        fmt::format("block '{}' expects {} input(s), got {}", block.name(), shapes.size(), inputs.size()));
  }
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const auto& want = shapes[i];
    const auto got = inputs[i].sizes();
    bool match = inputs[i].defined() && got.size() == want.size();
    for (std::size_t d = 0; match && d < want.size(); ++d) match = want[d] < 0 || want[d] == got[d];
    if (!match) {
      return absl::InvalidArgumentError(fmt::format("block '{}': input {} has shape {}, expected [{}]", block.name(),
                                                    i, describe(inputs[i]), fmt::join(want, ", ")));
    }
  }
  return absl::OkStatus();
}

}  // namespace blockflow
