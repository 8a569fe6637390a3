// The CUDA IPC channel (TensorMQ, channel "cuda"). The [cuda] cases need a GPU and a libtorch with
// CUDA (scripts/gpu.sh builds and runs them); elsewhere they print "SKIPPED: no usable CUDA
// channel: <reason>" and ctest reports them as skipped. The refusal case runs where CUDA cannot be
// used (CI), as part of [shm], and so does the export table's (plain host code).
#include "worker_util.hpp"

#include <blockflow/channel/detail/cuda_ipc.hpp>
#include <blockflow/core/kpi.hpp>
#include <blockflow/worker/worker_site.hpp>

#include <csignal>
#include <future>
#include <iostream>

using namespace blockflow;
using Catch::Matchers::Contains;

namespace {

// True where the [cuda] cases can run; otherwise says why, in the words ctest looks for.
bool gpu_or_skip() {
  const absl::Status usable = blockflow::detail::cuda_ipc_usable();
  if (usable.ok()) return true;
  std::cout << "SKIPPED: no usable CUDA channel: " << usable.message() << "\n";
  return false;
}

BlockDescription on_cuda(BlockDescription d) {
  d.options.device = "cuda:0";
  return d;
}

// A C++ block in the host's threads on cuda:0 (3x + 1), like the plugin's "affine" in workers.
std::shared_ptr<Block> host_affine(const std::string& name, BlockOptions options = {}) {
  options.device = "cuda:0";
  return Block::callable(
      name, [](Tensors&& in) -> absl::StatusOr<Tensors> { return Tensors{in.at(0) * 3 + 1}; }, options);
}

// The slow producer ("slow_fill" in a cuda worker) alone and followed by `affine` in the host, both
// given; started.
void start_slow_then_affine(Session& session, BlockDescription slow, std::shared_ptr<Block> affine) {
  session.add_site(make_worker(test::test_worker("w1", "cuda")))
      .add_block(std::move(slow))
      .add_block(std::move(affine))
      .add_path(Path::chain("slow", {"slow"}))
      .add_path(Path::chain("slow_then_affine", {"slow", "affine"}));
  test::require_started(session);
}

// Three times: the slow producer's output read by a copy to the host (on this process's stream,
// which waits on the producer's event), and by a kernel of a block in this process (3 * 42 + 1).
void check_slow_ordering(Session& session) {
  for (int i = 0; i < 3; ++i) {
    Result r = session.submit("slow", at::zeros({1 << 20})).get();
    REQUIRE(r.ok());
    REQUIRE(r.output().is_cuda());
    CHECK(r.output().cpu().eq(42.0).all().item<bool>());
    Result a = session.submit("slow_then_affine", at::zeros({1 << 20})).get();
    REQUIRE(a.ok());
    CHECK(a.output().cpu().eq(127.0).all().item<bool>());
  }
}

std::int64_t torch_cuda_allocated() {
  std::vector<TorchCudaMemory> devices;
  (void)sample_torch_cuda(devices);
  std::int64_t total = 0;
  for (const auto& d : devices) total += d.allocated_bytes;
  return total;
}

}  // namespace

TEST_CASE("channel cuda is refused at start, naming the reason, where CUDA cannot carry tensors", "[shm]") {
  const absl::Status usable = blockflow::detail::cuda_ipc_usable();
  if (usable.ok()) return;  // a GPU build: the [cuda] cases below cover the channel
  Session session;
  session.add_site(make_worker(test::test_worker("wc", "cuda")))
      .add_block(test::plugin_block("affine", "affine", "wc"))
      .add_path(Path::chain("t", {"affine"}));
  const std::string message(session.start().message());
  CHECK_THAT(message, Contains("worker wc: channel 'cuda': "));
  CHECK_THAT(message, Contains(std::string(usable.message())));
}

TEST_CASE("cuda export table: only released exports are evicted; with all live it grows", "[shm]") {
  using blockflow::detail::CudaExportTable;
  CudaExportTable table(4);
  char memory[6] = {};
  auto key = [](int i) { return std::string(64, static_cast<char>('a' + i)); };
  std::vector<std::shared_ptr<void>> shares;
  for (int i = 0; i < 4; ++i) shares.push_back(table.remember(key(i), {&memory[i], 100}));
  shares[1].reset();  // export 1's share was released
  CHECK_FALSE(table.find(key(1)));
  shares.push_back(table.remember(key(4), {&memory[4], 100}));  // full: evicts export 1 only
  CHECK(table.size() == 4);
  CHECK(table.bound() == 4);
  for (int i : {0, 2, 3, 4}) {
    INFO("export " << i);
    auto found = table.find(key(i));
    REQUIRE(found);
    CHECK(found->base == &memory[i]);
    CHECK(found->bytes == 100);
  }
  shares.push_back(table.remember(key(5), {&memory[5], 100}));  // full and all live: grows
  CHECK(table.size() == 5);
  CHECK(table.bound() == 8);
  for (int i : {0, 2, 3, 4, 5}) CHECK(table.find(key(i)));
  // Two shares of one allocation: it stays until both are released.
  auto again = table.remember(key(0), {&memory[0], 100});
  shares[0].reset();
  CHECK(table.find(key(0)));
  again.reset();
  CHECK_FALSE(table.find(key(0)));
}

TEST_CASE("split small CNN on cuda:0 in two workers over channel cuda equals the monolithic model; nothing copied",
          "[cuda]") {
  if (!gpu_or_skip()) return;
  Session session;
  session.add_site(make_worker(test::test_worker("w1", "cuda"))).add_site(make_worker(test::test_worker("w2", "cuda")));
  session.add_block(on_cuda(test::model_block("b1", "cnn_block1.pt", "w1", {-1, 3, 16, 16})))
      .add_block(on_cuda(test::model_block("b2", "cnn_block2.pt", "w2", {-1, 8, 16, 16})))
      .add_block(on_cuda(test::model_block("b3", "cnn_block3.pt", "w1", {-1, 16, 8, 8})))
      .add_block(on_cuda(test::model_block("whole", "cnn_monolithic.pt", "", {-1, 3, 16, 16})))
      .add_path(Path::chain("cnn", {"b1", "b2", "b3"}))
      .add_path(Path::chain("mono", {"whole"}));
  test::require_started(session);
  at::manual_seed(5);
  std::vector<Tensor> inputs, expected;
  for (int i = 0; i < 8; ++i) {
    inputs.push_back(at::randn({1 + i % 4, 3, 16, 16}));
    Result m = session.submit("mono", inputs.back()).get();
    REQUIRE(m.ok());
    expected.push_back(m.output().cpu());
  }
  // Results received from a worker lie in that worker's memory: this process's allocator does not
  // grow while we hold them.
  const std::int64_t allocated_before = torch_cuda_allocated();
  std::vector<Tensor> held;
  for (int i = 0; i < 8; ++i) {
    Result r = session.submit("cnn", inputs[static_cast<std::size_t>(i)]).get();
    INFO(r.status.ToString());
    REQUIRE(r.ok());
    REQUIRE(r.output().is_cuda());
    held.push_back(r.output());
  }
  CHECK(torch_cuda_allocated() == allocated_before);
  for (std::size_t i = 0; i < held.size(); ++i) {
    const Tensor got = held[i].cpu();
    INFO("request " << i << ": max |split - monolithic| = " << (got - expected[i]).abs().max().item<double>());
    CHECK(at::allclose(got, expected[i], 1e-4, 1e-5));
  }
  held.clear();
  REQUIRE(test::eventually([&] {
    const auto m = session.metrics();
    return m.sites.size() == 2 && m.sites[0].cuda_results.handles > 0 && m.sites[1].cuda_results.handles > 0 &&
           m.sites[0].cuda_requests.slots_in_use == 0 && m.sites[1].cuda_requests.slots_in_use == 0;
  }));
  for (const auto& site : session.metrics().sites) {
    INFO(site.name);
    CHECK(site.data.kind == "cuda");
    CHECK(site.data.bytes_copied == 0);
    CHECK(site.cuda_requests.bytes_staged == 0);
    CHECK(site.cuda_results.bytes_staged == 0);
    CHECK(site.cuda_requests.stale_releases == 0);
  }
  // b2 and b3 receive CUDA tensors the host forwarded from the other worker, as handles, sent by
  // the thread that received them (records taken at once), not through the blocks' queues.
  const auto m = session.metrics();
  CHECK(m.sites[1].cuda_requests.handles >= 8);
  for (const auto& b : m.blocks) {
    INFO(b.name);
    if (b.name == "b2" || b.name == "b3") CHECK(b.handed_directly == 8);
  }
}

TEST_CASE("channel cuda orders by events: a consumer reads the slow producer's final values, no host sync", "[cuda]") {
  if (!gpu_or_skip()) return;
  Session session;
  start_slow_then_affine(session, on_cuda(test::plugin_block("slow", "slow_fill", "w1")), host_affine("affine"));
  check_slow_ordering(session);
}

TEST_CASE("channel cuda: a killed consumer's records come back; the worker restarts and traffic flows", "[cuda]") {
  if (!gpu_or_skip()) return;
  auto site = make_worker(test::test_worker("w1", "cuda"));
  Session session;
  session.add_site(site)
      .add_block(host_affine("lift"))
      .add_block(on_cuda(test::plugin_block("hold", "slow_identity", "w1")))
      .add_path(Path::chain("t", {"lift", "hold"}));
  test::require_started(session);
  std::vector<std::future<Result>> pending;
  for (int i = 0; i < 20; ++i) pending.push_back(session.submit("t", at::ones({1024})));
  REQUIRE(test::eventually([&] { return session.metrics().sites.at(0).cuda_requests.slots_in_use >= 2; }));
  ::kill(static_cast<pid_t>(site->pid()), SIGKILL);
  for (auto& f : pending) (void)f.get();  // each resolves: a result or the named error
  REQUIRE(test::eventually([&] { return session.metrics().sites.at(0).cuda_requests.slots_in_use == 0; }));
  CHECK(session.metrics().sites.at(0).cuda_requests.reclaims >= 1);
  REQUIRE(test::eventually([&] { return session.metrics().sites.at(0).pid != 0; }, std::chrono::seconds(30)));
  Result r = session.submit("t", at::ones({1024})).get();
  INFO(r.status.ToString());
  REQUIRE(r.ok());
  CHECK(r.output().cpu().eq(4.0).all().item<bool>());
}

TEST_CASE("cuda_graph: the warm-up shape replays a graph, another shape runs eagerly, both right", "[cuda]") {
  if (!gpu_or_skip()) return;
  BlockOptions options;
  options.cuda_graph = true;
  options.input_shapes = {{-1, 4096}};  // warmed up (and captured) as [1, 4096]
  Session session;
  session.add_block(host_affine("affine", options)).add_path(Path::chain("t", {"affine"}));
  test::require_started(session);
  std::vector<Result> results;
  for (int i = 0; i < 5; ++i) results.push_back(session.submit("t", at::full({1, 4096}, static_cast<double>(i))).get());
  for (int i = 0; i < 5; ++i) {
    REQUIRE(results[static_cast<std::size_t>(i)].ok());
    // Each result is a clone: later replays did not overwrite the earlier ones.
    CHECK(results[static_cast<std::size_t>(i)].output().cpu().eq(3.0 * i + 1).all().item<bool>());
  }
  Result other = session.submit("t", at::full({2, 4096}, 2.0)).get();
  INFO(other.status.ToString());
  REQUIRE(other.ok());
  CHECK(other.output().sizes() == at::IntArrayRef{2, 4096});
  CHECK(other.output().cpu().eq(7.0).all().item<bool>());
  const BlockMetrics b = session.metrics().blocks.at(0);
  CHECK(b.cuda_graph.graphs == 1);
  CHECK(b.cuda_graph.replays == 5);
  CHECK(b.cuda_graph.eager_runs == 1);
  const std::string prometheus = session.metrics().to_prometheus();
  CHECK_THAT(prometheus, Contains("blockflow_block_cuda_graph_replays_total{block=\"affine\""));
  CHECK_THAT(prometheus, Contains("blockflow_block_cuda_graph_eager_runs_total{block=\"affine\""));
  CHECK_THAT(prometheus, Contains("blockflow_block_cuda_graphs{block=\"affine\""));
}

TEST_CASE("cuda_graph: channel cuda still orders by events when the slow producer replays a graph", "[cuda]") {
  if (!gpu_or_skip()) return;
  BlockDescription slow = on_cuda(test::plugin_block("slow", "slow_fill", "w1"));
  slow.options.cuda_graph = true;
  slow.options.input_shapes = {{1 << 20}};
  BlockOptions options;
  options.cuda_graph = true;
  options.input_shapes = {{1 << 20}};
  Session session;
  start_slow_then_affine(session, slow, host_affine("affine", options));
  check_slow_ordering(session);
  // The worker's counters arrive with its heartbeats.
  REQUIRE(test::eventually([&] {
    for (const auto& b : session.metrics().blocks) {
      if (b.name == "slow") return b.cuda_graph.graphs == 1 && b.cuda_graph.replays == 6;
    }
    return false;
  }));
  for (const auto& b : session.metrics().blocks) {
    if (b.name == "affine") CHECK(b.cuda_graph.replays == 3);
    CHECK(b.cuda_graph.eager_runs == 0);
  }
}
