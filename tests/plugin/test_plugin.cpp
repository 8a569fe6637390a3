// A worker plugin: registers C++ blocks that worker processes can build by factory name.
#include <blockflow/core/block_registry.hpp>

#include <ATen/ATen.h>

#include <dirent.h>
#include <sys/socket.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#ifdef BLOCKFLOW_TEST_TORCH_CUDA
#include <ATen/cuda/Sleep.h>
#endif

extern "C" void blockflow_register_blocks(blockflow::BlockRegistry& registry) {
  registry.add("affine", [](const std::string& name, const blockflow::BlockOptions& options) {
    return blockflow::Block::callable(
        name, [](blockflow::Tensors&& in) -> absl::StatusOr<blockflow::Tensors> { return blockflow::Tensors{in.at(0) * 3 + 1}; },
        options);
  });
  // Its input as complex numbers (pairs of floats): a dtype no wire format carries.
  registry.add("complex", [](const std::string& name, const blockflow::BlockOptions& options) {
    return blockflow::Block::callable(
        name,
        [](blockflow::Tensors&& in) -> absl::StatusOr<blockflow::Tensors> {
          return blockflow::Tensors{at::view_as_complex(in.at(0).reshape({-1, 2}).contiguous())};
        },
        options);
  });
  // The order in which the worker ran its requests: the n-th call returns n (from 0), whatever its input.
  registry.add("sequence", [](const std::string& name, const blockflow::BlockOptions& options) {
    auto calls = std::make_shared<std::atomic<std::int64_t>>(0);
    return blockflow::Block::callable(
        name,
        [calls](blockflow::Tensors&&) -> absl::StatusOr<blockflow::Tensors> {
          return blockflow::Tensors{at::full({1}, static_cast<double>(calls->fetch_add(1)))};
        },
        options);
  });
  // A block with a 1 MB "weight" made when it is built (as a model's weights are when loaded).
  registry.add("weighted", [](const std::string& name, const blockflow::BlockOptions& options) {
    at::Tensor weight = at::ones({262144});
    return blockflow::Block::callable(
        name,
        [weight](blockflow::Tensors&& in) -> absl::StatusOr<blockflow::Tensors> {
          return blockflow::Tensors{in.at(0) + weight[0]};
        },
        options);
  });
  registry.add("slow_identity", [](const std::string& name, const blockflow::BlockOptions& options) {
    return blockflow::Block::callable(
        name,
        [](blockflow::Tensors&& in) -> absl::StatusOr<blockflow::Tensors> {
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
          return blockflow::Tensors{in.at(0)};
        },
        options);
  });
#ifdef BLOCKFLOW_TEST_TORCH_CUDA
  // A slow producer for the CUDA ordering test: zeros, a ~100 ms spin kernel, then 42 everywhere,
  // all queued on the current stream; forward() returns long before the GPU has written the 42s.
  registry.add("slow_fill", [](const std::string& name, const blockflow::BlockOptions& options) {
    return blockflow::Block::callable(
        name,
        [](blockflow::Tensors&& in) -> absl::StatusOr<blockflow::Tensors> {
          at::Tensor out = at::zeros_like(in.at(0));
          at::cuda::sleep(200'000'000);
          out.fill_(42.0);
          return blockflow::Tensors{out};
        },
        options);
  });
#endif
  // Fault injection: shuts down every SOCK_SEQPACKET socket of its process (a worker's data link
  // to the session) while the process lives on, then returns its input.
  registry.add("cut_data_link", [](const std::string& name, const blockflow::BlockOptions& options) {
    return blockflow::Block::callable(
        name,
        [](blockflow::Tensors&& in) -> absl::StatusOr<blockflow::Tensors> {
          if (DIR* fds = ::opendir("/proc/self/fd")) {
            while (const dirent* e = ::readdir(fds)) {
              const int fd = std::atoi(e->d_name);
              int type = 0;
              socklen_t len = sizeof type;
              if (fd > 2 && ::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) == 0 && type == SOCK_SEQPACKET) {
                ::shutdown(fd, SHUT_RDWR);
              }
            }
            ::closedir(fds);
          }
          return blockflow::Tensors{in.at(0)};
        },
        options);
  });
  // The identity, except that it never returns for an input whose first element is negative.
  registry.add("hang_on_negative", [](const std::string& name, const blockflow::BlockOptions& options) {
    return blockflow::Block::callable(
        name,
        [](blockflow::Tensors&& in) -> absl::StatusOr<blockflow::Tensors> {
          if (in.at(0).flatten()[0].item<double>() < 0) std::this_thread::sleep_for(std::chrono::hours(1));
          return blockflow::Tensors{in.at(0)};
        },
        options);
  });
  // Grows its process by 48 MB (touched) at its first forward and keeps it: memory that no block's
  // footprint accounts for, as a worker measuring its process (MemoryMeasure::kProcess) sees it.
  registry.add("ballast", [](const std::string& name, const blockflow::BlockOptions& options) {
    return blockflow::Block::callable(
        name,
        [](blockflow::Tensors&& in) -> absl::StatusOr<blockflow::Tensors> {
          static const auto* kept = new std::vector<char>(std::size_t{48} << 20, 1);
          return blockflow::Tensors{in.at(0) + kept->back()};
        },
        options);
  });
  // Kills its process while it is being built: a worker dying in the middle of loading.
  registry.add("abort_on_build", [](const std::string&, const blockflow::BlockOptions&) -> std::shared_ptr<blockflow::Block> {
    std::abort();
  });
}
