#pragma once
// A RemoteSite for tests of updates: its update() waits at a gate that the test controls; the test
// may also report it lost (lose()).

#include "test_util.hpp"

#include <blockflow/core/remote_site.hpp>

#include <ATen/ATen.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace blockflow::test {

// A test site's run(): reports the request's first tensor plus 1 to `site_done` (read under `mu`;
// none: dropped).
inline void report_plus_one(std::mutex& mu, const RemoteSite::CompletionFn& site_done, Envelope&& envelope) {
  RemoteSite::CompletionFn done;
  {
    std::lock_guard lock(mu);
    done = site_done;
  }
  if (!done) return;
  SiteCompletion c;
  c.request_id = envelope.request_id;
  c.node = envelope.node;
  c.outputs = Tensors{envelope.tensors.at(0) + 1};
  done(std::move(c));
}

// A site whose update() that adds blocks waits for its gate: until cancel_update(), stop() or
// open(). Removals answer at once (or fail, with fail_removals). Its blocks add 1.
class GateSite : public RemoteSite {
 public:
  explicit GateSite(std::string name) : name_(std::move(name)) {}
  const std::string& name() const override { return name_; }
  absl::Status start(const std::vector<BlockDescription>& blocks, CompletionFn done) override {
    std::lock_guard lock(mu_);
    loaded_ = blocks.size();
    done_ = std::move(done);
    return absl::OkStatus();
  }
  void run(const std::string&, Envelope&& envelope) override {
    test::report_plus_one(mu_, done_, std::move(envelope));
  }
  void stop() override {
    std::lock_guard lock(mu_);
    stopped_ = true;
    done_ = nullptr;
    cv_.notify_all();
  }
  SiteStats stats() const override {
    SiteStats s;
    s.name = name_;
    s.kind = "gate";
    return s;
  }
  absl::Status update(const std::vector<BlockDescription>& blocks) override {
    std::unique_lock lock(mu_);
    if (blocks.size() <= loaded_) {
      if (fail_removals_) return absl::UnavailableError("gate site cannot unload");
      loaded_ = blocks.size();
      return absl::OkStatus();
    }
    waiting_ = true;
    cv_.notify_all();
    cv_.wait_for(lock, std::chrono::seconds(60), [&] { return cancelled_ || stopped_ || open_; });
    waiting_ = false;
    if (open_) {
      loaded_ = blocks.size();
      const auto after = after_loading_;
      lock.unlock();
      if (after) after();
      return absl::OkStatus();
    }
    cancelled_ = false;
    return stopped_ ? absl::UnavailableError("gate site stopped") : absl::CancelledError("gate site: update cancelled");
  }
  void cancel_update() override {
    std::lock_guard lock(mu_);
    if (waiting_) cancelled_ = true;
    cv_.notify_all();
  }
  bool wait_until_updating() {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(30), [&] { return waiting_; });
  }
  void open() {
    std::lock_guard lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  void fail_removals() {
    std::lock_guard lock(mu_);
    fail_removals_ = true;
  }
  /// Runs `fn` when an update that adds blocks has loaded them, just before it returns OK.
  void after_loading(std::function<void()> fn) {
    std::lock_guard lock(mu_);
    after_loading_ = std::move(fn);
  }
  /// How many blocks it has loaded now.
  std::size_t loaded() {
    std::lock_guard lock(mu_);
    return loaded_;
  }
  void on_lost(LostFn lost) override {
    std::lock_guard lock(mu_);
    lost_ = std::move(lost);
  }
  /// Reports the site lost for good, as a worker that exhausted its restarts does.
  void lose(const std::string& cause) {
    LostFn lost;
    {
      std::lock_guard lock(mu_);
      lost = lost_;
    }
    if (lost) lost(cause);
  }
  bool stopped() {
    std::lock_guard lock(mu_);
    return stopped_;
  }

 private:
  const std::string name_;
  std::mutex mu_;
  std::condition_variable cv_;
  CompletionFn done_;
  LostFn lost_;
  std::function<void()> after_loading_;
  std::size_t loaded_ = 0;
  bool waiting_ = false, cancelled_ = false, stopped_ = false, open_ = false, fail_removals_ = false;
};

/// Starts `session` with block "a" (+1) in this process, task "t" = [a], and a GateSite "gate".
inline std::shared_ptr<GateSite> start_with_gate(Session& session) {
  register_update_factories();
  auto gate = std::make_shared<GateSite>("gate");
  session.add_site(gate);
  session.add_block(unary("a", [](const Tensor& x) { return x + 1; }));
  session.add_path(Path::chain("t", {"a"}));
  require_started(session);
  return gate;
}

/// An update that places a new block at the gate: it waits there until the gate opens.
inline const char* kThroughGate = R"({"blocks": ["a", {"name": "g", "factory": "upd_add_1", "placement": "gate"}],
                                      "tasks": {"t": ["a"], "t2": ["a", "g"]}})";

}  // namespace blockflow::test
