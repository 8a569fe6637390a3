#pragma once
// Internal: which of a site's blocks are loaded, under a memory budget (SessionOptions::memory_policy
// kOnDemand, docs/memory.md). A block is loaded when a request needs it; to make room, idle blocks
// are unloaded, least recently used first. A block that is running (held) is never unloaded; one with
// requests queued only when no idle block is left to unload (the site could not go on otherwise).
// Loads that wait for room are served in order, and the first of them claims its victims: a claimed
// block takes no new holds, so it is free once its running holds end, however busy it is.
// With swapping (SessionOptions::swap), a swappable block's load captures the memory it allocates
// (WeightSwap): unloading it pages that memory out to a file and keeps the block, and loading it
// again pages it back in instead of building it anew.

#include <blockflow/core/block.hpp>
#include <blockflow/core/detail/mutex.hpp>
#include <blockflow/core/detail/weight_swap.hpp>

#include <absl/status/statusor.h>
#include <absl/strings/string_view.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace blockflow::detail {

class ResidentSet {
 public:
  /// Builds the block (and warms it up): what a load is.
  using Loader = std::function<absl::StatusOr<std::shared_ptr<Block>>()>;
  /// The resident memory of this process, in bytes: a block of unknown footprint is measured by it
  /// across its first load.
  using MemoryProbe = std::function<std::int64_t()>;

  /// hold()'s message for an id the set has forgotten (a removed block): callers add the name.
  static constexpr absl::string_view kForgotten = "the block was removed by an update";

  /// A loaded block, kept loaded while the Hold lives. Move-only.
  class Hold {
   public:
    Hold() = default;
    Hold(Hold&& other) noexcept;
    Hold& operator=(Hold&& other) noexcept;
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;
    ~Hold();
    [[nodiscard]] Block* block() const { return block_.get(); }
    [[nodiscard]] bool loaded_now() const { return loaded_now_; }  ///< this hold paid for a load
    void reset();

   private:
    friend class ResidentSet;
    ResidentSet* set_ = nullptr;
    int id_ = -1;
    std::shared_ptr<Block> block_;
    bool loaded_now_ = false;
  };

  /// One block's residency, as metrics report it.
  struct BlockState {
    std::string name;
    bool resident = false;
    bool claimed = false;  ///< the first waiting load will unload it (it takes no new hold)
    std::int64_t footprint_bytes = 0;  ///< profiled, or measured at its first load (0: not yet known)
    std::uint64_t loads = 0, evictions = 0;
    std::int64_t last_use_ns = 0;       ///< steady clock; 0: never used
    /// The loaded block's CUDA-graph counters (BlockOptions::cuda_graph), since its last load.
    std::optional<CudaGraphStats> cuda_graph;
  };
  struct Totals {
    std::int64_t budget_bytes = 0;
    std::int64_t resident_bytes = 0;  ///< the footprints of the blocks loaded now
    /// kProcess: the process's growth beyond the loaded blocks' footprints, as last sampled.
    std::int64_t unaccounted_bytes = 0;
    std::uint64_t loads = 0, evictions = 0;
    std::int64_t bytes_loaded = 0;
    double load_s = 0;                ///< time spent loading
    std::uint64_t prefetches = 0;     ///< loads made ahead of their requests (prefetch())
    std::uint64_t swap_ins = 0;       ///< loads that paged a block's weights back in (swapping)
    std::int64_t swapped_bytes = 0;   ///< the weights of unloaded blocks that wait in swap files
    std::size_t waiting_loads = 0;    ///< loads waiting for room now (hold())
    std::size_t entries = 0;          ///< blocks it keeps track of (a removed one goes once nothing uses it)
  };

  /// `swap`: unloading pages a swappable block's weights out to a file (WeightSwap) instead of
  /// freeing the block; none: unloading frees it, and loading builds it anew. `process`: the budget
  /// also bounds what `probe` shows grown since now beyond the loaded blocks' footprints
  /// (SessionOptions::MemoryMeasure::kProcess): room is made for it too, as far as idle blocks allow.
  ResidentSet(std::int64_t budget_bytes, MemoryProbe probe, std::optional<WeightSwap::Options> swap = std::nullopt,
              bool process = false);
  ~ResidentSet();
  ResidentSet(const ResidentSet&) = delete;
  ResidentSet& operator=(const ResidentSet&) = delete;

  /// Registers a block, not loaded; returns its id. `footprint` 0: measured at its first load.
  /// `queued`: whether requests wait for it. `swappable`: its memory is what libtorch's CPU
  /// allocator gives it (a TorchScript module on the CPU), so swapping may page it out.
  int add(std::string name, std::int64_t footprint, Loader loader, std::function<bool()> queued, bool swappable = false);
  /// Loads the block if it is not (making room first), and keeps it loaded until the Hold goes.
  /// Waits while the loaded blocks that are running leave too little room: such loads wait in the
  /// order they came, and the first one claims the blocks it will unload (a hold on a claimed block
  /// waits until it is unloaded, then loads it again in its turn). A thread must not hold one block
  /// while it asks for another. The error of a failed load names the block; ResourceExhausted for a
  /// block whose footprint exceeds the whole budget.
  absl::StatusOr<Hold> hold(int id);
  /// hold(), except that a forgotten id's error names the block: "block '<name>' was removed by an
  /// update" (FailedPrecondition); other errors as they are.
  absl::StatusOr<Hold> hold_named(int id, std::string_view name);
  /// Prefetching (SessionOptions::prefetch): true, once until prefetch() runs, when block `id` is
  /// worth loading ahead (not loaded, not loading, of known footprint). A loaded one counts as used
  /// now, so that loads for the same request evict others first.
  bool want_prefetch(int id);
  /// Loads block `id` ahead of its requests when room can be made without waiting, from idle blocks
  /// (no queued requests) that are not in `keep` (the request's path); otherwise does nothing.
  void prefetch(int id, const std::vector<int>& keep);
  /// The block was removed by an update: unloaded now, or when its last hold goes; never loaded
  /// again (hold() returns FailedPrecondition naming it); its `queued` function is dropped (it may
  /// read a queue that is about to be freed). Once nothing holds, loads or asks for it, the set
  /// forgets it: its id finds nothing (hold(): FailedPrecondition, no longer naming it; state(): an
  /// empty BlockState; prefetch(), retire(): nothing).
  void retire(int id);

  [[nodiscard]] std::int64_t budget() const { return budget_; }
  [[nodiscard]] BlockState state(int id) const;
  [[nodiscard]] Totals totals() const;

 private:
  struct Entry;
  // What make_room_locked() unloaded, finished once mu_ is let go (finish()): blocks to free, and
  // entries whose weights page out (Entry::parked; loading until that is done).
  struct Evicted {
    std::vector<std::shared_ptr<Block>> freed;
    std::vector<Entry*> parking;
    std::int64_t bytes = 0;  // their footprints (in unloading_ until finished)
  };
  void finish(Evicted& evicted);
  void release(int id);
  // A retired block: unloaded now unless it is held or loading (into `gone`, for finish()).
  void unload_locked(Entry& e, Evicted& gone) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Picks blocks to unload so that `need` more bytes fit (idle ones first, least recently used
  // first; then ones with queued requests); false when the running ones leave too little room.
  // `keep` (a prefetch): only idle blocks not listed there. `partly` (a load measured after the
  // fact): what can go goes, even when that leaves too little room.
  bool make_room_locked(std::int64_t need, int except, Evicted& unloaded, const std::vector<int>* keep = nullptr,
                        bool partly = false) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The first waiting load (make_room_locked() said no): claims loaded blocks, idle ones first, then
  // running ones (each once it has been loaded as long as its load took) least recently used first, until unloading them all would make `need` fit. Claims
  // only grow until that load leaves the queue (leave_queue_locked()).
  void claim_locked(std::int64_t need, int except) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A waiting load is served or gives up: out of the queue; the first one's claims end with it.
  void leave_queue_locked(std::uint64_t ticket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Loads a block whose room (`reserved`, 0 when its footprint is measured now) is taken, and holds it.
  absl::StatusOr<Hold> load_reserved(int id, Entry& entry, std::int64_t reserved);

  const std::int64_t budget_;
  const MemoryProbe probe_;
  const bool process_;              // the budget bounds the process's growth too (kProcess)
  const std::int64_t baseline_;     // probe_() when made: the growth is over it (kProcess; 0: unread, none counted)
  const std::optional<WeightSwap::Options> swap_;
  std::atomic<bool> swap_failed_{false};  // a swap file could not be written: unloaded blocks are freed from then on
  mutable Mutex mu_;
  std::uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;  // +1 whenever a block is released, loaded or unloaded
  std::deque<std::uint64_t> waiting_ ABSL_GUARDED_BY(mu_);  // tickets of the loads waiting for room, first first
  std::uint64_t tickets_ ABSL_GUARDED_BY(mu_) = 0;
  Entry* find_locked(int id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);  // nullptr: none (forgotten)
  void erase_if_done_locked(const Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::map<int, std::unique_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  int next_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t resident_ ABSL_GUARDED_BY(mu_) = 0;  // footprints of loaded blocks and of loads under way
  std::int64_t unaccounted_ ABSL_GUARDED_BY(mu_) = 0;  // kProcess: growth beyond resident_, last sampled
  std::int64_t unloading_ ABSL_GUARDED_BY(mu_) = 0;    // footprints of unloads not finished yet
  std::uint64_t loads_ ABSL_GUARDED_BY(mu_) = 0, evictions_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t bytes_loaded_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t load_ns_ ABSL_GUARDED_BY(mu_) = 0;
  std::uint64_t prefetches_ ABSL_GUARDED_BY(mu_) = 0;
  std::uint64_t swap_ins_ ABSL_GUARDED_BY(mu_) = 0;
};

/// The Block a session keeps for a block of `set` (its name, options, device and `kind`): forward()
/// holds the block loaded for the call. The session's lanes call ResidentSet::hold() themselves, to
/// time the load apart from the compute.
std::shared_ptr<Block> on_demand_block(ResidentSet& set, int id, std::string name, BlockOptions options, std::string kind);

}  // namespace blockflow::detail
