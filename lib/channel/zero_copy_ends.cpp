#include <blockflow/channel/detail/zero_copy_ends.hpp>
#include <blockflow/core/detail/mutex.hpp>

#include <ATen/ATen.h>
#include <fmt/format.h>

namespace blockflow::detail {

ZeroCopyEnds::ZeroCopyEnds(const ShmPoolOptions& pools, bool cuda) : host_out_(std::make_shared<ShmProducer>(pools)) {
  if (cuda) {
    // As many CUDA tensors in flight as host slots would allow, at least the default.
    cuda_out_ = std::make_unique<CudaProducer>(std::max<std::size_t>(64, pools.slots_per_pool));
    cuda_in_ = std::make_unique<CudaConsumer>();
  }
}

ShmStager ZeroCopyEnds::stager(StageWait wait) {
  // make_stager()'s order (our own slot: shared; otherwise copied), with a relayed tensor in between.
  ShmStager host = [copy = make_stager(*host_out_, wait), forwarded = forwarded_, own = host_out_.get()](
                       const at::Tensor& contiguous) -> absl::StatusOr<wire::ShmHandle> {
    if (contiguous.device().is_cpu()) {
      const std::size_t bytes = byte_size(contiguous);
      if (auto shared = own->share(contiguous.data_ptr(), bytes)) return *shared;
      if (auto origin = shm_origin(contiguous.data_ptr(), bytes)) {
        blockflow::detail::MutexLock lock(&forwarded->mu);
        forwarded->held[{origin->pool_id, origin->slot, origin->generation}].push_back(contiguous);
        ++forwarded->count;
        ++forwarded->now;
        return *origin;
      }
    }
    return copy(contiguous);  // CUDA tensors get its error; the rest are copied into a slot
  };
  if (!cuda_out_) return host;
  return [cuda = cuda_out_.get(), host = std::move(host), wait](const at::Tensor& contiguous) {
    return contiguous.is_cuda() ? cuda->share(contiguous, wait.deadline()) : host(contiguous);
  };
}

ShmResolver ZeroCopyEnds::resolver(ShmConsumer& given, std::function<void(const wire::ShmHandle&)> release) {
  return make_zero_copy_resolver(given, cuda_in_.get(), std::move(release));
}

ShmEdgeStats combined(const ShmEdgeStats& host, const ShmEdgeStats& cuda) {
  ShmEdgeStats s = host;
  s.handles += cuda.handles;
  s.releases += cuda.releases;
  s.slots_in_use += cuda.slots_in_use;
  s.slots_total += cuda.slots_total;
  s.credit_waits += cuda.credit_waits;
  s.reclaims += cuda.reclaims;
  s.stale_releases += cuda.stale_releases;
  return s;
}

ShmResolver make_zero_copy_resolver(ShmConsumer& host_in, CudaConsumer* cuda_in, std::function<void(const wire::ShmHandle&)> release) {
  ShmResolver out;
  out.release = release;
  out.resolve = [cuda = cuda_in, records = &host_in, host = make_resolver(host_in, release).resolve, release](
                    const wire::TensorDesc& desc, const wire::ShmHandle& handle, at::ScalarType type) -> absl::StatusOr<at::Tensor> {
    if (handle.memory != wire::kCudaMemory) return host(desc, handle, type);
    if (cuda == nullptr) return absl::InvalidArgumentError("a CUDA handle on a channel that is not 'cuda'");
    return cuda->resolve(*records, desc, handle, type, release);
  };
  return out;
}

bool ZeroCopyEnds::relays_as_is(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.is_contiguous() && shm_origin(t.data_ptr(), byte_size(t)).has_value();
}

std::optional<ShmStager> ZeroCopyEnds::stager_now(const Tensors& tensors) {
  std::size_t cuda_tensors = 0;
  for (const auto& t : tensors) {
    if (t.defined() && t.is_cuda()) {
      ++cuda_tensors;
    } else if (!relays_as_is(t)) {
      return std::nullopt;  // staging it could wait for a slot
    }
  }
  ShmStager host = stager(absl::ZeroDuration());
  if (cuda_tensors == 0) return host;
  if (!cuda_out_) return std::nullopt;
  auto reserved = cuda_out_->reserve_now(cuda_tensors);
  if (!reserved) return std::nullopt;
  return ShmStager([cuda = cuda_out_.get(), host = std::move(host), reserved](const at::Tensor& contiguous) {
    return contiguous.is_cuda() ? cuda->share(contiguous, *reserved) : host(contiguous);
  });
}

void ZeroCopyEnds::stop_waiting() {
  host_out_->stop_waiting();
  if (cuda_out_) cuda_out_->stop_waiting();
}

bool ZeroCopyEnds::release(const wire::ShmHandle& handle) {
  if (handle.memory == wire::kCudaMemory) return cuda_out_ != nullptr && cuda_out_->release(handle);
  at::Tensor dropped;  // dies outside the lock: its own release may run now
  {
    blockflow::detail::MutexLock lock(&forwarded_->mu);
    auto it = forwarded_->held.find({handle.pool_id, handle.slot, handle.generation});
    if (it != forwarded_->held.end()) {
      dropped = std::move(it->second.back());
      it->second.pop_back();
      --forwarded_->now;
      if (it->second.empty()) forwarded_->held.erase(it);
    }
  }
  if (dropped.defined()) return true;
  return host_out_->release(handle);
}

absl::Status ZeroCopyEnds::take_releases(const wire::Header& message) {
  if (message.kind != wire::MessageKind::kRelease) return absl::InvalidArgumentError("not a release message");
  auto handles = wire::decode_releases(message.message);
  if (!handles.ok()) return handles.status();
  for (const auto& h : *handles) (void)release(h);  // a stale or forged one is counted there
  return absl::OkStatus();
}

std::size_t ZeroCopyEnds::reclaim_all() {
  std::size_t forwarded = 0;
  decltype(forwarded_->held) dropped;
  {
    blockflow::detail::MutexLock lock(&forwarded_->mu);
    for (const auto& [key, tensors] : forwarded_->held) forwarded += tensors.size();
    dropped.swap(forwarded_->held);
    forwarded_->now = 0;
  }
  return host_out_->reclaim_all() + forwarded + (cuda_out_ ? cuda_out_->reclaim_all() : 0);
}

std::uint64_t ZeroCopyEnds::forwarded_held() const {
  blockflow::detail::MutexLock lock(&forwarded_->mu);
  return forwarded_->now;
}

ShmEdgeStats ZeroCopyEnds::host_stats() const {
  ShmEdgeStats s = host_out_->stats();
  blockflow::detail::MutexLock lock(&forwarded_->mu);
  s.forwarded = forwarded_->count;
  s.handles += forwarded_->count;
  return s;
}

}  // namespace blockflow::detail
