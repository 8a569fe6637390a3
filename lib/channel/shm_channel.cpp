// shm:// and cuda:// ends: tensors cross as handles to the sender's shared-memory slots (and, over
// cuda://, to its CUDA allocations) over a SEQPACKET data link: the machinery of a worker's "shm"
// and "cuda" channels (zero_copy_link.hpp: one ZeroCopyLink per link), with no session around it. The
// receiver listens in the channel directory; each sender connects, sends kData packets of handles
// and reads kRelease packets back; the receiver's tensors are views of the slots (or of the CUDA
// memory, ordered by the sender's event), and each one's death sends its handle back.
//
// Lifetimes. A receiver's tensors keep their sender's link open (ReleaseOutbox), so a sender takes
// slots back all at once (reclaim) only when that link closes: the receiving process died, or its
// receiver has gone and every tensor it gave out has died. A receiver that closes shuts its links'
// reading side: the senders' next send fails there, and a sender connects to a new receiver only
// once the old one's end has closed. A sender that closes shuts its sending side (the receiver
// still gets what was sent). A sender destroyed while its receiver holds some of what it sent
// leaves that behind (RelayOrphans) until released: tensors it relayed from a third process's slot
// (ZeroCopyEnds), which that process would otherwise reuse, and CUDA tensors, which its caching
// allocator would. Its own slots need nothing: a pool lives while a receiver maps it, or holds its
// descriptor in a packet not read yet.
//
// cuda:// connect-time check: the receiver exports a CUDA probe (a small allocation and an
// interprocess event, cuda_ipc.hpp) into a file beside its socket; a sender opens it when it
// connects, and fails (FailedPrecondition naming the URI and the CUDA error) when it cannot: two
// processes in different PID namespaces, or that see different devices, never fall back to copies.
#include "process_channel_impl.hpp"

#include <blockflow/core/detail/clock.hpp>
#include <blockflow/core/detail/log.hpp>
#include <blockflow/core/detail/mutex.hpp>
#include <blockflow/core/detail/process_state.hpp>
#include <blockflow/channel/detail/packet_link.hpp>
#include <blockflow/channel/detail/tensor_codec.hpp>
#include <blockflow/channel/detail/zero_copy_ends.hpp>
#include <blockflow/channel/detail/zero_copy_link.hpp>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <fstream>
#include <sstream>

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

namespace blockflow::detail {
namespace {

constexpr int kPollMs = 100;

// See "Lifetimes" above: the ends of senders that are gone, each with its link, until the receiver
// has released what it held or its end has closed. A thread of its own reads their releases (every
// kSweepMs) while there are any.
class RelayOrphans {
 public:
  static RelayOrphans& get() {
    static auto* orphans = new RelayOrphans;  // never destroyed: what it holds may live to the end
    return *orphans;
  }
  void adopt(std::shared_ptr<ZeroCopyLink> link) {
    MutexLock lock(&mu_);
    orphans_.push_back({std::move(link)});
    if (sweeping_) return;
    // Ends with the last orphan. Without a thread, the orphans wait for the next adopt().
    sweeping_ = run_detached_until_done([this] { return sweep(); }, absl::Milliseconds(kSweepMs));
  }

 private:
  static constexpr int kSweepMs = 20;
  // False once none is left (and the sweeping thread ends).
  bool sweep() {
    std::vector<Orphan> finished;  // destroyed after the lock is let go: their tensors' releases run then
    MutexLock lock(&mu_);
    auto done_now = std::stable_partition(orphans_.begin(), orphans_.end(), [](const Orphan& o) { return !done(o); });
    std::move(done_now, orphans_.end(), std::back_inserter(finished));
    orphans_.erase(done_now, orphans_.end());
    sweeping_ = !orphans_.empty();
    return sweeping_;
  }

  struct Orphan {
    std::shared_ptr<ZeroCopyLink> link;
  };
  // Reads the releases that came; true once nothing is held any more or the receiver has gone.
  // At most kReadsPerSweep reads a sweep: a receiver that keeps sending cannot hold the sweep (and
  // with it every sender that adopts an orphan meanwhile).
  static bool done(const Orphan& o) {
    constexpr int kReadsPerSweep = 64;
    for (int reads = 0; reads < kReadsPerSweep; ++reads) {
      const auto kind = o.link->read(0).kind;
      if (kind == ZeroCopyLink::Packet::Kind::kClosed) return true;
      if (kind == ZeroCopyLink::Packet::Kind::kNothing) break;
    }
    return !o.link->ends().holds_for_peer();
  }
  Mutex mu_;
  std::vector<Orphan> orphans_ ABSL_GUARDED_BY(mu_);
  bool sweeping_ ABSL_GUARDED_BY(mu_) = false;
};

// ---------------------------------------------------------------------------------------------
class ShmSender final : public ProcessChannel {
 public:
  ShmSender(std::string uri, std::string path, const ProcessChannelOptions& options, bool cuda)
      : uri_(std::move(uri)),
        path_(std::move(path)),
        options_(options),
        ends_(std::make_shared<ZeroCopyEnds>(pools(options), cuda)),
        wake_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
    reader_ = std::thread([this] { read_releases(); });
  }
  ~ShmSender() override {
    close();
    stopping_.store(true);
    const std::uint64_t one = 1;
    (void)!::write(wake_, &one, sizeof(one));
    reader_.join();
    ::close(wake_);
    std::shared_ptr<ZeroCopyLink> link;
    {
      MutexLock lock(&mu_);
      link = link_;
    }
    if (link && ends_->holds_for_peer()) RelayOrphans::get().adopt(std::move(link));
  }

  SendOutcome send(Envelope&& envelope) override {
    const bool wait = options_.full_policy == FullPolicy::kBlock;
    const absl::Time deadline = absl::Now() + (wait ? options_.send_timeout : absl::ZeroDuration());
    absl::Status status;
    while (true) {
      // close() from another thread ends a send that waits, and it never connects again.
      if (closed_.load()) return refused(std::move(envelope), absl::CancelledError(fmt::format("{}: closed", uri_)));
      auto link = ensure_link(deadline);
      if (!link.ok()) return refused(std::move(envelope), link.status());
      // One deadline for the whole send, however many tensors wait for a slot.
      const ShmStager stager = ends_->stager(StageWait::until_deadline(deadline));
      std::uint64_t copied = 0;
      status = (*link)->send(data_header(envelope), envelope.tensors, &stager, wait, &copied);
      if (copied > 0) contiguous_copies_.fetch_add(copied);
      if (status.ok()) break;
      if (status.code() != absl::StatusCode::kUnavailable) break;  // not the link: a slot, a dtype...
      retire(*link);  // the receiver went away or stopped reading: the next one may come before the deadline
      status = absl::OkStatus();  // ensure_link() says why, at the deadline
    }
    if (!status.ok()) {
      if (!wait && status.code() == absl::StatusCode::kDeadlineExceeded) {
        status = absl::ResourceExhaustedError(std::string(status.message()));
      }
      return refused(std::move(envelope), named(uri_, status));
    }
    sent_.fetch_add(1);
    return {};
  }

  std::optional<Envelope> receive(absl::Time) override { return std::nullopt; }
  std::vector<Envelope> drain() override { return {}; }

  void close() override {
    if (closed_.exchange(true)) return;
    std::shared_ptr<ZeroCopyLink> link;
    {
      MutexLock lock(&mu_);
      link = link_;
    }
    if (link) ::shutdown(link->fd(), SHUT_WR);  // the receiver reads what was sent, then the end
    ends_->stop_waiting();                      // a send() waiting for a slot or record ends
    // The reader goes on taking the receiver's releases (flush() waits for them) until the
    // receiver's end closes, or this end is destroyed.
  }
  bool closed() const override { return closed_.load(); }

  ChannelStats stats() const override {
    ChannelStats s;
    s.kind = std::string(kind());
    s.sent = sent_.load();
    s.bytes_copied = contiguous_copies_.load() + ends_->host_stats().bytes_staged;
    return s;
  }
  std::string_view kind() const override { return ends_->cuda() ? "cuda" : "shm"; }

  absl::StatusOr<at::Tensor> empty(at::IntArrayRef sizes, at::ScalarType dtype) override {
    // cuda://: on the current CUDA device, where send() shares it as it lies.
    if (ends_->cuda()) return named(uri_, checked_empty(sizes, dtype, at::kCUDA));
    const absl::Duration wait = options_.full_policy == FullPolicy::kBlock ? options_.send_timeout : absl::ZeroDuration();
    return named(uri_, make_shm_allocator(ends_->host_pool(), wait)(sizes, dtype));
  }
  const std::string& uri() const override { return uri_; }
  ChannelRole role() const override { return ChannelRole::kSender; }
  bool connected() const override {
    MutexLock lock(&mu_);
    return link_ != nullptr && !retiring_;
  }
  ShmEdgeStats shm_stats() const override { return combined(ends_->host_stats(), ends_->cuda_stats()); }
  absl::Status flush(absl::Time deadline) override {
    while (true) {
      const std::uint64_t held = ends_->held_by_peer();
      if (held == 0) return absl::OkStatus();
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(fmt::format("{}: {} slot(s) still held by the receiver", uri_, held));
      }
      absl::SleepFor(absl::Milliseconds(1));
    }
  }

 private:
  static ShmPoolOptions pools(const ProcessChannelOptions& o) {
    ShmPoolOptions p;
    p.slots_per_pool = std::max<std::size_t>(1, o.shm_slots_per_pool);
    p.max_total_bytes = o.shm_max_bytes;
    return p;
  }

  // The current link, or a new one to a receiver that listens now; retried until `deadline`. While
  // the last receiver's end stays open (it stopped reading; its tensors live), no new one: its
  // slots come back one by one, or all at once when that end closes.
  absl::StatusOr<std::shared_ptr<ZeroCopyLink>> ensure_link(absl::Time deadline) {
    while (true) {
      bool retiring = false;
      {
        MutexLock lock(&mu_);
        if (link_ && !retiring_) return link_;
        retiring = link_ != nullptr;
      }
      if (retiring) {
        if (closed_.load()) return absl::CancelledError(fmt::format("{}: closed", uri_));
        if (absl::Now() >= deadline) {
          return absl::Status(options_.full_policy == FullPolicy::kBlock ? absl::StatusCode::kDeadlineExceeded
                                                                         : absl::StatusCode::kUnavailable,
                              fmt::format("{}: the receiver stopped reading (closed, or gone) and still holds {} slot(s); the "
                                          "next receiver is connected once they are back",
                                          uri_, ends_->held_by_peer()));
        }
        absl::SleepFor(absl::Milliseconds(5));
        continue;
      }
      auto link = PacketLink::connect(path_);
      // kBlock: a receiver whose queue stays full holds a send up to send_timeout; else not at all.
      if (link.ok() && options_.full_policy == FullPolicy::kBlock) (*link)->set_send_timeout(options_.send_timeout);
      if (link.ok() && ends_->cuda()) {
        if (auto usable = open_receivers_probe(); !usable.ok()) return usable;  // no fallback: refused
      }
      if (link.ok()) {
        MutexLock lock(&mu_);
        // close() sets closed_ before it reads link_ under mu_: one of the two sees the other.
        if (closed_.load()) {
          ::shutdown((*link)->fd(), SHUT_RDWR);
          return absl::CancelledError(fmt::format("{}: closed", uri_));
        }
        if (!link_) link_ = std::make_shared<ZeroCopyLink>(*std::move(link), ends_);
        return link_;
      }
      if (closed_.load()) return absl::CancelledError(fmt::format("{}: closed", uri_));
      if (absl::Now() >= deadline) {
        return absl::Status(options_.full_policy == FullPolicy::kBlock ? absl::StatusCode::kDeadlineExceeded
                                                                       : absl::StatusCode::kUnavailable,
                            fmt::format("{}: no receiver ({})", uri_, std::string(link.status().message())));
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
  }

  // cuda://: the probe the receiver exported beside its socket must open here.
  absl::Status open_receivers_probe() const {
    std::ifstream in(path_ + ".probe");
    std::stringstream probe;
    probe << in.rdbuf();
    auto status = in ? open_cuda_probe(probe.str()) : absl::NotFoundError("the receiver published no CUDA probe");
    if (status.ok()) return status;
    return absl::FailedPreconditionError(
        fmt::format("{}: the receiver's CUDA memory cannot be opened in this process: {}", uri_, std::string(status.message())));
  }

  // The receiver's end has closed: every slot it held is ours again. Under the lock, so that no
  // handle sent to the next receiver can be taken back by mistake.
  void drop_link(const std::shared_ptr<ZeroCopyLink>& link) {
    {
      MutexLock lock(&mu_);
      if (link_ != link) return;
      link_.reset();
      retiring_ = false;
      ends_->reclaim_all();
    }
    ::shutdown(link->fd(), SHUT_RDWR);
  }

  // A send found that the receiver no longer reads: no more sends on this link; its releases are
  // still read, until its end closes (drop_link()).
  void retire(const std::shared_ptr<ZeroCopyLink>& link) {
    MutexLock lock(&mu_);
    if (link_ == link) retiring_ = true;
  }

  void read_releases() {
    while (!stopping_.load()) {
      std::shared_ptr<ZeroCopyLink> link;
      {
        MutexLock lock(&mu_);
        link = link_;
      }
      std::vector<pollfd> fds = {{wake_, POLLIN, 0}};
      if (link) fds.push_back({link->fd(), POLLIN, 0});
      // Without a link: until send() makes one (closed: one a send made just before may still
      // come, so the reader keeps looking; the destructor wakes it).
      (void)::poll(fds.data(), fds.size(), link || closed_.load() ? kPollMs : 10);
      if ((fds[0].revents & POLLIN) != 0) {
        std::uint64_t woken = 0;
        (void)!::read(wake_, &woken, sizeof(woken));
      }
      if (!link || fds[1].revents == 0) continue;
      auto packet = link->read(0);  // takes the releases; the receiver sends nothing else
      if (packet.kind == ZeroCopyLink::Packet::Kind::kClosed) drop_link(link);
      if (packet.kind == ZeroCopyLink::Packet::Kind::kMalformed) {
        noisy_.log(LogLevel::kWarning, fmt::format("{}: malformed packet from the receiver dropped: {}", uri_,
                                                   std::string(packet.malformed.message())));
      }
    }
  }

  const std::string uri_, path_;
  const ProcessChannelOptions options_;
  const std::shared_ptr<ZeroCopyEnds> ends_;
  const int wake_;  // close() wakes the reader
  mutable Mutex mu_;
  std::shared_ptr<ZeroCopyLink> link_ ABSL_GUARDED_BY(mu_);
  bool retiring_ ABSL_GUARDED_BY(mu_) = false;  // link_'s receiver no longer reads
  std::atomic<bool> closed_{false};
  std::atomic<bool> stopping_{false};  // the destructor: the reader ends
  std::atomic<std::uint64_t> sent_{0}, contiguous_copies_{0};
  RateLimitedLog noisy_;
  std::thread reader_;
};

// ---------------------------------------------------------------------------------------------
// The receiving end has no thread of its own: receive() reads the data links itself (one caller at
// a time; others wait their turn until their deadline), so a hand-off costs one wake-up, and none
// while packets stream (it polls up to `receive_spin` first, as a worker's link does). Packets not
// yet read wait in the kernel's socket buffers, which push back on senders. Tensor deleters send
// the releases straight on their link (ZeroCopyLink's ReleaseOutbox: never blocking), from whatever
// thread they die on.
class ShmReceiver final : public ProcessChannel {
 public:
  ShmReceiver(std::string uri, std::unique_ptr<PacketListener> listener, const ProcessChannelOptions& options, bool cuda)
      : uri_(std::move(uri)),
        listener_(std::move(listener)),
        options_(options),
        cuda_(cuda),
        ends_(std::make_shared<ZeroCopyEnds>(ShmPoolOptions{}, cuda)),  // the senders' memory; our pools stay empty
        probe_(cuda ? listener_->path() + ".probe" : std::string()),
        wake_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {}
  ~ShmReceiver() override {
    close();
    ::close(wake_);
  }

  SendOutcome send(Envelope&& envelope) override {
    return refused(std::move(envelope), absl::FailedPreconditionError(fmt::format("{}: this end receives", uri_)));
  }

  std::optional<Envelope> receive(absl::Time deadline) override {
    // The turn to read: one caller at a time (a flag under a lock, not a timed mutex: TSan sees
    // through pthread_mutex_clocklock only in newer runtimes than Debian's).
    turn_mu_.Lock();
    const bool mine = turn_mu_.AwaitWithDeadline(absl::Condition(+[](bool* reading) { return !*reading; }, &reading_), deadline);
    if (mine) reading_ = true;
    turn_mu_.Unlock();
    if (!mine) return std::nullopt;
    struct EndOfTurn {
      ShmReceiver* self;
      ~EndOfTurn() {
        self->turn_mu_.Lock();
        self->reading_ = false;
        self->turn_mu_.Unlock();
      }
    } end_of_turn{this};
    const std::int64_t spin_until =  // streaming: poll first
        gaps_.streaming(options_.receive_spin) ? now_ns() + absl::ToInt64Nanoseconds(options_.receive_spin) : 0;
    std::optional<Envelope> newest;
    while (!closed_.load()) {
      // New senders are accepted while others stream too (below, only when nothing is there).
      if (const std::int64_t now = now_ns(); now - last_accept_ns_ >= kAcceptEveryNs) {
        last_accept_ns_ = now;
        accept_senders();
      }
      for (const auto& s : senders_) {
        if (s.link) s.link->flush_releases();  // releases a full link could not take at once
      }
      // Everything that is there now: the first envelope found, or with kDropOldest the newest.
      for (std::size_t k = 0; k < senders_.size(); ++k) {
        Sender& s = senders_[(next_ + k) % senders_.size()];
        // kDropOldest: what is there now, up to a bound (a sender that keeps its queue full cannot
        // hold this call past its deadline).
        for (int taken = 0; taken < kTakesPerSender; ++taken) {
          auto e = take_one(s);
          if (!e) break;
          if (newest) dropped_.fetch_add(1);  // dies here: its slots go back
          newest = std::move(e);
          if (options_.full_policy != FullPolicy::kDropOldest) break;
        }
        if (newest && options_.full_policy != FullPolicy::kDropOldest) break;
      }
      forget_gone_senders();
      if (newest) {
        next_ = senders_.empty() ? 0 : (next_ + 1) % senders_.size();
        received_.fetch_add(1);
        gaps_.note(now_ns());
        return newest;
      }
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return std::nullopt;
      if (now_ns() < spin_until) continue;  // packets are streaming: one may follow at once
      std::vector<pollfd> fds = {{wake_, POLLIN, 0}, {listener_->poll_fd(), POLLIN, 0}};
      for (const auto& s : senders_) {
        if (s.link) fds.push_back({s.link->fd(), POLLIN, 0});
      }
      (void)::poll(fds.data(), fds.size(), poll_slice_ms(left, kPollMs));
      if ((fds[1].revents & POLLIN) != 0) accept_senders();
    }
    return std::nullopt;
  }
  std::vector<Envelope> drain() override { return {}; }  // nothing is queued on this side
  void close() override {
    MutexLock serial(&close_mu_);  // a second caller returns once the first has freed the URI
    if (closed_.exchange(true)) return;
    const std::uint64_t one = 1;
    (void)!::write(wake_, &one, sizeof(one));  // a receive() in progress sees closed_ and ends its turn
    turn_mu_.Lock();
    turn_mu_.Await(absl::Condition(+[](bool* reading) { return !*reading; }, &reading_));
    reading_ = true;
    turn_mu_.Unlock();
    stop_reading();
    turn_mu_.Lock();
    reading_ = false;
    turn_mu_.Unlock();
  }
  bool closed() const override { return closed_.load(); }
  ChannelStats stats() const override {
    ChannelStats s;
    s.kind = std::string(kind());
    s.received = received_.load();
    s.dropped = dropped_.load();
    s.bytes_copied = misaligned_copies_.load();
    return s;
  }
  std::string_view kind() const override { return cuda_ ? "cuda" : "shm"; }
  absl::StatusOr<at::Tensor> empty(at::IntArrayRef sizes, at::ScalarType dtype) override {
    return named(uri_, checked_empty(sizes, dtype, cuda_ ? at::kCUDA : at::kCPU));
  }
  const std::string& uri() const override { return uri_; }
  ChannelRole role() const override { return ChannelRole::kReceiver; }
  /// Senders seen by the last receive() (a new one is accepted when a receive() runs).
  bool connected() const override { return sender_count_.load() > 0; }

 private:
  struct Sender {
    std::shared_ptr<ZeroCopyLink> link;  // null once the sender has gone (its tensors keep the link open)
    std::int64_t pid = 0;                // the sending process (the link's peer credentials)
  };

  void accept_senders() {
    while (auto accepted = listener_->accept()) {
      if (accepted->peer_uid != ::geteuid()) {
        noisy_.log(LogLevel::kWarning, fmt::format("{}: refused a sender of another user (uid {}, pid {})", uri_,
                                                   accepted->peer_uid, accepted->peer_pid));
        continue;  // the link closes as `accepted` goes
      }
      senders_.push_back({std::make_shared<ZeroCopyLink>(std::move(accepted->link), ends_), accepted->peer_pid});
    }
    if (auto unaccepted = listener_->error(); !unaccepted.ok()) {  // tried again after a back-off
      noisy_.log(LogLevel::kWarning, fmt::format("{}: a sender waits: {}", uri_, std::string(unaccepted.message())));
    }
    sender_count_.store(senders_.size());
  }

  // close(), with the turn: senders can send nothing more here (their next send fails, and they
  // wait for this end to close before they connect to the next receiver); what they sent and was
  // not taken is dropped, its slots released; the URI is free for a new receiver at once.
  void stop_reading() {
    if (cuda_) ::unlink(probe_.c_str());
    // Senders still waiting to be accepted may have sent already: taken in, so that what they sent
    // is counted as dropped (and its slots go back now) like the others'.
    accept_senders();
    listener_.reset();  // unlinks the socket; connections not accepted yet are refused
    for (auto& s : senders_) {
      if (!s.link) continue;
      ::shutdown(s.link->fd(), SHUT_RD);
      // Until it reports the end of what was queued (readable until then: data, then the end);
      // take_one() also stops after a run of releases (kReleasePacketsPerRead).
      while (s.link) {
        if (take_one(s)) {
          dropped_.fetch_add(1);
          continue;
        }
        if (!s.link) break;  // take_one() saw the end
        pollfd readable{s.link->fd(), POLLIN, 0};
        if (::poll(&readable, 1, 0) <= 0) break;
      }
    }
    senders_.clear();  // each link stays open while tensors from it live
    sender_count_.store(0);
  }

  void forget_gone_senders() {
    senders_.erase(std::remove_if(senders_.begin(), senders_.end(), [](const Sender& s) { return !s.link; }), senders_.end());
    sender_count_.store(senders_.size());
  }

  // The next envelope a sender has sent, if one is there now; a sender that has gone loses its link.
  // Skips at most kSkipsPerTake malformed or non-data packets a call (a peer sending only those
  // cannot hold receive() past its deadline or close()).
  std::optional<Envelope> take_one(Sender& s) {
    for (int skipped = 0; s.link && skipped < kSkipsPerTake; ++skipped) {
      auto packet = s.link->read(0);
      switch (packet.kind) {
        case ZeroCopyLink::Packet::Kind::kNothing:
          return std::nullopt;
        case ZeroCopyLink::Packet::Kind::kClosed:
          // A sender that died (SIGKILL) could not retire its pools: this end does, so that the
          // receivers this one relayed its tensors to let go of them too (ZeroCopyLink::read()). Its
          // exit has begun before its descriptors close, so the kernel says so by now.
          if (s.pid > 0 && process_exiting(s.pid)) s.link->peer_died(s.pid);
          s.link.reset();  // its releases have nowhere to go: the sender reclaimed its slots
          return std::nullopt;
        case ZeroCopyLink::Packet::Kind::kMalformed:
          noisy_.log(LogLevel::kWarning, fmt::format("{}: malformed packet dropped: {}", uri_, std::string(packet.malformed.message())));
          continue;
        case ZeroCopyLink::Packet::Kind::kMessage:
          if (packet.message.header.kind != wire::MessageKind::kData) continue;
          misaligned_copies_.fetch_add(packet.message.bytes_copied);
          return envelope_of(std::move(packet.message));
      }
    }
    return std::nullopt;
  }

  static constexpr int kSkipsPerTake = 64;
  static constexpr int kTakesPerSender = 1024;
  static constexpr std::int64_t kAcceptEveryNs = 1'000'000;

  const std::string uri_;
  std::unique_ptr<PacketListener> listener_;  // until close()
  const ProcessChannelOptions options_;
  const bool cuda_;
  const std::shared_ptr<ZeroCopyEnds> ends_;
  const std::string probe_;                    // cuda:// only: the probe file beside the socket
  const int wake_;
  Mutex close_mu_;
  Mutex turn_mu_;
  bool reading_ ABSL_GUARDED_BY(turn_mu_) = false;  // a receive() has the turn; it alone uses the fields below
  std::vector<Sender> senders_;
  std::size_t next_ = 0;
  std::int64_t last_accept_ns_ = 0;  // the turn's: when receive() last accepted new senders
  ArrivalGaps gaps_;
  std::atomic<bool> closed_{false};
  std::atomic<std::size_t> sender_count_{0};
  std::atomic<std::uint64_t> received_{0}, dropped_{0}, misaligned_copies_{0};
  RateLimitedLog noisy_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ProcessChannel>> open_shm_channel(const std::string& uri, const std::string& socket_path,
                                                                 ChannelRole role, const ProcessChannelOptions& options, bool cuda) {
  if (cuda) {  // both ends, at once: no silent fallback to host memory
    if (auto usable = cuda_ipc_usable(); !usable.ok()) {
      return absl::FailedPreconditionError(fmt::format("{}: no CUDA channel here: {}", uri, std::string(usable.message())));
    }
  }
  if (role == ChannelRole::kSender) return std::unique_ptr<ProcessChannel>(new ShmSender(uri, socket_path, options, cuda));
  if (unix_socket_live(socket_path, SOCK_SEQPACKET)) {
    return absl::AlreadyExistsError(fmt::format("{}: another receiver holds it", uri));
  }
  // The path's lock before anything is written: of two receivers opened at once, one goes on (the
  // other's probe file or bind would replace the first's).
  auto lock = PathLock::take(socket_path);
  if (absl::IsAlreadyExists(lock.status())) return absl::AlreadyExistsError(fmt::format("{}: another receiver holds it", uri));
  if (!lock.ok()) return named(uri, lock.status());
  if (cuda) {
    // Published before the socket is bound, so that a sender that connects finds it.
    auto probe = export_cuda_probe();
    if (!probe.ok()) return absl::FailedPreconditionError(fmt::format("{}: {}", uri, std::string(probe.status().message())));
    const std::string file = socket_path + ".probe", staged = file + ".new";
    {
      std::ofstream out(staged, std::ios::trunc);
      out << *probe;
      if (!out) return absl::UnavailableError(fmt::format("{}: cannot write '{}'", uri, staged));
    }
    if (::rename(staged.c_str(), file.c_str()) != 0) {
      return absl::UnavailableError(fmt::format("{}: cannot publish '{}': {}", uri, file, std::strerror(errno)));
    }
  }
  auto listener = PacketListener::bind(socket_path, *std::move(lock));  // replaces a socket left by a dead receiver
  if (!listener.ok()) return named(uri, listener.status());
  return std::unique_ptr<ProcessChannel>(new ShmReceiver(uri, *std::move(listener), options, cuda));
}

}  // namespace blockflow::detail
