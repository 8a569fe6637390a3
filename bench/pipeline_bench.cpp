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
//  "e2e_p50_ms":..,"monolithic_p50_ms":..,"ratio":..,"overhead_p50_ms":..,"trace_e2e_p50_ms":..,"round":..}
// e2e and the in-session monolithic model are timed by the client, submit() to get() (the caller's
// wait, its wake-up included, as the clean process times its whole forward()); trace_e2e_p50_ms is
// the requests' own traces (submit's entry to the result), which leave those out.
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
// per second with 16 requests kept in flight, and "monolithic_alone_p50_ms" with "ratio_alone": the
// eager monolithic model in a clean process of its own on the same GPU (input to the GPU, forward,
// result to the host), one pass between each pair of the session's requests.
// In workers mode (CPU) the line adds the floor of any one-block-per-process pipeline, measured in
// the same alternating rounds (bench/process_chain.hpp: the four blocks in four clean processes, one
// after the other, nothing moved): "split_processes_p50_ms", "split_processes_over_monolithic_alone"
// and "ratio_split_processes" = e2e p50 / that floor. Over channel zmq the line adds the floor of any
// serialized channel, the same chain with each request's tensors crossing Unix sockets as raw bytes:
// "split_processes_serialized_p50_ms", "split_processes_serialized_over_monolithic_alone" and
// "ratio_split_processes_serialized".
// CPU lines also give "session_start_ms": Session::start() (sites started at once, blocks loaded and
// warmed up).
// Every pipeline line ends with "hops_us": per block, the p50 in microseconds of [hand-off in,
// queue, to the block (for a worker: the relay into its process), compute, hand-off out].
//
//   pipeline_bench --models DIR [--mode threads|workers|worker_memory] [--channel shm|zmq|cuda] [--requests N]
//                  [--threads T] [--worker-env "K=V ..."] [--device cpu|cuda] [--round N]
//                  [--cuda-graph 0|1] [--receive-spin-us US] [--outputs-in-slots 0|1] [--optimize 0|1] [--direct-edges 0|1]
// --optimize 1: every block and the monolithic model also go through
// torch::jit::optimize_for_inference after freezing (TorchScriptOptions); lines say which.
// --outputs-in-slots 1: workers allocate their blocks' activations in their result slots, so that an
// output crosses as it lies (WorkerOptions::shm_outputs_in_slots true), instead of copying each
// output into a slot when they send it (the default); lines say which.
// --direct-edges 0 (channel zmq): every block output comes back to the session, which sends it on
// to the next worker (WorkerOptions::direct_edges false), instead of going from worker to worker;
// lines say which ("direct_edges", true only for zmq).
// Environment: BENCH_METRICS=1 prints the session's metrics JSON to stderr after the runs;
// BENCH_SAMPLING=MS turns KPI sampling on at that period; BENCH_NVIDIA_SMI=1 prints nvidia-smi's
// process and device figures right after the metrics (scripts/gpu.sh kpi compares the two).

#include "alone_process.hpp"
#include "process_chain.hpp"
#include "bench_util.hpp"
#include "resnet_split.hpp"

#include <blockflow/blockflow.hpp>
#include <blockflow/worker/worker_site.hpp>
#include <blockflow/core/detail/clock.hpp>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <fmt/format.h>

#include <fmt/ranges.h>

#include <absl/strings/str_split.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <deque>
#include <future>
#include <iostream>
#include <optional>
#include <thread>

namespace bf = blockflow;

// host_app: the application's own monolithic model next to a started, idle session of the four
// blocks in threads, against the same model in a clean process of its own, in alternating rounds.
// --app-on lane: the application runs its model through Session::run_on_lane() (what docs/lanes.md
// tells it to do; timed around the whole call); --app-on thread: on its own thread, with its own
// OpenMP team of --threads (the process then holds more OpenMP threads than the lanes).
int host_app(const std::string& models, int requests, int threads, int round, bool optimize, const std::string& app_on) {
  if (app_on != "lane" && app_on != "thread") throw std::invalid_argument("--app-on lane|thread");
  bf::Session session;
  for (const auto& [name, shape] : bf::bench::resnet_split_stages()) {
    session.add_block(bf::bench::model_block(models, name, shape, threads, optimize));
  }
  session.add_path(bf::Path::chain("split", {"block1", "block2", "block3", "block4"}));
  if (auto status = session.start(); !status.ok()) throw std::runtime_error(status.ToString());
  bf::BlockDescription md;
  md.name = "app_model";
  md.torchscript = models + "/monolithic.pt";
  md.torchscript_options.optimize_for_inference = optimize;
  std::shared_ptr<bf::Block> app_model;
  at::Tensor x;
  auto load = [&] {
    auto made = bf::make_block(md);
    if (!made.ok()) throw std::runtime_error(made.status().ToString());
    app_model = *made;
    x = at::randn({1, 3, 224, 224});
  };
  auto forward = [&] {
    c10::InferenceMode inference_mode;
    if (!app_model->forward({x}).ok()) throw std::runtime_error("app model failed");
  };
  if (app_on == "lane") {
    session.run_on_lane(load).get();
  } else {
    at::internal::lazy_init_num_threads();
    at::set_num_threads(threads);
    load();
  }
  auto timed = [&] {
    const std::int64_t t0 = bf::detail::now_ns();
    if (app_on == "lane") session.run_on_lane(forward).get();
    else forward();
    return static_cast<double>(bf::detail::now_ns() - t0) / 1e6;
  };
  for (int i = 0; i < 3; ++i) (void)timed();
  bf::bench::AloneProcess alone(models + "/monolithic.pt", threads, {1, 3, 224, 224}, optimize);
  const int skip = round > 2 ? 2 : 0;
  std::vector<double> app_ms, alone_ms;
  while (static_cast<int>(app_ms.size()) < requests || static_cast<int>(alone_ms.size()) < requests) {
    for (int j = 0; j < round; ++j) {
      const double ms = timed();
      if (j >= skip && static_cast<int>(app_ms.size()) < requests) app_ms.push_back(ms);
    }
    const auto clean = alone.run(round);
    for (int j = skip; j < round && static_cast<int>(alone_ms.size()) < requests; ++j) alone_ms.push_back(clean[static_cast<std::size_t>(j)]);
  }
  const double app = bf::bench::percentile(app_ms, 0.5), base = bf::bench::percentile(alone_ms, 0.5);
  const auto m = session.metrics();
  fmt::print("{{\"bench\":\"host_app\",\"app_on\":\"{}\",\"blocks\":4,\"threads\":{},\"lanes\":{},\"requests\":{},"
             "\"app_p50_ms\":{:.3f},\"monolithic_alone_p50_ms\":{:.3f},\"ratio\":{:.4f},\"process_threads\":{},"
             "\"hardware_threads\":{},\"cpu\":\"{}\"}}\n",
             app_on, threads, m.lanes.size(), requests, app, base, app / base, bf::bench::process_threads(),
             std::thread::hardware_concurrency(), bf::bench::cpu_model());
  return 0;
}

int main(int argc, char** argv) try {
  std::string models, mode = "threads", channel = "shm", device = "cpu", model, shape, app_on = "lane";
  std::optional<std::string> worker_env;  // "K=V K=V": replaces WorkerOptions::environment
  int requests = 100, threads = 2, warmup = 5, round = 20;
  std::optional<int> spin_us;  // WorkerOptions::receive_spin
  bool outputs_in_slots = bf::WorkerOptions{}.shm_outputs_in_slots;
  bool direct_edges = bf::WorkerOptions{}.direct_edges;
  bool optimize = bf::TorchScriptOptions{}.optimize_for_inference;
  bool busy_poll = false;   // --busy-poll 1: WorkerOptions::busy_poll
  bool serialized = false;  // --mode stage: the chain carries the tensors' bytes (ProcessChain)
  bool cuda_graph = false;  // --cuda-graph 1 (with --device cuda): the split's blocks replay CUDA graphs
  bf::bench::parse_options(argc, argv, [&](const std::string& a, const std::string& v) {
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
    else if (a == "--cuda-graph") cuda_graph = std::stoi(v) != 0;
    else if (a == "--busy-poll") busy_poll = std::stoi(v) != 0;
    else if (a == "--model") model = v;      // --mode alone (the baseline process), stage
    else if (a == "--shape") shape = v;      // --mode alone, stage
    else if (a == "--app-on") app_on = v;    // --mode host_app: lane | thread
    else if (a == "--serialized") serialized = std::stoi(v) != 0;  // --mode stage
    else return false;
    return true;
  });
  if (mode == "alone" || mode == "stage") {
    std::vector<std::int64_t> dims;
    for (const auto& d : absl::StrSplit(shape, ',')) dims.push_back(std::stoll(std::string(d)));
    return mode == "stage" ? bf::bench::ProcessChain::serve(model, threads, dims, optimize, serialized)
                           : bf::bench::AloneProcess::serve(model, threads, dims, optimize, device);
  }
  if (models.empty()) throw std::invalid_argument("usage: pipeline_bench --models DIR [--requests N] [--threads T]");
  if (mode == "host_app") return host_app(models, requests, threads, round, optimize, app_on);

  auto blocks = bf::bench::resnet_split_stages();
  blocks.emplace_back("monolithic", std::vector<std::int64_t>{1, 3, 224, 224});
  const bool sampler_cost = mode == "sampler_cost";
  const bool workers = mode == "workers" || sampler_cost;
  const bool memory = mode == "worker_memory";
  if (!workers && !memory && mode != "threads") {
    throw std::invalid_argument("--mode threads|workers|worker_memory|sampler_cost");
  }
  const std::vector<std::string> worker_environment =
      worker_env ? std::vector<std::string>(absl::StrSplit(*worker_env, ' ', absl::SkipEmpty())) : bf::WorkerOptions{}.environment;
  bf::Session session;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    bf::BlockDescription d = bf::bench::model_block(models, blocks[i].first, blocks[i].second, threads, optimize);
    if (device == "cuda") d.options.device = "cuda:0";
    d.options.cuda_graph = cuda_graph && d.name != "monolithic";  // the baseline stays eager
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
    o.environment = worker_environment;
    if (spin_us) o.receive_spin = absl::Microseconds(*spin_us);
    o.busy_poll = busy_poll;
    o.shm_outputs_in_slots = outputs_in_slots;
    o.direct_edges = direct_edges;
    session.add_site(bf::make_worker(o));
  }
  session.add_path(bf::Path::chain("split", {"block1", "block2", "block3", "block4"}));
  if (!memory) session.add_path(bf::Path::chain("whole", {"monolithic"}));
  const std::int64_t start_t0 = bf::detail::now_ns();
  if (auto status = session.start(); !status.ok()) throw std::runtime_error(status.ToString());
  // start(): every site started (at once) and every block loaded and warmed up.
  const double start_ms = static_cast<double>(bf::detail::now_ns() - start_t0) / 1e6;
  if (memory) {
    const auto site = session.metrics().sites.at(0);
    fmt::print("{{\"bench\":\"worker_memory\",{},\"rss_idle_mb\":{:.1f},\"rss_loaded_mb\":{:.1f},\"blocks\":4,"
               "\"threads_per_block\":{}}}\n",
               bf::bench::machine_json(), static_cast<double>(site.rss_idle_bytes) / 1048576.0, static_cast<double>(site.rss_bytes) / 1048576.0,
               threads);
    return 0;
  }

  // BENCH_SAMPLING=MS: KPI sampling on in the host and every worker at that period (scripts/gpu.sh kpi).
  if (const char* ms = std::getenv("BENCH_SAMPLING"); ms != nullptr && !sampler_cost) {
    session.set_sampling(true, absl::Milliseconds(std::max(10, std::atoi(ms))));
  }
  // Made on a lane: this thread makes no OpenMP team of its own (docs/lanes.md).
  const bf::Tensor x = session.run_on_lane([] { return at::randn({1, 3, 224, 224}); }).get();
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
    fmt::print("{{\"bench\":\"sampler_cost\",{},\"e2e_p50_ms_off\":{:.3f},\"e2e_p50_ms_on\":{:.3f},\"ratio\":{:.4f},"
               "\"period_ms\":100,\"requests_off\":{},\"requests_on\":{},\"channel\":\"{}\",\"threads_per_block\":{}}}\n",
               bf::bench::machine_json(), off, on, on / off, off_ms.size(), on_ms.size(), channel, threads);
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
    if (std::getenv("BENCH_METRICS") != nullptr) {
      std::cerr << session.metrics().to_json(1) << "\n";
      // BENCH_NVIDIA_SMI: the driver's own view at the same moment, to check the KPI sampler's GPU
      // columns against (scripts/gpu.sh kpi).
      if (std::getenv("BENCH_NVIDIA_SMI") != nullptr) {
        std::cerr.flush();
        (void)std::system(
            "nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 1>&2; "
            "nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu,power.draw,clocks.sm "
            "--format=csv,noheader 1>&2");
      }
    }
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
    // The baseline a user would run instead: the eager monolithic model in a clean process of its
    // own, on the same GPU, one pass between each pair of the session's requests.
    bf::bench::AloneProcess alone(models + "/monolithic.pt", threads, {1, 3, 224, 224}, optimize, "cuda");
    std::vector<double> alone_ms;
    for (int i = -warmup; i < requests; ++i) {
      double split = 0, mono = 0;
      const bf::Result r = timed("split", split);
      (void)timed("whole", mono);
      const double clean = alone.run(1).at(0);
      if (i < 0) continue;
      e2e_ms.push_back(split);
      mono_ms.push_back(mono);
      alone_ms.push_back(clean);
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
    const double mono_alone = bf::bench::percentile(alone_ms, 0.5);
    fmt::print(
        "{{\"bench\":\"pipeline\",\"mode\":\"{}\",\"channel\":\"{}\",\"device\":\"{}\",\"threads_per_block\":{},"
        "\"requests\":{},\"e2e_p50_ms\":{:.3f},\"monolithic_p50_ms\":{:.3f},\"ratio\":{:.4f},"
        "\"monolithic_alone_p50_ms\":{:.3f},\"ratio_alone\":{:.4f},\"overhead_p50_ms\":{:.4f},"
        "\"saturation_rps\":{:.1f},\"monolithic_saturation_rps\":{:.1f},\"cuda_graph\":{},\"busy_poll\":{},{},\"hops_us\":[{}]}}\n",
        mode, channel_label, bf::bench::gpu_name(), threads, requests, sum.e2e, sum.mono, sum.e2e / sum.mono, mono_alone,
        sum.e2e / mono_alone, sum.overhead,
        split_rps, mono_rps, cuda_graph, busy_poll, bf::bench::machine_json(), hops_json());
    return 0;
  }
  // Alternating rounds: `round` split requests, then `round` monolithic ones in this session, then
  // `round` in a clean process of its own (the baseline a user would run instead); the first 2 of
  // each round are not counted (the other side's threads may still be spinning down).
  const int skip = round > 2 ? 2 : 0;
  bf::bench::AloneProcess alone(models + "/monolithic.pt", threads, {1, 3, 224, 224}, optimize);
  // The floor of any pipeline of these blocks: the four run one after the other, no session at all.
  const std::string chain = fmt::format("{0}/block1.pt,{0}/block2.pt,{0}/block3.pt,{0}/block4.pt", models);
  bf::bench::AloneProcess split_alone(chain, threads, {1, 3, 224, 224}, optimize);
  // Workers mode: the floor of running one block per process (bench/process_chain.hpp).
  // Channel zmq: also the floor of any serialized channel (the tensors' bytes through Unix sockets).
  std::optional<bf::bench::ProcessChain> processes, processes_serialized;
  if (workers) {
    std::vector<bf::bench::ProcessChain::Stage> stages;
    for (std::size_t i = 0; i < 4; ++i) stages.push_back({fmt::format("{}/{}.pt", models, blocks[i].first), blocks[i].second});
    processes.emplace(stages, threads, optimize, worker_environment);
    if (channel == "zmq") processes_serialized.emplace(stages, threads, optimize, worker_environment, /*serialized=*/true);
  }
  std::vector<double> alone_ms, split_alone_ms, processes_ms, serialized_ms, trace_e2e_ms;
  for (int i = 0; i < warmup; ++i) {
    (void)session.submit("split", x).get();
    (void)session.submit("whole", x).get();
  }
  auto keep = [&](std::vector<double>& into, int j, double ms) {
    if (j >= skip && static_cast<int>(into.size()) < requests) into.push_back(ms);
  };
  while (static_cast<int>(e2e_ms.size()) < requests || static_cast<int>(mono_ms.size()) < requests ||
         static_cast<int>(alone_ms.size()) < requests || static_cast<int>(split_alone_ms.size()) < requests) {
    // Timed by the client, submit() to get(): what a caller waits, its wake-up included, as the
    // clean process's timer is around the whole forward(). The trace's own e2e is kept beside it.
    for (int j = 0; j < round; ++j) {
      const std::int64_t t0 = bf::detail::now_ns();
      const bf::Result r = session.submit("split", x).get();
      const double client_ms = static_cast<double>(bf::detail::now_ns() - t0) / 1e6;
      if (!r.ok()) throw std::runtime_error(r.status.ToString());
      if (j < skip || static_cast<int>(e2e_ms.size()) >= requests) continue;
      e2e_ms.push_back(client_ms);
      trace_e2e_ms.push_back(r.trace.e2e_ms());
      overhead_ms.push_back(r.trace.overhead_ms());
      record_hops(r);
    }
    for (int j = 0; j < round; ++j) {
      const std::int64_t t0 = bf::detail::now_ns();
      const bf::Result m = session.submit("whole", x).get();
      const double client_ms = static_cast<double>(bf::detail::now_ns() - t0) / 1e6;
      if (!m.ok()) throw std::runtime_error(m.status.ToString());
      keep(mono_ms, j, client_ms);  // the model in this session, timed as the split is
    }
    const auto clean = alone.run(round);
    for (int j = 0; j < round; ++j) keep(alone_ms, j, clean[static_cast<std::size_t>(j)]);
    const auto floor = split_alone.run(round);
    for (int j = 0; j < round; ++j) keep(split_alone_ms, j, floor[static_cast<std::size_t>(j)]);
    if (processes) {
      const auto chain_ms = processes->run(round);
      for (int j = 0; j < round; ++j) keep(processes_ms, j, chain_ms[static_cast<std::size_t>(j)]);
    }
    if (processes_serialized) {
      const auto chain_ms = processes_serialized->run(round);
      for (int j = 0; j < round; ++j) keep(serialized_ms, j, chain_ms[static_cast<std::size_t>(j)]);
    }
  }
  const Summary sum = summarize();
  const double mono_alone = bf::bench::percentile(alone_ms, 0.5);
  const double split_floor = bf::bench::percentile(split_alone_ms, 0.5);
  std::string processes_json;
  if (processes) {
    const double p = bf::bench::percentile(processes_ms, 0.5);
    processes_json = fmt::format("\"split_processes_p50_ms\":{:.3f},\"split_processes_over_monolithic_alone\":{:.4f},"
                                 "\"ratio_split_processes\":{:.4f},",
                                 p, p / mono_alone, sum.e2e / p);
  }
  if (processes_serialized) {
    const double p = bf::bench::percentile(serialized_ms, 0.5);
    processes_json += fmt::format("\"split_processes_serialized_p50_ms\":{:.3f},"
                                  "\"split_processes_serialized_over_monolithic_alone\":{:.4f},"
                                  "\"ratio_split_processes_serialized\":{:.4f},",
                                  p, p / mono_alone, sum.e2e / p);
  }
  const auto m = session.metrics();
  fmt::print(
      "{{\"bench\":\"pipeline\",\"mode\":\"{}\",\"channel\":\"{}\",\"threads_per_block\":{},\"requests\":{},"
      "\"e2e_p50_ms\":{:.3f},\"monolithic_alone_p50_ms\":{:.3f},\"ratio_alone\":{:.4f},\"ratio\":{:.4f},"
      "\"split_alone_p50_ms\":{:.3f},\"split_alone_over_monolithic_alone\":{:.4f},\"ratio_split_alone\":{:.4f},{}"
      "\"monolithic_in_session_p50_ms\":{:.3f},\"ratio_in_session\":{:.4f},\"overhead_p50_ms\":{:.4f},"
      "\"trace_e2e_p50_ms\":{:.3f},\"round\":{},"
      "\"worker_env\":\"{}\",\"outputs_in_slots\":{},\"direct_edges\":{},\"optimize_for_inference\":{},\"hardware_threads\":{},"
      "\"lanes\":{},\"lane_intra_op_threads\":{},\"session_start_ms\":{:.0f},\"cpu\":\"{}\",\"hops_us\":[{}]}}\n",
      mode, channel_label, threads, requests, sum.e2e, mono_alone, sum.e2e / mono_alone, sum.e2e / mono_alone, split_floor,
      split_floor / mono_alone, sum.e2e / split_floor, processes_json, sum.mono,
      sum.e2e / sum.mono, sum.overhead, bf::bench::percentile(trace_e2e_ms, 0.5), round,
      workers ? worker_env.value_or(fmt::format("{}", fmt::join(bf::WorkerOptions{}.environment, " "))) : "",
      workers && channel != "zmq" && outputs_in_slots, workers && channel == "zmq" && direct_edges, optimize, std::thread::hardware_concurrency(),
      m.lanes.size(), m.lane_intra_op_threads, start_ms, bf::bench::cpu_model(), hops_json());
  return 0;
} catch (const std::exception& e) {
  std::cerr << "pipeline_bench: " << e.what() << "\n";
  return 1;
}
