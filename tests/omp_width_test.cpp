// detail::set_thread_omp_width(): a thread's OpenMP width, in the runtime libtorch reads.
#include <blockflow/core/detail/omp_width.hpp>

#include <ATen/Parallel.h>
#include <catch2/catch.hpp>

#include <thread>

TEST_CASE("set_thread_omp_width: libtorch runs the width set on this thread; the other threads keep theirs", "[lanes]") {
  const int main_width = at::get_num_threads();
  int seen_one = 0, seen_two = 0, read_back = 0;
  std::thread lane([&] {
    (void)at::get_num_threads();  // libtorch's lazy width of this thread first, as a lane does
    blockflow::detail::set_thread_omp_width(1);
    seen_one = at::get_num_threads();
    blockflow::detail::set_thread_omp_width(2);
    seen_two = at::get_num_threads();
    read_back = blockflow::detail::thread_omp_width();
  });
  lane.join();
  INFO("libtorch has an OpenMP runtime of its own: " << blockflow::detail::torch_has_own_omp_runtime());
  CHECK(seen_one == 1);
  CHECK(seen_two == 2);
  CHECK(read_back == 2);
  CHECK(at::get_num_threads() == main_width);
}
