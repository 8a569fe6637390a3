#include <blockflow/worker_site.hpp>
#include <blockflow/detail/log.hpp>
#include <blockflow/names.hpp>
#include <blockflow/detail/clock.hpp>
#include <blockflow/detail/curve_auth.hpp>
#include <blockflow/detail/runtime_dir.hpp>
#include <blockflow/detail/zero_copy_ends.hpp>
#include <blockflow/detail/tensor_codec.hpp>
#include <blockflow/detail/metrics_json.hpp>
#include <blockflow/detail/packet_link.hpp>
#include <blockflow/detail/worker_protocol.hpp>

#include <absl/container/flat_hash_map.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <dlfcn.h>
#include <poll.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <pthread.h>
#include <csignal>
#include <cstring>
#include <deque>
#include <filesystem>
#include <mutex>
#include <thread>
#include <utility>

extern char** environ;

namespace blockflow {
namespace {

using detail::now_ns;

// $BLOCKFLOW_WORKER; else beside this library (a build tree) or in ../bin (an install, wherever it
// was moved); else the build tree's or the configured install path.
std::string default_executable() {
  if (const char* env = std::getenv("BLOCKFLOW_WORKER"); env != nullptr && *env != '\0') return env;
  std::error_code ec;
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&default_executable), &info) != 0 && info.dli_fname != nullptr) {
    const std::filesystem::path dir = std::filesystem::canonical(info.dli_fname, ec).parent_path();
    for (const auto& candidate : {dir / "blockflow-worker", dir.parent_path() / "bin" / "blockflow-worker"}) {
      if (!ec && std::filesystem::exists(candidate, ec)) return candidate.string();
    }
  }
  if (std::filesystem::exists(BLOCKFLOW_WORKER_BUILD_PATH, ec)) return BLOCKFLOW_WORKER_BUILD_PATH;
  return BLOCKFLOW_WORKER_INSTALL_PATH;
}

std::string describe_exit(int status) {
  if (WIFSIGNALED(status)) return fmt::format("killed by signal {}", WTERMSIG(status));
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  return "stopped";
}

// The host's environment with `overrides` ("NAME=VALUE") replacing same-named entries.
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

// "tcp://ADDR:PORT" -> "tcp://ADDR:*" (the data sockets of a joining worker take ephemeral ports).
std::string with_any_port(const std::string& endpoint) {
  return endpoint.substr(0, endpoint.rfind(':') + 1) + "*";
}

int port_of(const std::string& endpoint) { return std::stoi(endpoint.substr(endpoint.rfind(':') + 1)); }

// Handles of the worker's slots whose tensors died here, waiting for the sender to return them.
// Shared with the tensors' deleters, which may run after the site is gone. Also the sender
// thread's doorbell: whatever gives the sender work rings it (deleters cannot take the site's
// mutex, so the sender sleeps on this one), and the sender sleeps until then.
struct ReleaseQueue {
  std::mutex mu;
  std::condition_variable rung_cv;
  bool rung = false;
  std::vector<wire::ShmHandle> handles;
  void push(const wire::ShmHandle& h) {
    {
      std::lock_guard lock(mu);
      handles.push_back(h);
      rung = true;
    }
    rung_cv.notify_one();
  }
  void ring() {
    {
      std::lock_guard lock(mu);
      rung = true;
    }
    rung_cv.notify_one();
  }
  // Until rung (or `backstop`, a guard against a wake-up missed by a bug: it costs a wake-up per
  // second when idle, never a stuck request).
  void wait(std::chrono::milliseconds backstop) {
    std::unique_lock lock(mu);
    rung_cv.wait_for(lock, backstop, [&] { return rung; });
    rung = false;
  }
  std::vector<wire::ShmHandle> take() {
    std::lock_guard lock(mu);
    return std::exchange(handles, {});
  }
  void put_back(std::vector<wire::ShmHandle>&& back) {
    std::lock_guard lock(mu);
    handles.insert(handles.end(), back.begin(), back.end());
  }
};

constexpr std::size_t kReleasesPerMessage = wire::kMaxMessageBytes / wire::kShmHandleBytes;

}  // namespace

struct WorkerSite::Impl {
  enum class State { kIdle, kStarting, kReady, kDown, kFailed, kStopped };
  using Key = std::pair<std::uint64_t, std::uint32_t>;  // (request id, node)

  // Direct edges (channel "zmq", children of this host): an output the worker parked, as the
  // session holds it. A placeholder tensor on the meta device (no bytes here: reading it fails
  // loudly) whose storage context is this record; when the last reference dies unsent, the
  // worker is told to drop the output.
  struct ParkedRef {
    std::weak_ptr<Impl> owner;
    std::uint64_t id = 0;
    pid_t pid = 0;                      // the worker process that holds it
    std::atomic<bool> consumed{false};  // forwarded with kFlagReleaseAfter: nothing to drop
  };
  // A kForward waiting for the sender thread of the worker that holds the outputs.
  struct Forward {
    wire::Header header;
    Tensors described;
    std::vector<std::string> references;
    pid_t holder = 0;  // the worker process that holds the outputs
  };
  struct InFlight {
    std::string block;
    std::weak_ptr<Impl> via;  // the site whose worker holds this request's parked input
  };

  static void delete_parked(void* context) {
    auto* ref = static_cast<ParkedRef*>(context);
    if (!ref->consumed.load(std::memory_order_acquire)) {
      if (auto owner = ref->owner.lock()) owner->queue_drop(ref->id, ref->pid);
    }
    delete ref;
  }
  static ParkedRef* parked_ref_of(const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return nullptr;
    const c10::DataPtr& ptr = t.storage().data_ptr();
    return ptr.get_deleter() == &delete_parked ? static_cast<ParkedRef*>(ptr.get_context()) : nullptr;
  }
  // Where a request's input lies when placeholders stand for it (direct edges).
  struct ParkedInput {
    bool any = false;          // some tensor is a placeholder
    std::weak_ptr<Impl> site;  // set when all are, parked by one worker process: its site...
    pid_t holder = 0;          // ...and that process
  };
  static ParkedInput parked_input(const Tensors& tensors) {
    ParkedInput in;
    bool all = !tensors.empty();
    for (const auto& t : tensors) {
      ParkedRef* ref = parked_ref_of(t);
      if (ref == nullptr) {
        all = false;
        continue;
      }
      if (!in.any) {
        in.any = true;
        in.site = ref->owner;
        in.holder = ref->pid;
        continue;
      }
      const bool same_site = !ref->owner.owner_before(in.site) && !in.site.owner_before(ref->owner);
      if (!same_site || ref->pid != in.holder) all = false;
    }
    if (!all) in.site.reset();
    return in;
  }
  // A request waiting for (or being given to) the worker.
  struct Outbound {
    std::string block;
    Envelope envelope;
    ParkedInput parked;
  };
  static Outbound make_outbound(std::string block, Envelope&& envelope) {
    envelope.local.reset();  // never crosses the process boundary
    ParkedInput parked = parked_input(envelope.tensors);
    return Outbound{std::move(block), std::move(envelope), std::move(parked)};
  }

  WorkerOptions options;
  std::vector<BlockDescription> blocks;
  CompletionFn done;
  std::string dir, control_endpoint, request_endpoint, result_endpoint;
  zmq::context_t context{1};
  std::unique_ptr<detail::CurveServer> curve;  // joined over CURVE; after the sockets, before the context
  // Bound in start() on the caller's thread, then each used by exactly one thread. push and pull
  // carry the data of channel "zmq"; the zero-copy channels use the data link instead.
  zmq::socket_t router, push, pull;
  std::unique_ptr<detail::PacketListener> listener;  // zero-copy channels: the worker connects here

  mutable std::mutex mu;
  std::condition_variable changed;  // state, outbound, in_flight: wakes the sender, run() and start()
  State state = State::kIdle;
  std::string cause;                // why the worker is down / failed
  std::string start_error;
  bool ever_ready = false;
  pid_t pid = 0;
  std::string identity;             // routing id of the live worker
  std::int64_t last_heartbeat_ns = 0;
  std::int64_t start_deadline_ns = 0;
  std::int64_t restart_at_ns = 0;
  std::string kill_cause;           // set when we killed it (heartbeat, start timeout)
  std::uint64_t restarts = 0, failed_requests = 0, malformed = 0, sent = 0, received = 0;
  std::int64_t rss_idle = 0, rss = 0;
  bool loaded = false;              // the worker said "loaded"; ready once its data link is up too
  std::shared_ptr<detail::PacketLink> link;  // zero-copy channels: the live worker's data link
  std::int64_t link_lost_ns = 0;             // when it closed while the worker was still ready
  static constexpr std::int64_t kLinkGraceNs = 500'000'000;  // to exit by itself before we kill it
  std::deque<Outbound> outbound;
  absl::flat_hash_map<Key, InFlight> in_flight;
  // Direct edges. `peer`: our worker's endpoint for other workers (empty: none). As the site whose
  // worker holds parked outputs: kForwards for the sender thread, and the forwarded requests not
  // yet answered by the site that runs them (failed if our worker dies with their input).
  std::weak_ptr<Impl> self;
  std::string peer;
  std::deque<Forward> forwards;
  absl::flat_hash_map<Key, std::weak_ptr<Impl>> pending_forwards;
  std::uint64_t parked_results = 0, forwards_sent = 0, drops_sent = 0;
  std::mutex drops_mu;  // taken by placeholders' deleters (any thread; never with mu)
  std::vector<std::pair<std::uint64_t, pid_t>> drops;
  std::atomic<bool> drops_pending{false};
  std::uint64_t bytes_copied = 0;
  // The zero-copy channels ("shm", "cuda"): our pools for requests, the worker's pools mapped here.
  std::unique_ptr<detail::ZeroCopyEnds> ends;
  detail::ShmStager stager, stager_no_wait;
  detail::ShmResolver resolver;
  detail::ShmUnstager unstage;  // staged for a request that was not sent: back to our pool
  std::shared_ptr<ReleaseQueue> releases = std::make_shared<ReleaseQueue>();
  ShmEdgeStats shm_results, cuda_results;
  KpiSample kpi;
  bool sampling = false, sampling_sent = true;  // sampling_sent: the worker has the current setting
  absl::Duration sampling_period = absl::Milliseconds(100);
  // A block-list update for the running worker: queued for the control thread, answered by seq.
  std::optional<nlohmann::json> pending_update;
  std::uint64_t update_seq = 0, update_answered = 0, update_cancelled = 0;
  std::string update_error;
  std::string cuda_probe;  // channel "cuda": what the worker must open (the connect-time check)
  bool stopping = false;
  bool death_pending = false;       // a joined worker declared dead from the control thread
  std::string unreachable_peer;     // control thread only
  std::thread control, sender, receiver;
  detail::RateLimitedLog noisy;  // messages a peer can trigger per frame

  explicit Impl(WorkerOptions o) : options(std::move(o)) {
    if (options.executable.empty()) options.executable = default_executable();
  }

  // Wakes whoever waits on `changed` (run(), start(), update()) and the sender thread.
  void wake() {
    changed.notify_all();
    releases->ring();
  }

  std::string prefix() const { return fmt::format("worker {}", options.name); }
  // "bf-w1:snd": the site's threads, as top -H and /proc/<pid>/task/*/comm show them.
  void name_thread(const char* role) const {
    const std::string name = fmt::format("bf-{}", options.name).substr(0, 10) + ":" + role;
    pthread_setname_np(pthread_self(), name.c_str());
  }
  bool joined() const { return !options.listen.empty(); }  // on another host, joins over TCP
  bool shm() const { return options.channel == "shm" || options.channel == "cuda"; }  // zero-copy

  absl::Status resolve_channel() {
    std::string& c = options.channel;
    if (c.empty()) c = joined() ? "zmq" : "shm";
    if (c != "shm" && c != "zmq" && c != "cuda") {
      return absl::InvalidArgumentError(fmt::format("{}: channel '{}' is not shm, cuda or zmq", prefix(), c));
    }
    if (c != "zmq" && joined()) {
      return absl::InvalidArgumentError(fmt::format("{}: channel '{}' needs a worker on this host, but it joins over TCP ({})",
                                                    prefix(), c, options.listen));
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
      ends = std::make_unique<detail::ZeroCopyEnds>(pool, c == "cuda");
      // Without a free slot, the target block's full policy decides: kBlock waits for a release (up
      // to 10 s, then the request fails, named), kReject and kDropOldest fail the request at once.
      stager = ends->stager(absl::Seconds(10));
      stager_no_wait = ends->stager(absl::ZeroDuration());
      resolver = ends->resolver([queue = releases](const wire::ShmHandle& h) { queue->push(h); });
      unstage = [this](const wire::ShmHandle& h) { (void)ends->release(h); };
    }
    return absl::OkStatus();
  }

  // With mu held (update() replaces `blocks`).
  const detail::ShmStager* stager_for(const std::string& block) const {
    for (const auto& b : blocks) {
      if (b.name == block && b.options.full_policy != FullPolicy::kBlock) return &stager_no_wait;
    }
    return &stager;
  }

  // Returns the worker's slots whose tensors died here (only to a live worker; one that went away
  // meanwhile gets them back as reclaimed anyway).
  void flush_releases() {
    if (!shm()) return;
    std::shared_ptr<detail::PacketLink> to;
    {
      std::lock_guard lock(mu);
      if (state != State::kReady) return;
      to = link;
    }
    if (!to) return;  // the worker's end closed; supervision is about to see it (its slots are reclaimed)
    std::vector<wire::ShmHandle> all = releases->take();
    for (std::size_t at = 0; at < all.size(); at += kReleasesPerMessage) {
      const std::size_t end = std::min(all.size(), at + kReleasesPerMessage);
      wire::Header h;
      h.kind = wire::MessageKind::kRelease;
      h.message = wire::encode_releases({all.begin() + static_cast<std::ptrdiff_t>(at), all.begin() + static_cast<std::ptrdiff_t>(end)});
      if (!detail::send_packet(*to, h, {}).ok()) {
        releases->put_back({all.begin() + static_cast<std::ptrdiff_t>(at), all.end()});
        return;
      }
    }
  }

  absl::Status spawn_locked() {
    if (joined()) {  // nothing to start: wait for the worker to join
      identity.clear();
      state = State::kStarting;
      kill_cause.clear();
      start_deadline_ns = now_ns() + absl::ToInt64Nanoseconds(options.start_timeout);
      return absl::OkStatus();
    }
    std::vector<std::string> args = {options.executable,       "--name",    options.name,   "--control",
                                     control_endpoint,         "--requests", request_endpoint, "--results",
                                     result_endpoint,          "--parent",  std::to_string(::getpid())};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> env_strings = merged_environment(options.environment);
    std::vector<char*> envp;
    for (auto& e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);
    pid_t child = 0;
    const int rc = ::posix_spawn(&child, options.executable.c_str(), nullptr, nullptr, argv.data(), envp.data());
    if (rc != 0) {
      return absl::UnavailableError(
          fmt::format("{}: cannot start '{}': {}", prefix(), options.executable, std::strerror(rc)));
    }
    pid = child;
    identity.clear();
    loaded = false;
    link.reset();
    link_lost_ns = 0;
    state = State::kStarting;
    kill_cause.clear();
    start_deadline_ns = now_ns() + absl::ToInt64Nanoseconds(options.start_timeout);
    last_heartbeat_ns = now_ns();
    return absl::OkStatus();
  }

  // Fails the given requests outside the lock.
  // Any thread: run() may fail a request while stop() drops `done` (then nobody is told).
  void fail_all(std::vector<std::pair<std::uint64_t, std::uint32_t>> lost, const absl::Status& why) {
    CompletionFn report;
    {
      std::lock_guard lock(mu);
      report = done;
    }
    if (!report) return;
    for (const auto& [id, node] : lost) {
      SiteCompletion c;
      c.request_id = id;
      c.node = node;
      c.outputs = why;
      report(std::move(c));
    }
  }

  // Direct edges: the requests whose input our worker held, now lost with it (or with our stop).
  void fail_forwarded(const std::vector<std::pair<Key, std::weak_ptr<Impl>>>& forwarded, const absl::Status& why) {
    for (const auto& [key, consumer] : forwarded) {
      if (auto c = consumer.lock()) {
        c->complete_error(key.first, key.second,
                          absl::Status(why.code(), fmt::format("its input was parked in {}: {}", prefix(), std::string(why.message()))));
      }
    }
  }
  // Tells the sites that held our requests' inputs that those requests are answered.
  static void forget_vias(const std::vector<std::pair<Key, std::weak_ptr<Impl>>>& vias) {
    for (const auto& [key, via] : vias) {
      if (auto v = via.lock()) {
        std::lock_guard lock(v->mu);
        v->pending_forwards.erase(key);
      }
    }
  }
  // From a placeholder's deleter, on any thread.
  void queue_drop(std::uint64_t id, pid_t holder) {
    {
      std::lock_guard lock(drops_mu);
      drops.emplace_back(id, holder);
    }
    drops_pending.store(true, std::memory_order_release);
    wake();
  }
  // Consumer side: asks the site whose worker holds `f`'s tensors to send them to our worker.
  absl::Status enqueue_forward(Forward&& f, pid_t holder, std::weak_ptr<Impl> consumer) {
    {
      std::lock_guard lock(mu);
      if (stopping || pid != holder || state != State::kReady) {
        return absl::UnavailableError(fmt::format("{}, which held it, {}", prefix(),
                                                  stopping ? "stopped" : pid != holder ? "restarted" : "is down"));
      }
      pending_forwards[{f.header.request_id, f.header.node}] = std::move(consumer);
      f.holder = holder;
      forwards.push_back(std::move(f));
    }
    wake();
    return absl::OkStatus();
  }
  // Sender thread: kForwards, then drops for the live worker (the others' outputs died with them).
  // Never blocks: a message the socket does not take now waits for the next round (1 ms later),
  // and a kForward for a worker process that is gone fails its request instead of reaching the
  // next one.
  void send_direct_edge_messages() {
    std::deque<Forward> now;
    pid_t live = 0;
    {
      std::lock_guard lock(mu);
      now.swap(forwards);
      live = pid;
    }
    while (!now.empty()) {
      Forward& f = now.front();
      absl::Status status;
      if (f.holder != live || live == 0) {
        status = absl::UnavailableError(fmt::format("{} restarted or stopped", prefix()));
      } else {
        try {
          auto sent = detail::send_references(push, f.header, f.described, f.references, zmq::send_flags::dontwait);
          if (!sent.ok()) {
            status = sent.status();
          } else if (!*sent) {  // full: keep the order, try again shortly
            std::lock_guard lock(mu);
            while (!now.empty()) {
              forwards.push_front(std::move(now.back()));
              now.pop_back();
            }
            break;
          }
        } catch (const zmq::error_t& e) {
          status = absl::UnavailableError(e.what());
        }
      }
      std::shared_ptr<Impl> consumer;
      {
        std::lock_guard lock(mu);
        if (status.ok()) ++forwards_sent;
        if (!status.ok()) {
          auto it = pending_forwards.find({f.header.request_id, f.header.node});
          if (it != pending_forwards.end()) {
            consumer = it->second.lock();
            pending_forwards.erase(it);
          }
        }
      }
      if (!status.ok() && (f.header.flags & wire::kFlagReleaseAfter) != 0) {
        for (const auto& t : f.described) {  // not sent: the worker still holds them
          if (ParkedRef* ref = parked_ref_of(t)) ref->consumed.store(false, std::memory_order_release);
        }
      }
      const Key key{f.header.request_id, f.header.node};
      now.pop_front();  // placeholders die here (drops queued unless consumed)
      if (consumer) {
        consumer->complete_error(key.first, key.second,
                                 absl::UnavailableError(fmt::format("{}: cannot forward its parked output: {}", prefix(),
                                                                    std::string(status.message()))));
      }
    }
    bool blocked = false;
    {
      std::lock_guard lock(mu);
      blocked = !forwards.empty();
    }
    if (blocked) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (!drops_pending.exchange(false, std::memory_order_acq_rel)) return;
    std::vector<std::pair<std::uint64_t, pid_t>> taken;
    {
      std::lock_guard lock(drops_mu);
      taken.swap(drops);
    }
    std::vector<std::uint64_t> ids;
    for (const auto& [id, holder] : taken) {
      if (holder == live && live != 0) ids.push_back(id);
    }
    constexpr std::size_t kIdsPerMessage = wire::kMaxMessageBytes / wire::kParkedRefBytes;
    for (std::size_t at = 0; at < ids.size(); at += kIdsPerMessage) {
      wire::Header h;
      h.kind = wire::MessageKind::kDrop;
      h.message = wire::encode_parked_ids(
          {ids.begin() + static_cast<std::ptrdiff_t>(at), ids.begin() + static_cast<std::ptrdiff_t>(std::min(ids.size(), at + kIdsPerMessage))});
      try {
        auto sent = detail::send_message(push, h, {}, zmq::send_flags::dontwait);
        if (!sent.ok() || !*sent) return;  // full: the worker lets its outputs expire
      } catch (const zmq::error_t&) {
        return;  // the worker is going away; its parked outputs with it
      }
      std::lock_guard lock(mu);
      ++drops_sent;
    }
  }
  // The placeholder for output `id` parked in our worker.
  absl::StatusOr<at::Tensor> make_placeholder(const wire::TensorDesc& desc, std::uint64_t id, at::ScalarType type) {
    auto* ref = new ParkedRef;
    ref->owner = self;
    ref->id = id;
    {
      std::lock_guard lock(mu);
      ref->pid = pid;
      ++parked_results;
    }
    c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<std::size_t>(desc.byte_count),
                         c10::DataPtr(ref, ref, &delete_parked, c10::Device(c10::kMeta)), nullptr, false);
    auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::Meta),
                                                      c10::scalarTypeToTypeMeta(type));
    t.unsafeGetTensorImpl()->set_sizes_and_strides(desc.shape, desc.strides);
    return t;
  }
  detail::ParkedResolver parked_resolver = [this](const wire::TensorDesc& desc, std::uint64_t id, at::ScalarType type) {
    return make_placeholder(desc, id, type);
  };

  void on_death(std::string what) {
    // Its leases are void: our slots come back, its pools are no longer looked up.
    if (ends) {
      if (const std::size_t n = ends->reclaim_all(); n > 0) {
        detail::log(LogLevel::kWarning, fmt::format("{}: {} zero-copy slot(s) reclaimed", prefix(), n));
      }
      ends->forget_all();
    }
    std::vector<std::pair<std::uint64_t, std::uint32_t>> lost;
    std::vector<Outbound> queued;
    std::vector<std::pair<Key, std::weak_ptr<Impl>>> vias, forwarded;
    absl::Status why;
    {
      std::lock_guard lock(mu);
      pid = 0;
      identity.clear();
      loaded = false;
      link.reset();
      link_lost_ns = 0;
      cause = kill_cause.empty() ? what : kill_cause;
      for (const auto& [key, entry] : in_flight) {
        lost.push_back(key);
        if (!entry.via.expired()) vias.emplace_back(key, entry.via);
      }
      in_flight.clear();
      forwarded.assign(pending_forwards.begin(), pending_forwards.end());
      pending_forwards.clear();
      forwards.clear();
      failed_requests += lost.size();
      why = absl::UnavailableError(fmt::format("{} {}", prefix(), cause));
      if (!ever_ready) {
        state = State::kFailed;
        if (start_error.empty()) start_error = fmt::format("{} {} while starting", prefix(), cause);
      } else if (restarts < static_cast<std::uint64_t>(options.max_restarts) && !stopping) {
        ++restarts;
        state = State::kDown;
        const auto backoff = options.restart_backoff * static_cast<double>(1ull << std::min<std::uint64_t>(restarts - 1, 10));
        restart_at_ns = now_ns() + absl::ToInt64Nanoseconds(backoff);
        detail::log(LogLevel::kWarning, fmt::format("{} {}; {} request(s) failed; restart {} of {}", prefix(), cause,
                                                     lost.size(), restarts, options.max_restarts));
      } else {
        state = State::kFailed;
        for (auto& o : outbound) queued.push_back(std::move(o));
        outbound.clear();
        failed_requests += queued.size();
        detail::log(LogLevel::kError, fmt::format("{} {}; not restarted ({} restarts used)", prefix(), cause, restarts));
      }
    }
    wake();
    forget_vias(vias);
    fail_all(std::move(lost), why);
    fail_forwarded(forwarded, why);
    for (auto& o : queued) {
      fail_all({{o.envelope.request_id, o.envelope.node}},
               absl::UnavailableError(fmt::format("{} is down: {}", prefix(), cause)));
    }
  }

  void send_control(zmq::socket_t& router, const std::string& to, const nlohmann::json& message) {
    try {
      (void)router.send(zmq::buffer(to), zmq::send_flags::sndmore);
      (void)router.send(zmq::buffer(message.dump()), zmq::send_flags::none);
    } catch (const zmq::error_t& e) {
      // ROUTER_MANDATORY: the peer is gone; supervision notices (process status, heartbeats). Said
      // once per peer.
      if (to != unreachable_peer) {
        unreachable_peer = to;
        noisy.log(LogLevel::kWarning, fmt::format("{}: control message lost: {}", prefix(), e.what()));
      }
    }
  }

  void handle_control(zmq::socket_t& router, const std::string& from, const std::string& payload) {
    auto message = nlohmann::json::parse(payload, nullptr, false);
    if (message.is_discarded() || !message.contains("type")) {
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
      } else if (message.value("pid", 0) != pid) {
        return;  // a stale worker
      }
      identity = from;
      last_heartbeat_ns = now_ns();
      rss_idle = rss = message.value("rss_bytes", std::int64_t{0});
      nlohmann::json config = detail::make_config(blocks, options);
      config["sampling"] = sampling;
      config["sampling_period_ms"] = absl::ToInt64Milliseconds(sampling_period);
      if (!cuda_probe.empty()) config["cuda_probe"] = cuda_probe;
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
      last_heartbeat_ns = now_ns();
      become_ready_locked();
      lock.unlock();
      wake();
    } else if (type == detail::kLoadError) {
      start_error = fmt::format("{}: {}", prefix(), message.value("message", "load failed"));
      kill_cause = "failed to load its blocks";
      if (joined()) death_pending = true;
      else if (pid != 0) ::kill(pid, SIGKILL);
    } else if (type == detail::kUpdated || type == detail::kUpdateError) {
      update_answered = message.value("seq", std::uint64_t{0});
      update_error = type == detail::kUpdated ? "" : message.value("message", "update failed");
      rss = message.value("rss_bytes", rss);
      lock.unlock();
      wake();
    } else if (type == detail::kHeartbeat) {
      last_heartbeat_ns = now_ns();
      rss = message.value("rss_bytes", rss);
      if (message.contains("shm") && message["shm"].is_object()) shm_results = message["shm"].get<ShmEdgeStats>();
      if (message.contains("cuda") && message["cuda"].is_object()) cuda_results = message["cuda"].get<ShmEdgeStats>();
      kpi = message.contains("kpi") ? message["kpi"].get<KpiSample>() : KpiSample{};
    }
  }

  // With mu held: a started worker that has loaded its blocks (and, on a zero-copy channel,
  // connected its data link) takes requests.
  void become_ready_locked() {
    if (state != State::kStarting || !loaded || (listener && !link)) return;
    state = State::kReady;
    ever_ready = true;
  }

  // Reaps the child, enforces heartbeats and start timeouts, restarts after backoff (for a joining
  // worker: declares it dead, then waits for it to join again).
  void supervise() {
    pid_t child = 0;
    std::string death;
    {
      std::lock_guard lock(mu);
      child = pid;
      const std::int64_t now = now_ns();
      auto declare = [&](std::string why) {
        kill_cause = std::move(why);
        if (joined()) death = kill_cause;
        else if (child != 0) ::kill(child, SIGKILL);
      };
      if (death_pending) {
        death_pending = false;
        death = kill_cause;
      } else if (state == State::kReady && now - last_heartbeat_ns > absl::ToInt64Nanoseconds(options.heartbeat_timeout)) {
        declare(fmt::format("missed heartbeats for {} ms", (now - last_heartbeat_ns) / 1000000));
      } else if (state == State::kReady && link_lost_ns != 0 && now - link_lost_ns > kLinkGraceNs) {
        // Its data link closed but the process lives on: it can take no request; start it anew.
        link_lost_ns = 0;
        declare("lost its data link");
      } else if (state == State::kStarting && now > start_deadline_ns) {
        declare(joined() ? fmt::format("did not join at {} within {}", control_endpoint,
                                       absl::FormatDuration(options.start_timeout))
                         : fmt::format("did not start within {}", absl::FormatDuration(options.start_timeout)));
      } else if (child == 0 && state == State::kDown && now >= restart_at_ns) {
        if (auto status = spawn_locked(); !status.ok()) {
          state = State::kFailed;
          cause = std::string(std::string(status.message()));
        }
        return;
      }
    }
    if (!death.empty()) return on_death(death);
    if (child == 0) return;
    int status = 0;
    if (::waitpid(child, &status, WNOHANG) == child) on_death(describe_exit(status));
  }

  void control_main() {
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
      zmq::poll(&item, 1, std::chrono::milliseconds(50));
      if ((item.revents & ZMQ_POLLIN) != 0) {
        std::vector<zmq::message_t> parts;
        if (zmq::recv_multipart(router, std::back_inserter(parts), zmq::recv_flags::dontwait) && parts.size() == 2) {
          handle_control(router, parts[0].to_string(), parts[1].to_string());
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
      if (now_ns() >= next_ping) {  // the worker answers pings with heartbeats
        std::string to;
        std::optional<nlohmann::json> sampler;
        {
          std::lock_guard lock(mu);
          to = identity;
          if (!sampling_sent && !to.empty()) {
            sampler = nlohmann::json{{"type", detail::kSampler}, {"enabled", sampling},
                                     {"period_ms", absl::ToInt64Milliseconds(sampling_period)}};
            sampling_sent = true;
          }
        }
        if (sampler) send_control(router, to, *sampler);
        if (!to.empty()) send_control(router, to, {{"type", detail::kPing}});
        next_ping = now_ns() + absl::ToInt64Nanoseconds(options.heartbeat_interval);
      }
    }
    shutdown_worker(router);
  }

  void shutdown_worker(zmq::socket_t& router) {
    pid_t child = 0;
    std::string to;
    {
      std::lock_guard lock(mu);
      child = pid;
      to = identity;
    }
    if (!to.empty()) send_control(router, to, {{"type", detail::kStop}});
    if (child == 0) return;
    int status = 0;
    for (int i = 0; i < 200; ++i) {  // up to 2 s for a clean exit
      if (::waitpid(child, &status, WNOHANG) == child) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ::kill(child, SIGKILL);
    ::waitpid(child, &status, 0);
  }

  void sender_main() {
    name_thread("snd");
    while (true) {
      flush_releases();
      Outbound next;
      const detail::ShmStager* stager_of_next = nullptr;
      std::shared_ptr<detail::PacketLink> to;
      {
        std::unique_lock lock(mu);
        auto ready = [&] {
          return stopping || (!outbound.empty() && state == State::kReady && in_flight.size() < options.max_in_flight) ||
                 !forwards.empty() || drops_pending.load(std::memory_order_acquire);
        };
        if (stopping) return;
        if (!ready()) {
          // Asleep until something rings: run(), a state change, a reply (room in flight), a
          // released slot or a drop (their deleters run anywhere and ring without mu).
          lock.unlock();
          releases->wait(std::chrono::milliseconds(1000));
          continue;
        }
        if (!forwards.empty() || drops_pending.load(std::memory_order_acquire)) {
          lock.unlock();
          send_direct_edge_messages();
          continue;
        }
        next = std::move(outbound.front());
        outbound.pop_front();
        stager_of_next = admit_locked(next, to);
      }
      wake();  // room in outbound for run()
      transmit(std::move(next), stager_of_next, to);
    }
  }

  // With mu held: a request may skip the sender thread (zero-copy channels: the data link takes
  // packets from any thread) when nothing waits before it and a credit is free.
  bool can_send_now_locked() const {
    return shm() && link && outbound.empty() && state == State::kReady && in_flight.size() < options.max_in_flight;
  }

  // With mu held, for a ready worker with a credit: `next` counts as in flight from now on. Returns
  // its stager (zero-copy channels) and sets `to`, the data link to send it on.
  const detail::ShmStager* admit_locked(const Outbound& next, std::shared_ptr<detail::PacketLink>& to) {
    in_flight[{next.envelope.request_id, next.envelope.node}] = {next.block, next.parked.site};
    ++sent;
    to = link;
    return shm() ? stager_for(next.block) : nullptr;  // `blocks` changes with update()
  }

  // Sends one admitted request: on the data link for the zero-copy channels (any thread), else on
  // the PUSH socket (the sender thread only). A request that cannot be sent fails, named.
  void transmit(Outbound&& next, const detail::ShmStager* stager, const std::shared_ptr<detail::PacketLink>& to) {
    wire::Header header;
    header.kind = wire::MessageKind::kData;
    header.request_id = next.envelope.request_id;
    header.node = next.envelope.node;
    header.target = next.block;
    header.times.sent_ns = now_ns();
    absl::Status status;
    std::uint64_t copied = 0;
    if (shm()) {
      status = to ? detail::send_packet(*to, header, next.envelope.tensors, &copied, stager, &unstage)
                  : absl::UnavailableError("its data link is down");
    } else if (next.parked.any) {
      // Not on `push`: this may be any thread (try_run()).
      auto owner = next.parked.site.lock();
      status = owner ? forward_from(*owner, next.parked.holder, std::move(header), std::move(next.envelope))
                     : absl::UnavailableError("its input is parked in a worker that is gone, or split between workers");
    } else {
      if (next.envelope.outputs_may_stay && !peer.empty()) header.flags |= wire::kFlagParkOutputs;
      try {
        auto sent_ok = detail::send_message(push, header, next.envelope.tensors, zmq::send_flags::none, &copied, stager);
        if (!sent_ok.ok()) status = sent_ok.status();
      } catch (const zmq::error_t& e) {
        status = absl::UnavailableError(e.what());
      }
    }
    if (copied > 0) {
      std::lock_guard lock(mu);
      bytes_copied += copied;
    }
    if (!status.ok()) {
      complete_error(next.envelope.request_id, next.envelope.node,
                     absl::Status(status.code(), fmt::format("{}: block '{}': cannot send: {}", prefix(), next.block,
                                                             std::string(status.message()))));
    }
  }

  // Direct edges: our request's input is parked in `owner`'s worker: that site tells its worker to
  // send it to ours (kForward). Any thread (the owner's sender thread does the sending).
  absl::Status forward_from(Impl& owner, pid_t holder, wire::Header header, Envelope&& envelope) {
    if (peer.empty()) return absl::FailedPreconditionError("its input is parked in another worker, and this one takes no direct edges");
    header.kind = wire::MessageKind::kForward;
    header.message = peer;
    header.times.sent_ns = 0;
    if (envelope.outputs_may_stay) header.flags |= wire::kFlagParkOutputs;
    Forward f;
    // Nobody else holds these placeholders: the worker may forget the outputs once sent.
    bool last = true;
    for (const auto& t : envelope.tensors) last = last && t.use_count() == 1 && t.storage().use_count() == 1;
    for (const auto& t : envelope.tensors) {
      ParkedRef* ref = parked_ref_of(t);
      f.references.push_back(wire::encode_parked_ids({ref->id}));
      if (last) ref->consumed.store(true, std::memory_order_release);
    }
    if (last) header.flags |= wire::kFlagReleaseAfter;
    f.header = std::move(header);
    f.described = std::move(envelope.tensors);
    const Key key{f.header.request_id, f.header.node};
    auto status = owner.enqueue_forward(std::move(f), holder, self);
    if (status.ok()) {
      // Failed meanwhile (our worker died after admitting it): the owner need not remember it.
      bool gone = false;
      {
        std::lock_guard lock(mu);
        gone = in_flight.count(key) == 0;
      }
      if (gone) forget_vias({{key, owner.self}});
    }
    return status;
  }

  // Reports an error for one in-flight request unless it was already reported.
  void complete_error(std::uint64_t id, std::uint32_t node, absl::Status why) {
    std::weak_ptr<Impl> via;
    {
      std::lock_guard lock(mu);
      auto it = in_flight.find({id, node});
      if (it == in_flight.end()) return;
      via = it->second.via;
      in_flight.erase(it);
    }
    wake();
    forget_vias({{{id, node}, via}});
    fail_all({{id, node}}, why);
  }

  void receiver_main() {
    name_thread("rcv");
    while (true) {
      {
        std::lock_guard lock(mu);
        if (stopping) return;
      }
      std::vector<zmq::message_t> frames;
      if (listener) {
        if (!receive_from_link(frames)) continue;
      } else if (!zmq::recv_multipart(pull, std::back_inserter(frames))) {
        continue;  // timeout
      }
      handle_frames(std::move(frames));
    }
  }

  // Zero-copy channels: waits up to 100 ms for the worker's connection or a packet from it. True
  // with a packet's frames; a malformed packet is counted and dropped here.
  bool receive_from_link(std::vector<zmq::message_t>& frames) {
    std::shared_ptr<detail::PacketLink> current;
    {
      std::lock_guard lock(mu);
      current = link;
    }
    // A packet now, or within the spin; else sleep on both the link and the listener.
    std::optional<detail::PacketLink::Received> received;
    if (current) received = current->receive(0, options.receive_spin);
    if (!received) {
      pollfd items[2] = {{listener->fd(), POLLIN, 0}, {current ? current->fd() : -1, POLLIN, 0}};
      if (::poll(items, 2, 100) <= 0) return false;
      if ((items[0].revents & POLLIN) != 0) accept_link();
      if (!current || items[1].revents == 0) return false;
      received = current->receive(0);
    }
    if (!received) return false;
    if (received->closed) {  // the worker is going away; supervision tells how (or kills it)
      std::lock_guard lock(mu);
      if (link == current) {
        link.reset();
        link_lost_ns = now_ns();
      }
      return false;
    }
    if (!received->frames.ok()) {
      on_malformed(std::nullopt, received->frames.status());
      return false;
    }
    frames = *std::move(received->frames);
    return true;
  }

  // The live worker's data link; a connection from any other process is refused (and counted).
  void accept_link() {
    while (auto accepted = listener->accept()) {
      std::unique_lock lock(mu);
      if (accepted->peer_pid == 0 || accepted->peer_pid != pid || joined()) {
        ++malformed;
        const pid_t expected = pid;
        lock.unlock();
        noisy.log(LogLevel::kWarning, fmt::format("{}: data link connection from pid {} refused (the worker is pid {})",
                                                   prefix(), accepted->peer_pid, expected));
        continue;
      }
      link = std::move(accepted->link);
      become_ready_locked();
      lock.unlock();
      wake();
    }
  }

  void handle_frames(std::vector<zmq::message_t>&& frames) {
    std::optional<std::uint64_t> id;
    if (!frames.empty()) id = wire::peek_request_id(frames[0].data(), frames[0].size());
    auto decoded = detail::decode_message(std::move(frames), shm() ? &resolver : nullptr, peer.empty() ? nullptr : &parked_resolver);
    if (!decoded.ok()) return on_malformed(id, decoded.status());
    if (decoded->header.kind == wire::MessageKind::kRelease) {
      auto handles = wire::decode_releases(decoded->header.message);
      if (!handles.ok() || !ends) {
        return on_malformed(std::nullopt,
                            handles.ok() ? absl::InvalidArgumentError("release without shared memory") : handles.status());
      }
      for (const auto& h : *handles) ends->release(h);
      return;
    }
    deliver(std::move(*decoded));
  }

  void on_malformed(std::optional<std::uint64_t> id, const absl::Status& why) {
    std::vector<std::pair<std::uint64_t, std::uint32_t>> affected;
    std::vector<std::pair<Key, std::weak_ptr<Impl>>> vias;
    {
      std::lock_guard lock(mu);
      ++malformed;
      if (id) {
        for (auto it = in_flight.begin(); it != in_flight.end();) {
          if (it->first.first == *id) {
            affected.push_back(it->first);
            if (!it->second.via.expired()) vias.emplace_back(it->first, it->second.via);
            in_flight.erase(it++);
          } else {
            ++it;
          }
        }
      }
    }
    forget_vias(vias);
    noisy.log(LogLevel::kWarning, fmt::format("{}: malformed result frame dropped: {}", prefix(), std::string(why.message())));
    fail_all(std::move(affected),
             absl::DataLossError(fmt::format("{} sent a malformed result: {}", prefix(), std::string(why.message()))));
  }

  // Creates and binds the three sockets; the endpoints get their resolved ports.
  absl::Status bind_sockets() {
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

  void deliver(detail::DecodedMessage&& message) {
    const auto& h = message.header;
    std::weak_ptr<Impl> via;
    {
      std::unique_lock lock(mu);
      auto it = in_flight.find({h.request_id, h.node});
      if (it == in_flight.end()) {
        // Not ours: already failed (worker declared dead), or a request whose parked input our
        // worker could not forward: that error belongs to the site that runs the request.
        auto f = pending_forwards.find({h.request_id, h.node});
        if (f == pending_forwards.end() || h.kind != wire::MessageKind::kError) return;
        auto consumer = f->second.lock();
        pending_forwards.erase(f);
        lock.unlock();
        if (consumer) {
          const auto code = static_cast<absl::StatusCode>(h.status_code == 0 ? 13 : h.status_code);
          consumer->complete_error(h.request_id, h.node, absl::Status(code, fmt::format("{}: {}", prefix(), h.message)));
        }
        return;
      }
      via = it->second.via;
      in_flight.erase(it);
      ++received;
    }
    wake();
    if (!via.expired()) forget_vias({{{h.request_id, h.node}, via}});
    SiteCompletion c;
    c.request_id = h.request_id;
    c.node = h.node;
    // The worker's clock may not be ours (another host): keep its durations, anchor them at the
    // moment the reply arrived, so the transfer back counts as overhead.
    const std::int64_t received_ns = now_ns();
    if (h.times.sent_ns >= h.times.compute_end_ns && h.times.compute_end_ns >= h.times.compute_start_ns &&
        h.times.compute_start_ns > 0) {
      c.compute_end_ns = received_ns - (h.times.sent_ns - h.times.compute_end_ns);
      c.compute_start_ns = c.compute_end_ns - (h.times.compute_end_ns - h.times.compute_start_ns);
    }
    c.wait_ns = std::max<std::int64_t>(0, h.times.dequeued_ns - h.times.arrived_ns);
    if (h.kind == wire::MessageKind::kResult) {
      c.outputs = std::move(message.tensors);
    } else {
      const auto code = static_cast<absl::StatusCode>(h.status_code == 0 ? 13 : h.status_code);
      c.outputs = absl::Status(code, fmt::format("{}: {}", prefix(), h.message));
    }
    done(std::move(c));
  }
};

WorkerSite::WorkerSite(WorkerOptions options) : impl_(std::make_shared<Impl>(std::move(options))) {
  impl_->self = impl_;
  // The name becomes a directory name, a thread name and a metric label: never a path.
  if (auto status = check_name("worker", impl_->options.name); !status.ok()) {
    throw std::invalid_argument(fmt::format("WorkerOptions::name: {}", std::string(status.message())));
  }
}

WorkerSite::~WorkerSite() { stop(); }

const std::string& WorkerSite::name() const { return impl_->options.name; }

absl::Status WorkerSite::start(const std::vector<BlockDescription>& blocks, CompletionFn done) {
  Impl& s = *impl_;
  if (auto status = s.resolve_channel(); !status.ok()) {
    s.state = Impl::State::kStopped;
    return status;
  }
  if (s.joined()) {
    if (s.options.listen.rfind("tcp://", 0) != 0) {
      return absl::InvalidArgumentError(
          fmt::format("{}: listen '{}' is not a tcp://ADDR:PORT endpoint", s.prefix(), s.options.listen));
    }
    s.control_endpoint = s.options.listen;
    s.request_endpoint = s.result_endpoint = with_any_port(s.options.listen);
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
  Impl& s = *impl_;
  Impl::Outbound next = Impl::make_outbound(block, std::move(envelope));
  std::unique_lock lock(s.mu);
  s.changed.wait(lock, [&] {
    return s.stopping || s.state == Impl::State::kFailed || s.outbound.size() < s.options.max_in_flight;
  });
  if (s.stopping || s.state == Impl::State::kFailed) {
    const std::string why = s.stopping ? "stopped" : "down: " + s.cause;
    ++s.failed_requests;
    lock.unlock();
    s.fail_all({{next.envelope.request_id, next.envelope.node}},
               absl::UnavailableError(fmt::format("{} is {}", s.prefix(), why)));
    return;
  }
  if (s.can_send_now_locked()) {
    // The data link takes any thread's packets: send from here, without waking the sender thread
    // (staging may wait for a credit: run() may block).
    std::shared_ptr<detail::PacketLink> to;
    const detail::ShmStager* stager = s.admit_locked(next, to);
    lock.unlock();
    s.transmit(std::move(next), stager, to);
    return;
  }
  s.outbound.push_back(std::move(next));
  lock.unlock();
  s.wake();
}

bool WorkerSite::try_run(const std::string& block, Envelope& envelope) {
  Impl& s = *impl_;
  if (!s.shm()) {
    // Direct edges: a request whose input is parked in a worker costs this thread a small message
    // to that worker's site, never a wait.
    Impl::ParkedInput parked = Impl::parked_input(envelope.tensors);
    if (s.peer.empty() || parked.site.expired()) return false;
    std::unique_lock lock(s.mu);
    if (s.stopping || !s.outbound.empty() || s.state != Impl::State::kReady ||
        s.in_flight.size() >= s.options.max_in_flight) {
      return false;
    }
    envelope.local.reset();  // never crosses the process boundary
    Impl::Outbound next{block, std::move(envelope), std::move(parked)};
    std::shared_ptr<detail::PacketLink> unused;
    (void)s.admit_locked(next, unused);
    lock.unlock();
    s.transmit(std::move(next), nullptr, nullptr);
    return true;
  }
  for (const auto& t : envelope.tensors) {
    if (!detail::ZeroCopyEnds::relays_as_is(t)) return false;  // staging could wait for a credit
  }
  std::unique_lock lock(s.mu);
  if (s.stopping || !s.can_send_now_locked()) return false;
  Impl::Outbound next = Impl::make_outbound(block, std::move(envelope));
  std::shared_ptr<detail::PacketLink> to;
  const detail::ShmStager* stager = s.admit_locked(next, to);
  lock.unlock();
  s.transmit(std::move(next), stager, to);
  return true;
}

void WorkerSite::stop() {
  Impl& s = *impl_;
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
  {
    std::lock_guard lock(s.mu);
    for (const auto& [key, entry] : s.in_flight) {
      lost.push_back(key);
      if (!entry.via.expired()) vias.emplace_back(key, entry.via);
    }
    for (const auto& o : s.outbound) lost.emplace_back(o.envelope.request_id, o.envelope.node);
    forwarded.assign(s.pending_forwards.begin(), s.pending_forwards.end());
    s.pending_forwards.clear();
    s.forwards.clear();
    s.in_flight.clear();
    outbound.swap(s.outbound);  // destroyed outside mu (placeholders' deleters)
    s.state = Impl::State::kStopped;
    s.pid = 0;
  }
  outbound.clear();
  const absl::Status stopped = absl::CancelledError(fmt::format("{} stopped", s.prefix()));
  Impl::forget_vias(vias);
  s.fail_all(std::move(lost), stopped);
  s.fail_forwarded(forwarded, stopped);
  {
    std::lock_guard lock(s.mu);
    s.link.reset();
  }
  s.listener.reset();
  detail::remove_private_dir(s.dir);
  CompletionFn dropped;  // destroyed outside mu: it may hold the last reference to its owner
  {
    std::lock_guard lock(s.mu);
    dropped = std::move(s.done);
    s.done = nullptr;
  }
}

SiteStats WorkerSite::stats() const {
  const Impl& s = *impl_;
  std::lock_guard lock(s.mu);
  SiteStats out;
  out.name = s.options.name;
  out.kind = s.joined() ? "joined-worker" : "worker";
  out.pid = s.pid;
  out.restarts = s.restarts;
  out.failed_requests = s.failed_requests;
  out.in_flight = s.in_flight.size();
  out.malformed_frames = s.malformed;
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
  if (only_removals) s.blocks = blocks;
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
    s.blocks = blocks;  // what a restart loads from now on
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
std::string WorkerSite::result_endpoint() const { return impl_->result_endpoint; }
std::string WorkerSite::request_endpoint() const { return impl_->request_endpoint; }
std::string WorkerSite::peer_endpoint() const { return impl_->peer; }

std::string WorkerSite::join_endpoint() const { return impl_->joined() ? impl_->control_endpoint : std::string(); }
}  // namespace blockflow

namespace blockflow {
void add_deployment(Session& session, const Deployment& deployment, const WorkerOptions& defaults) {
  session.set_site_factory([defaults](const std::string& name) -> std::shared_ptr<RemoteSite> {
    WorkerOptions options = defaults;
    options.name = name;
    return make_worker(std::move(options));
  });
  for (const auto& name : deployment.workers()) {
    WorkerOptions options = defaults;
    options.name = name;
    session.add_site(make_worker(std::move(options)), Session::SiteLifetime::kStopWhenEmpty);
  }
  for (const auto& block : deployment.blocks) session.add_block(block);
  for (auto& path : deployment.paths()) session.add_path(std::move(path));
}
absl::Status cuda_channel_available() { return detail::cuda_ipc_usable(); }

}  // namespace blockflow
