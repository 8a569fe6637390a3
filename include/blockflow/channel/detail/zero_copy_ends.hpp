#pragma once
// Internal: one process's ends of a zero-copy edge to another process of the same host (the session
// host and one worker, either side). Its own pools, which the peer's messages release slots of, and
// the peer's pools, mapped on demand. Channel "shm": host shared memory for CPU tensors. Channel
// "cuda": the same for CPU tensors, plus CUDA IPC for CUDA tensors (cuda_ipc.hpp). Each handle says
// which memory it names (wire::ShmHandle::memory), so one message may carry both kinds. The peer's
// pools are not here: each link's ZeroCopyLink holds those given on it.

#include <blockflow/channel/detail/cuda_ipc.hpp>
#include <blockflow/channel/detail/shm_pool.hpp>
#include <blockflow/channel/detail/tensor_codec.hpp>

#include <absl/container/flat_hash_map.h>
#include <absl/status/status.h>
#include <blockflow/core/detail/mutex.hpp>

#include <functional>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

namespace blockflow::detail {

/// Builds tensors over a producer's memory: host slots and CUDA records through `host` (the pools
/// the link was given), CUDA allocations through `cuda` (null: refused, naming the channel);
/// `release` runs with each handle when its tensor dies.
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
  /// here until the peer releases it (no copy); others are copied into a slot. Waits as `wait`
  /// says for a credit.
  [[nodiscard]] ShmStager stager(StageWait wait);
  /// Builds tensors over the peer's memory, in the pools `given` holds (a link's); `release` runs
  /// with each handle when its tensor dies.
  [[nodiscard]] ShmResolver resolver(ShmConsumer& given, std::function<void(const wire::ShmHandle&)> release);
  /// True when the stager hands `t` on without a copy or a credit: a contiguous CPU tensor lying in
  /// another process's slot (a relay). No side effect.
  [[nodiscard]] static bool relays_as_is(const at::Tensor& t);
  /// A stager for one send of `tensors` that never waits for a credit, from a thread that must not
  /// (a site's receiving thread relaying a result): every CPU tensor relays as is, and the CUDA
  /// records the CUDA tensors need are taken now (kept by the stager; those it does not use go back
  /// when it dies). nullopt, nothing taken, when either is not so.
  [[nodiscard]] std::optional<ShmStager> stager_now(const Tensors& tensors);
  /// The peer is done with one of our handles (false, counted, for a stale or forged one).
  bool release(const wire::ShmHandle& handle);
  /// A kRelease message from the peer (release_message()): each of its handles back, as release()
  /// does. InvalidArgument naming the problem when the message is not whole handles.
  absl::Status take_releases(const wire::Header& message);
  /// The peer died: frees every slot it held. Returns how many.
  std::size_t reclaim_all();
  /// The channel is closing: sends waiting for a slot or a CUDA record return Cancelled.
  void stop_waiting();

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
  std::shared_ptr<Forwarded> forwarded_ = std::make_shared<Forwarded>();
  std::unique_ptr<CudaProducer> cuda_out_;
  std::unique_ptr<CudaConsumer> cuda_in_;
};

}  // namespace blockflow::detail
