// plan(): admission, placement and batch sizes from block profiles (docs/planner.md, "Algorithm").
#include <blockflow/plan/planner.hpp>

#include "plan_check.hpp"
#include "plan_model.hpp"
#include "task_graph.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <set>

namespace blockflow {
namespace {

using detail::kEps;
using detail::Model;
using detail::task_graph;

// Every placement of each block on a site of its device: the optimum of the score. A block no site
// of its device runs stays at -1 (refused by name); the others are placed all the same.
Model::Score search_all(Model& m, const std::vector<PlanSite>& sites) {
  const std::size_t n = m.blocks();
  std::vector<std::vector<int>> fitting(n);
  for (std::size_t b = 0; b < n; ++b) {
    for (int s = 0; s < static_cast<int>(sites.size()); ++s) {
      if (m.device_fits(static_cast<int>(b), s)) fitting[b].push_back(s);
    }
    if (fitting[b].empty()) fitting[b].push_back(-1);
  }
  std::vector<std::size_t> at(n, 0);
  std::vector<int> best(n, -1);
  Model::Score best_score;
  for (bool first = true;; first = false) {
    for (std::size_t b = 0; b < n; ++b) m.site(static_cast<int>(b)) = fitting[b][at[b]];
    const Model::Score sc = m.score();
    if (first || sc < best_score) {
      best_score = sc;
      for (std::size_t b = 0; b < n; ++b) best[b] = m.site(static_cast<int>(b));
    }
    std::size_t i = 0;
    while (i < n && ++at[i] == fitting[i].size()) at[i++] = 0;
    if (i == n) break;
  }
  for (std::size_t b = 0; b < n; ++b) m.site(static_cast<int>(b)) = best[b];
  return best_score;
}

// Worst-fit decreasing by memory, GPU sites first; then moves and swaps while the score improves;
// then larger batches for the blocks of an over-committed site, and again; then larger batches
// for tasks predicted over their SLOs. Exhaustive: every placement instead of the first two steps.
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
  // Greedy max_batch for latency: while a task is predicted over its SLO (a block near its lanes'
  // limit queues long at batch 1 though no site is over-committed), the next larger batch of the
  // block that lowers the tasks' excess over their SLOs most, over-committing nothing more.
  if (sc.overflow > kEps) return;  // still over-committed: refused as such
  for (int b = 0; b < static_cast<int>(m.blocks()); ++b) {
    if (m.site(b) < 0) return;  // a block no site runs: refused as such
  }
  // (tasks predicted unbounded over their SLOs, ms over their SLOs), and which tasks are over.
  auto excess = [&](std::vector<char>* over) {
    std::pair<int, double> e{0, 0.0};
    for (const PlanTask* t : m.tasks()) {
      const double p = m.predicted_ms(*t);
      const bool late = p > t->slo_ms;  // as refusal() judges it (an infinite SLO holds anything)
      if (over != nullptr) over->push_back(late ? 1 : 0);
      if (!late) continue;
      if (!std::isfinite(p)) ++e.first;
      else e.second += p - t->slo_ms;
    }
    return e;
  };
  std::vector<char> over_now;
  for (auto e = excess(&over_now); e.first > 0 || e.second > kEps;) {
    int pick = -1, to = 1;
    auto best = e;
    for (int b = 0; b < static_cast<int>(m.blocks()); ++b) {
      for (const auto& l : m.profile(b).latency) {
        if (l.batch <= m.batch(b)) continue;
        const int was = m.batch(b);
        m.batch(b) = l.batch;
        if (m.score().overflow <= sc.overflow + kEps) {
          std::vector<char> over;
          const auto x = excess(&over);
          bool breaks = false;  // a task within its SLO pushed over it (a shared block's batch fill)
          for (std::size_t i = 0; i < over.size(); ++i) breaks = breaks || (over[i] != 0 && over_now[i] == 0);
          if (!breaks && (x.first < best.first || (x.first == best.first && x.second < best.second - kEps))) {
            pick = b;
            to = l.batch;
            best = x;
          }
        }
        m.batch(b) = was;
        break;  // one step at a time: the next larger batch size
      }
    }
    if (pick < 0) break;
    m.batch(pick) = to;
    over_now.clear();
    e = excess(&over_now);
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
      m.given_workers(b) = std::max(1, at->workers);  // as it runs: its own wait depends on them
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
