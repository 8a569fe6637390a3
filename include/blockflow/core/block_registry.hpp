#pragma once
/// @file
/// @brief Blocks described by data (a TorchScript file or a registered C++ factory), so that a
/// session can build them in its own threads or ship the description to a worker process.

#include <blockflow/core/block.hpp>
#include <blockflow/core/torchscript_block.hpp>

#include <absl/status/statusor.h>
#include <blockflow/core/detail/mutex.hpp>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace blockflow {

/// @brief What a block is and where it runs. Exactly one of `torchscript` and `factory` is set.
struct BlockDescription {
  std::string name;
  std::string torchscript;  ///< path of a TorchScript file
  std::string factory;      ///< name of a factory in the BlockRegistry
  BlockOptions options;
  /// How the TorchScript file is prepared (freeze, optimize_for_inference); JSON keys "freeze" and
  /// "optimize_for_inference".
  TorchScriptOptions torchscript_options;
  /// Empty: the session's own threads. Otherwise the name of a site (e.g. a worker process) added
  /// with Session::add_site().
  std::string placement;
};

/// @brief Factories of C++ blocks by name. Worker processes build C++ blocks through it: a plugin
/// library exports `extern "C" void blockflow_register_blocks(blockflow::BlockRegistry&)`, which the
/// worker calls after dlopen() (see WorkerOptions::plugins). Thread-safe.
///
/// @code
/// extern "C" void blockflow_register_blocks(blockflow::BlockRegistry& registry) {
///   registry.add("scale2", [](const std::string& name, const blockflow::BlockOptions& options) {
///     return blockflow::Block::callable(name, scale2_fn, options);
///   });
/// }
/// @endcode
class BlockRegistry {
 public:
  using Factory = std::function<std::shared_ptr<Block>(const std::string& name, const BlockOptions& options)>;

  /// @brief The process-wide registry.
  static BlockRegistry& global();

  /// @brief Adds or replaces a factory.
  void add(const std::string& factory, Factory fn);
  [[nodiscard]] bool contains(const std::string& factory) const;
  [[nodiscard]] std::vector<std::string> names() const;
  /// @brief Builds a block; NotFound names the factory and lists the known ones; InvalidArgument
  /// when the factory made a block of another name, or with other options than it was given.
  [[nodiscard]] absl::StatusOr<std::shared_ptr<Block>> create(const std::string& factory, const std::string& name,
                                                               const BlockOptions& options) const;

 private:
  mutable blockflow::detail::Mutex mu_;
  std::map<std::string, Factory> factories_ ABSL_GUARDED_BY(mu_);
};

/// @brief Builds the block a description names, in this process (TorchScript file or factory of the
/// global registry). Errors name the block.
absl::StatusOr<std::shared_ptr<Block>> make_block(const BlockDescription& description);

/// @brief dlopen()s a plugin library and calls its `blockflow_register_blocks(BlockRegistry::global())`.
/// NotFound naming the library when it cannot be opened or lacks that function.
absl::Status load_plugin(const std::string& path);

}  // namespace blockflow
