#pragma once
// Internal: the shared-memory half of the zero-copy channel (TensorMQ's CPU twin).
//
// A producer owns pools of fixed-size slots in shared memory, created on demand per size class up to
// a byte bound. Each pool is a memfd ("blockflow-<pool id>"), sealed at its size: it has no name
// any process could open, it goes with its last descriptor and mapping (a producer killed leaves
// nothing behind), and no process can shrink it under a consumer. A consumer gets a pool's
// descriptor with the first packet that names it, on the data link (packet_link.hpp), and refuses
// one that is not so sealed. It copies a tensor's bytes into a free
// slot once (stage), or lets the producer write its tensor in a slot it leased (lease, then share:
// no copy at all), and sends a handle (pool, slot, generation, offset) instead of the bytes. The
// consumer maps each pool once, checks the handle against the pool's header (the slot's current
// generation lives in shared memory, so stale and forged handles are caught) and builds its tensor
// over the slot: nothing is copied in the hand-off. When that tensor dies, the consumer sends the
// handle back (a kRelease message) and the slot is free again: free slots are the producer's credits.
// When the consumer dies, reclaim_all() frees every slot it held.
//
// Lifetimes: a pool's memory lives while any process holds its descriptor or a mapping of it. The
// producer lets a pool go when it trims it (idle: ShmPoolOptions::idle_trim) or ends, and marks it
// retired in its header then (a session host marks the pools of a worker that died). A link's
// consumer drops its cached mapping of a retired pool once the link has been seen empty after the
// pool was seen retired (ZeroCopyLink::read(), at most once a second), and all of them with the
// link; tensors still over a pool keep it mapped until they die. A sender that names a retired
// pool (a relay) sends its descriptor again. The pid in a
// pool's id is only a hint for people: pids say nothing across PID namespaces.
//
// Segment layout: a 64-byte header {u32 magic "BFSP", u32 version, u64 pool_id, u64 slot_count,
// u64 slot_bytes, u64 data_offset, u64 retired (0, or 1 once the producer let the pool go), 16
// reserved}, then one atomic u64 generation per slot (0 while the slot is free), then the slots from
// data_offset (page-aligned), slot_bytes each.

#include <blockflow/core/remote_site.hpp>
#include <blockflow/channel/wire_format.hpp>

#include <absl/status/statusor.h>
#include <absl/time/time.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

namespace blockflow::detail {

struct ShmPoolOptions {
  std::size_t slots_per_pool = 4;               ///< slots in each pool (one pool per size class)
  std::size_t min_slot_bytes = std::size_t{1} << 20;  ///< smallest slot; slots are powers of two
  std::size_t max_total_bytes = std::size_t{1} << 30;  ///< bound on all pools of one producer
  std::size_t max_pools = 0;  ///< bound on the number of pools (0: only max_total_bytes bounds them)
  /// A pool whose slots have all been free this long (its size class's trim delay, which starts
  /// here and may grow up to idle_trim_max) is retired and unmapped, unless it is the last of its
  /// size class: a burst of traffic grows the pools, and they shrink back once it has passed
  /// (checked when a slot is taken). Zero: pools stay until the producer goes. Apart from this, a
  /// send that needs a new pool under max_total_bytes (or max_pools) retires idle pools of any
  /// class, the last of a class too, the longest idle first, when that makes the room.
  absl::Duration idle_trim = absl::Seconds(30);
  /// Hysteresis against pools that come and go with every burst: when a size class needs a new
  /// pool within 4 x its trim delay of having lost one, its delay doubles, up to this bound. Bursty
  /// traffic then keeps the pools its bursts need (memory stays at their high-water mark and no
  /// request pays for making a pool again); a lasting drop in traffic still gives them back.
  absl::Duration idle_trim_max = absl::Minutes(8);
};


/// A slot leased to the producer itself (ShmProducer::lease()): it writes its tensor at `data`,
/// then sending that tensor hands the slot over without a copy (ShmProducer::share()). Call `drop`
/// once when the producer's tensor dies; `keep` keeps the pool mapped until then.
struct ShmLease {
  void* data = nullptr;
  wire::ShmHandle handle;
  std::shared_ptr<void> keep;
  std::function<void()> drop;
};

/// Tests only: when set, ShmProducer::stage() calls it with the handle of the slot it reserved, after
/// reserving it and before copying into it, without the pool's lock (so a test can hold a copy in
/// progress and show that the pool stays usable meanwhile). Null by default.
extern std::atomic<void (*)(const wire::ShmHandle&)> shm_stage_copy_hook;
/// Tests only: when set, a producer making a new pool calls it without the pool's lock, before the
/// pool exists (so a test can hold the making and show what other senders do meanwhile).
extern std::atomic<void (*)()> shm_pool_create_hook;

/// The producing side. Thread-safe.
class ShmProducer {
 public:
  explicit ShmProducer(ShmPoolOptions options = {});
  ~ShmProducer();  // retires and unmaps its pools (mappings held by consumers stay valid)
  ShmProducer(const ShmProducer&) = delete;
  ShmProducer& operator=(const ShmProducer&) = delete;

  /// Copies `bytes` bytes into a free slot that fits and returns its handle. Waits for a credit until
  /// `deadline`: DeadlineExceeded then, naming the size and the slots in use; ResourceExhausted when
  /// the tensor can never fit under max_total_bytes. The copy runs without the pool's lock: other
  /// calls (release, share, stats, another stage) proceed meanwhile; the slot is reserved the way a
  /// lease is, so nobody can take, free or reclaim it before its handle is returned.
  absl::StatusOr<wire::ShmHandle> stage(const void* data, std::size_t bytes, absl::Time deadline);
  /// Leases a free slot of at least `bytes` bytes to the producer (same credits and bound as
  /// stage()). The slot is free again once the lease is dropped and every handle shared from it
  /// has been released: the producer must not write it after sending.
  absl::StatusOr<ShmLease> lease(std::size_t bytes, absl::Time deadline);
  /// lease() when a slot is free now (or a pool can still be made for it); nullopt otherwise, at
  /// once and without counting a credit wait.
  std::optional<ShmLease> try_lease(std::size_t bytes);
  /// When `bytes` bytes at `data` lie inside a slot leased by lease(), returns their handle (with
  /// the offset) and counts one more consumer hold; nothing is copied. nullopt otherwise.
  std::optional<wire::ShmHandle> share(const void* data, std::size_t bytes);
  /// Frees the slot of a handle the consumer is done with. False (counted) when it matches no leased
  /// slot: stale, unknown pool or forged.
  bool release(const wire::ShmHandle& handle);
  /// Drops every hold of the consumer (it died): slots nobody else holds are free again. Returns how
  /// many slots the consumer held.
  std::size_t reclaim_all();
  /// The channel is closing: a stage() or lease() waiting for a slot returns Cancelled now, and so
  /// does every later one that would wait.
  void stop_waiting();
  /// The pool's figures, as metrics report them (SiteStats::shm_requests / shm_results).
  ShmEdgeStats stats() const;
  /// Slots the consumer holds now (handles sent, not yet released); unlike stats().slots_in_use,
  /// without the slots only the producer's own tensors hold (a lease not yet sent).
  std::uint64_t held_by_consumer() const;
  /// The address of a handle's bytes in this process (tests).
  const void* address(const wire::ShmHandle& handle) const;

 private:
  struct Impl;
  absl::StatusOr<ShmLease> lease_slot(std::size_t bytes, absl::Time deadline, bool wait);
  std::shared_ptr<Impl> impl_;  // shared with the drop functions of leases
};

/// When `bytes` bytes at `data` lie in a slot of another process's pool that a ShmConsumer of this
/// process has mapped (a tensor received over the shm channel), that slot's handle (with the
/// offset), so the tensor can be handed on without a copy while this process keeps it alive.
/// nullopt otherwise. Thread-safe.
std::optional<wire::ShmHandle> shm_origin(const void* data, std::size_t bytes);

/// A pool's memfd, what keeps it open, and its retired flag (in its header, valid while `keep`
/// lives): `fd` -1 when no pool of that id is mapped here.
struct ShmPoolFd {
  int fd = -1;
  std::shared_ptr<const void> keep;
  const std::atomic<std::uint64_t>* retired = nullptr;
};
/// The descriptor of pool `pool_id`, made here or given to this process, for the data link to send
/// with the first packet that names the pool (a relay hands a given pool on to the next process).
ShmPoolFd shm_pool_fd(std::uint64_t pool_id);

/// The id of a pool from the name of its memfd: "blockflow-" and 16 hex digits, alone or after
/// "memfd:" or "/memfd:" (as /proc/PID/maps shows it). nullopt for any other name.
std::optional<std::uint64_t> shm_pool_id(std::string_view name);
/// The pid of the process that made pool `id` (the id's high 32 bits).
inline std::int64_t shm_pool_producer(std::uint64_t id) { return static_cast<std::int64_t>(id >> 32); }

/// A consumer maps at most this many pools given on one link at a time (a producer's pools are
/// bounded by max_total_bytes: 256 at the defaults; relays add a third process's): a peer cannot make
/// it map memory and hold descriptors without bound.
inline constexpr std::size_t kMaxPoolsPerLink = 512;

/// The consuming side of one link: maps each pool given to it once. Thread-safe.
class ShmConsumer {
 public:
  /// `local_pools`: also resolves handles of this process's own pools, never given (a producer and
  /// its consumer in one process: tests, benchmarks).
  explicit ShmConsumer(bool local_pools = false);
  ~ShmConsumer();
  ShmConsumer(const ShmConsumer&) = delete;
  ShmConsumer& operator=(const ShmConsumer&) = delete;

  struct View {
    void* data = nullptr;        ///< the handle's bytes inside the mapped pool
    std::shared_ptr<void> keep;  ///< keeps the pool mapped
    std::uint64_t pool_bytes = 0;
    const void* pool_base = nullptr;
  };
  /// Takes a pool's descriptor that came from its producer (closed here, whatever the outcome): checks
  /// that it is a memfd on tmpfs sealed at its size (shrink, grow, seal) whose header is a BlockFlow
  /// pool's of exactly that size, maps it, and returns the pool's id. A pool given again replaces the
  /// first mapping. InvalidArgument naming the problem otherwise; ResourceExhausted beyond
  /// kMaxPoolsPerLink pools mapped.
  absl::StatusOr<std::uint64_t> adopt(int fd);
  /// Checks `handle` for `bytes` bytes: its pool was given here, the slot is in range, offset +
  /// bytes fits in the slot, the generation is the slot's current one. InvalidArgument naming the
  /// problem otherwise ("stale handle", "slot 9 out of range", ...).
  absl::StatusOr<View> resolve(const wire::ShmHandle& handle, std::uint64_t bytes);
  /// The pools mapped here that their producer retired (ShmPoolOptions::idle_trim, or its end). The
  /// caller forgets them once it knows that no packet naming them is still unread (ZeroCopyLink).
  [[nodiscard]] std::vector<std::uint64_t> retired() const;
  /// Drops the cached mappings of `ids` (tensors still over them keep them mapped). They still
  /// resolve until the next call, which drops them for good: a relay that checked a pool's retired
  /// flag just before it was set may send a handle of it without its descriptor.
  void forget(const std::vector<std::uint64_t>& ids);
  /// Marks retired the pools given here that process `pid` made (the pid in their id): it died (a
  /// worker killed), so the consumers this process relayed their slots to drop them too. Pools of
  /// other processes it relayed here are not its to retire, nor pools made in another PID
  /// namespace (there the same number names another process).
  void retire_made_by(std::int64_t pid);
  std::size_t pools_mapped() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace blockflow::detail
