// memory_budget (issue 19): six TorchScript blocks for three tasks, round-robin, on the session's
// threads with blocks loaded on demand (SessionOptions::MemoryPolicy::kOnDemand):
//   task_a  block1 -> block2 -> block3 -> block4   (the split ResNet50)
//   task_b  block1 -> block2 -> block3 -> head_b   (its second head)
//   task_c  monolithic_b                            (the whole second model)
// One process per run (scripts/bench.sh memory_budget alternates them): `--budget-mb 0` is the
// unlimited run (a budget far above every block: each loads once, none is unloaded); a budget below
// the blocks' total makes them take turns. One closed-loop client sends task_a, task_b, task_c, ...
// after a warm-up round; a thread samples the process's resident memory every 100 ms. Prints one
// JSON line: the budget, the blocks' measured footprints, the largest resident memory the blocks
// took (sampled RSS over the RSS before start(): while serving, `max_blocks_rss_mb`, and during
// start(), whose first build of each block holds copies of its weights for a moment,
// `max_blocks_rss_start_mb`), failed requests, p50/p99 e2e, loads, evictions, and the mean time of
// one load: the floor a request that loads pays on top of its compute.
//
// With --footprints (what an unlimited run measured, as a profile would give them), the blocks carry
// them as BlockOptions::memory_bytes and are not measured again.
//
// With --measure process, the budget bounds the process's growth since start(), not only the
// blocks' footprints (SessionOptions::MemoryMeasure::kProcess).
//
// With --prefetch 1, SessionOptions::prefetch is on. --swap says how an unloaded block comes back
// (SessionOptions::swap): "on" (the default) pages its weights back in from its swap file, "cold"
// too but from the disk (the page cache dropped at each unload), "off" builds it again.
//
// usage: memory_budget_bench --models DIR [--budget-mb MB] [--footprints NAME=MB,...] [--requests N] [--threads T]
//                            [--prefetch 0|1] [--swap on|cold|off] [--measure blocks|process]
#include "bench_util.hpp"
#include "resnet_split.hpp"

#include <blockflow/blockflow.hpp>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

namespace bf = blockflow;

namespace {

std::int64_t rss_bytes() { return bf::sample_process().rss_bytes; }

// The kernel's exact peak of this process's resident memory (VmHWM), and its reset (clear_refs 5):
// what 100 ms sampling may miss, such as a build's copies of its weights for a few milliseconds.
std::int64_t peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return 0;
}
bool reset_peak_rss() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  return static_cast<bool>(clear.flush());
}

}  // namespace

int main(int argc, char** argv) try {
  std::string models;
  double budget_mb = 0;
  int requests = 60;
  int threads = 2;
  bool prefetch = false;
  std::string swap = "on";
  bool process = false;  // --measure process: SessionOptions::MemoryMeasure::kProcess
  std::map<std::string, double> footprint_mb;  // --footprints name=MB,...: the blocks' profiles
  bf::bench::parse_options(argc, argv, [&](const std::string& k, const std::string& v) {
    if (k == "--footprints") {
      std::stringstream list(v);
      for (std::string item; std::getline(list, item, ',');) {
        footprint_mb[item.substr(0, item.find('='))] = std::stod(item.substr(item.find('=') + 1));
      }
    } else if (k == "--models") models = v;
    else if (k == "--budget-mb") budget_mb = std::stod(v);
    else if (k == "--requests") requests = std::stoi(v);
    else if (k == "--threads") threads = std::stoi(v);
    else if (k == "--prefetch") prefetch = v == "1";
    else if (k == "--swap" && (v == "on" || v == "cold" || v == "off")) swap = v;
    else if (k == "--measure" && (v == "blocks" || v == "process")) process = v == "process";
    else return false;
    return true;
  });
  if (models.empty()) throw std::invalid_argument("usage: memory_budget_bench --models DIR [--budget-mb MB] [--requests N]");

  bf::SessionOptions options;
  options.intra_op_threads = threads;
  options.memory_policy = bf::SessionOptions::MemoryPolicy::kOnDemand;
  options.memory_measure = process ? bf::SessionOptions::MemoryMeasure::kProcess : bf::SessionOptions::MemoryMeasure::kBlocks;
  options.prefetch = prefetch;
  options.swap.enabled = swap != "off";
  options.swap.drop_page_cache = swap == "cold";
  options.memory_budget = budget_mb > 0 ? static_cast<std::int64_t>(budget_mb * 1048576.0) : (std::int64_t{1} << 40);
  const std::int64_t rss_before = rss_bytes();
  bf::Session session(options);
  auto block = [&](const std::string& name, std::vector<std::int64_t> shape) {
    bf::BlockDescription d = bf::bench::model_block(models, name, std::move(shape), threads, true);
    if (footprint_mb.count(name) != 0) d.options.memory_bytes = static_cast<std::int64_t>(footprint_mb[name] * 1048576.0);
    session.add_block(d);
  };
  for (const auto& [name, shape] : bf::bench::resnet_split_stages()) block(name, shape);
  block("head_b", {1, 1024, 14, 14});
  block("monolithic_b", {1, 3, 224, 224});
  session.add_path(bf::Path::chain("task_a", {"block1", "block2", "block3", "block4"}));
  session.add_path(bf::Path::chain("task_b", {"block1", "block2", "block3", "head_b"}));
  session.add_path(bf::Path::chain("task_c", {"monolithic_b"}));

  std::atomic<std::int64_t> max_rss{rss_bytes()};
  std::atomic<bool> sampling{true};
  std::thread sampler([&] {
    while (sampling.load()) {
      const std::int64_t now = rss_bytes();
      std::int64_t seen = max_rss.load();
      while (now > seen && !max_rss.compare_exchange_weak(seen, now)) {
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  auto stop_sampler = [&] {
    sampling = false;
    if (sampler.joinable()) sampler.join();
  };
  if (auto status = session.start(); !status.ok()) {
    stop_sampler();
    fmt::print(stderr, "memory_budget_bench: {}\n", status.ToString());
    return 1;
  }
  const std::vector<std::string> tasks = {"task_a", "task_b", "task_c"};
  const at::Tensor x = at::randn({1, 3, 224, 224});
  // start()'s builds (each block's first load: deserialising, freezing and optimising make copies
  // of its weights for a moment) apart from what serving takes.
  const std::int64_t max_rss_start = std::max(max_rss.exchange(rss_bytes()), rss_bytes());
  const std::int64_t peak_start = peak_rss_bytes();
  const bool peak_reset = reset_peak_rss();
  for (const auto& task : tasks) (void)session.submit(task, x).get();  // warm-up round, not measured
  const auto warm = session.metrics();
  std::vector<double> e2e;
  double load_ms = 0;
  int failed = 0;
  for (int i = 0; i < requests; ++i) {
    bf::Result r = session.submit(tasks[static_cast<std::size_t>(i) % tasks.size()], x).get();
    if (!r.ok()) {
      ++failed;
      fmt::print(stderr, "memory_budget_bench: {}\n", r.status.ToString());
      continue;
    }
    e2e.push_back(r.trace.e2e_ms());
    load_ms += r.trace.load_ms();
  }
  const auto m = session.metrics();
  const std::int64_t peak_serving = peak_reset ? peak_rss_bytes() : 0;
  stop_sampler();
  session.shutdown();

  const bf::SiteMemory* site = nullptr;
  for (const auto& s : m.memory) {
    if (s.site == "threads") site = &s;
  }
  const bf::SiteMemory* warm_site = nullptr;
  for (const auto& s : warm.memory) {
    if (s.site == "threads") warm_site = &s;
  }
  if (site == nullptr || warm_site == nullptr) throw std::runtime_error("no memory figures for the threads");
  nlohmann::json footprints = nlohmann::json::object();
  double total_mb = 0;
  for (const auto& b : m.blocks) {
    footprints[b.name] = std::round(static_cast<double>(b.footprint_bytes) / 1048576.0 * 10) / 10;
    total_mb += static_cast<double>(b.footprint_bytes) / 1048576.0;
  }
  const std::uint64_t loads = site->loads - warm_site->loads;
  const double load_s = site->load_s - warm_site->load_s;
  auto round1 = [](double v) { return std::round(v * 10) / 10; };
  nlohmann::json line = {
      {"bench", "memory_budget"},
      {"budget_mb", budget_mb > 0 ? round1(budget_mb) : 0.0},
      {"prefetch", prefetch},
      {"prefetches", site->prefetches - warm_site->prefetches},
      {"swap", swap},
      {"measure", process ? "process" : "blocks"},
      {"swap_ins", site->swap_ins - warm_site->swap_ins},
      {"swapped_mb_at_end", round1(static_cast<double>(site->swapped_bytes) / 1048576.0)},
      {"blocks_total_mb", round1(total_mb)},
      {"footprint_mb", footprints},
      {"rss_before_mb", round1(static_cast<double>(rss_before) / 1048576.0)},
      {"max_rss_mb", round1(static_cast<double>(max_rss.load()) / 1048576.0)},
      {"max_blocks_rss_mb", round1(static_cast<double>(max_rss.load() - rss_before) / 1048576.0)},
      {"max_blocks_rss_start_mb", round1(static_cast<double>(max_rss_start - rss_before) / 1048576.0)},
      // The exact peaks over the same RSS (VmHWM; the serving one 0 where it could not be reset).
      {"peak_blocks_rss_start_mb", round1(static_cast<double>(peak_start - rss_before) / 1048576.0)},
      {"peak_blocks_rss_mb", peak_reset ? round1(static_cast<double>(peak_serving - rss_before) / 1048576.0) : 0.0},
      {"requests", requests},
      {"failed", failed},
      {"p50_ms", round1(bf::bench::percentile(e2e, 0.5))},
      {"p99_ms", round1(bf::bench::percentile(e2e, 0.99))},
      {"load_ms_per_request", round1(e2e.empty() ? 0.0 : load_ms / static_cast<double>(e2e.size()))},
      {"loads", loads},
      {"evictions", site->evictions - warm_site->evictions},
      {"ms_per_load", round1(loads > 0 ? load_s * 1e3 / static_cast<double>(loads) : 0.0)},
      {"threads", threads},
      {"cpu", bf::bench::cpu_model()},
      {"hardware_threads", std::thread::hardware_concurrency()}};
  fmt::print("{}\n", line.dump());
  return failed == 0 ? 0 : 1;
} catch (const std::exception& e) {
  fmt::print(stderr, "memory_budget_bench: {}\n", e.what());
  return 2;
}
