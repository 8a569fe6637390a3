// hop: latency of one hand-off over a TensorChannel, for three tensor sizes.
//
// A sender thread stamps the time, sends an envelope carrying a tensor of B bytes, and waits for
// the receiver's acknowledgement before the next one; the receiver, blocked in receive() as a
// block's worker is, records the one-way latency (same steady clock). Prints one JSON line per
// size: {"bench":"hop","channel":"inproc","bytes":B,"p50_us":..,"p99_us":..}.
//
// zmq-ipc / zmq-tcp: the same, through the serialized channel as workers use it: the wire header
// plus the tensor's bytes sent without a copy on a PUSH socket, received on a PULL socket and
// decoded into a tensor over the received buffer. Each line also has "memcpy_us": one memcpy of
// the same bytes (p50), measured in the same run. socketpair: the floor under zmq-ipc, the same
// bytes through a bare AF_UNIX stream socket pair between two threads (no ZeroMQ, a reused buffer).
// zmq-tcp-curve: zmq-tcp with the data sockets talking CURVE (encrypted and authenticated, as a
// joined worker's and a remote client's do); its line has "over_zmq_tcp", its p50 over plain zmq-tcp
// at the same size ("zmq_tcp_p50_us": the lower of that line's and a measurement again right after). memcpy_us times many copies
// per sample at small sizes, so that the clock's cost does not count.
//
// shm: the zero-copy channel as workers use it, over its data link (an AF_UNIX SOCK_SEQPACKET
// socket pair, detail/packet_link.hpp), with the producer's tensor allocated in a shared-memory
// slot (make_shm_allocator(); writing it is the producer's own work and is not timed): the sender
// sends a 32-byte handle, the receiver builds its tensor over the slot. Nothing is copied on either
// side. shm-copy: the same for a tensor allocated anywhere, which the sender copies into a slot
// first (inside the timed span). shm-zmq: the shm hand-off over ZeroMQ PUSH/PULL ipc:// sockets
// instead of the link (what workers used before the link), for comparison in the same run. The
// slot's release, which a worker sends back as a message off the critical path, is a direct call
// here.
//
// cuda (where a GPU and a libtorch with CUDA are present): a CUDA tensor written by the producer
// (a fill kernel, not timed) crosses to a second process (this program, spawned with
// --cuda-receiver) over a data link as workers use it: the sender records an interprocess event
// and sends a 32-byte handle naming its allocation; the receiver opens it (once, cached), makes its stream wait on the event and
// builds its tensor over the producer's memory. Nothing is copied. Releases ride on the acks.
// cuda-uri: the same hand-off over the public cuda:// channel between two processes (uri_hop.hpp),
// with its ratio to the cuda line (over_cuda_link).

#include "bench_util.hpp"
#include "uri_hop.hpp"

#include <blockflow/channel/inproc_channel.hpp>
#include <blockflow/core/detail/clock.hpp>
#include <blockflow/channel/detail/packet_link.hpp>
#include <blockflow/worker/worker_site.hpp>
#include <blockflow/channel/detail/runtime_dir.hpp>
#include <blockflow/channel/detail/tensor_codec.hpp>
#include <blockflow/channel/detail/zero_copy_ends.hpp>

#include <ATen/ops/empty.h>
#include <fmt/format.h>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <spawn.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ATen/ops/empty.h>
#ifdef BLOCKFLOW_TORCH_CUDA
#include <ATen/cuda/Sleep.h>
#endif
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>

namespace bf = blockflow;

namespace {

struct HopFigures {
  double p50_us, p99_us;
};

HopFigures measure(std::size_t bytes, int iterations) {
  bf::InProcessChannel forward_channel, ack_channel;
  const bf::Tensor payload = at::empty({static_cast<std::int64_t>(bytes)}, at::kByte);
  std::vector<double> latencies_us;
  latencies_us.reserve(static_cast<std::size_t>(iterations));
  std::thread receiver([&] {
    while (auto envelope = forward_channel.receive(absl::InfiniteFuture())) {
      const std::int64_t now = bf::detail::now_ns();
      latencies_us.push_back(static_cast<double>(now - static_cast<std::int64_t>(envelope->request_id)) / 1e3);
      envelope->tensors.clear();
      (void)ack_channel.send(bf::Envelope{});
    }
  });
  for (int i = 0; i < iterations; ++i) {
    bf::Envelope envelope;
    envelope.tensors = {payload};
    envelope.request_id = static_cast<std::uint64_t>(bf::detail::now_ns());  // the send time rides along
    (void)forward_channel.send(std::move(envelope));
    (void)ack_channel.receive(absl::InfiniteFuture());
  }
  forward_channel.close();
  receiver.join();
  latencies_us.erase(latencies_us.begin(), latencies_us.begin() + iterations / 10);  // warm-up
  return {bf::bench::percentile(latencies_us, 0.5), bf::bench::percentile(latencies_us, 0.99)};
}

// One-way latency over PUSH/PULL with the wire format; the ack goes back on a second pair.
enum class Shm { kNone, kCopy, kLease };
HopFigures measure_zmq(const std::string& endpoint, std::size_t bytes, int iterations, Shm mode = Shm::kNone,
                       bool curve = false) {
  const bool shm = mode != Shm::kNone;
  bf::detail::ShmProducer producer;
  bf::detail::ShmConsumer consumer(/*local_pools=*/true);  // the handles cross a ZeroMQ socket: no descriptors
  const bf::detail::ShmStager stager = bf::detail::make_stager(producer, absl::Seconds(10));
  const bf::detail::ShmResolver resolver =
      bf::detail::make_resolver(consumer, [&producer](const bf::wire::ShmHandle& h) { producer.release(h); });
  zmq::context_t context(1);
  zmq::socket_t push(context, zmq::socket_type::push), pull(context, zmq::socket_type::pull);
  zmq::socket_t ack_push(context, zmq::socket_type::push), ack_pull(context, zmq::socket_type::pull);
  if (curve) {  // fresh key pairs; no ZAP handler: the handshake and the encryption are what is measured
    char server_public[41], server_secret[41], client_public[41], client_secret[41];
    if (zmq_curve_keypair(server_public, server_secret) != 0 || zmq_curve_keypair(client_public, client_secret) != 0) {
      std::abort();
    }
    pull.set(zmq::sockopt::curve_server, true);
    pull.set(zmq::sockopt::curve_secretkey, std::string(server_secret, 40));
    push.set(zmq::sockopt::curve_serverkey, std::string(server_public, 40));
    push.set(zmq::sockopt::curve_publickey, std::string(client_public, 40));
    push.set(zmq::sockopt::curve_secretkey, std::string(client_secret, 40));
  }
  pull.bind(endpoint);
  push.connect(pull.get(zmq::sockopt::last_endpoint));
  ack_pull.bind(endpoint.rfind("ipc://", 0) == 0 ? endpoint + "-ack" : "tcp://127.0.0.1:*");
  ack_push.connect(ack_pull.get(zmq::sockopt::last_endpoint));
  const bf::Tensor payload = at::empty({static_cast<std::int64_t>(bytes)}, at::kByte).fill_(7);
  const bf::detail::ShmAllocator allocate = bf::detail::make_shm_allocator(producer, absl::Seconds(10));
  std::vector<double> latencies_us;
  std::thread receiver([&] {
    for (int i = 0; i < iterations; ++i) {
      std::vector<zmq::message_t> frames;
      (void)zmq::recv_multipart(pull, std::back_inserter(frames));
      auto message = bf::detail::decode_message(std::move(frames), shm ? &resolver : nullptr);
      const std::int64_t now = bf::detail::now_ns();
      if (!message.ok() || message->tensors.at(0).numel() != static_cast<std::int64_t>(bytes)) std::abort();
      latencies_us.push_back(static_cast<double>(now - message->header.times.sent_ns) / 1e3);
      (void)ack_push.send(zmq::str_buffer("ok"), zmq::send_flags::none);
    }
  });
  for (int i = 0; i < iterations; ++i) {
    bf::Tensor out = payload;
    if (mode == Shm::kLease) {  // the producer's output, written in place
      auto in_slot = allocate({static_cast<std::int64_t>(bytes)}, at::kByte);
      if (!in_slot.ok()) std::abort();
      out = *std::move(in_slot);
      static_cast<unsigned char*>(out.data_ptr())[0] = 7;
    }
    bf::wire::Header header;
    header.request_id = static_cast<std::uint64_t>(i);
    header.times.sent_ns = bf::detail::now_ns();
    if (!bf::detail::send_message(push, header, {out}, zmq::send_flags::none, nullptr, shm ? &stager : nullptr).ok()) {
      std::abort();
    }
    out = bf::Tensor();  // the producer is done with it; the receiver's view keeps the slot
    zmq::message_t ack;
    (void)ack_pull.recv(ack);
  }
  receiver.join();
  latencies_us.erase(latencies_us.begin(), latencies_us.begin() + iterations / 10);
  return {bf::bench::percentile(latencies_us, 0.5), bf::bench::percentile(latencies_us, 0.99)};
}

// The floor under the zmq-ipc lines: the same bytes through a bare AF_UNIX stream socketpair
// between two threads, no ZeroMQ, no header, the receiver reading into a buffer it reuses (warm,
// already faulted in); an 8-byte send time goes first and a 1-byte ack comes back.
HopFigures measure_socketpair(std::size_t bytes, int iterations) {
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) std::abort();
  std::vector<char> payload(bytes, 7), into(bytes);
  std::vector<double> latencies_us;
  auto read_all = [](int fd, void* data, std::size_t n) {
    auto* p = static_cast<char*>(data);
    while (n > 0) {
      const ssize_t got = ::read(fd, p, n);
      if (got <= 0) std::abort();
      p += got;
      n -= static_cast<std::size_t>(got);
    }
  };
  std::thread receiver([&] {
    for (int i = 0; i < iterations; ++i) {
      std::int64_t sent_ns = 0;
      read_all(fds[1], &sent_ns, sizeof sent_ns);
      read_all(fds[1], into.data(), bytes);
      latencies_us.push_back(static_cast<double>(bf::detail::now_ns() - sent_ns) / 1e3);
      const char ack = 1;
      if (::write(fds[1], &ack, 1) != 1) std::abort();
    }
  });
  for (int i = 0; i < iterations; ++i) {
    std::int64_t sent_ns = bf::detail::now_ns();
    iovec parts[2] = {{&sent_ns, sizeof sent_ns}, {payload.data(), bytes}};
    std::size_t left = sizeof sent_ns + bytes;
    while (left > 0) {
      const ssize_t n = ::writev(fds[0], parts, 2);
      if (n <= 0) std::abort();
      std::size_t written = static_cast<std::size_t>(n);
      left -= written;
      for (auto& part : parts) {  // skip what was written
        const std::size_t done = std::min(part.iov_len, written);
        part.iov_base = static_cast<char*>(part.iov_base) + done;
        part.iov_len -= done;
        written -= done;
      }
    }
    char ack = 0;
    read_all(fds[0], &ack, 1);
  }
  receiver.join();
  ::close(fds[0]);
  ::close(fds[1]);
  latencies_us.erase(latencies_us.begin(), latencies_us.begin() + iterations / 10);
  return {bf::bench::percentile(latencies_us, 0.5), bf::bench::percentile(latencies_us, 0.99)};
}

// The same over a data link (both directions of one socket pair: the ack comes back on it).
// What workers poll before they sleep while packets come in a stream (WorkerOptions::receive_spin).
const absl::Duration kSpin = bf::WorkerOptions{}.receive_spin;

HopFigures measure_link(std::size_t bytes, int iterations, Shm mode, absl::Duration spin = kSpin) {
  bf::detail::ShmProducer producer;
  bf::detail::ShmConsumer consumer;
  const bf::detail::ShmStager stager = bf::detail::make_stager(producer, absl::Seconds(10));
  const bf::detail::ShmResolver resolver =
      bf::detail::make_resolver(consumer, [&producer](const bf::wire::ShmHandle& h) { producer.release(h); });
  auto ends = bf::detail::PacketLink::pair();
  if (!ends.ok()) std::abort();
  auto [sender, receiver_end] = *ends;
  const bf::Tensor payload = at::empty({static_cast<std::int64_t>(bytes)}, at::kByte).fill_(7);
  const bf::detail::ShmAllocator allocate = bf::detail::make_shm_allocator(producer, absl::Seconds(10));
  std::vector<double> latencies_us;
  std::thread receiver([&, link = receiver_end] {
    for (int i = 0; i < iterations; ++i) {
      auto received = link->receive(-1, spin);
      if (!received || received->closed || !received->frames.ok()) std::abort();
      for (const int fd : received->fds.take()) {  // a pool's first packet brings its descriptor
        if (!consumer.adopt(fd).ok()) std::abort();
      }
      auto message = bf::detail::decode_message(*std::move(received->frames), &resolver);
      const std::int64_t now = bf::detail::now_ns();
      if (!message.ok() || message->tensors.at(0).numel() != static_cast<std::int64_t>(bytes)) std::abort();
      latencies_us.push_back(static_cast<double>(now - message->header.times.sent_ns) / 1e3);
      if (!link->send({"ok"}).ok()) std::abort();
    }
  });
  for (int i = 0; i < iterations; ++i) {
    bf::Tensor out = payload;
    if (mode == Shm::kLease) {  // the producer's output, written in place
      auto in_slot = allocate({static_cast<std::int64_t>(bytes)}, at::kByte);
      if (!in_slot.ok()) std::abort();
      out = *std::move(in_slot);
      static_cast<unsigned char*>(out.data_ptr())[0] = 7;
    }
    bf::wire::Header header;
    header.request_id = static_cast<std::uint64_t>(i);
    header.times.sent_ns = bf::detail::now_ns();
    if (!bf::detail::send_packet(*sender, header, {out}, nullptr, &stager).ok()) std::abort();
    out = bf::Tensor();  // the producer is done with it; the receiver's view keeps the slot
    auto ack = sender->receive(-1, kSpin);
    if (!ack || ack->closed) std::abort();
  }
  receiver.join();
  latencies_us.erase(latencies_us.begin(), latencies_us.begin() + iterations / 10);
  return {bf::bench::percentile(latencies_us, 0.5), bf::bench::percentile(latencies_us, 0.99)};
}

// The receiving process of the cuda hop: resolves each handle, reports its one-way latency and the
// handles whose tensors died (released once its stream is done with them) in the ack.
int cuda_receiver(const std::string& data, int total) {
  bf::detail::ZeroCopyEnds ends(bf::detail::ShmPoolOptions{}, true);
  // Shared with the release callbacks, which CUDA may run after this function has returned.
  struct Released {
    std::mutex mu;
    std::vector<bf::wire::ShmHandle> handles;
  };
  auto released = std::make_shared<Released>();
  bf::detail::ShmConsumer given;  // the sender's record pools, as their descriptors come
  const bf::detail::ShmResolver resolver = ends.resolver(given, [released](const bf::wire::ShmHandle& h) {
    std::lock_guard lock(released->mu);
    released->handles.push_back(h);
  });
  auto link = bf::detail::PacketLink::connect(data);
  if (!link.ok()) {
    std::cerr << "hop cuda receiver: " << link.status() << "\n";
    return 1;
  }
  for (int i = 0; i < total; ++i) {
    auto packet = (*link)->receive(-1, kSpin);
    if (!packet || packet->closed || !packet->frames.ok()) return 1;
    const std::int64_t received = bf::detail::now_ns();
    for (const int fd : packet->fds.take()) {
      if (auto adopted = given.adopt(fd); !adopted.ok()) {
        std::cerr << "hop cuda receiver: " << adopted.status() << "\n";
        return 1;
      }
    }
    auto message = bf::detail::decode_message(*std::move(packet->frames), &resolver);
    const std::int64_t now = bf::detail::now_ns();
    const double resolve_us = static_cast<double>(now - received) / 1e3;
    if (!message.ok() || !message->tensors.at(0).is_cuda()) {
      std::cerr << "hop cuda receiver: " << message.status() << "\n";
      return 1;
    }
    const double latency_us = static_cast<double>(now - message->header.times.sent_ns) / 1e3;
    message->tensors.clear();  // the release follows once this stream is done with it
    std::string reply(reinterpret_cast<const char*>(&latency_us), sizeof(latency_us));
    reply.append(reinterpret_cast<const char*>(&resolve_us), sizeof(resolve_us));
    {
      std::lock_guard lock(released->mu);
      reply += bf::wire::encode_releases(released->handles);
      released->handles.clear();
    }
    if (!(*link)->send({reply}).ok()) return 1;
  }
  return 0;
}

// The sending side of the cuda hop, for each size. `busy_cycles` > 0: the producer's stream is
// still busy (a spin kernel of that many cycles queued before the send), to show that neither side
// waits for the GPU: send_us (the sender's share + send) and resolve_us (the receiver's decode)
// stay small while the kernel runs.
struct CudaHop {
  HopFigures hop;
  double send_us = 0, resolve_us = 0;
};
std::vector<CudaHop> measure_cuda(const char* self, const std::string& dir, const std::vector<std::size_t>& sizes,
                                  int iterations, std::int64_t busy_cycles = 0) {
  bf::detail::ZeroCopyEnds ends(bf::detail::ShmPoolOptions{}, true);
  const bf::detail::ShmStager stager = ends.stager(absl::Seconds(10));
  auto listener = bf::detail::PacketListener::bind(dir + "/cuda");
  if (!listener.ok()) return {};
  const std::string total = std::to_string(iterations * static_cast<int>(sizes.size()));
  std::vector<std::string> args = {self, "--cuda-receiver", (*listener)->path(), total};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t child = 0;
  if (::posix_spawn(&child, self, nullptr, nullptr, argv.data(), environ) != 0) return {};
  std::shared_ptr<bf::detail::PacketLink> link;
  for (int i = 0; i < 3000 && !link; ++i) {  // the receiver connects once CUDA is up
    if (auto accepted = (*listener)->accept()) link = accepted->link;
    else std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (!link) return {};
  std::vector<CudaHop> out;
  for (std::size_t bytes : sizes) {
    std::vector<double> latencies_us, send_us, resolve_us;
    for (int i = 0; i < iterations; ++i) {
      bf::Tensor t = at::empty({static_cast<std::int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA));
      t.fill_(static_cast<std::int64_t>(i % 251));  // the producer's own work, queued on its stream
#ifdef BLOCKFLOW_TORCH_CUDA
      if (busy_cycles > 0) at::cuda::sleep(busy_cycles);
#endif
      bf::wire::Header header;
      header.request_id = static_cast<std::uint64_t>(i);
      header.times.sent_ns = bf::detail::now_ns();
      if (!bf::detail::send_packet(*link, header, {t}, nullptr, &stager).ok()) std::abort();
      send_us.push_back(static_cast<double>(bf::detail::now_ns() - header.times.sent_ns) / 1e3);
      t = bf::Tensor();
      auto ack = link->receive(-1, kSpin);
      if (!ack || ack->closed || !ack->frames.ok() || ack->frames->size() != 1) std::abort();
      const zmq::message_t& reply = ack->frames->front();
      if (reply.size() < 2 * sizeof(double)) std::abort();
      double figures[2] = {0, 0};
      std::memcpy(figures, reply.data(), sizeof(figures));
      latencies_us.push_back(figures[0]);
      resolve_us.push_back(figures[1]);
      auto handles = bf::wire::decode_releases(
          std::string(static_cast<const char*>(reply.data()) + sizeof(figures), reply.size() - sizeof(figures)));
      if (handles.ok()) {
        for (const auto& h : *handles) ends.release(h);
      }
    }
    latencies_us.erase(latencies_us.begin(), latencies_us.begin() + iterations / 10);
    out.push_back({{bf::bench::percentile(latencies_us, 0.5), bf::bench::percentile(latencies_us, 0.99)},
                   bf::bench::percentile(send_us, 0.5),
                   bf::bench::percentile(resolve_us, 0.5)});
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  return out;
}

// One memcpy of `bytes`: the median of 21 samples, each timing enough copies (about 1 MB of them,
// 1000 at most) that the clock's own cost, near a 4 KB copy's, does not count.
double memcpy_us(std::size_t bytes) {
  std::vector<char> src(bytes, 1), dst(bytes, 2);
  const int copies = static_cast<int>(std::clamp<std::size_t>((std::size_t{1} << 20) / std::max<std::size_t>(bytes, 1), 1, 1000));
  std::vector<double> samples;
  for (int i = 0; i < 21; ++i) {
    const std::int64_t t0 = bf::detail::now_ns();
    for (int c = 0; c < copies; ++c) {
      src[static_cast<std::size_t>(c) % bytes] = 1;  // a store between copies: each copy is done again
      std::memcpy(dst.data(), src.data(), bytes);
    }
    const std::int64_t t1 = bf::detail::now_ns();
    samples.push_back(static_cast<double>(t1 - t0) / 1e3 / copies);
    if (dst[bytes / 2] != 1) std::abort();  // keeps the copies from being optimised away
  }
  return bf::bench::percentile(samples, 0.5);
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc == 4 && std::string(argv[1]) == "--cuda-receiver") return cuda_receiver(argv[2], std::stoi(argv[3]));
  if (argc == 5 && std::string(argv[1]) == "--channel-receiver") {
    return bf::bench::serve_uri_receiver(argv[2], std::stoul(argv[3]), std::stoi(argv[4]));
  }
  const int iterations = argc > 1 ? std::stoi(argv[1]) : 20000;
  const std::vector<std::size_t> sizes = {4096, 3211264, 104857600};
  const std::string machine = bf::bench::machine_json();
  // BENCH_HOP_CUDA_ONLY=1 (scripts/gpu.sh): the cuda lines alone, none of the host-memory ones.
  const bool cuda_only = std::getenv("BENCH_HOP_CUDA_ONLY") != nullptr;
  for (std::size_t bytes : cuda_only ? std::vector<std::size_t>{} : sizes) {
    const HopFigures f = measure(bytes, iterations);
    fmt::print("{{\"bench\":\"hop\",{},\"channel\":\"inproc\",\"bytes\":{},\"iterations\":{},\"p50_us\":{:.3f},\"p99_us\":{:.3f}}}\n",
               machine, bytes, iterations, f.p50_us, f.p99_us);
  }
  auto dir = bf::detail::make_private_dir("hop");
  if (!dir.ok()) {
    std::cerr << "hop_bench: " << dir.status() << "\n";
    return 1;
  }
  struct Removed {  // however this ends (a measurement that throws included)
    std::string dir;
    ~Removed() { bf::detail::remove_private_dir(dir); }
  } removed{*dir};
  std::map<std::pair<std::string, std::size_t>, double> thread_p50_us;  // for the URI lines' ratios
  for (const auto& [channel, endpoint] : {std::pair<std::string, std::string>{"shm", ""},
                                          std::pair<std::string, std::string>{"shm-copy", ""},
                                          std::pair<std::string, std::string>{"shm-zmq", "ipc://" + *dir + "/shm"},
                                          std::pair<std::string, std::string>{"zmq-ipc", "ipc://" + *dir + "/hop"},
                                          std::pair<std::string, std::string>{"socketpair", ""},
                                          std::pair<std::string, std::string>{"zmq-tcp", "tcp://127.0.0.1:*"},
                                          std::pair<std::string, std::string>{"zmq-tcp-curve", "tcp://127.0.0.1:*"}}) {
    if (cuda_only) break;
    for (std::size_t bytes : sizes) {
      // Fewer round trips for the large sizes: each moves the whole tensor through the kernel.
      const int n = bytes > 50'000'000 ? 30 : bytes > 1'000'000 ? 500 : std::min(iterations, 5000);
      const double copy_us = memcpy_us(bytes);
      const HopFigures f = channel == "socketpair" ? measure_socketpair(bytes, n)
                           : endpoint.empty() ? measure_link(bytes, n, channel == "shm" ? Shm::kLease : Shm::kCopy)
                           : measure_zmq(endpoint, bytes, n, channel == "shm-zmq" ? Shm::kLease : Shm::kNone,
                                         channel == "zmq-tcp-curve");
      // The hops come one after another, a stream: the link's receiver polls for
      // WorkerOptions::receive_spin before it sleeps. "asleep_p50_us": the same hop with a receiver
      // that never spins, as a pipeline stage's whose packets come milliseconds apart: each hop
      // pays a thread's wake-up.
      std::string extra;  // fields of one channel's line only
      thread_p50_us[{channel, bytes}] = f.p50_us;
      if (channel == "zmq-tcp-curve") {  // against plain zmq-tcp: the lower of its line above and again now
        const double plain = std::min(thread_p50_us.at({"zmq-tcp", bytes}),
                                      measure_zmq(endpoint, bytes, n, Shm::kNone, false).p50_us);
        extra = fmt::format(",\"over_zmq_tcp\":{:.2f},\"zmq_tcp_p50_us\":{:.3f}", f.p50_us / plain, plain);
      }
      if (channel == "shm") {
        extra = fmt::format(",\"spin_us\":{},\"asleep_p50_us\":{:.3f}", absl::ToInt64Microseconds(kSpin),
                             measure_link(bytes, n, Shm::kLease, absl::ZeroDuration()).p50_us);
      }
      fmt::print(
          "{{\"bench\":\"hop\",{},\"channel\":\"{}\",\"bytes\":{},\"iterations\":{},\"p50_us\":{:.3f},\"p99_us\":{:.3f},"
          "\"memcpy_us\":{:.3f},\"p50_over_memcpy\":{:.2f}{}}}\n",
          machine, channel, bytes, n, f.p50_us, f.p99_us, copy_us, f.p50_us / copy_us, extra);
    }
  }
  // The public channels, opened by URI in two processes (uri_hop.hpp). "over_threads": p50 over the
  // same machinery between two threads (shm, zmq-ipc, zmq-tcp), same size ("threads_p50_us"): the
  // lower of its line above and a measurement again just before, so that a moment of noise on the
  // baseline's side does not flatter the URI channel.
  for (const auto& [channel, uri] :
       {std::pair<std::string, std::string>{"shm", fmt::format("shm://hop-bench-{}", ::getpid())},
        std::pair<std::string, std::string>{"zmq-ipc", fmt::format("ipc://hop-bench-{}", ::getpid())},
        std::pair<std::string, std::string>{"zmq-tcp", "tcp://127.0.0.1:" + std::to_string(bf::bench::free_tcp_port())}}) {
    if (cuda_only) break;
    for (std::size_t bytes : sizes) {
      const int n = bytes > 50'000'000 ? 30 : bytes > 1'000'000 ? 500 : std::min(iterations, 5000);
      const double again = channel == "shm" ? measure_link(bytes, n, Shm::kLease).p50_us
                           : channel == "zmq-ipc" ? measure_zmq("ipc://" + *dir + "/again", bytes, n, Shm::kNone, false).p50_us
                                                  : measure_zmq("tcp://127.0.0.1:*", bytes, n, Shm::kNone, false).p50_us;
      const double threads = std::min(again, thread_p50_us.at({channel, bytes}));
      const auto f = bf::bench::measure_uri(uri, bytes, n);
      fmt::print("{{\"bench\":\"hop\",{},\"channel\":\"{}\",\"uri\":\"{}\",\"processes\":2,\"bytes\":{},\"iterations\":{},"
                 "\"p50_us\":{:.3f},\"p99_us\":{:.3f},\"over_threads\":{:.2f},\"threads_p50_us\":{:.3f},\"socketpair_p50_us\":{:.3f}}}\n",
                 machine, channel + "-uri", uri, bytes, n, f.p50_us, f.p99_us, f.p50_us / threads, threads,
                 thread_p50_us.at({"socketpair", bytes}));
    }
  }
  if (const absl::Status cuda = bf::detail::cuda_ipc_usable(); cuda.ok()) {
    const auto figures = measure_cuda(argv[0], *dir, sizes, 1000);
    for (std::size_t i = 0; i < figures.size(); ++i) {
      fmt::print("{{\"bench\":\"hop\",{},\"channel\":\"cuda\",\"bytes\":{},\"iterations\":1000,\"p50_us\":{:.3f},"
                 "\"p99_us\":{:.3f},\"send_us\":{:.3f},\"resolve_us\":{:.3f},\"device\":\"{}\"}}\n",
                 machine, sizes[i], figures[i].hop.p50_us, figures[i].hop.p99_us, figures[i].send_us, figures[i].resolve_us,
                 bf::bench::gpu_name());
    }
    // cuda:// opened by URI in two processes (the public channel), against the data-link line above.
    const std::string cuda_uri = fmt::format("cuda://hop-bench-{}", ::getpid());
    for (std::size_t i = 0; i < figures.size(); ++i) {
      const auto f = bf::bench::measure_uri(cuda_uri, sizes[i], 1000);
      fmt::print("{{\"bench\":\"hop\",{},\"channel\":\"cuda-uri\",\"uri\":\"{}\",\"processes\":2,\"bytes\":{},\"iterations\":1000,"
                 "\"p50_us\":{:.3f},\"p99_us\":{:.3f},\"over_cuda_link\":{:.2f},\"device\":\"{}\"}}\n",
                 machine, cuda_uri, sizes[i], f.p50_us, f.p99_us, f.p50_us / figures[i].hop.p50_us, bf::bench::gpu_name());
    }
#ifdef BLOCKFLOW_TORCH_CUDA
    // The same with the producer's GPU still busy for ~1 ms (2M cycles) when it sends.
    const auto busy = measure_cuda(argv[0], *dir, {sizes[1]}, 200, 2'000'000);
    if (!busy.empty()) {
      fmt::print("{{\"bench\":\"hop\",{},\"channel\":\"cuda-busy\",\"bytes\":{},\"iterations\":200,\"p50_us\":{:.3f},"
                 "\"p99_us\":{:.3f},\"send_us\":{:.3f},\"resolve_us\":{:.3f},\"busy_cycles\":2000000,\"device\":\"{}\"}}\n",
                 machine, sizes[1], busy[0].hop.p50_us, busy[0].hop.p99_us, busy[0].send_us, busy[0].resolve_us, bf::bench::gpu_name());
    }
#endif
  } else {
    std::cerr << "hop: no cuda lines: " << cuda.message() << "\n";
  }
  return 0;
} catch (const std::exception& e) {
  std::cerr << "hop_bench: " << e.what() << "\n";
  return 1;
}
