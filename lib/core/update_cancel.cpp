// Cancelling the apply() in progress (Session::cancel_update(), cancel_update_from()): the flag the
// update's steps read, and the sites it waits on told to stop waiting.
#include <blockflow/core/detail/session_core.hpp>

#include <blockflow/core/detail/exception_text.hpp>
#include <blockflow/core/detail/log.hpp>

#include <fmt/format.h>

namespace blockflow::detail {

bool SessionCore::update_cancelled() const {
  blockflow::detail::MutexLock lock(&busy_mu_);
  return cancelled_;
}

void SessionCore::cancel_update() { cancel_update_of(std::nullopt); }

bool SessionCore::cancel_update_from(std::thread::id caller) { return cancel_update_of(caller); }

bool SessionCore::cancel_update_of(std::optional<std::thread::id> caller) {
  std::vector<std::pair<std::shared_ptr<RemoteSite>, bool>> sites;
  {
    blockflow::detail::MutexLock lock(&busy_mu_);
    if (!updating_ || (caller && *caller != updating_thread_)) return false;
    cancelled_ = true;
    sites = busy_sites_;
    ++cancelling_;  // each site's step waits for these calls before it ends (at_site())
  }
  struct Done {  // however the calls below end: a step waiting for them must not wait for ever
    SessionCore* core;
    ~Done() {
      blockflow::detail::MutexLock lock(&core->busy_mu_);
      --core->cancelling_;
    }
  } done{this};
  for (const auto& [site, is_new] : sites) {
    // A site this update was starting serves nothing yet: stopping it is how its start() ends.
    try {
      if (is_new) site->stop();
      else site->cancel_update();
    } catch (...) {  // the other sites are still told
      detail::log(LogLevel::kWarning, fmt::format("cancelling an update: site '{}' threw: {}", site->name(), current_exception_text()));
    }
  }
  return true;
}

}  // namespace blockflow::detail
