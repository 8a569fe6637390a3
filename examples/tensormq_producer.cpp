// TensorMQ producer: sends COUNT tensors of [1, 256, 56, 56] float32 (3.2 MB, a ResNet50 stage's
// activation) to whichever process receives on URI, with no Session on either side. Each tensor is
// made by the channel (empty()): over shm:// its bytes lie in shared memory from the start, so the
// hand-off copies nothing. Tensor i holds the value i everywhere (tensormq_consumer checks it).
//
//   tensormq_producer shm://frames 1000
//   tensormq_producer tcp://127.0.0.1:5555 1000
//
// With kBlock (the default) a send waits for a receiver, and for a free slot: if the receiver dies,
// the producer takes its slots back and goes on with the next receiver that opens the URI.
#include <blockflow/channel/process_channel.hpp>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <charconv>
#include <cstdlib>
#include <string>

int main(int argc, char** argv) {
  if (argc < 3) {
    fmt::print(stderr, "usage: tensormq_producer URI COUNT\n");
    return 2;
  }
  const std::string uri = argv[1];
  int count = 0;
  const std::string count_text = argv[2];
  if (const auto [end, error] = std::from_chars(count_text.data(), count_text.data() + count_text.size(), count);
      error != std::errc() || end != count_text.data() + count_text.size() || count < 0) {
    fmt::print(stderr, "tensormq_producer: COUNT is a whole number from 0, not '{}'\n", count_text);
    return 2;
  }
  // [readme-start]
  blockflow::ProcessChannelOptions options;
  options.send_timeout = absl::Seconds(60);  // time for a receiver to (re)appear
  auto channel = blockflow::open_channel(uri, blockflow::ChannelRole::kSender, options);
  if (!channel.ok()) {
    fmt::print(stderr, "producer: {}\n", channel.status().ToString());
    return 1;
  }
  auto& ch = **channel;
  for (int i = 0; i < count; ++i) {
    auto tensor = ch.empty({1, 256, 56, 56});
    if (!tensor.ok()) {
      fmt::print(stderr, "producer: {}\n", tensor.status().ToString());
      return 1;
    }
    tensor->fill_(static_cast<float>(i));
    blockflow::Envelope envelope;
    envelope.request_id = static_cast<std::uint64_t>(i);
    envelope.tensors = {*tensor};
    if (auto sent = ch.send(std::move(envelope)); !sent.status.ok()) {
      fmt::print(stderr, "producer: tensor {}: {}\n", i, sent.status.ToString());
      return 1;
    }
  }
  // Our pools leave with us: wait until the receiver has let go of what it was sent.
  if (auto flushed = ch.flush(absl::Now() + absl::Seconds(60)); !flushed.ok()) {
    fmt::print(stderr, "producer: {}\n", flushed.ToString());
    return 1;
  }
  // [readme-end]
  const auto stats = ch.stats();
  const auto shm = ch.shm_stats();
  fmt::print("producer: sent {} to {}, bytes_copied {}, slots reclaimed {}, slots in use {}\n", stats.sent, uri,
             stats.bytes_copied, shm.reclaims, shm.slots_in_use);
  return 0;
}
