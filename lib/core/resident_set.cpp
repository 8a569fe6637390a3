// On-demand residency under a memory budget (include/blockflow/core/detail/resident_set.hpp).
#include <blockflow/core/detail/clock.hpp>
#include <blockflow/core/detail/exception_text.hpp>
#include <blockflow/core/detail/cuda_graph_block.hpp>
#include <blockflow/core/detail/units.hpp>
#include <blockflow/core/detail/log.hpp>
#include <blockflow/core/detail/resident_set.hpp>

#include <fmt/format.h>

#if defined(__GLIBC__)
#include <blockflow/core/detail/sanitizer.hpp>
#endif

#include <algorithm>
#include <utility>

namespace blockflow::detail {
namespace {

struct ChangeSince {
  const std::uint64_t* generation;
  std::uint64_t seen;
};
bool changed(ChangeSince* c) { return *c->generation != c->seen; }

// Frees unloaded blocks (their last references) and hands the memory back to the system: a
// module's smaller tensors come from malloc's heap, which keeps freed memory unless trimmed, and
// the budget is about resident memory.
void trim_heap() { sanitizer::trim_malloc_heap(); }

void free_blocks(std::vector<std::shared_ptr<Block>>& blocks) {
  if (blocks.empty()) return;
  blocks.clear();
  trim_heap();
}

}  // namespace

struct ResidentSet::Entry {
  int id = -1;
  std::string name;
  std::int64_t footprint = 0;
  Loader loader;
  std::function<bool()> queued;
  bool swappable = false;
  std::shared_ptr<Block> block;  // null while not loaded
  // Swapping: the memory the block's last build captured (null: none, or not swappable), and the
  // block while its weights are paged out. Both belong to the thread that set `loading` while it
  // is set, and to mu_ otherwise.
  std::shared_ptr<WeightSwap> swap;
  std::shared_ptr<Block> parked;
  std::int64_t swap_bytes = 0;   // swap->bytes(), as last seen
  bool loading = false;
  bool prefetch_posted = false;  // want_prefetch() said yes; prefetch() has not run yet
  bool retired = false;          // removed by an update: never loaded again
  bool claimed = false;          // the first waiting load will unload it: no new holds
  int holders = 0;
  int askers = 0;                // hold() calls inside their loop (they keep a pointer to it)
  std::uint64_t loads = 0, evictions = 0;
  std::int64_t last_use_ns = 0;
  // Its last load: when it ended, and what it took. A running block is claimed only once it has
  // been loaded that long, so that a load under contention serves more than the request that made it.
  std::int64_t loaded_ns = 0, load_cost_ns = 0;
};

ResidentSet::Hold::Hold(Hold&& other) noexcept
    : set_(std::exchange(other.set_, nullptr)), id_(other.id_), block_(std::move(other.block_)), loaded_now_(other.loaded_now_) {}

ResidentSet::Hold& ResidentSet::Hold::operator=(Hold&& other) noexcept {
  if (this != &other) {
    reset();
    set_ = std::exchange(other.set_, nullptr);
    id_ = other.id_;
    block_ = std::move(other.block_);
    loaded_now_ = other.loaded_now_;
  }
  return *this;
}

ResidentSet::Hold::~Hold() { reset(); }

void ResidentSet::Hold::reset() {
  // The block goes first (the set keeps it while it is held): the release may unload it, and then
  // frees it there, accounted as unloading until it is freed (kProcess: not growth).
  block_.reset();
  if (set_ != nullptr) std::exchange(set_, nullptr)->release(id_);
}

ResidentSet::ResidentSet(std::int64_t budget_bytes, MemoryProbe probe, std::optional<WeightSwap::Options> swap, bool process)
    : budget_(budget_bytes), probe_(std::move(probe)), process_(process && probe_), baseline_(process_ ? probe_() : 0),
      swap_(std::move(swap)) {
  if (swap_ && !WeightSwap::available()) {  // installs the capturing allocator now, before any block loads
    log(LogLevel::kWarning, "swapping is off: another CPU allocator of a higher priority is installed in libtorch; "
                            "unloaded blocks are built again (SessionOptions::swap)");
  }
}

ResidentSet::~ResidentSet() = default;

int ResidentSet::add(std::string name, std::int64_t footprint, Loader loader, std::function<bool()> queued, bool swappable) {
  auto entry = std::make_unique<Entry>();
  entry->name = std::move(name);
  entry->footprint = std::max<std::int64_t>(0, footprint);
  entry->loader = std::move(loader);
  entry->queued = std::move(queued);
  entry->swappable = swappable && swap_.has_value() && WeightSwap::available();
  MutexLock lock(&mu_);
  const int id = next_id_++;
  entry->id = id;
  entries_.emplace(id, std::move(entry));
  return id;
}

ResidentSet::Entry* ResidentSet::find_locked(int id) const {
  const auto it = entries_.find(id);
  return it == entries_.end() ? nullptr : it->second.get();
}

void ResidentSet::erase_if_done_locked(const Entry& e) {
  // A retired entry nothing holds, loads, pages out or asks for any more: its id is never used
  // again (a late lookup finds none), so the set does not grow with updates.
  if (!e.retired || e.holders > 0 || e.loading || e.askers > 0 || e.block || e.parked) return;
  const int id = e.id;  // not a reference into what the erase destroys
  entries_.erase(id);
}

bool ResidentSet::make_room_locked(std::int64_t need, int except, Evicted& unloaded, const std::vector<int>* keep,
                                   bool partly) {
  std::int64_t free = budget_ - resident_;
  // kProcess: what the process grew by beyond the loaded blocks' footprints takes room too. Only
  // idle blocks are unloaded for it: it is never a reason to wait (see the loop's end).
  // Blocks being paged out or freed (finish()) still hold their memory: not growth.
  // A probe that could not read (0) leaves the last figure; without a baseline there is none.
  if (process_ && baseline_ > 0) {
    if (const std::int64_t rss = probe_(); rss > 0) {
      unaccounted_ = std::max<std::int64_t>(0, rss - baseline_ - resident_ - unloading_);
    }
  }
  const std::int64_t unaccounted = process_ ? unaccounted_ : 0;
  if (need <= free - unaccounted) return true;
  struct Candidate {
    Entry* entry;
    bool queued;
  };
  std::vector<Candidate> candidates;
  for (auto& [i, entry] : entries_) {
    Entry& e = *entry;
    if (i == except || !e.block || e.holders > 0 || e.loading) continue;
    const bool queued = e.queued && e.queued();
    // A prefetch makes room only from idle blocks off the request's path.
    if (keep != nullptr && (queued || std::find(keep->begin(), keep->end(), i) != keep->end())) continue;
    candidates.push_back({&e, queued});
  }
  // Blocks with no request queued first; then those the first waiting load claimed; then the
  // others with requests queued; each least recently used first.
  const auto rank = [](const Candidate& c) { return !c.queued ? 0 : c.entry->claimed ? 1 : 2; };
  std::sort(candidates.begin(), candidates.end(), [&rank](const Candidate& a, const Candidate& b) {
    if (rank(a) != rank(b)) return rank(a) < rank(b);
    return a.entry->last_use_ns < b.entry->last_use_ns;
  });
  std::size_t taken = 0;
  while (free < need && taken < candidates.size()) free += candidates[taken++].entry->footprint;
  if (free < need) {
    if (!partly) return false;  // running blocks hold the rest: wait for one to finish
    // After the fact, and short of room whatever goes: idle blocks only (one with requests queued
    // would load again at once, into the same shortage). They come first in the order.
    while (taken > 0 && candidates[taken - 1].queued) free -= candidates[--taken].entry->footprint;
  }
  // kProcess: for the growth, more idle blocks only (never one with requests queued). A prefetch
  // loads only if that makes the room; otherwise, every idle block taken, the block loads all the
  // same (it fits the budget by the footprints): waiting would not shrink that growth.
  if (free - unaccounted < need) {
    std::size_t more = taken;
    std::int64_t could = free;
    while (could - unaccounted < need && more < candidates.size() && !candidates[more].queued) {
      could += candidates[more++].entry->footprint;
    }
    if (keep != nullptr && could - unaccounted < need) return false;
    taken = more;
    free = could;
  }
  for (std::size_t i = 0; i < taken; ++i) {
    Entry& e = *candidates[i].entry;
    if (e.swap && !swap_failed_.load()) {  // kept, its weights paged out by finish()
      e.parked = std::move(e.block);
      e.loading = true;
      unloaded.parking.push_back(&e);
    } else {  // once a swap file failed, no block is swapped any more: freed, built again
      e.swap.reset();
      e.swap_bytes = 0;
      unloaded.freed.push_back(std::move(e.block));
    }
    e.block = nullptr;
    resident_ -= e.footprint;
    unloading_ += e.footprint;
    unloaded.bytes += e.footprint;
    ++e.evictions;
    ++evictions_;
  }
  ++generation_;
  return true;
}

void ResidentSet::claim_locked(std::int64_t need, int except) {
  std::int64_t room = budget_ - resident_;
  std::vector<Entry*> candidates;
  const std::int64_t now = now_ns();
  for (auto& [i, entry] : entries_) {
    Entry& e = *entry;
    if (i == except || !e.block || e.loading) continue;
    if (e.claimed) {
      room += e.footprint;
    } else if (e.holders == 0 || now - e.loaded_ns >= e.load_cost_ns) {  // a running block: once it paid off its load
      candidates.push_back(&e);
    }
  }
  if (room >= need) return;
  // Idle blocks first (they cannot be held any more once claimed), then running ones; each least
  // recently used first.
  std::sort(candidates.begin(), candidates.end(), [](const Entry* a, const Entry* b) {
    if ((a->holders > 0) != (b->holders > 0)) return a->holders == 0;
    return a->last_use_ns < b->last_use_ns;
  });
  for (Entry* e : candidates) {
    if (room >= need) break;
    e->claimed = true;
    room += e->footprint;
  }
}

void ResidentSet::leave_queue_locked(std::uint64_t ticket) {
  if (ticket == 0) return;
  const auto it = std::find(waiting_.begin(), waiting_.end(), ticket);
  if (it == waiting_.end()) return;
  if (it == waiting_.begin()) {
    for (auto& [i, e] : entries_) e->claimed = false;
  }
  waiting_.erase(it);
  ++generation_;  // the next one's turn
}

absl::StatusOr<ResidentSet::Hold> ResidentSet::hold_named(int id, std::string_view name) {
  auto held = hold(id);
  if (absl::IsFailedPrecondition(held.status()) && held.status().message() == kForgotten) {
    return absl::FailedPreconditionError(fmt::format("block '{}' was removed by an update", name));
  }
  return held;
}

absl::StatusOr<ResidentSet::Hold> ResidentSet::hold(int id) {
  Evicted unloaded;  // finished once the lock is let go
  Entry* entry = nullptr;
  std::int64_t reserved = 0;
  {
    MutexLock lock(&mu_);
    entry = find_locked(id);
    if (entry == nullptr) return absl::FailedPreconditionError(kForgotten);
    // While this call asks, the entry stays (erase_if_done_locked()).
    struct Asking {
      ResidentSet* set;
      Entry* e;
      ~Asking() ABSL_NO_THREAD_SAFETY_ANALYSIS {  // mu_ is held: it lives inside the lock's scope
        --e->askers;
        set->erase_if_done_locked(*e);
      }
    } asking{this, entry};
    ++entry->askers;
    // This load's place among those waiting for room (0: none), given up on every way out of the
    // loop, an exception's included.
    struct Ticket {
      ResidentSet* set;
      std::uint64_t number = 0;
      void leave() ABSL_NO_THREAD_SAFETY_ANALYSIS {  // mu_ is held: the ticket lives inside the lock's scope
        set->leave_queue_locked(std::exchange(number, 0));
      }
      ~Ticket() { leave(); }
    } ticket{this};
    for (;;) {
      if (entry->retired) {
        ticket.leave();
        return absl::FailedPreconditionError(fmt::format("block '{}' was removed by an update", entry->name));
      }
      if (entry->block && !entry->claimed) {
        ticket.leave();
        ++entry->holders;
        entry->last_use_ns = now_ns();
        Hold h;
        h.set_ = this;
        h.id_ = id;
        h.block_ = entry->block;
        return h;
      }
      if (!entry->block && entry->footprint > budget_) {
        ticket.leave();
        return absl::ResourceExhaustedError(fmt::format("block '{}': it takes {:.1f} MB, over the memory budget of {:.1f} MB",
                                                        entry->name, to_mb(entry->footprint), to_mb(budget_)));
      }
      // Not loaded (a claimed block waits to be unloaded, then loads again in its turn): loads that
      // wait for room go in order, the first one claiming its victims.
      if (!entry->block && !entry->loading) {
        const bool first = waiting_.empty() || waiting_.front() == ticket.number;
        if (first && make_room_locked(entry->footprint, id, unloaded)) {
          ticket.leave();
          break;
        }
        if (ticket.number == 0) {
          ticket.number = ++tickets_;
          waiting_.push_back(ticket.number);
        }
        if (waiting_.front() == ticket.number) claim_locked(entry->footprint, id);
      } else if (entry->loading) {
        ticket.leave();  // another load brings it: no room to wait for, no turn to hold up the others
      }
      ChangeSince since{&generation_, generation_};
      (void)mu_.AwaitWithDeadline(absl::Condition(&changed, &since), absl::Now() + absl::Milliseconds(100));
    }
    entry->loading = true;
    reserved = entry->footprint;  // 0 for a block not measured yet: measured below
    resident_ += reserved;
  }
  finish(unloaded);
  return load_reserved(id, *entry, reserved);
}

bool ResidentSet::want_prefetch(int id) {
  MutexLock lock(&mu_);
  Entry* found = find_locked(id);
  if (found == nullptr) return false;
  Entry& e = *found;
  if (e.block) {
    e.last_use_ns = now_ns();  // about to be used: not the one to make room for this request's others
    return false;
  }
  // A block of unknown footprint is measured by a load of its own, never beside another.
  if (e.retired || e.loading || e.prefetch_posted || e.footprint <= 0 || e.footprint > budget_) return false;
  e.prefetch_posted = true;
  return true;
}

void ResidentSet::prefetch(int id, const std::vector<int>& keep) {
  Evicted unloaded;
  Entry* entry = nullptr;
  std::int64_t reserved = 0;
  {
    MutexLock lock(&mu_);
    entry = find_locked(id);
    if (entry == nullptr) return;  // removed by an update
    entry->prefetch_posted = false;
    // Loads waiting for room come first: a prefetch takes none of it.
    if (!waiting_.empty() || entry->retired || entry->block || entry->loading || entry->footprint <= 0 || entry->footprint > budget_ ||
        !make_room_locked(entry->footprint, id, unloaded, &keep)) {
      return;
    }
    entry->loading = true;
    reserved = entry->footprint;
    resident_ += reserved;
    ++prefetches_;
  }
  finish(unloaded);
  (void)load_reserved(id, *entry, reserved);  // the hold goes at once: loaded, idle, just used
}

absl::StatusOr<ResidentSet::Hold> ResidentSet::load_reserved(int id, Entry& slot, std::int64_t reserved) {
  Entry* entry = &slot;
  Evicted unloaded;
  // A block measured by its load: what the load left resident, its transient copies handed back.
  const bool measure = reserved == 0 && probe_;
  if (measure) trim_heap();
  const std::int64_t before = measure ? probe_() : 0;
  const std::int64_t start = now_ns();
  absl::StatusOr<std::shared_ptr<Block>> made = absl::InternalError("not loaded");
  // This thread owns the entry's swap and parked block while it is loading.
  bool swapped_in = false;
  if (std::shared_ptr<Block> parked = std::move(entry->parked)) {
    if (auto status = entry->swap->swap_in(); status.ok()) {
      made = std::move(parked);
      swapped_in = true;
    } else {
      log(LogLevel::kWarning, fmt::format("{}; building the block again", status.ToString()));
      entry->swap.reset();
      parked.reset();
      trim_heap();
    }
  }
  if (!swapped_in) {
    const bool capturing = entry->swappable && !swap_failed_.load();
    std::shared_ptr<WeightSwap> swap;
    try {
      if (capturing) swap = std::make_shared<WeightSwap>(entry->name, *swap_);
      std::optional<WeightSwap::Capture> capture;
      if (swap) capture.emplace(*swap);
      made = entry->loader();
    } catch (...) {  // the entry must leave `loading` whatever the loader throws
      made = absl::InternalError(fmt::format("block '{}': loading failed: {}", entry->name, current_exception_text()));
    }
    if (made.ok() && swap && swap->bytes() > 0 && !swaps_whole(**made)) {
      // Swapped, it would keep the rest resident while counted as unloaded: freed and rebuilt.
      log(LogLevel::kInfo, fmt::format("block '{}' holds memory libtorch's allocator did not give (prepacked weights "
                                       "of fbgemm, qnnpack or XNNPACK): it is freed and built again when unloaded, not "
                                       "swapped", entry->name));
      entry->swappable = false;
      swap.reset();
    }
    entry->swap = made.ok() && swap && swap->bytes() > 0 ? std::move(swap) : nullptr;
    entry->swap_bytes = entry->swap ? entry->swap->bytes() : 0;
  }
  const std::int64_t end = now_ns();
  if (measure) trim_heap();
  // A probe that could not read (0) measures nothing: the footprint stays unknown, and the next
  // load measures again.
  const std::int64_t after = measure && made.ok() && before > 0 ? probe_() : 0;
  // A load that grew nothing (heap already mapped) is known as a page: 0 would mean "unknown", and
  // every later load would measure again, beside whatever else runs then. One that shrank (another
  // lane freed memory meanwhile) measured nothing: unknown still, the next load measures again.
  constexpr std::int64_t kPage = 4096;
  const std::int64_t measured = after <= 0 ? 0 : after > before ? after - before : after == before ? kPage : 0;

  absl::StatusOr<Hold> result = absl::InternalError("not loaded");
  {
    MutexLock lock(&mu_);
    entry->loading = false;
    ++generation_;
    if (entry->retired) entry->loader = nullptr;  // retired while it loaded: never called again
    if (!made.ok()) {
      entry->swap.reset();
      resident_ -= reserved;
      result = made.status();
    } else if (reserved == 0 && measured > budget_) {
      entry->footprint = measured;  // from now on refused at once
      entry->swap.reset();
      unloaded.freed.push_back(std::move(*made));
      result = absl::ResourceExhaustedError(
          fmt::format("block '{}': loading it took {:.1f} MB of resident memory, over the memory budget of {:.1f} MB",
                      entry->name, to_mb(measured), to_mb(budget_)));
    } else {
      if (reserved == 0) {
        // Measured only now: the others make room after the fact, as far as they can.
        entry->footprint = measured;
        resident_ += measured;
        (void)make_room_locked(0, id, unloaded, nullptr, /*partly=*/true);
      }
      entry->block = std::move(*made);
      ++entry->holders;
      ++entry->loads;
      entry->last_use_ns = end;
      entry->loaded_ns = end;
      entry->load_cost_ns = end - start;
      ++loads_;
      if (swapped_in) ++swap_ins_;
      bytes_loaded_ += entry->footprint;
      load_ns_ += end - start;
      Hold h;
      h.set_ = this;
      h.id_ = id;
      h.block_ = entry->block;
      h.loaded_now_ = true;
      result = std::move(h);
    }
    erase_if_done_locked(*entry);  // retired while it loaded, and nothing holds it: forgotten (not used below)
  }
  finish(unloaded);
  return result;
}

void ResidentSet::finish(Evicted& evicted) {
  for (Entry* e : evicted.parking) {
    // This thread owns e->swap and e->parked until `loading` is cleared.
    const absl::Status status = e->swap->swap_out();
    if (!status.ok() && !swap_failed_.exchange(true)) {
      log(LogLevel::kWarning, fmt::format("{}; freeing the block instead, and building unloaded blocks again from now on "
                                          "(SessionOptions::swap)", status.ToString()));
    }
    MutexLock lock(&mu_);
    e->loading = false;
    ++generation_;
    if (!status.ok() || e->retired) {
      e->swap.reset();
      if (e->retired) e->loader = nullptr;
      evicted.freed.push_back(std::move(e->parked));
      erase_if_done_locked(*e);  // e is not used after this
    }
  }
  free_blocks(evicted.freed);
  if (evicted.bytes != 0) {
    MutexLock lock(&mu_);
    unloading_ -= std::exchange(evicted.bytes, 0);
  }
}

void ResidentSet::release(int id) {
  Evicted gone;  // a retired block's last hold frees it
  {
    MutexLock lock(&mu_);
    Entry& e = *find_locked(id);  // held: never erased
    --e.holders;
    e.last_use_ns = now_ns();
    ++generation_;
    if (e.retired) {
      unload_locked(e, gone);
      erase_if_done_locked(e);
    }
  }
  finish(gone);
}

void ResidentSet::unload_locked(Entry& e, Evicted& gone) {
  if (e.loading) return;  // its loader or finish() owns parked and swap now, and frees it if retired
  e.loader = nullptr;     // never loaded again: what it holds (the block's description) goes now
  if (e.parked) {  // paged out: freed for good
    gone.freed.push_back(std::move(e.parked));
    e.swap.reset();
    return;
  }
  if (!e.block || e.holders > 0) return;
  e.swap.reset();
  gone.freed.push_back(std::move(e.block));
  e.block = nullptr;
  resident_ -= e.footprint;
  unloading_ += e.footprint;  // resident until finish() frees it: not growth (kProcess)
  gone.bytes += e.footprint;
  ++generation_;
}

void ResidentSet::retire(int id) {
  Evicted gone;
  {
    MutexLock lock(&mu_);
    Entry* found = find_locked(id);
    if (found == nullptr) return;  // retired and gone already
    Entry& e = *found;
    e.retired = true;
    e.queued = nullptr;  // it reads the block's queue, which goes with the block's runtime
    ++generation_;  // a load waiting for it gives up now
    unload_locked(e, gone);
    erase_if_done_locked(e);
  }
  finish(gone);
}

ResidentSet::BlockState ResidentSet::state(int id) const {
  MutexLock lock(&mu_);
  BlockState s;
  const Entry* found = find_locked(id);
  if (found == nullptr) return s;  // removed by an update
  const Entry& e = *found;
  s.name = e.name;
  s.resident = e.block != nullptr;
  s.claimed = e.claimed;
  s.footprint_bytes = e.footprint;
  s.loads = e.loads;
  s.evictions = e.evictions;
  s.last_use_ns = e.last_use_ns;
  if (e.block) s.cuda_graph = cuda_graph_stats(*e.block);
  return s;
}

ResidentSet::Totals ResidentSet::totals() const {
  MutexLock lock(&mu_);
  Totals t;
  t.budget_bytes = budget_;
  t.resident_bytes = resident_;
  t.unaccounted_bytes = unaccounted_;
  t.loads = loads_;
  t.evictions = evictions_;
  t.bytes_loaded = bytes_loaded_;
  t.load_s = static_cast<double>(load_ns_) * 1e-9;
  t.prefetches = prefetches_;
  t.swap_ins = swap_ins_;
  t.waiting_loads = waiting_.size();
  for (const auto& [i, e] : entries_) {
    if (!e->loading && e->parked) t.swapped_bytes += e->swap_bytes;
  }
  t.entries = entries_.size();
  return t;
}

namespace {

class OnDemandBlock final : public Block {
 public:
  OnDemandBlock(ResidentSet& set, int id, std::string name, BlockOptions options, std::string kind)
      : Block(std::move(name), std::move(options)), set_(set), id_(id), kind_(std::move(kind)) {}
  std::string_view kind() const override { return kind_; }
  absl::StatusOr<Tensors> forward(Tensors&& inputs) override {
    auto hold = set_.hold_named(id_, name());
    if (!hold.ok()) return hold.status();
    return hold->block()->forward(std::move(inputs));
  }

 private:
  ResidentSet& set_;
  const int id_;
  const std::string kind_;
};

}  // namespace

std::shared_ptr<Block> on_demand_block(ResidentSet& set, int id, std::string name, BlockOptions options, std::string kind) {
  return std::make_shared<OnDemandBlock>(set, id, std::move(name), std::move(options), std::move(kind));
}

}  // namespace blockflow::detail
