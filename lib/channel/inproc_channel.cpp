#include <blockflow/channel/inproc_channel.hpp>
#include <blockflow/core/detail/clock.hpp>

#include <fmt/format.h>

#include <chrono>
#include <thread>

namespace blockflow {

std::string_view to_string(FullPolicy policy) {
  switch (policy) {
    case FullPolicy::kBlock: return "block";
    case FullPolicy::kReject: return "reject";
    case FullPolicy::kDropOldest: return "drop-oldest";
  }
  return "unknown";
}

InProcessChannel::InProcessChannel(InProcessChannelOptions options) : options_(options) {
  if (options_.capacity == 0) throw std::invalid_argument("InProcessChannel: capacity must be at least 1");
  stats_.kind = "inproc";
  stats_.capacity = options_.capacity;
}

InProcessChannel::~InProcessChannel() { close(); }

SendOutcome InProcessChannel::send(Envelope&& envelope, absl::Time deadline) {
  SendOutcome outcome;
  std::unique_lock lock(mu_);
  if (queue_.size() >= options_.capacity && !closed_) {
    switch (options_.full_policy) {
      case FullPolicy::kBlock: {
        auto room = [&] { return closed_ || queue_.size() < options_.capacity; };
        if (envelope.offered_ns == 0) envelope.offered_ns = detail::now_ns();
        ++sleeping_senders_;
        if (deadline == absl::InfiniteFuture()) {
          not_full_.wait(lock, room);
        } else if (!not_full_.wait_until(lock, absl::ToChronoTime(deadline), room)) {
          --sleeping_senders_;
          outcome.status = absl::DeadlineExceededError(
              fmt::format("queue full (capacity {}, policy block)", options_.capacity));
          outcome.displaced = std::move(envelope);
          return outcome;
        }
        --sleeping_senders_;
        break;
      }
      case FullPolicy::kReject:
        ++stats_.rejected;
        outcome.status = absl::ResourceExhaustedError(
            fmt::format("queue full (capacity {}, policy reject)", options_.capacity));
        outcome.displaced = std::move(envelope);
        return outcome;
      case FullPolicy::kDropOldest:
        ++stats_.dropped;
        outcome.displaced = std::move(queue_.front());
        queue_.pop_front();
        break;
    }
  }
  if (closed_) {
    outcome.status = absl::CancelledError("channel closed");
    outcome.displaced = std::move(envelope);
    return outcome;
  }
  push_locked(std::move(envelope), lock);
  return outcome;  // with drop-oldest's victim, if any
}

namespace {

SendOutcome closed_outcome(Envelope&& envelope) {
  SendOutcome outcome;
  outcome.status = absl::CancelledError("channel closed");
  outcome.displaced = std::move(envelope);
  return outcome;
}

}  // namespace

SendOutcome InProcessChannel::send_past_capacity(Envelope&& envelope, std::size_t limit) {
  std::unique_lock lock(mu_);
  if (closed_) return closed_outcome(std::move(envelope));
  if (queue_.size() >= limit) {
    return SendOutcome{absl::ResourceExhaustedError(fmt::format("queue full ({} queued, the limit past its capacity)", limit)),
                       std::move(envelope)};
  }
  if (queue_.size() >= options_.capacity) ++stats_.past_capacity;
  push_locked(std::move(envelope), lock);
  return {};
}

SendOutcome InProcessChannel::exchange(Envelope&& envelope, std::optional<Envelope>& oldest) {
  std::unique_lock lock(mu_);
  if (closed_) return closed_outcome(std::move(envelope));
  const bool full = queue_.size() >= options_.capacity;
  envelope.sent_ns = detail::now_ns();
  queue_.push_back(std::move(envelope));  // first: if it throws, nothing was taken
  ++stats_.sent;
  if (full) oldest = pop_locked();
  stats_.high_watermark = std::max(stats_.high_watermark, queue_.size());
  size_.store(queue_.size(), std::memory_order_release);
  const bool wake = sleeping_receivers_ > 0;
  lock.unlock();
  if (wake) not_empty_.notify_one();
  return {};
}

void InProcessChannel::push_locked(Envelope&& envelope, std::unique_lock<std::mutex>& lock) {
  envelope.sent_ns = detail::now_ns();
  queue_.push_back(std::move(envelope));
  ++stats_.sent;
  stats_.high_watermark = std::max(stats_.high_watermark, queue_.size());
  size_.store(queue_.size(), std::memory_order_release);
  const bool wake = sleeping_receivers_ > 0;
  lock.unlock();
  if (wake) not_empty_.notify_one();
}

std::optional<Envelope> InProcessChannel::pop_locked() {
  if (closed_ || queue_.empty()) return std::nullopt;
  Envelope envelope = std::move(queue_.front());
  queue_.pop_front();
  ++stats_.received;
  size_.store(queue_.size(), std::memory_order_release);
  return envelope;
}

std::optional<Envelope> InProcessChannel::try_receive() {
  if (size_.load(std::memory_order_acquire) == 0) return std::nullopt;
  std::unique_lock lock(mu_);
  auto envelope = pop_locked();
  const bool wake = envelope && sleeping_senders_ > 0;
  lock.unlock();
  if (wake) not_full_.notify_one();
  return envelope;
}

std::optional<Envelope> InProcessChannel::receive(absl::Time deadline) {
  // Poll briefly before sleeping: a hand-off to an awake receiver costs well under a microsecond,
  // a futex wake-up several.
  if (options_.receive_spin > absl::ZeroDuration()) {
    const absl::Time spin_end = std::min(deadline, absl::Now() + options_.receive_spin);
    while (size_.load(std::memory_order_acquire) == 0 && absl::Now() < spin_end) {
      if (closed_.load(std::memory_order_acquire)) return std::nullopt;
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
  }
  std::unique_lock lock(mu_);
  while (!closed_ && queue_.empty()) {
    ++sleeping_receivers_;
    if (deadline == absl::InfiniteFuture()) {
      not_empty_.wait(lock);
    } else if (not_empty_.wait_until(lock, absl::ToChronoTime(deadline)) == std::cv_status::timeout) {
      --sleeping_receivers_;
      break;  // what came meanwhile is taken below, and a sender waiting for room is woken
    }
    --sleeping_receivers_;
  }
  auto envelope = pop_locked();
  const bool wake = envelope && sleeping_senders_ > 0;
  lock.unlock();
  if (wake) not_full_.notify_one();
  return envelope;
}

void InProcessChannel::close() {
  {
    std::lock_guard lock(mu_);
    if (closed_) return;
    closed_ = true;
  }
  not_empty_.notify_all();
  not_full_.notify_all();
}

std::vector<Envelope> InProcessChannel::drain() {
  std::unique_lock lock(mu_);
  std::vector<Envelope> out;
  out.reserve(queue_.size());
  for (auto& envelope : queue_) out.push_back(std::move(envelope));
  queue_.clear();
  stats_.received += out.size();  // taken out, as by receive(): sent = received + dropped + depth
  size_.store(0, std::memory_order_release);
  const bool wake = !out.empty() && sleeping_senders_ > 0;
  lock.unlock();
  if (wake) not_full_.notify_all();  // room for every sender waiting, on a channel still open
  return out;
}

bool InProcessChannel::closed() const { return closed_.load(std::memory_order_acquire); }

ChannelStats InProcessChannel::stats() const {
  std::lock_guard lock(mu_);
  ChannelStats copy = stats_;
  copy.depth = queue_.size();
  return copy;
}

}  // namespace blockflow
