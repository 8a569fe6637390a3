#pragma once
// Internal to lib/worker: WorkerSite::Impl, shared by the files that implement a worker site:
//   worker_site.cpp          the public WorkerSite API (start, run, try_run, stop, stats, update)
//   worker_site_process.cpp  the worker process: spawn, control messages, supervision, death, sockets
//   worker_site_outbound.cpp the sender thread: requests, direct edges (forwards, drops)
//   worker_site_inbound.cpp  the receiver thread: results from the data link or ZeroMQ, malformed frames
// Locking: `mu` guards the state below it (functions named *_locked expect it held); `drops_mu`
// is taken by placeholders' deleters on any thread and never with `mu`.

#include <blockflow/worker/worker_site.hpp>
#include <blockflow/core/detail/log.hpp>
#include <blockflow/core/names.hpp>
#include <blockflow/core/detail/clock.hpp>
#include <blockflow/channel/detail/curve_auth.hpp>
#include <blockflow/channel/detail/zmq_calls.hpp>
#include <blockflow/channel/detail/runtime_dir.hpp>
#include <blockflow/channel/detail/zero_copy_ends.hpp>
#include <blockflow/channel/detail/zero_copy_link.hpp>
#include <blockflow/channel/detail/tensor_codec.hpp>
#include <blockflow/observe/detail/metrics_json.hpp>
#include <blockflow/channel/detail/packet_link.hpp>
#include <blockflow/worker/detail/child_process.hpp>
#include <blockflow/worker/detail/worker_protocol.hpp>

#include <absl/container/flat_hash_map.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <poll.h>
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

namespace blockflow {
namespace detail {

// The sender thread's doorbell: whatever gives the sender work rings it (placeholders' deleters
// cannot take the site's mutex, so the sender sleeps on this one), and the sender sleeps until then.
struct Doorbell {
  std::mutex mu;
  std::condition_variable rung_cv;
  bool rung = false;
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
};

// The host's environment (read now) with `overrides` ("NAME=VALUE") replacing same-named entries.
std::vector<std::string> merged_environment(const std::vector<std::string>& overrides);

}  // namespace detail

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
  // A kForward for the worker that holds the outputs (sent by the thread that makes it, or queued
  // for the sender thread).
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
  struct Turns {
    std::uint64_t next = 0;                // the turn the next admitted request gets (under mu)
    std::atomic<std::uint64_t> serving{0};  // the turn being sent (advanced under turn_mu)
  };
  struct Outbound {
    std::string block;
    Envelope envelope;
    ParkedInput parked;
    std::shared_ptr<Turns> turns;  // set by admit_locked(): its block's, and its place among them
    std::uint64_t turn = 0;
  };
  static Outbound make_outbound(std::string block, Envelope&& envelope) {
    envelope.local.reset();  // never crosses the process boundary
    ParkedInput parked = parked_input(envelope.tensors);
    return Outbound{std::move(block), std::move(envelope), std::move(parked), nullptr, 0};
  }

  WorkerOptions options;
  bool default_executable = false;  // options.executable is BlockFlow's blockflow-worker, found by the site: forkable
  std::vector<std::string> environment;  // the worker's: the host's at start() with options.environment over it
  bool fork_refusal_logged = false;  // the control thread's: why the fork server could not take the worker, said once
  detail::ChildProcess process;     // the control thread's: the live worker process (none while joined or down)
  std::vector<BlockDescription> blocks;
  CompletionFn done;
  // Calls of `done` fail_all() is making now, from any thread (a request run() fails at once, a send
  // another site's thread could not make): stop() returns only once they are over, for its owner may
  // be gone after it. Under mu.
  int reports_running = 0;
  LostFn lost_fn;                   // RemoteSite::on_lost(); dropped by stop() with `done`
  bool lost = false;                // gone for good: died after its last restart
  SiteStats on_demand;              // WorkerOptions::memory_policy kOnDemand: the block_* figures of the last heartbeat
  std::string dir, control_endpoint, request_endpoint, result_endpoint;  // the last two under mu once started
  zmq::context_t context{1};
  std::unique_ptr<detail::CurveServer> curve;  // joined over CURVE; after the sockets, before the context
  // Bound in start() on the caller's thread. push and pull carry the data of channel "zmq"; the
  // zero-copy channels use the data link instead. router and pull are each used by one thread;
  // push by whichever thread holds push_mu (the sender thread, or a thread sending a kForward
  // itself: enqueue_forward()).
  zmq::socket_t router, push, pull;
  std::mutex push_mu;  // before mu where both are taken
  std::unique_ptr<detail::PacketListener> listener;  // zero-copy channels: the worker connects here

  mutable std::mutex mu;
  std::condition_variable changed;  // state, outbound, in_flight: wakes the sender, run() and start()
  State state = State::kIdle;
  std::string cause;                // why the worker is down / failed
  std::string start_error;
  bool ever_ready = false;
  pid_t pid = 0;
  bool forked = false;              // the live worker was forked from the fork server
  int warm_up_threads = 0;          // for the next configuration sent (starting_together()); 0: the worker's own
  std::string identity;             // routing id of the live worker
  std::int64_t last_heartbeat_ns = 0;
  std::int64_t start_deadline_ns = 0;
  std::int64_t restart_at_ns = 0;
  std::string kill_cause;           // why we killed it (heartbeat, start timeout...): the first reason
  std::uint64_t restarts = 0, failed_requests = 0, malformed = 0, sent = 0, received = 0;
  std::int64_t rss_idle = 0, rss = 0;
  bool loaded = false;              // the worker said "loaded"; ready once its data link is up too
  std::shared_ptr<detail::ZeroCopyLink> link;  // zero-copy channels: the live worker's data link
  std::int64_t link_lost_ns = 0;             // when it closed while the worker was still ready
  // A joined worker's death moves push and pull to fresh ports (each by its own thread): a worker
  // declared dead that still holds TCP connections to them (stopped, cut off from the control
  // socket) then gets no request and delivers no result. A worker that joins is answered once both
  // have moved (it says hello again every second).
  std::uint64_t data_epoch = 0, push_epoch = 0, pull_epoch = 0;
  std::string computing_block;  // the worker's longest block call in progress, as of its last heartbeat
  double computing_s = 0;
  std::mutex stop_mu;  // stop() runs once at a time: a second caller waits, then finds it stopped
  static constexpr std::int64_t kLinkGraceNs = 500'000'000;  // to exit by itself before we kill it
  static constexpr int kPushTimeoutMs = 100;  // one blocking try of a request send (channel zmq)
  std::deque<Outbound> outbound;
  absl::flat_hash_map<Key, InFlight> in_flight;
  // A block's requests leave in the order they were admitted, whichever threads transmit them (the
  // sender thread, the block's forwarder in run_unless(), a site's thread in try_run()): admit_locked()
  // hands out the block's turns and transmit() waits for its own (a turn is given back before the
  // request's failure is reported). The session hands a block's requests over in order, so they
  // reach the worker in that order. Per block: one waiting for a slot holds up no other block.
  absl::flat_hash_map<std::string, std::shared_ptr<Turns>> turns;  // under mu
  std::mutex turn_mu;
  std::condition_variable turn_cv;
  // With mu held: whether a request for `block` admitted before is still being sent (one admitted
  // now would wait for it).
  [[nodiscard]] bool transmitting_locked(const std::string& block) const {
    auto it = turns.find(block);
    return it != turns.end() && it->second->serving.load(std::memory_order_acquire) != it->second->next;
  }
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
  // The zero-copy channels ("shm", "cuda"): our pools for requests, the worker's pools mapped here;
  // each worker's data link reads and sends through them (a result's tensors, dying here, give
  // their handles back on the link they came by).
  std::shared_ptr<detail::ZeroCopyEnds> ends;
  detail::ShmStager stager, stager_no_wait;
  detail::Doorbell doorbell;
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

  explicit Impl(WorkerOptions o);  // worker_site_process.cpp

  // Wakes whoever waits on `changed` (run(), start(), update()) and the sender thread.
  void wake() {
    changed.notify_all();
    doorbell.ring();
  }

  std::string prefix() const { return fmt::format("worker {}", options.name); }
  // "bf-w1:snd": the site's threads, as top -H and /proc/<pid>/task/*/comm show them.
  void name_thread(const char* role) const {
    const std::string name = fmt::format("bf-{}", options.name).substr(0, 10) + ":" + role;
    pthread_setname_np(pthread_self(), name.c_str());
  }
  bool joined() const { return !options.listen.empty(); }  // on another host, joins over TCP
  bool shm() const { return options.channel == "shm" || options.channel == "cuda"; }  // zero-copy

  absl::Status resolve_channel();

  // With mu held (update() replaces `blocks`).
  const detail::ShmStager* stager_for(const std::string& block) const;
  // With mu held: the blocks the worker hosts from now on (update()); the turns of a block no
  // longer hosted are forgotten once none of its requests is being sent.
  void set_blocks_locked(const std::vector<BlockDescription>& now);

  absl::Status spawn_locked();
  // Marks the site lost for good and takes the session's callback (to call outside mu; once).
  LostFn take_lost_locked();
  // The worker will not come back (its last restart used, or its last could not spawn): kFailed,
  // its queued requests taken out and counted (fail them outside mu with fail_queued()), and the
  // session's callback taken unless the site is stopping.
  std::deque<Outbound> give_up_locked(LostFn& lost_now);
  void fail_queued(std::deque<Outbound> queued, const absl::Status& why);

  // Fails the given requests outside the lock.
  // Any thread: run() may fail a request while stop() drops `done` (then nobody is told).
  void fail_all(std::vector<std::pair<std::uint64_t, std::uint32_t>> lost, const absl::Status& why);
  // fail_all()'s reports of this site that the calling thread is inside (a report may stop the site).
  int reports_on_this_thread() const;

  // Direct edges: the requests whose input our worker held, now lost with it (or with our stop).
  void fail_forwarded(const std::vector<std::pair<Key, std::weak_ptr<Impl>>>& forwarded, const absl::Status& why);
  // Tells the sites that held our requests' inputs that those requests are answered.
  static void forget_vias(const std::vector<std::pair<Key, std::weak_ptr<Impl>>>& vias);
  // From a placeholder's deleter, on any thread.
  void queue_drop(std::uint64_t id, pid_t holder);
  // Consumer side: asks the site whose worker holds `f`'s tensors to send them to our worker.
  absl::Status enqueue_forward(Forward&& f, pid_t holder, std::weak_ptr<Impl> consumer);
  // With push_mu held: sends one kForward for the live worker `live` (status: why it failed).
  // false: the socket takes nothing now (the caller keeps it, first in line).
  bool send_forward(Forward& f, pid_t live, absl::Status& status);
  // A kForward not sent: its outputs are still the worker's to drop.
  static void unconsume(const Forward& f);
  // What a request whose parked input could not be forwarded fails with: `why`, named.
  absl::Status forward_failed(const absl::Status& why) const {
    return absl::Status(why.code(), fmt::format("{}: cannot forward its parked output: {}", prefix(), std::string(why.message())));
  }
  // Sender thread: kForwards, then drops for the live worker (the others' outputs died with them).
  // Never blocks: a message the socket does not take now waits for the next round (1 ms later),
  // and a kForward for a worker process that is gone fails its request instead of reaching the
  // next one.
  void send_direct_edge_messages();
  // The placeholder for output `id` parked in our worker.
  absl::StatusOr<at::Tensor> make_placeholder(const wire::TensorDesc& desc, std::uint64_t id, at::ScalarType type);
  detail::ParkedResolver parked_resolver = [this](const wire::TensorDesc& desc, std::uint64_t id, at::ScalarType type) {
    return make_placeholder(desc, id, type);
  };

  void on_death(std::string what);

  void send_control(zmq::socket_t& router, const std::string& to, const nlohmann::json& message);

  void handle_control(zmq::socket_t& router, const std::string& from, const std::string& payload);

  // With mu held: a started worker that has loaded its blocks (and, on a zero-copy channel,
  // connected its data link) takes requests.
  void become_ready_locked();

  // Reaps the child, enforces heartbeats and start timeouts, restarts after backoff (for a joining
  // worker: declares it dead, then waits for it to join again).
  void supervise();

  void control_main();

  void shutdown_worker(zmq::socket_t& router);

  void sender_main();

  // With mu held: a request may skip the sender thread (zero-copy channels: the data link takes
  // packets from any thread) when nothing waits before it and a credit is free. (Not on "zmq":
  // a send there waits while the worker is not connected, which may be seconds for a joined one.)
  bool can_send_now_locked() const;

  // With mu held, for a ready worker with a credit: `next` counts as in flight from now on. Returns
  // its stager (zero-copy channels) and sets `to`, the data link to send it on.
  const detail::ShmStager* admit_locked(Outbound& next, std::shared_ptr<detail::ZeroCopyLink>& to);

  // Sends one admitted request, from any thread: on the data link for the zero-copy channels, else
  // on the PUSH socket (under push_mu) or as a kForward to the site holding its input. A request
  // that cannot be sent fails, named.
  void transmit(Outbound&& next, const detail::ShmStager* stager, const std::shared_ptr<detail::ZeroCopyLink>& to);

  // Direct edges: our request's input is parked in `owner`'s worker: that site tells its worker to
  // send it to ours (kForward). Any thread (the owner's sender thread does the sending).
  absl::Status forward_from(Impl& owner, pid_t holder, wire::Header header, Envelope&& envelope);

  // Reports an error for one in-flight request unless it was already reported; `site_failure`:
  // the site failed it (it could not send it), counted in failed_requests.
  void complete_error(std::uint64_t id, std::uint32_t node, absl::Status why, bool site_failure = false);

  void receiver_main();

  // Zero-copy channels: waits up to 100 ms for the worker's connection or a packet from it, and
  // delivers a result; a malformed packet is counted and dropped (on_malformed()).
  void receive_from_link();

  // The live worker's data link; a connection from any other process is refused (and counted).
  void accept_link();

  void handle_frames(std::vector<zmq::message_t>&& frames);

  void on_malformed(std::optional<std::uint64_t> id, const absl::Status& why);

  // Creates and binds the three sockets; the endpoints get their resolved ports.
  absl::Status bind_sockets();

  // Joined workers, on the socket's own thread: after a death (data_epoch moved), binds `socket` to
  // a fresh port in place of `endpoint` (unbinding the old one drops its connections).
  void move_data_socket(zmq::socket_t& socket, std::string& endpoint, std::uint64_t& epoch);
  // "tcp://ADDR:PORT" -> "tcp://ADDR:*": the data sockets of a joining worker take ephemeral ports.
  static std::string with_any_port(const std::string& endpoint) { return endpoint.substr(0, endpoint.rfind(':') + 1) + "*"; }

  void deliver(detail::DecodedMessage&& message);
};

}  // namespace blockflow
