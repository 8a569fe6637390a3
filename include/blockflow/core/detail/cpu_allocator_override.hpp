#pragma once
// Internal: what an override of c10::Allocator must declare in the libtorch it is built against,
// for the CPU allocators BlockFlow installs in front of libtorch's (the shared-memory slot
// allocator, the weight-capturing allocator of swapping). libtorch 2.3 made allocate() non-const
// and added the pure copy_data(); 1.13 (Debian's) has neither.

#include <c10/core/Allocator.h>
#include <torch/version.h>

#include <cstring>

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
/// The qualifier of an allocate() override.
#define BLOCKFLOW_ALLOCATE_CONST
/// The copy_data() override a plain CPU allocator needs (its bytes copy as bytes).
#define BLOCKFLOW_CPU_COPY_DATA \
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
#else
#define BLOCKFLOW_ALLOCATE_CONST const
#define BLOCKFLOW_CPU_COPY_DATA
#endif
