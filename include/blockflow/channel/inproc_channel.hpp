#pragma once
/// @file
/// @brief The in-process TensorChannel: a bounded queue of envelopes; tensors cross by reference.

#include <blockflow/channel/channel.hpp>

#include <absl/time/time.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <limits>
#include <mutex>

namespace blockflow {

/// @brief Settings of an InProcessChannel.
struct InProcessChannelOptions {
  std::size_t capacity = 64;                 ///< at least 1
  FullPolicy full_policy = FullPolicy::kBlock;
  /// How long a receiver polls before it sleeps on the condition variable. A short spin keeps a
  /// hop in the microsecond range when messages follow each other closely; 0 disables it.
  absl::Duration receive_spin = absl::Microseconds(50);
};

/// @brief A bounded multi-producer, multi-consumer queue of envelopes. Nothing is copied: the
/// envelope (and the tensor references in it) is moved. Thread-safe.
class InProcessChannel final : public TensorChannel {
 public:
  explicit InProcessChannel(InProcessChannelOptions options = {});
  ~InProcessChannel() override;

  SendOutcome send(Envelope&& envelope) override { return send(std::move(envelope), absl::InfiniteFuture()); }
  /// @brief send() that, with kBlock on a full queue, waits only until `deadline`: then
  /// DeadlineExceeded, with the envelope back in `displaced`.
  SendOutcome send(Envelope&& envelope, absl::Time deadline);
  /// @brief Queues the envelope even when the queue is full (whatever the policy); fails only on a
  /// closed channel (Cancelled, the envelope in `displaced`). For an executor whose threads would
  /// otherwise wait on each other for room (docs/lanes.md): the depth passes the capacity until
  /// receivers catch up, and senders that wait for room wait until it is below the capacity again.
  /// Counted in stats().past_capacity when the queue was full. With `limit`: not once `limit`
  /// envelopes are queued (ResourceExhausted, `envelope` in `displaced`).
  SendOutcome send_past_capacity(Envelope&& envelope, std::size_t limit = std::numeric_limits<std::size_t>::max());
  /// @brief Queues `envelope` without waiting and, when the queue is full, takes its oldest
  /// envelope out into `oldest` in the same step: the depth never passes the capacity, and no
  /// other sender takes the room in between (a lane that helps empty a full queue keeps the room it
  /// makes, docs/lanes.md). A closed channel takes nothing: Cancelled, `envelope` in `displaced`.
  SendOutcome exchange(Envelope&& envelope, std::optional<Envelope>& oldest);
  std::optional<Envelope> receive(absl::Time deadline) override;
  /// @brief The next envelope if one is queued (and the channel is open); never waits.
  [[nodiscard]] std::optional<Envelope> try_receive();
  /// @brief Envelopes queued now (no lock taken).
  [[nodiscard]] std::size_t depth() const { return size_.load(std::memory_order_acquire); }
  /// @brief The queue's bound.
  [[nodiscard]] std::size_t capacity() const { return options_.capacity; }
  /// @brief What the queue does when it is full.
  [[nodiscard]] FullPolicy full_policy() const { return options_.full_policy; }
  void close() override;
  std::vector<Envelope> drain() override;
  bool closed() const override;
  ChannelStats stats() const override;
  std::string_view kind() const override { return "inproc"; }

 private:
  std::optional<Envelope> pop_locked();
  void push_locked(Envelope&& envelope, std::unique_lock<std::mutex>& lock);  // unlocks

  const InProcessChannelOptions options_;
  mutable std::mutex mu_;
  std::condition_variable not_empty_;
  std::condition_variable not_full_;
  std::deque<Envelope> queue_;
  std::atomic<bool> closed_{false};
  int sleeping_receivers_ = 0;
  int sleeping_senders_ = 0;
  std::atomic<std::size_t> size_{0};  // mirrors queue_.size() for the lock-free spin
  ChannelStats stats_;
};

}  // namespace blockflow
