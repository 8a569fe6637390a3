// The test driver. With BLOCKFLOW_TEST_FORK_SERVER set (ctest's `fork_server` area), the process
// starts a fork server before anything else, as an application would (fork_server_test.cpp).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <blockflow/worker/fork_server.hpp>

#include <unistd.h>

#include <cstdlib>
#include <iostream>

// An inheritable pipe the process held when its fork server started: neither the server nor a
// worker forked from it may hold it (fork_server_test.cpp). -1 without a fork server.
int blockflow_test_pipe_before_fork_server[2] = {-1, -1};

int main(int argc, char** argv) {
  if (const char* fork = std::getenv("BLOCKFLOW_TEST_FORK_SERVER"); fork != nullptr && *fork != '\0') {
    if (::pipe(blockflow_test_pipe_before_fork_server) != 0) return 1;  // no O_CLOEXEC
    if (auto started = blockflow::start_fork_server(); !started.ok()) {
      std::cerr << "start_fork_server: " << started << "\n";
      return 1;
    }
  }
  return Catch::Session().run(argc, argv);
}
