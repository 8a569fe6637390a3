#pragma once
// Tests of the shared-memory pools: what the data link does for a pool's first packet, by hand.
#include <blockflow/channel/detail/shm_pool.hpp>

#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstdint>

namespace blockflow::test {

/// Gives `consumer` a descriptor of pool `pool_id` (made or mapped in this process), as the data
/// link does with the first packet that names the pool.
inline void give_pool(detail::ShmConsumer& consumer, std::uint64_t pool_id) {
  const int fd = ::dup(detail::shm_pool_fd(pool_id).fd);
  REQUIRE(fd >= 0);
  auto adopted = consumer.adopt(fd);
  INFO(adopted.status().ToString());
  REQUIRE(adopted.ok());
  CHECK(*adopted == pool_id);
}

}  // namespace blockflow::test
