#pragma once
// Internal: what a session does when a site is lost for good (SessionOptions::on_site_lost): the
// sites report from their own threads; a thread of the responder's own asks the function for a
// deployment and applies it, one loss after another, and counts what happened (ReplanStats).
#include <blockflow/core/metrics.hpp>
#include <blockflow/core/site_loss.hpp>

#include <absl/status/statusor.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace blockflow::detail {

class LossResponder {
 public:
  /// Applies a deployment (Session::apply()).
  using ApplyFn = std::function<absl::StatusOr<std::uint64_t>(const Deployment&)>;
  /// `replan` may be empty: losses are then only logged and counted.
  LossResponder(SiteLostFn replan, ApplyFn apply);
  ~LossResponder();
  LossResponder(const LossResponder&) = delete;
  LossResponder& operator=(const LossResponder&) = delete;

  /// Any thread, returns at once: `site` is gone for good. A second report of one site is ignored
  /// until restored() names it.
  void report(const std::string& site, const std::string& cause);
  /// A site of that name starts (again): it is no longer listed as lost, and its loss is reported
  /// anew. Whether it was listed.
  bool restored(const std::string& site);
  /// A site restored() named did not start after all: listed as lost again (no count, no re-plan).
  void relist(const std::string& site);
  /// No re-plan starts after this; waits for the one in progress (cancel the apply() first), unless
  /// called from it (SessionOptions::on_site_lost shutting its session down): it then ends after it.
  void stop();
  /// Whether the calling thread is the responder's (in SessionOptions::on_site_lost, or its apply()).
  [[nodiscard]] bool on_own_thread() const;
  [[nodiscard]] ReplanStats stats() const;

 private:
  void main();

  const SiteLostFn replan_;
  const ApplyFn apply_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::deque<std::pair<SiteLoss, std::int64_t>> pending_;  // the loss, when it was reported
  ReplanStats stats_;
  bool stopping_ = false;
  std::thread thread_;  // started by the first loss that has something to do
  std::mutex join_mu_;  // two shutdown()s at once: one joins, the other waits for it
};

}  // namespace blockflow::detail
