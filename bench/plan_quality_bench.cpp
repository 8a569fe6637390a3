// plan_quality: the planner's heuristic against the exhaustive optimum of the same objective
// (plan/planner.hpp, PlanOptions::exhaustive) on 50 random synthetic instances small enough to
// search exhaustively (3 to 8 blocks, 3 sites), and its planning time for 20 blocks over 4 sites.
//
// An instance: blocks with random capacities (20-200 req/s per lane at batch 1, batch 4 at 2-4x the
// time), memory (50-800 MB) and output sizes (4 KB-4 MB); 1 to 3 chain tasks over random blocks
// whose rates make the total demand 40-90% of the sites' lanes; sites of 1 or 2 lanes, some with a
// memory budget. Per instance: admitted tasks (heuristic, optimum) and, where both admit the same
// tasks, the heuristic's bottleneck utilisation over the optimum's. Prints one line:
// {"bench":"plan_quality","instances":50,"same_admission":..,"fewer_admitted":..,"more_admitted":..,
//  "none_admitted":..,"median_over_optimal":..,"worst_over_optimal":..,"plan_20x4_ms":..,...,"cpu":..}
// plan_20x4: the heuristic planning 20 blocks over 4 sites (a chain over all 20 and more tasks;
// no memory budgets, so that every block is placed), median of 5.
#include "bench_util.hpp"

#include <blockflow/core/detail/clock.hpp>
#include <blockflow/plan/planner.hpp>

#include <fmt/format.h>

#include <random>

namespace bf = blockflow;

namespace {

bf::PlanInput instance(std::mt19937& rng, int blocks, int sites, int max_tasks, bool cover_all = false) {
  std::uniform_real_distribution<double> unit(0, 1);
  bf::PlanInput in;
  in.profile.channels = {{"inproc", 2, 0}, {"shm", 5, 2}};
  for (int b = 0; b < blocks; ++b) {
    bf::BlockProfile p;
    p.name = fmt::format("b{}", b);
    p.source = p.name + ".pt";
    p.input_shapes = {{1, 8}};
    p.output_shapes = {{1, 8}};
    const double rate = 20 + 180 * unit(rng), p50 = 1000 / rate, batch4 = 2 + 2 * unit(rng);
    p.latency = {{1, p50, 1.2 * p50}, {4, batch4 * p50, 1.2 * batch4 * p50}};
    p.max_rate_rps = rate;
    p.memory_bytes = static_cast<std::int64_t>((50 + 750 * unit(rng)) * 1048576);
    p.output_bytes = static_cast<std::uint64_t>(4096 + unit(rng) * 4 * 1048576);
    in.profile.blocks.push_back(p);
  }
  double lanes = 0;
  for (int s = 0; s < sites; ++s) {
    bf::PlanSite site;
    site.name = fmt::format("s{}", s);
    site.lanes = unit(rng) < 0.5 ? 1 : 2;
    site.memory_budget = unit(rng) < 0.5 ? static_cast<std::int64_t>((1000 + 2000 * unit(rng)) * 1048576) : 0;
    lanes += site.lanes;
    in.sites.push_back(site);
  }
  const int tasks = 1 + static_cast<int>(unit(rng) * max_tasks) % max_tasks;
  std::vector<std::vector<int>> paths;
  for (int t = 0; t < tasks; ++t) {  // a chain over a random run of blocks (the first over all, if asked)
    const int from = cover_all && t == 0 ? 0 : static_cast<int>(unit(rng) * blocks) % blocks;
    const int length = cover_all && t == 0 ? blocks : 1 + static_cast<int>(unit(rng) * (blocks - from)) % (blocks - from);
    std::vector<int> path;
    for (int b = from; b < from + length; ++b) path.push_back(b);
    paths.push_back(path);
  }
  // Rates: the total demand is a random 40-90% of the lanes, split over the tasks alike.
  double lanes_per_rps = 0;
  for (const auto& path : paths) {
    for (int b : path) lanes_per_rps += 1.0 / in.profile.blocks[static_cast<std::size_t>(b)].max_rate_rps;
  }
  const double rate = (0.4 + 0.5 * unit(rng)) * lanes / lanes_per_rps;
  for (std::size_t t = 0; t < paths.size(); ++t) {
    bf::PlanTask task;
    task.name = fmt::format("t{}", t);
    for (int b : paths[t]) task.path.push_back(fmt::format("b{}", b));
    task.rate_rps = rate;
    task.slo_ms = 10000;  // quality of placement, not SLOs
    in.tasks.push_back(task);
  }
  return in;
}

int admitted(const bf::Plan& p) {
  int n = 0;
  for (const auto& v : p.tasks) n += v.admitted ? 1 : 0;
  return n;
}

}  // namespace

int main() {
  std::vector<double> ratios;
  int same = 0, fewer = 0, more = 0, none = 0;
  constexpr int kInstances = 50;
  for (int i = 0; i < kInstances; ++i) {
    std::mt19937 rng(static_cast<unsigned>(1000 + i));
    const bf::PlanInput in = instance(rng, 3 + i % 6, 3, 3);
    auto heuristic = bf::plan(in);
    auto optimum = bf::plan(in, bf::PlanOptions{true});
    if (!heuristic.ok() || !optimum.ok()) {
      std::cerr << "plan_quality: instance " << i << ": " << (heuristic.ok() ? optimum.status() : heuristic.status()) << "\n";
      return 1;
    }
    const int h = admitted(*heuristic), o = admitted(*optimum);
    if (h < o) ++fewer;
    if (h > o) ++more;  // the optimum of each step is not the optimum of the sequence: it can happen
    if (h == 0 && o == 0) ++none;  // no placement fits the first task: nothing to compare
    if (h == o && h > 0) {
      ++same;
      ratios.push_back(heuristic->bottleneck_utilisation / std::max(1e-9, optimum->bottleneck_utilisation));
    }
  }
  std::mt19937 rng(7);
  bf::PlanInput big = instance(rng, 20, 4, 5, true);
  for (auto& site : big.sites) site.memory_budget = 0;  // 20 blocks of up to 800 MB: time the placement, not a refusal
  std::vector<double> ms;
  std::size_t big_blocks = 0;
  int big_admitted = 0;
  for (int i = 0; i < 5; ++i) {
    const std::int64_t t0 = bf::detail::now_ns();
    auto p = bf::plan(big);
    if (!p.ok()) return 1;
    big_blocks = p->blocks.size();
    big_admitted = admitted(*p);
    ms.push_back(static_cast<double>(bf::detail::now_ns() - t0) / 1e6);
  }
  fmt::print("{{\"bench\":\"plan_quality\",\"instances\":{},\"same_admission\":{},\"fewer_admitted\":{},\"more_admitted\":{},\"none_admitted\":{},"
             "\"median_over_optimal\":{:.4f},\"worst_over_optimal\":{:.4f},\"plan_20x4_ms\":{:.1f},\"plan_20x4_tasks\":{},"
             "\"plan_20x4_admitted\":{},\"plan_20x4_blocks_placed\":{},{}}}\n",
             kInstances, same, fewer, more, none, bf::bench::percentile(ratios, 0.5),
             ratios.empty() ? 0.0 : *std::max_element(ratios.begin(), ratios.end()), bf::bench::percentile(ms, 0.5),
             big.tasks.size(), big_admitted, big_blocks, bf::bench::machine_json());
  return 0;
}
