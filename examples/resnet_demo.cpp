// The main demo: a ResNet50 split into four TorchScript blocks, shared by two tasks, running in
// threads of one process. Checks the split pipelines against the monolithic models and prints where
// each request's time went.
//
//   resnet_demo --models DIR [--requests N] [--threads T] [--placement threads|workers]
//
// DIR is written by scripts/export_models.py. T is the intra-op thread count of every block (and
// of the monolithic models, so the comparison is fair). With --placement workers, block1..block4
// run in child worker processes w1..w4 (head_b shares w4 with block4) over serialized ZeroMQ; the
// monolithic models stay in the host's threads.

#include <blockflow/blockflow.hpp>
#include <blockflow/worker_site.hpp>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>

namespace bf = blockflow;

namespace {

struct Args {
  std::string models;
  int requests = 20;
  int threads = 2;
  std::string placement = "threads";
};

Args parse(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--models") args.models = next();
    else if (a == "--requests") args.requests = std::stoi(next());
    else if (a == "--threads") args.threads = std::stoi(next());
    else if (a == "--placement") args.placement = next();
    else throw std::invalid_argument("unknown argument " + a +
                                     " (use --models DIR [--requests N] [--threads T] [--placement threads|workers])");
  }
  if (args.models.empty()) throw std::invalid_argument("--models DIR is required");
  if (args.placement != "threads" && args.placement != "workers") {
    throw std::invalid_argument("--placement is threads or workers, not " + args.placement);
  }
  return args;
}

// A TorchScript block of the demo, placed in this process (empty placement) or in a worker.
bf::BlockDescription block(const Args& args, const std::string& name, std::vector<std::int64_t> input_shape,
                           std::string placement = "") {
  bf::BlockDescription d;
  d.name = name;
  d.torchscript = args.models + "/" + name + ".pt";
  d.options.intra_op_threads = args.threads;
  d.options.input_shapes = {std::move(input_shape)};
  d.placement = args.placement == "workers" ? std::move(placement) : "";
  return d;
}

double max_abs_diff(const bf::Tensor& a, const bf::Tensor& b) { return (a - b).abs().max().item<double>(); }

}  // namespace

int main(int argc, char** argv) try {
  const Args args = parse(argc, argv);
  const std::vector<std::int64_t> image{-1, 3, 224, 224};

  bf::Session session;
  if (args.placement == "workers") {
    for (const char* w : {"w1", "w2", "w3", "w4"}) {
      bf::WorkerOptions worker;
      worker.name = w;
      session.add_site(bf::make_worker(worker));
    }
  }
  session.add_block(block(args, "block1", image, "w1"))
      .add_block(block(args, "block2", {-1, 256, 56, 56}, "w2"))
      .add_block(block(args, "block3", {-1, 512, 28, 28}, "w3"))
      .add_block(block(args, "block4", {-1, 1024, 14, 14}, "w4"))
      .add_block(block(args, "head_b", {-1, 1024, 14, 14}, "w4"))
      .add_block(block(args, "monolithic", image))
      .add_block(block(args, "monolithic_b", image))
      // Two tasks share blocks 1-3 and differ in their heads.
      .add_path(bf::Path::chain("task_a", {"block1", "block2", "block3", "block4"}))
      .add_path(bf::Path::chain("task_b", {"block1", "block2", "block3", "head_b"}))
      .add_path(bf::Path::chain("mono_a", {"monolithic"}))
      .add_path(bf::Path::chain("mono_b", {"monolithic_b"}));
  if (auto status = session.start(); !status.ok()) {
    std::cerr << "start failed: " << status << "\n";
    return 1;
  }

  fmt::print("BlockFlow demo: split ResNet50, 2 tasks sharing blocks 1-3, placement: {}\n",
             args.placement == "workers" ? "blocks 1-4 in worker processes w1-w4 (zmq-ipc), head_b in w4"
                                         : "threads of this process (inproc)");
  fmt::print("threads: {} intra-op per block, 1 worker thread per block, {} hardware threads\n", args.threads,
             std::thread::hardware_concurrency());

  // Equality of the split pipelines with the monolithic models.
  at::manual_seed(0);
  double worst = 0;
  for (const auto& [split, whole] : {std::pair{"task_a", "mono_a"}, std::pair{"task_b", "mono_b"}}) {
    const bf::Tensor x = at::randn({1, 3, 224, 224});
    const bf::Result s = session.submit(split, x).get();
    const bf::Result w = session.submit(whole, x).get();
    if (!s.ok() || !w.ok()) {
      std::cerr << "request failed: " << (s.ok() ? w.status : s.status) << "\n";
      return 1;
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
      return 1;
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
  session.shutdown();
  return equal ? 0 : 1;
} catch (const std::exception& e) {
  std::cerr << "resnet_demo: " << e.what() << "\n";
  return 2;
}
