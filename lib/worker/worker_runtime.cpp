// The worker runtime (libblockflow_worker_runtime.so): what blockflow-worker loads once its
// configuration has arrived. It builds and warms the blocks up in a local Session, then serves data
// messages until told to stop or until the host goes away (see worker_launcher.cpp).

#include <blockflow/blockflow.hpp>
#include <blockflow/core/detail/build_scope.hpp>
#include <blockflow/core/detail/session_core.hpp>
#include <blockflow/core/detail/clock.hpp>
#include <blockflow/channel/detail/curve_keys.hpp>
#include <blockflow/channel/detail/slot_allocator.hpp>
#include <blockflow/channel/detail/zmq_calls.hpp>
#include <blockflow/worker/worker_site.hpp>
#include <blockflow/channel/detail/zero_copy_ends.hpp>
#include <blockflow/channel/detail/zero_copy_link.hpp>
#include <blockflow/channel/detail/tensor_codec.hpp>
#include <blockflow/deploy/detail/deployment_json.hpp>
#include <blockflow/core/detail/log.hpp>
#include <blockflow/core/detail/malloc_settings.hpp>
#include <blockflow/observe/detail/metrics_json.hpp>
#include <blockflow/worker/detail/worker_launch.hpp>
#include <blockflow/worker/detail/worker_protocol.hpp>
#include <blockflow/core/kpi.hpp>

#include "worker_allowlist.hpp"
#include "worker_replies.hpp"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <dlfcn.h>
#include <pthread.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <csignal>
#include <map>
#include <optional>
#include <mutex>
#include <set>
#include <thread>

namespace bf = blockflow;
using bf::detail::now_ns;
using bf::detail::ParkedOutputs;
using bf::detail::error_header;
using bf::detail::Reply;
using bf::detail::ReplyQueue;

namespace {

struct Args {
  std::string name, control, requests, results;
  pid_t parent = 0;
  bool join = false;  // on another host: joined over TCP; no parent
  std::optional<bf::detail::CurveClientKeys> curve;  // joined with --key/--session-key: the data sockets too
};

std::int64_t rss_bytes() { return bf::sample_process().rss_bytes; }

// "tcp://HOST:PORT" with another port.
std::string with_port(const std::string& endpoint, int port) {
  return fmt::format("{}{}", endpoint.substr(0, endpoint.rfind(':') + 1), port);
}

class Worker {
 public:
  explicit Worker(const BlockflowWorkerLaunch& launch)
      : allowed_(bf::detail::WorkerAllowList::of(launch)), control_(zmq::from_handle, launch.control_socket), config_text_(launch.config_json) {
    args_.name = launch.name;
    args_.control = launch.control;
    args_.requests = launch.requests != nullptr ? launch.requests : "";
    args_.results = launch.results != nullptr ? launch.results : "";
    args_.parent = static_cast<pid_t>(launch.parent);
    args_.join = launch.join != 0;
    if (launch.curve_secret_key_file != nullptr) {
      // The launcher read these files a moment ago; a failure here is a file changed since.
      bf::detail::CurveClientKeys keys;
      std::string error;
      if (!bf::detail::read_curve_client_keys(launch.curve_secret_key_file,
                                              launch.curve_server_key_file != nullptr ? launch.curve_server_key_file : "",
                                              keys, error)) {
        throw std::runtime_error(error);
      }
      args_.curve = std::move(keys);
    }
    last_host_ns_ = now_ns();
  }

  // Tells the host why this worker cannot serve (its start() fails, naming it), then ends.
  int fail_to_load(absl::string_view why) {
    send_control({{"type", bf::detail::kLoadError}, {"message", std::string(why)}});
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // let the message leave
    return 1;
  }

  int run() {
    auto config = std::optional<nlohmann::json>(nlohmann::json::parse(config_text_, nullptr, false));
    if (config->is_discarded()) return 1;
    if (auto allowed = allowed_.config(*config); !allowed.ok()) return fail_to_load(allowed.message());
    if (args_.join) {
      try {
        args_.requests = with_port(args_.control, config->at("requests_port").get<int>());
        args_.results = with_port(args_.control, config->at("results_port").get<int>());
      } catch (const nlohmann::json::exception& e) {
        bf::detail::log(bf::LogLevel::kError, fmt::format("worker {}: configuration without data ports: {}", args_.name, e.what()));
        return 1;
      }
      bf::detail::log(bf::LogLevel::kInfo, fmt::format("worker {}: joined {}; loading {} block(s)", args_.name, args_.control,
                                                      config->value("blocks", nlohmann::json::array()).size()));
    }
    const std::string channel = config->value("channel", "zmq");
    if (channel == "cuda") {
      // The connect-time check: this process must open the host's CUDA memory and events.
      auto status = bf::detail::cuda_ipc_usable();
      if (status.ok()) status = bf::detail::open_cuda_probe(config->value("cuda_probe", ""));
      if (!status.ok()) return fail_to_load(fmt::format("channel 'cuda': {}", std::string(status.message())));
    }
    if (channel == "shm" || channel == "cuda") {
      bf::detail::ShmPoolOptions pool;
      pool.slots_per_pool = config->value("shm_slots_per_pool", pool.slots_per_pool);
      pool.max_total_bytes = config->value("shm_max_bytes", pool.max_total_bytes);
      ends_ = std::make_shared<bf::detail::ZeroCopyEnds>(pool, channel == "cuda");
      if (config->value("shm_outputs_in_slots", bf::WorkerOptions{}.shm_outputs_in_slots)) {
        bf::detail::install_slot_allocator(ends_->shared_host_pool(), pool.min_slot_bytes / 2);
        outputs_in_slots_ = true;
      }
      stager_ = ends_->stager(absl::Seconds(10));
      // Handles and releases travel on the data link, not on the ZeroMQ data sockets.
      auto link = bf::detail::PacketLink::connect(config->value("data_link", ""));
      if (!link.ok()) return fail_to_load(link.status().message());
      // A request's input that dies here gives its slot back to the host on this link (any thread).
      link_ = std::make_shared<bf::detail::ZeroCopyLink>(*std::move(link), ends_);
      receive_spin_ = config->value("busy_poll", false)  // WorkerOptions::busy_poll: poll, never sleep
                          ? absl::InfiniteDuration()
                          : absl::Microseconds(config->value(
                                "receive_spin_us", absl::ToInt64Microseconds(bf::WorkerOptions{}.receive_spin)));
    }
    peer_endpoint_ = config->value("peer_endpoint", "");
    if (!peer_endpoint_.empty()) {
      parked_.set_limits(config->value("max_parked", std::size_t{128}),
                         config->value("max_parked_bytes", bf::WorkerOptions{}.max_parked_bytes));
    }
    heartbeat_ = bf::detail::heartbeat_settings(*config);
    sampler_.set(config->value("sampling", false), absl::Milliseconds(config->value("sampling_period_ms", 100)));
    absl::Status status = link_ ? absl::OkStatus() : open_requests();
    if (status.ok()) status = load(*config);
    if (!status.ok()) return fail_to_load(status.message());
    std::thread sender;  // channel "zmq": the one thread owning the PUSH socket
    if (!link_) sender = std::thread([this] { sender_main(); });
    std::thread receiver([this] { receiver_main(); });
    send_control({{"type", bf::detail::kLoaded},
                  {"rss_bytes", bf::detail::settled_rss_bytes()},  // as the host's profiles measure
                  {"heartbeat_ms", absl::ToInt64Milliseconds(heartbeat_.interval)},
                  {"host_silence_ms", absl::ToInt64Milliseconds(heartbeat_.host_silence)}});
    last_host_ns_ = now_ns();  // the host pings a worker only once it is ready: the silence starts now
    control_loop();
    if (updater_.joinable()) updater_.join();
    stopping_ = true;
    receiver.join();
    if (session_) session_->shutdown(absl::Seconds(1));
    replies_.close();
    if (sender.joinable()) sender.join();
    bf::detail::uninstall_slot_allocator();
    return 0;
  }

 private:
  void send_control(const nlohmann::json& message) { (void)control_.send(zmq::buffer(bf::detail::dump_json(message)), zmq::send_flags::none); }

  // A child lives while its parent does; a joined worker while the session keeps pinging (it pings
  // every heartbeat interval, WorkerOptions::heartbeat_interval, sent in the config).
  bool host_alive() const {
    if (!args_.join) return ::getppid() == args_.parent;
    return now_ns() - last_host_ns_ < absl::ToInt64Nanoseconds(heartbeat_.host_silence);
  }

  absl::Status load(const nlohmann::json& config) {
    auto wanted = blocks_of(config);
    if (!wanted.ok()) return wanted.status();
    bf::SessionOptions options;
    options.lanes = config.value("lanes", 0);
    options.warm_up_threads = config.value("warm_up_threads", 0);
    // Starting beside other workers: the last warm-up run too with those threads; prime_slots()
    // below then runs each block with the team's, as its requests will.
    options.warm_up_last_narrow = outputs_in_slots_;
    // WorkerOptions::busy_poll: a lane polls for the requests its receiver polls for, so that neither
    // hand-off waits for a wake-up.
    options.poll_lane = config.value("busy_poll", false);
    if (const std::int64_t budget = config.value("on_demand_budget", std::int64_t{0}); budget > 0) {
      options.memory_budget = budget;
      options.memory_policy = bf::SessionOptions::MemoryPolicy::kOnDemand;
      if (config.value("on_demand_measure", std::string("blocks")) == "process") {
        options.memory_measure = bf::SessionOptions::MemoryMeasure::kProcess;
      }
      on_demand_ = true;
    }
    session_ = std::make_unique<bf::Session>(options);
    for (const auto& description : wanted->blocks) session_->add_block(description);
    for (auto& path : wanted->paths()) session_->add_path(std::move(path));
    set_hosted(*wanted);
    // Blocks are built and warmed up on the session's lanes: the slot allocator stays off there.
    bf::detail::set_build_scope([] { return std::make_shared<bf::detail::SlotAllocatorPause>(); });
    if (auto status = session_->start(); !status.ok()) return status;
    if (outputs_in_slots_ && !on_demand_) prime_slots(wanted->blocks);  // on demand: each would load in turn
    return absl::OkStatus();
  }

  // The warm-up ran with the slot allocator paused (a block's weights must not hold result slots),
  // so the first request would make the result pools of its activations' sizes and fault their
  // pages in (measured: the ResNet50 split's first request 130 ms against 30 ms after). One run of
  // each block with zeros, as requests run, makes them now; its slots are free again after it.
  void prime_slots(const std::vector<bf::BlockDescription>& blocks) {
    for (const auto& b : blocks) {
      // warmup_runs 1: TorchScript's optimising run would be this one, and what it keeps would hold slots.
      if (b.options.input_shapes.empty() || b.options.warmup_runs < 2 || b.options.device.rfind("cuda", 0) == 0) continue;
      const bf::Result r = session_->submit(b.name, bf::detail::warm_up_inputs(b.options, c10::kCPU)).get();
      if (!r.ok()) bf::detail::log(bf::LogLevel::kWarning, fmt::format("worker {}: priming '{}': {}", args_.name, b.name, r.status.ToString()));
    }
  }

  // The blocks of a config or update message, each with a task of its own name (how the host
  // addresses it), after loading the plugins they need.
  absl::StatusOr<bf::Deployment> blocks_of(const nlohmann::json& message) {
    if (auto status = bf::detail::load_plugins(message.value("plugins", nlohmann::json::array()), allowed_, plugins_); !status.ok()) {
      return status;
    }
    bf::Deployment d;
    for (const auto& b : message.at("blocks")) {
      auto description = allowed_.block(b);
      if (!description.ok()) return description.status();
      description->placement.clear();  // here, it runs in this process's threads
      d.tasks.push_back({description->name, {description->name}});
      d.blocks.push_back(*std::move(description));
    }
    return d;
  }

  void set_hosted(const bf::Deployment& d) {
    std::lock_guard lock(hosted_mu_);
    hosted_.clear();
    for (const auto& b : d.blocks) hosted_.insert(b.name);
  }

  // An update runs on a thread of its own (loading takes a while) while this thread goes on
  // answering pings; finish_update() sends the answer.
  void start_update(const nlohmann::json& message) {
    const auto seq = message.value("seq", std::uint64_t{0});
    if (update_running_) {
      send_control({{"type", bf::detail::kUpdateError}, {"seq", seq}, {"message", "an earlier update is still loading"}});
      return;
    }
    if (updater_.joinable()) updater_.join();
    update_running_ = true;
    update_seq_ = seq;
    updater_ = std::thread([this, message] {
      absl::Status status;
      try {
        const bf::detail::SlotAllocatorPause weights_off_slots;  // in case a block is built on this thread
        auto wanted = blocks_of(message);
        if (!wanted.ok()) {
          status = wanted.status();
        } else if (auto version = session_->apply(*wanted, absl::Seconds(5)); !version.ok()) {
          status = version.status();
        } else {
          set_hosted(*wanted);
        }
      } catch (const std::exception& e) {  // a malformed message: answer, do not die
        status = absl::InvalidArgumentError(std::string("malformed update: ") + e.what());
      }
      std::lock_guard lock(update_mu_);
      update_status_ = status;
    });
  }

  void finish_update() {
    std::optional<absl::Status> status;
    {
      std::lock_guard lock(update_mu_);
      status = std::exchange(update_status_, std::nullopt);
    }
    if (!status) return;
    update_running_ = false;
    if (status->ok()) {
      send_control({{"type", bf::detail::kUpdated}, {"seq", update_seq_}, {"rss_bytes", bf::detail::settled_rss_bytes()}});
      return;
    }
    // The local session says "update N rejected, nothing changed: <cause>": the host has its own
    // numbering, so only the cause travels.
    std::string why(status->message());
    if (const auto at = why.find("nothing changed: "); at != std::string::npos) why = why.substr(at + 17);
    send_control({{"type", bf::detail::kUpdateError}, {"seq", update_seq_}, {"message", why}});
  }

  void control_loop() {
    while (host_alive()) {
      zmq::pollitem_t item{control_.handle(), 0, ZMQ_POLLIN, 0};
      bf::detail::poll_items(&item, 1, std::chrono::milliseconds(update_running_ ? 10 : 100));
      finish_update();
      if ((item.revents & ZMQ_POLLIN) == 0) continue;
      zmq::message_t msg;
      if (!control_.recv(msg, zmq::recv_flags::dontwait)) continue;
      last_host_ns_ = now_ns();
      auto json = nlohmann::json::parse(msg.to_string(), nullptr, false);
      if (json.is_discarded()) continue;
      const std::string type = json.value("type", "");
      if (type == bf::detail::kStop) {
        stopped_by_host_ = true;
        return;
      }
      if (type == bf::detail::kPing) {
        nlohmann::json beat = {{"type", bf::detail::kHeartbeat}, {"rss_bytes", rss_bytes()}};
        if (ends_) beat["shm"] = ends_->host_stats();
        if (ends_ && ends_->cuda()) beat["cuda"] = ends_->cuda_stats();
        if (sampler_.enabled()) beat["kpi"] = sampler_.latest();
        if (session_) bf::detail::add_session_figures(beat, session_->metrics(), on_demand_);
        send_control(beat);
      }
      if (type == bf::detail::kUpdate) start_update(json);
      if (type == bf::detail::kSampler) {
        sampler_.set(json.value("enabled", false), absl::Milliseconds(json.value("period_ms", 100)));
      }
    }
  }

  // The next message: from the data link (zero-copy channels; the host's releases are taken there)
  // or the PULL socket (zmq). `id`: the request a malformed one names, when readable; `arrived`:
  // when it was received, before decoding (mapping the host's pools counts as the request's wait).
  struct Incoming {
    std::optional<std::uint64_t> id;
    std::optional<std::uint32_t> node;  // with `id`: the node a malformed one names, when readable
    absl::StatusOr<bf::detail::DecodedMessage> message;
    std::int64_t arrived = 0;
  };
  std::optional<Incoming> next_request() {
    if (link_) {
      auto packet = link_->read(100, receive_spin_, &parked_resolver_);
      switch (packet.kind) {
        case bf::detail::ZeroCopyLink::Packet::Kind::kNothing:
          return std::nullopt;
        case bf::detail::ZeroCopyLink::Packet::Kind::kClosed:  // the host is gone: the control loop notices and stops us
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
          return std::nullopt;
        case bf::detail::ZeroCopyLink::Packet::Kind::kMalformed:
          return Incoming{packet.request_id, packet.node, std::move(packet.malformed), packet.received_ns};
        case bf::detail::ZeroCopyLink::Packet::Kind::kMessage:
          return Incoming{std::nullopt, std::nullopt, std::move(packet.message), packet.received_ns};
      }
    }
    std::vector<zmq::message_t> frames;
    if (!bf::detail::receive_frames(pull_, frames)) return std::nullopt;
    Incoming in;
    in.arrived = now_ns();
    if (!frames.empty()) {
      in.id = bf::wire::peek_request_id(frames[0].data(), frames[0].size());
      in.node = bf::wire::peek_node(frames[0].data(), frames[0].size());
    }
    in.message = bf::detail::decode_message(std::move(frames), nullptr, &parked_resolver_);
    if (in.message.ok() && in.message->header.kind == bf::wire::MessageKind::kRelease) {
      in.id.reset();  // a stray release names no request
      in.message = absl::InvalidArgumentError("a release on channel 'zmq', which has no shared memory");
    }
    return in;
  }

  // Channel "zmq": the PULL socket for requests, from the host and (direct edges) from the other
  // workers at our peer endpoint. Made here, used by the receiver thread only.
  absl::Status open_requests() {
    pull_ = zmq::socket_t(context_, zmq::socket_type::pull);
    pull_.set(zmq::sockopt::linger, 0);
    pull_.set(zmq::sockopt::rcvtimeo, 100);
    pull_.set(zmq::sockopt::maxmsgsize, static_cast<std::int64_t>(bf::wire::kMaxTensorBytes));
    try {
      secure(pull_);
      pull_.connect(args_.requests);
      if (!peer_endpoint_.empty()) pull_.bind(peer_endpoint_);
    } catch (const zmq::error_t& e) {
      return absl::UnavailableError(fmt::format("cannot open the request endpoints ({}, {}): {}", args_.requests,
                                                peer_endpoint_, e.what()));
    }
    return absl::OkStatus();
  }

  void receiver_main() {
    pthread_setname_np(pthread_self(), "bf-worker:rcv");  // as top -H shows it
    while (!stopping_) {
      forwarded_ids_.clear();  // filled by parked_resolver_ while a kForward is decoded
      forward_problem_.clear();
      auto next = next_request();
      if (!next) continue;
      const std::int64_t arrived = next->arrived;
      auto& message = next->message;
      if (!message.ok()) {
        noisy_.log(bf::LogLevel::kWarning, fmt::format("worker {}: malformed request frame dropped: {}", args_.name,
                                                       std::string(message.status().message())));
        if (next->id && next->node) {  // both read: the reply fails that request's node, no other
          reply({error_header(*next->id, *next->node, absl::InvalidArgumentError(fmt::format(
                                                  "malformed request frame: {}", std::string(message.status().message())))),
                 {}});
        }
        continue;
      }
      if (message->header.kind == bf::wire::MessageKind::kDrop) {
        auto ids = bf::wire::decode_parked_ids(message->header.message.data(), message->header.message.size());
        if (ids.ok()) parked_.drop(*ids);
        continue;
      }
      if (message->header.kind == bf::wire::MessageKind::kForward) {
        forward(std::move(*message), arrived);
        continue;
      }
      dispatch(std::move(*message), arrived);
    }
  }

  // Direct edges: sends parked outputs (the tensors of the kForward, resolved by id) to the worker
  // at the endpoint it names, as that worker's request; to ourselves without a socket. A failure is
  // reported to the host as the error of the request it was for.
  void forward(bf::detail::DecodedMessage&& message, std::int64_t arrived) {
    const auto& f = message.header;
    bf::wire::Header h;
    h.kind = bf::wire::MessageKind::kData;
    h.flags = f.flags & bf::wire::kFlagParkOutputs;
    h.request_id = f.request_id;
    h.node = f.node;
    h.target = f.target;
    if ((f.flags & bf::wire::kFlagReleaseAfter) != 0) parked_.drop(forwarded_ids_);
    if (f.message == peer_endpoint_ && forward_problem_.empty()) {
      message.header = std::move(h);
      return dispatch(std::move(message), arrived);
    }
    absl::Status status;
    if (!forward_problem_.empty()) {
      status = absl::DataLossError(forward_problem_);
    } else if (f.kind != bf::wire::MessageKind::kForward || message.tensors.empty()) {
      status = absl::InvalidArgumentError("a forward without parked outputs");
    } else if (allowed_.enforced) {  // a joined worker connects to no endpoint its session names
      status = absl::PermissionDeniedError(fmt::format("forward to '{}': refused by a joined worker", f.message));
    } else if (f.message.rfind("ipc://", 0) != 0) {
      status = absl::InvalidArgumentError(fmt::format("forward to '{}': not an ipc:// endpoint", f.message));
    } else {
      try {
        zmq::socket_t& to = peer_socket(f.message);
        h.times.sent_ns = now_ns();
        auto sent = bf::detail::send_message(to, h, message.tensors, zmq::send_flags::dontwait);
        if (!sent.ok()) status = sent.status();
        else if (!*sent) status = absl::UnavailableError(fmt::format("worker at {} is not taking requests", f.message));
      } catch (const zmq::error_t& e) {
        status = absl::UnavailableError(e.what());
      }
    }
    if (!status.ok()) {
      reply({error_header(f.request_id, f.node,
                          absl::Status(status.code(), fmt::format("block '{}': input from worker {} not delivered: {}",
                                                                  f.target, args_.name, std::string(status.message())))),
             {}});
    }
  }

  // A joined worker's data socket talks CURVE when its control socket does (before connect()).
  void secure(zmq::socket_t& socket) const {
    if (args_.curve) bf::detail::apply_curve_client(socket, *args_.curve);
  }

  // The receiver thread's PUSH socket to another worker's peer endpoint (one per other worker of
  // the session it forwards to).
  zmq::socket_t& peer_socket(const std::string& endpoint) {
    auto it = peers_.find(endpoint);
    if (it != peers_.end()) return it->second;
    zmq::socket_t socket(context_, zmq::socket_type::push);
    socket.set(zmq::sockopt::linger, 0);
    socket.set(zmq::sockopt::sndhwm, 256);
    socket.connect(endpoint);
    return peers_.emplace(endpoint, std::move(socket)).first->second;
  }

  void dispatch(bf::detail::DecodedMessage&& message, std::int64_t arrived) {
    const std::uint64_t id = message.header.request_id;
    const std::uint32_t node = message.header.node;
    const std::string& block = message.header.target;
    bool hosted = false;
    {
      std::lock_guard lock(hosted_mu_);
      hosted = hosted_.count(block) != 0;
    }
    if (!hosted) {
      reply({error_header(id, node, absl::NotFoundError(fmt::format("does not host block '{}'", block))), {}});
      return;
    }
    const bool park = (message.header.flags & bf::wire::kFlagParkOutputs) != 0 && !peer_endpoint_.empty();
    // This thread also takes the host's slot releases: it never waits for room (a lane queues it).
    const bf::detail::NeverWaitHere never_wait;
    session_->submit(block, std::move(message.tensors), [this, id, node, arrived, park](bf::Result&& r) {
      if (!r.ok()) return reply({error_header(id, node, r.status), {}});
      bf::wire::Header h;
      h.kind = bf::wire::MessageKind::kResult;
      h.request_id = id;
      h.node = node;
      h.times.arrived_ns = arrived;
      if (!r.trace.hops.empty()) {
        const auto& hop = r.trace.hops.front();
        h.times.dequeued_ns = hop.dequeued_ns;
        h.times.compute_start_ns = hop.compute_start_ns;
        h.times.compute_end_ns = hop.compute_end_ns;
      }
      if (park) {
        // Kept here for the next worker on the path; the host gets their descriptions and ids.
        bf::Tensors kept;
        for (const auto& t : r.outputs) {
          // A view keeps its whole storage alive: keep a copy of what it shows instead.
          at::Tensor c = t.defined() ? t.contiguous() : t;
          if (c.defined() && c.storage().nbytes() > c.nbytes()) c = c.clone();
          kept.push_back(std::move(c));
        }
        if (auto ids = parked_.park(kept)) {
          std::vector<std::string> references;
          for (const auto parked_id : *ids) references.push_back(bf::wire::encode_parked_ids({parked_id}));
          return reply({std::move(h), std::move(kept), std::move(references)});
        }
      }
      reply({std::move(h), std::move(r.outputs)});
    });
  }

  // On the data link, from the calling thread (a block's, for results): one wake-up, the host's
  // receiver. Otherwise on the PUSH socket: from the calling thread too while no other reply waits
  // (ReplyQueue), else through the thread owning the socket.
  void reply(Reply&& r) {
    if (!link_) return replies_.push(std::move(r));
    transmit(r, [&](const bf::wire::Header& h, const bf::Tensors& t, const bf::detail::ShmStager* stager) {
      return link_->send(h, t, stager);
    });
  }

  // Sends a reply; an output the channel cannot carry (an unknown dtype, no slot) is reported instead.
  template <typename Send>
  void transmit(Reply& r, Send&& send) {
    r.header.times.sent_ns = now_ns();
    const bool data = r.header.kind == bf::wire::MessageKind::kResult;
    absl::Status sent = send(r.header, r.tensors, data && ends_ ? &stager_ : nullptr);
    if (!sent.ok() && data) {
      (void)send(error_header(r.header.request_id, r.header.node, sent), {}, nullptr);
    }
  }

  // Channel "zmq": the replies, on the PUSH socket.
  void sender_main() {
    zmq::socket_t push(context_, zmq::socket_type::push);
    push.set(zmq::sockopt::linger, 1000);
    secure(push);
    push.connect(args_.results);
    replies_.attach([&](Reply& r, bool wait) {
      bool taken = true;
      transmit(r, [&](const bf::wire::Header& h, const bf::Tensors& t, const bf::detail::ShmStager* stager) {
        const auto flags = wait ? zmq::send_flags::none : zmq::send_flags::dontwait;
        // An error reply in place of a parked result (t empty) carries no references.
        auto sent = r.references.empty() || t.empty() ? bf::detail::send_message(push, h, t, flags, nullptr, stager)
                                                      : bf::detail::send_references(push, h, t, r.references, flags);
        if (!sent.ok() && !t.empty()) parked_.drop_referenced(r.references);  // the host never learns them
        if (!sent.ok()) return sent.status();
        taken = taken && *sent;  // not taken: sent later by the sending thread, which waits
        return absl::OkStatus();
      });
      return taken;
    }, [&](Reply& r) { parked_.drop_referenced(r.references); });  // dropped: the host never learns them
    while (replies_.send_next()) {
    }
    replies_.detach();
  }

 public:
  bool stopped_by_host() const { return stopped_by_host_; }

 private:
  Args args_;
  const bf::detail::WorkerAllowList allowed_;  // what this worker's command line lets it load
  bf::detail::RateLimitedLog noisy_;  // per-frame messages a peer can trigger
  std::int64_t last_host_ns_ = 0;
  bf::detail::HeartbeatSettings heartbeat_ = bf::detail::heartbeat_settings(nlohmann::json::object());  // from the config
  bool stopped_by_host_ = false;
  zmq::context_t context_{1};  // for the data sockets; the control socket is the launcher's
  zmq::socket_ref control_;
  zmq::socket_t pull_;  // channel "zmq": requests (receiver thread)
  std::string config_text_;
  std::unique_ptr<bf::Session> session_;  // made once the configuration has arrived
  bool on_demand_ = false;                 // its blocks load on demand (heartbeats say what is loaded)
  std::mutex hosted_mu_;
  std::set<std::string> hosted_;   // read by the receiver thread, changed by updates
  std::set<std::string> plugins_;  // loaded already
  // Updates (control thread and the updater thread).
  std::thread updater_;
  bool update_running_ = false;  // control thread only
  std::uint64_t update_seq_ = 0;
  std::mutex update_mu_;
  std::optional<absl::Status> update_status_;
  ReplyQueue replies_;  // channel "zmq": for the sender thread
  // The zero-copy channel: results go into our pools, requests are views of the host's.
  std::shared_ptr<bf::detail::ZeroCopyEnds> ends_;  // channels "shm" and "cuda"
  bool outputs_in_slots_ = false;                    // the slot allocator is installed
  std::shared_ptr<bf::detail::ZeroCopyLink> link_;   // their data link (set before the threads start)
  absl::Duration receive_spin_;
  bf::detail::ShmStager stager_;
  bf::KpiSampler sampler_;  // off unless the session switches sampling on
  // Direct edges (channel "zmq", a child worker): our endpoint for other workers' requests, the
  // outputs kept for them, and the sockets to them (receiver thread only).
  std::string peer_endpoint_;
  ParkedOutputs parked_;
  std::vector<std::uint64_t> forwarded_ids_;  // receiver thread: the ids of the kForward being decoded
  std::string forward_problem_;               // and what was wrong with them
  bf::detail::ParkedResolver parked_resolver_ = [this](const bf::wire::TensorDesc& desc, std::uint64_t parked_id,
                                                       at::ScalarType type) -> absl::StatusOr<at::Tensor> {
    // A problem is reported by forward() as the error of the request (undefined tensor here).
    forwarded_ids_.push_back(parked_id);
    auto found = parked_.get({parked_id}, false);
    if (!found) {
      forward_problem_ = fmt::format("its output {} is no longer there", parked_id);
      return at::Tensor();
    }
    const at::Tensor& t = found->front();
    if (t.scalar_type() != type || std::vector<std::int64_t>(t.sizes().begin(), t.sizes().end()) != desc.shape) {
      forward_problem_ = fmt::format("its output {} does not match the description the host sent", parked_id);
      return at::Tensor();
    }
    return t;
  };
  std::map<std::string, zmq::socket_t> peers_;
  std::atomic<bool> stopping_{false};
};

}  // namespace

extern "C" __attribute__((visibility("default"))) int blockflow_worker_serve(BlockflowWorkerLaunch* launch) try {
  Worker worker(*launch);
  const int rc = worker.run();
  launch->stopped_by_host = worker.stopped_by_host() ? 1 : 0;
  return rc;
} catch (const std::exception& e) {
  bf::detail::log(bf::LogLevel::kError, fmt::format("worker runtime: {}", e.what()));
  return 2;
}
