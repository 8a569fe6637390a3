// hop: latency of one hand-off over a TensorChannel, for three tensor sizes.
//
// A sender thread stamps the time, sends an envelope carrying a tensor of B bytes, and waits for
// the receiver's acknowledgement before the next one; the receiver, blocked in receive() as a
// block's worker is, records the one-way latency (same steady clock). Prints one JSON line per
// size: {"bench":"hop","channel":"inproc","bytes":B,"p50_us":..,"p99_us":..}.

#include "bench_util.hpp"

#include <blockflow/inproc_channel.hpp>
#include <blockflow/detail/clock.hpp>

#include <ATen/ops/empty.h>
#include <fmt/format.h>

#include <atomic>
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

}  // namespace

int main(int argc, char** argv) {
  const int iterations = argc > 1 ? std::stoi(argv[1]) : 20000;
  for (std::size_t bytes : {std::size_t{4096}, std::size_t{3211264}, std::size_t{104857600}}) {
    const HopFigures f = measure(bytes, iterations);
    fmt::print("{{\"bench\":\"hop\",\"channel\":\"inproc\",\"bytes\":{},\"iterations\":{},\"p50_us\":{:.3f},\"p99_us\":{:.3f}}}\n",
               bytes, iterations, f.p50_us, f.p99_us);
  }
  return 0;
}
