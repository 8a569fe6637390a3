#pragma once
// Internal to the worker runtime (worker_runtime.cpp): replies on their way back to the host, the
// queue that hands them to the sending thread, and the outputs parked for direct edges.

#include <blockflow/core/tensor.hpp>
#include <blockflow/channel/wire_format.hpp>
#include <blockflow/channel/detail/zmq_calls.hpp>
#include <blockflow/core/detail/clock.hpp>

#include <ATen/core/Tensor.h>
#include <absl/status/status.h>
#include <zmq.hpp>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace blockflow::detail {

// The reply that fails request `id`'s node `node` with `status` (its message cut to the wire's bound).
inline wire::Header error_header(std::uint64_t id, std::uint32_t node, const absl::Status& status) {
  wire::Header h;
  h.kind = wire::MessageKind::kError;
  h.request_id = id;
  h.node = node;
  h.status_code = static_cast<std::int32_t>(status.code());
  h.message = std::string(status.message()).substr(0, wire::kMaxMessageBytes);
  return h;
}

// One reply on its way back to the host.
struct Reply {
  Reply(wire::Header h, Tensors t = {}, std::vector<std::string> refs = {})
      : header(std::move(h)), tensors(std::move(t)), references(std::move(refs)) {}
  wire::Header header;
  Tensors tensors;
  // Parked outputs (direct edges): one kParkedRefBytes id per tensor, sent instead of its bytes.
  std::vector<std::string> references;
};

// Direct edges (channel "zmq"): outputs that the host asked us to keep, by id, until it says which
// worker takes them (kForward) or that nobody will (kDrop). Bounded: beyond max_count entries or
// max_bytes, outputs go back to the host as usual; an output nobody asked for within kExpiry (a
// lost drop) is forgotten. Ids start at a random base, so that a message meant for an earlier
// process of this worker matches nothing here.
class ParkedOutputs {
 public:
  static constexpr std::int64_t kExpiryNs = 30'000'000'000;
  ParkedOutputs() : next_id_((static_cast<std::uint64_t>(std::random_device{}()) << 32) | 1) {}
  void set_limits(std::size_t max_count, std::uint64_t max_bytes) {
    std::lock_guard lock(mu_);
    max_count_ = max_count;
    max_bytes_ = max_bytes;
  }
  // Keeps all of `outputs` (contiguous CPU tensors) and returns their ids, or nothing (no room).
  std::optional<std::vector<std::uint64_t>> park(const Tensors& outputs) {
    std::uint64_t bytes = 0;
    for (const auto& t : outputs) {
      if (!t.defined() || !t.device().is_cpu() || !t.is_contiguous()) return std::nullopt;
      bytes += t.nbytes();
    }
    std::lock_guard lock(mu_);
    const std::int64_t now = now_ns();
    while (!by_id_.empty() && by_id_.begin()->second.parked_ns < now - kExpiryNs) {  // ids grow with time
      bytes_ -= by_id_.begin()->second.tensor.nbytes();
      by_id_.erase(by_id_.begin());
    }
    if (outputs.empty() || by_id_.size() + outputs.size() > max_count_ || bytes_ + bytes > max_bytes_) return std::nullopt;
    std::vector<std::uint64_t> ids;
    for (const auto& t : outputs) {
      ids.push_back(next_id_++);
      by_id_.emplace(ids.back(), Entry{t, now});
    }
    bytes_ += bytes;
    return ids;
  }
  // The tensors of `ids`, taken out (release) or left in place; nothing if one is unknown.
  std::optional<Tensors> get(const std::vector<std::uint64_t>& ids, bool release) {
    std::lock_guard lock(mu_);
    Tensors out;
    for (const auto id : ids) {
      auto it = by_id_.find(id);
      if (it == by_id_.end()) return std::nullopt;
      out.push_back(it->second.tensor);
    }
    if (release) drop_locked(ids);
    return out;
  }
  void drop(const std::vector<std::uint64_t>& ids) {
    std::lock_guard lock(mu_);
    drop_locked(ids);
  }
  // The outputs a reply's reference frames name (wire::encode_parked_ids()): the host never got
  // that reply, so it will neither forward nor drop them.
  void drop_referenced(const std::vector<std::string>& references) {
    for (const auto& frame : references) {
      if (auto ids = wire::decode_parked_ids(frame.data(), frame.size()); ids.ok()) drop(*ids);
    }
  }

 private:
  void drop_locked(const std::vector<std::uint64_t>& ids) {
    for (const auto id : ids) {
      auto it = by_id_.find(id);
      if (it == by_id_.end()) continue;
      bytes_ -= it->second.tensor.nbytes();
      by_id_.erase(it);
    }
  }
  struct Entry {
    at::Tensor tensor;
    std::int64_t parked_ns = 0;
  };
  std::mutex mu_;
  std::map<std::uint64_t, Entry> by_id_;
  std::uint64_t next_id_ = 1, bytes_ = 0, max_bytes_ = 0;
  std::size_t max_count_ = 0;
};

// Replies on their way to the one PUSH socket, in the order they are handed in. The thread that
// hands one in sends it itself when the socket is free, no reply waits before it and the socket
// takes it at once (no wake-up of the sending thread on the way back: one fewer per block run);
// otherwise it queues it for the thread that owns the socket, which sends the queued ones in order
// and is the only one that waits for the socket.
class ReplyQueue {
 public:
  // Sends one reply; `wait` false: returns false, having sent nothing, if the socket would block.
  using Send = std::function<bool(Reply&, bool wait)>;

  // The sending thread, once its socket exists: `send` sends one reply on it, with the send lock
  // held (by whichever thread calls it). detach() before the socket goes.
  // `dropped` (if given) is told of a reply the sending thread had to drop (its socket failed).
  using Dropped = std::function<void(Reply&)>;
  void attach(Send send, Dropped dropped = nullptr) {
    std::lock_guard sending(send_mu_);
    send_ = std::move(send);
    dropped_ = std::move(dropped);
  }
  void detach() {
    std::lock_guard sending(send_mu_);
    send_ = nullptr;
  }

  void push(Reply&& r) {
    // Counted before anything else: a reply handed in meanwhile sees this one and queues behind it.
    const bool first = pending_.fetch_add(1) == 0;
    // With none pending, nobody holds the send lock across a send (the count falls only after the
    // lock is let go): waiting for it is short, and keeps this one ahead of any handed in meanwhile.
    std::unique_lock sending(send_mu_, std::defer_lock);
    if (first) sending.lock();
    if (first && send_) {  // replies handed in meanwhile queue behind this one
      try {
        if (send_(r, /*wait=*/false)) {
          sending.unlock();
          pending_.fetch_sub(1);
          return;
        }
      } catch (...) {  // (out of memory, say) the sending thread tries again, waiting
      }
    }
    {
      // Still holding the send lock if it was taken: the sending thread pops nothing before this one.
      std::lock_guard lock(mu_);
      if (closed_) {  // the sending thread is gone: nobody would send it
        pending_.fetch_sub(1);
        return;
      }
      if (first) queue_.push_front(std::move(r));
      else queue_.push_back(std::move(r));
    }
    cv_.notify_one();
  }

  // The sending thread: waits for the next queued reply and sends it; false once closed and empty.
  bool send_next() {
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return closed_ || !queue_.empty(); });
      if (queue_.empty()) return false;
    }
    {
      // The send lock first: a reply being sent directly came first, and one that could not be is
      // put at the front before that lock is let go.
      std::lock_guard sending(send_mu_);
      std::optional<Reply> r;
      {
        std::lock_guard lock(mu_);
        r = std::move(queue_.front());  // only this thread pops
        queue_.pop_front();
      }
      try {
        if (send_ && !detail::unless_interrupted([&] {
              (void)send_(*r, /*wait=*/true);
              return true;
            })) {
          std::lock_guard lock(mu_);  // a signal handler ran on this thread: the same reply goes next
          queue_.push_front(std::move(*r));
          return true;
        }
      } catch (const zmq::error_t&) {
        // The socket cannot send any more (its context is ending): the reply is dropped, counted
        // out of pending as sent ones are.
        if (dropped_) dropped_(*r);
      } catch (...) {  // (out of memory, say) dropped, and what it parked with it
        if (dropped_) dropped_(*r);
      }
    }
    pending_.fetch_sub(1);
    return true;
  }

  void close() {
    {
      std::lock_guard lock(mu_);
      closed_ = true;
    }
    cv_.notify_all();
  }

  // Handed in and not yet sent.
  int pending() const { return pending_.load(); }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Reply> queue_;
  bool closed_ = false;
  std::mutex send_mu_;  // whoever sends on the socket holds it
  Send send_;
  Dropped dropped_;
  std::atomic<int> pending_{0};  // handed in and not yet sent: queued, or being sent
};

}  // namespace blockflow::detail
