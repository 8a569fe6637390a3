// ShmProducer's pools on their own (no channel, no codec): each pool is a sealed memfd that no
// process can shrink or open by name, a consumer maps only what it was given and refuses what is not
// such a pool; stage() copies without the pool's lock.
#include "shm_util.hpp"

#include <blockflow/channel/detail/shm_pool.hpp>

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <future>
#include <string>
#include <thread>
#include <utility>
#include <vector>

using namespace blockflow;
using namespace blockflow::detail;
using blockflow::test::give_pool;

namespace {

constexpr int kSealed = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

// A memfd of `bytes` bytes whose first bytes are `header` (a forged pool), sealed with `seals`.
int crafted_pool(std::size_t bytes, const std::vector<std::uint64_t>& header, int seals) {
  const int fd = ::memfd_create("crafted", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  REQUIRE(fd >= 0);
  REQUIRE(::ftruncate(fd, static_cast<off_t>(bytes)) == 0);
  REQUIRE(::pwrite(fd, header.data(), header.size() * 8, 0) == static_cast<ssize_t>(header.size() * 8));
  if (seals != 0) REQUIRE(::fcntl(fd, F_ADD_SEALS, seals) == 0);
  return fd;
}

}  // namespace

TEST_CASE("shm pools are sealed memfds: no name in /dev/shm, and nobody can shrink or grow one, even by /proc", "[shm]") {
  ShmProducer producer;
  std::vector<float> bytes(256, 1.0f);
  auto h = producer.stage(bytes.data(), 1024, absl::Now());
  REQUIRE(h.ok());
  CHECK_FALSE(std::filesystem::exists(fmt::format("/dev/shm/blockflow-{:016x}", h->pool_id)));
  const ShmPoolFd pool = shm_pool_fd(h->pool_id);
  REQUIRE(pool.fd >= 0);
  const int seals = ::fcntl(pool.fd, F_GET_SEALS);
  CHECK((seals & F_SEAL_SHRINK) != 0);
  CHECK((seals & F_SEAL_GROW) != 0);
  CHECK((seals & F_SEAL_SEAL) != 0);  // and no seal can be taken off or added
  // What another process of the same user could do: open it through /proc (a new open file) and
  // truncate it. Refused: a consumer's reads can never run past the pool's end (SIGBUS).
  const int reopened = ::open(fmt::format("/proc/self/fd/{}", pool.fd).c_str(), O_RDWR | O_CLOEXEC);
  REQUIRE(reopened >= 0);
  struct stat st {};
  REQUIRE(::fstat(reopened, &st) == 0);
  errno = 0;
  CHECK(::ftruncate(reopened, 4096) != 0);
  CHECK(errno == EPERM);
  CHECK(::ftruncate(reopened, st.st_size + 4096) != 0);
  CHECK(::fcntl(reopened, F_ADD_SEALS, F_SEAL_WRITE) != 0);
  ::close(reopened);
  CHECK(shm_pool_fd(h->pool_id ^ 1).fd == -1);  // no such pool here
}

TEST_CASE("shm consumer: only a sealed BlockFlow pool is adopted; a handle of a pool never given is refused", "[shm]") {
  ShmProducer producer;
  std::vector<float> bytes(256, 4.0f);
  auto h = producer.stage(bytes.data(), 1024, absl::Now());
  REQUIRE(h.ok());
  ShmConsumer consumer;
  CHECK_THAT(std::string(consumer.resolve(*h, 1024).status().message()), Catch::Matchers::Contains("never given"));
  give_pool(consumer, h->pool_id);
  auto view = consumer.resolve(*h, 1024);
  REQUIRE(view.ok());
  CHECK(static_cast<const float*>(view->data)[255] == 4.0f);
  CHECK(consumer.pools_mapped() == 1);
  give_pool(consumer, h->pool_id);  // given again (a retired pool, relayed): the same mapping stays
  CHECK(consumer.resolve(*h, 1024)->data == view->data);
  CHECK(consumer.pools_mapped() == 1);

  // A valid-looking header: magic "BFSP", version 1, id, 1 slot of 4096 bytes at 4096.
  const std::vector<std::uint64_t> header{0x0000000150534642ULL, 0x1234, 1, 4096, 4096};
  auto refusal = [&](int fd) { return std::string(consumer.adopt(fd).status().message()); };
  using Catch::Matchers::Contains;
  CHECK_THAT(refusal(crafted_pool(8192, header, 0)), Contains("not a memfd sealed at its size"));
  CHECK_THAT(refusal(crafted_pool(8192, header, F_SEAL_GROW)), Contains("not a memfd sealed at its size"));
  CHECK_THAT(refusal(crafted_pool(8192, header, F_SEAL_SHRINK | F_SEAL_GROW)), Contains("not a memfd sealed at its size"));
  CHECK_THAT(refusal(crafted_pool(8192, {0x0000000150534642ULL, 0x1234, 1, 1 << 20, 4096}, kSealed)),
             Contains("header is malformed"));  // its slot runs past its end
  CHECK_THAT(refusal(crafted_pool(8192, {0xdeadbeef}, kSealed)), Contains("header is malformed"));
  CHECK_THAT(refusal(crafted_pool(1024, header, kSealed)), Contains("too small"));
  // Larger than its header says (a sparse memfd of any size would take the consumer's address space).
  CHECK_THAT(refusal(crafted_pool(std::size_t{1} << 30, header, kSealed)), Contains("does not match its size"));
  int pipe_fds[2] = {-1, -1};
  REQUIRE(::pipe(pipe_fds) == 0);
  ::close(pipe_fds[1]);
  CHECK_THAT(refusal(pipe_fds[0]), Contains("not a memfd"));
  auto adopted = consumer.adopt(crafted_pool(8192, header, kSealed));  // sealed and well formed: taken
  REQUIRE(adopted.ok());
  CHECK(*adopted == 0x1234);
  CHECK(consumer.pools_mapped() == 2);

  ShmConsumer local(/*local_pools=*/true);  // a producer and its consumer in one process
  CHECK(local.resolve(*h, 1024).ok());
}

TEST_CASE("shm consumer: at most kMaxPoolsPerLink pools given on one link are mapped", "[shm]") {
  ShmConsumer consumer;
  for (std::uint64_t id = 1; id <= kMaxPoolsPerLink; ++id) {
    REQUIRE(consumer.adopt(crafted_pool(8192, {0x0000000150534642ULL, id, 1, 4096, 4096}, kSealed)).ok());
  }
  CHECK(consumer.pools_mapped() == kMaxPoolsPerLink);
  auto one_more = consumer.adopt(crafted_pool(8192, {0x0000000150534642ULL, kMaxPoolsPerLink + 1, 1, 4096, 4096}, kSealed));
  CHECK(one_more.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(one_more.status().message()), Catch::Matchers::Contains("more than 512 pools"));
  // One it has already is given again: it replaces the first.
  CHECK(consumer.adopt(crafted_pool(8192, {0x0000000150534642ULL, 7, 1, 4096, 4096}, kSealed)).ok());
  CHECK(consumer.pools_mapped() == kMaxPoolsPerLink);
}

TEST_CASE("shm: a producer's pools are retired when it ends, or by retire_made_by(its pid); a consumer's tensor keeps "
          "its mapping once the cache forgets",
          "[shm]") {
  ShmConsumer consumer;
  ShmConsumer::View survivor;
  std::uint64_t first_pool = 0;
  {
    ShmProducer producer;
    std::vector<float> bytes(256, 3.0f);
    auto h = producer.stage(bytes.data(), 1024, absl::Now());
    REQUIRE(h.ok());
    give_pool(consumer, h->pool_id);
    auto view = consumer.resolve(*h, 1024);
    REQUIRE(view.ok());
    survivor = *view;
    first_pool = h->pool_id;
    CHECK(consumer.retired().empty());
  }
  CHECK(static_cast<const float*>(survivor.data)[255] == 3.0f);
  CHECK(consumer.pools_mapped() == 1);
  CHECK(consumer.retired() == std::vector<std::uint64_t>{first_pool});  // its producer is gone
  const std::vector<std::uint64_t> retired = consumer.retired();
  consumer.forget(retired);  // as the link does, once no packet naming it is unread
  CHECK(consumer.pools_mapped() == 0);
  // A handle of it that a relay sent just as it was retired still resolves until the next forget().
  const wire::ShmHandle late{first_pool, 0, static_cast<std::uint64_t>(1), 0};
  CHECK(consumer.resolve(late, 4).ok());
  consumer.forget({});
  CHECK_THAT(std::string(consumer.resolve(late, 4).status().message()), Catch::Matchers::Contains("never given"));
  CHECK(static_cast<const float*>(survivor.data)[0] == 3.0f);  // `survivor` alone keeps it mapped

  // A worker's death as its host sees it: the pools that process made are retired, none other.
  ShmProducer live;
  std::vector<float> bytes(256, 1.0f);
  auto h = live.stage(bytes.data(), 1024, absl::Now());
  REQUIRE(h.ok());
  give_pool(consumer, h->pool_id);
  consumer.retire_made_by(::getpid() + 1);
  CHECK(consumer.retired().empty());
  consumer.retire_made_by(::getpid());
  CHECK(consumer.retired() == std::vector<std::uint64_t>{h->pool_id});

  // Pools whose ids carry this pid: one made in this PID namespace, one in another (a container
  // sharing the host's memfds), where the same number is another process.
  struct stat ns {};
  REQUIRE(::stat("/proc/self/ns/pid", &ns) == 0);
  const std::uint64_t mine = static_cast<std::uint64_t>(::getpid()) << 32;
  ShmConsumer second;
  const std::uint64_t magic = 0x0000000150534642ULL;
  REQUIRE(second.adopt(crafted_pool(8192, {magic, mine | 1, 1, 4096, 4096, 0, static_cast<std::uint64_t>(ns.st_ino)}, kSealed)).ok());
  REQUIRE(second.adopt(crafted_pool(8192, {magic, mine | 2, 1, 4096, 4096, 0, static_cast<std::uint64_t>(ns.st_ino) + 1}, kSealed)).ok());
  second.retire_made_by(::getpid());
  CHECK(second.retired() == std::vector<std::uint64_t>{mine | 1});
}

namespace {

// Holds a stage()'s copy (the copy hook) until the test's other thread is done with the pool, or a
// generous wait runs out: while stage() copied under the pool's lock, that thread could not be done.
struct CopyGate {
  std::promise<wire::ShmHandle> reserved;  // the slot stage() is about to copy into
  std::promise<void> other_done;
  std::shared_future<void> done = other_done.get_future().share();
  std::atomic<bool> other_done_during_copy{false};
};
CopyGate* copy_gate = nullptr;

void hold_copy(const wire::ShmHandle& handle) {
  copy_gate->reserved.set_value(handle);
  const bool done = copy_gate->done.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  copy_gate->other_done_during_copy = done;
}

// What the other thread saw of the pool while the copy was held.
struct SeenDuringCopy {
  bool released_other = false;     // release() of another slot
  bool released_reserved = false;  // release() of the slot being copied into
  std::size_t reclaimed = 0;
  bool leased_free_slot = false;
  bool leased_another = false;  // only the slot being copied into was left
  ShmEdgeStats stats;
};

}  // namespace

TEST_CASE("shm stage: the copy runs without the pool's lock; its slot cannot be taken, freed or reclaimed meanwhile",
          "[shm]") {
  ShmPoolOptions options;
  options.slots_per_pool = 2;
  options.max_pools = 1;  // one pool of 2 x 1 MB
  ShmProducer producer(options);
  ShmConsumer consumer(/*local_pools=*/true);
  std::vector<float> first(1024, 1.0f), second(1024, 2.0f);
  auto a = producer.stage(first.data(), 4096, absl::Now());  // slot 0, held by the consumer
  REQUIRE(a.ok());

  CopyGate gate;
  copy_gate = &gate;
  shm_stage_copy_hook = &hold_copy;
  struct Unhook {
    ~Unhook() { shm_stage_copy_hook = nullptr; }
  } unhook;
  auto staging = std::async(std::launch::async, [&] { return producer.stage(second.data(), 4096, absl::Now()); });
  auto reserved = gate.reserved.get_future();
  REQUIRE(reserved.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  const wire::ShmHandle b = reserved.get();
  auto other = std::async(std::launch::async, [&] {
    SeenDuringCopy seen;
    seen.released_other = producer.release(*a);
    seen.released_reserved = producer.release(b);
    seen.reclaimed = producer.reclaim_all();
    auto free_slot = producer.try_lease(100);
    seen.leased_free_slot = free_slot.has_value();
    seen.leased_another = producer.try_lease(100).has_value();
    if (free_slot) free_slot->drop();
    seen.stats = producer.stats();
    gate.other_done.set_value();
    return seen;
  });
  const SeenDuringCopy seen = other.get();
  auto staged = staging.get();
  REQUIRE(staged.ok());

  CHECK(gate.other_done_during_copy);  // release(), try_lease() and stats() did not wait for the copy
  CHECK(seen.released_other);
  CHECK_FALSE(seen.released_reserved);  // nobody holds it yet: refused, not freed
  CHECK(seen.reclaimed == 0);
  CHECK(seen.leased_free_slot);
  CHECK_FALSE(seen.leased_another);
  CHECK(seen.stats.handles == 1);  // the copy's handle is not published yet
  CHECK(seen.stats.slots_in_use == 1);
  CHECK(seen.stats.stale_releases == 1);

  CHECK(*staged == b);
  auto view = consumer.resolve(*staged, 4096);
  REQUIRE(view.ok());
  CHECK(static_cast<const float*>(view->data)[1023] == 2.0f);
  auto after = producer.stats();
  CHECK(after.handles == 2);
  CHECK(after.bytes_staged == 8192);
  CHECK(after.slots_in_use == 1);
  CHECK(producer.release(*staged));
  CHECK(producer.stats().slots_in_use == 0);
}

TEST_CASE("shm consumer: a pool header rewritten after mapping moves no handle outside the pool", "[shm]") {
  ShmProducer producer;
  ShmConsumer consumer;
  const std::vector<char> first(100, 'a'), second(100, 'b');
  auto h1 = producer.stage(first.data(), first.size(), absl::Now() + absl::Seconds(10));
  REQUIRE(h1.ok());
  give_pool(consumer, h1->pool_id);  // maps the pool, checks its header
  auto mapped = consumer.resolve(*h1, first.size());
  REQUIRE(mapped.ok());
  // The producer (or a process it gave the pool to) rewrites data_offset (offset 32) and slot_bytes (24).
  void* header = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, shm_pool_fd(h1->pool_id).fd, 0);
  REQUIRE(header != MAP_FAILED);
  auto* fields = static_cast<std::uint64_t*>(header);
  fields[3] = std::uint64_t{1} << 40;  // slot_bytes
  fields[4] = std::uint64_t{1} << 40;  // data_offset
  auto h2 = producer.stage(second.data(), second.size(), absl::Now() + absl::Seconds(10));
  REQUIRE(h2.ok());
  auto view = consumer.resolve(*h2, second.size());
  REQUIRE(view.ok());
  const auto* base = static_cast<const char*>(view->pool_base);
  const auto* data = static_cast<const char*>(view->data);
  REQUIRE(data >= base);
  REQUIRE(data + second.size() <= base + view->pool_bytes);  // the layout captured at mapping time
  CHECK(std::string(data, second.size()) == std::string(second.begin(), second.end()));
  ::munmap(header, 4096);
}

TEST_CASE("shm pools: a burst's extra pool is removed once idle, the last of its class stays; consumers let go", "[shm]") {
  ShmPoolOptions options;
  options.slots_per_pool = 1;
  options.idle_trim = absl::Milliseconds(50);
  ShmProducer producer(options);
  ShmConsumer consumer;
  std::vector<float> bytes(256, 5.0f);
  auto first = producer.stage(bytes.data(), 1024, absl::Now());
  auto second = producer.stage(bytes.data(), 1024, absl::Now());  // the burst: a second pool of the class
  REQUIRE(first.ok());
  REQUIRE(second.ok());
  REQUIRE(first->pool_id != second->pool_id);
  give_pool(consumer, first->pool_id);
  give_pool(consumer, second->pool_id);
  REQUIRE(consumer.resolve(*first, 1024).ok());
  auto held = consumer.resolve(*second, 1024);  // a tensor still over the second pool
  REQUIRE(held.ok());
  CHECK(consumer.pools_mapped() == 2);
  CHECK(producer.release(*first));
  CHECK(producer.release(*second));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // both pools idle past idle_trim

  auto third = producer.stage(bytes.data(), 1024, absl::Now());  // taking a slot trims first
  REQUIRE(third.ok());
  const ShmEdgeStats stats = producer.stats();
  CHECK(stats.pools == 1);
  CHECK(stats.pools_trimmed == 1);
  CHECK(stats.slots_total == 1);
  CHECK(third->pool_id == first->pool_id);  // the last of its class stayed and serves on
  CHECK(static_cast<const float*>(held->data)[255] == 5.0f);  // still mapped for the tensor over it

  CHECK(consumer.retired() == std::vector<std::uint64_t>{second->pool_id});  // trimmed: retired
  consumer.forget(consumer.retired());
  REQUIRE(consumer.resolve(*third, 1024).ok());
  CHECK(consumer.pools_mapped() == 1);  // it dropped the retired pool; `held` alone keeps its pages
  CHECK(producer.release(*third));
}

TEST_CASE("shm pools: a class that needs a pool again soon after losing one keeps its next one twice as long", "[shm]") {
  ShmPoolOptions options;
  options.slots_per_pool = 1;
  options.idle_trim = absl::Milliseconds(200);
  options.idle_trim_max = absl::Milliseconds(400);
  ShmProducer producer(options);
  std::vector<float> bytes(256, 1.0f);
  // Two slots of one class at once: the second one is a burst's extra pool.
  auto burst = [&] {
    auto a = producer.stage(bytes.data(), 1024, absl::Now());
    auto b = producer.stage(bytes.data(), 1024, absl::Now());
    REQUIRE(a.ok());
    REQUIRE(b.ok());
    CHECK(producer.release(*a));
    CHECK(producer.release(*b));
  };
  auto take_one = [&] {  // taking a slot trims what has idled long enough
    auto c = producer.stage(bytes.data(), 1024, absl::Now());
    REQUIRE(c.ok());
    CHECK(producer.release(*c));
    return producer.stats();
  };
  burst();
  CHECK(producer.stats().pools_created == 2);
  std::this_thread::sleep_for(std::chrono::milliseconds(250));  // past 200 ms: the extra pool goes
  CHECK(take_one().pools_trimmed == 1);
  burst();  // needed again at once: the class's delay doubles to 400 ms
  CHECK(producer.stats().pools_created == 3);
  std::this_thread::sleep_for(std::chrono::milliseconds(250));  // past the first delay, not the new one
  ShmEdgeStats stats = take_one();
  CHECK(stats.pools_trimmed == 1);
  CHECK(stats.pools == 2);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // 550 ms idle: past 400 ms
  stats = take_one();
  CHECK(stats.pools_trimmed == 2);
  CHECK(stats.pools == 1);
  CHECK(stats.pools_created == 3);
}

TEST_CASE("shm pool names: the id and its producer's pid read back from the memfd's name, other names refused",
          "[shm]") {
  using blockflow::detail::shm_pool_id;
  using blockflow::detail::shm_pool_producer;
  for (const char* name : {"blockflow-00003039deadbeef", "memfd:blockflow-00003039deadbeef", "/memfd:blockflow-00003039deadbeef"}) {
    INFO(name);
    const auto id = shm_pool_id(name);
    REQUIRE(id.has_value());
    CHECK(*id == 0x00003039deadbeefULL);
    CHECK(shm_pool_producer(*id) == 12345);
  }
  for (const char* name : {"blockflow-00003039deadbee", "blockflow-00003039deadbeef0", "blockflow-00003039DEADBEEF",
                           "blockflow-0000303xdeadbeef", "other-00003039deadbeef", "/tmp/blockflow-00003039deadbeef",
                           "/dev/shm/blockflow-00003039deadbeef", ""}) {
    INFO(name);
    CHECK_FALSE(shm_pool_id(name).has_value());
  }
}

TEST_CASE("shm pools: idle pools of other classes make room for a tensor that fits under max_total_bytes", "[shm]") {
  ShmPoolOptions options;
  options.slots_per_pool = 1;
  options.max_total_bytes = (std::size_t{4} << 20) + 4096;  // one pool of a 4 MB slot, or 1 MB + 2 MB
  ShmProducer producer(options);
  std::vector<char> bytes(std::size_t{3} << 20, 'x');
  auto one = producer.stage(bytes.data(), std::size_t{1} << 20, absl::Now());
  auto two = producer.stage(bytes.data(), std::size_t{2} << 20, absl::Now());
  REQUIRE(one.ok());
  REQUIRE(two.ok());
  CHECK(producer.release(*one));
  CHECK(producer.release(*two));
  // Nothing is in use: the 1 MB and 2 MB pools, idle, go for the 4 MB one (the last of their classes too).
  auto three = producer.stage(bytes.data(), bytes.size(), absl::Now());
  INFO(three.status().ToString());
  REQUIRE(three.ok());
  const ShmEdgeStats stats = producer.stats();
  CHECK(stats.pools == 1);
  CHECK(stats.pools_trimmed == 2);
  CHECK(producer.release(*three));
  // A pool larger than the whole bound is refused at once, naming both.
  options.max_total_bytes = std::size_t{3} << 20;
  ShmProducer small(options);
  auto never = small.stage(bytes.data(), bytes.size(), absl::Now() + absl::Seconds(10));
  CHECK(absl::IsResourceExhausted(never.status()));
  CHECK_THAT(std::string(never.status().message()), Catch::Matchers::Contains("max_total_bytes 3145728"));
}

namespace {
std::promise<void>* creating = nullptr;      // set once a pool's making is held
std::shared_future<void>* create_go = nullptr;  // the making goes on once it is ready
void hold_create() {
  if (creating == nullptr) return;
  std::exchange(creating, nullptr)->set_value();
  create_go->wait();
}
}  // namespace

TEST_CASE("shm pools: a send while another makes the pool it needs waits for that pool's slots, not refused",
          "[shm]") {
  ShmPoolOptions options;
  options.slots_per_pool = 4;
  options.max_total_bytes = (std::size_t{4} << 20) + 4096;  // room for one pool of 4 x 1 MB only
  ShmProducer producer(options);
  std::vector<char> bytes(std::size_t{1} << 20, 'x');
  std::promise<void> held, go;
  std::shared_future<void> go_future = go.get_future().share();
  creating = &held;
  create_go = &go_future;
  shm_pool_create_hook = &hold_create;
  struct Unhook {
    ~Unhook() { shm_pool_create_hook = nullptr; }
  } unhook;
  auto first = std::async(std::launch::async, [&] { return producer.stage(bytes.data(), bytes.size(), absl::Now()); });
  REQUIRE(held.get_future().wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  // The pool being made holds the whole bound: this one waits for it rather than fail.
  auto second = std::async(std::launch::async,
                           [&] { return producer.stage(bytes.data(), bytes.size(), absl::Now() + absl::Seconds(30)); });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (producer.stats().credit_waits == 0 && second.wait_for(std::chrono::milliseconds(0)) != std::future_status::ready &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  go.set_value();
  auto a = first.get();
  REQUIRE(a.ok());
  REQUIRE(second.wait_for(std::chrono::seconds(5)) == std::future_status::ready);  // woken by the new pool
  auto b = second.get();
  INFO(b.status().ToString());
  REQUIRE(b.ok());
  CHECK(a->pool_id == b->pool_id);
  CHECK(producer.stats().pools == 1);
  CHECK(producer.stats().credit_waits == 1);
}
