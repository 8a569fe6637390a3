// CUDA graphs per block (BlockOptions::cuda_graph). The capture and replay need a libtorch with
// CUDA (BLOCKFLOW_TORCH_CUDA, where CMake found target c10_cuda); the CPU-only build refuses the
// option, saying so.
#include <blockflow/core/detail/cuda_graph_block.hpp>

#include <fmt/format.h>

#ifdef BLOCKFLOW_TORCH_CUDA
#include <blockflow/core/detail/mutex.hpp>

#include <absl/base/thread_annotations.h>

#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/core/InferenceMode.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/version.h>

#include <atomic>
#include <vector>
#endif

namespace blockflow::detail {

absl::Status capture_cuda_graph(Block& block, const Tensors& example) {
  auto* graphed = dynamic_cast<CudaGraphBlock*>(&block);
  return graphed == nullptr ? absl::OkStatus() : graphed->capture(example);
}

std::optional<CudaGraphStats> cuda_graph_stats(const Block& block) {
  const auto* graphed = dynamic_cast<const CudaGraphBlock*>(&block);
  if (graphed == nullptr) return std::nullopt;
  return graphed->counters();
}

// Where the capture cannot be built: no CUDA in this libtorch, or one before 2.1, which captures in
// global mode only (a capture would break other threads' CUDA calls).
#if defined(BLOCKFLOW_TORCH_CUDA) && (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1))
#define BLOCKFLOW_CUDA_GRAPHS 1
#endif

#ifndef BLOCKFLOW_CUDA_GRAPHS

absl::Status cuda_graphs_available() {
#ifndef BLOCKFLOW_TORCH_CUDA
  return absl::UnimplementedError("cuda_graph needs a libtorch with CUDA (this build's libtorch has none; see docs/gpu.md)");
#else
  return absl::UnimplementedError(fmt::format("cuda_graph needs libtorch >= 2.1 (this build's is {}.{})",
                                              TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR));
#endif
}

absl::StatusOr<std::shared_ptr<Block>> make_cuda_graph_block(std::shared_ptr<Block> inner) {
  return absl::UnimplementedError(fmt::format("block '{}': {}", inner->name(), std::string(cuda_graphs_available().message())));
}

#else

absl::Status cuda_graphs_available() { return absl::OkStatus(); }

namespace {

bool same_shapes(const Tensors& a, const Tensors& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].sizes() != b[i].sizes() || a[i].scalar_type() != b[i].scalar_type() || a[i].device() != b[i].device()) {
      return false;
    }
  }
  return true;
}

class GraphBlock final : public CudaGraphBlock {
 public:
  // "cuda" without an index is the device current where the block is made (its module was loaded
  // there), fixed once so that every lane captures and replays on the same one.
  explicit GraphBlock(std::shared_ptr<Block> inner)
      : CudaGraphBlock(inner->name(), inner->options()),
        inner_(std::move(inner)),
        device_(c10::DeviceType::CUDA, device().has_index() ? device().index() : c10::cuda::current_device()) {}

  // In-flight replays read the graphs' memory: let them finish first.
  ~GraphBlock() override {
    MutexLock lock(&mu_);
    for (auto& e : entries_) {
      try {
        e->done.synchronize();
      } catch (...) {
      }
    }
  }

  std::string_view kind() const override { return inner_->kind(); }

  absl::Status capture(const Tensors& example) override {
    MutexLock lock(&mu_);
    if (find(example) != nullptr) return absl::OkStatus();
    auto entry = std::make_unique<Entry>();
    c10::InferenceMode inference_mode;
    const c10::cuda::CUDAGuard device_guard(device_);
    const c10::DeviceIndex index = device_.index();
    // Captured on a side stream (a graph cannot be captured on the default stream), after two
    // eager runs there: TorchScript's executor optimises on its second run, and cuBLAS and the
    // allocator set up their per-stream state outside the capture.
    const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(index);
    const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, index);
    for (const auto& t : example) {
      entry->inputs.push_back(t.clone());  // the graph's own input memory, made on the caller's stream
      entry->inputs.back().record_stream(side);
    }
    at::cuda::CUDAEvent inputs_ready;
    inputs_ready.record(caller);
    inputs_ready.block(side);
    // Whatever happens below, the side stream's work is done before this returns.
    struct Drain {
      const c10::cuda::CUDAStream& stream;
      ~Drain() {
        try {
          stream.synchronize();
        } catch (...) {
        }
      }
    } drain{side};
    try {
      const c10::cuda::CUDAStreamGuard stream_guard(side);
      absl::Status status;
      for (int run = 0; run < 2 && status.ok(); ++run) status = inner_->forward(Tensors(entry->inputs)).status();
      if (!status.ok()) return prefixed(status, "eager run before the capture failed");
      side.synchronize();
      entry->graph = std::make_unique<at::cuda::CUDAGraph>();
      // Thread-local mode: other blocks may warm up (allocate, synchronise) on other threads meanwhile.
      entry->graph->capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
      absl::StatusOr<Tensors> out;
      try {
        out = inner_->forward(Tensors(entry->inputs));
      } catch (...) {
        end_capture_quietly(*entry->graph);
        throw;
      }
      if (!out.ok()) {
        end_capture_quietly(*entry->graph);
        return prefixed(out.status(), "the forward being captured failed");
      }
      entry->graph->capture_end();
      entry->outputs = *std::move(out);
      entry->graph->replay();  // once, so that a graph that cannot run fails here, not on a request
      side.synchronize();
    } catch (const c10::Error& e) {
      return absl::FailedPreconditionError(
          fmt::format("block '{}': CUDA graph capture failed: {}", name(), e.what_without_backtrace()));
    } catch (const std::exception& e) {
      return absl::FailedPreconditionError(fmt::format("block '{}': CUDA graph capture failed: {}", name(), e.what()));
    }
    entry->done.record(side);
    entry->done.block(caller);
    entries_.push_back(std::move(entry));
    graphs_.fetch_add(1, std::memory_order_relaxed);
    eager_runs_.store(0, std::memory_order_relaxed);  // the warm-up's own runs are not fallbacks
    return absl::OkStatus();
  }

  absl::StatusOr<Tensors> forward(Tensors&& inputs) override {
    {
      MutexLock lock(&mu_);
      if (Entry* e = find(inputs)) return replay(*e, inputs);
    }
    eager_runs_.fetch_add(1, std::memory_order_relaxed);
    return inner_->forward(std::move(inputs));
  }

  CudaGraphStats counters() const override {
    return {graphs_.load(std::memory_order_relaxed), replays_.load(std::memory_order_relaxed),
            eager_runs_.load(std::memory_order_relaxed)};
  }

 private:
  struct Entry {
    Tensors inputs, outputs;  // the graph's memory: inputs copied in, outputs cloned out
    std::unique_ptr<at::cuda::CUDAGraph> graph;
    at::cuda::CUDAEvent done;  // after the last call's clones: the next call's stream waits on it
  };

  Entry* find(const Tensors& inputs) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (auto& e : entries_) {
      if (same_shapes(e->inputs, inputs)) return e.get();
    }
    return nullptr;
  }

  // On the caller's current stream: no host synchronisation. A caller on another stream than the
  // last one first waits for the last call's clones (the graph's memory is reused).
  absl::StatusOr<Tensors> replay(Entry& e, const Tensors& inputs) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    c10::InferenceMode inference_mode;
    const c10::cuda::CUDAGuard device_guard(device_);
    const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device_.index());
    e.done.block(stream);
    for (std::size_t i = 0; i < inputs.size(); ++i) e.inputs[i].copy_(inputs[i], /*non_blocking=*/true);
    e.graph->replay();
    Tensors out;
    out.reserve(e.outputs.size());
    for (const auto& t : e.outputs) out.push_back(t.clone());
    e.done.record(stream);
    replays_.fetch_add(1, std::memory_order_relaxed);
    return out;
  }

  static void end_capture_quietly(at::cuda::CUDAGraph& graph) {
    try {
      graph.capture_end();
    } catch (...) {
    }
  }

  absl::Status prefixed(const absl::Status& status, const char* what) const {
    return absl::Status(status.code(), fmt::format("block '{}': CUDA graph: {}: {}", name(), what, std::string(status.message())));
  }

  const std::shared_ptr<Block> inner_;
  const c10::Device device_;
  mutable Mutex mu_;
  std::vector<std::unique_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  std::atomic<std::uint64_t> graphs_{0}, replays_{0}, eager_runs_{0};
};

}  // namespace

absl::StatusOr<std::shared_ptr<Block>> make_cuda_graph_block(std::shared_ptr<Block> inner) {
  if (!inner->device().is_cuda()) {
    return absl::FailedPreconditionError(fmt::format("block '{}': cuda_graph needs a CUDA device (device is '{}')",
                                                     inner->name(), inner->options().device));
  }
  return std::shared_ptr<Block>(std::make_shared<GraphBlock>(std::move(inner)));
}

#endif  // BLOCKFLOW_CUDA_GRAPHS

}  // namespace blockflow::detail
