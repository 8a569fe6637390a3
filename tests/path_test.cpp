// Path validation: every malformed path is rejected at start() with a message naming it.
#include "test_util.hpp"

using namespace blockflow;
using Catch::Matchers::Contains;

namespace {

// Starts a session with blocks a, b, c and the given path; returns start()'s status.
absl::Status start_with(Path path) {
  Session session;
  for (const char* name : {"a", "b", "c"}) session.add_block(test::unary(name, [](const Tensor& x) { return x + 1; }));
  session.add_path(std::move(path));
  return session.start();
}

}  // namespace

TEST_CASE("an empty path is rejected, naming the path", "[path]") {
  auto status = start_with(Path("lonely"));
  CHECK(absl::IsInvalidArgument(status));
  CHECK_THAT(std::string(status.message()), Contains("path 'lonely'") && Contains("empty"));
}

TEST_CASE("a path naming an unknown block is rejected, naming path and block", "[path]") {
  auto status = start_with(Path::chain("task1", {"a", "nope", "c"}));
  CHECK(absl::IsInvalidArgument(status));
  CHECK_THAT(std::string(status.message()), Contains("path 'task1'") && Contains("unknown block 'nope'"));
}

TEST_CASE("a chain that visits a block twice is a cycle", "[path]") {
  auto status = start_with(Path::chain("loop", {"a", "b", "a"}));
  CHECK(absl::IsInvalidArgument(status));
  CHECK_THAT(std::string(status.message()), Contains("path 'loop'") && Contains("cycle") && Contains("'a'"));
}

TEST_CASE("a DAG with a cycle through explicit inputs is rejected, naming the nodes", "[path]") {
  Path path("dag");
  path.node("a", {}).node("b", {"a", "c"}).node("c", {"b"});
  auto status = start_with(path);
  CHECK(absl::IsInvalidArgument(status));
  CHECK_THAT(std::string(status.message()), Contains("path 'dag'") && Contains("cycle") && Contains("b") &&
                                                 Contains("c"));
}

TEST_CASE("an input that is not a node of the path is rejected", "[path]") {
  Path path("p");
  path.node("a", {}).node("b", {"ghost"});
  auto status = start_with(path);
  CHECK_THAT(std::string(status.message()), Contains("path 'p'") && Contains("'ghost'"));
}

TEST_CASE("a path with two output nodes is rejected", "[path]") {
  Path path("forked");
  path.node("a", {}).node("b", {"a"}).node("c", {"a"});
  auto status = start_with(path);
  CHECK(absl::IsInvalidArgument(status));
  CHECK_THAT(std::string(status.message()), Contains("path 'forked'") && Contains("2 output nodes") &&
                                                 Contains("b, c"));
}

TEST_CASE("two paths for one task and two blocks with one name are rejected", "[path]") {
  Session twice;
  twice.add_block(test::unary("a", [](const Tensor& x) { return x; }))
      .add_path(Path::chain("t", {"a"}))
      .add_path(Path::chain("t", {"a"}));
  CHECK_THAT(std::string(twice.start().message()), Contains("path 't'") && Contains("two paths"));

  Session dup;
  dup.add_block(test::unary("a", [](const Tensor& x) { return x; }))
      .add_block(test::unary("a", [](const Tensor& x) { return x; }));
  CHECK_THAT(std::string(dup.start().message()), Contains("two blocks are named 'a'"));
}

TEST_CASE("valid chains and DAGs start; blocks are shared by several paths", "[path]") {
  Session session;
  for (const char* name : {"a", "b", "c"}) session.add_block(test::unary(name, [](const Tensor& x) { return x + 1; }));
  session.add_path(Path::chain("t1", {"a", "b"}))
      .add_path(Path::chain("t2", {"a", "c"}))
      .add_path(Path("t3").node("a", {}).node("b", {"a"}).node("c", {"a"}).join("sum", {"b", "c"}, Combine::mean()));
  test::require_started(session);
  CHECK(session.submit("t1", at::zeros({1})).get().output().item<float>() == 2.0f);
  CHECK(session.submit("t2", at::zeros({1})).get().output().item<float>() == 2.0f);
  CHECK(session.submit("t3", at::zeros({1})).get().output().item<float>() == 2.0f);
}
