// plan(): admission, placement and batch sizes from block profiles (docs/planner.md, "Algorithm").
#include <blockflow/plan/planner.hpp>

#include <blockflow/core/names.hpp>

#include "plan_check.hpp"
#include "task_graph.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <set>
#include <tuple>

namespace blockflow {
namespace {

using detail::TaskGraph;
using detail::task_graph;

constexpr double kEps = 1e-9;

// The blocks, edges and demands of one set of tasks, and a placement of its blocks being evaluated.
class Model {
 public:
  Model(const PlanInput& in, const std::vector<const PlanTask*>& tasks) : in_(in), tasks_(tasks) {
    for (const PlanTask* t : tasks) {
      const TaskGraph& g = graphs_.emplace(t, *task_graph(*t)).first->second;  // check() has validated it
      for (const auto& node : g.nodes) {
        if (node.block.empty()) continue;
        const int b = block_index(node.block);
        demand_[static_cast<std::size_t>(b)] += t->rate_rps;
        for (const int input : node.inputs) {
          for (const auto& from : g.nodes[static_cast<std::size_t>(input)].sources) edges_.push_back({block_index(from), b, t->rate_rps});
        }
      }
    }
    site_.assign(blocks_.size(), -1);
    batch_.assign(blocks_.size(), 1);
    for (const auto& c : in.profile.channels) channel_[c.kind] = &c;
    for (const auto& site : in.sites) {
      int h = -1;
      for (std::size_t i = 0; i < in.hosts.size(); ++i) {
        if (in.hosts[i].name == site.host) h = static_cast<int>(i);
      }
      host_of_site_.push_back(h);
    }
    for (const auto& [block, at] : in.current) {  // a re-plan's starting point
      const auto b = index_.find(block);
      for (std::size_t s = 0; b != index_.end() && s < in.sites.size(); ++s) {
        if (in.sites[s].name == at) was_.emplace(b->second, static_cast<int>(s));
      }
    }
  }

  std::size_t blocks() const { return blocks_.size(); }
  const BlockProfile& profile(int b) const { return *blocks_[static_cast<std::size_t>(b)]; }
  double demand(int b) const { return demand_[static_cast<std::size_t>(b)]; }
  int& site(int b) { return site_[static_cast<std::size_t>(b)]; }
  int site(int b) const { return site_[static_cast<std::size_t>(b)]; }
  int& batch(int b) { return batch_[static_cast<std::size_t>(b)]; }
  int batch(int b) const { return batch_[static_cast<std::size_t>(b)]; }
  const std::vector<const PlanTask*>& tasks() const { return tasks_; }

  // Service time (ms) of one forward at max_batch k (the profile's p50; the nearest measured
  // batch size below k when k was not measured).
  double service_ms(int b, int k) const {
    const BatchLatency* measured = measured_at(b, k);
    return measured != nullptr ? measured->p50_ms : 0.0;
  }
  // The profile's latency at the largest measured batch size at or below k (null: none).
  const BatchLatency* measured_at(int b, int k) const {
    const BatchLatency* best = nullptr;
    for (const auto& l : profile(b).latency) {
      if (l.batch <= k && (best == nullptr || l.batch > best->batch)) best = &l;
    }
    return best;
  }
  // Requests per second one lane serves at max_batch k: the profiled maximum rate (frame-rate
  // proportionality), scaled by the batch's throughput gain at the batch size service_ms() uses
  // (the nearest measured one at or below k: an unmeasured k is modelled as that one).
  double capacity(int b, int k) const {
    const BlockProfile& p = profile(b);
    const double one = service_ms(b, 1);
    double f = p.max_rate_rps > 0 ? p.max_rate_rps : (one > 0 ? 1000.0 / one : 1e9);
    const BatchLatency* measured = measured_at(b, k);
    if (measured != nullptr && measured->batch > 1 && measured->p50_ms > 0 && one > 0) {
      f *= measured->batch * one / measured->p50_ms;
    }
    return f;
  }
  double lanes_used(int b) const { return demand(b) / capacity(b, batch(b)); }
  int workers(int b) const {  // a rate beyond any site's lanes stays a count an int holds
    return std::max(1, static_cast<int>(std::min(1e6, std::ceil(lanes_used(b) - kEps))));
  }

  // The hand-off of block a's outputs to b: shared memory between two processes (workers' default
  // channel), a reference inside one.
  double handoff_ms(int a, int b) const {
    const auto it = channel_.find(site(a) == site(b) ? "inproc" : "shm");
    if (it == channel_.end()) return 0;
    const double mb = static_cast<double>(profile(a).output_bytes) / 1048576.0;
    return (it->second->fixed_us + it->second->us_per_mb * mb) / 1000.0;
  }

  struct Score {
    double overflow = 0;     // lanes and memory beyond what sites have (0 when feasible)
    int moves = 0;           // blocks not on their PlanInput::current site
    double bottleneck = 0;   // the highest site utilisation
    double traffic_ms = 0;   // hand-off time per second across sites
    bool operator<(const Score& o) const {
      return std::tie(overflow, moves, bottleneck, traffic_ms) < std::tie(o.overflow, o.moves, o.bottleneck, o.traffic_ms);
    }
  };

  std::vector<SiteLoad> loads() const {
    std::vector<SiteLoad> out;
    for (const auto& s : in_.sites) out.push_back({s.name, s.lanes, 0, 0, 0, s.memory_budget, {}});
    for (std::size_t b = 0; b < blocks_.size(); ++b) {
      const int s = site_[b];
      if (s < 0) continue;
      out[static_cast<std::size_t>(s)].lanes_used += lanes_used(static_cast<int>(b));
      out[static_cast<std::size_t>(s)].memory_bytes += blocks_[b]->memory_bytes;
      out[static_cast<std::size_t>(s)].blocks.push_back(blocks_[b]->name);
    }
    for (const auto& e : edges_) {  // the receiver decodes: its lanes pay the hand-off
      if (site(e.from) >= 0 && site(e.to) >= 0 && site(e.from) != site(e.to)) {
        out[static_cast<std::size_t>(site(e.to))].lanes_used += e.rate * handoff_ms(e.from, e.to) / 1000.0;
      }
    }
    for (std::size_t s = 0; s < out.size(); ++s) out[s].utilisation = out[s].lanes_used / usable_lanes(static_cast<int>(s));
    return out;
  }

  // Per host of PlanInput::hosts: the cores its sites keep busy (a block's lane share times its
  // intra-op threads, plus the hand-offs its sites receive).
  std::vector<HostLoad> host_loads() const {
    std::vector<HostLoad> out;
    for (const auto& h : in_.hosts) out.push_back({h.name, h.cores, 0, 0});
    for (std::size_t b = 0; b < blocks_.size(); ++b) {
      const int h = site_[b] < 0 ? -1 : host_of_site_[static_cast<std::size_t>(site_[b])];
      if (h >= 0) out[static_cast<std::size_t>(h)].cores_used += lanes_used(static_cast<int>(b)) * std::max(1, blocks_[b]->intra_op_threads);
    }
    for (const auto& e : edges_) {
      if (site(e.from) >= 0 && site(e.to) >= 0 && site(e.from) != site(e.to)) {
        const int h = host_of_site_[static_cast<std::size_t>(site(e.to))];
        if (h >= 0) out[static_cast<std::size_t>(h)].cores_used += e.rate * handoff_ms(e.from, e.to) / 1000.0;
      }
    }
    for (auto& h : out) h.utilisation = h.cores > 0 ? h.cores_used / h.cores : 0.0;
    return out;
  }
  // How far the hosts' cores are over-committed (0 when they hold what their sites run).
  double host_overflow() const {
    double over = 0;
    for (const auto& h : host_loads()) over += std::max(0.0, h.cores_used - h.cores);
    return over;
  }
  // The utilisation a block's wait for a lane sees: its site's, or its host's when that is higher.
  double contention(int s, const std::vector<SiteLoad>& l, const std::vector<HostLoad>& hosts) const {
    const int h = host_of_site_[static_cast<std::size_t>(s)];
    const double site = l[static_cast<std::size_t>(s)].utilisation;
    return h < 0 ? site : std::max(site, hosts[static_cast<std::size_t>(h)].utilisation);
  }

  // The sites holding a block of `t`.
  std::set<int> sites_of(const PlanTask& t) const {
    std::set<int> out;
    for (const auto& name : blocks_of(t)) out.insert(site(index_.at(name)));
    return out;
  }
  // What score().overflow counts, on `sites` and their hosts only.
  double overflow_at(const std::set<int>& sites) const {
    const auto l = loads();
    const auto hosts = host_loads();
    std::set<int> on_hosts;
    double over = 0;
    for (const int s : sites) {
      if (s < 0) continue;
      const auto& load = l[static_cast<std::size_t>(s)];
      over += std::max(0.0, load.lanes_used - usable_lanes(s));
      if (usable_memory(s) > 0) over += std::max(0.0, static_cast<double>(load.memory_bytes) - usable_memory(s)) / 1048576.0;
      if (const int h = host_of_site_[static_cast<std::size_t>(s)]; h >= 0 && on_hosts.insert(h).second) {
        over += std::max(0.0, hosts[static_cast<std::size_t>(h)].cores_used - hosts[static_cast<std::size_t>(h)].cores);
      }
    }
    for (std::size_t b = 0; b < blocks_.size(); ++b) {
      if (sites.count(site_[b]) > 0 && workers(static_cast<int>(b)) > in_.sites[static_cast<std::size_t>(site_[b])].lanes) {
        over += workers(static_cast<int>(b));
      }
    }
    return over;
  }

  Score score() const {
    Score sc;
    const auto l = loads();
    sc.overflow += host_overflow();
    for (std::size_t s = 0; s < l.size(); ++s) {
      sc.bottleneck = std::max(sc.bottleneck, l[s].utilisation);
      sc.overflow += std::max(0.0, l[s].lanes_used - usable_lanes(static_cast<int>(s)));
      const double budget = usable_memory(static_cast<int>(s));
      if (budget > 0) sc.overflow += std::max(0.0, static_cast<double>(l[s].memory_bytes) - budget) / 1048576.0;
    }
    for (std::size_t b = 0; b < blocks_.size(); ++b) {
      if (site_[b] >= 0 && workers(static_cast<int>(b)) > in_.sites[static_cast<std::size_t>(site_[b])].lanes) {
        sc.overflow += workers(static_cast<int>(b));  // more replicas than the site has lanes
      }
    }
    for (const auto& e : edges_) {
      if (site(e.from) != site(e.to)) sc.traffic_ms += e.rate * handoff_ms(e.from, e.to);
    }
    for (const auto& [b, s] : was_) sc.moves += site(b) != s ? 1 : 0;
    return sc;
  }

  double usable_lanes(int s) const {
    const auto& site = in_.sites[static_cast<std::size_t>(s)];
    return site.lanes * (1.0 - site.reserve);
  }
  double usable_memory(int s) const {
    const auto& site = in_.sites[static_cast<std::size_t>(s)];
    return site.memory_budget > 0 ? static_cast<double>(site.memory_budget) * (1.0 - site.reserve) : 0.0;
  }
  bool device_fits(int b, int s) const { return profile(b).device == in_.sites[static_cast<std::size_t>(s)].device; }

  // The mean wait of M/D/1 at utilisation `rho`, over `servers` lanes; unbounded from 1 on.
  static double lane_wait(double rho, double service, int servers) {
    if (rho >= 1.0 - kEps) return std::numeric_limits<double>::infinity();
    return rho / (2.0 * (1.0 - rho)) * service / std::max(1, servers);
  }

  // Predicted p50 of a task: per block its service time at its batch size, the wait for a lane and,
  // with batching, the wait for the batch to fill; plus the hand-offs between blocks. The wait is
  // the longer of two: for any of the site's lanes at the site's (or host's) utilisation, and for
  // the `workers` lanes that may run the block at once, at the block's own load on them. Unbounded
  // (infinity) when either is saturated. A graph's time is its slowest way to the output: a
  // node starts when its last input has arrived, a join ends when its last input does.
  double predicted_ms(const PlanTask& t) const {
    const auto l = loads();
    const auto hosts = host_loads();
    const TaskGraph& g = graphs_.at(&t);
    std::vector<double> done(g.nodes.size(), 0.0);
    for (std::size_t i = 0; i < g.nodes.size(); ++i) {
      const auto& node = g.nodes[i];
      double start = 0;
      for (const int input : node.inputs) {
        double arrive = done[static_cast<std::size_t>(input)];
        if (!node.block.empty()) {
          double handoff = 0;
          for (const auto& from : g.nodes[static_cast<std::size_t>(input)].sources) {
            handoff = std::max(handoff, handoff_ms(index_.at(from), index_.at(node.block)));
          }
          arrive += handoff;
        }
        start = std::max(start, arrive);
      }
      done[i] = start;
      if (node.block.empty()) continue;
      const int b = index_.at(node.block);
      const int s = site(b);
      const double service = service_ms(b, batch(b));
      const int c = workers(b);
      done[i] += service + std::max(lane_wait(contention(s, l, hosts), service, in_.sites[static_cast<std::size_t>(s)].lanes),
                                    lane_wait(lanes_used(b) / c, service, c));
      if (batch(b) > 1) done[i] += std::min(2.0, 1000.0 * (batch(b) - 1) / (2.0 * demand(b)));  // max_batch_delay_ms
    }
    return done[static_cast<std::size_t>(g.sink)];
  }

  // The blocks of a task, in an order where each comes after its inputs.
  std::vector<std::string> blocks_of(const PlanTask& t) const { return graphs_.at(&t).blocks(); }

  int index_of(const std::string& name) const { return index_.at(name); }

 private:
  struct Edge {
    int from, to;
    double rate;
  };
  int block_index(const std::string& name) {
    auto it = index_.find(name);
    if (it != index_.end()) return it->second;
    const int i = static_cast<int>(blocks_.size());
    blocks_.push_back(in_.profile.block(name));
    demand_.push_back(0);
    index_[name] = i;
    return i;
  }

  const PlanInput& in_;
  std::vector<const PlanTask*> tasks_;
  std::map<const PlanTask*, TaskGraph> graphs_;
  std::vector<const BlockProfile*> blocks_;
  std::map<std::string, int> index_;
  std::vector<double> demand_;
  std::vector<Edge> edges_;
  std::vector<int> site_, batch_;
  std::vector<int> host_of_site_;  // index into PlanInput::hosts, -1 for a host not listed
  std::map<int, int> was_;         // block -> the site PlanInput::current gives it
  std::map<std::string, const ChannelCost*> channel_;
};

// Every placement (sites^blocks): the optimum of the score.
Model::Score search_all(Model& m, const std::vector<PlanSite>& sites) {
  const int n = static_cast<int>(m.blocks()), k = static_cast<int>(sites.size());
  std::vector<int> best(static_cast<std::size_t>(n), -1), at(static_cast<std::size_t>(n), 0);
  Model::Score best_score;
  bool found = false;
  while (true) {
    bool fits = true;
    for (int b = 0; b < n; ++b) {
      m.site(b) = at[static_cast<std::size_t>(b)];
      fits = fits && m.device_fits(b, m.site(b));
    }
    if (fits) {
      const Model::Score sc = m.score();
      if (!found || sc < best_score) {
        best_score = sc;
        for (int b = 0; b < n; ++b) best[static_cast<std::size_t>(b)] = m.site(b);
        found = true;
      }
    }
    int i = 0;
    while (i < n && ++at[static_cast<std::size_t>(i)] == k) at[static_cast<std::size_t>(i++)] = 0;
    if (i == n) break;
  }
  for (int b = 0; b < n; ++b) m.site(b) = best[static_cast<std::size_t>(b)];
  return found ? best_score : m.score();
}

// Worst-fit decreasing by memory, GPU sites first; then moves and swaps while the score improves;
// then larger batches for the blocks of an over-committed site, and again. Exhaustive: every
// placement instead of the first two steps.
void place(Model& m, const std::vector<PlanSite>& sites, bool exhaustive) {
  std::vector<int> order(m.blocks());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return m.profile(a).memory_bytes > m.profile(b).memory_bytes; });
  std::vector<int> site_order(sites.size());
  std::iota(site_order.begin(), site_order.end(), 0);
  std::stable_sort(site_order.begin(), site_order.end(), [&](int a, int b) {
    return (sites[static_cast<std::size_t>(a)].device != "cpu") > (sites[static_cast<std::size_t>(b)].device != "cpu");
  });
  for (const int b : exhaustive ? std::vector<int>{} : order) {
    int best = -1;
    Model::Score best_score;
    for (const int s : site_order) {
      if (!m.device_fits(b, s)) continue;
      m.site(b) = s;
      const Model::Score sc = m.score();
      if (best < 0 || sc < best_score) {
        best = s;
        best_score = sc;
      }
    }
    m.site(b) = best;  // -1: no site of its device
  }
  auto improve = [&] {
    if (exhaustive) return search_all(m, sites);
    Model::Score current = m.score();
    for (int round = 0; round < 64; ++round) {
      bool better = false;
      for (int b = 0; b < static_cast<int>(m.blocks()); ++b) {
        for (int s = 0; s < static_cast<int>(sites.size()); ++s) {
          if (s == m.site(b) || !m.device_fits(b, s)) continue;
          const int was = m.site(b);
          m.site(b) = s;
          const Model::Score sc = m.score();
          if (sc < current) {
            current = sc;
            better = true;
          } else {
            m.site(b) = was;
          }
        }
        for (int c = b + 1; c < static_cast<int>(m.blocks()); ++c) {
          // A block of no site (-1: none of its device) swaps with nothing.
          if (m.site(b) < 0 || m.site(c) < 0 || m.site(b) == m.site(c) || !m.device_fits(b, m.site(c)) ||
              !m.device_fits(c, m.site(b))) {
            continue;
          }
          std::swap(m.site(b), m.site(c));
          const Model::Score sc = m.score();
          if (sc < current) {
            current = sc;
            better = true;
          } else {
            std::swap(m.site(b), m.site(c));
          }
        }
      }
      if (!better) break;
    }
    return current;
  };
  Model::Score sc = improve();
  // Greedy max_batch: while sites are over-committed, the next larger batch of the block that lowers
  // the over-commitment most; when none lowers it as it stands, of the block that frees the most
  // lanes (room that lets improve() move another block). A block whose batch changes nothing keeps
  // its batch (and its latency).
  while (sc.overflow > kEps) {
    int pick = -1, to = 1;
    double lowered = 0, freed = 0;
    for (int b = 0; b < static_cast<int>(m.blocks()); ++b) {
      for (const auto& l : m.profile(b).latency) {
        if (l.batch <= m.batch(b)) continue;
        const double before = m.lanes_used(b);
        const int was = m.batch(b);
        m.batch(b) = l.batch;
        const double gain = before - m.lanes_used(b);
        const double lower = sc.overflow - m.score().overflow;
        m.batch(b) = was;
        if (lower > lowered + kEps || (lowered <= kEps && lower <= kEps && gain > freed + kEps)) {
          pick = b;
          to = l.batch;
          lowered = std::max(lowered, lower);
          freed = gain;
        }
        break;  // one step at a time: the next larger batch size
      }
    }
    if (pick < 0) break;
    m.batch(pick) = to;
    sc = improve();
  }
}

// A predicted p50 in words: "12.3 ms", or unbounded.
std::string p50_text(double ms) {
  return std::isfinite(ms) ? fmt::format("{:.1f} ms", ms)
                           : std::string("unbounded (a block of it, or its site, would get requests as fast as its lanes serve them or faster)");
}

// Why `task` does not fit next to `admitted` (whose placement is `before`). `own_sites` (predict()):
// only the sites holding a block of the task, their hosts and the tasks sharing them count against it.
std::string refusal(const PlanInput& in, const PlanTask& task, const Model& with, const Model* before, bool own_sites = false) {
  const std::vector<std::string> task_blocks = with.blocks_of(task);
  for (const auto& name : task_blocks) {
    const int b = with.index_of(name);
    if (with.site(b) < 0) return fmt::format("block '{}' runs on {}, and no site has that device", name, with.profile(b).device);
  }
  const std::set<int> scope = with.sites_of(task);
  if ((own_sites ? with.overflow_at(scope) : with.score().overflow) > kEps) {
    const auto l = with.loads();
    const auto base = before != nullptr ? before->loads() : std::vector<SiteLoad>{};
    // Memory first: the block of the task that needs most against the most any site has left.
    for (std::size_t s = 0; s < in.sites.size(); ++s) {
      const double budget = with.usable_memory(static_cast<int>(s));
      if (own_sites && scope.count(static_cast<int>(s)) == 0) continue;
      if (budget > 0 && static_cast<double>(l[s].memory_bytes) > budget) {
        double most_left = 0;
        for (std::size_t r = 0; r < in.sites.size(); ++r) {
          const double used = r < base.size() ? static_cast<double>(base[r].memory_bytes) : 0.0;
          if (with.usable_memory(static_cast<int>(r)) > 0) most_left = std::max(most_left, with.usable_memory(static_cast<int>(r)) - used);
        }
        std::string heaviest;
        std::int64_t need = -1;
        for (const auto& name : task_blocks) {
          const auto* p = in.profile.block(name);
          if (p->memory_bytes > need) {
            need = p->memory_bytes;
            heaviest = name;
          }
        }
        return fmt::format("needs {:.1f} MB for block '{}'; the most any site has left is {:.1f} MB",
                           static_cast<double>(need) / 1048576.0, heaviest, most_left / 1048576.0);
      }
    }
    // The hosts' cores, when they are what is short (the sites' lanes would hold the task).
    double lanes_over = 0;
    for (std::size_t s = 0; s < in.sites.size(); ++s) {
      if (!own_sites || scope.count(static_cast<int>(s)) > 0) lanes_over += std::max(0.0, l[s].lanes_used - with.usable_lanes(static_cast<int>(s)));
    }
    if (lanes_over <= kEps && with.host_overflow() > kEps) {
      const auto hosts = with.host_loads();
      const auto base_hosts = before != nullptr ? before->host_loads() : std::vector<HostLoad>{};
      std::size_t h = 0;
      for (std::size_t i = 1; i < hosts.size(); ++i) {
        if (hosts[i].cores_used - hosts[i].cores > hosts[h].cores_used - hosts[h].cores) h = i;
      }
      double cores = 0;
      for (const auto& name : task_blocks) {
        const int b = with.index_of(name);
        cores += task.rate_rps / with.capacity(b, with.batch(b)) * std::max(1, with.profile(b).intra_op_threads);
      }
      const double used = h < base_hosts.size() ? base_hosts[h].cores_used : 0.0;
      return fmt::format("needs {:.2f} cores for {:.1f} req/s; host '{}' has {} cores, {:.2f} of them left",
                         cores, task.rate_rps, hosts[h].host, hosts[h].cores, std::max(0.0, hosts[h].cores - used));
    }
    // The task's lanes: each block of its path at the task's rate, the largest share named.
    std::string worst;
    double need = 0, largest = -1, per_lane = 0;
    for (const auto& name : task_blocks) {
      const int b = with.index_of(name);
      const double lanes = task.rate_rps / with.capacity(b, with.batch(b));
      need += lanes;
      if (lanes > largest) {
        largest = lanes;
        worst = name;
        per_lane = with.capacity(b, with.batch(b));
      }
    }
    double left = 0;
    for (std::size_t s = 0; s < in.sites.size(); ++s) {
      left += with.usable_lanes(static_cast<int>(s)) - (s < base.size() ? base[s].lanes_used : 0.0);
    }
    const std::string blocks =
        task_blocks.size() == 1 ? std::string() : fmt::format(" over {} blocks, {:.2f} of them for", task_blocks.size(), largest);
    return fmt::format("needs {:.2f} lanes for {:.1f} req/s ({}block '{}' at {:.1f} req/s per lane); the sites have {:.2f} lanes left",
                       need, task.rate_rps, blocks.empty() ? "" : blocks.substr(1) + " ", worst, per_lane, std::max(0.0, left));
  }
  for (const PlanTask* t : with.tasks()) {
    if (own_sites && t != &task) {
      const std::set<int> theirs = with.sites_of(*t);
      if (std::none_of(theirs.begin(), theirs.end(), [&](int s) { return scope.count(s) > 0; })) continue;
    }
    const double p = with.predicted_ms(*t);
    if (p > t->slo_ms) {
      return t == &task ? fmt::format("predicted p50 {} exceeds its SLO of {:.1f} ms", p50_text(p), t->slo_ms)
                        : fmt::format("it would push task '{}' to a predicted p50 of {}, over its SLO of {:.1f} ms",
                                      t->name, p50_text(p), t->slo_ms);
    }
  }
  return "";
}

// The placement of `tasks`' blocks (profile order), the sites' and hosts' loads and the bottleneck.
void describe(const PlanInput& in, const Model& m, const std::vector<const PlanTask*>& tasks, Plan& out) {
  for (const auto& p : in.profile.blocks) {  // profile order
    bool used = false;
    for (const PlanTask* t : tasks) {
      const auto names = m.blocks_of(*t);
      used = used || std::count(names.begin(), names.end(), p.name) > 0;
    }
    if (!used) continue;
    const int b = m.index_of(p.name);
    out.blocks.push_back({p.name, in.sites[static_cast<std::size_t>(m.site(b))].name, m.batch(b), m.workers(b),
                          m.demand(b), m.lanes_used(b)});
  }
  out.sites = m.loads();
  out.hosts = m.host_loads();
  for (const auto& l : out.sites) out.bottleneck_utilisation = std::max(out.bottleneck_utilisation, l.utilisation);
}

}  // namespace

absl::StatusOr<Plan> plan(const PlanInput& in, const PlanOptions& options) {
  if (auto status = detail::check_plan_input(in); !status.ok()) return status;
  if (options.exhaustive) {
    std::set<std::string> blocks;
    for (const auto& t : in.tasks) {
      const auto names = task_graph(t)->blocks();
      blocks.insert(names.begin(), names.end());
    }
    if (blocks.size() > 12) {
      return absl::InvalidArgumentError(fmt::format("plan: an exhaustive search over {} blocks is too long (12 at most)", blocks.size()));
    }
    // sites^blocks placements, each scored at every batching step: 4^12 at most.
    if (std::pow(static_cast<double>(in.sites.size()), static_cast<double>(blocks.size())) > std::pow(4.0, 12.0)) {
      return absl::InvalidArgumentError(fmt::format("plan: an exhaustive search over {} blocks on {} sites is too long "
                                                    "({}^{} placements; at most 4^12)", blocks.size(), in.sites.size(),
                                                    in.sites.size(), blocks.size()));
    }
  }
  Plan out;
  std::vector<const PlanTask*> admitted;
  std::unique_ptr<Model> current;
  for (const PlanTask& t : in.tasks) {
    std::vector<const PlanTask*> candidate = admitted;
    candidate.push_back(&t);
    auto trial = std::make_unique<Model>(in, candidate);
    place(*trial, in.sites, options.exhaustive);
    TaskVerdict v{t.name, false, "", t.rate_rps, t.slo_ms, 0};
    v.reason = refusal(in, t, *trial, current.get());
    bool placed = true;
    for (int b = 0; b < static_cast<int>(trial->blocks()); ++b) placed = placed && trial->site(b) >= 0;
    if (placed) v.predicted_p50_ms = trial->predicted_ms(t);
    if (v.reason.empty()) {
      v.admitted = true;
      admitted = std::move(candidate);
      current = std::move(trial);
    } else {
      v.reason = fmt::format("task '{}': {}", t.name, v.reason);
    }
    out.tasks.push_back(std::move(v));
  }
  if (!current) {
    for (const auto& site : in.sites) out.sites.push_back({site.name, site.lanes, 0, 0, 0, site.memory_budget, {}});
    for (const auto& host : in.hosts) out.hosts.push_back({host.name, host.cores, 0, 0});
    return out;
  }
  for (auto& v : out.tasks) {  // the admitted tasks' predictions with the final placement
    for (const PlanTask* t : admitted) {
      if (v.admitted && t->name == v.task) v.predicted_p50_ms = current->predicted_ms(*t);
    }
  }
  describe(in, *current, admitted, out);
  return out;
}

absl::StatusOr<Plan> predict(const PlanInput& in, const std::vector<BlockPlacement>& placement) {
  if (auto status = detail::check_plan_input(in); !status.ok()) return status;
  // Puts the blocks of `m` where `placement` says.
  auto place_as_given = [&](Model& m) -> absl::Status {
    for (int b = 0; b < static_cast<int>(m.blocks()); ++b) {
      const std::string& name = m.profile(b).name;
      const auto at = std::find_if(placement.begin(), placement.end(), [&](const BlockPlacement& p) { return p.block == name; });
      if (at == placement.end()) return absl::InvalidArgumentError(fmt::format("predict: block '{}' has no placement", name));
      for (std::size_t s = 0; s < in.sites.size() && m.site(b) < 0; ++s) {
        if (in.sites[s].name == at->site) m.site(b) = static_cast<int>(s);
      }
      if (m.site(b) < 0) return absl::InvalidArgumentError(fmt::format("predict: block '{}': no site '{}'", name, at->site));
      if (!m.device_fits(b, m.site(b))) {
        return absl::InvalidArgumentError(fmt::format("predict: block '{}' runs on {}, and site '{}' is {}", name,
                                                      m.profile(b).device, at->site, in.sites[static_cast<std::size_t>(m.site(b))].device));
      }
      if (at->max_batch < 1) return absl::InvalidArgumentError(fmt::format("predict: block '{}': max_batch < 1", name));
      m.batch(b) = at->max_batch;
    }
    return absl::OkStatus();
  };
  std::vector<const PlanTask*> tasks;
  for (const PlanTask& t : in.tasks) tasks.push_back(&t);
  Model m(in, tasks);
  if (auto status = place_as_given(m); !status.ok()) return status;
  Plan out;
  for (const PlanTask& t : in.tasks) {
    // The reason, as plan() gives it: this task next to the others, on the same placement.
    std::vector<const PlanTask*> others;
    for (const PlanTask* o : tasks) {
      if (o != &t) others.push_back(o);
    }
    Model before(in, others);
    if (auto status = place_as_given(before); !status.ok()) return status;
    const std::string why = refusal(in, t, m, &before, /*own_sites=*/true);
    out.tasks.push_back({t.name, why.empty(), why.empty() ? "" : fmt::format("task '{}': {}", t.name, why), t.rate_rps,
                         t.slo_ms, m.predicted_ms(t)});
  }
  describe(in, m, tasks, out);
  return out;
}

}  // namespace blockflow
