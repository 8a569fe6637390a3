// Dynamic batching at a shared block: outputs equal unbatched ones for every request, requests of
// several tasks share a batch, incompatible shapes are never merged, a lone request is not held
// forever, the per-request trace still adds up (batch waiting counted as wait), and batching works
// in a worker process too.
#include "worker_util.hpp"

#include <atomic>
#include <mutex>

using namespace blockflow;
using Catch::Matchers::Contains;
using namespace std::chrono_literals;

namespace {

// A block that sleeps on its first call (so a queue builds up behind it), records the row count
// and trailing shape of every call, and returns x * 2 (rows kept apart).
struct Recorder {
  std::mutex mu;
  std::vector<std::vector<std::int64_t>> calls;  // sizes of each forward's input
  std::atomic<bool> first{true};

  std::shared_ptr<Block> block(const std::string& name, BlockOptions options) {
    return Block::callable(name, [this](Tensors&& in) -> absl::StatusOr<Tensors> {
      if (first.exchange(false)) std::this_thread::sleep_for(150ms);
      {
        std::lock_guard lock(mu);
        calls.push_back(in.at(0).sizes().vec());
      }
      return Tensors{in.at(0) * 2};
    }, options);
  }
};

BlockOptions batching(int max_batch, double delay_ms) {
  BlockOptions o;
  o.max_batch = max_batch;
  o.max_batch_delay_ms = delay_ms;
  return o;
}

// One lane: the queue builds up behind the first call, and the rest is one batch.
SessionOptions one_lane() {
  SessionOptions o;
  o.lanes = 1;
  return o;
}

// Task "t" over the recorder's block "rec", batching up to 16 within 50 ms; started.
void serve_recorder(Session& session, Recorder& recorder) {
  session.add_block(recorder.block("rec", batching(16, 50))).add_path(Path::chain("t", {"rec"}));
  test::require_started(session);
}

}  // namespace

TEST_CASE("batched outputs equal unbatched ones for every request; tasks share a batch", "[batching]") {
  Session batched, plain;
  BlockOptions b = batching(8, 20);
  b.intra_op_threads = 1;
  b.input_shapes = {{-1, 3, 16, 16}};
  BlockOptions p = b;
  p.max_batch = 1;
  batched.add_block(test::load_block("cnn", "cnn_block1.pt", b))
      .add_path(Path::chain("t1", {"cnn"}))
      .add_path(Path::chain("t2", {"cnn"}));
  plain.add_block(test::load_block("cnn", "cnn_block1.pt", p)).add_path(Path::chain("t1", {"cnn"}));
  test::require_started(batched);
  test::require_started(plain);
  at::manual_seed(3);
  std::vector<Tensor> inputs;
  std::vector<std::future<Result>> futures;
  for (int i = 0; i < 24; ++i) {
    inputs.push_back(at::randn({1 + i % 2, 3, 16, 16}));
    futures.push_back(batched.submit(i % 2 == 0 ? "t1" : "t2", inputs.back()));
  }
  for (int i = 0; i < 24; ++i) {
    Result r = futures[static_cast<std::size_t>(i)].get();
    INFO(r.status.ToString());
    REQUIRE(r.ok());
    Result reference = plain.submit("t1", inputs[static_cast<std::size_t>(i)]).get();
    REQUIRE(reference.ok());
    CHECK(r.output().sizes() == reference.output().sizes());
    CHECK(at::allclose(r.output(), reference.output(), 1e-4, 1e-5));
    const double parts = r.trace.wait_ms() + r.trace.compute_ms() + r.trace.overhead_ms();
    CHECK(parts == Approx(r.trace.e2e_ms()).margin(1e-6));
  }
  const auto m = batched.metrics().blocks.at(0);
  CHECK(m.processed == 24);
  CHECK(m.batches >= 1);
  CHECK(m.batched_requests >= 2);
  CHECK(m.batched_requests <= 24);
}

TEST_CASE("incompatible shapes are never merged; every request gets its own rows", "[batching]") {
  Recorder recorder;
  Session session;
  session.add_block(recorder.block("rec", batching(16, 50))).add_path(Path::chain("t", {"rec"}));
  test::require_started(session);
  std::vector<std::future<Result>> futures;
  std::vector<Tensor> inputs;
  for (int i = 0; i < 12; ++i) {
    const std::int64_t width = i % 3 == 0 ? 5 : 4;  // two shapes interleaved
    inputs.push_back(at::full({1 + i % 2, width}, static_cast<double>(i)));
    futures.push_back(session.submit("t", inputs.back()));
  }
  for (std::size_t i = 0; i < futures.size(); ++i) {
    Result r = futures[i].get();
    REQUIRE(r.ok());
    CHECK(at::equal(r.output(), inputs[i] * 2));
  }
  std::lock_guard lock(recorder.mu);
  bool merged = false;
  for (const auto& sizes : recorder.calls) {
    REQUIRE(sizes.size() == 2);
    CHECK((sizes[1] == 4 || sizes[1] == 5));  // each call saw one width only: cat would fail otherwise
    merged = merged || sizes[0] > 2;
  }
  CHECK(merged);  // the queue that built up behind the first call was batched
  CHECK(session.metrics().blocks.at(0).batches >= 1);
}

TEST_CASE("requests without inputs, or whose inputs differ in rows, are never stacked: each runs alone", "[batching]") {
  // No input_shapes: the block takes whatever it is given; it answers with its inputs' row counts.
  Session session(one_lane());
  std::atomic<int> calls{0};
  session
      .add_block(Block::callable("rows",
                                 [&](Tensors&& in) -> absl::StatusOr<Tensors> {
                                   ++calls;
                                   std::vector<double> rows;
                                   for (const auto& t : in) rows.push_back(static_cast<double>(t.size(0)));
                                   if (rows.empty()) rows.push_back(-1);
                                   return Tensors{at::tensor(rows, at::kDouble)};
                                 },
                                 batching(16, 50)))
      .add_path(Path::chain("t", {"rows"}));
  test::require_started(session);
  std::vector<std::future<Result>> empty, uneven;
  for (int i = 0; i < 4; ++i) {
    empty.push_back(session.submit("t", Tensors{}));
    uneven.push_back(session.submit("t", Tensors{at::zeros({1, 3}), at::zeros({2, 3})}));
  }
  for (auto& f : empty) {
    const Result r = f.get();
    INFO(r.status.ToString());
    REQUIRE(r.ok());
    CHECK(r.output().item<double>() == -1);
  }
  for (auto& f : uneven) {
    const Result r = f.get();
    INFO(r.status.ToString());
    REQUIRE(r.ok());
    CHECK(at::equal(r.output(), at::tensor(std::vector<double>{1, 2}, at::kDouble)));
  }
  CHECK(calls.load() == 8);
}

TEST_CASE("a lone request is not held for a batch that never fills", "[batching]") {
  Session session;
  session.add_block(test::unary("double", [](const Tensor& x) { return x * 2; }, batching(64, 30)))
      .add_path(Path::chain("t", {"double"}));
  test::require_started(session);
  for (int i = 0; i < 3; ++i) {
    Result r = session.submit("t", at::ones({1, 2})).get();  // one at a time: never a second request
    REQUIRE(r.ok());
    CHECK(at::equal(r.output(), at::full({1, 2}, 2.0)));
  }
  const auto m = session.metrics().blocks.at(0);
  CHECK(m.processed == 3);
  CHECK(m.batches == 0);  // each ran alone once max_batch_delay_ms passed
}

TEST_CASE("a block that two lanes run is gathered by one: requests within max_batch_delay_ms share one batch", "[batching]") {
  // Before, the lane gathering saw the block's own ready entry (left for its second lane) as other
  // work waiting and ran the first request alone; and a second lane could take part of the batch.
  SessionOptions two_lanes;
  two_lanes.lanes = 2;
  Session session(two_lanes);
  Recorder recorder;
  recorder.first = false;  // no slow first call
  BlockOptions b = batching(4, 10'000);  // the batch fills long before the delay
  b.workers = 2;
  session.add_block(recorder.block("rec", b)).add_path(Path::chain("t", {"rec"}));
  test::require_started(session);
  std::vector<std::future<Result>> futures;
  for (int i = 0; i < 4; ++i) {
    if (i > 0) std::this_thread::sleep_for(20ms);  // each arrives while a lane waits for more
    futures.push_back(session.submit("t", at::full({1, 2}, static_cast<double>(i))));
  }
  for (int i = 0; i < 4; ++i) {
    Result r = futures[static_cast<std::size_t>(i)].get();
    INFO(r.status.ToString());
    REQUIRE(r.ok());
    CHECK(at::equal(r.output(), at::full({1, 2}, 2.0 * i)));
  }
  {
    std::lock_guard lock(recorder.mu);
    REQUIRE(recorder.calls.size() == 1);
    CHECK(recorder.calls.front() == std::vector<std::int64_t>{4, 2});
  }
  const auto m = session.metrics().blocks.at(0);
  CHECK(m.batches == 1);
  CHECK(m.batched_requests == 4);
}

TEST_CASE("a block whose output rows do not follow its input rows fails the batch, named", "[batching]") {
  Session session;
  std::atomic<bool> first{true};
  session.add_block(Block::callable("summing", [&](Tensors&& in) -> absl::StatusOr<Tensors> {
           if (first.exchange(false)) std::this_thread::sleep_for(100ms);
           return Tensors{in.at(0).sum(0, true)};  // one row whatever the rows: not batchable
         }, batching(8, 50)))
      .add_path(Path::chain("t", {"summing"}));
  test::require_started(session);
  std::vector<std::future<Result>> futures;
  for (int i = 0; i < 6; ++i) futures.push_back(session.submit("t", at::ones({1, 3})));
  int failed = 0;
  for (auto& f : futures) {
    Result r = f.get();
    if (!r.ok()) {
      ++failed;
      CHECK_THAT(std::string(r.status.message()), Contains("block 'summing': a batched output has 1 rows for"));
    }
  }
  CHECK(failed >= 2);
}

TEST_CASE("a completion callback that throws fails none of the other requests of its batch", "[batching]") {
  Recorder recorder;
  Session session(one_lane());
  serve_recorder(session, recorder);
  auto first = session.submit("t", at::full({1, 4}, 1.0));
  session.submit("t", Tensors{at::full({1, 4}, 2.0)}, [](Result&&) { throw std::runtime_error("callback bug"); });
  std::vector<std::future<Result>> rest;
  for (int i = 3; i < 6; ++i) rest.push_back(session.submit("t", at::full({1, 4}, double(i))));
  REQUIRE(first.get().ok());
  for (std::size_t i = 0; i < rest.size(); ++i) {
    Result r = rest[i].get();
    INFO(i << ": " << r.status.ToString());
    REQUIRE(r.ok());  // before: "block 'rec': callback bug"
    CHECK(at::equal(r.output(), at::full({1, 4}, double(i + 3) * 2)));
  }
  std::lock_guard lock(recorder.mu);  // the one whose callback threw was batched with the others
  CHECK(std::any_of(recorder.calls.begin(), recorder.calls.end(), [](const auto& sizes) { return sizes.at(0) >= 4; }));
}

TEST_CASE("a batch group that throws fails its own requests only; the other groups' go on", "[batching]") {
  Recorder recorder;
  Session session(one_lane());
  serve_recorder(session, recorder);
  std::vector<std::future<Result>> futures;
  std::vector<Tensor> inputs;
  for (int i = 0; i < 9; ++i) {
    // Meta tensors stack, and then cannot be copied to the block's device: their group, the
    // batch's first, throws.
    const bool meta = i % 2 == 1;
    inputs.push_back(meta ? at::empty({1, 5}, at::TensorOptions().device(at::kMeta)) : at::full({1, 4}, double(i)));
    futures.push_back(session.submit("t", inputs.back()));
  }
  int failed = 0;
  for (std::size_t i = 0; i < futures.size(); ++i) {
    Result r = futures[i].get();
    if (inputs[i].is_meta()) {
      CHECK_FALSE(r.ok());
      CHECK_THAT(std::string(r.status.message()), Contains("block 'rec'"));
      ++failed;
      continue;
    }
    INFO(i << ": " << r.status.ToString());
    REQUIRE(r.ok());  // before, the group that threw failed them too
    CHECK(at::equal(r.output(), inputs[i] * 2));
  }
  CHECK(failed == 4);
  CHECK(session.metrics().blocks.at(0).batches >= 1);
}

TEST_CASE("batching in a worker process: equal outputs, counted in the worker", "[batching]") {
  BlockDescription d = test::model_block("cnn", "cnn_block1.pt", "w1", {-1, 3, 16, 16});
  d.options.max_batch = 8;
  d.options.max_batch_delay_ms = 20;
  Session workers, plain;
  workers.add_site(make_worker(test::test_worker("w1"))).add_block(d).add_path(Path::chain("t", {"cnn"}));
  BlockOptions p;
  p.intra_op_threads = 1;
  plain.add_block(test::load_block("cnn", "cnn_block1.pt", p)).add_path(Path::chain("t", {"cnn"}));
  test::require_started(workers);
  test::require_started(plain);
  at::manual_seed(9);
  std::vector<Tensor> inputs;
  std::vector<std::future<Result>> futures;
  for (int i = 0; i < 16; ++i) {
    inputs.push_back(at::randn({1, 3, 16, 16}));
    futures.push_back(workers.submit("t", inputs.back()));
  }
  for (std::size_t i = 0; i < futures.size(); ++i) {
    Result r = futures[i].get();
    INFO(r.status.ToString());
    REQUIRE(r.ok());
    CHECK(at::allclose(r.output(), plain.submit("t", inputs[i]).get().output(), 1e-4, 1e-5));
  }
}
