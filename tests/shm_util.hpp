#pragma once
// Tests of the shared-memory pools: what the data link does for a pool's first packet, by hand,
// and which pools a process maps.
#include <blockflow/channel/detail/shm_pool.hpp>

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <set>
#include <string>
#include <string_view>

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

/// The pools that process `pid` maps and process `producer` made (the pid in their id), from
/// /proc/PID/maps ("/memfd:blockflow-<id>").
inline std::set<std::uint64_t> pools_mapped_by(std::int64_t pid, std::int64_t producer) {
  std::set<std::uint64_t> ids;
  std::ifstream maps(fmt::format("/proc/{}/maps", pid));
  std::string line;
  while (std::getline(maps, line)) {
    const auto at = line.find("/memfd:");
    if (at == std::string::npos) continue;
    const auto id = detail::shm_pool_id(std::string_view(line).substr(at, line.find(' ', at) - at));
    if (id && detail::shm_pool_producer(*id) == producer) ids.insert(*id);
  }
  return ids;
}

}  // namespace blockflow::test
