// One process's end of a zero-copy data link (include/blockflow/channel/detail/zero_copy_link.hpp):
// the release protocol, and what is read from the link sorted.
#include <blockflow/channel/detail/zero_copy_link.hpp>
#include <blockflow/core/detail/clock.hpp>
#include <blockflow/core/detail/log.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <thread>
#include <utility>

namespace blockflow::detail {

wire::Header release_message(const wire::ShmHandle* first, std::size_t count) {
  wire::Header h;
  h.kind = wire::MessageKind::kRelease;
  h.message = wire::encode_releases({first, first + count});
  return h;
}

std::size_t send_releases(PacketLink& link, const wire::ShmHandle* first, std::size_t count, bool wait, absl::Status* why) {
  for (std::size_t at = 0; at < count; at += kReleasesPerMessage) {
    const std::size_t n = std::min(count - at, kReleasesPerMessage);
    absl::Status status = send_packet(link, release_message(first + at, n), {}, nullptr, nullptr, nullptr, wait);
    if (!status.ok()) {
      if (why != nullptr) *why = std::move(status);
      return at;
    }
  }
  return count;
}

bool run_detached_until_done(std::function<bool()> step, absl::Duration period) noexcept {
  try {
    std::thread([step = std::move(step), period] {
      while (step()) absl::SleepFor(period);
    }).detach();
    return true;
  } catch (const std::exception& e) {
    try {
      log(LogLevel::kWarning, fmt::format("a helper thread could not be made ({}): what it finishes waits for the next try",
                                          e.what()));
    } catch (...) {
    }
    return false;
  }
}

namespace {

// The outboxes whose releases wait for room, retried every kRetryMs by one thread while any does.
class OutboxRetries {
 public:
  static OutboxRetries& get() {
    static auto* retries = new OutboxRetries;  // never destroyed: its thread may outlive main()
    return *retries;
  }
  // False when no thread retries `outbox` (none could be made): it is not listed, and its releases
  // leave with its next give(), which asks again.
  bool add(std::weak_ptr<ReleaseOutbox> outbox) {
    blockflow::detail::MutexLock lock(&mu_);
    waiting_.push_back(std::move(outbox));
    if (!running_) running_ = run_detached_until_done([this] { return retry(); }, absl::Milliseconds(kRetryMs));
    if (!running_) waiting_.pop_back();
    return running_;
  }

 private:
  static constexpr int kRetryMs = 2;
  bool retry() {
    std::vector<std::weak_ptr<ReleaseOutbox>> now;
    {
      blockflow::detail::MutexLock lock(&mu_);
      now.swap(waiting_);
    }
    for (auto& weak : now) {
      if (auto outbox = weak.lock()) outbox->flush();  // lists itself again if some still wait
    }
    blockflow::detail::MutexLock lock(&mu_);
    running_ = !waiting_.empty();
    return running_;
  }
  blockflow::detail::Mutex mu_;
  std::vector<std::weak_ptr<ReleaseOutbox>> waiting_ ABSL_GUARDED_BY(mu_);
  bool running_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

void ReleaseOutbox::give(const wire::ShmHandle& handle) {
  blockflow::detail::MutexLock lock(&mu_);
  waiting_.push_back(handle);
  send_locked();
}

void ReleaseOutbox::flush() {
  retrying_.store(false);
  blockflow::detail::MutexLock lock(&mu_);
  send_locked();
}

void ReleaseOutbox::send_locked() {
  absl::Status why;
  std::size_t sent = send_releases(*link_, waiting_.data(), waiting_.size(), /*wait=*/false, &why);
  // The producer is gone (it reclaimed every slot): drop them. Else its queue is full (or this
  // packet failed): they wait for the next try.
  if (sent < waiting_.size() && why.code() == absl::StatusCode::kUnavailable) sent = waiting_.size();
  waiting_.erase(waiting_.begin(), waiting_.begin() + static_cast<std::ptrdiff_t>(sent));
  waiting_count_.store(waiting_.size(), std::memory_order_relaxed);
  if (!waiting_.empty() && !retrying_.exchange(true) && !OutboxRetries::get().add(weak_from_this())) {
    retrying_.store(false);  // not listed: the next give() lists it again
  }
}

ZeroCopyLink::ZeroCopyLink(std::shared_ptr<PacketLink> link, std::shared_ptr<ZeroCopyEnds> ends)
    : link_(std::move(link)),
      ends_(std::move(ends)),
      outbox_(std::make_shared<ReleaseOutbox>(link_)),
      resolver_(ends_->resolver(given_, [outbox = outbox_](const wire::ShmHandle& h) { outbox->give(h); })),  // any thread
      unstage_([ends = ends_](const wire::ShmHandle& h) { (void)ends->release(h); }) {}

ZeroCopyLink::Packet ZeroCopyLink::read(int timeout_ms, absl::Duration spin, const ParkedResolver* parked) {
  Packet out;
  // Pools their producer retired are forgotten once the link has been seen empty after they were
  // seen retired: every packet naming one was sent before it was retired, so none is left unread.
  // (A relay that names a retired pool sends its descriptor again: LinkFd::resend; one whose check
  // of the flag came just before it was set finds the pool kept one period more: forget().)
  if (const std::int64_t now = now_ns(); !forget_due_ && now - retire_check_ns_ >= kRetireCheckNs) {
    retire_check_ns_ = now;
    retiring_ = given_.retired();
    forget_due_ = true;
  }
  for (int releases = 0; releases < kReleasePacketsPerRead; ++releases) {
    auto received = link_->receive(releases == 0 ? timeout_ms : 0, spin);
    if (!received) {
      if (std::exchange(forget_due_, false)) given_.forget(std::exchange(retiring_, {}));
      return out;
    }
    out.received_ns = now_ns();
    if (received->closed) {
      out.kind = Packet::Kind::kClosed;
      return out;
    }
    if (!received->frames.ok()) {
      out.kind = Packet::Kind::kMalformed;
      out.malformed = received->frames.status();
      return out;
    }
    // The pools this packet is the first to name, before its handles are read. One that cannot be
    // taken leaves the peer sure that this end holds it: the link is shut, as a broken one.
    absl::Status refused_pool;
    for (const int fd : received->fds.take()) {
      if (auto adopted = given_.adopt(fd); !adopted.ok() && refused_pool.ok()) refused_pool = adopted.status();
    }
    if (!refused_pool.ok()) link_->shut_down();
    std::vector<zmq::message_t>& frames = *received->frames;
    if (!frames.empty()) {
      out.request_id = wire::peek_request_id(frames[0].data(), frames[0].size());
      out.node = wire::peek_node(frames[0].data(), frames[0].size());
    }
    auto message = decode_message(std::move(frames), &resolver_, parked);
    if (!message.ok()) {
      out.kind = Packet::Kind::kMalformed;
      out.malformed = refused_pool.ok() ? message.status()
                                        : absl::InvalidArgumentError(fmt::format("{} ({})", std::string(message.status().message()),
                                                                                 std::string(refused_pool.message())));
      return out;
    }
    if (message->header.kind != wire::MessageKind::kRelease) {
      out.kind = Packet::Kind::kMessage;
      out.message = *std::move(message);
      return out;
    }
    out.request_id.reset();
    if (auto status = ends_->take_releases(message->header); !status.ok()) {
      out.kind = Packet::Kind::kMalformed;
      out.malformed = absl::InvalidArgumentError(fmt::format("a release: {}", std::string(status.message())));
      return out;
    }
  }
  out.received_ns = 0;
  return out;  // kNothing: the caller reads again after its own checks
}

absl::Status ZeroCopyLink::send(const wire::Header& header, const Tensors& tensors, const ShmStager* stager, bool wait,
                                std::uint64_t* bytes_copied) {
  return send_packet(*link_, header, tensors, bytes_copied, stager, &unstage_, wait);
}

void ZeroCopyLink::flush_releases() {
  if (outbox_->pending()) outbox_->flush();
}

}  // namespace blockflow::detail
