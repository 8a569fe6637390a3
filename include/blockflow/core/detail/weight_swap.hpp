#pragma once
// Internal: paging a loaded block's weights out to a file and back in (SessionOptions::swap,
// docs/memory.md "Swapping"), so that a block evicted under a memory budget comes back in a few
// milliseconds instead of being rebuilt from its TorchScript file.
//
// While a WeightSwap::Capture lives on a thread, every allocation of at least one page that this
// thread makes through libtorch's CPU allocator (tensors, and oneDNN's packed weights, which libtorch
// allocates through it too) gets a mapping of its own. The block's load runs under one, so what the
// loaded module keeps (its weights) lives in those mappings. swap_out() writes them to an unlinked
// file once and maps each one onto its copy (private, so a later write only changes this process's
// page), then drops their pages: the process's resident memory falls by their size, and the memory
// stays valid (an access reads it back from the file). Pages written since the last swap_out() are
// found in /proc/self/pagemap and saved before their pages are dropped. swap_in() faults the pages
// back in before the block runs, so the reload is timed as a load, not as compute.
//
// Allocations of other threads, smaller ones, and those made outside a Capture go to the allocator
// that was installed before (libtorch's own, unless the application set one).

#include <absl/status/status.h>

#include <cstdint>
#include <memory>
#include <string>

namespace blockflow {
class Block;
}

namespace blockflow::detail {

/// False for a block some of whose memory libtorch's CPU allocator does not give, so that swapping
/// it out would leave that memory resident: a TorchScript module holding prepacked weights that
/// their library allocates itself (quantized: fbgemm, qnnpack; XNNPACK). Such a block is freed and
/// rebuilt instead.
/// Defined with the TorchScript block.
bool swaps_whole(const Block& block);

class WeightSwap {
 public:
  struct Options {
    /// Where the file goes: "" is $TMPDIR, else /var/tmp.
    std::string directory;
    /// swap_out() also drops the file's pages from the page cache, so swap_in() reads the disk.
    bool drop_page_cache = false;
  };

  /// `owner` names the block in errors and logs.
  WeightSwap(std::string owner, Options options);
  ~WeightSwap();
  WeightSwap(const WeightSwap&) = delete;
  WeightSwap& operator=(const WeightSwap&) = delete;

  /// Whether capturing works in this process: false when an allocator of a priority above 100
  /// holds libtorch's CPU slot (then blocks are rebuilt instead). Installed once, in front of the
  /// allocator there (a worker's shared-memory slot allocator, installed later, goes in front of it).
  static bool available();

  /// Captures this thread's allocations of a page or more into `swap` while it lives (nests).
  class Capture {
   public:
    explicit Capture(WeightSwap& swap);
    ~Capture();
    Capture(const Capture&) = delete;
    Capture& operator=(const Capture&) = delete;

   private:
    void* previous_;
  };

  /// Stops this thread's capture while it lives (a block's warm-up: its activations are not weights).
  class Pause {
   public:
    Pause();
    ~Pause();
    Pause(const Pause&) = delete;
    Pause& operator=(const Pause&) = delete;

   private:
    void* previous_;
  };

  /// Bytes of captured memory still allocated (whole pages).
  [[nodiscard]] std::int64_t bytes() const;
  /// Of those, the bytes whose pages are in this process's resident set now (/proc/self/pagemap).
  [[nodiscard]] std::int64_t resident_bytes() const;
  /// Saves what changed since the last call (all of it the first time) to the file and drops the
  /// pages. On an error (the file cannot be made or written, naming the block) nothing was
  /// dropped that was not saved.
  absl::Status swap_out();
  /// Brings the pages back into the resident set. An error (the file cannot be read) names the
  /// block; the memory must not be used then.
  absl::Status swap_in();

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace blockflow::detail
