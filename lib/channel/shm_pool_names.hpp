#pragma once
// Internal to the shared-memory pools (shm_pool.cpp): the names of their /dev/shm objects, the ids
// in them, and the sweep of the objects no live producer holds.

#include <cstdint>
#include <string>

namespace blockflow::detail {

/// "/blockflow-<16 hex digits>": the shm_open() name of pool `pool_id` (shm_pool_id() reads it back).
std::string shm_name(std::uint64_t pool_id);
/// A fresh pool id: this process's pid in the high 32 bits, random low 32 bits.
std::uint64_t new_pool_id();
/// flock(LOCK_SH), waiting out a sweeper that holds LOCK_EX for a moment.
bool lock_shared(int fd);
/// Unlinks the /dev/shm/blockflow-* objects that no live producer holds.
void sweep_orphaned_pools();

}  // namespace blockflow::detail
