// pipeline: the 4-block split ResNet50 in threads mode against the monolithic model, same process,
// same intra-op thread count, synchronous client, requests interleaved (split, monolithic, split,
// ...) so that machine noise hits both alike. They alternate in rounds (--round, 20 by default):
// 20 split requests, then 20 monolithic ones, and so on; the first 2 of each round are not counted.
// One by one (--round 1), each model starts while the other's OpenMP threads still spin down
// (libgomp spins after a parallel region before it sleeps: in the host, at its default spin count,
// for several ms) and shares the 2 cores with them; block1 in its worker is the one that pays.
// (The --device cuda loop below still interleaves one by one: there the GPU does the compute.)
// Prints one JSON line:
// {"bench":"pipeline","mode":"threads","channel":"inproc","threads_per_block":T,"requests":N,
//  "e2e_p50_ms":..,"monolithic_p50_ms":..,"ratio":..,"overhead_p50_ms":..,"round":..}
// With --mode workers the four blocks run in four worker processes, reached over --channel shm (the
// zero-copy shared-memory channel, the default) or zmq (serialized ZeroMQ over ipc://, "zmq-ipc");
// the monolithic model stays in the host's threads.
// With --mode worker_memory it prints {"bench":"worker_memory","rss_idle_mb":..,"rss_loaded_mb":..}:
// a worker's resident memory before it loads anything and after it loaded the four blocks.
//
// With --mode sampler_cost the 4-worker pipeline runs in alternating rounds of 20 requests with KPI
// sampling off and on (10 Hz in the host and every worker; the first 2 requests after each switch are
// not counted while the setting propagates), so that slow drifts of a shared machine fall on both
// sides alike, and prints
// {"bench":"sampler_cost","e2e_p50_ms_off":..,"e2e_p50_ms_on":..,"ratio":..} with ratio = on / off.
//
// With --device cuda every block and the monolithic model run on cuda:0 (use --channel cuda for
// workers: CUDA tensors cross as CUDA IPC handles). GPU kernels run asynchronously, so e2e and
// monolithic times are taken by the client up to the result's copy to the host (the same for
// both); overhead_p50_ms stays the trace's own (time outside compute and waits). The line adds
// "device" (the GPU's name), "saturation_rps" and "monolithic_saturation_rps": completed requests
// per second with 16 requests kept in flight.
// Every pipeline line ends with "hops_us": per block, the p50 in microseconds of [hand-off in,
// queue, to the block (for a worker: the relay into its process), compute, hand-off out].
//
//   pipeline_bench --models DIR [--mode threads|workers|worker_memory] [--channel shm|zmq|cuda] [--requests N]
//                  [--threads T] [--worker-env "K=V ..."] [--device cpu|cuda] [--round N]
//                  [--receive-spin-us US] [--outputs-in-slots 0|1] [--optimize 0|1] [--direct-edges 0|1]
// --optimize 1: every block and the monolithic model also go through
// torch::jit::optimize_for_inference after freezing (TorchScriptOptions); lines say which.
// --outputs-in-slots 0: workers copy each block output into a slot when they send it
// (WorkerOptions::shm_outputs_in_slots false) instead of allocating it there; lines say which.
// --direct-edges 0 (channel zmq): every block output comes back to the session, which sends it on
// to the next worker (WorkerOptions::direct_edges false), instead of going from worker to worker;
// lines say which ("direct_edges", true only for zmq).

#include "bench_util.hpp"

#include <blockflow/blockflow.hpp>
#include <blockflow/worker_site.hpp>
#include <blockflow/detail/clock.hpp>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <fmt/ranges.h>

#include <absl/strings/str_split.h>

#include <array>
#include <deque>
#include <future>
#include <iostream>
#include <optional>
#include <thread>

namespace bf = blockflow;

int main(int argc, char** argv) try {
  std::string models, mode = "threads", channel = "shm", device = "cpu";
  std::optional<std::string> worker_env;  // "K=V K=V": replaces WorkerOptions::environment
  int requests = 100, threads = 2, warmup = 5, round = 20;
  std::optional<int> spin_us;  // WorkerOptions::receive_spin
  bool outputs_in_slots = bf::WorkerOptions{}.shm_outputs_in_slots;
  bool direct_edges = bf::WorkerOptions{}.direct_edges;
  bool optimize = bf::TorchScriptOptions{}.optimize_for_inference;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--models") models = v;
    else if (a == "--requests") requests = std::stoi(v);
    else if (a == "--threads") threads = std::stoi(v);
    else if (a == "--warmup") warmup = std::stoi(v);
    else if (a == "--mode") mode = v;
    else if (a == "--channel") channel = v;
    else if (a == "--worker-env") worker_env = v;
    else if (a == "--device") device = v;
    else if (a == "--round") round = std::max(1, std::stoi(v));
    else if (a == "--receive-spin-us") spin_us = std::stoi(v);
    else if (a == "--outputs-in-slots") outputs_in_slots = std::stoi(v) != 0;
    else if (a == "--direct-edges") direct_edges = std::stoi(v) != 0;
    else if (a == "--optimize") optimize = std::stoi(v) != 0;
    else throw std::invalid_argument("unknown argument " + a);
  }
  if (models.empty()) throw std::invalid_argument("usage: pipeline_bench --models DIR [--requests N] [--threads T]");

  const std::vector<std::pair<std::string, std::vector<std::int64_t>>> blocks = {
      {"block1", {1, 3, 224, 224}}, {"block2", {1, 256, 56, 56}}, {"block3", {1, 512, 28, 28}},
      {"block4", {1, 1024, 14, 14}}, {"monolithic", {1, 3, 224, 224}}};
  const bool sampler_cost = mode == "sampler_cost";
  const bool workers = mode == "workers" || sampler_cost;
  const bool memory = mode == "worker_memory";
  if (!workers && !memory && mode != "threads") {
    throw std::invalid_argument("--mode threads|workers|worker_memory|sampler_cost");
  }
  bf::Session session;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    bf::BlockDescription d;
    d.name = blocks[i].first;
    d.torchscript = models + "/" + d.name + ".pt";
    d.options.intra_op_threads = threads;
    d.torchscript_options.optimize_for_inference = optimize;
    d.options.input_shapes = {blocks[i].second};
    if (device == "cuda") d.options.device = "cuda:0";
    if (d.name != "monolithic" && (workers || memory)) {
      d.placement = memory ? "w1" : fmt::format("w{}", i + 1);
    }
    if (memory && d.name == "monolithic") continue;
    session.add_block(d);
  }
  for (int w = 1; w <= (memory ? 1 : workers ? 4 : 0); ++w) {
    bf::WorkerOptions o;
    o.name = fmt::format("w{}", w);
    o.channel = channel;
    if (worker_env) o.environment = absl::StrSplit(*worker_env, ' ', absl::SkipEmpty());
    if (spin_us) o.receive_spin = absl::Microseconds(*spin_us);
    o.shm_outputs_in_slots = outputs_in_slots;
    o.direct_edges = direct_edges;
    session.add_site(bf::make_worker(o));
  }
  session.add_path(bf::Path::chain("split", {"block1", "block2", "block3", "block4"}));
  if (!memory) session.add_path(bf::Path::chain("whole", {"monolithic"}));
  if (auto status = session.start(); !status.ok()) throw std::runtime_error(status.ToString());
  if (memory) {
    const auto site = session.metrics().sites.at(0);
    fmt::print("{{\"bench\":\"worker_memory\",\"rss_idle_mb\":{:.1f},\"rss_loaded_mb\":{:.1f},\"blocks\":4,"
               "\"threads_per_block\":{}}}\n",
               static_cast<double>(site.rss_idle_bytes) / 1048576.0, static_cast<double>(site.rss_bytes) / 1048576.0,
               threads);
    return 0;
  }

  const bf::Tensor x = at::randn({1, 3, 224, 224});
  if (sampler_cost) {
    std::vector<double> off_ms, on_ms;
    for (int i = 0; i < warmup; ++i) (void)session.submit("split", x).get();
    for (int round = 0; static_cast<int>(off_ms.size() + on_ms.size()) < requests; ++round) {
      const bool on = round % 2 == 1;
      session.set_sampling(on, absl::Milliseconds(100));
      for (int i = 0; i < 20; ++i) {
        const bf::Result r = session.submit("split", x).get();
        if (!r.ok()) throw std::runtime_error(r.status.ToString());
        if (i >= 2) (on ? on_ms : off_ms).push_back(r.trace.e2e_ms());
      }
    }
    const double off = bf::bench::percentile(off_ms, 0.5), on = bf::bench::percentile(on_ms, 0.5);
    fmt::print("{{\"bench\":\"sampler_cost\",\"e2e_p50_ms_off\":{:.3f},\"e2e_p50_ms_on\":{:.3f},\"ratio\":{:.4f},"
               "\"period_ms\":100,\"requests_off\":{},\"requests_on\":{},\"channel\":\"{}\",\"threads_per_block\":{}}}\n",
               off, on, on / off, off_ms.size(), on_ms.size(), channel, threads);
    return 0;
  }
  std::vector<double> e2e_ms, mono_ms, overhead_ms;
  // Per hop (p50, us): input_ready -> arrived (the hand-off in), arrived -> dequeued (queue),
  // dequeued -> compute_start (to the block: for a worker, the relay to its process), compute,
  // compute_end -> done (hand-off out). Printed as "hops_us": [[in, queue, to_block, compute, out], ...].
  std::vector<std::array<std::vector<double>, 5>> hop_us(4);
  auto record_hops = [&](const bf::Result& r) {
    for (std::size_t h = 0; h < std::min<std::size_t>(4, r.trace.hops.size()); ++h) {
      const bf::HopTiming& t = r.trace.hops[h];
      const std::int64_t spans[5] = {t.arrived_ns - t.input_ready_ns, t.dequeued_ns - t.arrived_ns,
                                     t.compute_start_ns - t.dequeued_ns, t.compute_end_ns - t.compute_start_ns,
                                     t.done_ns - t.compute_end_ns};
      for (int k = 0; k < 5; ++k) hop_us[h][static_cast<std::size_t>(k)].push_back(static_cast<double>(spans[k]) / 1e3);
    }
  };
  auto hops_json = [&] {
    std::string out;
    for (std::size_t h = 0; h < hop_us.size(); ++h) {
      out += h ? ",[" : "[";
      for (std::size_t k = 0; k < 5; ++k) out += fmt::format("{}{:.0f}", k ? "," : "", bf::bench::percentile(hop_us[h][k], 0.5));
      out += "]";
    }
    return out;
  };
  const std::string channel_label = workers ? (channel == "zmq" ? "zmq-ipc" : channel) : "inproc";
  struct Summary {
    double e2e, mono, overhead;
  };
  auto summarize = [&] {  // after the runs: the metrics snapshot if asked for, and the p50s
    if (std::getenv("BENCH_METRICS") != nullptr) std::cerr << session.metrics().to_json(1) << "\n";
    return Summary{bf::bench::percentile(e2e_ms, 0.5), bf::bench::percentile(mono_ms, 0.5),
                   bf::bench::percentile(overhead_ms, 0.5)};
  };
  if (device == "cuda") {
    // Client-side times up to the result on the host, both sides alike.
    auto timed = [&](const char* task, double& ms) {
      const std::int64_t t0 = bf::detail::now_ns();
      bf::Result r = session.submit(task, x).get();
      if (!r.ok()) throw std::runtime_error(r.status.ToString());
      (void)r.output().cpu();
      ms = static_cast<double>(bf::detail::now_ns() - t0) / 1e6;
      return r;
    };
    for (int i = -warmup; i < requests; ++i) {
      double split = 0, mono = 0;
      const bf::Result r = timed("split", split);
      (void)timed("whole", mono);
      if (i < 0) continue;
      e2e_ms.push_back(split);
      mono_ms.push_back(mono);
      overhead_ms.push_back(r.trace.overhead_ms());
      record_hops(r);
    }
    // Saturation: 16 requests in flight, 10 x `requests` completions.
    auto saturation = [&](const char* task) {
      std::deque<std::future<bf::Result>> window;
      const int total = 10 * requests;
      const std::int64_t t0 = bf::detail::now_ns();
      int submitted = 0;
      for (; submitted < 16; ++submitted) window.push_back(session.submit(task, x));
      for (int done = 0; done < total; ++done) {
        bf::Result r = window.front().get();
        window.pop_front();
        if (!r.ok()) throw std::runtime_error(r.status.ToString());
        (void)r.output().cpu();
        if (submitted < total) {
          window.push_back(session.submit(task, x));
          ++submitted;
        }
      }
      return total / (static_cast<double>(bf::detail::now_ns() - t0) / 1e9);
    };
    const double split_rps = saturation("split"), mono_rps = saturation("whole");
    const Summary sum = summarize();
    fmt::print(
        "{{\"bench\":\"pipeline\",\"mode\":\"{}\",\"channel\":\"{}\",\"device\":\"{}\",\"threads_per_block\":{},"
        "\"requests\":{},\"e2e_p50_ms\":{:.3f},\"monolithic_p50_ms\":{:.3f},\"ratio\":{:.4f},\"overhead_p50_ms\":{:.4f},"
        "\"saturation_rps\":{:.1f},\"monolithic_saturation_rps\":{:.1f},\"hops_us\":[{}]}}\n",
        mode, channel_label, bf::bench::gpu_name(), threads, requests, sum.e2e, sum.mono, sum.e2e / sum.mono, sum.overhead,
        split_rps, mono_rps, hops_json());
    return 0;
  }
  // Alternating rounds: `round` split requests, then `round` monolithic ones; the first 2 of each
  // round are not counted (the other model's threads may still be spinning down).
  const int skip = round > 2 ? 2 : 0;
  for (int i = 0; i < warmup; ++i) {
    (void)session.submit("split", x).get();
    (void)session.submit("whole", x).get();
  }
  while (static_cast<int>(e2e_ms.size()) < requests || static_cast<int>(mono_ms.size()) < requests) {
    for (int j = 0; j < round; ++j) {
      const bf::Result r = session.submit("split", x).get();
      if (!r.ok()) throw std::runtime_error(r.status.ToString());
      if (j < skip || static_cast<int>(e2e_ms.size()) >= requests) continue;
      e2e_ms.push_back(r.trace.e2e_ms());
      overhead_ms.push_back(r.trace.overhead_ms());
      record_hops(r);
    }
    for (int j = 0; j < round; ++j) {
      const bf::Result m = session.submit("whole", x).get();
      if (!m.ok()) throw std::runtime_error(m.status.ToString());
      if (j < skip || static_cast<int>(mono_ms.size()) >= requests) continue;
      mono_ms.push_back(m.trace.compute_ms());  // the model alone: its forward() time
    }
  }
  const Summary sum = summarize();
  fmt::print(
      "{{\"bench\":\"pipeline\",\"mode\":\"{}\",\"channel\":\"{}\",\"threads_per_block\":{},\"requests\":{},"
      "\"e2e_p50_ms\":{:.3f},\"monolithic_p50_ms\":{:.3f},\"ratio\":{:.4f},\"overhead_p50_ms\":{:.4f},\"round\":{},"
      "\"worker_env\":\"{}\",\"outputs_in_slots\":{},\"direct_edges\":{},\"optimize_for_inference\":{},\"hardware_threads\":{},\"hops_us\":[{}]}}\n",
      mode, channel_label, threads, requests, sum.e2e, sum.mono, sum.e2e / sum.mono, sum.overhead, round,
      workers ? worker_env.value_or(fmt::format("{}", fmt::join(bf::WorkerOptions{}.environment, " "))) : "",
      workers && channel != "zmq" && outputs_in_slots, workers && channel == "zmq" && direct_edges, optimize, std::thread::hardware_concurrency(),
      hops_json());
  return 0;
} catch (const std::exception& e) {
  std::cerr << "pipeline_bench: " << e.what() << "\n";
  return 1;
}
