#pragma once
/// @file
/// @brief Result of a request and the trace of where its time went.

#include <blockflow/core/tensor.hpp>

#include <absl/status/status.h>

#include <cstdint>
#include <string>
#include <vector>

namespace blockflow {

/// @brief Timestamps (steady clock, ns) of one node visit. The reference's decomposition:
/// wait = queued at the block; load = loading the block for it (SessionOptions::MemoryPolicy
/// kOnDemand; 0 otherwise); compute = forward(); overhead = everything else the hop costs
/// (hand-off into the queue, dispatch, device move, routing to the next block).
struct HopTiming {
  std::string node;               ///< node name (the block's name for block nodes)
  std::string block;              ///< empty for a join node
  std::int64_t input_ready_ns = 0;  ///< the predecessor handed its output on (or submit time)
  std::int64_t arrived_ns = 0;      ///< reached this block's queue (a full one: began waiting for room)
  std::int64_t dequeued_ns = 0;     ///< a worker took it
  std::int64_t compute_start_ns = 0;
  std::int64_t compute_end_ns = 0;
  std::int64_t done_ns = 0;         ///< output handed to the next node (or the request resolved)
  /// Loading the block for this request, between dequeued_ns and compute_start_ns (both 0: no load).
  std::int64_t load_start_ns = 0;
  std::int64_t load_end_ns = 0;
  /// Time the request waited at its task's entry window before it started (an entry node's hop
  /// only; SessionOptions::max_in_flight_per_task). Part of wait_ms(); input_ready_ns is then when
  /// it started.
  std::int64_t entry_wait_ns = 0;

  [[nodiscard]] double wait_ms() const;
  [[nodiscard]] double load_ms() const;
  [[nodiscard]] double compute_ms() const;
  [[nodiscard]] double overhead_ms() const;
};

/// @brief Where one request's time went, along its critical path (for a chain: every hop).
/// For a resolved request, wait + load + compute + overhead summed over `hops` equals e2e_ms().
struct RequestTrace {
  std::uint64_t request_id = 0;
  std::string task;
  std::int64_t submitted_ns = 0;
  std::int64_t resolved_ns = 0;
  std::vector<HopTiming> hops;  ///< critical path, in order; empty for a failed request

  [[nodiscard]] double e2e_ms() const;
  [[nodiscard]] double wait_ms() const;
  [[nodiscard]] double load_ms() const;
  [[nodiscard]] double compute_ms() const;
  [[nodiscard]] double overhead_ms() const;
};

/// @brief What a submitted request resolves to, exactly once: outputs, or an error status whose
/// message names the block (or path) and the cause.
struct Result {
  absl::Status status;
  Tensors outputs;
  RequestTrace trace;

  [[nodiscard]] bool ok() const { return status.ok(); }
  /// @brief The first output tensor; throws std::logic_error with the status if !ok().
  [[nodiscard]] const Tensor& output() const;
};

}  // namespace blockflow
