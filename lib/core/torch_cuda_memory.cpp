// libtorch's CUDA caching-allocator figures for the KPI sampler. Built with
// BLOCKFLOW_TORCH_CUDA where the libtorch found by CMake carries CUDA (target c10_cuda); the
// CPU-only build says so instead.
#include <blockflow/core/kpi.hpp>

#ifdef BLOCKFLOW_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/version.h>
#endif

namespace blockflow {

std::string sample_torch_cuda(std::vector<TorchCudaMemory>& out) {
  out.clear();
#ifdef BLOCKFLOW_TORCH_CUDA
  try {
    const int devices = static_cast<int>(c10::cuda::device_count());
    if (devices == 0) return "no CUDA device visible to libtorch";
    for (int d = 0; d < devices; ++d) {
#if TORCH_VERSION_MAJOR >= 2
      // Only devices this process has a context on: asking about others would create one.
      if (!c10::cuda::hasPrimaryContext(static_cast<c10::DeviceIndex>(d))) continue;
#endif
      // Older libtorch throws for a device whose allocator was never initialised.
      try {
        const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(d));
        // StatType::AGGREGATE: index 0 in every libtorch (the enum moved namespaces in 2.x).
        constexpr std::size_t aggregate = 0;
        TorchCudaMemory m;
        m.device = d;
        m.allocated_bytes = stats.allocated_bytes[aggregate].current;
        m.reserved_bytes = stats.reserved_bytes[aggregate].current;
        m.peak_allocated_bytes = stats.allocated_bytes[aggregate].peak;
        out.push_back(m);
      } catch (const std::exception&) {
      }
    }
    return out.empty() ? "CUDA not initialised in this process" : "ok";
  } catch (const std::exception& e) {
    return std::string("torch CUDA allocator unavailable: ") + e.what();
  }
#else
  return "libtorch built without CUDA";
#endif
}

}  // namespace blockflow
