#include <blockflow/client_endpoint.hpp>
#include <blockflow/detail/log.hpp>
#include <blockflow/detail/clock.hpp>
#include <blockflow/detail/tensor_codec.hpp>

#include <fmt/format.h>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
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
  zmq::context_t context{1};
  zmq::socket_t router{context, zmq::socket_type::router};
  std::string endpoint;
  const std::shared_ptr<Outbox> outbox = std::make_shared<Outbox>();  // shared with the callbacks
  std::atomic<bool> stopping{false};
  std::atomic<std::uint64_t> malformed{0}, served{0};
  detail::RateLimitedLog noisy;  // per-frame messages a client can trigger
  std::mutex stop_mu;  // one stop() joins the thread
  std::thread thread;

  explicit Impl(Session& s) : session(s) {}

  void post(Reply&& reply) { outbox->post(std::move(reply)); }

  void on_request(std::string peer, std::vector<zmq::message_t>&& frames) {
    std::optional<std::uint64_t> id;
    if (!frames.empty()) id = wire::peek_request_id(frames[0].data(), frames[0].size());
    auto message = detail::decode_message(std::move(frames));
    absl::Status problem;
    if (!message.ok()) {
      problem = message.status();
    } else if (message->header.kind != wire::MessageKind::kSubmit) {
      problem = absl::InvalidArgumentError(
          fmt::format("expected a submit message, got {}", std::string(wire::to_string(message->header.kind))));
    }
    if (!problem.ok()) {
      ++malformed;
      noisy.log(LogLevel::kWarning, fmt::format("client endpoint {}: malformed frame dropped: {}", endpoint,
                                                 std::string(problem.message())));
      if (id) post({std::move(peer), reply_header(*id, absl::InvalidArgumentError(fmt::format(
                                                             "malformed request: {}", std::string(problem.message())))),
                    {}});
      return;
    }
    const std::uint64_t request = message->header.request_id;
    // The callback may run after stop() or after this object is gone: it holds the outbox, not `this`.
    session.submit(message->header.target, std::move(message->tensors),
                   [outbox = outbox, peer = std::move(peer), request](Result&& r) mutable {
                     outbox->post({std::move(peer), reply_header(request, r.status), std::move(r.outputs)});
                   });
  }

  void flush() {
    for (auto& reply : outbox->take()) {
      // Counted before the send: the client may read the reply before this thread goes on.
      ++served;
      try {
        (void)router.send(zmq::buffer(reply.peer), zmq::send_flags::sndmore);
        auto sent = detail::send_message(router, reply.header, reply.tensors);
        if (!sent.ok()) {  // outputs the wire cannot carry: tell the client why
          (void)router.send(zmq::buffer(reply.peer), zmq::send_flags::sndmore);
          (void)detail::send_message(router, reply_header(reply.header.request_id, sent.status()), {});
        }
      } catch (const zmq::error_t& e) {  // the client went away (ROUTER_MANDATORY)
        --served;
        noisy.log(LogLevel::kWarning, fmt::format("client endpoint {}: reply lost: {}", endpoint, e.what()));
      }
    }
  }

  void main() {
    zmq::pollitem_t items[2] = {{router.handle(), 0, ZMQ_POLLIN, 0}, {nullptr, outbox->wake_fd, ZMQ_POLLIN, 0}};
    while (!stopping) {
      zmq::poll(items, 2, std::chrono::milliseconds(100));
      if ((items[1].revents & ZMQ_POLLIN) != 0) flush();
      if ((items[0].revents & ZMQ_POLLIN) == 0) continue;
      std::vector<zmq::message_t> parts;
      if (!zmq::recv_multipart(router, std::back_inserter(parts), zmq::recv_flags::dontwait) || parts.empty()) continue;
      std::string peer = parts.front().to_string();
      parts.erase(parts.begin());
      on_request(std::move(peer), std::move(parts));
    }
  }
};

ClientEndpoint::ClientEndpoint(Session& session, const std::string& endpoint) : impl_(std::make_unique<Impl>(session)) {
  Impl& s = *impl_;
  s.router.set(zmq::sockopt::router_mandatory, 1);
  s.router.set(zmq::sockopt::linger, 0);
  s.router.set(zmq::sockopt::maxmsgsize, static_cast<std::int64_t>(wire::kMaxTensorBytes) * 2);
  try {
    s.router.bind(endpoint);
  } catch (const zmq::error_t& e) {
    throw std::runtime_error(fmt::format("client endpoint '{}': cannot bind: {}", endpoint, e.what()));
  }
  s.endpoint = s.router.get(zmq::sockopt::last_endpoint);
  s.thread = std::thread([&s] { s.main(); });
}

// Requests still in the session keep the outbox (and its fd) alive; their replies are dropped.
ClientEndpoint::~ClientEndpoint() { stop(); }

const std::string& ClientEndpoint::endpoint() const { return impl_->endpoint; }
std::uint64_t ClientEndpoint::malformed_frames() const { return impl_->malformed.load(); }
std::uint64_t ClientEndpoint::served() const { return impl_->served.load(); }
std::uint64_t ClientEndpoint::dropped_replies() const { return impl_->outbox->dropped.load(); }

void ClientEndpoint::stop() {
  std::lock_guard lock(impl_->stop_mu);
  impl_->stopping = true;
  if (impl_->thread.joinable()) impl_->thread.join();
  impl_->outbox->close();  // after the join: the socket thread sends nothing any more
}

struct RemoteClient::Impl {
  zmq::context_t context{1};
  zmq::socket_t dealer{context, zmq::socket_type::dealer};
  absl::Duration timeout;
  std::uint64_t next_id = 1;
};

RemoteClient::RemoteClient(const std::string& endpoint, absl::Duration timeout) : impl_(std::make_unique<Impl>()) {
  impl_->timeout = timeout;
  impl_->dealer.set(zmq::sockopt::linger, 0);
  impl_->dealer.connect(endpoint);
}

RemoteClient::~RemoteClient() = default;

absl::StatusOr<Tensors> RemoteClient::submit(const std::string& task, const Tensors& inputs) {
  Impl& c = *impl_;
  wire::Header header;
  header.kind = wire::MessageKind::kSubmit;
  header.request_id = c.next_id++;
  header.target = task;
  header.times.submitted_ns = detail::now_ns();
  auto sent = detail::send_message(c.dealer, header, inputs);
  if (!sent.ok()) return sent.status();
  const absl::Time deadline = absl::Now() + c.timeout;
  while (true) {
    const auto left = std::max<std::int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now()));
    zmq::pollitem_t item{c.dealer.handle(), 0, ZMQ_POLLIN, 0};
    zmq::poll(&item, 1, std::chrono::milliseconds(left));
    if ((item.revents & ZMQ_POLLIN) == 0) {
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
