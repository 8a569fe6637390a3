// One thread's OpenMP width in libtorch's OpenMP runtime (include/blockflow/core/detail/omp_width.hpp).
#include <blockflow/core/detail/omp_width.hpp>

#include <ATen/Parallel.h>

#include <dlfcn.h>
#include <link.h>
#include <omp.h>

#include <cstring>
#include <string>

namespace blockflow::detail {
namespace {

struct OmpRuntime {
  void (*set)(int) = &::omp_set_num_threads;
  int (*get)() = &::omp_get_max_threads;
  bool own = false;
};

// The path of the loaded libtorch_cpu (or libtorch, in builds that have no split), "" if none.
std::string loaded_libtorch() {
  std::string path;
  dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t, void* data) {
        const char* name = info->dlpi_name;
        if (name == nullptr || name[0] == '\0') return 0;
        const char* base = std::strrchr(name, '/');
        base = base != nullptr ? base + 1 : name;
        if (std::strncmp(base, "libtorch_cpu.so", 15) == 0 || std::strncmp(base, "libtorch.so", 11) == 0) {
          auto& out = *static_cast<std::string*>(data);
          out = name;
          return std::strncmp(base, "libtorch_cpu.so", 15) == 0 ? 1 : 0;  // libtorch_cpu wins
        }
        return 0;
      },
      &path);
  return path;
}

// Whether a width set with `set` on this thread is the one libtorch reads (at::get_num_threads()
// asks libtorch's runtime); the thread's width is given back.
bool libtorch_reads(void (*set)(int)) {
  const int before = at::get_num_threads();  // also libtorch's lazy setting of this thread's width
  const int probe = before == 1 ? 2 : 1;
  set(probe);
  const bool reads = at::get_num_threads() == probe;
  set(before);
  return reads;
}

OmpRuntime resolve() {
  OmpRuntime linked;
  const std::string path = loaded_libtorch();
  if (path.empty()) return linked;
  // RTLD_NOLOAD: only a handle on what is loaded (never closed: libtorch stays for the process).
  // dlsym() on it searches libtorch and its dependencies only; the loader may have bound libtorch
  // to another copy found earlier in the process (same symbol versions), so the candidate is kept
  // only where libtorch reads what it sets.
  void* handle = ::dlopen(path.c_str(), RTLD_LAZY | RTLD_NOLOAD);
  if (handle == nullptr) return linked;
  auto* set = reinterpret_cast<void (*)(int)>(::dlsym(handle, "omp_set_num_threads"));
  auto* get = reinterpret_cast<int (*)()>(::dlsym(handle, "omp_get_max_threads"));
  if (set == nullptr || get == nullptr || set == linked.set) return linked;
  if (libtorch_reads(linked.set) || !libtorch_reads(set)) return linked;
  return OmpRuntime{set, get, true};
}

const OmpRuntime& runtime() {
  static const OmpRuntime r = resolve();
  return r;
}

}  // namespace

void set_thread_omp_width(int threads) { runtime().set(threads); }

int thread_omp_width() { return runtime().get(); }

bool torch_has_own_omp_runtime() { return runtime().own; }

}  // namespace blockflow::detail
