#pragma once
// The planner's model (lib/plan only): the blocks, edges and demands of a set of tasks, a placement
// of their blocks being evaluated, and what follows from it: lanes, memory, waits, predictions and
// the score plan()'s search minimises (docs/planner.md, "Model").
#include <blockflow/plan/planner.hpp>

#include "task_graph.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace blockflow::detail {

constexpr double kEps = 1e-9;

// The blocks, edges and demands of one set of tasks, and a placement of its blocks being evaluated.
class Model {
 public:
  Model(const PlanInput& in, const std::vector<const PlanTask*>& tasks) : in_(in), tasks_(tasks) {
    for (const PlanTask* t : tasks) {
      const TaskGraph& g = graphs_.emplace(t, *task_graph(*t)).first->second;  // check_plan_input() has validated it
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
    given_workers_.assign(blocks_.size(), 0);
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
  // Lanes block b's share needs: its lanes_used rounded up (over its site's lanes: over-commitment).
  int needed_lanes(int b) const {  // a rate beyond any site's lanes stays a count an int holds
    return std::max(1, static_cast<int>(std::min(1e6, std::ceil(lanes_used(b) - kEps))));
  }
  // Lanes that may run block b at once. A TorchScript file's block: all of its site's (its forward
  // is reentrant; a lane runs it only when it has work; its own wait, a queue at lanes_used /
  // workers, is then never longer than its site's, so the prediction grows with the rate; its
  // requests may leave it out of order). A C++ factory's block, whose forward may not be reentrant
  // (BlockOptions::workers): its share rounded up, and its own wait modelled at that. A placement
  // predict() is given sets it (given_workers).
  int workers(int b) const {
    if (given_workers_[static_cast<std::size_t>(b)] > 0) return given_workers_[static_cast<std::size_t>(b)];
    if (site(b) < 0 || !profile(b).from_file()) return needed_lanes(b);
    return std::max(needed_lanes(b), in_.sites[static_cast<std::size_t>(site(b))].lanes);
  }
  int& given_workers(int b) { return given_workers_[static_cast<std::size_t>(b)]; }

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
      auto& memory = out[static_cast<std::size_t>(s)].memory_bytes;  // saturates: no int64 overflow
      memory = blocks_[b]->memory_bytes > std::numeric_limits<std::int64_t>::max() - memory
                   ? std::numeric_limits<std::int64_t>::max()
                   : memory + blocks_[b]->memory_bytes;
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
      if (sites.count(site_[b]) > 0 && needed_lanes(static_cast<int>(b)) > in_.sites[static_cast<std::size_t>(site_[b])].lanes) {
        over += needed_lanes(static_cast<int>(b));
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
      if (site_[b] >= 0 && needed_lanes(static_cast<int>(b)) > in_.sites[static_cast<std::size_t>(site_[b])].lanes) {
        sc.overflow += needed_lanes(static_cast<int>(b));  // a share over the site's lanes
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
      const int c = std::min(workers(b), in_.sites[static_cast<std::size_t>(s)].lanes);  // the lanes cap them
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
  std::vector<int> site_, batch_, given_workers_;
  std::vector<int> host_of_site_;  // index into PlanInput::hosts, -1 for a host not listed
  std::map<int, int> was_;         // block -> the site PlanInput::current gives it
  std::map<std::string, const ChannelCost*> channel_;
};

}  // namespace blockflow::detail
