// What updates removed, retired: a removed block's queue closed and its lanes left
// (stop_runtime()), the plans requests may still hold (publish(), live_plans()), and freeing the
// blocks, sites and task counters no live plan reaches any more (collect_retired()).
#include <blockflow/core/detail/session_core.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <iterator>
#include <set>

namespace blockflow::detail {

// Closes a block's queue, fails what was still queued, naming `why`, then waits for a lane still
// running the block to finish (a forward in progress is never interrupted), until `deadline`: false
// when one still runs it then.
bool SessionCore::stop_runtime(BlockRuntime& runtime, const std::string& why, absl::Time deadline) {
  runtime.removed_reason = why;  // before close(): whoever finds the queue closed reads it
  runtime.removed_why.store(&runtime.removed_reason, std::memory_order_release);
  runtime.stop_feeding.store(true, std::memory_order_release);  // a forwarder waiting at its site gives up
  runtime.inbox->close();
  if (runtime.forwarder.joinable()) runtime.forwarder.join();
  for (auto& envelope : runtime.inbox->drain()) {
    runtime.failed.fetch_add(1, std::memory_order_relaxed);
    fail(envelope.local, absl::CancelledError(fmt::format("block '{}': {}", runtime.name(), why)));
  }
  // An on-demand block's memory goes now, before the lanes are waited for: a load that one of them
  // waits for gives up (the request fails, naming the block), rather than make room by unloading
  // live blocks for a block that is gone. What a lane holds stays until it lets go.
  if (runtime.resident_id >= 0) resident_->retire(runtime.resident_id);
  return runtime.site != nullptr || !lanes_ || lanes_->quiesce(runtime, deadline);
}

void SessionCore::publish(const RoutingTable& table) {
  for (const auto& [task, plan] : table.plans) {
    PublishedPlan published{plan, plan->gone, {}};
    for (const auto& node : plan->nodes) published.blocks.push_back(node.block);
    published_plans_.push_back(std::move(published));
  }
}

// The published plans some request or the routing table still holds. A plan is forgotten once its
// destructor has run (PathPlan::gone), not merely once it has expired.
std::vector<std::shared_ptr<const PathPlan>> SessionCore::live_plans() {
  std::vector<std::shared_ptr<const PathPlan>> live;
  for (auto it = published_plans_.begin(); it != published_plans_.end();) {
    if (it->gone->load(std::memory_order_acquire)) {
      it = published_plans_.erase(it);
      continue;
    }
    if (auto plan = it->plan.lock()) live.push_back(std::move(plan));
    ++it;
  }
  return live;
}

// Frees the removed blocks (and emptied sites, and counters of removed tasks) that no live plan
// refers to any more: no request can reach them. A plan lives as long as a request or the routing
// table holds it, and every plan ever published stays in published_plans_ until its destructor has run
// (its release store of PathPlan::gone orders every access made through it before the free).
void SessionCore::collect_retired() {
  std::set<const BlockRuntime*> held_blocks;
  std::set<const PathRuntime*> held_paths;
  for (const auto& plan : live_plans()) held_paths.insert(plan->metrics.get());
  // Every plan not yet destroyed, expired or not, keeps what it reaches.
  for (const auto& published : published_plans_) held_blocks.insert(published.blocks.begin(), published.blocks.end());
  std::vector<std::unique_ptr<BlockRuntime>> freed;
  std::vector<std::shared_ptr<SiteRuntime>> freed_sites;
  std::vector<std::shared_ptr<PathRuntime>> freed_paths;  // the session's references only
  blockflow::detail::MutexLock lock(&state_mu_);
  auto keep_block = [&](const auto& runtime) {
    // A lane may still be inside a call into it (stop_runtime() gave up waiting).
    return held_blocks.count(runtime.get()) != 0 || (runtime->site == nullptr && lanes_ && !lanes_->idle(*runtime));
  };
  auto split = std::stable_partition(retired_.begin(), retired_.end(), keep_block);
  std::move(split, retired_.end(), std::back_inserter(freed));
  retired_.erase(split, retired_.end());
  auto keep_site = [&](const auto& site) {
    return std::any_of(retired_.begin(), retired_.end(), [&](const auto& r) { return r->site == site.get(); });
  };
  auto site_split = std::stable_partition(retired_sites_.begin(), retired_sites_.end(), keep_site);
  std::move(site_split, retired_sites_.end(), std::back_inserter(freed_sites));
  retired_sites_.erase(site_split, retired_sites_.end());
  // A removed task's counters go with its last plan (metrics() shows it while they live).
  auto keep_path = [&](const auto& path) { return held_paths.count(path.get()) != 0; };
  auto path_split = std::stable_partition(paths_.begin(), paths_.end(), keep_path);
  std::move(path_split, paths_.end(), std::back_inserter(freed_paths));
  paths_.erase(path_split, paths_.end());
}

}  // namespace blockflow::detail
