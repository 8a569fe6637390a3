// ipc:// and tcp:// ends: envelopes cross in the serialized wire format (docs/wire-format.md) over
// a ZeroMQ PUSH (sender, connects) / PULL (receiver, binds) pair. ZeroMQ reconnects by itself, and
// its high-water marks (the capacity, on both sides) push back on a sender whose receiver is slow
// or absent. On tcp:// with keys, CURVE authenticates both ends and encrypts (curve.hpp).
#include "process_channel_impl.hpp"

#include <blockflow/core/detail/clock.hpp>
#include <blockflow/core/detail/log.hpp>
#include <blockflow/core/detail/mutex.hpp>
#include <blockflow/channel/detail/curve_auth.hpp>
#include <blockflow/channel/detail/curve_keys.hpp>
#include <blockflow/channel/detail/ipc_socket_file.hpp>
#include <blockflow/channel/detail/tensor_codec.hpp>
#include <blockflow/channel/detail/zmq_calls.hpp>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <zmq_addon.hpp>

#include <sys/socket.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <iterator>
#include <limits>
#include <optional>

namespace blockflow::detail {
namespace {

constexpr int kPollSliceMs = 50;  // a waiting receive() notices close() within this

class ZmqEnd : public ProcessChannel {
 public:
  ZmqEnd(std::string uri, ChannelRole role, const ProcessChannelOptions& options)
      : uri_(std::move(uri)), role_(role), options_(options), context_(1) {}

  absl::StatusOr<at::Tensor> empty(at::IntArrayRef sizes, at::ScalarType dtype) override {
    return named(uri_, checked_empty(sizes, dtype, at::kCPU));
  }
  const std::string& uri() const override { return uri_; }
  ChannelRole role() const override { return role_; }
  bool closed() const override { return closed_.load(); }
  std::string_view kind() const override { return kind_; }
  void close() override { closed_.store(true); }
  ChannelStats stats() const override {
    ChannelStats s;
    s.kind = kind_;
    s.sent = sent_.load();
    s.received = received_.load();
    s.bytes_copied = copies_.load();
    s.capacity = options_.capacity;
    return s;
  }
  /// ZeroMQ connects and reconnects in the background and does not say whether a peer is there:
  /// true while the end is open.
  bool connected() const override { return !closed_.load(); }

 protected:
  std::string uri_;  // a tcp://HOST:* receiver's names its port once bound (set before any other thread sees it)
  const ChannelRole role_;
  const ProcessChannelOptions options_;
  std::atomic<std::uint64_t> sent_{0}, received_{0}, copies_{0};
  const std::string kind_ = uri_.rfind("tcp://", 0) == 0 ? "zmq-tcp" : "zmq-ipc";
  zmq::context_t context_;
  std::atomic<bool> closed_{false};
  mutable Mutex mu_;  // the socket's: ZeroMQ sockets are not thread-safe
};

class ZmqSender final : public ZmqEnd {
 public:
  ZmqSender(std::string uri, const std::string& endpoint, const ProcessChannelOptions& options,
            const CurveClientKeys* keys)
      : ZmqEnd(std::move(uri), ChannelRole::kSender, options), socket_(context_, zmq::socket_type::push) {
    if (keys != nullptr) apply_curve_client(socket_, *keys);
    socket_.set(zmq::sockopt::sndhwm, static_cast<int>(options.capacity));
    // What was accepted still leaves after close, for up to send_timeout.
    socket_.set(zmq::sockopt::linger, static_cast<int>(absl::ToInt64Milliseconds(options.send_timeout)));
    socket_.set(zmq::sockopt::immediate, 1);  // nothing queues for a receiver that is not there
    socket_.set(zmq::sockopt::sndtimeo, options.full_policy == FullPolicy::kBlock
                                            ? static_cast<int>(absl::ToInt64Milliseconds(options.send_timeout))
                                            : 0);
    socket_.connect(endpoint);
  }

  SendOutcome send(Envelope&& envelope) override {
    if (closed_.load()) return refused(std::move(envelope), absl::CancelledError(fmt::format("{}: closed", uri_)));
    wire::Header h = data_header(envelope);
    std::uint64_t copied = 0;
    absl::StatusOr<bool> sent = false;
    {
      MutexLock lock(&mu_);
      try {
        sent = send_message(socket_, std::move(h), envelope.tensors, zmq::send_flags::none, &copied);
      } catch (const zmq::error_t& e) {
        sent = absl::UnavailableError(e.what());
      }
    }
    copies_.fetch_add(copied);
    if (!sent.ok()) {
      return refused(std::move(envelope), named(uri_, sent.status()));
    }
    if (!*sent) {
      const bool wait = options_.full_policy == FullPolicy::kBlock;
      return refused(std::move(envelope),
                     wait ? absl::DeadlineExceededError(fmt::format("{}: no receiver took it within {}{}", uri_,
                                                                    absl::FormatDuration(options_.send_timeout),
                                                                    kind_ == "zmq-tcp" ? no_receiver_hint() : ""))
                          : absl::UnavailableError(fmt::format("{}: no receiver ready", uri_)));
    }
    sent_.fetch_add(1);
    return {};
  }
  std::optional<Envelope> receive(absl::Time) override { return std::nullopt; }
  std::vector<Envelope> drain() override { return {}; }

 private:
  // A CURVE handshake that fails looks, from here, like no receiver at all.
  std::string no_receiver_hint() const {
    return options_.sender_security.curve()
               ? " (none reachable, or it refused this sender's key: see the receiver's auth failures)"
               : " (none reachable, or it refused this sender: a receiver with CURVE keys takes only senders "
                 "with keys, ProcessChannelOptions::sender_security)";
  }

  zmq::socket_t socket_;
};

class ZmqReceiver final : public ZmqEnd {
 public:
  ZmqReceiver(std::string uri, const ProcessChannelOptions& options)
      : ZmqEnd(std::move(uri), ChannelRole::kReceiver, options), socket_(context_, zmq::socket_type::pull) {
    socket_.set(zmq::sockopt::rcvhwm, static_cast<int>(options.capacity));
    socket_.set(zmq::sockopt::linger, 0);
    socket_.set(zmq::sockopt::maxmsgsize,
                static_cast<std::int64_t>(std::min<std::uint64_t>(
                    options.max_frame_bytes, static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))));
  }
  absl::Status bind(const std::string& endpoint) {
    const std::string what = fmt::format("channel receiver '{}'", uri_);
    if (auto status = check_tcp_bind(endpoint, options_.receiver_security, "channel receiver"); !status.ok()) {
      return status;
    }
    if (options_.receiver_security.curve()) {
      auto curve = CurveServer::start(context_, options_.receiver_security, what);
      if (!curve.ok()) return curve.status();
      curve_ = *std::move(curve);
      curve_->secure(socket_);
    }
    try {
      socket_.bind(endpoint);
      socket_file_ = IpcSocketFile::of(endpoint);  // libzmq 4.3 leaves it: removed when this end goes
      if (uri_.rfind("tcp://", 0) == 0 && uri_.size() > 2 && uri_.compare(uri_.size() - 2, 2, ":*") == 0) {
        uri_ = socket_.get(zmq::sockopt::last_endpoint);  // tcp://HOST:PORT, the port the system chose
        if (curve_) curve_->describe(fmt::format("channel receiver '{}'", uri_));
      }
    } catch (const zmq::error_t& e) {
      return e.num() == EADDRINUSE ? absl::AlreadyExistsError(fmt::format("{}: another receiver holds it", uri_))
                                   : absl::UnavailableError(fmt::format("{}: cannot bind: {}", uri_, e.what()));
    }
    return absl::OkStatus();
  }

  SendOutcome send(Envelope&& envelope) override {
    return refused(std::move(envelope), absl::FailedPreconditionError(fmt::format("{}: this end receives", uri_)));
  }
  std::optional<Envelope> receive(absl::Time deadline) override {
    while (!closed_.load()) {
      if (auto e = take(zmq::recv_flags::dontwait)) return e;
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return std::nullopt;
      MutexLock lock(&mu_);
      zmq::pollitem_t item{static_cast<void*>(socket_), 0, ZMQ_POLLIN, 0};
      poll_items(&item, 1, std::chrono::milliseconds(poll_slice_ms(left, kPollSliceMs)));
    }
    return std::nullopt;
  }
  std::vector<Envelope> drain() override {
    std::vector<Envelope> out;
    while (auto e = take(zmq::recv_flags::dontwait)) out.push_back(std::move(*e));
    return out;
  }
 private:
  // The next well-formed message, if one is there; malformed ones are dropped (logged), up to
  // kMalformedPerTake a call, so that a peer sending only those cannot hold receive() past its deadline.
  std::optional<Envelope> take(zmq::recv_flags flags) {
    constexpr int kMalformedPerTake = 64;
    for (int dropped = 0; dropped < kMalformedPerTake; ++dropped) {
      std::vector<zmq::message_t> frames;
      {
        MutexLock lock(&mu_);
        try {
          if (!zmq::recv_multipart(socket_, std::back_inserter(frames), flags)) return std::nullopt;
        } catch (const zmq::error_t&) {
          return std::nullopt;
        }
      }
      auto message = decode_message(std::move(frames));
      if (!message.ok()) {
        noisy_.log(LogLevel::kWarning, fmt::format("{}: malformed message dropped: {}", uri_, std::string(message.status().message())));
        continue;
      }
      if (message->header.kind != wire::MessageKind::kData) continue;
      copies_.fetch_add(message->bytes_copied);
      received_.fetch_add(1);
      return envelope_of(std::move(*message));
    }
    return std::nullopt;
  }

  // The ipc:// socket file this end bound: unlinked once the socket is closed, if it is still that file
  // (not one a receiver opened since under the same name).
  std::optional<IpcSocketFile> socket_file_;
  std::unique_ptr<CurveServer> curve_;  // destroyed after the socket, before the context
  zmq::socket_t socket_;
  RateLimitedLog noisy_;

 public:
  ~ZmqReceiver() override {
    if (!socket_file_) return;
    socket_.close();
    socket_file_->remove();
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<ProcessChannel>> open_zmq_channel(const std::string& uri, const std::string& endpoint,
                                                                 ChannelRole role, const ProcessChannelOptions& options) {
  try {
    if (role == ChannelRole::kSender) {
      CurveClientKeys keys;
      if (options.sender_security.curve()) {
        std::string error;
        if (!read_curve_client_keys(options.sender_security.secret_key_file, options.sender_security.server_key_file,
                                    keys, error)) {
          return absl::InvalidArgumentError(fmt::format("{}: sender_security: {}", uri, error));
        }
      }
      return std::unique_ptr<ProcessChannel>(
          new ZmqSender(uri, endpoint, options, options.sender_security.curve() ? &keys : nullptr));
    }
    if (endpoint.rfind("ipc://", 0) == 0 && unix_socket_live(endpoint.substr(6), SOCK_STREAM)) {
      return absl::AlreadyExistsError(fmt::format("{}: another receiver holds it", uri));
    }
    auto receiver = std::make_unique<ZmqReceiver>(uri, options);
    if (auto status = receiver->bind(endpoint); !status.ok()) return status;
    return std::unique_ptr<ProcessChannel>(std::move(receiver));
  } catch (const zmq::error_t& e) {
    return absl::InvalidArgumentError(fmt::format("{}: {}", uri, e.what()));
  }
}

}  // namespace blockflow::detail
