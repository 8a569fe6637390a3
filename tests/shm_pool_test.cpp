// ShmProducer's pools on their own (no channel, no codec): the sweep of abandoned pools judges them
// by their producer's flock, never by the pid in their name; stage() copies without the pool's lock.
#include <blockflow/channel/detail/shm_pool.hpp>

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <filesystem>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

using namespace blockflow;
using namespace blockflow::detail;

namespace {

// Above any pid_max Linux allows (2^22): no process of this PID namespace has it.
constexpr std::uint32_t kNoSuchPid = 0x7ffffff0;

// A /dev/shm object named like a pool of the producer `pid` ("/blockflow-<pid><random>"), made by
// hand; unlinked when the test ends, whatever happened to it.
struct CraftedPool {
  std::string name;
  explicit CraftedPool(std::uint32_t pid) {
    const std::uint32_t low = static_cast<std::uint32_t>(std::random_device{}());
    name = fmt::format("/blockflow-{:016x}", (std::uint64_t{pid} << 32) | low);
  }
  ~CraftedPool() { ::shm_unlink(name.c_str()); }
  bool exists() const { return std::filesystem::exists("/dev/shm" + name); }
  // Creates it with `bytes` bytes and closes it: nobody holds it any more.
  void make_abandoned(off_t bytes) const {
    const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    REQUIRE(fd >= 0);
    CHECK(::ftruncate(fd, bytes) == 0);
    ::close(fd);
  }
};

// Another program's live pool: a child process creates the object the way a producer does (flock
// LOCK_SH right after the exclusive create, then the size) and holds it until `release()`.
class ForeignHolder {
 public:
  explicit ForeignHolder(const std::string& name) {
    REQUIRE(::pipe(ready_) == 0);
    REQUIRE(::pipe(hold_) == 0);
    child_ = ::fork();
    REQUIRE(child_ >= 0);
    if (child_ == 0) run_child(name);  // never returns
    ::close(ready_[1]);
    ::close(hold_[0]);
    char ok = 0;
    REQUIRE(::read(ready_[0], &ok, 1) == 1);
    REQUIRE(ok == 1);
  }
  ~ForeignHolder() { release(); }
  // Kills the child with SIGKILL, as a host killed mid-run, and reaps it.
  void kill() {
    if (child_ <= 0) return;
    ::kill(child_, SIGKILL);
    release();
  }
  // Lets the child exit (its descriptor, hence its lock, goes with it) and reaps it.
  void release() {
    if (child_ <= 0) return;
    ::close(hold_[1]);
    ::close(ready_[0]);
    int status = 0;
    ::waitpid(child_, &status, 0);
    child_ = -1;
  }

 private:
  // Only async-signal-safe calls: the parent has threads.
  [[noreturn]] void run_child(const std::string& name) {
    ::close(ready_[0]);
    ::close(hold_[1]);
    const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    const char ok = fd >= 0 && ::flock(fd, LOCK_SH) == 0 && ::ftruncate(fd, 8192) == 0 ? 1 : 0;
    ssize_t n = ::write(ready_[1], &ok, 1);
    char c = 0;
    n = ::read(hold_[0], &c, 1);  // returns when the parent closes its end
    (void)n;
    ::_exit(0);
  }

  int ready_[2] = {-1, -1};
  int hold_[2] = {-1, -1};
  pid_t child_ = -1;
};

}  // namespace

TEST_CASE("shm sweep: another program's live pool survives, even when its pid is not one of ours", "[shm]") {
  errno = 0;
  REQUIRE((::kill(static_cast<pid_t>(kNoSuchPid), 0) != 0 && errno == ESRCH));
  CraftedPool pool(kNoSuchPid);  // the old pid test called this producer dead
  ForeignHolder holder(pool.name);
  REQUIRE(pool.exists());
  { ShmProducer producer; }  // its constructor sweeps
  CHECK(pool.exists());
  holder.release();  // the holder exits: now the pool is abandoned, and the next sweep removes it
  { ShmProducer producer; }
  CHECK_FALSE(pool.exists());
}

TEST_CASE("shm sweep: the pool of a process killed with SIGKILL is removed by the next producer", "[shm]") {
  CraftedPool pool(kNoSuchPid);
  ForeignHolder holder(pool.name);
  { ShmProducer producer; }
  REQUIRE(pool.exists());  // alive: kept
  holder.kill();           // no destructor, no unlink: only the kernel drops its lock
  REQUIRE(pool.exists());  // left behind
  { ShmProducer producer; }
  CHECK_FALSE(pool.exists());
}

TEST_CASE("shm sweep: a pool nobody holds is removed, even when its pid names a live process", "[shm]") {
  CraftedPool pool(static_cast<std::uint32_t>(::getpid()));
  pool.make_abandoned(8192);
  REQUIRE(pool.exists());
  { ShmProducer producer; }
  CHECK_FALSE(pool.exists());
}

TEST_CASE("shm sweep: a size-0 object (a pool being created) is kept", "[shm]") {
  CraftedPool pool(kNoSuchPid);
  pool.make_abandoned(0);
  REQUIRE(pool.exists());
  { ShmProducer producer; }
  CHECK(pool.exists());
}

TEST_CASE("shm sweep: a live producer's pools survive another producer's sweep", "[shm]") {
  ShmProducer first;
  ShmConsumer consumer;
  std::vector<float> bytes(256, 3.0f);
  auto h = first.stage(bytes.data(), 1024, absl::Now());
  REQUIRE(h.ok());
  { ShmProducer second; }
  CHECK(std::filesystem::exists(fmt::format("/dev/shm/blockflow-{:016x}", h->pool_id)));
  auto view = consumer.resolve(*h, 1024);
  REQUIRE(view.ok());
  CHECK(static_cast<const float*>(view->data)[255] == 3.0f);
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
  ShmConsumer consumer;
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
  auto mapped = consumer.resolve(*h1, first.size());  // maps the pool, checks its header
  REQUIRE(mapped.ok());
  // Another process of the same user rewrites data_offset (offset 32) and slot_bytes (offset 24).
  const int fd = ::shm_open(fmt::format("/blockflow-{:016x}", h1->pool_id).c_str(), O_RDWR, 0);
  REQUIRE(fd >= 0);
  void* header = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
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
  namespace fs = std::filesystem;
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
  const std::string gone = fmt::format("/dev/shm/blockflow-{:016x}", second->pool_id);
  CHECK_FALSE(fs::exists(gone));
  CHECK(static_cast<const float*>(held->data)[255] == 5.0f);  // still mapped for the tensor over it

  std::this_thread::sleep_for(std::chrono::milliseconds(1100));  // the consumer checks once a second
  REQUIRE(consumer.resolve(*third, 1024).ok());
  CHECK(consumer.pools_mapped() == 1);  // it dropped the gone pool; `held` alone keeps its pages
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

TEST_CASE("shm pool names: the id and its producer's pid read back from the object's name, other names refused",
          "[shm]") {
  using blockflow::detail::shm_pool_id;
  using blockflow::detail::shm_pool_producer;
  for (const char* name : {"blockflow-00003039deadbeef", "/blockflow-00003039deadbeef", "/dev/shm/blockflow-00003039deadbeef"}) {
    INFO(name);
    const auto id = shm_pool_id(name);
    REQUIRE(id.has_value());
    CHECK(*id == 0x00003039deadbeefULL);
    CHECK(shm_pool_producer(*id) == 12345);
  }
  for (const char* name : {"blockflow-00003039deadbee", "blockflow-00003039deadbeef0", "blockflow-00003039DEADBEEF",
                           "blockflow-0000303xdeadbeef", "other-00003039deadbeef", "/tmp/blockflow-00003039deadbeef", ""}) {
    INFO(name);
    CHECK_FALSE(shm_pool_id(name).has_value());
  }
}
