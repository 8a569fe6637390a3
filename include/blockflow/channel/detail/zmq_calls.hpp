#pragma once
// Internal: ZeroMQ's waiting calls as every thread of BlockFlow makes them. A call that waits
// returns EINTR when a signal handler runs on its thread (an application's SIGINT or SIGTERM
// handler may run on any thread that does not block them), which cppzmq throws: here an
// interrupted call reads as one that found nothing, and the caller's loop looks again.

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <iterator>
#include <vector>

namespace blockflow::detail {

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

/// zmq::recv_multipart() into `frames`; false when nothing came (timeout, dontwait) or the wait
/// was interrupted.
inline bool receive_frames(zmq::socket_t& socket, std::vector<zmq::message_t>& frames,
                           zmq::recv_flags flags = zmq::recv_flags::none) {
  try {
    return zmq::recv_multipart(socket, std::back_inserter(frames), flags).has_value();
  } catch (const zmq::error_t& e) {
    if (e.num() != EINTR) throw;
    frames.clear();
    return false;
  }
}

}  // namespace blockflow::detail
