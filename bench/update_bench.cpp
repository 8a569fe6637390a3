// update: live updates under Poisson traffic on the split ResNet50 (threads, 2 intra-op threads per
// block). Two kinds of update, each applied several times while requests flow:
//   reroute  task_a alternates between ...block4 and ...head_b (no block added or removed)
//   add      a block (the monolithic model, loaded and warmed from its file) joins, then leaves
//   add_worker  the same block placed in a worker process that the update starts (and the next
//            update stops again when it removes the block)
// Prints one line per kind:
//   {"bench":"update","kind":"reroute","blocks_changed":0,"tasks_rerouted":1,"updates":N,
//    "apply_ms_p50":..,"apply_ms_max":..,"lost":0,"failed":0,"requests":..}
// apply_ms is the time apply() takes to return: from then on every new request takes the new route.
// For "add" it includes loading and warming the new block, and removing it includes its drain;
// "load_ms_p50" is that loading part alone (metrics().last_update.load_ms: for add_worker, starting
// the worker process too), "route_ms_p50" the publishing of the new routes.
// Per kind, counted since the previous line: requests = sent, failed = resolved with an error;
// lost = requests still unresolved 30 s after the kind's last update (traffic goes on, so the count
// is taken at the first moment none is in flight: 0 unless one never resolved). requests_total and
// failed_total: since the start. Every line carries the CPU model and hardware threads.
//
//   update_bench --models DIR [--rate R] [--updates N] [--threads T]

#include "bench_util.hpp"

#include <blockflow/core/detail/flag_number.hpp>
#include <blockflow/blockflow.hpp>
#include <blockflow/worker/worker_site.hpp>
#include <blockflow/deploy/deployment.hpp>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <atomic>
#include <deque>
#include <chrono>
#include <iostream>
#include <random>
#include <thread>

namespace bf = blockflow;
using Clock = std::chrono::steady_clock;

namespace {

std::string block(const std::string& models, const std::string& name, const std::string& shape, int threads) {
  return fmt::format(R"({{"name": "{}", "torchscript": "{}/{}.pt", "intra_op_threads": {}, "input_shapes": [{}], "warmup_runs": 1}})",
                     name, models, name, threads, shape);
}

}  // namespace

int main(int argc, char** argv) try {
  std::string models;
  double rate = 6;
  int updates = 10, threads = 2;
  bf::bench::parse_options(argc, argv, [&](const std::string& a, const std::string& v) {
    if (a == "--models") models = v;
    else if (a == "--rate") rate = bf::detail::flag_number(a, v, 0.1, 1e5);
    else if (a == "--updates") updates = bf::detail::flag_number(a, v, 1, 100000);
    else if (a == "--threads") threads = bf::detail::flag_number(a, v, 1, 1024);
    else return false;
    return true;
  });
  if (models.empty()) throw std::invalid_argument("usage: update_bench --models DIR [--rate R] [--updates N] [--threads T]");
  const std::string blocks = fmt::format("{}, {}, {}, {}, {}", block(models, "block1", "[-1, 3, 224, 224]", threads),
                                         block(models, "block2", "[-1, 256, 56, 56]", threads),
                                         block(models, "block3", "[-1, 512, 28, 28]", threads),
                                         block(models, "block4", "[-1, 1024, 14, 14]", threads),
                                         block(models, "head_b", "[-1, 1024, 14, 14]", threads));
  auto deployment = [&](const std::string& head, bool with_monolithic, const std::string& placement = "") {
    std::string mono = block(models, "monolithic", "[-1, 3, 224, 224]", threads);
    if (!placement.empty()) mono.insert(mono.size() - 1, fmt::format(R"(, "placement": "{}")", placement));
    const std::string extra = with_monolithic ? ", " + mono : "";
    const std::string mono_task = with_monolithic ? R"(, "whole": ["monolithic"])" : "";
    auto d = bf::Deployment::parse(fmt::format(R"({{"blocks": [{}{}], "tasks": {{"task_a": ["block1", "block2", "block3", "{}"]{}}}}})",
                                               blocks, extra, head, mono_task));
    if (!d.ok()) throw std::runtime_error(d.status().ToString());
    return *d;
  };

  bf::Session session;
  bf::add_deployment(session, bf::Deployment{});  // only installs the factory of worker sites
  const bf::Deployment first = deployment("block4", false);
  for (const auto& b : first.blocks) session.add_block(b);
  for (auto& p : first.paths()) session.add_path(std::move(p));
  if (auto status = session.start(); !status.ok()) throw std::runtime_error(status.ToString());

  // Each update kind's requests: those sent while its updates applied and settled, and of them the
  // ones that failed and those still unresolved, whenever they resolve (adds and removes take turns).
  struct Window {
    std::atomic<long> sent{0}, failed{0}, resolved{0};
  };
  struct Timing {
    std::vector<double> apply, load, route;
    Window requests;
  };
  // Poisson traffic on task_a for the whole run; each request counted to the window open when it was sent.
  std::atomic<long> sent{0}, resolved{0}, failed{0};
  std::atomic<Window*> open_window{nullptr};
  const bf::Tensor x = at::randn({1, 3, 224, 224});
  bf::bench::PoissonTraffic traffic(rate, [&] {
    ++sent;
    Window* window = open_window.load();
    if (window != nullptr) ++window->sent;
    session.submit("task_a", {x}, [&, window](bf::Result&& r) {
      if (!r.ok()) ++failed;
      if (window != nullptr && !r.ok()) ++window->failed;
      if (window != nullptr) ++window->resolved;
      ++resolved;
    });
  });
  // Runs `step` (an update and its settling time) with `t`'s window open.
  auto counted = [&](Timing& t, const auto& step) {
    open_window = &t.requests;
    step();
    open_window = nullptr;
  };
  auto timed_apply = [&](const bf::Deployment& d, Timing& t) {
    const auto t0 = Clock::now();
    auto v = session.apply(d);
    if (!v.ok()) throw std::runtime_error(v.status().ToString());
    t.apply.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    const auto last = session.metrics().last_update;
    t.load.push_back(last.load_ms);
    t.route.push_back(last.route_ms);
  };
  auto report = [&](const char* kind, int blocks_changed, int rerouted, const Timing& t) {
    const std::vector<double>& ms = t.apply;
    // Let what is in flight finish before counting: the first moment nothing is (sent read first,
    // so a request sent after it can only make the difference smaller).
    const auto until = Clock::now() + std::chrono::seconds(30);
    long outstanding = 0, sent_now = 0;
    while (true) {
      sent_now = sent.load();
      outstanding = std::max(0L, sent_now - resolved.load());
      if (outstanding == 0 || Clock::now() >= until) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    const long failed_now = failed.load();
    const long lost = t.requests.sent.load() - t.requests.resolved.load();  // this kind's, unresolved after the wait
    fmt::print("{{\"bench\":\"update\",\"kind\":\"{}\",\"blocks_changed\":{},\"tasks_rerouted\":{},\"updates\":{},"
               "\"apply_ms_p50\":{:.3f},\"apply_ms_max\":{:.3f},\"load_ms_p50\":{:.3f},\"route_ms_p50\":{:.3f},"
               "\"lost\":{},\"failed\":{},\"requests\":{},\"failed_total\":{},\"requests_total\":{},\"rate_per_s\":{},"
               "\"threads_per_block\":{},{}}}\n",
               kind, blocks_changed, rerouted, ms.size(), bf::bench::percentile(ms, 0.5),
               *std::max_element(ms.begin(), ms.end()), bf::bench::percentile(t.load, 0.5),
               bf::bench::percentile(t.route, 0.5), lost, t.requests.failed.load(), t.requests.sent.load(), failed_now,
               sent_now, rate, threads, bf::bench::machine_json());
    std::fflush(stdout);
  };

  std::this_thread::sleep_for(std::chrono::seconds(1));
  std::deque<Timing> timings;  // each kind's, alive until the session has resolved every request
  Timing& reroute = timings.emplace_back();
  for (int u = 0; u < updates; ++u) {
    counted(reroute, [&] {
      timed_apply(deployment(u % 2 == 0 ? "head_b" : "block4", false), reroute);
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
    });
  }
  report("reroute", 0, 1, reroute);

  for (const std::string placement : {"", "wm"}) {
    Timing& add = timings.emplace_back();
    Timing& remove = timings.emplace_back();
    for (int u = 0; u < std::max(1, updates / 4); ++u) {
      counted(add, [&] {
        timed_apply(deployment("block4", true, placement), add);
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
      });
      counted(remove, [&] {
        timed_apply(deployment("block4", false), remove);
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
      });
    }
    report(placement.empty() ? "add" : "add_worker", 1, 0, add);
    report(placement.empty() ? "remove" : "remove_worker", 1, 0, remove);
  }
  traffic.stop();
  session.shutdown();
  return 0;
} catch (const std::exception& e) {
  std::cerr << "update_bench: " << e.what() << "\n";
  return 1;
}
