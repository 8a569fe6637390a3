// The sender thread of a WorkerSite: requests to the worker (zero-copy handles over the data link,
// or ZeroMQ frames) and the direct edges' forwards and drops. (Releases of the worker's slots leave
// from whichever thread their tensor dies on: detail::ZeroCopyLink.)
#include "worker_site_impl.hpp"

#include <tuple>

namespace blockflow {

void WorkerSite::Impl::fail_forwarded(const std::vector<std::pair<Key, std::weak_ptr<Impl>>>& forwarded, const absl::Status& why) {
  for (const auto& [key, consumer] : forwarded) {
    if (auto c = consumer.lock()) {
      c->complete_error(key.first, key.second,
                        absl::Status(why.code(), fmt::format("its input was parked in {}: {}", prefix(), std::string(why.message()))),
                        /*site_failure=*/true);
    }
  }
}

void WorkerSite::Impl::forget_vias(const std::vector<std::pair<Key, std::weak_ptr<Impl>>>& vias) {
  for (const auto& [key, via] : vias) {
    if (auto v = via.lock()) {
      std::lock_guard lock(v->mu);
      v->pending_forwards.erase(key);
    }
  }
}

void WorkerSite::Impl::queue_drop(std::uint64_t id, pid_t holder) {
  {
    std::lock_guard lock(drops_mu);
    drops.emplace_back(id, holder);
  }
  drops_pending.store(true, std::memory_order_release);
  wake();
}

absl::Status WorkerSite::Impl::enqueue_forward(Forward&& f, pid_t holder, std::weak_ptr<Impl> consumer) {
  // Sent from this thread when nobody sends on `push` and no kForward waits before this one: the
  // sender thread's wake-up is not on the request's way. Otherwise queued for the sender thread.
  std::unique_lock sending(push_mu, std::try_to_lock);
  const Key key{f.header.request_id, f.header.node};
  {
    std::lock_guard lock(mu);
    if (stopping || pid != holder || state != State::kReady) {
      return absl::UnavailableError(fmt::format("{}, which held it, {}", prefix(),
                                                stopping ? "stopped" : pid != holder ? "restarted" : "is down"));
    }
    pending_forwards[key] = std::move(consumer);
    f.holder = holder;
    if (!sending.owns_lock() || !forwards.empty()) {
      forwards.push_back(std::move(f));
      sending = {};
    }
  }
  if (!sending.owns_lock()) {
    wake();
    return absl::OkStatus();
  }
  absl::Status status;
  if (!send_forward(f, holder, status)) {  // full: first in line for the sender thread
    std::unique_lock lock(mu);
    if (!stopping) {
      forwards.push_front(std::move(f));
      lock.unlock();
      sending.unlock();
      wake();
      return absl::OkStatus();
    }
    status = absl::UnavailableError("the site stopped");  // stop() has taken the sender thread's queue
  }
  sending.unlock();
  {
    std::lock_guard lock(mu);
    if (status.ok()) ++forwards_sent;
    else pending_forwards.erase(key);
  }
  if (status.ok()) return status;
  unconsume(f);
  // The caller fails its request (after its turn: the report may run a callback that submits).
  return forward_failed(status);
}

bool WorkerSite::Impl::send_forward(Forward& f, pid_t live, absl::Status& status) {
  if (f.holder != live || live == 0) {
    status = absl::UnavailableError(fmt::format("{} restarted or stopped", prefix()));
    return true;
  }
  try {
    auto sent = detail::send_references(push, f.header, f.described, f.references, zmq::send_flags::dontwait);
    if (!sent.ok()) status = sent.status();
    return !sent.ok() || *sent;
  } catch (const zmq::error_t& e) {
    status = absl::UnavailableError(e.what());
    return true;
  }
}

void WorkerSite::Impl::unconsume(const Forward& f) {
  if ((f.header.flags & wire::kFlagReleaseAfter) == 0) return;
  for (const auto& t : f.described) {  // not sent: the worker still holds them
    if (ParkedRef* ref = parked_ref_of(t)) ref->consumed.store(false, std::memory_order_release);
  }
}

void WorkerSite::Impl::send_direct_edge_messages() {
  std::unique_lock sending(push_mu);  // after a kForward being sent directly (enqueue_forward())
  std::deque<Forward> now;
  // Failed forwards, reported once push_mu is let go: a report runs callbacks, which may route
  // another request through this site.
  std::vector<std::tuple<std::shared_ptr<Impl>, Key, absl::Status>> failed;
  pid_t live = 0;
  {
    std::lock_guard lock(mu);
    now.swap(forwards);
    live = pid;
  }
  while (!now.empty()) {
    Forward& f = now.front();
    absl::Status status;
    if (!send_forward(f, live, status)) {  // full: keep the order, try again shortly
      std::lock_guard lock(mu);
      while (!now.empty()) {
        forwards.push_front(std::move(now.back()));
        now.pop_back();
      }
      break;
    }
    std::shared_ptr<Impl> consumer;
    {
      std::lock_guard lock(mu);
      if (status.ok()) ++forwards_sent;
      if (!status.ok()) {
        auto it = pending_forwards.find({f.header.request_id, f.header.node});
        if (it != pending_forwards.end()) {
          consumer = it->second.lock();
          pending_forwards.erase(it);
        }
      }
    }
    if (!status.ok()) unconsume(f);
    const Key key{f.header.request_id, f.header.node};
    now.pop_front();  // placeholders die here (drops queued unless consumed)
    if (consumer) {
      failed.emplace_back(std::move(consumer), key, forward_failed(status));
    }
  }
  bool blocked = false;
  {
    std::lock_guard lock(mu);
    blocked = !forwards.empty();
  }
  sending.unlock();  // a direct sender meanwhile finds `forwards` non-empty (if blocked) and queues behind them
  for (auto& [consumer, key, why] : failed) consumer->complete_error(key.first, key.second, std::move(why), /*site_failure=*/true);
  if (blocked) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (!drops_pending.exchange(false, std::memory_order_acq_rel)) return;
  sending.lock();
  std::vector<std::pair<std::uint64_t, pid_t>> taken;
  {
    std::lock_guard lock(drops_mu);
    taken.swap(drops);
  }
  std::vector<std::uint64_t> ids;
  for (const auto& [id, holder] : taken) {
    if (holder == live && live != 0) ids.push_back(id);
  }
  constexpr std::size_t kIdsPerMessage = wire::kMaxMessageBytes / wire::kParkedRefBytes;
  for (std::size_t at = 0; at < ids.size(); at += kIdsPerMessage) {
    wire::Header h;
    h.kind = wire::MessageKind::kDrop;
    h.message = wire::encode_parked_ids(
        {ids.begin() + static_cast<std::ptrdiff_t>(at), ids.begin() + static_cast<std::ptrdiff_t>(std::min(ids.size(), at + kIdsPerMessage))});
    try {
      auto sent = detail::send_message(push, h, {}, zmq::send_flags::dontwait);
      if (!sent.ok() || !*sent) return;  // full: the worker lets its outputs expire
    } catch (const zmq::error_t&) {
      return;  // the worker is going away; its parked outputs with it
    }
    std::lock_guard lock(mu);
    ++drops_sent;
  }
}

void WorkerSite::Impl::sender_main() {
  name_thread("snd");
  while (true) {
    if (joined()) {
      std::lock_guard sending(push_mu);
      move_data_socket(push, request_endpoint, push_epoch);
    }
    Outbound next;
    const detail::ShmStager* stager_of_next = nullptr;
    std::shared_ptr<detail::ZeroCopyLink> to;
    {
      std::unique_lock lock(mu);
      auto ready = [&] {
        // A zero-copy site whose data link just closed waits with its queue (for the worker's
        // death or its restart) rather than failing the next request for want of a link.
        return stopping ||
               (!outbound.empty() && state == State::kReady && (!shm() || link) &&
                in_flight.size() < options.max_in_flight) ||
               !forwards.empty() || drops_pending.load(std::memory_order_acquire);
      };
      if (stopping) return;
      if (!ready()) {
        // Asleep until something rings: run(), a state change, a reply (room in flight) or a drop
        // (its deleter runs anywhere and rings without mu).
        lock.unlock();
        doorbell.wait(std::chrono::milliseconds(1000));
        continue;
      }
      if (!forwards.empty() || drops_pending.load(std::memory_order_acquire)) {
        lock.unlock();
        send_direct_edge_messages();
        continue;
      }
      next = std::move(outbound.front());
      outbound.pop_front();
      stager_of_next = admit_locked(next, to);
    }
    wake();  // room in outbound for run()
    transmit(std::move(next), stager_of_next, to);
  }
}

bool WorkerSite::Impl::can_send_now_locked() const {
  return shm() && link && outbound.empty() && state == State::kReady && in_flight.size() < options.max_in_flight;
}

const detail::ShmStager* WorkerSite::Impl::admit_locked(Outbound& next, std::shared_ptr<detail::ZeroCopyLink>& to) {
  in_flight[{next.envelope.request_id, next.envelope.node}] = {next.block, next.parked.site};
  std::shared_ptr<Turns>& turns_of_block = turns[next.block];
  if (!turns_of_block) turns_of_block = std::make_shared<Turns>();
  next.turns = turns_of_block;
  next.turn = turns_of_block->next++;
  ++sent;
  to = link;
  return shm() ? stager_for(next.block) : nullptr;  // `blocks` changes with update()
}

void WorkerSite::Impl::transmit(Outbound&& next, const detail::ShmStager* stager, const std::shared_ptr<detail::ZeroCopyLink>& to) {
  Turns& turns_of_block = *next.turns;
  if (turns_of_block.serving.load(std::memory_order_acquire) != next.turn) {  // one admitted before is being sent
    std::unique_lock lock(turn_mu);
    turn_cv.wait(lock, [&] { return turns_of_block.serving.load(std::memory_order_acquire) == next.turn; });
  }
  struct NextTurn {  // once sent, or however this returns
    Impl& site;
    Turns& turns;
    bool given = false;
    void give() {
      if (std::exchange(given, true)) return;
      {
        std::lock_guard lock(site.turn_mu);
        turns.serving.fetch_add(1, std::memory_order_acq_rel);
      }
      site.turn_cv.notify_all();
    }
    ~NextTurn() { give(); }
  } next_turn{*this, turns_of_block};
  wire::Header header;
  header.kind = wire::MessageKind::kData;
  header.request_id = next.envelope.request_id;
  header.node = next.envelope.node;
  header.target = next.block;
  header.times.sent_ns = detail::now_ns();
  absl::Status status;
  std::uint64_t copied = 0;
  if (shm()) {
    status = to ? to->send(header, next.envelope.tensors, stager, /*wait=*/true, &copied)
                : absl::UnavailableError("its data link is down");
  } else if (next.parked.any) {
    // Not on `push`: this may be any thread (try_run()).
    auto owner = next.parked.site.lock();
    status = owner ? forward_from(*owner, next.parked.holder, std::move(header), std::move(next.envelope))
                   : absl::UnavailableError("its input is parked in a worker that is gone, or split between workers");
  } else {
    if (next.envelope.outputs_may_stay && !peer.empty()) header.flags |= wire::kFlagParkOutputs;
    // With no worker connected (it died and supervision has not noticed yet) a send waits up to
    // kPushTimeoutMs (ZMQ_SNDTIMEO) at a time. It gives up once the request is no longer ours to
    // send (the worker's death failed it) or the site stops: a worker that will not come back
    // never holds stop() up. (A restarted worker that connects during the try in progress may
    // still get that one request; its reply then matches nothing and is dropped.)
    const Key key{header.request_id, header.node};
    auto encoded = detail::encode_for_socket(header, next.envelope.tensors, &copied, stager);  // once, whatever the tries
    if (!encoded.ok()) status = encoded.status();
    while (encoded.ok()) {
      try {
        std::lock_guard sending(push_mu);  // one try at a time: kForwards may go between them
        if (detail::send_encoded(push, *encoded, zmq::send_flags::none)) break;
      } catch (const zmq::error_t& e) {
        status = absl::UnavailableError(e.what());
        break;
      }
      std::lock_guard lock(mu);
      if (stopping || in_flight.find(key) == in_flight.end()) {
        status = absl::UnavailableError("no worker took it before the site stopped");
        break;
      }
    }
  }
  // Given back before a failure is reported: the report may run the application's callback, which
  // may submit again and wait for room that this block's next request (waiting for this turn) makes.
  next_turn.give();
  if (copied > 0) {
    std::lock_guard lock(mu);
    bytes_copied += copied;
  }
  if (!status.ok()) {
    complete_error(next.envelope.request_id, next.envelope.node,
                   absl::Status(status.code(), fmt::format("{}: block '{}': cannot send: {}", prefix(), next.block,
                                                           std::string(status.message()))),
                   /*site_failure=*/true);
  }
}

absl::Status WorkerSite::Impl::forward_from(Impl& owner, pid_t holder, wire::Header header, Envelope&& envelope) {
  if (peer.empty()) return absl::FailedPreconditionError("its input is parked in another worker, and this one takes no direct edges");
  header.kind = wire::MessageKind::kForward;
  header.message = peer;
  header.times.sent_ns = 0;
  if (envelope.outputs_may_stay) header.flags |= wire::kFlagParkOutputs;
  Forward f;
  // Nobody else holds these placeholders: the worker may forget the outputs once sent.
  bool last = true;
  for (const auto& t : envelope.tensors) last = last && t.use_count() == 1 && t.storage().use_count() == 1;
  for (const auto& t : envelope.tensors) {
    ParkedRef* ref = parked_ref_of(t);
    f.references.push_back(wire::encode_parked_ids({ref->id}));
    if (last) ref->consumed.store(true, std::memory_order_release);
  }
  if (last) header.flags |= wire::kFlagReleaseAfter;
  f.header = std::move(header);
  f.described = std::move(envelope.tensors);
  const Key key{f.header.request_id, f.header.node};
  auto status = owner.enqueue_forward(std::move(f), holder, self);
  if (status.ok()) {
    // Failed meanwhile (our worker died after admitting it): the owner need not remember it.
    bool gone = false;
    {
      std::lock_guard lock(mu);
      gone = in_flight.count(key) == 0;
    }
    if (gone) forget_vias({{key, owner.self}});
  }
  return status;
}

}  // namespace blockflow
