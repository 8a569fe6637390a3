#include <blockflow/detail/zero_copy_ends.hpp>

#include <ATen/ATen.h>
#include <fmt/format.h>

namespace blockflow::detail {

ZeroCopyEnds::ZeroCopyEnds(const ShmPoolOptions& pools, bool cuda) : host_out_(pools) {
  if (cuda) {
    // As many CUDA tensors in flight as host slots would allow, at least the default.
    cuda_out_ = std::make_unique<CudaProducer>(std::max<std::size_t>(64, pools.slots_per_pool));
    cuda_in_ = std::make_unique<CudaConsumer>();
  }
}

ShmStager ZeroCopyEnds::stager(absl::Duration wait) {
  ShmStager host = make_stager(host_out_, wait);
  if (!cuda_out_) return host;
  return [cuda = cuda_out_.get(), host = std::move(host), wait](const at::Tensor& contiguous) {
    return contiguous.is_cuda() ? cuda->share(contiguous, absl::Now() + wait) : host(contiguous);
  };
}

ShmResolver ZeroCopyEnds::resolver(std::function<void(const wire::ShmHandle&)> release) {
  ShmResolver host = make_resolver(host_in_, release);
  return [cuda = cuda_in_.get(), host = std::move(host), release](
             const wire::TensorDesc& desc, const wire::ShmHandle& handle, at::ScalarType type) -> absl::StatusOr<at::Tensor> {
    if (handle.memory != wire::kCudaMemory) return host(desc, handle, type);
    if (cuda == nullptr) return absl::InvalidArgumentError("a CUDA handle on a channel that is not 'cuda'");
    return cuda->resolve(desc, handle, type, release);
  };
}

bool ZeroCopyEnds::release(const wire::ShmHandle& handle) {
  if (handle.memory == wire::kCudaMemory) return cuda_out_ != nullptr && cuda_out_->release(handle);
  return host_out_.release(handle);
}

std::size_t ZeroCopyEnds::reclaim_all() { return host_out_.reclaim_all() + (cuda_out_ ? cuda_out_->reclaim_all() : 0); }

void ZeroCopyEnds::forget_all() {
  host_in_.forget_all();
  if (cuda_in_) cuda_in_->forget_all();
}

}  // namespace blockflow::detail
