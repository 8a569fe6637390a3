// The receiver thread of a WorkerSite: results from the worker (data link or ZeroMQ), their
// delivery to the session, errors, and malformed frames.
#include "worker_site_impl.hpp"

namespace blockflow {

absl::StatusOr<at::Tensor> WorkerSite::Impl::make_placeholder(const wire::TensorDesc& desc, std::uint64_t id, at::ScalarType type) {
  auto* ref = new ParkedRef;
  ref->owner = self;
  ref->id = id;
  {
    std::lock_guard lock(mu);
    ref->pid = pid;
    ++parked_results;
  }
  c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<std::size_t>(desc.byte_count),
                       c10::DataPtr(ref, ref, &delete_parked, c10::Device(c10::kMeta)), nullptr, false);
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::Meta),
                                                    c10::scalarTypeToTypeMeta(type));
  t.unsafeGetTensorImpl()->set_sizes_and_strides(desc.shape, desc.strides);
  return t;
}

void WorkerSite::Impl::complete_error(std::uint64_t id, std::uint32_t node, absl::Status why, bool site_failure) {
  std::weak_ptr<Impl> via;
  {
    std::lock_guard lock(mu);
    auto it = in_flight.find({id, node});
    if (it == in_flight.end()) return;
    via = it->second.via;
    in_flight.erase(it);
    if (site_failure) ++failed_requests;
  }
  wake();
  forget_vias({{{id, node}, via}});
  fail_all({{id, node}}, why);
}

void WorkerSite::Impl::receiver_main() {
  name_thread("rcv");
  while (true) {
    {
      std::lock_guard lock(mu);
      if (stopping) return;
    }
    if (listener) {
      receive_from_link();
      continue;
    }
    if (joined()) move_data_socket(pull, result_endpoint, pull_epoch);
    std::vector<zmq::message_t> frames;
    if (!detail::receive_frames(pull, frames)) continue;  // timeout
    handle_frames(std::move(frames));
  }
}

void WorkerSite::Impl::receive_from_link() {
  std::shared_ptr<detail::ZeroCopyLink> current;
  {
    std::lock_guard lock(mu);
    current = link;
  }
  // A packet now, or within the spin; else sleep on both the link and the listener. Busy polling
  // (WorkerOptions::busy_poll) polls the link for 10 ms at a time and only looks at the listener.
  using Kind = detail::ZeroCopyLink::Packet::Kind;
  detail::ZeroCopyLink::Packet packet;
  const bool busy = options.busy_poll && current;
  if (current) {
    packet = current->read(busy ? 10 : 0, busy ? absl::InfiniteDuration() : options.receive_spin,
                           peer.empty() ? nullptr : &parked_resolver);
  }
  if (packet.kind == Kind::kNothing) {
    pollfd items[2] = {{listener->poll_fd(), POLLIN, 0}, {current ? current->fd() : -1, POLLIN, 0}};
    if (::poll(items, 2, busy ? 0 : 100) <= 0) return;
    if ((items[0].revents & POLLIN) != 0) accept_link();
    if (!current || items[1].revents == 0) return;
    packet = current->read(0, absl::ZeroDuration(), peer.empty() ? nullptr : &parked_resolver);
  }
  switch (packet.kind) {
    case Kind::kNothing:
      return;
    case Kind::kClosed: {  // the worker is going away; supervision tells how (or kills it)
      std::lock_guard lock(mu);
      if (pid > 0) current->peer_died(pid);  // its pools, for the workers its results were relayed to
      if (link == current) {
        link.reset();
        link_lost_ns = detail::now_ns();
      }
      return;
    }
    case Kind::kMalformed:
      return on_malformed(packet.request_id, packet.malformed);
    case Kind::kMessage:
      return deliver(std::move(packet.message));
  }
}

void WorkerSite::Impl::accept_link() {
  while (auto accepted = listener->accept()) {
    std::unique_lock lock(mu);
    if (accepted->peer_pid == 0 || accepted->peer_pid != pid || joined()) {
      ++malformed;
      const pid_t expected = pid;
      lock.unlock();
      noisy.log(LogLevel::kWarning, fmt::format("{}: data link connection from pid {} refused (the worker is pid {})",
                                                 prefix(), accepted->peer_pid, expected));
      continue;
    }
    if (link) {
      // The worker connects once; a second connection from its pid (a plugin's code, say) would
      // drop the live link and what is on it: refused, the live one kept.
      ++malformed;
      lock.unlock();
      noisy.log(LogLevel::kWarning, fmt::format("{}: a second data link connection from the worker (pid {}) refused: its "
                                                 "link is live", prefix(), accepted->peer_pid));
      continue;
    }
    link = std::make_shared<detail::ZeroCopyLink>(std::move(accepted->link), ends);
    become_ready_locked();
    lock.unlock();
    wake();
  }
  if (auto unaccepted = listener->error(); !unaccepted.ok()) {  // tried again after a back-off
    noisy.log(LogLevel::kWarning, fmt::format("{}: {}", prefix(), std::string(unaccepted.message())));
  }
}

void WorkerSite::Impl::handle_frames(std::vector<zmq::message_t>&& frames) {
  std::optional<std::uint64_t> id;
  if (!frames.empty()) id = wire::peek_request_id(frames[0].data(), frames[0].size());
  auto decoded = detail::decode_message(std::move(frames), nullptr, peer.empty() ? nullptr : &parked_resolver);
  if (!decoded.ok()) return on_malformed(id, decoded.status());
  if (decoded->header.kind == wire::MessageKind::kRelease) {
    return on_malformed(std::nullopt, absl::InvalidArgumentError("a release on channel 'zmq', which has no shared memory"));
  }
  deliver(std::move(*decoded));
}

void WorkerSite::Impl::on_malformed(std::optional<std::uint64_t> id, const absl::Status& why) {
  std::vector<std::pair<std::uint64_t, std::uint32_t>> affected;
  std::vector<std::pair<Key, std::weak_ptr<Impl>>> vias;
  {
    std::lock_guard lock(mu);
    ++malformed;
    if (id) {
      for (auto it = in_flight.begin(); it != in_flight.end();) {
        if (it->first.first == *id) {
          affected.push_back(it->first);
          if (!it->second.via.expired()) vias.emplace_back(it->first, it->second.via);
          in_flight.erase(it++);
        } else {
          ++it;
        }
      }
    }
  }
  if (!affected.empty()) wake();  // room in flight: a request waiting for it goes now
  forget_vias(vias);
  noisy.log(LogLevel::kWarning, fmt::format("{}: malformed result frame dropped: {}", prefix(), std::string(why.message())));
  fail_all(std::move(affected),
           absl::DataLossError(fmt::format("{} sent a malformed result: {}", prefix(), std::string(why.message()))));
}

void WorkerSite::Impl::deliver(detail::DecodedMessage&& message) {
  const auto& h = message.header;
  std::weak_ptr<Impl> via;
  {
    std::unique_lock lock(mu);
    auto it = in_flight.find({h.request_id, h.node});
    if (it == in_flight.end()) {
      // Not ours: already failed (worker declared dead), or a request whose parked input our
      // worker could not forward: that error belongs to the site that runs the request.
      auto f = pending_forwards.find({h.request_id, h.node});
      if (f == pending_forwards.end() || h.kind != wire::MessageKind::kError) return;
      auto consumer = f->second.lock();
      pending_forwards.erase(f);
      lock.unlock();
      if (consumer) {
        const auto code = static_cast<absl::StatusCode>(h.status_code == 0 ? 13 : h.status_code);
        consumer->complete_error(h.request_id, h.node, absl::Status(code, fmt::format("{}: {}", prefix(), h.message)),
                                 /*site_failure=*/true);
      }
      return;
    }
    via = it->second.via;
    in_flight.erase(it);
    ++received;
  }
  wake();
  if (!via.expired()) forget_vias({{{h.request_id, h.node}, via}});
  SiteCompletion c;
  c.request_id = h.request_id;
  c.node = h.node;
  // The worker's clock may not be ours (another host): keep its durations, anchor them at the
  // moment the reply arrived, so the transfer back counts as overhead.
  const std::int64_t received_ns = detail::now_ns();
  if (h.times.sent_ns >= h.times.compute_end_ns && h.times.compute_end_ns >= h.times.compute_start_ns &&
      h.times.compute_start_ns > 0) {
    c.compute_end_ns = received_ns - (h.times.sent_ns - h.times.compute_end_ns);
    c.compute_start_ns = c.compute_end_ns - (h.times.compute_end_ns - h.times.compute_start_ns);
  }
  c.wait_ns = std::max<std::int64_t>(0, h.times.dequeued_ns - h.times.arrived_ns);
  if (h.kind == wire::MessageKind::kResult) {
    c.outputs = std::move(message.tensors);
  } else {
    const auto code = static_cast<absl::StatusCode>(h.status_code == 0 ? 13 : h.status_code);
    c.outputs = absl::Status(code, fmt::format("{}: {}", prefix(), h.message));
  }
  done(std::move(c));
}

}  // namespace blockflow
