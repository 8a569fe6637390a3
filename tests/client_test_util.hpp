// Helpers of the client endpoint's tests: a task whose requests stay inside the session until a
// latch opens, and submit headers as a raw client writes them.
#pragma once

#include "test_util.hpp"

#include <blockflow/channel/wire_format.hpp>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace blockflow::test {

// Task "held": its block waits on the latch, so that requests stay inside the session.
inline void serve_held(Session& session, Latch& latch) {
  auto held = unary("held", [&latch](const Tensor& x) {
    ++latch.entered;
    latch.wait();
    return x;
  });
  session.add_block(held).add_path(Path::chain("held", {"held"}));
  require_started(session);
}

// A submit header for task `task` and one float32 tensor of `floats` elements, as bytes.
inline std::string submit_header(std::uint64_t id, const std::string& task, std::int64_t floats = 2) {
  wire::Header h;
  h.kind = wire::MessageKind::kSubmit;
  h.request_id = id;
  h.target = task;
  wire::TensorDesc d;
  d.dtype = wire::DType::kFloat32;
  d.shape = {floats};
  d.strides = {1};
  d.byte_count = static_cast<std::uint64_t>(floats) * 4;
  h.tensors.push_back(d);
  return wire::encode_header(h);
}

// The header of the next reply on a raw client's `socket`, if one comes within `within`.
inline std::optional<wire::Header> next_reply(zmq::socket_t& socket, std::chrono::milliseconds within) {
  zmq::pollitem_t item{socket.handle(), 0, ZMQ_POLLIN, 0};
  zmq::poll(&item, 1, within);
  if ((item.revents & ZMQ_POLLIN) == 0) return std::nullopt;
  std::vector<zmq::message_t> frames;
  (void)zmq::recv_multipart(socket, std::back_inserter(frames));
  auto h = wire::decode_header(frames.at(0).data(), frames.at(0).size());
  REQUIRE(h.ok());
  return *h;
}

}  // namespace blockflow::test
