#pragma once
// Internal: one process's ends of a zero-copy edge to another process of the same host (the session
// host and one worker, either side). Its own pools, which the peer's messages release slots of, and
// the peer's pools, mapped on demand. Channel "shm": host shared memory for CPU tensors. Channel
// "cuda": the same for CPU tensors, plus CUDA IPC for CUDA tensors (cuda_ipc.hpp). Each handle says
// which memory it names (wire::ShmHandle::memory), so one message may carry both kinds.

#include <blockflow/channel/detail/cuda_ipc.hpp>
#include <blockflow/channel/detail/shm_pool.hpp>
#include <blockflow/channel/detail/tensor_codec.hpp>

#include <absl/container/flat_hash_map.h>
#include <absl/status/status.h>
#include <blockflow/core/detail/mutex.hpp>

#include <atomic>
#include <functional>
#include <memory>
#include <tuple>
#include <vector>

namespace blockflow::detail {

/// The release protocol of every zero-copy data link (a shm:// channel, a worker's "shm" or "cuda"
/// channel): a consumer gives the producer's handles back in kRelease messages of at most this
/// many handles (the longest message), and the producer's ZeroCopyEnds::take_releases() frees them.
inline constexpr std::size_t kReleasesPerMessage = wire::kMaxMessageBytes / wire::kShmHandleBytes;

/// The kRelease message for `count` handles from `first` (at most kReleasesPerMessage).
wire::Header release_message(const wire::ShmHandle* first, std::size_t count);

/// Sends `handles` back to their producer on `link`, kReleasesPerMessage a packet, from any thread.
/// Returns how many went out; when the link is down, the rest are the caller's (to send again on
/// the next link, or to drop: a producer whose consumer went away reclaims what it held).
std::size_t send_releases(PacketLink& link, const std::vector<wire::ShmHandle>& handles);

/// Runs `step` every `period` on a thread of its own, detached, until it returns false: the
/// process-wide helpers that finish what an object gone or going left behind.
void run_detached_until_done(std::function<bool()> step, absl::Duration period);

/// Releases on their way back to one producer over `link`, for a consumer whose tensors die on any
/// thread (a block's, a CUDA callback's): give() never blocks. What the link cannot take now (the
/// producer's queue holds a few packets) waits here and leaves in one packet with the next give(),
/// or within milliseconds from a process-wide retrying thread (bounded: one handle per slot the
/// consumer holds); once the producer is gone it is dropped (the producer reclaimed every slot).
/// Tensors hold their outbox, and the outbox its link: the link stays open while any tensor over
/// the producer's memory lives here, so the producer takes their slots back only once they are all
/// gone (or this process is), never under them. Thread-safe; made by std::make_shared.
class ReleaseOutbox : public std::enable_shared_from_this<ReleaseOutbox> {
 public:
  explicit ReleaseOutbox(std::shared_ptr<PacketLink> link) : link_(std::move(link)) {}
  void give(const wire::ShmHandle& handle);
  void flush();
  /// Releases wait for room on the link.
  [[nodiscard]] bool pending() const { return waiting_count_.load(std::memory_order_relaxed) > 0; }

 private:
  void send_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const std::shared_ptr<PacketLink> link_;
  blockflow::detail::Mutex mu_;
  std::vector<wire::ShmHandle> waiting_ ABSL_GUARDED_BY(mu_);
  std::atomic<std::size_t> waiting_count_{0};
  std::atomic<bool> retrying_{false};  // listed for the retrying thread
};

/// Builds tensors over a producer's memory: host slots through `host`, CUDA handles through `cuda`
/// (null: refused, naming the channel); `release` runs with each handle when its tensor dies.
ShmResolver make_zero_copy_resolver(ShmConsumer& host, CudaConsumer* cuda, std::function<void(const wire::ShmHandle&)> release);

/// A producer's counters over both kinds of memory: its host slots and its CUDA records.
ShmEdgeStats combined(const ShmEdgeStats& host, const ShmEdgeStats& cuda);

class ZeroCopyEnds {
 public:
  /// `cuda`: also carry CUDA tensors; the caller checked cuda_ipc_usable().
  ZeroCopyEnds(const ShmPoolOptions& pools, bool cuda);

  /// Turns each tensor into a handle: CUDA tensors (channel "cuda") are shared where they lie; CPU
  /// tensors lying in a slot we leased are shared; CPU tensors lying in another process's slot (a
  /// tensor received from one worker, relayed to the next) are passed on as that slot, kept alive
  /// here until the peer releases it (no copy); others are copied into a slot. Waits up to `wait`
  /// for a credit.
  [[nodiscard]] ShmStager stager(absl::Duration wait);
  /// Builds tensors over the peer's memory; `release` runs with each handle when its tensor dies.
  [[nodiscard]] ShmResolver resolver(std::function<void(const wire::ShmHandle&)> release);
  /// True when the stager hands `t` on without a copy or a credit: a contiguous CPU tensor lying in
  /// another process's slot (a relay). No side effect.
  [[nodiscard]] static bool relays_as_is(const at::Tensor& t);
  /// The peer is done with one of our handles (false, counted, for a stale or forged one).
  bool release(const wire::ShmHandle& handle);
  /// A kRelease message from the peer (release_message()): each of its handles back, as release()
  /// does. InvalidArgument naming the problem when the message is not whole handles.
  absl::Status take_releases(const wire::Header& message);
  /// The peer died: frees every slot it held. Returns how many.
  std::size_t reclaim_all();
  /// The channel is closing: sends waiting for a slot or a CUDA record return Cancelled.
  void stop_waiting();
  /// The peer restarted: its pools are new.
  void forget_all();

  [[nodiscard]] bool cuda() const { return cuda_out_ != nullptr; }
  [[nodiscard]] ShmProducer& host_pool() { return *host_out_; }
  [[nodiscard]] std::shared_ptr<ShmProducer> shared_host_pool() const { return host_out_; }
  [[nodiscard]] ShmEdgeStats host_stats() const;
  [[nodiscard]] ShmEdgeStats cuda_stats() const { return cuda_out_ ? cuda_out_->stats() : ShmEdgeStats{}; }
  /// Handles the peer holds now: our slots sent to it, tensors relayed to it as a third process's
  /// slot, CUDA records. Not our own leases that were never sent.
  [[nodiscard]] std::uint64_t held_by_peer() const {
    return host_out_->held_by_consumer() + forwarded_held() + cuda_stats().slots_in_use;
  }
  /// Tensors relayed to the peer as a third process's slot that it has not released yet: this end
  /// keeps them alive, so that the third process does not reuse their slots under the peer.
  [[nodiscard]] std::uint64_t forwarded_held() const;
  /// The peer holds memory that this end must keep alive for it: relayed tensors (forwarded_held())
  /// or CUDA tensors (their allocator would reuse them). Our own slots stay valid for a peer that
  /// mapped them even once this end is gone.
  [[nodiscard]] bool holds_for_peer() const { return forwarded_held() > 0 || cuda_stats().slots_in_use > 0; }

 private:
  // Tensors passed on as another process's slot, kept until the peer releases that handle.
  struct Forwarded {
    blockflow::detail::Mutex mu;
    absl::flat_hash_map<std::tuple<std::uint64_t, std::uint32_t, std::uint64_t>, std::vector<at::Tensor>> held
        ABSL_GUARDED_BY(mu);
    std::uint64_t count ABSL_GUARDED_BY(mu) = 0;  // relayed so far
    std::uint64_t now ABSL_GUARDED_BY(mu) = 0;    // held now (the tensors in `held`)
  };

  std::shared_ptr<ShmProducer> host_out_;
  ShmConsumer host_in_;
  std::shared_ptr<Forwarded> forwarded_ = std::make_shared<Forwarded>();
  std::unique_ptr<CudaProducer> cuda_out_;
  std::unique_ptr<CudaConsumer> cuda_in_;
};

}  // namespace blockflow::detail
