// TensorMQ consumer: receives tensors on URI (see tensormq_producer.cpp) and checks that tensor i
// holds the value i everywhere, until it has COUNT of them or the one numbered LAST. --hold N keeps
// the last N tensors alive (as an application batching frames would), so N slots of the producer
// stay in use until it lets go. Prints "consumer: received K" every 100 tensors, then a summary.
//
//   tensormq_consumer shm://frames 1000 [--last 999] [--hold 8]
#include <blockflow/channel/process_channel.hpp>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <string>

int main(int argc, char** argv) {
  if (argc < 3) {
    fmt::print(stderr, "usage: tensormq_consumer URI COUNT [--last ID] [--hold N]\n");
    return 2;
  }
  const std::string uri = argv[1];
  const long count = std::atol(argv[2]);
  long last = -1;
  std::size_t hold = 0;
  for (int i = 3; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--last") == 0) last = std::atol(argv[i + 1]);
    if (std::strcmp(argv[i], "--hold") == 0) hold = static_cast<std::size_t>(std::atol(argv[i + 1]));
  }
  // [readme-start]
  auto channel = blockflow::open_channel(uri, blockflow::ChannelRole::kReceiver);
  if (!channel.ok()) {
    fmt::print(stderr, "consumer: {}\n", channel.status().ToString());
    return 1;
  }
  auto& ch = **channel;
  fmt::print("consumer: listening on {}\n", uri);
  std::fflush(stdout);
  long received = 0, wrong = 0, first = -1, last_seen = -1;
  std::deque<blockflow::Tensors> held;
  while (received < count && last_seen != last) {
    auto envelope = ch.receive(absl::Now() + absl::Seconds(60));
    if (!envelope) {
      fmt::print(stderr, "consumer: nothing for 60 s after {} tensors\n", received);
      return 1;
    }
    const auto id = static_cast<long>(envelope->request_id);
    const at::Tensor& t = envelope->tensors.at(0);
    const bool ok = t.sizes() == at::IntArrayRef({1, 256, 56, 56}) && t.eq(static_cast<float>(id)).all().item<bool>();
    wrong += ok ? 0 : 1;
    if (first < 0) first = id;
    last_seen = id;
    if (++received % 100 == 0) {
      fmt::print("consumer: received {}\n", received);
      std::fflush(stdout);
    }
    if (hold > 0) {
      held.push_back(std::move(envelope->tensors));
      if (held.size() > hold) held.pop_front();
    }
  }
  // [readme-end]
  held.clear();
  fmt::print("consumer: received {} (ids {} to {}), wrong values {}, bytes_copied {}\n", received, first, last_seen, wrong,
             ch.stats().bytes_copied);
  return wrong == 0 ? 0 : 1;
}
