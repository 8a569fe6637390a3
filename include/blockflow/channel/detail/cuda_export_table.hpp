#pragma once
// Internal: the table of CUDA allocations this process exported over CUDA IPC (plain host code:
// it builds, and is tested, without CUDA).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace blockflow::detail {

/// The allocations this process exported (CudaProducer::share), by their CUDA IPC memory handle, so
/// that a handle naming one can come back here (a worker returned a view of its input). An entry is
/// live while a share of its allocation is unreleased: remember() returns a token that the share
/// holds until the consumer releases it (a handle naming the allocation can only come back while one
/// is out). Once the table holds `bound` entries, a new one first evicts the released ones; when all
/// are live the bound doubles instead: a live export is never dropped. Thread-safe.
class CudaExportTable {
 public:
  struct Allocation {
    void* base = nullptr;
    std::uint64_t bytes = 0;
  };
  explicit CudaExportTable(std::size_t bound = 4096);
  ~CudaExportTable();
  CudaExportTable(const CudaExportTable&) = delete;
  CudaExportTable& operator=(const CudaExportTable&) = delete;

  /// Records the allocation that `key` (the IPC handle's bytes) names; keep the token while a
  /// handle naming it is out. A live entry's token is shared: the entry lives until the last dies.
  [[nodiscard]] std::shared_ptr<void> remember(const std::string& key, Allocation allocation);
  /// The allocation `key` names while live; nullopt when never exported or every share of it was
  /// released (its memory may be reused).
  [[nodiscard]] std::optional<Allocation> find(const std::string& key) const;
  [[nodiscard]] std::size_t size() const;   ///< entries held, released ones not yet evicted included
  [[nodiscard]] std::size_t bound() const;  ///< the size at which remember() evicts (or grows)

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace blockflow::detail
