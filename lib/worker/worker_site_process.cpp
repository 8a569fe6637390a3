// The worker process of a WorkerSite: spawning it, its control messages (hello, loaded,
// heartbeats, updates), supervision and restarts, its death, and the sockets it talks to.
#include "worker_site_impl.hpp"

#include <blockflow/core/detail/process_state.hpp>

#include <dlfcn.h>


extern char** environ;

namespace blockflow {
namespace {

// $BLOCKFLOW_WORKER (`ours` false: another program may lie there); else beside this library (a build
// tree) or in ../bin (an install, wherever it was moved); else the build tree's or the configured
// install path.
std::string find_worker_executable(bool& ours) {
  ours = false;
  if (const char* env = std::getenv("BLOCKFLOW_WORKER"); env != nullptr && *env != '\0') return env;
  ours = true;
  std::error_code ec;
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&find_worker_executable), &info) != 0 && info.dli_fname != nullptr) {
    const std::filesystem::path dir = std::filesystem::canonical(info.dli_fname, ec).parent_path();
    for (const auto& candidate : {dir / "blockflow-worker", dir.parent_path() / "bin" / "blockflow-worker"}) {
      if (!ec && std::filesystem::exists(candidate, ec)) return candidate.string();
    }
  }
  if (std::filesystem::exists(BLOCKFLOW_WORKER_BUILD_PATH, ec)) return BLOCKFLOW_WORKER_BUILD_PATH;
  return BLOCKFLOW_WORKER_INSTALL_PATH;
}

int port_of(const std::string& endpoint) { return std::stoi(endpoint.substr(endpoint.rfind(':') + 1)); }

}  // namespace

namespace detail {

std::vector<std::string> merged_environment(const std::vector<std::string>& overrides) {
  std::vector<std::string> out;
  auto name_of = [](const std::string& entry) { return entry.substr(0, entry.find('=')); };
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string entry = *e;
    const bool replaced = std::any_of(overrides.begin(), overrides.end(),
                                      [&](const std::string& o) { return name_of(o) == name_of(entry); });
    if (!replaced) out.push_back(entry);
  }
  out.insert(out.end(), overrides.begin(), overrides.end());
  return out;
}

}  // namespace detail

WorkerSite::Impl::Impl(WorkerOptions o) : options(std::move(o)) {
  if (options.executable.empty()) {
    options.executable = find_worker_executable(default_executable);
  }
}

absl::Status WorkerSite::Impl::spawn_locked() {
  if (joined()) {  // nothing to start: wait for the worker to join
    identity.clear();
    state = State::kStarting;
    kill_cause.clear();
    start_deadline_ns = detail::now_ns() + absl::ToInt64Nanoseconds(options.start_timeout);
    return absl::OkStatus();
  }
  std::vector<std::string> args = {options.executable,       "--name",    options.name,   "--control",
                                   control_endpoint,         "--requests", request_endpoint, "--results",
                                   result_endpoint,          "--parent",  std::to_string(::getpid())};
  const detail::ChildProcess::Spec spec{options.executable, std::move(args), environment, options.fork && default_executable};
  std::string not_forked;
  auto started = detail::ChildProcess::start(spec, &not_forked);
  if (!started.ok()) return absl::UnavailableError(fmt::format("{}: {}", prefix(), std::string(started.status().message())));
  if (!not_forked.empty() && !std::exchange(fork_refusal_logged, true)) {
    detail::log(LogLevel::kWarning, fmt::format("{}: started as a new process, not forked from the fork server: {} "
                                                "(docs/workers.md, \"Fork server\")",
                                                prefix(), not_forked));
  }
  process = *std::move(started);
  pid = process.pid();
  forked = process.forked();
  identity.clear();
  loaded = false;
  link.reset();
  link_lost_ns = 0;
  state = State::kStarting;
  kill_cause.clear();
  start_deadline_ns = detail::now_ns() + absl::ToInt64Nanoseconds(options.start_timeout);
  last_heartbeat_ns = detail::now_ns();
  return absl::OkStatus();
}

namespace {
thread_local std::vector<const void*> reporting_sites;  // fail_all() calls this thread is inside
}  // namespace

int WorkerSite::Impl::reports_on_this_thread() const {
  return static_cast<int>(std::count(reporting_sites.begin(), reporting_sites.end(), this));
}

void WorkerSite::Impl::fail_all(std::vector<std::pair<std::uint64_t, std::uint32_t>> lost, const absl::Status& why) {
  if (lost.empty()) return;
  reporting_sites.reserve(reporting_sites.size() + 1);  // the push below cannot throw once counted
  CompletionFn report;
  {
    std::lock_guard lock(mu);
    report = done;
    if (report) ++reports_running;
  }
  if (!report) return;
  struct Running {  // however the reports end
    Impl& site;
    CompletionFn& report;
    Running(Impl& s, CompletionFn& r) : site(s), report(r) { reporting_sites.push_back(&s); }
    ~Running() {
      reporting_sites.pop_back();
      report = nullptr;  // before stop() may return: it may hold the last reference to its owner
      // Notified under mu: once the count is down, stop() may return and the site be freed.
      std::lock_guard lock(site.mu);
      --site.reports_running;
      site.changed.notify_all();
    }
  } running(*this, report);
  for (const auto& [id, node] : lost) {
    SiteCompletion c;
    c.request_id = id;
    c.node = node;
    c.outputs = why;
    report(std::move(c));
  }
}

void WorkerSite::Impl::on_death(std::string what) {
  // Its leases are void: our slots come back (its pools went with its link).
  if (ends) {
    if (const std::size_t n = ends->reclaim_all(); n > 0) {
      detail::log(LogLevel::kWarning, fmt::format("{}: {} zero-copy slot(s) reclaimed", prefix(), n));
    }
  }
  std::vector<std::pair<std::uint64_t, std::uint32_t>> lost;
  std::deque<Outbound> queued;
  std::vector<std::pair<Key, std::weak_ptr<Impl>>> vias, forwarded;
  absl::Status why;
  LostFn lost_now;
  std::deque<Forward> dropped_forwards;  // destroyed outside mu (their placeholders' deleters take drops_mu)
  {
    std::lock_guard lock(mu);
    const pid_t dead = pid;
    pid = 0;
    forked = false;
    identity.clear();
    loaded = false;
    if (link && dead > 0) link->peer_died(dead);  // its pools, for the workers its results were relayed to
    link.reset();
    link_lost_ns = 0;
    computing_block.clear();
    computing_s = 0;
    cause = kill_cause.empty() ? what : kill_cause;
    if (joined()) ++data_epoch;
    for (const auto& [key, entry] : in_flight) {
      lost.push_back(key);
      if (!entry.via.expired()) vias.emplace_back(key, entry.via);
    }
    in_flight.clear();
    forwarded.assign(pending_forwards.begin(), pending_forwards.end());
    pending_forwards.clear();
    dropped_forwards.swap(forwards);
    failed_requests += lost.size();
    why = absl::UnavailableError(fmt::format("{} {}", prefix(), cause));
    if (!ever_ready) {
      state = State::kFailed;
      if (start_error.empty()) start_error = fmt::format("{} {} while starting", prefix(), cause);
    } else if (restarts < static_cast<std::uint64_t>(options.max_restarts) && !stopping) {
      ++restarts;
      state = State::kDown;
      const auto backoff = options.restart_backoff * static_cast<double>(1ull << std::min<std::uint64_t>(restarts - 1, 10));
      restart_at_ns = detail::now_ns() + absl::ToInt64Nanoseconds(backoff);
      detail::log(LogLevel::kWarning, fmt::format("{} {}; {} request(s) failed; restart {} of {}", prefix(), cause,
                                                   lost.size(), restarts, options.max_restarts));
    } else {
      queued = give_up_locked(lost_now);
      detail::log(LogLevel::kError, fmt::format("{} {}; not restarted ({} restarts used)", prefix(), cause, restarts));
    }
  }
  dropped_forwards.clear();
  if (lost_now) lost_now(std::string(why.message()));
  wake();
  forget_vias(vias);
  fail_all(std::move(lost), why);
  fail_forwarded(forwarded, why);
  fail_queued(std::move(queued), absl::UnavailableError(fmt::format("{} is down: {}", prefix(), cause)));
}

std::deque<WorkerSite::Impl::Outbound> WorkerSite::Impl::give_up_locked(LostFn& lost_now) {
  state = State::kFailed;
  std::deque<Outbound> queued = std::exchange(outbound, {});
  failed_requests += queued.size();
  if (!stopping) lost_now = take_lost_locked();
  return queued;
}

void WorkerSite::Impl::fail_queued(std::deque<Outbound> queued, const absl::Status& why) {
  for (auto& o : queued) fail_all({{o.envelope.request_id, o.envelope.node}}, why);
}

void WorkerSite::Impl::send_control(zmq::socket_t& router, const std::string& to, const nlohmann::json& message) {
  try {
    (void)router.send(zmq::buffer(to), zmq::send_flags::sndmore);
    (void)router.send(zmq::buffer(detail::dump_json(message)), zmq::send_flags::none);
  } catch (const zmq::error_t& e) {
    // ROUTER_MANDATORY: the peer is gone; supervision notices (process status, heartbeats). Said
    // once per peer.
    if (to != unreachable_peer) {
      unreachable_peer = to;
      noisy.log(LogLevel::kWarning, fmt::format("{}: control message lost: {}", prefix(), e.what()));
    }
  }
}

void WorkerSite::Impl::handle_control(zmq::socket_t& router, const std::string& from, const std::string& payload) {
  auto message = nlohmann::json::parse(payload, nullptr, false);
  if (message.is_discarded() || !message.contains("type")) {
    {
      std::lock_guard lock(mu);
      ++malformed;
    }
    noisy.log(LogLevel::kWarning, fmt::format("{}: malformed control message dropped", prefix()));
    return;
  }
  const std::string type = message.value("type", "");
  std::unique_lock lock(mu);
  if (type == detail::kHello) {
    if (joined()) {
      if (message.value("name", "") != options.name) {
        noisy.log(LogLevel::kWarning, fmt::format("{}: a worker named '{}' tried to join; ignored", prefix(),
                                                     message.value("name", "")));
        return;
      }
      if (state != State::kStarting) return;  // one worker at a time; a second one keeps knocking
      if (push_epoch != data_epoch || pull_epoch != data_epoch) return;  // moving: it knocks again
    } else if (message.value("pid", 0) != pid) {
      return;  // a stale worker
    }
    identity = from;
    last_heartbeat_ns = detail::now_ns();
    rss_idle = rss = message.value("rss_bytes", std::int64_t{0});
    nlohmann::json config = detail::make_config(blocks, options);
    config["sampling"] = sampling;
    config["sampling_period_ms"] = absl::ToInt64Milliseconds(sampling_period);
    if (!cuda_probe.empty()) config["cuda_probe"] = cuda_probe;
    if (warm_up_threads > 0) config["warm_up_threads"] = std::exchange(warm_up_threads, 0);  // a restart warms up alone
    sampling_sent = true;
    if (listener) config["data_link"] = listener->path();
    if (!peer.empty()) {
      config["peer_endpoint"] = peer;
      config["max_parked"] = 2 * options.max_in_flight;
    }
    if (joined()) {
      config["requests_port"] = port_of(request_endpoint);
      config["results_port"] = port_of(result_endpoint);
    }
    lock.unlock();
    send_control(router, from, config);
  } else if (from != identity) {
    return;  // from an earlier incarnation
  } else if (type == detail::kLoaded) {
    rss = message.value("rss_bytes", rss);
    loaded = true;
    last_heartbeat_ns = detail::now_ns();
    become_ready_locked();
    lock.unlock();
    wake();
  } else if (type == detail::kLoadError) {
    start_error = fmt::format("{}: {}", prefix(), message.value("message", "load failed"));
    // Named in the log and in the failures of a restart that cannot load (start() reads start_error).
    kill_cause = fmt::format("failed to load its blocks: {}", message.value("message", "load failed"));
    if (joined()) death_pending = true;
    else process.kill();
  } else if (type == detail::kUpdated || type == detail::kUpdateError) {
    // Every field read before any is taken: one of the wrong type drops the whole answer.
    const auto seq = message.value("seq", std::uint64_t{0});
    std::string error = type == detail::kUpdated ? "" : message.value("message", "update failed");
    const auto rss_now = message.value("rss_bytes", rss);
    update_answered = seq;
    update_error = std::move(error);
    rss = rss_now;
    lock.unlock();
    wake();
  } else if (type == detail::kHeartbeat) {
    rss = message.value("rss_bytes", rss);
    if (message.contains("shm") && message["shm"].is_object()) shm_results = message["shm"].get<ShmEdgeStats>();
    if (message.contains("cuda") && message["cuda"].is_object()) cuda_results = message["cuda"].get<ShmEdgeStats>();
    kpi = message.contains("kpi") ? message["kpi"].get<KpiSample>() : KpiSample{};
    computing_block.clear();
    computing_s = 0;
    if (const auto it = message.find("computing"); it != message.end() && it->is_object()) {
      computing_block = it->value("block", "");
      computing_s = it->value("s", 0.0);
    }
    // Replaced by each heartbeat (absent: no block of the worker has a graph, after a restart or an update too).
    on_demand.cuda_graphs.clear();
    if (const auto it = message.find("cuda_graphs"); it != message.end() && it->is_object()) {
      try {
        on_demand.cuda_graphs = it->get<std::map<std::string, CudaGraphStats>>();
      } catch (const nlohmann::json::exception&) {  // malformed: no counters, the heartbeat still counts
      }
    }
    if (const auto it = message.find("on_demand"); it != message.end() && it->is_object()) {
      on_demand.blocks_resident_bytes = it->value("blocks_resident_bytes", std::int64_t{0});
      on_demand.block_loads = it->value("block_loads", std::uint64_t{0});
      on_demand.block_evictions = it->value("block_evictions", std::uint64_t{0});
      on_demand.block_bytes_loaded = it->value("block_bytes_loaded", std::int64_t{0});
      on_demand.block_load_s = it->value("block_load_s", 0.0);
      on_demand.block_swap_ins = it->value("block_swap_ins", std::uint64_t{0});
      on_demand.swapped_bytes = it->value("swapped_bytes", std::int64_t{0});
      on_demand.unaccounted_bytes = it->value("unaccounted_bytes", std::int64_t{0});
    }
    last_heartbeat_ns = detail::now_ns();  // last: a heartbeat with a field of the wrong type does not count
  }
}

void WorkerSite::Impl::become_ready_locked() {
  if (state != State::kStarting || !loaded || (listener && !link)) return;
  state = State::kReady;
  ever_ready = true;
}

WorkerSite::LostFn WorkerSite::Impl::take_lost_locked() {
  lost = true;
  return std::exchange(lost_fn, nullptr);  // said once
}

void WorkerSite::Impl::supervise() {
  pid_t child = 0;
  std::string death, lost_cause;
  LostFn lost_now;
  std::deque<Outbound> queued;  // requests that waited for a restart that could not spawn
  {
    std::lock_guard lock(mu);
    child = pid;
    const std::int64_t now = detail::now_ns();
    auto declare = [&](std::string why) {
      // The first reason this incarnation was killed for stays its cause (a SIGKILLed child may
      // then miss heartbeats while the kernel tears it down).
      if (kill_cause.empty()) kill_cause = std::move(why);
      if (joined()) death = kill_cause;
      else process.kill();
    };
    if (death_pending) {
      death_pending = false;
      death = kill_cause;
    } else if (state == State::kReady && now - last_heartbeat_ns > absl::ToInt64Nanoseconds(options.heartbeat_timeout)) {
      // A child that has died already (killed from outside while its heartbeats were late) is
      // reported by how it died, not as silent.
      // One still tearing itself down is waited for (the waitpid below reports it), for up to
      // another timeout.
      const bool late = now - last_heartbeat_ns > 2 * absl::ToInt64Nanoseconds(options.heartbeat_timeout);
      if (auto how = joined() ? std::nullopt : process.exited()) {
        death = *std::move(how);
      } else if (!joined() && child != 0 && !late && process.exiting()) {
        // not silent: dying
      } else {
        declare(fmt::format("missed heartbeats for {} ms", (now - last_heartbeat_ns) / 1000000));
      }
    } else if (state == State::kReady && options.compute_timeout > absl::ZeroDuration() &&
               absl::Seconds(computing_s) > options.compute_timeout) {
      // Its heartbeats come from its control thread: a block that never returns does not stop them.
      declare(fmt::format("ran block '{}' for more than {} in one call (compute_timeout)", computing_block,
                          absl::FormatDuration(options.compute_timeout)));
      computing_s = 0;
    } else if (state == State::kReady && link_lost_ns != 0 && now - link_lost_ns > kLinkGraceNs) {
      // Its data link closed. A worker that died closed it as it went: it is reported by how it
      // died (waited for while it is exiting, up to a heartbeat timeout more). One that lives on
      // can take no request: start it anew.
      if (auto how = joined() ? std::nullopt : process.exited()) {
        death = *std::move(how);
      } else if (joined() || !process.exiting() ||
                 now - link_lost_ns - kLinkGraceNs > absl::ToInt64Nanoseconds(options.heartbeat_timeout)) {
        link_lost_ns = 0;
        declare("lost its data link");
      }
    } else if (state == State::kStarting && now > start_deadline_ns) {
      // Its data link may be what this process could not take (no descriptor left): said so.
      const absl::Status unaccepted = listener ? listener->error() : absl::OkStatus();
      declare(joined() ? fmt::format("did not join at {} within {}", control_endpoint,
                                     absl::FormatDuration(options.start_timeout))
                       : fmt::format("did not start within {}{}", absl::FormatDuration(options.start_timeout),
                                     unaccepted.ok() ? "" : fmt::format(" (its data link: {})", std::string(unaccepted.message()))));
    } else if (child == 0 && state == State::kDown && now >= restart_at_ns) {
      auto status = spawn_locked();
      if (!status.ok() && restarts < static_cast<std::uint64_t>(options.max_restarts) && !stopping) {
        // A failed spawn (EAGAIN, a fork-server hiccup) uses a restart and backs off again.
        ++restarts;
        restart_at_ns = now + absl::ToInt64Nanoseconds(options.restart_backoff * static_cast<double>(
                                                           1ull << std::min<std::uint64_t>(restarts - 1, 10)));
        detail::log(LogLevel::kWarning, fmt::format("{} could not be restarted: {}; restart {} of {}", prefix(),
                                                     std::string(status.message()), restarts, options.max_restarts));
      } else if (!status.ok()) {
        lost_cause = fmt::format("{} could not be restarted: {}", prefix(), std::string(status.message()));
        cause = lost_cause;  // what later requests are refused with ("... is down: ...")
        detail::log(LogLevel::kError, lost_cause);
        queued = give_up_locked(lost_now);
      }
    }
  }
  if (lost_now) lost_now(lost_cause);
  if (!lost_cause.empty()) {
    wake();  // run() callers waiting for room in outbound see kFailed
    fail_queued(std::move(queued), absl::UnavailableError(lost_cause));
  }
  if (!death.empty()) return on_death(death);
  if (child == 0) return;
  if (auto how = process.exited()) on_death(*std::move(how));
}

void WorkerSite::Impl::control_main() {
  name_thread("ctl");
  {
    std::lock_guard lock(mu);
    if (auto status = spawn_locked(); !status.ok()) {
      state = State::kFailed;
      start_error = std::string(std::string(status.message()));
    }
  }
  wake();
  std::int64_t next_ping = 0;
  while (true) {
    {
      std::lock_guard lock(mu);
      if (stopping) break;
    }
    zmq::pollitem_t item{router.handle(), 0, ZMQ_POLLIN, 0};
    detail::poll_items(&item, 1, std::chrono::milliseconds(50));
    if ((item.revents & ZMQ_POLLIN) != 0) {
      std::vector<zmq::message_t> parts;
      if (zmq::recv_multipart(router, std::back_inserter(parts), zmq::recv_flags::dontwait) && parts.size() == 2) {
        try {
          handle_control(router, parts[0].to_string(), parts[1].to_string());
        } catch (const nlohmann::json::exception& e) {  // a field of the wrong type: the message is dropped, not the site
          {
            std::lock_guard lock(mu);
            ++malformed;
          }
          noisy.log(LogLevel::kWarning, fmt::format("{}: malformed control message dropped: {}", prefix(), e.what()));
        }
      }
    }
    supervise();
    {
      std::optional<nlohmann::json> update;
      std::string to;
      {
        std::lock_guard lock(mu);
        if (!identity.empty() && state == State::kReady) {
          update = std::exchange(pending_update, std::nullopt);
          to = identity;
        }
      }
      if (update) send_control(router, to, *update);
    }
    if (detail::now_ns() >= next_ping) {  // the worker answers pings with heartbeats
      std::string to;
      std::optional<nlohmann::json> sampler;
      bool ready = false;  // only a ready worker reads its control socket: unread pings would fill it
      {
        std::lock_guard lock(mu);
        to = identity;
        ready = !to.empty() && state == State::kReady;
        if (!sampling_sent && !to.empty()) {
          sampler = nlohmann::json{{"type", detail::kSampler}, {"enabled", sampling},
                                   {"period_ms", absl::ToInt64Milliseconds(sampling_period)}};
          sampling_sent = true;
        }
      }
      if (sampler) send_control(router, to, *sampler);
      if (ready) send_control(router, to, {{"type", detail::kPing}});
      next_ping = detail::now_ns() + absl::ToInt64Nanoseconds(options.heartbeat_interval);
    }
  }
  shutdown_worker(router);
}

void WorkerSite::Impl::shutdown_worker(zmq::socket_t& router) {
  pid_t child = 0;
  std::string to;
  {
    std::lock_guard lock(mu);
    child = pid;
    to = identity;
  }
  if (!to.empty()) send_control(router, to, {{"type", detail::kStop}});
  if (child == 0) return;
  (void)process.stop(std::chrono::seconds(2));  // up to 2 s for a clean exit
}

void WorkerSite::Impl::move_data_socket(zmq::socket_t& socket, std::string& endpoint, std::uint64_t& epoch) {
  std::string old;
  std::uint64_t target = 0;
  {
    std::lock_guard lock(mu);
    if (epoch == data_epoch) return;
    target = data_epoch;
    old = endpoint;
  }
  try {
    socket.unbind(old);
  } catch (const zmq::error_t&) {
    // Unbound by an earlier try whose bind failed.
  }
  try {
    socket.bind(with_any_port(options.listen));
  } catch (const zmq::error_t& e) {
    noisy.log(LogLevel::kWarning, fmt::format("{}: cannot move a data socket to a new port: {}", prefix(), e.what()));
    return;  // tried again on the next turn of its thread
  }
  const std::string now = socket.get(zmq::sockopt::last_endpoint);
  std::lock_guard lock(mu);
  endpoint = now;
  epoch = target;
}

absl::Status WorkerSite::Impl::bind_sockets() {
  auto bind = [&](zmq::socket_t& socket, std::string& endpoint) -> absl::Status {
    try {
      socket.bind(endpoint);
    } catch (const zmq::error_t& e) {
      return absl::UnavailableError(fmt::format("{}: cannot bind '{}': {}", prefix(), endpoint, e.what()));
    }
    endpoint = socket.get(zmq::sockopt::last_endpoint);
    return absl::OkStatus();
  };
  if (joined()) {
    const std::string what = fmt::format("{} join endpoint", prefix());
    if (auto status = detail::check_tcp_bind(options.listen, options.security, what); !status.ok()) return status;
    if (options.security.curve()) {
      auto started = detail::CurveServer::start(context, options.security, what);
      if (!started.ok()) return started.status();
      curve = *std::move(started);
    }
  }
  // Every socket a joined worker reaches admits the key named after the worker only.
  auto secure = [&](zmq::socket_t& socket) {
    if (curve) curve->secure(socket, options.name);
  };
  router = zmq::socket_t(context, zmq::socket_type::router);
  secure(router);
  router.set(zmq::sockopt::router_mandatory, 1);
  router.set(zmq::sockopt::linger, 0);
  router.set(zmq::sockopt::maxmsgsize, std::int64_t{1} << 20);  // control messages are small JSON
  if (shm()) {  // a child on this host: the data link beside the control socket
    auto bound = detail::PacketListener::bind(dir + "/data");
    if (!bound.ok()) return absl::Status(bound.status().code(), fmt::format("{}: {}", prefix(), std::string(bound.status().message())));
    listener = *std::move(bound);
    request_endpoint = result_endpoint = listener->path();
    return bind(router, control_endpoint);
  }
  push = zmq::socket_t(context, zmq::socket_type::push);
  secure(push);
  push.set(zmq::sockopt::linger, 0);
  push.set(zmq::sockopt::sndtimeo, kPushTimeoutMs);  // transmit() re-checks the request between tries
  // Credits bound the data messages; kForward and kDrop (direct edges) share the pipe.
  push.set(zmq::sockopt::sndhwm, static_cast<int>(4 * options.max_in_flight) + 16);
  pull = zmq::socket_t(context, zmq::socket_type::pull);
  secure(pull);
  pull.set(zmq::sockopt::linger, 0);
  pull.set(zmq::sockopt::rcvtimeo, 100);
  pull.set(zmq::sockopt::maxmsgsize, static_cast<std::int64_t>(wire::kMaxTensorBytes));
  for (auto [socket, endpoint] : {std::pair{&router, &control_endpoint}, std::pair{&push, &request_endpoint},
                                  std::pair{&pull, &result_endpoint}}) {
    if (auto status = bind(*socket, *endpoint); !status.ok()) return status;
  }
  return absl::OkStatus();
}

}  // namespace blockflow
