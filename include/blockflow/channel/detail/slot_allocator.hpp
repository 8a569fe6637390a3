#pragma once
// Internal: in a worker on a zero-copy channel, libtorch's CPU tensors of at least `min_bytes` are
// allocated directly in free slots of the worker's result pools. A block's output then already
// lies in a slot, and sending it shares that slot (ShmProducer::share()) instead of copying it in
// (ShmEdgeStats::bytes_staged does not grow). Which allocation will be the output is not known
// beforehand, so intermediate activations take slots too while they live; when none is free, an
// allocation goes where libtorch's own allocator puts it (and that output is copied at send time,
// as before). Process-wide: it replaces c10's CPU allocator. Blocks are loaded under a
// SlotAllocatorPause, so their weights stay out of the slots.

#include <blockflow/channel/detail/shm_pool.hpp>

#include <cstddef>
#include <memory>

namespace blockflow::detail {

/// Installs the allocator over `producer` (kept alive until uninstall). Once per process.
void install_slot_allocator(std::shared_ptr<ShmProducer> producer, std::size_t min_bytes);
/// While one lives, this thread's allocations go to libtorch's allocator: loading and preparing
/// blocks (weights, frozen constants, oneDNN's prepacked weights live as long as the block and must
/// not hold result slots for good). Nests.
class SlotAllocatorPause {
 public:
  SlotAllocatorPause();
  ~SlotAllocatorPause();
  SlotAllocatorPause(const SlotAllocatorPause&) = delete;
  SlotAllocatorPause& operator=(const SlotAllocatorPause&) = delete;
};

/// Large allocations go back to libtorch's allocator; tensors already in slots stay valid (their
/// slots are freed when they die). Call before the producer's owner goes away.
void uninstall_slot_allocator();

}  // namespace blockflow::detail
