// Outputs a zmq worker keeps for direct edges (lib/worker/worker_replies.hpp, ParkedOutputs): bounded
// by count and bytes, taken out once, and dropped at once when the reply naming them never left.
#include "../lib/worker/worker_replies.hpp"

#include <catch2/catch.hpp>

#include <torch/torch.h>

using blockflow::detail::ParkedOutputs;

namespace parked_outputs_test {

at::Tensor bytes(std::int64_t n) { return torch::full({n}, 7, torch::kUInt8); }

}  // namespace parked_outputs_test

TEST_CASE("parked outputs are bounded by count and bytes, and a taken one is gone", "[worker]") {
  using parked_outputs_test::bytes;
  ParkedOutputs parked;
  parked.set_limits(/*max_count=*/3, /*max_bytes=*/1000);

  auto a = parked.park({bytes(400), bytes(400)});
  REQUIRE(a.has_value());
  REQUIRE(a->size() == 2);
  CHECK((*a)[1] == (*a)[0] + 1);
  CHECK_FALSE(parked.park({bytes(300)}).has_value());                // 1100 bytes: over max_bytes
  CHECK_FALSE(parked.park({bytes(10), bytes(10)}).has_value());      // 4 entries: over max_count
  auto b = parked.park({bytes(200)});                                // 1000 bytes, 3 entries: fits
  REQUIRE(b.has_value());
  CHECK_FALSE(parked.park({bytes(1)}).has_value());

  // Left in place: the same tensors again; taken out: gone, and their room with them.
  auto kept = parked.get(*a, /*release=*/false);
  REQUIRE(kept.has_value());
  REQUIRE(kept->size() == 2);
  CHECK((*kept)[0].nbytes() == 400);
  CHECK((*kept)[0].data_ptr<std::uint8_t>()[0] == 7);
  auto taken = parked.get(*a, /*release=*/true);
  REQUIRE(taken.has_value());
  CHECK_FALSE(parked.get(*a, /*release=*/false).has_value());
  CHECK_FALSE(parked.get({(*a)[0], (*b)[0]}, /*release=*/false).has_value());  // one unknown: nothing
  CHECK(parked.park({bytes(800)}).has_value());

  // Only contiguous CPU tensors are kept, and an empty set is not.
  CHECK_FALSE(parked.park({bytes(8).view({2, 4}).t()}).has_value());
  CHECK_FALSE(parked.park({}).has_value());
}

TEST_CASE("outputs named by a reply that never left are dropped at once", "[worker]") {
  using parked_outputs_test::bytes;
  ParkedOutputs parked;
  parked.set_limits(8, 1000);
  auto a = parked.park({bytes(500), bytes(400)});
  REQUIRE(a.has_value());
  CHECK_FALSE(parked.park({bytes(500)}).has_value());

  std::vector<std::string> frames;
  for (const auto id : *a) frames.push_back(blockflow::wire::encode_parked_ids({id}));
  frames.emplace_back("not a reference frame");  // ignored
  parked.drop_referenced(frames);
  CHECK_FALSE(parked.get({(*a)[0]}, false).has_value());
  CHECK_FALSE(parked.get({(*a)[1]}, false).has_value());
  CHECK(parked.park({bytes(1000)}).has_value());  // the room came back
}
