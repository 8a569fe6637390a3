// Memory admission: a site's memory budget against the profiled memory of the blocks placed on it
// (BlockOptions::memory_bytes, from blockflow-profile through the planner), checked by start() and
// apply() before anything is loaded; and after loading, what each site's memory grew by against
// the same profiles (docs/planner.md, "Admission"). And the blocks that load later, through the
// session's ResidentSet: on demand under a budget (docs/memory.md) or in the background while the
// session already serves (SessionOptions::serve_while_warming).
#include <blockflow/core/detail/build_scope.hpp>
#include <blockflow/core/detail/cuda_graph_block.hpp>
#include <blockflow/core/detail/clock.hpp>
#include <blockflow/core/detail/units.hpp>
#include <blockflow/core/detail/log.hpp>
#include <blockflow/core/detail/mutex.hpp>
#include <blockflow/core/detail/malloc_settings.hpp>
#include <blockflow/core/detail/session_core.hpp>
#include <blockflow/core/kpi.hpp>

#include <c10/core/InferenceMode.h>
#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <optional>

namespace blockflow::detail {
namespace {

constexpr const char* kThreads = "threads";
constexpr double kMisprofiled = 0.20;  // measured growth this far from the profile is reported


std::string site_label(const std::string& site) {
  return site == kThreads ? std::string("the session's threads") : fmt::format("site '{}'", site);
}

}  // namespace

// Blocks that load later (on demand, or in the background while the session serves) go through a
// resident set: made by build(), before any lane runs, even when no block needs it yet (apply() may
// add some). Serving while warming without a budget: one nothing is ever unloaded from.
void SessionCore::make_resident_set() {
  const bool on_demand = options_.memory_policy == SessionOptions::MemoryPolicy::kOnDemand;
  if (!on_demand && !options_.serve_while_warming) return;
  std::optional<WeightSwap::Options> swap;
  if (on_demand && options_.swap.enabled) swap = WeightSwap::Options{options_.swap.directory, options_.swap.drop_page_cache};
  auto resident = std::make_unique<ResidentSet>(on_demand ? options_.memory_budget : std::numeric_limits<std::int64_t>::max() / 4,
                                               process_rss_bytes, std::move(swap),
                                               on_demand && options_.memory_measure == SessionOptions::MemoryMeasure::kProcess);
  blockflow::detail::MutexLock lock(&state_mu_);  // metrics() may run from start() on
  resident_ = std::move(resident);
}

absl::StatusOr<std::unique_ptr<BlockRuntime>> SessionCore::make_on_demand_runtime(const BlockDescription& description) {
  if (auto status = validate(description.name, description.options); !status.ok()) return status;
  if (!resident_) return absl::InternalError(fmt::format("block '{}': no resident set (start() makes it)", description.name));
  // The block's queue, for the eviction order: set once the runtime exists.
  auto inbox = std::make_shared<std::atomic<const InProcessChannel*>>(nullptr);
  auto loader = [description]() -> absl::StatusOr<std::shared_ptr<Block>> {
    const auto scope = enter_build_scope();
    auto block = make_block(description);
    if (!block.ok()) return block.status();
    if (auto status = check_device(**block); !status.ok()) return status;
    if (auto status = warm_up_loaded(**block); !status.ok()) return status;
    return block;
  };
  // A TorchScript module on the CPU holds what libtorch's allocator gave it: swapping may page it out.
  const bool swappable = !description.torchscript.empty() && c10::Device(description.options.device).is_cpu();
  const int id = resident_->add(description.name, description.options.memory_bytes, std::move(loader), [inbox] {
    const InProcessChannel* queue = inbox->load(std::memory_order_acquire);
    return queue != nullptr && queue->depth() > 0;
  }, swappable);
  auto runtime = make_runtime(on_demand_block(*resident_, id, description.name, description.options,
                                              description.torchscript.empty() ? "callable" : "torchscript"));
  runtime->description = description;
  runtime->layout = nullptr;  // each load makes a new module: no layout kept across edges
  runtime->resident_id = id;
  inbox->store(runtime->inbox.get(), std::memory_order_release);
  return runtime;
}

void SessionCore::warm_in_background(const std::vector<BlockRuntime*>& order) {
  // A task per block, posted in order: the lanes take them first come, first served, as many at a
  // time as there are lanes (a load is mostly one thread's work: deserialising, graph passes).
  for (BlockRuntime* runtime : order) {
    // By id: an apply() may remove the block, and free its runtime, before the lane takes this.
    auto step = [this, id = runtime->resident_id] {
      if (stopped_.load()) return;
      const auto scope = enter_build_scope();
      auto hold = resident_->hold(id);
      if (absl::IsFailedPrecondition(hold.status())) return;  // removed meanwhile
      if (!hold.ok()) {
        log(LogLevel::kWarning, fmt::format("loading in the background: {} (its requests will try again)", hold.status().ToString()));
        return;
      }
      hold->reset();
      note_active();
    };
    if (!lanes_->post(std::move(step))) return;  // stopping
  }
}

void SessionCore::prefetch_next(const PathPlan& plan, std::uint32_t node) {
  std::vector<int> keep;  // the path's own blocks make no room for each other
  for (const auto& n : plan.nodes) {
    if (n.block != nullptr && n.block->resident_id >= 0) keep.push_back(n.block->resident_id);
  }
  for (const PlanEdge& e : plan.nodes[node].successors) {
    const BlockRuntime* next = plan.nodes[static_cast<std::size_t>(e.node)].block;
    if (next == nullptr || next->resident_id < 0 || !resident_->want_prefetch(next->resident_id)) continue;
    const int id = next->resident_id;
    (void)lanes_->post([this, id, keep] { resident_->prefetch(id, keep); });  // none once the lanes stop
  }
}

void SessionCore::note_active() {
  const auto table = routing();
  if (!table) return;
  for (const auto& [task, plan] : table->plans) {
    PathRuntime* path = plan->metrics.get();
    if (path == nullptr || path->active_ns.load(std::memory_order_acquire) != 0) continue;
    const bool loaded = std::all_of(plan->nodes.begin(), plan->nodes.end(), [this](const PlanNode& node) {
      return node.block == nullptr || node.block->resident_id < 0 || resident_->state(node.block->resident_id).loads > 0;
    });
    if (!loaded) continue;
    std::int64_t expected = 0;
    (void)path->active_ns.compare_exchange_strong(expected, now_ns(), std::memory_order_acq_rel);
  }
}

absl::Status SessionCore::load_on_demand(const std::vector<BlockRuntime*>& runtimes) {
  std::vector<BlockRuntime*> todo;
  for (auto* runtime : runtimes) {
    if (runtime->resident_id >= 0) todo.push_back(runtime);
  }
  if (todo.empty()) return absl::OkStatus();
  absl::Status status;
  std::vector<std::function<void()>> tasks{[&] {
    for (auto* runtime : todo) {
      auto hold = resident_->hold(runtime->resident_id);
      if (!hold.ok()) {
        status = hold.status();
        return;
      }
    }
  }};
  on_lanes(tasks, /*team_lanes=*/true);
  return status;
}

absl::Status SessionCore::check_memory(const std::vector<MemoryClaim>& claims,
                                       const std::function<std::int64_t(const std::string&)>& budget_of,
                                       const std::function<bool(const std::string&)>& on_demand_of) {
  std::map<std::string, std::vector<const MemoryClaim*>> by_site;
  for (const auto& c : claims) by_site[c.site.empty() ? kThreads : c.site].push_back(&c);
  for (auto& [site, list] : by_site) {
    const std::int64_t budget = budget_of(site);
    if (budget <= 0) continue;
    if (on_demand_of ? on_demand_of(site) : loads_on_demand(site)) {  // one at a time must fit
      for (const auto* c : list) {
        if (c->bytes <= budget) continue;
        return absl::ResourceExhaustedError(fmt::format(
            "block '{}': its profiled memory is {:.1f} MB, over the memory budget of {:.1f} MB of {} "
            "(on demand, every block must fit alone)", c->block, to_mb(c->bytes), to_mb(budget), site_label(site)));
      }
      continue;
    }
    std::int64_t need = 0;
    for (const auto* c : list) need += c->bytes;
    if (need <= budget) continue;
    std::stable_sort(list.begin(), list.end(), [](const MemoryClaim* a, const MemoryClaim* b) { return a->bytes > b->bytes; });
    std::string largest;
    for (std::size_t i = 0; i < list.size() && i < 3; ++i) {
      largest += fmt::format("{}'{}' {:.1f} MB", i ? ", " : "", list[i]->block, to_mb(list[i]->bytes));
    }
    return absl::ResourceExhaustedError(fmt::format(
        "{}: its blocks' profiled memory is {:.1f} MB ({}{}), over its memory budget of {:.1f} MB", site_label(site), to_mb(need),
        largest, list.size() > 3 ? ", ..." : "", to_mb(budget)));
  }
  return absl::OkStatus();
}

bool SessionCore::loads_on_demand(const std::string& site) const {
  if (site.empty() || site == kThreads) return options_.memory_policy == SessionOptions::MemoryPolicy::kOnDemand;
  const SiteRuntime* s = site_named(site);
  return s != nullptr && s->site->loads_on_demand();
}

std::int64_t SessionCore::memory_budget_of(const std::string& site) const {
  if (site.empty() || site == kThreads) return options_.memory_budget;
  const SiteRuntime* s = site_named(site);
  return s != nullptr ? s->site->memory_budget() : 0;
}

void SessionCore::note_memory_baseline() { rss_baseline_ = settled_rss_bytes(); }

void SessionCore::note_memory() {
  std::map<std::string, SiteMemory> sites;
  {
    blockflow::detail::MutexLock lock(&state_mu_);
    for (const auto& runtime : blocks_) {
      const std::string site = runtime->site ? runtime->site->site->name() : kThreads;
      const std::int64_t bytes =
          runtime->block ? runtime->block->options().memory_bytes : runtime->description.options.memory_bytes;
      SiteMemory& m = sites[site];
      m.site = site;
      m.profiled_bytes += bytes;
    }
  }
  if (options_.memory_budget > 0) sites[kThreads].site = kThreads;
  for (const auto& s : sites_) {
    if (s->site->memory_budget() > 0) sites[s->site->name()].site = s->site->name();
  }
  std::vector<SiteMemory> out;
  for (auto& [name, m] : sites) {
    m.budget_bytes = memory_budget_of(name);
    if (m.profiled_bytes == 0 && m.budget_bytes == 0) continue;  // nothing to say about it
    bool measured = false;
    if (name == kThreads) {
      m.measured_bytes = std::max<std::int64_t>(0, settled_rss_bytes() - rss_baseline_);
      measured = true;
    } else if (const SiteRuntime* site = site_named(name)) {
      const SiteStats st = site->site->stats();
      measured = st.rss_idle_bytes > 0;  // a worker that reported its RSS before loading
      if (measured) m.measured_bytes = std::max<std::int64_t>(0, st.rss_bytes - st.rss_idle_bytes);
    }
    // On demand, only some of the blocks are loaded at a time: the sum of profiles says nothing.
    const bool all_loaded = name == kThreads ? resident_ == nullptr : !loads_on_demand(name);
    if (m.profiled_bytes > 0 && measured && all_loaded) {
      const double off = static_cast<double>(m.measured_bytes - m.profiled_bytes) / static_cast<double>(m.profiled_bytes);
      if (std::abs(off) > kMisprofiled) {
        log(LogLevel::kWarning,
            fmt::format("{}: its memory grew by {:.1f} MB with its blocks, their profiles say {:.1f} MB ({:+.0f}%): "
                        "the profiles do not describe these blocks on this machine; run blockflow-profile here",
                        site_label(name), to_mb(m.measured_bytes), to_mb(m.profiled_bytes), 100 * off));
      }
    }
    out.push_back(m);
  }
  blockflow::detail::MutexLock lock(&state_mu_);
  memory_ = std::move(out);
}

}  // namespace blockflow::detail
