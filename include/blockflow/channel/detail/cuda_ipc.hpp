#pragma once
// Internal: the CUDA half of the zero-copy channel (TensorMQ, channel "cuda").
//
// A CUDA tensor crosses between two processes of one host as a 32-byte handle (wire::ShmHandle with
// memory = kCudaMemory). The handle names a slot of a small host shared-memory pool (the same pools,
// generations, credits and release protocol as the CPU channel: ShmProducer), and that slot holds a
// record: the CUDA IPC handle of the producer's allocation (libtorch's caching-allocator segment
// that holds the tensor, exported with cudaIpcGetMemHandle), its size, the device's PCI bus id, and
// the IPC handle of an interprocess event the producer recorded on its current stream after the
// tensor was written. The handle's offset is the tensor's offset inside that allocation.
//
// The consumer opens each allocation once per process (cached by its IPC handle, process-wide, as
// CUDA allows one mapping per process) and each event once, makes its current stream wait on the
// event (no host synchronisation, nothing device-wide), and builds its tensor over the mapping:
// nothing is copied. When that tensor dies, a host function enqueued on the consumer's current
// stream returns the handle once the stream has finished reading it; the producer then drops its
// reference to the tensor, and its allocator may reuse the memory.
//
// A process that forwards a tensor it received this way (the session host between two workers)
// shares the original allocation again, with an event of its own recorded after its stream's wait
// on the first producer's: the next consumer opens the first producer's memory directly, and the
// forwarder's view (which holds the first producer's slot) lives until the next consumer releases.
// A handle naming the receiver's own allocation (a worker returned a view of its input) resolves
// to that allocation. Nothing is copied at any hop.
//
// Everything here builds without CUDA (functions then answer Unimplemented, naming the reason).

#include <blockflow/channel/detail/cuda_export_table.hpp>
#include <blockflow/channel/detail/shm_pool.hpp>
#include <blockflow/core/tensor.hpp>
#include <blockflow/channel/wire_format.hpp>

#include <absl/status/statusor.h>
#include <absl/time/time.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace blockflow::detail {

/// OK when this build and this process can carry CUDA tensors between processes: built with the
/// CUDA toolkit, against a libtorch with CUDA, and a device is visible. Otherwise the reason.
absl::Status cuda_ipc_usable();

/// Connect-time check of the CUDA IPC path. export_cuda_probe() exports a small allocation and an
/// interprocess event of this process (once) and returns them as a hex string; the other process
/// passes that string to open_cuda_probe(), which opens both, or fails naming the cause (another
/// PID namespace, the device not visible there, no IPC support).
absl::StatusOr<std::string> export_cuda_probe();
absl::Status open_cuda_probe(const std::string& probe);

/// The producing side of CUDA hand-offs. Thread-safe.
class CudaProducer {
 public:
  /// `max_in_flight`: records, hence tensors handed over and not yet released (the credits).
  explicit CudaProducer(std::size_t max_in_flight = 64);
  ~CudaProducer();
  CudaProducer(const CudaProducer&) = delete;
  CudaProducer& operator=(const CudaProducer&) = delete;

  /// Hands over a contiguous CUDA tensor: records the ready event on the current stream and
  /// returns its handle; the tensor is kept alive until release(). Waits for a credit until
  /// `deadline` (DeadlineExceeded then, naming the records in use). A tensor this process received
  /// over CUDA IPC is handed over as its original allocation (with an event of this process).
  absl::StatusOr<wire::ShmHandle> share(const at::Tensor& contiguous, absl::Time deadline);
  /// Records taken ahead for share()s that must never wait for a credit (a relay from a thread that
  /// also reads this channel's releases); those left unused are free again when it dies.
  struct Reserved {
    std::vector<ShmLease> records;
    Reserved() = default;
    Reserved(const Reserved&) = delete;
    Reserved& operator=(const Reserved&) = delete;
    ~Reserved();
  };
  /// `n` records now, or null (none taken, no credit wait counted) when fewer are free.
  std::shared_ptr<Reserved> reserve_now(std::size_t n);
  /// share() with one of `reserved`'s records: never waits (FailedPrecondition when none is left).
  absl::StatusOr<wire::ShmHandle> share(const at::Tensor& contiguous, Reserved& reserved);
  /// The consumer is done with a handle: false (counted) when it matches no record in use.
  bool release(const wire::ShmHandle& handle);
  /// Drops every record the consumer held (it died). Returns how many.
  std::size_t reclaim_all();
  /// The channel is closing: a share() waiting for a record returns Cancelled (ShmProducer's).
  void stop_waiting();
  /// handles, releases, slots_in_use (records), credit_waits, reclaims; bytes_staged stays 0:
  /// nothing is ever copied.
  ShmEdgeStats stats() const;

 private:
  absl::StatusOr<wire::ShmHandle> share_in(const at::Tensor& contiguous,
                                           const std::function<absl::StatusOr<ShmLease>()>& take_record);
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

/// The consuming side: resolves handles into CUDA tensors over the producer's memory. Thread-safe.
class CudaConsumer {
 public:
  CudaConsumer();
  ~CudaConsumer();
  CudaConsumer(const CudaConsumer&) = delete;
  CudaConsumer& operator=(const CudaConsumer&) = delete;

  /// Checks the handle (record slot, generation, offset + byte_count inside the allocation,
  /// alignment), opens what it names, makes the current stream wait on its event, and returns a
  /// tensor over it. When the tensor dies, `release` runs with the handle once the consumer's
  /// stream has finished with it (on a CUDA callback thread). InvalidArgument naming the problem
  /// for a bad handle; FailedPrecondition naming the CUDA error when the memory or event cannot be
  /// opened.
  /// `records`: the link's consumer, which holds the producer's record pools it was given.
  /// Opened allocations stay cached process-wide while tensors use them.
  absl::StatusOr<at::Tensor> resolve(ShmConsumer& records, const wire::TensorDesc& desc, const wire::ShmHandle& handle,
                                     at::ScalarType type, std::function<void(const wire::ShmHandle&)> release);
};

}  // namespace blockflow::detail
