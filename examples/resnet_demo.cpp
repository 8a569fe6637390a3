// The main demo: a ResNet50 split into four TorchScript blocks, shared by two tasks, running in
// threads of one process. Checks the split pipelines against the monolithic models and prints where
// each request's time went.
//
//   resnet_demo --models DIR [--requests N] [--threads T] [--channel inproc|shm|zmq|cuda|all]
//
// DIR is written by scripts/export_models.py. T is the intra-op thread count of every block (and
// of the monolithic models, so the comparison is fair). --channel inproc (the default) runs every
// block in this process's threads; shm and zmq put block1..block4 in child worker processes w1..w4
// (head_b shares w4 with block4) reached over the zero-copy shared-memory channel or serialized
// ZeroMQ (ipc://); the monolithic models stay in the host's threads. cuda (where
// cuda_channel_available()) does the same with every block on cuda:0, CUDA tensors crossing as CUDA
// IPC handles. all runs the channels one after the other (cuda where available) and ends with a
// comparison table. (--placement workers is --channel shm.) With --fork-server the workers are
// forked from a fork server started first in main() (docs/workers.md; run it with
// GOMP_SPINCOUNT=10000 in the environment, or they are started as programs and the log says why).

#include <blockflow/blockflow.hpp>
#include <blockflow/worker/fork_server.hpp>
#include <blockflow/worker/worker_site.hpp>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <thread>

namespace bf = blockflow;

namespace {

struct Args {
  std::string models;
  int requests = 20;
  int threads = 2;
  std::vector<std::string> channels = {"inproc"};
};

// `text` as a whole number of at least `min`, or an error naming the flag.
int whole_number(const std::string& flag, const std::string& text, int min) {
  int value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size() || value < min) {
    throw std::invalid_argument(fmt::format("{} takes a whole number of at least {}, not '{}'", flag, min, text));
  }
  return value;
}

Args parse(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--fork-server") continue;  // taken by main() first
    if (a == "--models") args.models = next();
    else if (a == "--requests") args.requests = whole_number(a, next(), 1);
    else if (a == "--threads") args.threads = whole_number(a, next(), 1);
    else if (a == "--placement") {
      const std::string p = next();
      if (p != "workers" && p != "threads") throw std::invalid_argument("--placement is threads or workers, not " + p);
      args.channels = {p == "workers" ? "shm" : "inproc"};
    }
    else if (a == "--channel") {
      const std::string c = next();
      const absl::Status cuda = bf::cuda_channel_available();
      if (c == "all") {
        args.channels = {"inproc", "shm", "zmq"};
        if (cuda.ok()) args.channels.push_back("cuda");
        else std::cerr << "--channel all: no cuda line: " << cuda.message() << "\n";
      } else if (c == "inproc" || c == "shm" || c == "zmq") {
        args.channels = {c};
      } else if (c == "cuda") {
        if (!cuda.ok()) throw std::invalid_argument("--channel cuda: " + std::string(cuda.message()));
        args.channels = {c};
      } else {
        throw std::invalid_argument("--channel is inproc, shm, zmq, cuda or all, not " + c);
      }
    } else {
      throw std::invalid_argument("unknown argument " + a +
                                  " (use --models DIR [--requests N] [--threads T] [--channel inproc|shm|zmq|cuda|all] "
                                  "[--fork-server])");
    }
  }
  if (args.models.empty()) throw std::invalid_argument("--models DIR is required");
  return args;
}

// A TorchScript block of the demo, placed in this process (empty placement) or in a worker.
bf::BlockDescription block(const Args& args, const std::string& channel, const std::string& name,
                           std::vector<std::int64_t> input_shape, std::string placement = "") {
  bf::BlockDescription d;
  d.name = name;
  d.torchscript = args.models + "/" + name + ".pt";
  d.options.intra_op_threads = args.threads;
  d.options.input_shapes = {std::move(input_shape)};
  d.placement = channel == "inproc" ? "" : std::move(placement);
  if (channel == "cuda") d.options.device = "cuda:0";  // every block, the monolithic models too
  return d;
}

// One channel's line of the comparison table.
struct Summary {
  std::string channel;
  double worst_diff = 0, e2e_p50_ms = 0, overhead_p50_ms = 0, compute_mean_ms = 0;
  std::uint64_t bytes_copied = 0, handles = 0;
};

double max_abs_diff(const bf::Tensor& a, const bf::Tensor& b) { return (a - b).abs().max().item<double>(); }


std::optional<Summary> run(const Args& args, const std::string& channel) {
  const std::vector<std::int64_t> image{-1, 3, 224, 224};
  bf::Session session;
  if (channel != "inproc") {
    for (const char* w : {"w1", "w2", "w3", "w4"}) {
      bf::WorkerOptions worker;
      worker.name = w;
      worker.channel = channel;
      session.add_site(bf::make_worker(worker));
    }
  }
  session.add_block(block(args, channel, "block1", image, "w1"))
      .add_block(block(args, channel, "block2", {-1, 256, 56, 56}, "w2"))
      .add_block(block(args, channel, "block3", {-1, 512, 28, 28}, "w3"))
      .add_block(block(args, channel, "block4", {-1, 1024, 14, 14}, "w4"))
      .add_block(block(args, channel, "head_b", {-1, 1024, 14, 14}, "w4"))
      .add_block(block(args, channel, "monolithic", image))
      .add_block(block(args, channel, "monolithic_b", image))
      // Two tasks share blocks 1-3 and differ in their heads.
      .add_path(bf::Path::chain("task_a", {"block1", "block2", "block3", "block4"}))
      .add_path(bf::Path::chain("task_b", {"block1", "block2", "block3", "head_b"}))
      .add_path(bf::Path::chain("mono_a", {"monolithic"}))
      .add_path(bf::Path::chain("mono_b", {"monolithic_b"}));
  if (auto status = session.start(); !status.ok()) {
    std::cerr << "start failed: " << status << "\n";
    return std::nullopt;
  }

  fmt::print("BlockFlow demo: split ResNet50, 2 tasks sharing blocks 1-3, channel {}: {}\n", channel,
             channel == "inproc" ? "every block in this process's threads"
                                 : fmt::format("blocks 1-4 in worker processes w1-w4, head_b in w4, over {}",
                                               channel == "shm"    ? "shared memory (zero-copy)"
                                               : channel == "cuda" ? "CUDA IPC on cuda:0 (zero-copy)"
                                                                   : "serialized ZeroMQ (ipc://)"));
  const auto lanes = session.metrics().lanes.size();
  fmt::print("threads: {} compute lane{} of {} intra-op threads, {} hardware threads\n", lanes, lanes == 1 ? "" : "s",
             args.threads, std::thread::hardware_concurrency());
  {
    const auto started = session.metrics();
    const auto forked = std::count_if(started.sites.begin(), started.sites.end(), [](const bf::SiteStats& s) { return s.forked; });
    fmt::print("start(): {:.0f} ms{}\n", started.start.start_ms,
               started.sites.empty() ? ""
                                     : fmt::format(" ({} of {} worker processes forked from the fork server)", forked,
                                                   started.sites.size()));
  }

  // Equality of the split pipelines with the monolithic models.
  at::manual_seed(0);
  double worst = 0;
  for (const auto& [split, whole] : {std::pair{"task_a", "mono_a"}, std::pair{"task_b", "mono_b"}}) {
    const bf::Tensor x = at::randn({1, 3, 224, 224});
    const bf::Result s = session.submit(split, x).get();
    const bf::Result w = session.submit(whole, x).get();
    if (!s.ok() || !w.ok()) {
      std::cerr << "request failed: " << (s.ok() ? w.status : s.status) << "\n";
      return std::nullopt;
    }
    const double diff = max_abs_diff(s.output(), w.output());
    worst = std::max(worst, diff);
    fmt::print("{}: output {} , max |split - monolithic| = {:.3g}\n", split, bf::describe(s.output()), diff);
  }
  const bool equal = worst <= 1e-4;
  fmt::print("equality check (<= 1e-4): {}\n\n", equal ? "PASS" : "FAIL");

  // Synchronous client, alternating tasks.
  for (int i = 0; i < args.requests; ++i) {
    const bf::Result r = session.submit(i % 2 == 0 ? "task_a" : "task_b", at::randn({1, 3, 224, 224})).get();
    if (!r.ok()) {
      std::cerr << "request failed: " << r.status << "\n";
      return std::nullopt;
    }
  }

  const bf::MetricsSnapshot m = session.metrics();
  fmt::print("per block, ms as p50 / mean ({} timed requests + the equality checks):\n", args.requests);
  fmt::print("{:<14}{:>8}{:>6}{:>18}{:>18}{:>18}{:>7}\n", "block", "where", "count", "wait", "compute", "overhead",
             "queue");
  for (const auto& b : m.blocks) {
    auto cell = [](const bf::LatencyStats& s) { return fmt::format("{:.3f} / {:.3f}", s.p50_ms, s.mean_ms); };
    fmt::print("{:<14}{:>8}{:>6}{:>18}{:>18}{:>18}{:>7}\n", b.name, b.placement, b.processed, cell(b.wait),
               cell(b.compute), cell(b.overhead), b.queue.depth);
  }
  fmt::print("\nper task, ms (wait, compute, overhead: means summed over the request's hops):\n");
  fmt::print("{:<8}{:>6}{:>10}{:>10}{:>10}{:>12}{:>12}{:>12}\n", "task", "count", "e2e p50", "e2e p90", "e2e p99",
             "wait mean", "compute", "overhead");
  for (const auto& p : m.paths) {
    fmt::print("{:<8}{:>6}{:>10.2f}{:>10.2f}{:>10.2f}{:>12.3f}{:>12.2f}{:>12.3f}\n", p.task, p.completed, p.e2e.p50_ms,
               p.e2e.p90_ms, p.e2e.p99_ms, p.wait.mean_ms, p.compute.mean_ms, p.overhead.mean_ms);
  }
  Summary summary{channel, worst};
  for (const auto& p : m.paths) {
    if (p.task != "task_a") continue;
    summary.e2e_p50_ms = p.e2e.p50_ms;
    summary.overhead_p50_ms = p.overhead.p50_ms;
    summary.compute_mean_ms = p.compute.mean_ms;
  }
  for (const auto& site : m.sites) {
    summary.bytes_copied += site.data.bytes_copied;
    summary.handles += site.shm_requests.handles + site.shm_results.handles + site.cuda_requests.handles +
                       site.cuda_results.handles;
  }
  session.shutdown();
  fmt::print("\n");
  return summary;
}

}  // namespace

int main(int argc, char** argv) try {
  for (int i = 1; i < argc; ++i) {  // first, while this process has one thread
    if (std::string(argv[i]) != "--fork-server") continue;
    if (auto started = bf::start_fork_server(); !started.ok()) std::cerr << "fork server: " << started << "\n";
  }
  const Args args = parse(argc, argv);
  std::vector<Summary> summaries;
  bool equal = true;
  for (const auto& channel : args.channels) {
    auto summary = run(args, channel);
    if (!summary) return 1;
    equal = equal && summary->worst_diff <= 1e-4;
    summaries.push_back(*summary);
  }
  if (summaries.size() > 1) {
    fmt::print("channels compared (task_a, ms; compute = mean sum over its 4 blocks; handles and bytes copied\n"
               "in the hand-off summed over both directions of every worker edge):\n");
    fmt::print("{:<8}{:>12}{:>14}{:>10}{:>10}{:>14}{:>12}\n", "channel", "max diff", "overhead p50", "compute",
               "e2e p50", "bytes copied", "handles");
    for (const auto& s : summaries) {
      fmt::print("{:<8}{:>12.3g}{:>14.3f}{:>10.2f}{:>10.2f}{:>14}{:>12}\n", s.channel, s.worst_diff, s.overhead_p50_ms,
                 s.compute_mean_ms, s.e2e_p50_ms, s.bytes_copied, s.handles);
    }
    fmt::print("all channels: equality check (<= 1e-4): {}\n", equal ? "PASS" : "FAIL");
  }
  return equal ? 0 : 1;
} catch (const std::exception& e) {
  std::cerr << "resnet_demo: " << e.what() << "\n";
  return 2;
}
