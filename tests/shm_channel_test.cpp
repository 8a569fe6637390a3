// The shared-memory zero-copy protocol (ShmProducer / ShmConsumer / the codec's handle frames):
// the consumer's tensor lies in the mapped pool and nothing is copied in the hand-off; slots come
// back when the last view dies; no credit -> wait then a named error; stale, forged and
// out-of-range handles are rejected; reclaim after a consumer's death; pools bounded and unlinked.
#include "shm_util.hpp"
#include "worker_util.hpp"

#include <blockflow/channel/detail/shm_pool.hpp>
#include <blockflow/channel/detail/tensor_codec.hpp>
#include <blockflow/worker/worker_site.hpp>

#include <fmt/format.h>
#include <zmq_addon.hpp>

#include <csignal>
#include <filesystem>
#include <future>
#include <map>
#include <set>
#include <fstream>
#include <sstream>

using namespace blockflow;
using namespace blockflow::detail;
using Catch::Matchers::Contains;

namespace {

// The file behind the mapping that holds `address` in this process ("" when anonymous or none).
std::string mapping_file(const void* address) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  const auto a = reinterpret_cast<std::uintptr_t>(address);
  while (std::getline(maps, line)) {
    std::uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream in(line);
    in >> std::hex >> lo >> dash >> hi;
    if (a < lo || a >= hi) continue;
    const auto slash = line.find('/');
    return slash == std::string::npos ? "" : line.substr(slash);
  }
  return "";
}

// A producer and a consumer joined by an inproc PUSH/PULL pair, like the two ends of an edge.
struct Edge {
  zmq::context_t context{1};
  zmq::socket_t push{context, zmq::socket_type::push}, pull{context, zmq::socket_type::pull};
  ShmProducer producer;
  ShmConsumer consumer;
  std::set<std::uint64_t> given;  // the pools whose descriptors the consumer got
  ShmStager stager;
  ShmResolver resolver;

  explicit Edge(ShmPoolOptions options = {}) : producer(options) {
    pull.bind("inproc://edge");
    push.connect("inproc://edge");
    stager = make_stager(producer, absl::Milliseconds(50));
    // The release message's trip is a direct call here; the worker channel sends it as kRelease.
    resolver = make_resolver(consumer, [this](const wire::ShmHandle& h) { producer.release(h); });
  }

  absl::StatusOr<DecodedMessage> hand_off(const Tensors& tensors) {
    wire::Header h;
    h.request_id = 1;
    auto sent = send_message(push, h, tensors, zmq::send_flags::none, nullptr, &stager);
    if (!sent.ok()) return sent.status();
    std::vector<zmq::message_t> frames;
    (void)zmq::recv_multipart(pull, std::back_inserter(frames));
    give_pools(frames);
    return decode_message(std::move(frames), &resolver);
  }

  // What the data link does: the first message that names a pool brings its descriptor.
  void give_pools(const std::vector<zmq::message_t>& frames) {
    for (std::size_t i = 1; i < frames.size(); ++i) {
      auto h = wire::decode_shm_handle(frames[i].data(), frames[i].size());
      if (h.ok() && given.insert(h->pool_id).second) test::give_pool(consumer, h->pool_id);
    }
  }
};

}  // namespace

TEST_CASE("shm hand-off: the consumer's tensor is a view of the mapped pool, nothing copied", "[shm]") {
  Edge edge;
  const Tensor x = at::randn({256, 56, 56});  // 3.2 MB
  auto got = edge.hand_off({x, at::arange(10, at::kLong)});
  INFO(got.status().ToString());
  REQUIRE(got.ok());
  CHECK((got->header.flags & wire::kFlagShmHandles) != 0);
  CHECK(got->bytes_copied == 0);
  REQUIRE(got->tensors.size() == 2);
  CHECK(at::equal(got->tensors[0], x));
  CHECK(at::equal(got->tensors[1], at::arange(10, at::kLong)));
  // The consumer's data pointer lies in its own mapping of a BlockFlow pool, not in the heap and
  // not in the producer's mapping.
  const std::string file = mapping_file(got->tensors[0].data_ptr());
  CHECK_THAT(file, Contains("/memfd:blockflow-"));
  CHECK(edge.consumer.pools_mapped() == 1);  // both in the 4 MB class: it had free slots
  const auto stats = edge.producer.stats();
  CHECK(stats.handles == 2);
  CHECK(stats.slots_in_use == 2);
  CHECK(stats.bytes_staged == static_cast<std::uint64_t>(x.numel() * 4 + 80));
}

TEST_CASE("shm slots come back when the last view dies, and are reused", "[shm]") {
  Edge edge;
  auto got = edge.hand_off({at::ones({1000})});
  REQUIRE(got.ok());
  Tensor view = got->tensors[0].slice(0, 10, 20);
  got->tensors.clear();
  CHECK(edge.producer.stats().slots_in_use == 1);  // the slice still uses it
  CHECK(view.sum().item<double>() == 10.0);
  view = Tensor();
  auto s = edge.producer.stats();
  CHECK(s.slots_in_use == 0);
  CHECK(s.releases == 1);
  for (int i = 0; i < 20; ++i) {
    auto again = edge.hand_off({at::full({1000}, i)});
    REQUIRE(again.ok());
    CHECK(again->tensors[0][999].item<double>() == i);
  }
  s = edge.producer.stats();
  CHECK(s.pools == 1);
  CHECK(s.handles == 21);
  CHECK(s.slots_in_use == 0);
}

TEST_CASE("shm credits: an exhausted pool waits, then fails naming the size; a release frees a credit", "[shm]") {
  ShmPoolOptions options;
  options.slots_per_pool = 2;
  options.max_total_bytes = 3u << 20;  // one pool of 2 x 1 MB
  Edge edge(options);
  auto a = edge.hand_off({at::ones({100})});
  auto b = edge.hand_off({at::ones({100})});
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  auto c = edge.hand_off({at::ones({100})});
  CHECK(absl::IsDeadlineExceeded(c.status()));
  CHECK_THAT(std::string(c.status().message()), Contains("tensor 0: no free shared-memory slot for 400 bytes: 2 slot(s) in use"));
  CHECK(edge.producer.stats().credit_waits == 1);
  a->tensors.clear();
  auto d = edge.hand_off({at::ones({100})});
  CHECK(d.ok());
  auto huge = edge.hand_off({at::ones({1 << 20})});  // 4 MB never fits under 3 MB
  CHECK(absl::IsResourceExhausted(huge.status()));
  CHECK_THAT(std::string(huge.status().message()), Contains("4194304 bytes does not fit in shared memory"));
}

TEST_CASE("shm handles: stale, forged and out-of-range ones are rejected with the reason", "[shm]") {
  ShmProducer producer;
  ShmConsumer consumer;
  std::vector<float> bytes(256, 1.0f);
  auto h = producer.stage(bytes.data(), 1024, absl::Now());
  REQUIRE(h.ok());
  test::give_pool(consumer, h->pool_id);
  REQUIRE(consumer.resolve(*h, 1024).ok());

  wire::ShmHandle forged = *h;
  forged.pool_id ^= 0x5A5A5A5A;
  CHECK_THAT(std::string(consumer.resolve(forged, 1024).status().message()), Contains("never given"));
  forged = *h;
  forged.slot = 9;
  CHECK_THAT(std::string(consumer.resolve(forged, 1024).status().message()), Contains("slot 9 out of range"));
  forged = *h;
  forged.offset = (1u << 20) - 8;
  CHECK_THAT(std::string(consumer.resolve(forged, 1024).status().message()), Contains("exceeds the slot"));
  forged = *h;
  forged.offset = ~std::uint64_t{0};
  CHECK_THAT(std::string(consumer.resolve(forged, 1024).status().message()), Contains("exceeds the slot"));
  forged = *h;
  forged.generation += 1;
  CHECK_THAT(std::string(consumer.resolve(forged, 1024).status().message()), Contains("stale or forged"));
  CHECK_FALSE(producer.release(forged));

  REQUIRE(producer.release(*h));
  CHECK_FALSE(producer.release(*h));  // twice
  CHECK(producer.stats().stale_releases == 2);
  CHECK_THAT(std::string(consumer.resolve(*h, 1024).status().message()), Contains("stale or forged"));
  auto reused = producer.stage(bytes.data(), 1024, absl::Now());  // same slot, next generation
  REQUIRE(reused.ok());
  CHECK(reused->slot == h->slot);
  CHECK(reused->generation > h->generation);
  CHECK_FALSE(consumer.resolve(*h, 1024).ok());
  CHECK(consumer.resolve(*reused, 1024).ok());
}

TEST_CASE("shm: a message refused part-way gives back the handles that did not become tensors", "[shm]") {
  Edge edge;
  // The second of three handles cannot be resolved (a pool never given, say).
  ShmResolver failing = edge.resolver;
  int calls = 0;
  failing.resolve = [&](const wire::TensorDesc& desc, const wire::ShmHandle& h, at::ScalarType type) -> absl::StatusOr<Tensor> {
    if (++calls == 2) return absl::InvalidArgumentError("cannot map it");
    return edge.resolver.resolve(desc, h, type);
  };
  wire::Header header;
  header.request_id = 3;
  auto sent = send_message(edge.push, header, {at::ones({64}), at::ones({64}), at::ones({64})}, zmq::send_flags::none, nullptr,
                           &edge.stager);
  REQUIRE(sent.ok());
  CHECK(edge.producer.stats().slots_in_use == 3);
  std::vector<zmq::message_t> frames;
  (void)zmq::recv_multipart(edge.pull, std::back_inserter(frames));
  edge.give_pools(frames);
  auto got = decode_message(std::move(frames), &failing);
  REQUIRE_FALSE(got.ok());
  CHECK_THAT(std::string(got.status().message()), Contains("tensor 1: cannot map it"));
  CHECK(calls == 2);  // the third was never resolved
  // The first tensor was made and died with the refusal; the second and third were given back.
  CHECK(edge.producer.stats().slots_in_use == 0);
  CHECK(edge.producer.stats().releases == 3);
  CHECK(edge.producer.stats().stale_releases == 0);
}

TEST_CASE("shm reclaim: a dead consumer's slots return; a consumer's tensor outlives the producer", "[shm]") {
  ShmConsumer consumer;
  Tensor survivor;
  {
    ShmProducer producer;
    std::vector<float> bytes(256, 2.0f);
    auto a = producer.stage(bytes.data(), 1024, absl::Now());
    auto b = producer.stage(bytes.data(), 1024, absl::Now());
    REQUIRE(a.ok());
    REQUIRE(b.ok());
    test::give_pool(consumer, a->pool_id);
    auto view = consumer.resolve(*a, 1024);
    REQUIRE(view.ok());
    survivor = at::from_blob(view->data, {256}, [keep = view->keep](void*) {}, at::kFloat);
    CHECK(producer.reclaim_all() == 2);
    const auto s = producer.stats();
    CHECK(s.reclaims == 2);
    CHECK(s.slots_in_use == 0);
    CHECK_FALSE(consumer.resolve(*b, 1024).ok());  // reclaimed: its handle is stale
  }
  // A consumer's mapping outlives the producer: its tensor stays readable.
  CHECK(survivor.sum().item<double>() == 512.0);
}

// ---------------------------------------------------------------------------------------------------
// The same protocol between a session and its worker processes (WorkerOptions::channel).

TEST_CASE("split small CNN: threads, shm workers and zmq workers give equal outputs; shm relays without copies",
          "[shm]") {
  std::map<std::string, std::unique_ptr<Session>> sessions;
  for (const std::string channel : {"threads", "shm", "zmq"}) {
    auto session = std::make_unique<Session>();
    const bool workers = channel != "threads";
    if (workers) session->add_site(make_worker(test::test_worker("w1", channel))).add_site(make_worker(test::test_worker("w2", channel)));
    session->add_block(test::model_block("b1", "cnn_block1.pt", workers ? "w1" : "", {-1, 3, 16, 16}))
        .add_block(test::model_block("b2", "cnn_block2.pt", workers ? "w2" : "", {-1, 8, 16, 16}))
        .add_block(test::model_block("b3", "cnn_block3.pt", workers ? "w1" : "", {-1, 16, 8, 8}))
        .add_path(Path::chain("cnn", {"b1", "b2", "b3"}));
    test::require_started(*session);
    sessions[channel] = std::move(session);
  }
  at::manual_seed(5);
  for (int i = 0; i < 8; ++i) {
    const Tensor x = at::randn({1 + i % 4, 3, 16, 16});
    Result reference = sessions["threads"]->submit("cnn", x).get();
    REQUIRE(reference.ok());
    for (const std::string channel : {"shm", "zmq"}) {
      Result r = sessions[channel]->submit("cnn", x).get();
      INFO(channel << ": " << r.status.ToString());
      REQUIRE(r.ok());
      CHECK(at::equal(r.output(), reference.output()));
      if (channel == "shm") CHECK_THAT(mapping_file(r.output().data_ptr()), Contains("/memfd:blockflow-"));
    }
  }
  const auto shm = sessions["shm"]->metrics();
  REQUIRE(shm.sites.size() == 2);
  for (const auto& site : shm.sites) {
    CHECK(site.data.kind == "shm");
    CHECK(site.data.bytes_copied == 0);
    CHECK(site.shm_requests.handles == site.data.sent);
  }
  // w1 gets the images (copied into the host's pool once) and b2's outputs; w2 gets only b1's
  // outputs, which the host relays as w1's own slots: no pool, no copy for w2 at the host.
  CHECK(shm.sites[0].shm_requests.slots_total >= 1);
  CHECK(shm.sites[0].shm_requests.forwarded == 8);
  CHECK(shm.sites[1].shm_requests.forwarded == 8);
  CHECK(shm.sites[1].shm_requests.bytes_staged == 0);
  CHECK(shm.sites[1].shm_requests.slots_total == 0);
  // A relayed result goes to the next worker from the thread that received it, not through the
  // block's queue; the images (not in a slot) go through b1's queue.
  const auto block = [&](const std::string& name) {
    for (const auto& b : shm.blocks) {
      if (b.name == name) return b;
    }
    FAIL("no block " << name);
    return BlockMetrics{};
  };
  CHECK(block("b1").handed_directly == 0);
  CHECK(block("b2").handed_directly == 8);
  CHECK(block("b3").handed_directly == 8);
  CHECK(sessions["zmq"]->metrics().sites.at(0).data.kind == "zmq-ipc");
}

TEST_CASE("shm workers: a block's output is copied into a result slot; with outputs in slots it is allocated there",
          "[shm]") {
  for (const bool in_slots : {true, false}) {
    WorkerOptions options = test::test_worker("w1", "shm");
    options.shm_outputs_in_slots = in_slots;
    Session session;
    session.add_site(make_worker(options))
        .add_block(test::plugin_block("affine", "affine", "w1"))
        .add_path(Path::chain("t", {"affine"}));
    test::require_started(session);
    constexpr int kRequests = 6;
    const Tensor x = at::arange(262144, at::kFloat);  // 1 MB: above the allocator's half-slot floor
    for (int i = 0; i < kRequests; ++i) {
      Result r = session.submit("t", x + i).get();
      INFO(r.status.ToString());
      REQUIRE(r.ok());
      CHECK(at::equal(r.output(), (x + i) * 3 + 1));
      CHECK_THAT(mapping_file(r.output().data_ptr()), Contains("/memfd:blockflow-"));
    }
    // The worker's pool figures come with its heartbeats.
    SiteStats site;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while ((site = session.metrics().sites.at(0)).shm_results.handles < kRequests &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    INFO("in_slots " << in_slots);
    REQUIRE(site.shm_results.handles == kRequests);
    if (in_slots) {
      CHECK(site.shm_results.bytes_staged == 0);
      CHECK(site.shm_results.leases >= kRequests);
    } else {
      CHECK(site.shm_results.bytes_staged == std::uint64_t{kRequests} * 262144 * 4);
    }
  }
}

TEST_CASE("shm workers: the worker a killed worker's results were relayed to lets go of its pools", "[shm]") {
  auto w1 = make_worker(test::test_worker("w1", "shm"));
  auto w2 = make_worker(test::test_worker("w2", "shm"));
  Session session;
  session.add_site(w1)
      .add_site(w2)
      .add_block(test::model_block("b1", "cnn_block1.pt", "w1", {-1, 3, 16, 16}))
      .add_block(test::model_block("b2", "cnn_block2.pt", "w2", {-1, 8, 16, 16}))
      .add_path(Path::chain("cnn", {"b1", "b2"}));
  test::require_started(session);
  const Tensor x = at::randn({2, 3, 16, 16});
  for (int i = 0; i < 4; ++i) REQUIRE(session.submit("cnn", x).get().ok());
  const std::int64_t dead = w1->pid();
  REQUIRE_FALSE(test::pools_mapped_by(w2->pid(), dead).empty());  // w1's result slots reached w2 as they lay
  REQUIRE(::kill(static_cast<pid_t>(dead), SIGKILL) == 0);
  // w1 comes back (a new process, with pools of its own) and the path serves again.
  REQUIRE(test::eventually([&] { return w1->pid() > 0 && w1->pid() != dead && session.submit("cnn", x).get().ok(); },
                           std::chrono::seconds(30)));
  // The host retired the dead w1's pools; w2 drops them (it looks once a second) and maps none of
  // them any more: a worker killed again and again costs its peers nothing that lasts.
  CHECK(test::eventually([&] { return test::pools_mapped_by(w2->pid(), dead).empty(); }, std::chrono::seconds(10)));
  CHECK(session.submit("cnn", x).get().ok());
}

TEST_CASE("shm workers with outputs in slots: a block's weights, made when it is built, stay out of the result slots", "[shm]") {
  WorkerOptions options = test::test_worker("w1", "shm");
  options.shm_outputs_in_slots = true;  // off by default: then nothing at all is allocated in slots
  Session session;
  session.add_site(make_worker(options))
      .add_block(test::plugin_block("weighted", "weighted", "w1"))
      .add_path(Path::chain("t", {"weighted"}));
  test::require_started(session);
  {
    Result r = session.submit("t", at::zeros({4})).get();
    INFO(r.status.ToString());
    REQUIRE(r.ok());
    CHECK(at::equal(r.output(), at::ones({4})));
  }  // the result's slot goes back to w1
  SiteStats site;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (((site = session.metrics().sites.at(0)).shm_results.handles < 1 || site.shm_results.slots_in_use > 0) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  REQUIRE(site.shm_results.handles == 1);
  CHECK(site.shm_results.slots_in_use == 0);
  CHECK(site.shm_results.leases == 0);  // the 1 MB weight was allocated while the block was built
}

TEST_CASE("shm workers: kill -9 under load reclaims the host's slots; traffic flows again", "[shm]") {
  auto site = make_worker(test::test_worker("w1", "shm"));
  Session session;
  BlockDescription slow = test::plugin_block("slow", "slow_identity", "w1");
  slow.options.queue_capacity = 64;
  session.add_site(site).add_block(slow).add_path(Path::chain("t", {"slow"}));
  test::require_started(session);
  // Fill the worker: requests whose inputs (host slots) sit in its queue.
  std::vector<std::future<Result>> pending;
  for (int i = 0; i < 20; ++i) pending.push_back(session.submit("t", at::full({1000}, i)));
  const auto busy_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (session.metrics().sites.at(0).shm_requests.slots_in_use < 5 && std::chrono::steady_clock::now() < busy_deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  REQUIRE(session.metrics().sites.at(0).shm_requests.slots_in_use >= 5);
  REQUIRE(::kill(static_cast<pid_t>(site->pid()), SIGKILL) == 0);
  const auto killed = std::chrono::steady_clock::now();
  while (session.metrics().sites.at(0).shm_requests.slots_in_use > 0 && std::chrono::steady_clock::now() < killed + std::chrono::seconds(5)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const auto m = session.metrics().sites.at(0);
  CHECK(m.shm_requests.slots_in_use == 0);
  CHECK(m.shm_requests.reclaims >= 5);
  int failed = 0;
  for (auto& f : pending) {
    Result r = f.get();  // every request resolves: done before the kill, or failed naming the worker
    if (!r.ok()) {
      ++failed;
      CHECK_THAT(std::string(r.status.message()), Contains("worker w1"));
    }
  }
  CHECK(failed >= 1);
  // The restarted worker maps the same host pools again (their slots are free) and serves.
  Result after;
  after.status = absl::UnavailableError("not submitted yet");
  for (int i = 0; i < 200 && !after.ok(); ++i) {
    after = session.submit("t", at::full({1000}, 7.0)).get();
    if (!after.ok()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  REQUIRE(after.ok());
  CHECK(after.output()[999].item<double>() == 7.0);
}

TEST_CASE("shm over TCP is refused by name; an unknown channel too", "[shm]") {
  WorkerOptions o = test::test_worker("far", "shm");
  o.listen = "tcp://127.0.0.1:1";
  Session session;
  session.add_site(make_worker(o)).add_block(test::plugin_block("affine", "affine", "far")).add_path(Path::chain("t", {"affine"}));
  const auto status = session.start();
  CHECK_THAT(std::string(status.message()), Contains("worker far: channel 'shm' needs a worker on this host"));
  WorkerOptions bad = test::test_worker("w9", "carrier-pigeon");
  Session other;
  other.add_site(make_worker(bad)).add_block(test::plugin_block("affine", "affine", "w9")).add_path(Path::chain("t", {"affine"}));
  CHECK_THAT(std::string(other.start().message()), Contains("worker w9: channel 'carrier-pigeon' is not shm, cuda or zmq"));
}

TEST_CASE("shm workers: without credits a kReject block fails the request at once, naming it", "[shm]") {
  WorkerOptions o = test::test_worker("w1", "shm");
  o.shm_slots_per_pool = 2;
  o.shm_max_bytes = 3u << 20;  // the host's pool: 2 slots of 1 MB
  BlockDescription slow = test::plugin_block("slow", "slow_identity", "w1");
  slow.options.full_policy = FullPolicy::kReject;
  Session session;
  session.add_site(make_worker(o)).add_block(slow).add_path(Path::chain("t", {"slow"}));
  test::require_started(session);
  // Outputs held here keep the worker's slots; inputs held by the worker's queue keep ours: with
  // more requests than slots some must be refused.
  std::vector<std::future<Result>> pending;
  for (int i = 0; i < 40; ++i) pending.push_back(session.submit("t", at::full({1000}, i)));
  int ok = 0, refused = 0;
  for (auto& f : pending) {
    Result r = f.get();
    if (r.ok()) {
      ++ok;
    } else {
      ++refused;
      CHECK(absl::IsDeadlineExceeded(r.status));
      CHECK_THAT(std::string(r.status.message()), Contains("worker w1: block 'slow': cannot send") &&
                                                      Contains("no free shared-memory slot"));
    }
  }
  CHECK(ok >= 2);
  CHECK(refused >= 1);
  CHECK(session.metrics().sites.at(0).shm_requests.credit_waits >= 1);
}

TEST_CASE("shm workers: a worker whose data link breaks while it lives is restarted; traffic flows", "[shm]") {
  auto site = make_worker(test::test_worker("w1", "shm"));
  Session session;
  session.add_site(site)
      .add_block(test::plugin_block("cut", "cut_data_link", "w1"))
      .add_block(test::plugin_block("affine", "affine", "w1"))
      .add_path(Path::chain("cut", {"cut"}))
      .add_path(Path::chain("t", {"affine"}));
  test::require_started(session);
  const std::int64_t first_pid = site->pid();
  // Its answer cannot leave: the request fails, naming the worker and why, once it is killed.
  Result cut = session.submit("cut", at::ones({4})).get();
  REQUIRE_FALSE(cut.ok());
  CHECK_THAT(std::string(cut.status.message()), Contains("worker w1 lost its data link"));
  CHECK(test::eventually([&] { return site->pid() != 0 && site->pid() != first_pid; }, std::chrono::milliseconds(20000)));
  Result r;
  CHECK(test::eventually([&] {
    r = session.submit("t", at::ones({4})).get();
    return r.ok();
  }, std::chrono::milliseconds(20000)));
  REQUIRE(r.ok());
  CHECK(at::equal(r.output(), at::full({4}, 4.0)));
  CHECK(session.metrics().sites.at(0).restarts == 1);
}

TEST_CASE("shm workers: a request whose tensors cannot all be staged gives back the slots it took", "[shm]") {
  WorkerOptions o = test::test_worker("w1", "shm");
  o.shm_slots_per_pool = 2;
  o.shm_max_bytes = 3u << 20;  // the host's pool: 2 slots of 1 MB
  BlockDescription block = test::plugin_block("affine", "affine", "w1");
  block.options.full_policy = FullPolicy::kReject;  // staging never waits for a credit
  Session session;
  session.add_site(make_worker(o)).add_block(block).add_path(Path::chain("t", {"affine"}));
  test::require_started(session);
  // Three inputs, two slots: the third cannot be staged, and the two staged ones must come back.
  Result r = session.submit("t", Tensors{at::ones({1000}), at::ones({1000}), at::ones({1000})}).get();
  REQUIRE_FALSE(r.ok());
  CHECK_THAT(std::string(r.status.message()), Contains("tensor 2") && Contains("no free shared-memory slot"));
  CHECK(session.metrics().sites.at(0).shm_requests.slots_in_use == 0);
  for (int i = 0; i < 3; ++i) {
    // kReject never waits for a credit: let the worker's release of the last request's slot land
    // first (it travels after the result).
    REQUIRE(test::eventually([&] { return session.metrics().sites.at(0).shm_requests.slots_in_use == 0; }));
    Result ok = session.submit("t", at::full({1000}, i)).get();
    INFO(ok.status.ToString());
    REQUIRE(ok.ok());
    CHECK(at::equal(ok.output(), at::full({1000}, 3.0 * i + 1)));
  }
}

TEST_CASE("a tensor allocated in a slot crosses as its handle: no copy at the producer either", "[shm]") {
  Edge edge;
  const ShmAllocator allocate = make_shm_allocator(edge.producer, absl::Milliseconds(50));
  auto y = allocate({256, 56, 56}, at::kFloat);  // the producer writes its output here
  REQUIRE(y.ok());
  y->copy_(at::arange(256 * 56 * 56, at::kFloat).view({256, 56, 56}));
  CHECK(edge.producer.stats().leases == 1);
  CHECK(edge.producer.stats().slots_in_use == 1);
  // A contiguous slice of it crosses too, as the same slot at an offset.
  auto got = edge.hand_off({*y, y->select(0, 3)});
  INFO(got.status().ToString());
  REQUIRE(got.ok());
  CHECK(at::equal(got->tensors[0], *y));
  CHECK(at::equal(got->tensors[1], y->select(0, 3)));
  CHECK(edge.producer.stats().bytes_staged == 0);  // nothing copied anywhere
  CHECK(edge.producer.stats().handles == 2);
  CHECK(edge.producer.stats().slots_in_use == 1);  // one slot, held by both sides
  CHECK_THAT(mapping_file(got->tensors[0].data_ptr()), Contains("/memfd:blockflow-"));
  CHECK(got->tensors[0].data_ptr() != y->data_ptr());  // the consumer's own mapping of the same bytes
  CHECK(static_cast<const char*>(got->tensors[1].data_ptr()) ==
        static_cast<const char*>(got->tensors[0].data_ptr()) + 3 * 56 * 56 * 4);
  // The slot is free once the producer's tensor and both consumer views are gone, in any order.
  *y = Tensor();
  CHECK(edge.producer.stats().slots_in_use == 1);
  got->tensors.clear();
  CHECK(edge.producer.stats().slots_in_use == 0);
  CHECK(edge.producer.stats().releases == 2);
  // A dead consumer's holds are dropped; the producer's own tensor keeps its slot.
  auto z = allocate({1000}, at::kFloat);
  REQUIRE(z.ok());
  z->fill_(2);
  auto held = edge.hand_off({*z});
  REQUIRE(held.ok());
  CHECK(edge.producer.reclaim_all() == 1);
  CHECK(edge.producer.stats().slots_in_use == 1);
  CHECK(z->sum().item<double>() == 2000);
  *z = Tensor();
  CHECK(edge.producer.stats().slots_in_use == 0);
  held->tensors.clear();  // its late release matches nothing now: counted stale, changes nothing
  CHECK(edge.producer.stats().slots_in_use == 0);
  CHECK(edge.producer.stats().stale_releases == 1);
}
