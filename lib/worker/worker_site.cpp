// WorkerSite: the public API of a site whose blocks run in a worker process (start, run, try_run,
// stop, stats, update); the machinery is in worker_site_{process,outbound,inbound}.cpp.
#include "worker_site_impl.hpp"

namespace blockflow {
absl::Status WorkerSite::Impl::resolve_channel() {
  std::string& c = options.channel;
  if (c.empty()) c = joined() ? "zmq" : "shm";
  if (c != "shm" && c != "zmq" && c != "cuda") {
    return absl::InvalidArgumentError(fmt::format("{}: channel '{}' is not shm, cuda or zmq", prefix(), c));
  }
  if (c != "zmq" && joined()) {
    return absl::InvalidArgumentError(fmt::format("{}: channel '{}' needs a worker on this host, but it joins over TCP ({})",
                                                  prefix(), c, options.listen));
  }
  if (options.receive_spin < absl::ZeroDuration() || options.receive_spin > absl::Seconds(1)) {
    return absl::InvalidArgumentError(fmt::format(
        "{}: receive_spin must be from 0 to 1 s (it is {}); busy_poll polls without sleeping", prefix(),
        absl::FormatDuration(options.receive_spin)));
  }
  if (options.busy_poll && c == "zmq") {
    return absl::InvalidArgumentError(fmt::format(
        "{}: busy_poll applies to the data link of the zero-copy channels (shm, cuda), not to channel 'zmq'", prefix()));
  }
  if (c == "cuda") {
    if (auto usable = detail::cuda_ipc_usable(); !usable.ok()) {
      return absl::Status(usable.code(), fmt::format("{}: channel 'cuda': {}", prefix(), std::string(usable.message())));
    }
    auto probe = detail::export_cuda_probe();  // the worker opens it before it reports ready
    if (!probe.ok()) {
      return absl::Status(probe.status().code(),
                          fmt::format("{}: channel 'cuda': {}", prefix(), std::string(probe.status().message())));
    }
    cuda_probe = *probe;
  }
  if (shm()) {
    detail::ShmPoolOptions pool;
    pool.slots_per_pool = options.shm_slots_per_pool;
    pool.max_total_bytes = options.shm_max_bytes;
    ends = std::make_shared<detail::ZeroCopyEnds>(pool, c == "cuda");
    // Without a free slot, the target block's full policy decides: kBlock waits for a release (up
    // to 10 s, then the request fails, named), kReject and kDropOldest fail the request at once.
    stager = ends->stager(absl::Seconds(10));
    stager_no_wait = ends->stager(absl::ZeroDuration());
  }
  return absl::OkStatus();
}

void WorkerSite::Impl::set_blocks_locked(const std::vector<BlockDescription>& now) {
  blocks = now;
  // A removed block's turns go unless one of its requests is still being sent (that one holds them).
  for (auto it = turns.begin(); it != turns.end();) {
    const bool hosted = std::any_of(blocks.begin(), blocks.end(), [&](const BlockDescription& b) { return b.name == it->first; });
    const bool idle = it->second->serving.load(std::memory_order_acquire) == it->second->next;
    if (!hosted && idle) turns.erase(it++);
    else ++it;
  }
}

const detail::ShmStager* WorkerSite::Impl::stager_for(const std::string& block) const {
  for (const auto& b : blocks) {
    if (b.name == block && b.options.full_policy != FullPolicy::kBlock) return &stager_no_wait;
  }
  return &stager;
}

WorkerSite::WorkerSite(WorkerOptions options) : impl_(std::make_shared<Impl>(std::move(options))) {
  impl_->self = impl_;
  // The name becomes a directory name, a thread name and a metric label: never a path.
  if (auto status = check_site_name("worker", impl_->options.name); !status.ok()) {
    throw std::invalid_argument(fmt::format("WorkerOptions::name: {}", std::string(status.message())));
  }
}

WorkerSite::~WorkerSite() { stop(); }

const std::string& WorkerSite::name() const { return impl_->options.name; }

void WorkerSite::on_lost(LostFn lost) {
  std::lock_guard lock(impl_->mu);
  impl_->lost_fn = std::move(lost);
}

namespace {

// What start() refuses of the options ("" when they hold together).
std::string invalid_options(const WorkerOptions& o) {
  if (o.memory_policy == SessionOptions::MemoryPolicy::kOnDemand && o.memory_budget <= 0) {
    return "WorkerOptions::memory_policy kOnDemand needs a memory_budget above 0 (bytes)";
  }
  // Supervision: a negative count read as unsigned would restart for ever; a ping every poll would
  // keep a core busy on both sides; silence as short as the ping interval kills every worker.
  if (o.max_restarts < 0) return fmt::format("WorkerOptions::max_restarts is {}; give 0 or more", o.max_restarts);
  if (o.heartbeat_interval < absl::Milliseconds(1) || o.heartbeat_interval == absl::InfiniteDuration()) {
    return fmt::format("WorkerOptions::heartbeat_interval is {}; give 1ms or more (finite)",
                       absl::FormatDuration(o.heartbeat_interval));
  }
  if (o.heartbeat_timeout <= o.heartbeat_interval) {
    return fmt::format("WorkerOptions::heartbeat_timeout ({}) must be longer than heartbeat_interval ({})",
                       absl::FormatDuration(o.heartbeat_timeout), absl::FormatDuration(o.heartbeat_interval));
  }
  if (o.start_timeout <= absl::ZeroDuration() || o.restart_backoff < absl::ZeroDuration() ||
      o.start_timeout == absl::InfiniteDuration() || o.restart_backoff == absl::InfiniteDuration() ||
      o.heartbeat_timeout == absl::InfiniteDuration()) {
    return fmt::format("WorkerOptions::start_timeout ({}) must be above 0 and restart_backoff ({}) not below 0, "
                       "both (and heartbeat_timeout) finite",
                       absl::FormatDuration(o.start_timeout), absl::FormatDuration(o.restart_backoff));
  }
  if (o.max_in_flight == 0) return "WorkerOptions::max_in_flight is 0: no request could ever be sent";
  return {};
}

}  // namespace

absl::Status WorkerSite::start(const std::vector<BlockDescription>& blocks, CompletionFn done) {
  Impl& s = *impl_;
  if (const std::string invalid = invalid_options(s.options); !invalid.empty()) {
    s.state = Impl::State::kStopped;
    return absl::InvalidArgumentError(fmt::format("{}: {}", s.prefix(), invalid));
  }
  if (auto status = s.resolve_channel(); !status.ok()) {
    s.state = Impl::State::kStopped;
    return status;
  }
  // Read once, as the site starts (within Session::start() or apply()): a restart happens at any
  // time, and reading `environ` then would race whatever setenv() the application makes later.
  s.environment = detail::merged_environment(s.options.environment);
  if (s.joined()) {
    if (s.options.listen.rfind("tcp://", 0) != 0) {
      return absl::InvalidArgumentError(
          fmt::format("{}: listen '{}' is not a tcp://ADDR:PORT endpoint", s.prefix(), s.options.listen));
    }
    s.control_endpoint = s.options.listen;
    s.request_endpoint = s.result_endpoint = Impl::with_any_port(s.options.listen);
  } else {
    auto dir = detail::make_private_dir(s.options.name);
    if (!dir.ok()) return dir.status();
    s.dir = *dir;
    s.control_endpoint = "ipc://" + s.dir + "/control";
    s.request_endpoint = "ipc://" + s.dir + "/requests";
    s.result_endpoint = "ipc://" + s.dir + "/results";
    if (s.options.channel == "zmq" && s.options.direct_edges) s.peer = "ipc://" + s.dir + "/peer";
  }
  if (auto status = s.bind_sockets(); !status.ok()) {
    detail::remove_private_dir(s.dir);
    s.state = Impl::State::kStopped;
    return status;
  }
  s.blocks = blocks;
  s.done = std::move(done);
  s.receiver = std::thread([&s] { s.receiver_main(); });
  s.sender = std::thread([&s] { s.sender_main(); });
  s.control = std::thread([&s] { s.control_main(); });
  std::unique_lock lock(s.mu);
  s.changed.wait(lock, [&] {
    return s.state == Impl::State::kReady || s.state == Impl::State::kFailed || s.stopping ||
           s.state == Impl::State::kStopped;
  });
  if (s.state != Impl::State::kReady) {
    const std::string error = s.stopping || s.state == Impl::State::kStopped
                                  ? s.prefix() + " was stopped while it started"
                                  : (s.start_error.empty() ? s.prefix() + " failed to start" : s.start_error);
    lock.unlock();
    stop();
    return absl::UnavailableError(error);
  }
  return absl::OkStatus();
}

void WorkerSite::run(const std::string& block, Envelope&& envelope) {
  static const std::atomic<bool> never{false};
  (void)run_unless(block, envelope, never);
}

bool WorkerSite::run_unless(const std::string& block, Envelope& envelope, const std::atomic<bool>& give_up) {
  Impl& s = *impl_;
  std::unique_lock lock(s.mu);
  auto room = [&] {
    return s.stopping || s.state == Impl::State::kFailed || s.outbound.size() < s.options.max_in_flight;
  };
  while (!room()) {
    if (give_up.load(std::memory_order_acquire)) return false;
    // Woken by every change; the slice only bounds how late a give-up is seen.
    s.changed.wait_for(lock, std::chrono::milliseconds(10));
  }
  Impl::Outbound next = Impl::make_outbound(block, std::move(envelope));
  if (s.stopping || s.state == Impl::State::kFailed) {
    const std::string why = s.stopping ? "stopped" : "down: " + s.cause;
    ++s.failed_requests;
    lock.unlock();
    s.fail_all({{next.envelope.request_id, next.envelope.node}},
               absl::UnavailableError(fmt::format("{} is {}", s.prefix(), why)));
    return true;
  }
  if (s.can_send_now_locked() && !s.transmitting_locked(block)) {
    // The data link takes any thread's packets: send from here, without waking the sender thread
    // (staging may wait for a credit: run() may block). Not while another thread sends one of the
    // block's requests (try_run()): the sender thread waits for that turn, not the forwarder.
    std::shared_ptr<detail::ZeroCopyLink> to;
    const detail::ShmStager* stager = s.admit_locked(next, to);
    lock.unlock();
    s.transmit(std::move(next), stager, to);
    return true;
  }
  s.outbound.push_back(std::move(next));
  lock.unlock();
  s.wake();
  return true;
}

bool WorkerSite::try_run(const std::string& block, Envelope& envelope) {
  Impl& s = *impl_;
  if (!s.shm()) {
    // Direct edges: a request whose input is parked in a worker costs this thread a small message
    // to that worker's site, never a wait.
    Impl::ParkedInput parked = Impl::parked_input(envelope.tensors);
    if (s.peer.empty() || parked.site.expired()) return false;
    std::unique_lock lock(s.mu);
    if (s.stopping || !s.outbound.empty() || s.transmitting_locked(block) || s.state != Impl::State::kReady ||
        s.in_flight.size() >= s.options.max_in_flight) {
      return false;
    }
    envelope.local.reset();  // never crosses the process boundary
    Impl::Outbound next{block, std::move(envelope), std::move(parked), nullptr, 0};
    std::shared_ptr<detail::ZeroCopyLink> unused;
    (void)s.admit_locked(next, unused);
    lock.unlock();
    s.transmit(std::move(next), nullptr, nullptr);
    return true;
  }
  // Nothing this thread does may wait for a credit (it may be the very thread that reads the
  // releases): relayed CPU tensors cross as they are, with the site's stager; CUDA tensors' records
  // are taken here, into a stager for this send only.
  const bool cuda = std::any_of(envelope.tensors.begin(), envelope.tensors.end(),
                                [](const Tensor& t) { return t.defined() && t.is_cuda(); });
  if (!cuda && !std::all_of(envelope.tensors.begin(), envelope.tensors.end(), detail::ZeroCopyEnds::relays_as_is)) {
    return false;
  }
  std::unique_lock lock(s.mu);
  if (s.stopping || !s.can_send_now_locked() || s.transmitting_locked(block)) return false;  // it would wait its turn
  std::optional<detail::ShmStager> with_records;  // the records are a leaf lock's: taken under mu
  if (cuda && !(with_records = s.ends->stager_now(envelope.tensors))) return false;
  Impl::Outbound next = Impl::make_outbound(block, std::move(envelope));
  std::shared_ptr<detail::ZeroCopyLink> to;
  const detail::ShmStager* stager = s.admit_locked(next, to);
  lock.unlock();
  s.transmit(std::move(next), with_records ? &*with_records : stager, to);
  return true;
}

void WorkerSite::stop() {
  Impl& s = *impl_;
  std::lock_guard serial(s.stop_mu);
  {
    std::lock_guard lock(s.mu);
    if (s.state == Impl::State::kStopped || s.state == Impl::State::kIdle) {
      s.state = Impl::State::kStopped;
      return;
    }
    s.stopping = true;
  }
  s.wake();
  for (auto* t : {&s.control, &s.sender, &s.receiver}) {
    if (t->joinable()) t->join();
  }
  std::vector<std::pair<std::uint64_t, std::uint32_t>> lost;
  std::vector<std::pair<Impl::Key, std::weak_ptr<Impl>>> vias, forwarded;
  std::deque<Impl::Outbound> outbound;
  std::deque<Impl::Forward> forwards;
  {
    std::lock_guard lock(s.mu);
    for (const auto& [key, entry] : s.in_flight) {
      lost.push_back(key);
      if (!entry.via.expired()) vias.emplace_back(key, entry.via);
    }
    for (const auto& o : s.outbound) lost.emplace_back(o.envelope.request_id, o.envelope.node);
    forwarded.assign(s.pending_forwards.begin(), s.pending_forwards.end());
    s.pending_forwards.clear();
    forwards.swap(s.forwards);  // destroyed outside mu, as outbound (placeholders' deleters take drops_mu)
    s.in_flight.clear();
    outbound.swap(s.outbound);  // destroyed outside mu (placeholders' deleters)
    s.state = Impl::State::kStopped;
    s.pid = 0;
    s.forked = false;
  }
  outbound.clear();
  forwards.clear();
  const absl::Status stopped = absl::CancelledError(fmt::format("{} stopped", s.prefix()));
  Impl::forget_vias(vias);
  {
    std::lock_guard lock(s.mu);
    s.failed_requests += lost.size();
  }
  s.fail_all(std::move(lost), stopped);
  s.fail_forwarded(forwarded, stopped);
  {
    std::lock_guard lock(s.mu);
    s.link.reset();
  }
  s.listener.reset();
  detail::remove_private_dir(s.dir);
  CompletionFn dropped;  // destroyed outside mu: it may hold the last reference to its owner
  LostFn dropped_lost;
  {
    std::unique_lock lock(s.mu);
    dropped = std::move(s.done);
    s.done = nullptr;
    dropped_lost = std::move(s.lost_fn);
    s.lost_fn = nullptr;
    // None starts now; those other threads are making end before this returns (not this thread's
    // own: a report that stopped the site).
    const int own = s.reports_on_this_thread();
    s.changed.wait(lock, [&] { return s.reports_running <= own; });
  }
}

void WorkerSite::starting_together(int sites) {
  std::lock_guard lock(impl_->mu);
  const int cores = static_cast<int>(std::max(1U, std::thread::hardware_concurrency()));
  impl_->warm_up_threads = sites > 1 && !impl_->joined() ? std::max(1, cores / sites) : 0;  // a joined worker has its own cores
}

SiteStats WorkerSite::stats() const {
  const Impl& s = *impl_;
  std::lock_guard lock(s.mu);
  SiteStats out;
  out.name = s.options.name;
  out.kind = s.joined() ? "joined-worker" : "worker";
  out.pid = s.pid;
  out.forked = s.forked;
  out.restarts = s.restarts;
  out.lost = s.lost;
  out.blocks_resident_bytes = s.on_demand.blocks_resident_bytes;
  out.block_loads = s.on_demand.block_loads;
  out.block_evictions = s.on_demand.block_evictions;
  out.block_bytes_loaded = s.on_demand.block_bytes_loaded;
  out.block_load_s = s.on_demand.block_load_s;
  out.block_swap_ins = s.on_demand.block_swap_ins;
  out.swapped_bytes = s.on_demand.swapped_bytes;
  if (s.options.memory_policy == SessionOptions::MemoryPolicy::kOnDemand) {  // as configured: known before any heartbeat
    out.memory_measure = s.options.memory_measure == SessionOptions::MemoryMeasure::kProcess ? "process" : "blocks";
  }
  out.unaccounted_bytes = s.on_demand.unaccounted_bytes;
  out.cuda_graphs = s.on_demand.cuda_graphs;
  out.failed_requests = s.failed_requests;
  out.in_flight = s.in_flight.size();
  out.malformed_frames = s.malformed;
  out.computing_block = s.computing_block;
  out.computing_s = s.computing_s;
  out.rss_idle_bytes = s.rss_idle;
  out.rss_bytes = s.rss;
  out.data.kind = s.joined() ? "zmq-tcp" : s.options.channel == "zmq" ? "zmq-ipc" : s.options.channel;
  out.data.bytes_copied = s.bytes_copied;
  if (s.ends) {
    out.shm_requests = s.ends->host_stats();
    out.cuda_requests = s.ends->cuda_stats();
  }
  out.shm_results = s.shm_results;
  out.cuda_results = s.cuda_results;
  out.kpi = s.kpi;
  out.data.sent = s.sent;
  out.data.received = s.received;
  out.data.depth = s.outbound.size();
  out.data.capacity = s.options.max_in_flight;
  out.parked_outputs = s.parked_results;
  out.direct_forwards = s.forwards_sent;
  return out;
}

void WorkerSite::set_sampling(bool enabled, absl::Duration period) {
  std::lock_guard lock(impl_->mu);
  impl_->sampling = enabled;
  if (period > absl::ZeroDuration()) impl_->sampling_period = period;
  impl_->sampling_sent = false;  // the control thread sends it with the next ping
  if (!enabled) impl_->kpi = KpiSample{};
}

absl::Status WorkerSite::update(const std::vector<BlockDescription>& blocks) {
  Impl& s = *impl_;
  std::unique_lock lock(s.mu);
  if (s.state != Impl::State::kReady) {
    return absl::UnavailableError(fmt::format("{} cannot change its blocks now: it is not running{}", s.prefix(),
                                              s.cause.empty() ? "" : " (" + s.cause + ")"));
  }
  // Only removals: a restart from now on must not load the removed blocks again, whether or not
  // this message gets through.
  const bool only_removals = std::all_of(blocks.begin(), blocks.end(), [&](const BlockDescription& b) {
    return std::any_of(s.blocks.begin(), s.blocks.end(), [&](const BlockDescription& c) { return c.name == b.name; });
  });
  if (only_removals) s.set_blocks_locked(blocks);
  const std::uint64_t seq = ++s.update_seq;
  nlohmann::json message = detail::make_config(blocks, s.options);
  message["type"] = detail::kUpdate;
  message["seq"] = seq;
  s.pending_update = std::move(message);  // the control thread sends it within its poll interval
  const bool answered = s.changed.wait_for(lock, absl::ToChronoNanoseconds(s.options.start_timeout), [&] {
    return s.stopping || s.update_answered == seq || s.update_cancelled == seq || s.state != Impl::State::kReady;
  });
  if (s.update_answered == seq) {
    if (!s.update_error.empty()) return absl::InvalidArgumentError(fmt::format("{}: {}", s.prefix(), s.update_error));
    s.set_blocks_locked(blocks);  // what a restart loads from now on
    return absl::OkStatus();
  }
  s.pending_update.reset();
  if (s.update_cancelled == seq) {
    return absl::CancelledError(fmt::format("{}: update cancelled (the worker may still load the blocks)", s.prefix()));
  }
  if (!answered) {
    return absl::DeadlineExceededError(fmt::format("{} did not load its new blocks within {}", s.prefix(),
                                                   absl::FormatDuration(s.options.start_timeout)));
  }
  return absl::UnavailableError(fmt::format("{} went down during the update{}", s.prefix(),
                                            s.cause.empty() ? "" : ": " + s.cause));
}

void WorkerSite::cancel_update() {
  Impl& s = *impl_;
  {
    std::lock_guard lock(s.mu);
    if (s.update_answered == s.update_seq) return;  // none in progress
    s.update_cancelled = s.update_seq;
  }
  s.wake();
}

std::int64_t WorkerSite::pid() const {
  std::lock_guard lock(impl_->mu);
  return impl_->pid;
}

}  // namespace blockflow

namespace blockflow {
std::string WorkerSite::result_endpoint() const {
  std::lock_guard lock(impl_->mu);  // a joined worker's death moves it (move_data_socket())
  return impl_->result_endpoint;
}
std::string WorkerSite::request_endpoint() const {
  std::lock_guard lock(impl_->mu);
  return impl_->request_endpoint;
}
std::string WorkerSite::peer_endpoint() const { return impl_->peer; }

std::int64_t WorkerSite::memory_budget() const { return impl_->options.memory_budget; }

bool WorkerSite::loads_on_demand() const {
  return impl_->options.memory_policy == SessionOptions::MemoryPolicy::kOnDemand && impl_->options.memory_budget > 0;
}

std::string WorkerSite::join_endpoint() const { return impl_->joined() ? impl_->control_endpoint : std::string(); }
}  // namespace blockflow

namespace blockflow {

WorkerOptions worker_options_for(WorkerOptions options, const SiteSettings& settings) {
  options.name = settings.name;
  if (settings.memory_budget > 0) options.memory_budget = settings.memory_budget;
  if (settings.memory_policy == "on_demand") options.memory_policy = SessionOptions::MemoryPolicy::kOnDemand;
  if (settings.memory_policy == "admit") options.memory_policy = SessionOptions::MemoryPolicy::kAdmit;
  if (settings.memory_measure == "process") options.memory_measure = SessionOptions::MemoryMeasure::kProcess;
  if (settings.memory_measure == "blocks") options.memory_measure = SessionOptions::MemoryMeasure::kBlocks;
  if (settings.lanes > 0) options.lanes = settings.lanes;
  return options;
}

void add_deployment(Session& session, const Deployment& deployment, const WorkerOptions& defaults) {
  session.set_site_factory([defaults](const SiteSettings& settings) -> std::shared_ptr<RemoteSite> {
    return make_worker(worker_options_for(defaults, settings));
  });
  for (const auto& name : deployment.workers()) {
    session.add_site(make_worker(worker_options_for(defaults, deployment.site(name))), Session::SiteLifetime::kStopWhenEmpty);
  }
  for (const auto& block : deployment.blocks) session.add_block(block);
  for (auto& path : deployment.paths()) session.add_path(std::move(path));
}
absl::Status cuda_channel_available() { return detail::cuda_ipc_usable(); }

}  // namespace blockflow
