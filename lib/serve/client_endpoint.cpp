#include <blockflow/serve/client_endpoint.hpp>
#include <blockflow/channel/detail/ipc_socket_file.hpp>
#include <blockflow/core/detail/log.hpp>
#include <blockflow/core/detail/clock.hpp>
#include <blockflow/core/detail/never_wait.hpp>
#include <blockflow/channel/detail/curve_auth.hpp>
#include <blockflow/channel/detail/curve_keys.hpp>
#include <blockflow/channel/detail/tensor_codec.hpp>
#include <blockflow/channel/detail/zmq_calls.hpp>

#include <fmt/format.h>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <algorithm>
#include <cerrno>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>

namespace blockflow {
namespace {

wire::Header reply_header(std::uint64_t id, const absl::Status& status) {
  wire::Header h;
  h.kind = wire::MessageKind::kReply;
  h.request_id = id;
  h.status_code = static_cast<std::int32_t>(status.code());
  h.message = std::string(status.message()).substr(0, wire::kMaxMessageBytes);
  return h;
}

// One reply on its way to a client.
struct Reply {
  std::string peer;  // ROUTER routing id of the client
  wire::Header header;
  Tensors tensors;
  bool from_session = false;  // the reply of a request the session ran (counted in flight)
  std::size_t request_bytes = 0;  // from_session: the request's bytes, counted in flight
  // Encoded at its first try, kept for the next ones while it waits in its client's backlog (a
  // non-contiguous output is copied once, not once per try).
  std::optional<detail::EncodedMessage> encoded;
  // What it counts for in its client's backlog (size_of() when it was queued there): taken off as
  // counted, although encoding it may change its size (an error reply instead of its outputs).
  std::size_t backlogged_bytes = 0;
};

// What the completion callbacks given to Session::submit() reach: the replies waiting for the socket
// thread and the eventfd that wakes it. The endpoint and every callback still inside the session
// share it, so it outlives whichever goes last: a completion that comes after stop() (or after the
// endpoint is gone) finds it alive, sees `closed` and drops its reply instead of touching freed
// memory. The fd is closed only when the last owner lets go. Thread-safe.
struct Outbox {
  std::mutex mu;
  std::deque<Reply> replies;  // guarded by mu
  bool closed = false;        // guarded by mu: set by stop(); nobody sends replies any more
  int wake_fd = -1;           // the socket thread polls it; owned, closed by the destructor
  std::atomic<std::uint64_t> dropped{0};

  Outbox() : wake_fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
    if (wake_fd < 0) throw std::runtime_error("client endpoint: eventfd failed");
  }
  ~Outbox() { ::close(wake_fd); }
  Outbox(const Outbox&) = delete;
  Outbox& operator=(const Outbox&) = delete;

  // Queues a reply and wakes the socket thread; once closed, counts it as dropped instead.
  void post(Reply&& reply) {
    {
      std::lock_guard lock(mu);
      if (closed) {
        ++dropped;
        return;
      }
      replies.push_back(std::move(reply));
    }
    const std::uint64_t one = 1;
    (void)::write(wake_fd, &one, sizeof one);
  }

  // The replies queued so far (the socket thread sends them).
  std::deque<Reply> take() {
    std::uint64_t count = 0;
    (void)::read(wake_fd, &count, sizeof count);
    std::deque<Reply> batch;
    std::lock_guard lock(mu);
    batch.swap(replies);
    return batch;
  }

  // From now on every reply is dropped; those still queued are dropped now.
  void close() {
    std::lock_guard lock(mu);
    closed = true;
    dropped += replies.size();
    replies.clear();
  }
};

}  // namespace

struct ClientEndpoint::Impl {
  Session& session;
  const ClientEndpointOptions options;
  zmq::context_t context{1};
  std::unique_ptr<detail::CurveServer> curve;  // after the router's close, before the context's
  zmq::socket_t router{context, zmq::socket_type::router};
  std::string endpoint;
  const std::shared_ptr<Outbox> outbox = std::make_shared<Outbox>();  // shared with the callbacks
  std::atomic<bool> stopping{false};
  std::atomic<bool> draining{false};  // drain(): new requests are refused (Unavailable)
  std::optional<detail::IpcSocketFile> socket_file;  // an ipc:// endpoint's
  absl::Time drain_deadline = absl::InfinitePast();  // drain()'s: stop() lets ZeroMQ write until then
  std::atomic<std::uint64_t> malformed{0}, served{0};
  detail::RateLimitedLog noisy;  // per-frame messages a client can trigger

  // Socket thread only: per client, the replies ZeroMQ would not take yet, and requests in flight.
  struct Backlog {
    std::deque<Reply> replies;
    std::size_t bytes = 0;
  };
  std::map<std::string, Backlog> backlogs;
  std::deque<Reply> taken;  // replies taken from the outbox, not yet sent or backlogged
  std::atomic<std::size_t> backlog_bytes_total{0};  // drain() waits for it to reach 0
  // Requests inside the session, per client and in all: counted here, taken off in flush() as their
  // replies come back (socket thread only; drain() reads the atomic totals).
  struct Held {
    std::size_t requests = 0;
    std::size_t bytes = 0;
  };
  std::map<std::string, Held> in_flight;
  std::atomic<std::size_t> in_flight_total{0}, in_flight_bytes_total{0};

  std::mutex stop_mu;  // one stop() joins the thread
  std::thread thread;

  Impl(Session& s, ClientEndpointOptions o) : session(s), options(std::move(o)) {}

  void post(Reply&& reply) { outbox->post(std::move(reply)); }

  void refuse(std::string peer, std::uint64_t id, absl::Status status) {
    post({std::move(peer), reply_header(id, status), {}, false, 0, std::nullopt});
  }

  void on_request(std::string peer, std::vector<zmq::message_t>&& frames) {
    std::optional<std::uint64_t> id;
    if (!frames.empty()) id = wire::peek_request_id(frames[0].data(), frames[0].size());
    std::size_t bytes = 0;
    for (const auto& f : frames) bytes += f.size();
    absl::Status problem;
    std::optional<detail::DecodedMessage> message;
    if (bytes > options.max_request_bytes) {
      problem = absl::InvalidArgumentError(fmt::format("request of {} bytes is above the endpoint's max_request_bytes ({})",
                                                       bytes, options.max_request_bytes));
    } else if (auto decoded = detail::decode_message(std::move(frames)); !decoded.ok()) {
      problem = decoded.status();
    } else if (decoded->header.kind != wire::MessageKind::kSubmit) {
      problem = absl::InvalidArgumentError(
          fmt::format("expected a submit message, got {}", std::string(wire::to_string(decoded->header.kind))));
    } else {
      message = std::move(*decoded);
    }
    if (!problem.ok()) {
      ++malformed;
      noisy.log(LogLevel::kWarning, fmt::format("client endpoint {}: malformed frame dropped: {}", endpoint,
                                                 std::string(problem.message())));
      if (id) refuse(std::move(peer), *id, absl::InvalidArgumentError(fmt::format("malformed request: {}", std::string(problem.message()))));
      return;
    }
    const std::uint64_t request = message->header.request_id;
    if (draining) {
      return refuse(std::move(peer), request,
                    absl::UnavailableError(fmt::format("client endpoint '{}' is stopping: request refused", endpoint)));
    }
    if (auto full = over_limits(peer, bytes); !full.ok()) return refuse(std::move(peer), request, std::move(full));
    Held& held = in_flight[peer];
    held.requests += 1;
    held.bytes += bytes;
    in_flight_total += 1;
    in_flight_bytes_total += bytes;
    // This thread serves every client: it never waits for room in the task's first block (a lane
    // queues the request in order instead), or one busy task would stall every client.
    detail::NeverWaitHere never_wait;
    try {
      // The callback may run after stop() or after this object is gone: it holds the outbox, not `this`.
      session.submit(message->header.target, std::move(message->tensors),
                     [outbox = outbox, peer, request, bytes](Result&& r) mutable {
                       outbox->post({std::move(peer), reply_header(request, r.status), std::move(r.outputs), true,
                                     bytes, std::nullopt});
                     });
    } catch (const std::exception& e) {  // not registered (out of memory): its callback never runs
      release(peer, bytes);
      refuse(std::move(peer), request, absl::ResourceExhaustedError(fmt::format(
                                           "client endpoint '{}': the request could not be submitted: {}", endpoint, e.what())));
    }
  }

  // Why a request of `bytes` from `peer` may not enter the session now (the first bound it passes),
  // or OK.
  absl::Status over_limits(const std::string& peer, std::size_t bytes) const {
    const auto found = in_flight.find(peer);
    const Held held = found != in_flight.end() ? found->second : Held{};
    if (held.requests >= options.max_in_flight_per_client) {
      return absl::ResourceExhaustedError(fmt::format(
          "this client has {} requests in flight, the endpoint's max_in_flight_per_client", held.requests));
    }
    if (held.bytes + bytes > options.max_in_flight_bytes_per_client) {
      return absl::ResourceExhaustedError(
          fmt::format("this client has {} bytes of requests in flight, and this one's {} would pass the endpoint's "
                      "max_in_flight_bytes_per_client ({})",
                      held.bytes, bytes, options.max_in_flight_bytes_per_client));
    }
    if (in_flight_total >= options.max_in_flight) {
      return absl::ResourceExhaustedError(fmt::format(
          "the endpoint has {} requests of all its clients in flight, its max_in_flight", in_flight_total.load()));
    }
    if (in_flight_bytes_total + bytes > options.max_in_flight_bytes) {
      return absl::ResourceExhaustedError(
          fmt::format("the endpoint has {} bytes of all its clients' requests in flight, and this one's {} would pass "
                      "its max_in_flight_bytes ({})",
                      in_flight_bytes_total.load(), bytes, options.max_in_flight_bytes));
    }
    return absl::OkStatus();
  }

  // A request of `peer` is out of the session (answered, or never submitted).
  void release(const std::string& peer, std::size_t bytes) {
    in_flight_total -= 1;
    in_flight_bytes_total -= bytes;
    auto held = in_flight.find(peer);
    if (held == in_flight.end()) return;
    held->second.requests -= 1;
    held->second.bytes -= bytes;
    if (held->second.requests == 0) in_flight.erase(held);
  }

  void drop(const Reply& reply, std::string_view why) {
    ++outbox->dropped;
    noisy.log(LogLevel::kWarning, fmt::format("client endpoint {}: reply to request {} dropped: {}", endpoint,
                                              reply.header.request_id, why));
  }

  // Sends one reply without waiting: false when the client's pipe is full (try again later).
  bool try_send(Reply& reply) {
    // Encoded before anything is sent: outputs the wire cannot carry (a dtype without a code, more
    // than kMaxDims dimensions or kMaxTensors outputs) become an error reply telling the client why.
    if (!reply.encoded) {
      auto encoded = detail::encode_for_socket(reply.header, reply.tensors, nullptr, nullptr);
      if (!encoded.ok()) {
        encoded = detail::encode_for_socket(
            reply_header(reply.header.request_id,
                         absl::Status(encoded.status().code(), fmt::format("the outputs cannot be sent: {}",
                                                                           std::string(encoded.status().message())))),
            {}, nullptr, nullptr);
        if (!encoded.ok()) {
          drop(reply, std::string(encoded.status().message()));
          return true;
        }
      }
      reply.encoded = *std::move(encoded);
      reply.tensors.clear();  // the encoded message keeps what is sent (a contiguous copy of any other)
      std::string().swap(reply.header.message);  // and the message, in its header
    }
    try {
      if (!router.send(zmq::buffer(reply.peer), zmq::send_flags::sndmore | zmq::send_flags::dontwait)) return false;
      // Counted before the rest: the client may read the reply before this thread goes on.
      ++served;
      // The first frame passed the pipe's limit, so the rest of the message goes whole.
      (void)detail::send_encoded(router, *reply.encoded, zmq::send_flags::none);
    } catch (const zmq::error_t& e) {  // EHOSTUNREACH: the client went away (ROUTER_MANDATORY)
      drop(reply, fmt::format("client gone ({})", e.what()));
    }
    return true;
  }

  // A reply about to wait in a backlog holds its own bytes only: a row of a batch's output (a view
  // of a storage several times its size) is copied, so that it neither keeps the whole batch alive
  // nor is counted for it.
  static void compact(Reply& reply) {
    for (auto& t : reply.encoded ? reply.encoded->tensors : reply.tensors) {
      if (t.defined() && t.has_storage() && t.storage().nbytes() > 2 * t.nbytes()) t = t.clone();
    }
  }

  // What it holds: its message and header, and the whole storage of each tensor (a batch's output
  // row, a slice, keeps all of its storage alive), each storage once.
  static std::size_t size_of(const Reply& reply) {
    std::size_t bytes = sizeof(Reply) + reply.peer.size() + reply.header.message.size();
    if (reply.encoded) bytes += reply.encoded->header.size();
    std::vector<const void*> storages;
    for (const auto& t : reply.encoded ? reply.encoded->tensors : reply.tensors) {
      if (!t.defined() || !t.has_storage()) continue;
      const void* key = t.storage().unsafeGetStorageImpl();
      if (std::find(storages.begin(), storages.end(), key) != storages.end()) continue;
      storages.push_back(key);
      bytes += std::max<std::size_t>(t.storage().nbytes(), t.nbytes());
    }
    return bytes;
  }

  // Sends the backlogs first (in order, per client), then the new replies; what a full pipe refuses
  // waits in its client's backlog, within the client's byte bound.
  void flush() {
    for (auto it = backlogs.begin(); it != backlogs.end();) {
      Backlog& b = it->second;
      while (!b.replies.empty() && try_send(b.replies.front())) {
        b.bytes -= b.replies.front().backlogged_bytes;
        backlog_bytes_total -= b.replies.front().backlogged_bytes;
        b.replies.pop_front();
      }
      it = b.replies.empty() ? backlogs.erase(it) : std::next(it);
    }
    // One at a time off a member list: an exception (out of memory) loses the reply in hand only;
    // the next turn goes on with the others.
    for (auto& reply : outbox->take()) taken.push_back(std::move(reply));
    while (!taken.empty()) {
      Reply reply = std::move(taken.front());
      taken.pop_front();
      // Out of flight once sent, backlogged or dropped, not before: drain() must never see a reply
      // neither in flight nor in a backlog while this thread still holds it.
      struct Release {
        Impl& s;
        std::string peer;
        std::size_t bytes;
        bool counted;
        ~Release() {
          if (counted) s.release(peer, bytes);
        }
      } released{*this, reply.from_session ? reply.peer : std::string(), reply.request_bytes, reply.from_session};
      auto queued = backlogs.find(reply.peer);
      if (queued == backlogs.end() && try_send(reply)) continue;
      Backlog& b = backlogs[reply.peer];
      compact(reply);
      const std::size_t bytes = size_of(reply);
      if (!b.replies.empty() && b.bytes + bytes > options.max_backlog_bytes_per_client) {
        drop(reply, fmt::format("its client does not read its replies ({} bytes wait for it already)", b.bytes));
        continue;
      }
      if (backlog_bytes_total > 0 && backlog_bytes_total + bytes > options.max_backlog_bytes) {
        drop(reply, fmt::format("clients that do not read hold {} bytes of replies already (max_backlog_bytes)",
                                backlog_bytes_total.load()));
        if (b.replies.empty()) backlogs.erase(reply.peer);
        continue;
      }
      b.bytes += bytes;
      backlog_bytes_total += bytes;
      reply.backlogged_bytes = bytes;
      b.replies.push_back(std::move(reply));
    }
  }

  // One turn of the endpoint's thread: replies out, then a bounded batch of requests in.
  void turn(zmq::pollitem_t* items) {
    // With replies waiting for slow clients, look again soon: their pipes drain as they read.
    detail::poll_items(items, 2, std::chrono::milliseconds(backlogs.empty() ? 100 : 5));
    if ((items[1].revents & ZMQ_POLLIN) != 0 || !backlogs.empty()) flush();
    if ((items[0].revents & ZMQ_POLLIN) == 0) return;
    // A bounded batch per turn, so that replies keep flowing under a flood of requests.
    for (int i = 0; i < 64; ++i) {
      std::vector<zmq::message_t> parts;
      // The peer's identity, the header, a frame per tensor: a message of more frames is dropped.
      const auto receipt = detail::receive_frames_at_most(router, parts, 2 + wire::kMaxTensors, zmq::recv_flags::dontwait);
      if (receipt == detail::Receipt::kNothing) break;
      if (receipt == detail::Receipt::kTooManyFrames) {  // refused, by its id when its header has one
        ++malformed;
        const std::string why = fmt::format("a request of more than {} frames (a header and at most {} tensors)",
                                            1 + wire::kMaxTensors, wire::kMaxTensors);
        noisy.log(LogLevel::kWarning, fmt::format("client endpoint {}: malformed frame dropped: {}", endpoint, why));
        const auto id = parts.size() >= 2 ? wire::peek_request_id(parts[1].data(), parts[1].size()) : std::nullopt;
        if (id) refuse(parts.front().to_string(), *id, absl::InvalidArgumentError(fmt::format("malformed request: {}", why)));
        continue;
      }
      if (parts.empty()) continue;
      std::string peer = parts.front().to_string();
      parts.erase(parts.begin());
      on_request(std::move(peer), std::move(parts));
    }
  }

  void main() {
    zmq::pollitem_t items[2] = {{router.handle(), 0, ZMQ_POLLIN, 0}, {nullptr, outbox->wake_fd, ZMQ_POLLIN, 0}};
    while (!stopping) {
      try {
        turn(items);
      } catch (const std::exception& e) {  // out of memory, an unexpected ZeroMQ error: the endpoint goes on
        ++malformed;
        noisy.log(LogLevel::kWarning, fmt::format("client endpoint {}: {} (the endpoint goes on)", endpoint, e.what()));
        std::this_thread::sleep_for(std::chrono::milliseconds(10));  // no spinning on an error that stays
      }
    }
    try {  // what is ready goes out now, without waiting (drain()'s last refusals, say)
      flush();
    } catch (...) {
    }
    for (auto& [peer, b] : backlogs) outbox->dropped += b.replies.size();
    outbox->dropped += taken.size();
    backlogs.clear();
    taken.clear();
    backlog_bytes_total = 0;
  }
};

ClientEndpoint::ClientEndpoint(Session& session, const std::string& endpoint, ClientEndpointOptions options)
    : impl_(std::make_unique<Impl>(session, std::move(options))) {
  Impl& s = *impl_;
  const std::string what = fmt::format("client endpoint '{}'", endpoint);
  if (auto status = detail::check_tcp_bind(endpoint, s.options.security, "client endpoint"); !status.ok()) {
    throw std::runtime_error(std::string(status.message()));
  }
  if (s.options.security.curve()) {
    auto curve = detail::CurveServer::start(s.context, s.options.security, what);
    if (!curve.ok()) throw std::runtime_error(std::string(curve.status().message()));
    s.curve = *std::move(curve);
    s.curve->secure(s.router);
  }
  s.router.set(zmq::sockopt::router_mandatory, 1);
  s.router.set(zmq::sockopt::linger, 0);
  s.router.set(zmq::sockopt::sndhwm, 16);  // per client; beyond, replies wait in the endpoint's backlog
  s.router.set(zmq::sockopt::maxmsgsize, static_cast<std::int64_t>(std::max<std::size_t>(s.options.max_request_bytes, 4096)));
  try {
    s.router.bind(endpoint);
  } catch (const zmq::error_t& e) {
    throw std::runtime_error(fmt::format("client endpoint '{}': cannot bind: {}", endpoint, e.what()));
  }
  s.endpoint = s.router.get(zmq::sockopt::last_endpoint);
  s.socket_file = detail::IpcSocketFile::of(s.endpoint);  // libzmq 4.3 leaves it: removed at stop()
  if (s.curve) s.curve->describe(fmt::format("client endpoint '{}'", s.endpoint));
  s.thread = std::thread([&s] { s.main(); });
}

// Requests still in the session keep the outbox (and its fd) alive; their replies are dropped.
ClientEndpoint::~ClientEndpoint() {
  stop();
  impl_->router.close();  // before the authenticator and the context
  impl_->curve.reset();
}

const std::string& ClientEndpoint::endpoint() const { return impl_->endpoint; }
std::uint64_t ClientEndpoint::malformed_frames() const { return impl_->malformed.load(); }
std::uint64_t ClientEndpoint::served() const { return impl_->served.load(); }
std::uint64_t ClientEndpoint::dropped_replies() const { return impl_->outbox->dropped.load(); }
std::uint64_t ClientEndpoint::auth_failures() const { return impl_->curve ? impl_->curve->failures() : 0; }

void ClientEndpoint::stop() {
  std::lock_guard lock(impl_->stop_mu);
  impl_->stopping = true;
  if (impl_->thread.joinable()) impl_->thread.join();
  impl_->outbox->close();  // after the join: the socket thread sends nothing any more
  // Nothing reads the socket now: closed, so that clients are no longer accepted (their requests
  // would wait for a reply until their timeout) and none of their frames is buffered. After a
  // drain(), what ZeroMQ has not written yet still goes, until the drain's deadline (the context
  // waits for it when it ends); otherwise it is dropped.
  if (impl_->router.handle() != nullptr) {
    const auto left = absl::ToInt64Milliseconds(impl_->drain_deadline - absl::Now());
    if (impl_->draining && left > 0) impl_->router.set(zmq::sockopt::linger, static_cast<int>(std::min<std::int64_t>(left, 1 << 30)));
  }
  impl_->router.close();
  if (impl_->socket_file) impl_->socket_file->remove();
  impl_->socket_file.reset();
}

void ClientEndpoint::drain(absl::Duration timeout) {
  Impl& s = *impl_;
  const absl::Time deadline = absl::Now() + timeout;
  {
    std::lock_guard lock(s.stop_mu);
    s.drain_deadline = deadline;
  }
  s.draining = true;
  while (!s.stopping && (s.in_flight_total > 0 || s.backlog_bytes_total > 0) && absl::Now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  stop();
}

std::size_t ClientEndpoint::in_flight() const { return impl_->in_flight_total.load(); }
bool ClientEndpoint::draining() const { return impl_->draining.load(); }

struct RemoteClient::Impl {
  zmq::context_t context{1};
  zmq::socket_t dealer{context, zmq::socket_type::dealer};
  absl::Duration timeout;
  std::uint64_t next_id = 1;
};

RemoteClient::RemoteClient(const std::string& endpoint, absl::Duration timeout, const ClientSecurity& security)
    : impl_(std::make_unique<Impl>()) {
  impl_->timeout = timeout;
  impl_->dealer.set(zmq::sockopt::linger, 0);
  if (security.curve()) {
    std::string error;
    if (!detail::configure_curve_client(impl_->dealer, security.secret_key_file, security.server_key_file, error)) {
      throw std::runtime_error(fmt::format("remote client of '{}': {}", endpoint, error));
    }
  }
  try {
    impl_->dealer.connect(endpoint);
  } catch (const zmq::error_t& e) {  // a malformed endpoint ("127.0.0.1:5555" without tcp://)
    throw std::runtime_error(fmt::format("remote client of '{}': cannot connect: {}", endpoint, e.what()));
  }
}

RemoteClient::~RemoteClient() = default;

absl::StatusOr<Tensors> RemoteClient::submit(const std::string& task, const Tensors& inputs) {
  Impl& c = *impl_;
  wire::Header header;
  header.kind = wire::MessageKind::kSubmit;
  header.request_id = c.next_id++;
  header.target = task;
  header.times.submitted_ns = detail::now_ns();
  const absl::Time deadline = absl::Now() + c.timeout;
  auto encoded = detail::encode_for_socket(header, inputs, nullptr, nullptr);
  if (!encoded.ok()) return encoded.status();
  // Within the timeout too: with no endpoint there, requests queue in the socket up to its bound,
  // and the send would then wait for ever.
  auto wait_for = [&](short events) {
    zmq::pollitem_t item{c.dealer.handle(), 0, events, 0};
    detail::poll_items(&item, 1, std::chrono::milliseconds(detail::poll_slice_ms(deadline - absl::Now(), 100)));
    return (item.revents & events) != 0;
  };
  while (true) {
    std::optional<bool> sent;
    try {
      sent = detail::unless_interrupted([&] { return detail::send_encoded(c.dealer, *encoded, zmq::send_flags::dontwait); });
    } catch (const zmq::error_t& e) {
      return absl::UnavailableError(fmt::format("request {} for task '{}': {}", header.request_id, task, e.what()));
    }
    if (!sent) continue;  // interrupted: the same message again
    if (*sent) break;
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(fmt::format("request {} for task '{}' could not be sent within {} (no endpoint takes it)",
                                                     header.request_id, task, absl::FormatDuration(c.timeout)));
    }
    (void)wait_for(ZMQ_POLLOUT);
  }
  while (true) {
    if (!wait_for(ZMQ_POLLIN)) {
      if (absl::Now() < deadline) continue;
      return absl::DeadlineExceededError(fmt::format("no reply to request {} for task '{}' within {}",
                                                     header.request_id, task, absl::FormatDuration(c.timeout)));
    }
    std::vector<zmq::message_t> frames;
    (void)zmq::recv_multipart(c.dealer, std::back_inserter(frames));
    auto reply = detail::decode_message(std::move(frames));
    if (!reply.ok()) return absl::DataLossError(fmt::format("malformed reply: {}", std::string(reply.status().message())));
    if (reply->header.request_id != header.request_id) continue;  // a late reply to an earlier, timed-out request
    if (reply->header.status_code != 0) {
      return absl::Status(static_cast<absl::StatusCode>(reply->header.status_code), reply->header.message);
    }
    return std::move(reply->tensors);
  }
}

}  // namespace blockflow
