#include <blockflow/core/block_registry.hpp>
#include <blockflow/core/detail/cuda_graph_block.hpp>
#include <blockflow/core/detail/exception_text.hpp>
#include <blockflow/core/detail/mutex.hpp>
#include <blockflow/core/torchscript_block.hpp>

#include <fmt/format.h>

#include <dlfcn.h>
#include <fmt/ranges.h>

namespace blockflow {

BlockRegistry& BlockRegistry::global() {
  static BlockRegistry registry;
  return registry;
}

void BlockRegistry::add(const std::string& factory, Factory fn) {
  blockflow::detail::MutexLock lock(&mu_);
  factories_[factory] = std::move(fn);
}

bool BlockRegistry::contains(const std::string& factory) const {
  blockflow::detail::MutexLock lock(&mu_);
  return factories_.count(factory) > 0;
}

std::vector<std::string> BlockRegistry::names() const {
  blockflow::detail::MutexLock lock(&mu_);
  std::vector<std::string> out;
  for (const auto& [name, fn] : factories_) out.push_back(name);
  return out;
}

namespace {
// The first option in which `made` differs from `asked`; null when none does.
const char* first_difference(const BlockOptions& made, const BlockOptions& asked) {
  if (made.device != asked.device) return "device";
  if (made.intra_op_threads != asked.intra_op_threads) return "intra_op_threads";
  if (made.workers != asked.workers) return "workers";
  if (made.queue_capacity != asked.queue_capacity) return "queue_capacity";
  if (made.full_policy != asked.full_policy) return "full_policy";
  if (made.input_shapes != asked.input_shapes) return "input_shapes";
  if (made.input_dtypes != asked.input_dtypes) return "input_dtypes";
  if (made.warmup_runs != asked.warmup_runs) return "warmup_runs";
  if (made.max_batch != asked.max_batch) return "max_batch";
  if (made.max_batch_delay_ms != asked.max_batch_delay_ms) return "max_batch_delay_ms";
  if (made.memory_bytes != asked.memory_bytes) return "memory_bytes";
  if (made.cuda_graph != asked.cuda_graph) return "cuda_graph";
  return nullptr;
}
}  // namespace

absl::StatusOr<std::shared_ptr<Block>> BlockRegistry::create(const std::string& factory, const std::string& name,
                                                             const BlockOptions& options) const {
  Factory fn;
  {
    blockflow::detail::MutexLock lock(&mu_);
    auto it = factories_.find(factory);
    if (it != factories_.end()) fn = it->second;
  }
  if (!fn) {
    return absl::NotFoundError(fmt::format("block '{}': no factory '{}' is registered (known: {})", name, factory,
                                           fmt::join(names(), ", ")));
  }
  try {
    auto block = fn(name, options);
    if (!block) return absl::InternalError(fmt::format("block '{}': factory '{}' returned null", name, factory));
    // The session routes, queues, batches and checks by the description: a block that says
    // otherwise would be run by rules it does not follow.
    if (block->name() != name) {
      return absl::InvalidArgumentError(fmt::format("block '{}': factory '{}' made a block named '{}' (a factory names "
                                                    "its block with the name it is given)", name, factory, block->name()));
    }
    if (const char* field = first_difference(block->options(), options)) {
      return absl::InvalidArgumentError(fmt::format("block '{}': factory '{}' made it with another {} than its description's "
                                                    "(a factory passes the options it is given on to its block)",
                                                    name, factory, field));
    }
    return block;
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(fmt::format("block '{}': factory '{}' failed: {}", name, factory, e.what()));
  } catch (...) {  // `throw 42;`, another library's own type: a failed block, never the process's end
    return absl::InvalidArgumentError(
        fmt::format("block '{}': factory '{}' failed: {}", name, factory, detail::current_exception_text()));
  }
}

absl::StatusOr<std::shared_ptr<Block>> make_block(const BlockDescription& d) {
  if (d.torchscript.empty() == d.factory.empty()) {
    return absl::InvalidArgumentError(
        fmt::format("block '{}': set exactly one of torchscript (a file) and factory (a registered name)", d.name));
  }
  if (auto status = validate(d.name, d.options); !status.ok()) return status;
  if (d.options.cuda_graph) {
    if (auto status = detail::cuda_graphs_available(); !status.ok()) {
      return absl::Status(status.code(), fmt::format("block '{}': {}", d.name, std::string(status.message())));
    }
  }
  // The boundary of the Status API: nothing libtorch or a factory throws gets past it.
  try {
    auto block = !d.torchscript.empty() ? load_torchscript_block(d.name, d.torchscript, d.options, d.torchscript_options)
                                        : BlockRegistry::global().create(d.factory, d.name, d.options);
    if (!block.ok() || !d.options.cuda_graph) return block;
    return detail::make_cuda_graph_block(*std::move(block));
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(fmt::format("block '{}': {}", d.name, e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(fmt::format("block '{}': {}", d.name, e.what()));
  } catch (...) {
    return absl::InvalidArgumentError(fmt::format("block '{}': {}", d.name, detail::current_exception_text()));
  }
}

absl::Status load_plugin(const std::string& path) {
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) return absl::NotFoundError(fmt::format("plugin '{}': {}", path, ::dlerror()));
  using RegisterFn = void (*)(BlockRegistry&);
  auto fn = reinterpret_cast<RegisterFn>(::dlsym(handle, "blockflow_register_blocks"));
  if (fn == nullptr) return absl::NotFoundError(fmt::format("plugin '{}' does not export blockflow_register_blocks", path));
  try {
    fn(BlockRegistry::global());
  } catch (...) {  // a Status function: whatever the plugin throws is its refusal, named
    return absl::InvalidArgumentError(
        fmt::format("plugin '{}': blockflow_register_blocks threw: {}", path, detail::current_exception_text()));
  }
  return absl::OkStatus();
}

}  // namespace blockflow
