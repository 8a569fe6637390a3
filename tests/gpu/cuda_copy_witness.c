/* A witness for "zero host<->device copies in the hand-off": LD_PRELOAD this library and every
 * process (children too) counts the CUDA runtime's memcpy calls by direction, and appends one line
 * per process to $BLOCKFLOW_COPY_WITNESS (or stderr) at exit:
 *   pid=N exe=NAME h2d=calls/bytes d2h=calls/bytes d2d=calls/bytes
 * Calls pass through unchanged (dlsym RTLD_NEXT). It sees the calls libtorch and BlockFlow make
 * through libcudart's dynamic symbols, which is how both copy tensors. Used by scripts/gpu.sh. */
#define _GNU_SOURCE
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static atomic_ullong calls[4], bytes[4]; /* by cudaMemcpyKind: 1 h2d, 2 d2h, 3 d2d; 0 other */

/* The real function. A process that loads libcudart with dlopen(RTLD_LOCAL) (a worker loads its
 * runtime module that way) hides it from RTLD_NEXT: ask the loaded library itself then. */
static void* real(const char* name) {
  void* p = dlsym(RTLD_NEXT, name);
  static const char* libs[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so"};
  for (unsigned i = 0; !p && i < sizeof(libs) / sizeof(libs[0]); ++i) {
    void* h = dlopen(libs[i], RTLD_NOW | RTLD_NOLOAD);
    if (h) p = dlsym(h, name);
  }
  return p;
}

static int direction(const void* dst, const void* src, enum cudaMemcpyKind kind) {
  if (kind == cudaMemcpyHostToDevice) return 1;
  if (kind == cudaMemcpyDeviceToHost) return 2;
  if (kind == cudaMemcpyDeviceToDevice) return 3;
  if (kind == cudaMemcpyDefault) {
    typedef cudaError_t (*attr_fn)(struct cudaPointerAttributes*, const void*);
    static attr_fn attr = NULL;
    if (!attr) attr = (attr_fn)real("cudaPointerGetAttributes");
    struct cudaPointerAttributes a, b;
    int dst_dev = attr && attr(&a, dst) == cudaSuccess && a.type == cudaMemoryTypeDevice;
    int src_dev = attr && attr(&b, src) == cudaSuccess && b.type == cudaMemoryTypeDevice;
    return dst_dev && src_dev ? 3 : dst_dev ? 1 : src_dev ? 2 : 0;
  }
  return 0;
}

static void count(const void* dst, const void* src, size_t n, enum cudaMemcpyKind kind) {
  int d = direction(dst, src, kind);
  atomic_fetch_add(&calls[d], 1);
  atomic_fetch_add(&bytes[d], n);
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, enum cudaMemcpyKind kind) {
  typedef cudaError_t (*fn)(void*, const void*, size_t, enum cudaMemcpyKind);
  static fn next = NULL;
  if (!next) next = (fn)real("cudaMemcpy");
  if (!next) return cudaErrorUnknown;
  count(dst, src, n, kind);
  return next(dst, src, n, kind);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, enum cudaMemcpyKind kind, cudaStream_t s) {
  typedef cudaError_t (*fn)(void*, const void*, size_t, enum cudaMemcpyKind, cudaStream_t);
  static fn next = NULL;
  if (!next) next = (fn)real("cudaMemcpyAsync");
  if (!next) return cudaErrorUnknown;
  count(dst, src, n, kind);
  return next(dst, src, n, kind, s);
}

cudaError_t cudaMemcpyPeerAsync(void* dst, int dd, const void* src, int sd, size_t n, cudaStream_t s) {
  typedef cudaError_t (*fn)(void*, int, const void*, int, size_t, cudaStream_t);
  static fn next = NULL;
  if (!next) next = (fn)real("cudaMemcpyPeerAsync");
  if (!next) return cudaErrorUnknown;
  atomic_fetch_add(&calls[3], 1);
  atomic_fetch_add(&bytes[3], n);
  return next(dst, dd, src, sd, n, s);
}

__attribute__((destructor)) static void report(void) {
  char exe[256] = "?";
  ssize_t len = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (len > 0) exe[len] = 0;
  const char* base = strrchr(exe, '/');
  const char* path = getenv("BLOCKFLOW_COPY_WITNESS");
  FILE* out = path ? fopen(path, "a") : stderr;
  if (!out) return;
  fprintf(out, "pid=%d exe=%s h2d=%llu/%llu d2h=%llu/%llu d2d=%llu/%llu\n", (int)getpid(), base ? base + 1 : exe,
          (unsigned long long)calls[1], (unsigned long long)bytes[1], (unsigned long long)calls[2],
          (unsigned long long)bytes[2], (unsigned long long)calls[3], (unsigned long long)bytes[3]);
  if (out != stderr) fclose(out);
}
