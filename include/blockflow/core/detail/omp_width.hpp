#pragma once
// One thread's OpenMP width, set in the OpenMP runtime that libtorch's parallel ops use.
//
// Debian's libtorch and this library share the system's libgomp. PyTorch's wheels carry a libgomp
// of their own (renamed, e.g. libgomp-a34b3233.so.1) that libtorch_cpu is bound to: there, the
// `omp_set_num_threads` this library links would set a width in a runtime libtorch never reads,
// and a lane meant to run one thread would run libtorch's default team (every core). These
// functions call the runtime that libtorch_cpu resolves, found once through libtorch_cpu's own
// dependencies and kept only where libtorch reads the width it sets (at::get_num_threads()); else
// the linked one.

namespace blockflow::detail {

// omp_set_num_threads() of libtorch's OpenMP runtime: the calling thread's width only (unlike
// at::set_num_threads(), which also changes the default of threads not yet made).
void set_thread_omp_width(int threads);

// omp_get_max_threads() of libtorch's OpenMP runtime: the width of the calling thread's next team.
int thread_omp_width();

// Whether libtorch's OpenMP runtime is another library than the one this library links (a
// PyTorch wheel's libtorch); for logs and tests.
bool torch_has_own_omp_runtime();

}  // namespace blockflow::detail
