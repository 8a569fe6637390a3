#pragma once
/// @file
/// @brief Block profiles: what one block costs on this machine (latency per batch size, the highest
/// rate it sustains, memory, load time, output bytes) and what each channel costs per hand-off,
/// measured by profile_block() and profile_channels() and kept as a versioned JSON document
/// (docs/profile.md). The planner (a later part of this layer) places blocks from these figures.
///
/// @code
/// blockflow::BlockDescription d;
/// d.name = "block1";
/// d.torchscript = "models/block1.pt";
/// d.options.intra_op_threads = 2;
/// d.options.input_shapes = {{1, 3, 224, 224}};
/// auto profile = blockflow::profile_block(d);   // ~2-10 s for a ResNet50 stage
/// @endcode
///
/// Figures are taken in this process: run the profiler in a process of its own (the
/// `blockflow-profile` tool) and not next to a busy session, or the neighbours' load is measured too.

#include <blockflow/core/block.hpp>
#include <blockflow/core/block_registry.hpp>

#include <absl/status/statusor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace blockflow {

/// @brief The profile document's schema version (docs/profile.md, "Versioning").
inline constexpr int kProfileVersion = 1;

/// @brief How to profile.
struct ProfileOptions {
  /// Batch sizes to time (dimension 0 of every input scaled by it); timed and listed in increasing
  /// order, each once, whatever order they are given in.
  std::vector<int> batch_sizes = {1, 2, 4, 8};
  /// Timed forward passes per batch size, after `warmup` untimed ones, in two rounds over the batch
  /// sizes (half each; the round with the lower p50 is kept; one round with `quick`).
  int iterations = 30;
  int warmup = 3;
  /// Fewer iterations (8), 1 warm-up and a shorter rate sweep (0.7, 0.95, 1.1, then +10% steps of
  /// about 0.3 s while bounded): for tests and a first look.
  bool quick = false;
  /// The open-loop rate sweep (docs/profile.md, "Rate sweep"). Off: `max_rate_rps` stays 0 (the
  /// planner then uses the batch-1 service rate, 1000 / p50): latencies only, e.g. to re-measure a
  /// machine's speed against an earlier profile in a few seconds.
  bool rate_sweep = true;
  /// Progress lines ("block1: batch 4: p50 31.2 ms"), e.g. to stderr. May be empty.
  std::function<void(std::string_view)> progress;
};

/// @brief Latency of one forward pass at one batch size.
struct BatchLatency {
  int batch = 1;
  double p50_ms = 0;
  double p99_ms = 0;
};

/// @brief What one block costs (one entry of a profile).
struct BlockProfile {
  std::string name;
  std::string source;  ///< the TorchScript file or the factory name ("" for a block given as an object)
  std::string device = "cpu";
  int intra_op_threads = 0;
  std::vector<std::vector<std::int64_t>> input_shapes;  ///< at batch 1
  std::vector<at::ScalarType> input_dtypes;              ///< as BlockOptions::input_dtypes (empty: float32)
  double load_ms = 0;    ///< making the block (reading, freezing, optimising a TorchScript file)
  double warmup_ms = 0;  ///< the first forward passes, before the timed ones
  /// Resident memory the block added to the process: RSS after loading and warming up minus RSS
  /// before (CPU). Allocator caches of the warm-up's activations count: they stay with the process.
  std::int64_t memory_bytes = 0;
  std::vector<BatchLatency> latency;  ///< one per batch size, in ProfileOptions order
  /// The highest arrival rate (requests/s, batch 1, arrivals evenly spaced) at which the block's
  /// queue stays bounded: an open-loop sweep around 1 / p50 (docs/profile.md, "Rate sweep"). 0: not
  /// measured (ProfileOptions::rate_sweep off).
  double max_rate_rps = 0;
  std::uint64_t output_bytes = 0;  ///< bytes of the outputs of one request (batch 1)
  std::vector<std::vector<std::int64_t>> output_shapes;  ///< at batch 1 (the next block's input in a chain)

  /// @brief The latency at `batch`, or nullptr when it was not measured.
  [[nodiscard]] const BatchLatency* at_batch(int batch) const;
  /// @brief Whether `source` is a TorchScript file: a path (the profiler writes absolute ones: any
  /// name, .pt, .pth, .torchscript) or a bare "x.pt"; a factory's name has no '/' (check_name()).
  [[nodiscard]] bool from_file() const;
};

/// @brief The cost of one hand-off over a channel kind on this machine: fixed_us + us_per_mb x MB.
struct ChannelCost {
  std::string kind;  ///< "inproc", "shm", "zmq-ipc"
  double fixed_us = 0;
  double us_per_mb = 0;
};

/// @brief A profile document: the machine, the blocks, the channels.
struct Profile {
  int version = kProfileVersion;
  std::string cpu;           ///< the CPU model, as /proc/cpuinfo names it
  int hardware_threads = 0;
  std::vector<BlockProfile> blocks;
  std::vector<ChannelCost> channels;

  /// @brief The JSON document (docs/profile.md).
  [[nodiscard]] std::string to_json(int indent = 2) const;
  /// @brief Parses and checks a profile document. InvalidArgument naming `source` (a file name, for
  /// messages) and the field at fault: not JSON, a missing or mistyped field, a version this build
  /// does not read, a negative figure, batch sizes out of order.
  static absl::StatusOr<Profile> parse(const std::string& json, const std::string& source = "profile");
  /// @brief The block named `name`, or nullptr.
  [[nodiscard]] const BlockProfile* block(std::string_view name) const;
};

/// @brief Reads a profile file (errors name the file).
absl::StatusOr<Profile> load_profile(const std::string& file);

/// @brief Profiles `block` fed with `inputs` (its batch-1 inputs) on a thread of its own that sets
/// `block.options().intra_op_threads`. load_ms and memory_bytes stay 0: the block is already made.
absl::StatusOr<BlockProfile> profile_block(const std::shared_ptr<Block>& block, const Tensors& inputs,
                                           const ProfileOptions& options = {});

/// @brief Makes the block of `description` (timed, with its memory measured) and profiles it on
/// zeros of `description.options.input_shapes` (required; -1 read as 1). Errors name the block.
absl::StatusOr<BlockProfile> profile_block(const BlockDescription& description, const ProfileOptions& options = {});

/// @brief Measures the hand-off cost of the channel kinds this build has, between two threads of
/// this process, at two sizes (64 KiB and 4 MiB): "inproc" (a reference), and with
/// blockflow::channels "shm" (a handle to a slot the producer wrote) and "zmq-ipc" (the wire format
/// through a Unix socket).
absl::StatusOr<std::vector<ChannelCost>> profile_channels(const ProfileOptions& options = {});

}  // namespace blockflow
