#include <blockflow/core/block.hpp>
#include <blockflow/core/detail/warm_up_shapes.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <stdexcept>

namespace blockflow {
namespace {

// After validate(): the device string parses.
c10::Device parse_device(const std::string& device) {
  try {
    return c10::Device(device);
  } catch (const std::exception&) {
    return c10::Device(c10::kCPU);  // unreachable after validate()
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

// A batch's room is reserved when a lane takes its first request (session_execution.cpp).
constexpr int kMaxBatch = kMaxBatchSize;
// Bounds that keep a configuration's numbers within what the process can do: an OpenMP team of a
// million threads aborts it at the first parallel op; a delay past ~9e12 ms overflows the
// nanosecond deadline it is added to.
constexpr int kMaxIntraOpThreads = 1024;
constexpr double kMaxBatchDelayMs = 60'000;

absl::Status validate(const std::string& block, const BlockOptions& o) {
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(fmt::format("block '{}': {}", block, what));
  };
  if (block.empty()) return absl::InvalidArgumentError("a block needs a non-empty name");
  try {
    const c10::Device device(o.device);
    if (!device.is_cpu() && !device.is_cuda()) return bad(fmt::format("device '{}' is not supported (use cpu or cuda:N)", o.device));
  } catch (const std::exception&) {  // c10::Error for "cuda:x", "gpu", ""
    return bad(fmt::format("invalid device '{}' (expected cpu, cuda or cuda:N)", o.device));
  }
  if (o.workers < 1) return bad("workers must be >= 1");
  if (o.queue_capacity < 1) return bad("queue_capacity must be >= 1");
  if (o.intra_op_threads < 0 || o.intra_op_threads > kMaxIntraOpThreads) {
    return bad(fmt::format("intra_op_threads must be from 0 to {}", kMaxIntraOpThreads));
  }
  if (o.max_batch < 1 || o.max_batch > kMaxBatch) return bad(fmt::format("max_batch must be from 1 to {}", kMaxBatch));
  if (!(o.max_batch_delay_ms >= 0 && o.max_batch_delay_ms <= kMaxBatchDelayMs)) {
    return bad(fmt::format("max_batch_delay_ms must be from 0 to {}", kMaxBatchDelayMs));
  }
  if (o.warmup_runs < 0) return bad("warmup_runs must be >= 0");
  for (std::size_t i = 0; i < o.input_shapes.size(); ++i) {
    for (const std::int64_t d : o.input_shapes[i]) {
      if (d < -1) return bad(fmt::format("input_shapes[{}] has dimension {}: -1 (any size) is the only negative one", i, d));
    }
    if (!detail::warm_up_elements(o.input_shapes[i])) {
      return bad(fmt::format("input_shapes[{}] has more elements than 64 bits count", i));
    }
  }
  if (!o.input_dtypes.empty() && o.input_dtypes.size() != o.input_shapes.size()) {
    return bad(fmt::format("input_dtypes has {} entries for {} input_shapes: give one dtype per input shape",
                           o.input_dtypes.size(), o.input_shapes.size()));
  }
  for (std::size_t i = 0; i < o.input_dtypes.size(); ++i) {
    if (dtype_name(o.input_dtypes[i]).empty()) {
      return bad(fmt::format("input_dtypes[{}] is {}, which channels do not carry ({})", i,
                             c10::toString(o.input_dtypes[i]), dtype_names()));
    }
  }
  if (o.memory_bytes < 0) return bad("memory_bytes must be >= 0");
  if (o.cuda_graph && o.device.rfind("cuda", 0) != 0) {
    return bad(fmt::format("cuda_graph needs a CUDA device (device is '{}')", o.device));
  }
  if (o.cuda_graph && o.input_shapes.empty()) return bad("cuda_graph needs input_shapes (the shapes to capture)");
  return absl::OkStatus();
}

namespace {
// Throws std::invalid_argument for what validate() refuses: a constructor has no status to return.
const std::string& checked(const std::string& name, const BlockOptions& options) {
  if (auto status = validate(name, options); !status.ok()) throw std::invalid_argument(std::string(status.message()));
  return name;
}
}  // namespace

Block::Block(std::string name, BlockOptions options)
    : name_(checked(name, options)), options_(std::move(options)), device_(parse_device(options_.device)) {}

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
    const auto& dtypes = block.options().input_dtypes;
    if (!dtypes.empty() && inputs[i].scalar_type() != dtypes[i]) {
      return absl::InvalidArgumentError(fmt::format("block '{}': input {} is {}, expected dtype {}", block.name(), i,
                                                    describe(inputs[i]), dtype_name(dtypes[i])));
    }
  }
  return absl::OkStatus();
}

}  // namespace blockflow
