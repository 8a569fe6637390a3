#pragma once
// Internal: tells ThreadSanitizer about an ordering that uninstrumented code provides. In normal
// builds both calls are empty. Use only where a library hands an object from one thread to another
// through its own lock-free machinery (libzmq's pipes calling a zero-copy frame's free function on
// its I/O thread): release() before the hand-off on the sending side, acquire() where the other
// thread receives the object (docs/sanitizers.md).

#if defined(__GLIBC__) && !defined(__SANITIZE_ADDRESS__)
#include <malloc.h>
#endif

#if defined(__SANITIZE_THREAD__)
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace blockflow::detail::sanitizer {

/// Everything this thread did before is visible to the thread that later calls acquire(`token`).
inline void release([[maybe_unused]] void* token) {
#if defined(__SANITIZE_THREAD__)
  __tsan_release(token);
#endif
}

/// Pairs with release(`token`) on the thread that handed the object over.
inline void acquire([[maybe_unused]] void* token) {
#if defined(__SANITIZE_THREAD__)
  __tsan_acquire(token);
#endif
}

/// Hands the memory glibc's malloc keeps after frees back to the system (malloc_trim). Under
/// AddressSanitizer the heap is the sanitizer's, not glibc's: nothing to trim, and glibc's
/// malloc_trim on its unused arenas crashed there (a SEGV in mtrim, once, in the `warming` area).
inline void trim_malloc_heap() {
#if defined(__GLIBC__) && !defined(__SANITIZE_ADDRESS__)
  ::malloc_trim(0);
#endif
}

}  // namespace blockflow::detail::sanitizer
