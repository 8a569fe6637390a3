// Session::apply(): moving a running session to a wanted deployment while traffic flows, in steps
// (what changes, load, route, start, publish, drain), each of which can be cancelled before the
// publish. What the drain removed is retired in session_retire.cpp.
#include <blockflow/core/detail/clock.hpp>
#include <blockflow/core/detail/mutex.hpp>
#include <blockflow/deploy/detail/deployment_json.hpp>
#include <blockflow/core/detail/exception_text.hpp>
#include <blockflow/core/names.hpp>
#include <blockflow/core/detail/log.hpp>
#include <blockflow/core/detail/run_in_threads.hpp>
#include <blockflow/core/detail/session_core.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>
#include <thread>

namespace blockflow::detail {
namespace {

// A plan a Deployment can describe: a chain, or a graph whose merges are the deployment format's
// combine rules; a C++ combine rule (Combine::custom()) has no JSON form.
bool describable(const PathPlan& plan) {
  return std::all_of(plan.nodes.begin(), plan.nodes.end(),
                     [](const PlanNode& n) { return n.inputs.size() <= 1 || has_deployment_form(n.combine); });
}

}  // namespace

/// What one apply() call has found and made so far, between its steps.
struct SessionCore::UpdateWork {
  explicit UpdateWork(const Deployment& w) : wanted(w) {}
  const Deployment& wanted;
  std::uint64_t version = 0;
  std::int64_t t_begin = 0;
  UpdateStats timing;
  Session::SiteFactoryWithSettings factory;
  std::vector<BlockDescription> added;      // new blocks, and new versions of changed ones
  std::vector<BlockRuntime*> removed;       // running blocks that go (changed ones included)
  std::vector<std::unique_ptr<BlockRuntime>> fresh;
  std::vector<std::shared_ptr<SiteRuntime>> new_sites;
  std::vector<std::string> lost_before;     // sites lost for good when the update began
  std::vector<BlockRuntime*> starting;      // fresh blocks of this process, started in step 4
  // Running sites that may have loaded this update's blocks: their blocks before, and whether the
  // site answered (its update returned OK; else it was cancelled or did not answer in time).
  struct Grown {
    SiteRuntime* site;
    std::vector<BlockDescription> before;
    bool answered;
  };
  std::vector<Grown> grown;
  absl::flat_hash_map<std::string, BlockRuntime*> next_by_name;
  std::vector<std::shared_ptr<PathRuntime>> new_paths;
  std::shared_ptr<RoutingTable> table;
  std::weak_ptr<const RoutingTable> old_table;  // the one update_publish() replaced

  [[nodiscard]] absl::Status invalid(const std::string& what) const {
    return absl::InvalidArgumentError(fmt::format("update {} rejected, nothing changed: {}", version, what));
  }
  /// The same, keeping the status's code (ResourceExhausted for a memory budget).
  [[nodiscard]] absl::Status refused(const absl::Status& why) const {
    return absl::Status(why.code(), fmt::format("update {} rejected, nothing changed: {}", version, std::string(why.message())));
  }
  [[nodiscard]] absl::Status cancelled() const {
    return absl::CancelledError(fmt::format("update {} cancelled, nothing changed", version));
  }
  [[nodiscard]] bool is_new(const SiteRuntime* site) const {
    return std::any_of(new_sites.begin(), new_sites.end(), [&](const auto& n) { return n.get() == site; });
  }
};

absl::StatusOr<std::uint64_t> SessionCore::apply(const Deployment& wanted, absl::Duration drain) {
  if (on_own_thread()) {
    return absl::FailedPreconditionError(
        "apply() was called from a completion callback or a block of this session: it would wait for the very thread "
        "it runs on; call it from another thread");
  }
  blockflow::detail::MutexLock serial(&update_mu_);
  UpdateWork u(wanted);
  u.version = version_.load() + 1;
  u.t_begin = now_ns();
  u.timing.version = u.version;
  {
    // shutdown() sets stopped_ before it looks for an update to cancel: one of the two sees the other.
    blockflow::detail::MutexLock lock(&busy_mu_);
    updating_ = true;
    updating_thread_ = std::this_thread::get_id();
    cancelled_ = false;
  }
  struct Done {
    SessionCore* core;
    ~Done() {
      blockflow::detail::MutexLock lock(&core->busy_mu_);
      core->updating_ = false;
    }
  } done{this};
  if (!admitting_.load() || stopped_.load()) {
    return absl::FailedPreconditionError("update: the session is not running (start() it first; not after shutdown())");
  }
  collect_retired();
  {
    blockflow::detail::MutexLock lock(&factory_mu_);
    u.factory = site_factory_;
  }
  // An update rejected before it published: the on-demand blocks it registered are never loaded (the
  // resident set lets go of their loaders); those it started were retired by stop_runtime() already.
  struct Unpublished {
    SessionCore* core;
    UpdateWork* u;
    bool published = false;
    ~Unpublished() {
      if (published) return;
      for (const auto& runtime : u->fresh) {
        if (runtime != nullptr && runtime->resident_id >= 0) core->resident_->retire(runtime->resident_id);
      }
    }
  } unpublished{this, &u};
  if (auto status = update_diff(u); !status.ok()) return status;
  if (auto status = update_load(u); !status.ok()) return status;
  if (auto status = update_route(u); !status.ok()) return status;
  if (auto status = update_start(u); !status.ok()) return status;
  update_publish(u);
  unpublished.published = true;
  update_drain(u, drain);
  collect_retired();
  note_memory();
  return u.version;
}

// Runs `step` against `site` so that cancel_update() can interrupt it; not at all once cancelled,
// unless `even_if_cancelled`.
absl::Status SessionCore::at_site(SiteRuntime& site, bool is_new, const std::function<absl::Status()>& step,
                                  bool even_if_cancelled) {
  {
    blockflow::detail::MutexLock lock(&busy_mu_);
    if (cancelled_ && !even_if_cancelled) return absl::CancelledError("cancelled");
    busy_sites_.emplace_back(site.site, is_new);
  }
  absl::Status status;
  try {  // a site that throws (no thread for it, a user's RemoteSite) fails the update, which is undone
    status = step();
  } catch (...) {
    status = absl::InternalError(fmt::format("site '{}' threw: {}", site.site->name(), current_exception_text()));
  }
  blockflow::detail::MutexLock lock(&busy_mu_);
  // A cancel that listed this site may not have reached it yet: it must not land on what comes
  // next there (the undo of this update, or the next update's step).
  busy_mu_.Await(absl::Condition(+[](int* n) { return *n == 0; }, &cancelling_));
  busy_sites_.erase(std::find_if(busy_sites_.begin(), busy_sites_.end(), [&](const auto& s) { return s.first == site.site; }));
  if (cancelled_ && !status.ok() && !absl::IsCancelled(status)) {  // what the site said is kept
    return absl::CancelledError(fmt::format("cancelled (site '{}': {})", site.site->name(), std::string(status.message())));
  }
  return cancelled_ && !status.ok() ? absl::CancelledError("cancelled") : status;
}

// 1. What stays, what comes, what goes; and what a deployment cannot say.
absl::Status SessionCore::update_diff(UpdateWork& u) {
  const Deployment& wanted = u.wanted;
  const std::set<std::string> bare(wanted.bare_names.begin(), wanted.bare_names.end());
  std::set<std::string> wanted_names;
  for (const auto& d : wanted.blocks) {
    // Deployment::parse() refuses it, but blocks is a public vector: a name twice would build a
    // block never routed, or retire the one it replaces twice.
    if (!wanted_names.insert(d.name).second) return u.invalid(fmt::format("block '{}' is listed twice", d.name));
    auto it = block_by_name_.find(d.name);
    if (it != block_by_name_.end()) {
      const BlockRuntime& current = *it->second;
      const bool same = bare.count(d.name) != 0 ||
                        (current.description.torchscript == d.torchscript && current.description.factory == d.factory &&
                         block_to_json(current.description) == block_to_json(d));
      if (same) continue;
      u.removed.push_back(it->second);  // replaced
    }
    u.added.push_back(d);
  }
  for (const auto& runtime : blocks_) {
    if (wanted_names.count(runtime->name()) != 0) continue;
    // A C++ object added with Session::add_block() has neither file nor factory: no deployment can
    // bring it back, so leaving it out would remove it for good without anyone having said so.
    if (wanted.keep_code_blocks && runtime->description.torchscript.empty() && runtime->description.factory.empty()) {
      return u.invalid(fmt::format("block '{}' is a C++ object (added with Session::add_block()) that a deployment "
                                   "cannot describe; the update would remove it for good. List it by name in the "
                                   "deployment's blocks to keep it, or replace it with a block of the same name",
                                   runtime->name()));
    }
    u.removed.push_back(runtime.get());
  }
  // A task that a deployment leaves out is removed, as asked; but one merging with a C++ combine
  // rule (Session::add_path() with Combine::custom()) could never be brought back by a deployment.
  if (const auto table = routing()) {
    std::set<std::string> wanted_tasks;
    for (const auto& path : wanted.paths()) wanted_tasks.insert(path.task());
    for (const auto& [task, plan] : table->plans) {
      if (wanted_tasks.count(task) == 0 && !describable(*plan)) {
        return u.invalid(fmt::format("task '{}' merges with a C++ combine rule (Combine::custom()) that a deployment "
                                     "cannot describe; the update would drop it for good. List the task in the "
                                     "deployment (a chain, or a graph {{\"nodes\": [...]}}) to replace it", task));
      }
    }
  }
  // A site lost for good stays until its blocks leave it: a deployment that keeps or adds blocks
  // there would "succeed" and change nothing (or ask a dead site to load them).
  u.lost_before = losses_->stats().lost_sites;
  const auto& lost = u.lost_before;
  for (const auto& d : wanted.blocks) {
    std::string site = d.placement;
    if (bare.count(d.name) != 0) {  // a bare name keeps the block where it runs
      auto it = block_by_name_.find(d.name);
      if (it != block_by_name_.end() && it->second->site != nullptr) site = it->second->site->site->name();
    }
    if (site.empty() || site_named(site) == nullptr || std::find(lost.begin(), lost.end(), site) == lost.end()) continue;
    return u.invalid(fmt::format("block '{}': site '{}' is lost for good; place its blocks on a site of another name, or "
                                 "remove every block from '{}' first (a site a deployment started then stops, and a "
                                 "later update starts a new one of that name)",
                                 d.name, site, site));
  }
  for (const auto& d : u.added) {
    if (d.placement.empty()) continue;
    // Deployment::parse() checks it, but blocks is a public vector.
    if (auto status = check_site_name("placement", d.placement); !status.ok()) {
      return u.invalid(fmt::format("block '{}': {}", d.name, std::string(status.message())));
    }
    auto current = block_by_name_.find(d.name);
    if (current != block_by_name_.end() && current->second->site != nullptr &&
        current->second->site->site->name() == d.placement) {
      return u.invalid(fmt::format("block '{}' in site '{}': changing a block in place inside the same site is not "
                                   "supported; give the new version another name or another placement",
                                   d.name, d.placement));
    }
    if (site_named(d.placement) == nullptr && !u.factory) {
      return u.invalid(fmt::format("block '{}': placement '{}' names no site, and the session has no site factory to "
                                   "start one (add_deployment() installs one for worker processes)", d.name, d.placement));
    }
  }
  // Memory budgets of the sites there are (new ones are checked once made, in update_load()).
  const auto budget_of = [this](const std::string& site) { return memory_budget_of(site); };
  if (auto status = check_memory(memory_claims(u), budget_of); !status.ok()) return u.refused(status);
  // The added blocks load before the removed ones drain (no task stops serving): said, not refused.
  if (auto status = check_memory(memory_claims(u, /*with_removed=*/true), budget_of); !status.ok()) {
    detail::log(LogLevel::kWarning,
                fmt::format("update {}: during the switch, while the removed blocks drain, {}; to stay within the budget "
                            "throughout, remove them in an update of their own first",
                            u.version, std::string(status.message())));
  }
  return absl::OkStatus();
}

// The blocks the update leaves on each site: those that stay, and the added ones; `with_removed`:
// and the removed ones, which a site holds until they are drained.
std::vector<SessionCore::MemoryClaim> SessionCore::memory_claims(const UpdateWork& u, bool with_removed) const {
  std::vector<MemoryClaim> claims;
  for (const auto& runtime : blocks_) {
    if (!with_removed && std::find(u.removed.begin(), u.removed.end(), runtime.get()) != u.removed.end()) continue;
    claims.push_back({runtime->site ? runtime->site->site->name() : "",
                      runtime->name(),
                      runtime->block ? runtime->block->options().memory_bytes : runtime->description.options.memory_bytes});
  }
  for (const auto& d : u.added) claims.push_back({d.placement, d.name, d.options.memory_bytes});
  return claims;
}

SiteRuntime* SessionCore::site_named(const std::string& name) const {
  for (const auto& site : sites_) {
    if (site->site->name() == name) return site.get();
  }
  return nullptr;
}

// 2. Make the sites the session lacks (their budgets checked first), then build and load the new
// blocks of this process (nothing is routed to them yet) and describe the ones going to sites.
absl::Status SessionCore::update_load(UpdateWork& u) {
  const std::int64_t t_load = now_ns();
  auto made_named = [&](const std::string& placement) -> SiteRuntime* {  // by this update
    for (const auto& made : u.new_sites) {
      if (made->site->name() == placement) return made.get();
    }
    return nullptr;
  };
  auto site_for = [&](const std::string& placement) {
    SiteRuntime* made = made_named(placement);
    return made != nullptr ? made : site_named(placement);
  };
  // The sites the session lacks first, their budgets checked before anything loads here.
  for (const auto& d : u.added) {
    if (d.placement.empty() || site_for(d.placement) != nullptr) continue;
    auto made = std::make_shared<SiteRuntime>();
    try {  // the application's factory, or WorkerSite's constructor refusing a name
      made->site = u.factory(u.wanted.site(d.placement));
    } catch (...) {
      return u.invalid(fmt::format("block '{}': the site factory threw for site '{}': {}", d.name, d.placement,
                                   current_exception_text()));
    }
    made->stop_when_empty = true;
    if (!made->site) return u.invalid(fmt::format("block '{}': the site factory made no site '{}'", d.name, d.placement));
    u.new_sites.push_back(std::move(made));
  }
  if (!u.new_sites.empty()) {  // the sites the factory just made have their budgets now (the others:
                               // checked in update_diff())
    auto status = check_memory(
        memory_claims(u),
        [&](const std::string& site) -> std::int64_t {
          const SiteRuntime* made = made_named(site);
          return made != nullptr ? made->site->memory_budget() : 0;
        },
        [&](const std::string& site) {  // not published yet: sites_ does not know it
          const SiteRuntime* made = made_named(site);
          return made != nullptr && made->site->loads_on_demand();
        });
    if (!status.ok()) return u.refused(status);
  }
  std::map<const BlockDescription*, absl::StatusOr<std::shared_ptr<Block>>> built;
  {
    std::vector<const BlockDescription*> local;
    for (const auto& d : u.added) {
      if (d.placement.empty() && options_.memory_policy != SessionOptions::MemoryPolicy::kOnDemand) local.push_back(&d);
    }
    auto blocks = make_blocks(local);  // in parallel, on the lanes
    for (std::size_t i = 0; i < local.size(); ++i) built.emplace(local[i], std::move(blocks[i]));
  }
  if (update_cancelled()) return u.cancelled();
  for (const auto& d : u.added) {
    if (!d.placement.empty()) {
      auto runtime = std::make_unique<BlockRuntime>();
      runtime->description = d;
      runtime->site = site_for(d.placement);
      runtime->inbox = make_inbox(d.options);
      u.fresh.push_back(std::move(runtime));
      continue;
    }
    if (options_.memory_policy == SessionOptions::MemoryPolicy::kOnDemand) {  // loaded in update_start()
      auto runtime = make_on_demand_runtime(d);
      if (!runtime.ok()) return u.invalid(std::string(runtime.status().message()));
      u.fresh.push_back(*std::move(runtime));
      continue;
    }
    auto& block = built.at(&d);
    if (!block.ok()) return u.invalid(std::string(block.status().message()));
    if (auto status = check_device(**block); !status.ok()) return u.invalid(std::string(status.message()));
    u.fresh.push_back(make_runtime(*std::move(block)));
    u.fresh.back()->description = d;
  }
  u.timing.load_ms = ms_since(t_load);  // this process's blocks built; sites and warm-up follow in 4
  return absl::OkStatus();
}

// 3. The new routing table, against the blocks that stay and the new ones.
absl::Status SessionCore::update_route(UpdateWork& u) {
  const std::int64_t t_route = now_ns();
  for (const auto& runtime : blocks_) {
    if (std::find(u.removed.begin(), u.removed.end(), runtime.get()) == u.removed.end()) {
      u.next_by_name[runtime->name()] = runtime.get();
    }
  }
  for (const auto& runtime : u.fresh) u.next_by_name[runtime->name()] = runtime.get();
  auto table = compile_table(u.wanted.paths(), [&](const std::string& name) -> BlockRuntime* {
    auto it = u.next_by_name.find(name);
    return it == u.next_by_name.end() ? nullptr : it->second;
  }, &u.new_paths);
  if (!table.ok()) return u.invalid(std::string(table.status().message()));
  u.table = *std::move(table);
  u.timing.route_ms = ms_since(t_route);
  return absl::OkStatus();
}

// 4. Start and warm the new blocks up: this process's, then the sites' (new sites start with
// theirs; running sites load theirs next to what they have). On failure or cancel, undone.
absl::Status SessionCore::update_start(UpdateWork& u) {
  const std::int64_t t_warm = now_ns();
  for (auto& runtime : u.fresh) {
    if (runtime->site == nullptr) u.starting.push_back(runtime.get());
  }
  if (auto status = warm_up(u.starting, *u.table); !status.ok()) {
    for (auto* runtime : u.starting) stop_runtime(*runtime, "update rejected");
    return u.invalid(std::string(status.message()));
  }
  if (auto status = load_on_demand(u.starting); !status.ok()) {
    for (auto* runtime : u.starting) stop_runtime(*runtime, "update rejected");
    return absl::IsResourceExhausted(status) ? u.refused(status) : u.invalid(std::string(status.message()));
  }
  std::map<SiteRuntime*, std::vector<BlockRuntime*>> incoming;
  for (auto& runtime : u.fresh) {
    if (runtime->site != nullptr) incoming[runtime->site].push_back(runtime.get());
  }
  // Every site at once, each on a thread of its own (a new worker's start and a running one's
  // load are mostly waiting); then the outcomes in site order.
  struct SiteStep {
    SiteRuntime* site;
    bool is_new;
    std::vector<BlockDescription> before;
    absl::Status status;
  };
  std::vector<SiteStep> steps;
  for (auto& [site, runtimes] : incoming) {
    const bool is_new = u.is_new(site);
    if (is_new) site->blocks = runtimes;
    steps.push_back({site, is_new, descriptions_of(*site), absl::OkStatus()});
  }
  auto run_step = [this, &incoming](SiteStep& step) {
    auto after = step.before;
    for (const auto* runtime : incoming.at(step.site)) after.push_back(runtime->description);
    step.status = at_site(*step.site, step.is_new,
                          [&] { return step.is_new ? start_site(*step.site) : step.site->site->update(after); });
  };
  const auto starting = static_cast<int>(std::count_if(steps.begin(), steps.end(), [](const SiteStep& s) { return s.is_new; }));
  for (auto& step : steps) {
    if (step.is_new) step.site->site->starting_together(starting);
  }
  run_in_threads(steps.size(), [&](std::size_t i) { run_step(steps[i]); });
  const SiteStep* failed = nullptr;
  for (const auto& step : steps) {
    // What a running site may have loaded is unloaded if the update is undone: it loaded it, or it
    // did not answer and may load it yet (one that died restarts with its old list).
    if (!step.is_new && (step.status.ok() || absl::IsDeadlineExceeded(step.status) || absl::IsCancelled(step.status))) {
      u.grown.push_back({step.site, step.before, step.status.ok()});
    }
    if (step.status.ok()) continue;
    if (step.is_new) step.site->blocks.clear();
    if (failed == nullptr) failed = &step;
    else detail::log(LogLevel::kWarning, fmt::format("update {}: also failed: {}", u.version, std::string(step.status.message())));
  }
  if (failed != nullptr) {
    update_undo(u);
    if (absl::IsCancelled(failed->status)) return u.cancelled();
    // InvalidArgument for what could not be loaded (a new site that fails to start included);
    // a running worker that died or did not answer keeps its code (Unavailable, DeadlineExceeded).
    const bool invalid_update = failed->is_new || absl::IsInvalidArgument(failed->status);
    return absl::Status(invalid_update ? absl::StatusCode::kInvalidArgument : failed->status.code(),
                        fmt::format("update {} rejected, nothing changed: {}", u.version, std::string(failed->status.message())));
  }
  if (update_cancelled()) {
    update_undo(u);
    return u.cancelled();
  }
  std::vector<BlockRuntime*> forwarding;
  for (auto& [site, runtimes] : incoming) {
    for (auto* runtime : runtimes) {
      try {
        runtime->forwarder = std::thread([this, runtime] { forward_to_site(*runtime); });
        forwarding.push_back(runtime);
      } catch (const std::exception& e) {  // no thread to be had: the update is undone
        for (auto* started : forwarding) stop_runtime(*started, "update rejected");
        update_undo(u);
        return absl::ResourceExhaustedError(fmt::format("update {} rejected, nothing changed: no thread for block '{}': {}",
                                                        u.version, runtime->name(), e.what()));
      }
    }
  }
  for (auto& [site, runtimes] : incoming) {
    if (!u.is_new(site)) site->blocks.insert(site->blocks.end(), runtimes.begin(), runtimes.end());
  }
  u.timing.load_ms += ms_since(t_warm);
  return absl::OkStatus();
}

// Takes back what update_start() did: new sites stop, running ones unload what they loaded, this
// process's new blocks stop. After a cancel, only the running sites that answered their update
// are asked (a cancelled one would not answer in time either; the blocks it may have loaded are
// never routed to, and its next update lists what it keeps).
void SessionCore::update_undo(UpdateWork& u) {
  for (auto& site : u.new_sites) {
    site->site->stop();
    // It took a lost site's name off the list as it started: nothing replaced that site after all.
    const std::string& name = site->site->name();
    if (std::find(u.lost_before.begin(), u.lost_before.end(), name) != u.lost_before.end()) losses_->relist(name);
  }
  const bool cancelled = update_cancelled();
  for (const auto& grown : u.grown) {
    if (cancelled && !grown.answered) continue;
    if (auto status = grown.site->site->update(grown.before); !status.ok()) {
      detail::log(LogLevel::kWarning, fmt::format("update {} rejected; site '{}' could not unload what it loaded: {}",
                                                  u.version, grown.site->site->name(), std::string(status.message())));
    }
  }
  for (auto* runtime : u.starting) stop_runtime(*runtime, "update rejected");
}

// 5. Publish: blocks, then the routing table, at once for every task.
void SessionCore::update_publish(UpdateWork& u) {
  const std::int64_t t_publish = now_ns();
  u.timing.blocks_added = static_cast<std::uint32_t>(u.fresh.size());
  u.timing.blocks_removed = static_cast<std::uint32_t>(u.removed.size());
  u.timing.sites_started = static_cast<std::uint32_t>(u.new_sites.size());
  {
    blockflow::detail::MutexLock lock(&state_mu_);
    for (auto& runtime : u.fresh) blocks_.push_back(std::move(runtime));
    for (auto& site : u.new_sites) {
      // set_sampling() holds state_mu_ too: a new site gets the setting of the moment.
      if (sampler_.enabled()) site->site->set_sampling(true, sampler_.period());
      sites_.push_back(std::move(site));
    }
    for (auto& p : u.new_paths) paths_.push_back(std::move(p));
    block_by_name_ = u.next_by_name;
    update_called_ns_ = u.t_begin;
    update_first_result_ns_.store(0, std::memory_order_relaxed);  // before the new table is published
  }
  publish(*u.table);
  std::shared_ptr<const RoutingTable> old;
  {
    blockflow::detail::MutexLock lock(&routing_mu_);
    old = std::exchange(routing_, std::move(u.table));
  }
  u.old_table = old;
  {
    // After the switch: metrics() never shows a version submit() does not route by yet, and shows
    // the version and its figures together.
    blockflow::detail::MutexLock lock(&state_mu_);
    u.timing.total_ms = ms_since(u.t_begin);
    last_update_ = u.timing;  // drain figures follow once it is done
    version_.store(u.version);
  }
  note_active();  // the tasks it adds: their blocks have loaded
  u.timing.route_ms += ms_since(t_publish);
}

// 6. Drain what is going: wait until no request holds a plan through a removed block, from the
// table just replaced or from any earlier one (up to `drain`; a cancel or shutdown() ends the wait
// at once). Then stop the removed blocks, unload them from their sites, stop emptied sites.
void SessionCore::update_drain(UpdateWork& u, absl::Duration drain) {
  const std::int64_t t_drain = now_ns();
  std::vector<std::shared_ptr<const PathPlan>> through_removed;
  for (auto& plan : live_plans()) {
    for (const auto& node : plan->nodes) {
      if (std::find(u.removed.begin(), u.removed.end(), node.block) != u.removed.end()) {
        through_removed.push_back(plan);
        break;
      }
    }
  }
  // A submit() that read the old table just before the swap still holds it: wait for that too.
  const absl::Time deadline = absl::Now() + drain;
  auto held = [&] {
    return !u.old_table.expired() ||
           std::any_of(through_removed.begin(), through_removed.end(), [](const auto& p) { return p.use_count() > 1; });
  };
  while (held() && absl::Now() < deadline && !update_cancelled() && !stopped_.load()) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  through_removed.clear();
  // A call still in progress once the drain is over is waited for a little longer, not for ever: a
  // block that never returns must not hold the update (its lane stays with it).
  const absl::Time soon = absl::Now() + absl::Milliseconds(100);
  const absl::Time calls_deadline = update_cancelled() || stopped_.load() ? soon : std::max(deadline, soon);
  std::set<SiteRuntime*> shrinking;
  for (auto* runtime : u.removed) {
    if (stop_runtime(*runtime, fmt::format("removed by update {} before the request reached it", u.version),
                     calls_deadline)) {
      // Its model's memory goes now; the runtime stays for late plans. Under state_mu_: metrics()
      // reads `block` there.
      std::shared_ptr<Block> gone;
      blockflow::detail::MutexLock lock(&state_mu_);
      gone = std::move(runtime->block);
    } else {
      // The block goes with its runtime: collect_retired() of the first update after the call returns.
      detail::log(LogLevel::kWarning,
                  fmt::format("update {}: block '{}' was removed while a call into it had not returned after the drain; "
                              "its lane stays with that call, and the next update after it returns frees its memory",
                              u.version, runtime->name()));
    }
    if (runtime->site != nullptr) {
      auto& list = runtime->site->blocks;
      list.erase(std::remove(list.begin(), list.end(), runtime), list.end());
      shrinking.insert(runtime->site);
    }
  }
  // Sites unload what was removed; a factory's or deployment's site left without blocks stops (its
  // process exits), one the user added stays, idle. shutdown() stops them all anyway.
  std::vector<SiteRuntime*> emptied;
  for (auto* site : shrinking) {
    if (site->blocks.empty() && site->stop_when_empty) {
      site->site->stop();
      emptied.push_back(site);
    } else if (!stopped_.load()) {
      // A cancel ended the drain's wait, not the unload: the site sheds what it no longer serves
      // (a cancel that comes during the unload still interrupts it).
      const auto status = at_site(*site, false, [&] { return site->site->update(descriptions_of(*site)); },
                                  /*even_if_cancelled=*/true);
      if (!status.ok()) {
        // Drained and unrouted already: the site just keeps the model loaded.
        detail::log(LogLevel::kWarning, fmt::format("update {}: site '{}' could not unload removed blocks: {}", u.version,
                                            site->site->name(), std::string(status.message())));
      }
    }
  }
  u.timing.sites_stopped = static_cast<std::uint32_t>(emptied.size());
  u.timing.drain_ms = ms_since(t_drain);
  u.timing.total_ms = ms_since(u.t_begin);
  blockflow::detail::MutexLock lock(&state_mu_);
  last_update_ = u.timing;
  for (auto it = sites_.begin(); it != sites_.end();) {
    if (std::find(emptied.begin(), emptied.end(), it->get()) != emptied.end()) {
      // Stopped: its own threads report nothing more (another site's thread may still be failing a
      // request through it: its callback holds this runtime weakly). It keeps its (stopped) site until collect_retired()
      // frees it outside state_mu_: a request that read its block's inbox open just before the
      // drain closed it may still knock (try_run() refuses, the closed inbox fails the request).
      retired_sites_.push_back(std::move(*it));
      it = sites_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = blocks_.begin(); it != blocks_.end();) {
    if (std::find(u.removed.begin(), u.removed.end(), it->get()) != u.removed.end()) {
      retired_.push_back(std::move(*it));
      it = blocks_.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace blockflow::detail
