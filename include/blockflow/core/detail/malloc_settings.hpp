#pragma once
/// @file
/// @brief The glibc malloc settings blocks run under in worker processes
/// (WorkerOptions::environment's default: MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_), as
/// numbers, and a way to give this process the same ones (blockflow-profile does, so that a profile
/// measures a block's allocations as a worker makes them; workers' GOMP_SPINCOUNT is not set here).
///
/// Under glibc's defaults, a block's activation buffers of a few MB are unmapped when freed and
/// faulted back in on the next request: measured on 2 cores (AMD EPYC, one intra-op thread), the
/// ResNet50 split's block1 took 9.7-10.4 ms per call at batch 1 in a fresh process, 7.1 ms with
/// these settings.
#include <blockflow/core/detail/sanitizer.hpp>
#include <blockflow/core/kpi.hpp>

#include <cstdint>
#include <string>
#include <vector>

#if defined(__GLIBC__)  // defined by the headers above
#include <malloc.h>
#endif

namespace blockflow::detail {

/// Allocations below this many bytes come from the heap, not from mmap (glibc's maximum).
inline constexpr std::int64_t kMallocMmapThreshold = 33554432;
/// The heap keeps up to this many freed bytes at its top instead of giving them back.
inline constexpr std::int64_t kMallocTrimThreshold = 1073741824;

/// @brief This process's resident memory with the heap that freed allocations left handed back
/// first (malloc_trim): how blockflow-profile measures a block, and what sessions and workers
/// compare with those profiles after loading.
inline std::int64_t settled_rss_bytes() {
  sanitizer::trim_malloc_heap();
  return sample_process().rss_bytes;
}

/// @brief The same settings as environment variables, for a child process (glibc reads them at start).
inline std::vector<std::string> worker_malloc_environment() {
  return {"MALLOC_MMAP_THRESHOLD_=" + std::to_string(kMallocMmapThreshold),
          "MALLOC_TRIM_THRESHOLD_=" + std::to_string(kMallocTrimThreshold)};
}

/// @brief Gives this process those settings (mallopt); false where one was not applied: glibc
/// refused it, there is no glibc, or the heap is AddressSanitizer's (whose mallopt does nothing).
inline bool use_worker_malloc_settings() {
#if defined(__SANITIZE_ADDRESS__) || !defined(__GLIBC__)
  return false;
#else
  const bool mmap = mallopt(M_MMAP_THRESHOLD, static_cast<int>(kMallocMmapThreshold)) == 1;
  const bool trim = mallopt(M_TRIM_THRESHOLD, static_cast<int>(kMallocTrimThreshold)) == 1;
  return mmap && trim;
#endif
}

}  // namespace blockflow::detail
