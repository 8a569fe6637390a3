// One process's end of a zero-copy data link (detail/zero_copy_link.hpp), the transport under the
// shm:// and cuda:// channels and under every worker's "shm" and "cuda" channel: the release
// protocol (handles go back in packets of at most kReleasesPerMessage, each freed once), what read()
// sorts (releases taken, data as views of the peer's memory, malformed packets and a closed peer
// reported), pools' descriptors carried once per link, and a live view keeping its link open.
#include <blockflow/channel/detail/packet_link.hpp>
#include <blockflow/channel/detail/tensor_codec.hpp>
#include <blockflow/channel/detail/zero_copy_ends.hpp>
#include <blockflow/channel/detail/zero_copy_link.hpp>

#include <ATen/ATen.h>

#include <catch2/catch.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <string_view>
#include <vector>

using namespace blockflow::detail;
namespace wire = blockflow::wire;
using Catch::Matchers::Contains;
using Kind = ZeroCopyLink::Packet::Kind;

namespace {

ShmPoolOptions small_pools() {
  ShmPoolOptions pools;
  pools.min_slot_bytes = 4096;
  pools.slots_per_pool = 8;
  pools.max_total_bytes = std::size_t{64} << 20;
  return pools;
}

// The two ends of one link in this process: a producer with its pools, and a consumer.
struct LinkPair {
  std::shared_ptr<PacketLink> producer_end, consumer_end;
  struct Ends {
    std::shared_ptr<ZeroCopyEnds> producer_ends = std::make_shared<ZeroCopyEnds>(small_pools(), false);
    std::unique_ptr<ZeroCopyLink> producer, consumer;
    ShmStager stage;
  };
  Ends parts;
  LinkPair() {
    auto pair = PacketLink::pair();
    REQUIRE(pair.ok());
    std::tie(producer_end, consumer_end) = *pair;
    parts.producer = std::make_unique<ZeroCopyLink>(producer_end, parts.producer_ends);
    parts.consumer = std::make_unique<ZeroCopyLink>(consumer_end, std::make_shared<ZeroCopyEnds>(small_pools(), false));
    parts.stage = parts.producer_ends->stager(absl::ZeroDuration());
  }
  // producer_ends, producer, consumer, stage.
  auto ends() { return std::tie(parts.producer_ends, *parts.producer, *parts.consumer, parts.stage); }
};

wire::Header data_to(const std::string& target, std::uint64_t id) {
  wire::Header h;
  h.kind = wire::MessageKind::kData;
  h.request_id = id;
  h.target = target;
  return h;
}

}  // namespace

TEST_CASE("the release protocol: handles go back in packets of at most kReleasesPerMessage; the producer frees each once",
          "[link]") {
  ShmPoolOptions pools;
  pools.min_slot_bytes = 4096;
  pools.slots_per_pool = kReleasesPerMessage + 8;  // one pool: every handle below leases a slot of it
  pools.max_total_bytes = std::size_t{64} << 20;
  ZeroCopyEnds ends(pools, false);
  const auto allocate = make_shm_allocator(ends.host_pool(), absl::ZeroDuration());
  const ShmStager stage = ends.stager(absl::ZeroDuration());
  std::vector<wire::ShmHandle> handles;
  for (std::size_t i = 0; i < kReleasesPerMessage + 5; ++i) {
    auto t = allocate({16}, at::kFloat);
    REQUIRE(t.ok());
    auto h = stage(*t);  // our own slot: shared as it lies, leased until the consumer releases it
    REQUIRE(h.ok());
    handles.push_back(*h);
  }
  REQUIRE(ends.host_stats().slots_in_use == handles.size());

  auto pair = PacketLink::pair();
  REQUIRE(pair.ok());
  auto& [consumer, producer] = *pair;
  CHECK(send_releases(*consumer, handles.data(), handles.size()) == handles.size());
  std::vector<std::size_t> per_packet;
  while (per_packet.size() < 2) {
    auto received = producer->receive(1000);
    REQUIRE(received.has_value());
    REQUIRE(received->frames.ok());
    auto message = decode_message(std::move(*received->frames));
    REQUIRE(message.ok());
    CHECK(message->header.kind == wire::MessageKind::kRelease);
    per_packet.push_back(message->header.message.size() / wire::kShmHandleBytes);
    CHECK(ends.take_releases(message->header).ok());
  }
  CHECK(per_packet == std::vector<std::size_t>{kReleasesPerMessage, 5});
  CHECK(ends.host_stats().slots_in_use == 0);
  CHECK(ends.host_stats().releases == handles.size());

  // The same handles again are stale: counted, nothing freed twice.
  CHECK(ends.take_releases(release_message(handles.data(), 3)).ok());
  CHECK(ends.host_stats().stale_releases == 3);
  // Not whole handles, or not a release: refused, named.
  wire::Header torn = release_message(handles.data(), 1);
  torn.message.pop_back();
  CHECK(ends.take_releases(torn).code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(ends.take_releases(torn).message()), Contains("whole number"));
  wire::Header data;
  data.kind = wire::MessageKind::kData;
  CHECK(ends.take_releases(data).code() == absl::StatusCode::kInvalidArgument);

  // A link whose peer has gone takes nothing: the caller keeps every handle.
  producer.reset();
  CHECK(send_releases(*consumer, handles.data(), handles.size()) == 0);
}

TEST_CASE("a zero-copy link's read() takes the peer's releases and returns its data as views of its memory, each view's "
          "death giving its handle back on the same link",
          "[link]") {
  LinkPair link;
  auto [producer_ends, producer, consumer, stage] = link.ends();

  const at::Tensor x = at::arange(1024, at::kFloat);
  REQUIRE(producer.send(data_to("blk", 7), {x}, &stage).ok());
  CHECK(producer_ends->host_stats().slots_in_use == 1);  // x's copy, lent to the consumer

  auto packet = consumer.read(1000);
  REQUIRE(packet.kind == Kind::kMessage);
  CHECK(packet.message.header.kind == wire::MessageKind::kData);
  CHECK(packet.message.header.request_id == 7);
  CHECK(packet.message.header.target == "blk");
  REQUIRE(packet.message.tensors.size() == 1);
  at::Tensor view = packet.message.tensors[0];
  packet.message.tensors.clear();
  CHECK(at::equal(view, x));
  CHECK(view.data_ptr() != x.data_ptr());

  // While the view lives, nothing comes back and the slot stays lent.
  CHECK(producer.read(0).kind == Kind::kNothing);
  CHECK(producer_ends->host_stats().slots_in_use == 1);

  view.reset();  // its release leaves now, on this link
  const auto back = producer.read(1000);
  CHECK(back.kind == Kind::kNothing);  // a release is taken, not returned
  CHECK(producer_ends->host_stats().slots_in_use == 0);
  CHECK(producer_ends->host_stats().releases == 1);
  CHECK(producer_ends->host_stats().stale_releases == 0);

  // Data and releases in one stream: the release is taken on the way to the data behind it.
  REQUIRE(producer.send(data_to("blk", 8), {x}, &stage).ok());
  auto second = consumer.read(1000);
  REQUIRE(second.kind == Kind::kMessage);
  second.message.tensors.clear();  // released
  REQUIRE(consumer.send(data_to("back", 9), {}).ok());
  const auto reply = producer.read(1000);
  REQUIRE(reply.kind == Kind::kMessage);
  CHECK(reply.message.header.request_id == 9);
  CHECK(producer_ends->host_stats().slots_in_use == 0);
  CHECK(producer_ends->host_stats().releases == 2);
}

TEST_CASE("a pool's descriptor crosses once per link, with the first packet naming it; a relay hands it on; a "
          "packet naming a pool never given is refused, its handles given back",
          "[link]") {
  auto first = PacketLink::pair();
  REQUIRE(first.ok());
  auto producer_ends = std::make_shared<ZeroCopyEnds>(small_pools(), false);
  const ShmStager stage = producer_ends->stager(absl::ZeroDuration());
  const at::Tensor x = at::arange(1024, at::kFloat);
  // The packets themselves, as PacketLink delivers them: descriptors counted.
  REQUIRE(send_packet(*first->first, data_to("b", 1), {x}, nullptr, &stage).ok());
  REQUIRE(send_packet(*first->first, data_to("b", 2), {x, x}, nullptr, &stage).ok());  // same pool: none
  auto one = first->second->receive(1000);
  auto two = first->second->receive(1000);
  REQUIRE((one && two));
  CHECK(one->fds.size() == 1);
  CHECK(two->fds.size() == 0);
  // Another link carries it again.
  auto second = PacketLink::pair();
  REQUIRE(second.ok());
  ZeroCopyLink to_relay(second->first, producer_ends);
  auto relay_ends = std::make_shared<ZeroCopyEnds>(small_pools(), false);
  ZeroCopyLink relay_in(second->second, relay_ends);
  REQUIRE(to_relay.send(data_to("b", 3), {x}, &stage).ok());
  auto got = relay_in.read(1000);
  REQUIRE(got.kind == Kind::kMessage);
  REQUIRE(got.message.tensors.size() == 1);
  const at::Tensor view = got.message.tensors[0];
  CHECK(at::equal(view, x));
  // The relay hands the view on to a third process as the same slot: the pool's descriptor, which
  // the relay was given, goes with it, and the third end reads the same bytes.
  auto third = PacketLink::pair();
  REQUIRE(third.ok());
  ZeroCopyLink relay_out(third->first, relay_ends);
  ZeroCopyLink last(third->second, std::make_shared<ZeroCopyEnds>(small_pools(), false));
  const ShmStager relay_stage = relay_ends->stager(absl::ZeroDuration());
  REQUIRE(ZeroCopyEnds::relays_as_is(view));
  REQUIRE(relay_out.send(data_to("c", 4), {view}, &relay_stage).ok());
  auto relayed = last.read(1000);
  REQUIRE(relayed.kind == Kind::kMessage);
  REQUIRE(relayed.message.tensors.size() == 1);
  CHECK(at::equal(relayed.message.tensors[0], x));
  CHECK(relay_ends->host_stats().bytes_staged == 0);  // handed on, not copied

  // A packet naming a pool its link never carried (sent here without descriptors): refused, named,
  // and its handle goes back to the producer.
  auto bare = PacketLink::pair();
  REQUIRE(bare.ok());
  ZeroCopyLink reader(bare->second, std::make_shared<ZeroCopyEnds>(small_pools(), false));
  const std::size_t in_use = producer_ends->host_stats().slots_in_use;
  auto encoded = encode_message(data_to("b", 5), {x}, nullptr, &stage);
  REQUIRE(encoded.ok());
  REQUIRE(producer_ends->host_stats().slots_in_use == in_use + 1);
  REQUIRE(bare->first->send({encoded->header, encoded->handles[0]}).ok());
  auto refused = reader.read(1000);
  REQUIRE(refused.kind == Kind::kMalformed);
  CHECK_THAT(std::string(refused.malformed.message()), Contains("never given"));
  auto release = bare->first->receive(1000);  // the reader's release of the refused handle
  REQUIRE(release.has_value());
  REQUIRE(release->frames.ok());
  auto message = decode_message(*std::move(release->frames));
  REQUIRE(message.ok());
  CHECK(producer_ends->take_releases(message->header).ok());
  CHECK(producer_ends->host_stats().slots_in_use == in_use);  // the refused handle's slot is free again
}

TEST_CASE("a retired pool is forgotten once its link is seen empty, and a sender naming it again sends its descriptor "
          "again; a descriptor that cannot be taken shuts the link",
          "[link]") {
  LinkPair link;
  auto [producer_ends, producer, consumer, stage] = link.ends();
  const at::Tensor x = at::arange(1024, at::kFloat);
  REQUIRE(producer.send(data_to("b", 1), {x}, &stage).ok());
  auto first = consumer.read(1000);
  REQUIRE(first.kind == Kind::kMessage);
  first.message.tensors.clear();
  CHECK(consumer.read(0).kind == Kind::kNothing);  // seen empty: nothing retired yet

  // The host sees the pool's producer (this process, here) die: its pools are retired.
  consumer.peer_died(::getpid());
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));  // the link looks once a second
  CHECK(consumer.read(0).kind == Kind::kNothing);  // seen retired, then the link seen empty: forgotten
  // A handle of it sent without its descriptor (a relay that looked at the flag just before it was
  // set) still resolves for one period more...
  auto late = encode_message(data_to("b", 2), {x}, nullptr, &stage);
  REQUIRE(late.ok());
  REQUIRE(link.producer_end->send({late->header, late->handles[0]}).ok());
  auto kept = consumer.read(1000);
  REQUIRE(kept.kind == Kind::kMessage);
  kept.message.tensors.clear();
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  CHECK(consumer.read(0).kind == Kind::kNothing);  // the period is over: dropped for good
  // ...and is refused after it.
  auto encoded = encode_message(data_to("b", 2), {x}, nullptr, &stage);
  REQUIRE(encoded.ok());
  REQUIRE(link.producer_end->send({encoded->header, encoded->handles[0]}).ok());
  auto refused = consumer.read(1000);
  REQUIRE(refused.kind == Kind::kMalformed);
  CHECK_THAT(std::string(refused.malformed.message()), Contains("never given"));
  // ...and a sender naming a retired pool sends its descriptor with every packet.
  REQUIRE(producer.send(data_to("b", 3), {x}, &stage).ok());
  auto again = consumer.read(1000);
  REQUIRE(again.kind == Kind::kMessage);
  REQUIRE(again.message.tensors.size() == 1);
  CHECK(at::equal(again.message.tensors[0], x));

  // A descriptor that is not a pool: refused, and the link is shut (the peer counts it as carried).
  auto bare = PacketLink::pair();
  REQUIRE(bare.ok());
  ZeroCopyLink reader(bare->second, std::make_shared<ZeroCopyEnds>(small_pools(), false));
  const int not_a_pool = ::memfd_create("not-a-pool", MFD_CLOEXEC);
  REQUIRE(not_a_pool >= 0);
  REQUIRE(::ftruncate(not_a_pool, 8192) == 0);
  auto again_encoded = encode_message(data_to("b", 4), {x}, nullptr, &stage);
  REQUIRE(again_encoded.ok());
  const std::uint64_t pool = again_encoded->staged[0].pool_id;
  REQUIRE(bare->first->send({again_encoded->header, again_encoded->handles[0]}, true, {pool},
                            [&](std::uint64_t key) { return LinkFd{key, not_a_pool, nullptr, nullptr}; }).ok());
  ::close(not_a_pool);  // the packet holds its own reference
  auto broken = reader.read(1000);
  REQUIRE(broken.kind == Kind::kMalformed);
  CHECK_THAT(std::string(broken.malformed.message()), Contains("not a memfd sealed at its size"));
  CHECK(reader.read(1000).kind == Kind::kClosed);
  // Only its reading side: the peer's sends fail, and it still gets this end's releases (so it
  // reclaims nothing under a tensor this end gave out).
  CHECK(bare->first->send({"x"}).code() == absl::StatusCode::kUnavailable);
  CHECK(send_releases(*bare->second, &again_encoded->staged[0], 1) == 1);
}

TEST_CASE("a zero-copy link reports a malformed release and a closed peer, and gives back what a failed send staged",
          "[link]") {
  auto pair = PacketLink::pair();
  REQUIRE(pair.ok());
  auto& [ours, theirs] = *pair;
  auto ends = std::make_shared<ZeroCopyEnds>(small_pools(), false);
  ZeroCopyLink link(ours, ends);

  wire::ShmHandle handle;
  wire::Header torn = release_message(&handle, 1);
  torn.message.pop_back();
  REQUIRE(send_packet(*theirs, torn, {}).ok());
  const auto malformed = link.read(1000);
  CHECK(malformed.kind == Kind::kMalformed);
  CHECK_FALSE(malformed.request_id.has_value());
  CHECK_THAT(std::string(malformed.malformed.message()), Contains("a release"));
  CHECK_THAT(std::string(malformed.malformed.message()), Contains("whole number"));

  REQUIRE(theirs->send({std::string_view("not a header")}).ok());  // a packet that is no message
  const auto garbage = link.read(1000);
  CHECK(garbage.kind == Kind::kMalformed);
  CHECK_FALSE(garbage.malformed.ok());

  theirs.reset();
  CHECK(link.read(1000).kind == Kind::kClosed);

  const ShmStager stage = ends->stager(absl::ZeroDuration());
  const auto sent = link.send(data_to("blk", 1), {at::ones({256})}, &stage);
  CHECK(sent.code() == absl::StatusCode::kUnavailable);
  CHECK(ends->host_stats().slots_in_use == 0);  // the slot staged for it is free again
}

TEST_CASE("a zero-copy link's read() takes at most kReleasePacketsPerRead release packets a call", "[link]") {
  auto pair = PacketLink::pair();
  REQUIRE(pair.ok());
  auto& [ours, theirs] = *pair;
  auto ends = std::make_shared<ZeroCopyEnds>(small_pools(), false);
  ZeroCopyLink link(ours, ends);

  // A peer streaming releases (stale ones: counted and ignored), then one message.
  const int streamed = kReleasePacketsPerRead + kReleasePacketsPerRead / 2;
  wire::ShmHandle stale;
  stale.pool_id = 42;
  for (int i = 0; i < streamed; ++i) REQUIRE(send_packet(*theirs, release_message(&stale, 1), {}).ok());
  REQUIRE(send_packet(*theirs, data_to("blk", 7), {}).ok());

  const auto first = link.read(1000);
  CHECK(first.kind == Kind::kNothing);  // back to its caller with releases still queued
  CHECK(ends->host_stats().stale_releases == static_cast<std::uint64_t>(kReleasePacketsPerRead));
  const auto second = link.read(1000);
  REQUIRE(second.kind == Kind::kMessage);
  CHECK(second.message.header.request_id == 7);
  CHECK(ends->host_stats().stale_releases == static_cast<std::uint64_t>(streamed));
}

TEST_CASE("a view keeps its link open: the producer sees the consumer's end close only once its last view has died",
          "[link]") {
  auto pair = PacketLink::pair();
  REQUIRE(pair.ok());
  auto& [ours, theirs] = *pair;
  auto ends = std::make_shared<ZeroCopyEnds>(small_pools(), false);
  ZeroCopyLink producer(std::move(ours), ends);
  const ShmStager stage = ends->stager(absl::ZeroDuration());
  REQUIRE(producer.send(data_to("blk", 1), {at::full({512}, 3.0)}, &stage).ok());

  at::Tensor view;
  {
    ZeroCopyLink consumer(std::move(theirs), std::make_shared<ZeroCopyEnds>(small_pools(), false));
    auto packet = consumer.read(1000);
    REQUIRE(packet.kind == Kind::kMessage);
    view = packet.message.tensors.at(0);
  }  // the consumer's end is gone; the view holds its link
  CHECK(producer.read(50).kind == Kind::kNothing);
  CHECK(ends->host_stats().slots_in_use == 1);
  CHECK(view[0].item<float>() == 3.0F);

  view.reset();  // the release, then the end of the link
  auto last = producer.read(1000);
  if (last.kind == Kind::kNothing) last = producer.read(1000);  // the close came after the release was taken
  CHECK(last.kind == Kind::kClosed);
  CHECK(ends->host_stats().slots_in_use == 0);
  CHECK(ends->host_stats().releases == 1);
}
