#pragma once
// hop over the public cross-process channels (process_channel.hpp), opened by URI in two processes:
// this benchmark spawns itself as the receiver (`--channel-receiver URI BYTES N`), which opens the
// receiving end, says it is ready with one byte on its stdout, and for each envelope records the
// one-way latency (the sender's steady-clock stamp rides in request_id; one clock for the whole
// host), drops the tensor (over shm:// its slot goes back) and acknowledges with one byte. At the
// end it prints "p50 p99" in microseconds. The sender makes each tensor with empty() (over shm://
// in a slot: writing it is the producer's own work and is not timed), stamps and sends it, and
// waits for the acknowledgement. Over cuda:// empty() makes the tensor on the device, and the
// receiver's view of it is ready once its stream has waited on the sender's event.

#include "alone_process.hpp"
#include "bench_util.hpp"

#include <blockflow/channel/process_channel.hpp>

namespace blockflow::bench {

inline ProcessChannelOptions uri_hop_options() {
  ProcessChannelOptions o;
  o.shm_slots_per_pool = 2;
  o.shm_max_bytes = std::size_t{1} << 30;  // two 128 MiB slots for the 100 MB size
  return o;
}

struct UriHop {
  double p50_us = 0, p99_us = 0;
};

inline UriHop measure_uri(const std::string& uri, std::size_t bytes, int iterations) {
  int to_child[2], from_child[2];
  if (::pipe2(to_child, O_CLOEXEC) != 0 || ::pipe2(from_child, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
  const pid_t pid = spawn_self({"--channel-receiver", uri, std::to_string(bytes), std::to_string(iterations)}, to_child[0],
                               from_child[1], {});
  ::close(to_child[0]);
  ::close(from_child[1]);
  auto read_byte = [&] {
    char c = 0;
    if (::read(from_child[0], &c, 1) != 1) throw std::runtime_error("hop: the receiver process died on " + uri);
    return c;
  };
  (void)read_byte();  // ready
  auto opened = open_channel(uri, ChannelRole::kSender, uri_hop_options());
  if (!opened.ok()) throw std::runtime_error(opened.status().ToString());
  ProcessChannel& sender = **opened;
  for (int i = 0; i < iterations; ++i) {
    auto t = sender.empty({static_cast<std::int64_t>(bytes)}, at::kByte);
    if (!t.ok()) throw std::runtime_error(t.status().ToString());
    if (t->is_cuda()) {
      t->narrow(0, 0, 1).fill_(7);  // cuda://: on the device, ordered before the send by its event
    } else {
      static_cast<unsigned char*>(t->data_ptr())[0] = 7;
    }
    Envelope e;
    e.tensors = {*std::move(t)};
    e.request_id = static_cast<std::uint64_t>(detail::now_ns());
    if (auto out = sender.send(std::move(e)); !out.status.ok()) throw std::runtime_error(out.status.ToString());
    (void)read_byte();
  }
  std::string line;
  for (char c; ::read(from_child[0], &c, 1) == 1 && c != '\n';) line.push_back(c);
  ::close(to_child[1]);
  ::close(from_child[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  UriHop out;
  if (std::sscanf(line.c_str(), "%lf %lf", &out.p50_us, &out.p99_us) != 2) throw std::runtime_error("hop: no figures from " + uri);
  return out;
}

inline int serve_uri_receiver(const std::string& uri, std::size_t bytes, int iterations) {
  auto opened = open_channel(uri, ChannelRole::kReceiver, uri_hop_options());
  if (!opened.ok()) {
    std::cerr << opened.status() << "\n";
    return 1;
  }
  ProcessChannel& receiver = **opened;
  auto write_byte = [](char c) { return ::write(STDOUT_FILENO, &c, 1) == 1; };
  if (!write_byte('r')) return 1;
  std::vector<double> latencies_us;
  for (int i = 0; i < iterations; ++i) {
    auto e = receiver.receive(absl::Now() + absl::Seconds(60));
    const std::int64_t now = detail::now_ns();
    if (!e || e->tensors.size() != 1 || e->tensors[0].numel() != static_cast<std::int64_t>(bytes)) return 1;
    latencies_us.push_back(static_cast<double>(now - static_cast<std::int64_t>(e->request_id)) / 1e3);
    e.reset();  // the tensor dies: over shm:// its slot goes back now
    if (!write_byte('a')) return 1;
  }
  latencies_us.erase(latencies_us.begin(), latencies_us.begin() + iterations / 10);  // warm-up
  const std::string line = fmt::format("{:.3f} {:.3f}\n", percentile(latencies_us, 0.5), percentile(latencies_us, 0.99));
  return ::write(STDOUT_FILENO, line.data(), line.size()) == static_cast<ssize_t>(line.size()) ? 0 : 1;
}

}  // namespace blockflow::bench
