// Sites lost for good: logged, counted and, with SessionOptions::on_site_lost, re-planned on a
// thread of the responder's own (never the reporting site's: apply() stops sites and waits on them).
#include <blockflow/core/detail/loss_responder.hpp>

#include <blockflow/core/detail/clock.hpp>
#include <blockflow/core/detail/exception_text.hpp>
#include <blockflow/core/detail/log.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <exception>

namespace blockflow::detail {
namespace {
thread_local const LossResponder* responding = nullptr;  // the responder whose thread this is
}  // namespace

LossResponder::LossResponder(SiteLostFn replan, ApplyFn apply) : replan_(std::move(replan)), apply_(std::move(apply)) {}

LossResponder::~LossResponder() { stop(); }

void LossResponder::report(const std::string& site, const std::string& cause) {
  {
    std::lock_guard lock(mu_);
    auto& lost = stats_.lost_sites;
    if (stopping_ || std::find(lost.begin(), lost.end(), site) != lost.end()) return;
    lost.push_back(site);
    ++stats_.losses;
    if (replan_) {
      pending_.push_back({SiteLoss{site, cause, lost}, now_ns()});
      if (!thread_.joinable()) thread_ = std::thread([this] { main(); });
    }
  }
  wake_.notify_one();
  // Outside mu_: a log sink may ask the session for its metrics.
  log(LogLevel::kError, replan_ ? fmt::format("site '{}' is lost ({}); re-planning", site, cause)
                                : fmt::format("site '{}' is lost ({}); no re-plan is configured (SessionOptions::on_site_lost): "
                                              "its blocks stay unreachable until a new deployment is applied",
                                              site, cause));
}

bool LossResponder::restored(const std::string& site) {
  std::lock_guard lock(mu_);
  auto& lost = stats_.lost_sites;
  const auto before = lost.size();
  lost.erase(std::remove(lost.begin(), lost.end(), site), lost.end());
  return lost.size() != before;
}

void LossResponder::relist(const std::string& site) {
  std::lock_guard lock(mu_);
  auto& lost = stats_.lost_sites;
  if (std::find(lost.begin(), lost.end(), site) == lost.end()) lost.push_back(site);
}

void LossResponder::stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    pending_.clear();
  }
  wake_.notify_one();
  if (on_own_thread()) return;  // it would join itself: the thread ends once the re-plan returns
  std::lock_guard join(join_mu_);
  if (thread_.joinable()) thread_.join();
}

bool LossResponder::on_own_thread() const { return responding == this; }

ReplanStats LossResponder::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

void LossResponder::main() {
  responding = this;
  std::unique_lock lock(mu_);
  while (true) {
    wake_.wait(lock, [this] { return stopping_ || !pending_.empty(); });
    if (stopping_) return;
    auto [loss, reported_ns] = std::move(pending_.front());
    pending_.pop_front();
    lock.unlock();
    absl::StatusOr<std::uint64_t> version = absl::UnknownError("");
    try {
      if (auto wanted = replan_(loss); !wanted.ok()) {
        version = wanted.status();
      } else {
        version = apply_(*wanted);
      }
    } catch (...) {
      version = absl::InternalError(fmt::format("SessionOptions::on_site_lost threw: {}", current_exception_text()));
    }
    const double ms = static_cast<double>(now_ns() - reported_ns) / 1e6;
    if (version.ok()) {
      log(LogLevel::kInfo, fmt::format("site '{}' lost: re-planned deployment applied as version {} in {:.1f} ms",
                                       loss.site, *version, ms));
    } else {
      log(LogLevel::kError, fmt::format("site '{}' lost: re-plan failed: {}", loss.site, version.status().ToString()));
    }
    lock.lock();
    if (version.ok()) {
      ++stats_.applied;
      stats_.last_ms = ms;
      stats_.last_version = *version;
    } else {
      ++stats_.failed;
      stats_.last_error = fmt::format("site '{}': {}", loss.site, version.status().ToString());
    }
  }
}

}  // namespace blockflow::detail
