// profile_block() and profile_channels(): the measurements behind a profile (docs/profile.md).
#include <blockflow/plan/profile.hpp>

#include "percentile.hpp"

#include <blockflow/core/detail/clock.hpp>
#include <blockflow/core/detail/exception_text.hpp>
#include <blockflow/core/kpi.hpp>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <fmt/format.h>

#include <blockflow/core/detail/malloc_settings.hpp>
#include <blockflow/core/detail/warm_up_shapes.hpp>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>

namespace blockflow {
namespace {

using detail::ms_since;
using detail::percentile;

// Runs `fn` on a thread of its own with `threads` intra-op threads (its own OpenMP team, gone with
// it) in inference mode, so that the profile does not depend on the caller's thread.
template <typename Fn>
auto on_profiling_thread(int threads, Fn&& fn) -> decltype(fn()) {
  std::optional<decltype(fn())> out;
  std::exception_ptr failure;
  std::thread worker([&] {
    try {
      (void)at::get_num_threads();  // libtorch's lazy width first (see ComputeLanes::lane_main())
      if (threads > 0) at::set_num_threads(threads);
      c10::InferenceMode inference;
      out.emplace(fn());
    } catch (...) {
      failure = std::current_exception();
    }
  });
  worker.join();
  if (failure) std::rethrow_exception(failure);
  return *std::move(out);
}

Tensors batched(const Tensors& inputs, int batch) {
  if (batch == 1) return inputs;
  Tensors out;
  for (const auto& t : inputs) out.push_back(at::cat(std::vector<at::Tensor>(static_cast<std::size_t>(batch), t), 0));
  return out;
}

absl::StatusOr<std::vector<double>> time_forward(Block& block, const Tensors& inputs, int warmup, int iterations) {
  std::vector<double> ms;
  for (int i = -warmup; i < iterations; ++i) {
    Tensors in = inputs;
    const std::int64_t t0 = detail::now_ns();
    auto out = block.forward(std::move(in));
    const double elapsed = ms_since(t0);
    if (!out.ok()) return out.status();
    if (i >= 0) ms.push_back(elapsed);
  }
  return ms;
}

// One step of the rate sweep: `count` arrivals evenly spaced at `rate`, served in order by this
// thread; true when the queue stayed bounded: the mean time in system of the last third of the
// requests is within half a service time (p50) of the first third's.
struct SweepStep {
  bool stable = false;
  double throughput_rps = 0;
};
absl::StatusOr<SweepStep> sweep_step(Block& block, const Tensors& inputs, double rate, int count, double p50_ms) {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::int64_t> arrivals;  // scheduled times, ns
  const std::int64_t start = detail::now_ns() + 1'000'000;
  const double gap_ns = 1e9 / rate;
  std::thread generator([&] {
    for (int i = 0; i < count; ++i) {
      const auto at_ns = start + static_cast<std::int64_t>(gap_ns * i);
      std::this_thread::sleep_for(std::chrono::nanoseconds(std::max<std::int64_t>(0, at_ns - detail::now_ns())));
      std::lock_guard lock(mu);
      arrivals.push_back(at_ns);
      cv.notify_one();
    }
  });
  std::vector<double> sojourn_ms;
  absl::Status failed;
  std::int64_t last_done = start;
  for (int i = 0; i < count; ++i) {
    std::int64_t arrived = 0;
    {
      std::unique_lock lock(mu);
      cv.wait(lock, [&] { return !arrivals.empty(); });
      arrived = arrivals.front();
      arrivals.pop_front();
    }
    if (failed.ok()) {
      try {  // nothing may unwind past the joinable generator (std::terminate)
        Tensors in = inputs;
        auto out = block.forward(std::move(in));
        if (!out.ok()) failed = out.status();
      } catch (const std::exception& e) {
        failed = absl::InternalError(fmt::format("block '{}': forward raised: {}", block.name(), e.what()));
      } catch (...) {
        failed = absl::InternalError(fmt::format("block '{}': forward raised a non-standard exception", block.name()));
      }
    }
    last_done = detail::now_ns();
    sojourn_ms.push_back(static_cast<double>(last_done - arrived) / 1e6);
  }
  generator.join();
  if (!failed.ok()) return failed;
  const std::size_t third = sojourn_ms.size() / 3;
  double first = 0, last = 0;
  for (std::size_t i = 0; i < third; ++i) {
    first += sojourn_ms[i];
    last += sojourn_ms[sojourn_ms.size() - 1 - i];
  }
  first /= static_cast<double>(std::max<std::size_t>(1, third));
  last /= static_cast<double>(std::max<std::size_t>(1, third));
  SweepStep step;
  step.stable = last <= first + 0.5 * p50_ms;
  step.throughput_rps = count / (static_cast<double>(last_done - start) / 1e9);
  return step;
}

absl::StatusOr<double> max_rate(Block& block, const Tensors& inputs, double p50_ms, const ProfileOptions& o) {
  const std::vector<double> factors =
      o.quick ? std::vector<double>{0.7, 0.95, 1.1} : std::vector<double>{0.5, 0.7, 0.85, 0.95, 1.0, 1.05, 1.1, 1.2};
  const double capacity = 1000.0 / std::max(p50_ms, 1e-3);
  double best = 0;
  // Then on by 10% a step while the queue stays bounded (a block served faster back to back than
  // one call at a time), up to 3x.
  std::vector<double> steps = factors;
  for (double f = factors.back() * 1.1; f <= 3.0; f *= 1.1) steps.push_back(f);
  for (const double f : steps) {
    const double rate = f * capacity;
    const int count = static_cast<int>(std::clamp(rate * (o.quick ? 0.3 : 1.0), o.quick ? 9.0 : 24.0, o.quick ? 45.0 : 240.0));
    auto step = sweep_step(block, inputs, rate, count, p50_ms);
    if (!step.ok()) return step.status();
    if (o.progress) {
      o.progress(fmt::format("{}: {:.1f} req/s offered: {} ({:.1f} served)", block.name(), rate,
                             step->stable ? "bounded" : "grows", step->throughput_rps));
    }
    if (!step->stable && f < 1.0) {
      // Below the service rate a queue grows only when something else took the core for a while
      // (a shared machine): one disturbed step must not set the rate. The step runs again, and
      // only a second growth counts.
      step = sweep_step(block, inputs, rate, count, p50_ms);
      if (!step.ok()) return step.status();
      if (o.progress) {
        o.progress(fmt::format("{}: {:.1f} req/s offered again, under its service rate: {} ({:.1f} served)", block.name(),
                               rate, step->stable ? "bounded" : "grows", step->throughput_rps));
      }
    }
    if (!step->stable) return best > 0 ? best : step->throughput_rps;
    best = rate;
  }
  return best;
}

}  // namespace

bool BlockProfile::from_file() const {
  return source.find('/') != std::string::npos ||
         (source.size() > 3 && source.compare(source.size() - 3, 3, ".pt") == 0);
}

const BatchLatency* BlockProfile::at_batch(int batch) const {
  for (const auto& l : latency) {
    if (l.batch == batch) return &l;
  }
  return nullptr;
}

absl::StatusOr<BlockProfile> profile_block(const std::shared_ptr<Block>& block, const Tensors& inputs,
                                           const ProfileOptions& options) {
  if (!block) return absl::InvalidArgumentError("profile_block: no block");
  // A profile lists its batch sizes increasing, each once (Profile::parse() refuses others).
  std::vector<int> batch_sizes = options.batch_sizes;
  std::sort(batch_sizes.begin(), batch_sizes.end());
  batch_sizes.erase(std::unique(batch_sizes.begin(), batch_sizes.end()), batch_sizes.end());
  const int iterations = options.quick ? 8 : std::max(1, options.iterations);
  const int warmup = options.quick ? 1 : std::max(0, options.warmup);
  try {
    return on_profiling_thread(block->options().intra_op_threads, [&]() -> absl::StatusOr<BlockProfile> {
      BlockProfile p;
      p.name = block->name();
      p.device = block->device().str();
      p.intra_op_threads = block->options().intra_op_threads;
      for (const auto& t : inputs) p.input_shapes.push_back(t.sizes().vec());
      // Named when not all float32 (the default a deployment's warm-up assumes).
      const bool typed = !block->options().input_dtypes.empty() ||
                         std::any_of(inputs.begin(), inputs.end(), [](const Tensor& t) { return t.scalar_type() != at::kFloat; });
      if (typed) {
        for (const auto& t : inputs) p.input_dtypes.push_back(t.scalar_type());
      }
      // Two rounds over the batch sizes, half the iterations each, keeping per batch size the round
      // with the lower p50: a block's speed at one shape can settle in a slow mode for a while (a
      // kernel chosen for another shape, a busy neighbour), and a plan built on that mode is
      // pessimistic by as much (measured: block1 at batch 1, 37.6 ms in one pass, 10 in the next).
      const int rounds = options.quick ? 1 : 2;
      for (int round = 0; round < rounds; ++round) {
        for (std::size_t b = 0; b < batch_sizes.size(); ++b) {
          const int batch = batch_sizes[b];
          if (batch < 1) return absl::InvalidArgumentError(fmt::format("block '{}': batch size {} < 1", p.name, batch));
          auto ms = time_forward(*block, batched(inputs, batch), warmup, std::max(1, iterations / rounds));
          if (!ms.ok()) {
            return absl::Status(ms.status().code(), fmt::format("block '{}': batch {}: {}", p.name, batch,
                                                                std::string(ms.status().message())));
          }
          const BatchLatency measured{batch, percentile(*ms, 0.5), percentile(*ms, 0.99)};
          if (round == 0) {
            p.latency.push_back(measured);
          } else if (measured.p50_ms < p.latency[b].p50_ms) {
            p.latency[b] = measured;
          }
          if (options.progress) {
            options.progress(fmt::format("{}: batch {}: p50 {:.2f} ms, p99 {:.2f} ms (round {} of {})", p.name, batch,
                                         measured.p50_ms, measured.p99_ms, round + 1, rounds));
          }
        }
      }
      Tensors in = inputs;
      auto out = block->forward(std::move(in));
      if (!out.ok()) return out.status();
      for (const auto& t : *out) {
        p.output_bytes += t.defined() ? t.nbytes() : 0;
        p.output_shapes.push_back(t.defined() ? t.sizes().vec() : std::vector<std::int64_t>{});
      }
      if (!options.rate_sweep) return p;
      auto one = time_forward(*block, inputs, 0, options.quick ? 3 : 10);
      if (!one.ok()) return one.status();
      auto rate = max_rate(*block, inputs, percentile(*one, 0.5), options);
      if (!rate.ok()) return rate.status();
      p.max_rate_rps = *rate;
      return p;
    });
  } catch (...) {  // any type (`throw 42;` in a block's forward): an error naming the block, not the end
    return absl::InternalError(fmt::format("block '{}': {}", block->name(), detail::current_exception_text()));
  }
}

absl::StatusOr<BlockProfile> profile_block(const BlockDescription& d, const ProfileOptions& options) {
  if (d.options.input_shapes.empty()) {
    return absl::InvalidArgumentError(fmt::format("block '{}': profiling needs its input_shapes", d.name));
  }
  std::shared_ptr<Block> block;
  Tensors inputs;
  double load_ms = 0, warmup_ms = 0;
  std::int64_t memory = 0;
  try {
    auto made = on_profiling_thread(d.options.intra_op_threads, [&]() -> absl::Status {
      const std::int64_t before = detail::settled_rss_bytes();
      const std::int64_t t0 = detail::now_ns();
      auto b = make_block(d);
      if (!b.ok()) return b.status();
      load_ms = ms_since(t0);
      block = *std::move(b);
      inputs = detail::warm_up_inputs(*block);
      const std::int64_t t1 = detail::now_ns();
      auto ms = time_forward(*block, inputs, 0, std::max(1, options.quick ? 1 : options.warmup));
      if (!ms.ok()) return ms.status();
      warmup_ms = ms_since(t1);
      memory = std::max<std::int64_t>(0, detail::settled_rss_bytes() - before);
      return absl::OkStatus();
    });
    if (!made.ok()) return absl::Status(made.code(), fmt::format("block '{}': {}", d.name, std::string(made.message())));
  } catch (...) {
    return absl::InternalError(fmt::format("block '{}': {}", d.name, detail::current_exception_text()));
  }
  if (options.progress) {
    options.progress(fmt::format("{}: loaded in {:.0f} ms, warmed up in {:.0f} ms, {:.1f} MB resident", d.name, load_ms,
                                 warmup_ms, static_cast<double>(memory) / 1048576.0));
  }
  auto p = profile_block(block, inputs, options);
  if (!p.ok()) return p;
  p->source = !d.torchscript.empty() ? d.torchscript : d.factory;
  p->load_ms = load_ms;
  p->warmup_ms = warmup_ms;
  p->memory_bytes = memory;
  return p;
}

}  // namespace blockflow
