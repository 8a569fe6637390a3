#pragma once
// Internal: ZeroMQ's waiting calls as every thread of BlockFlow makes them. A call that waits
// returns EINTR when a signal handler runs on its thread (an application's SIGINT or SIGTERM
// handler may run on any thread that does not block them), which cppzmq throws: here an
// interrupted call reads as one that found nothing, and the caller's loop looks again.

#include <absl/time/time.h>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <iterator>
#include <limits>
#include <optional>
#include <vector>

namespace blockflow::detail {

/// How long one wait inside a longer one may last: `left` rounded up to a millisecond, at most
/// `slice_ms` (an infinite `left` included: the waiting thread still wakes to notice a close or a
/// stop). Never negative: ZeroMQ and poll(2) read a negative timeout as "for ever".
inline int poll_slice_ms(absl::Duration left, int slice_ms) {
  if (left >= absl::Milliseconds(slice_ms)) return slice_ms;
  return left <= absl::ZeroDuration() ? 0 : static_cast<int>(absl::ToInt64Milliseconds(left)) + 1;
}

/// Runs `send`, a ZeroMQ send that returns whether it sent (false: it would block): its answer, or
/// nullopt when a signal interrupted it (the caller sends the same message again). Other ZeroMQ
/// errors are thrown.
template <typename Send>
std::optional<bool> unless_interrupted(Send&& send) {
  try {
    return static_cast<bool>(send());
  } catch (const zmq::error_t& e) {
    if (e.num() != EINTR) throw;
    return std::nullopt;
  }
}

/// zmq::poll() over `count` items; interrupted, it returns with no item ready.
inline void poll_items(zmq::pollitem_t* items, std::size_t count, std::chrono::milliseconds timeout) {
  try {
    zmq::poll(items, count, timeout);
  } catch (const zmq::error_t& e) {
    if (e.num() != EINTR) throw;
    for (std::size_t i = 0; i < count; ++i) items[i].revents = 0;
  }
}

inline void poll_items(std::vector<zmq::pollitem_t>& items, std::chrono::milliseconds timeout) {
  poll_items(items.data(), items.size(), timeout);
}

enum class Receipt { kNothing, kMessage, kTooManyFrames };

/// One message of `socket` into `frames`, keeping at most its first `max_frames` parts: the rest
/// of a longer message is read to its end and dropped (kTooManyFrames; ZeroMQ delivers a multipart
/// message whole, so nothing waits). Parts are bounded in size by ZMQ_MAXMSGSIZE, not in number:
/// this keeps what a reply sends back (routing frames) and what the caller holds bounded, though
/// libzmq itself held the whole message. kNothing when nothing came (dontwait) or the wait was
/// interrupted.
inline Receipt receive_frames_at_most(zmq::socket_t& socket, std::vector<zmq::message_t>& frames, std::size_t max_frames,
                                      zmq::recv_flags flags = zmq::recv_flags::none) {
  zmq::message_t part;
  try {
    if (!socket.recv(part, flags)) return Receipt::kNothing;
  } catch (const zmq::error_t& e) {
    if (e.num() != EINTR) throw;
    return Receipt::kNothing;
  }
  bool over = false;
  while (true) {
    const bool more = part.more();
    if (frames.size() < max_frames) {
      frames.push_back(std::move(part));
    } else {
      over = true;
    }
    if (!more) return over ? Receipt::kTooManyFrames : Receipt::kMessage;
    part = zmq::message_t();
    while (true) {  // the rest is there already; a signal only interrupts the call
      try {
        (void)socket.recv(part, zmq::recv_flags::none);
        break;
      } catch (const zmq::error_t& e) {
        if (e.num() != EINTR) throw;
      }
    }
  }
}

/// One message into `frames`, whole; false when nothing came (timeout, dontwait) or the wait was
/// interrupted.
inline bool receive_frames(zmq::socket_t& socket, std::vector<zmq::message_t>& frames,
                           zmq::recv_flags flags = zmq::recv_flags::none) {
  return receive_frames_at_most(socket, frames, std::numeric_limits<std::size_t>::max(), flags) == Receipt::kMessage;
}

}  // namespace blockflow::detail
