// A worker that joins over TCP loads only what its own command line allows (issue 21, "nothing from
// the wire chooses code or files"): the plugins given with --plugin and TorchScript files inside
// --models. Whatever else the session's configuration names fails start(), naming the path and the
// option that would allow it, in the same words whether or not a file outside exists. Every
// refusal is a case of its own, as in libzmq's security tests. Child workers (the session's own,
// over its private ipc directory) keep loading what their parent names: tests/worker_test.cpp.
#include "joined_util.hpp"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/script.h>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <array>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace fs = std::filesystem;
using namespace blockflow;
using Catch::Matchers::Contains;
using namespace std::chrono_literals;
using test::WorkerProcess;

namespace {

// A scratch directory, removed at the end: models/ (a worker's --models) holds double.pt (2x, made
// here, so the case needs no exported models); outside/ holds a copy of it, exists.pt.
struct Scratch {
  Scratch() : root(fs::temp_directory_path() / fmt::format("bf-allow-{}-{}", ::getpid(), ++count)) {
    fs::create_directories(models());
    fs::create_directories(outside());
    torch::jit::Module m("Double");
    m.define("def forward(self, x):\n    return x * 2\n");
    m.save((models() / "double.pt").string());
    fs::copy_file(models() / "double.pt", outside() / "exists.pt");
  }
  ~Scratch() {
    test::remove_tree(root.string());
  }
  fs::path models() const { return root / "models"; }
  fs::path outside() const { return root / "outside"; }
  static inline int count = 0;
  fs::path root;
};

// A TorchScript block with this file, as the session's configuration names it.
BlockDescription script_block(const std::string& name, const std::string& file) {
  BlockDescription d;
  d.name = name;
  d.torchscript = file;
  d.options.intra_op_threads = 1;
  d.options.input_shapes = {{-1, 4}};
  return d;
}

// Runs `blockflow-worker args...` to its end; its exit status and what it wrote on stderr.
std::pair<int, std::string> run_worker(const std::vector<std::string>& args, const fs::path& log) {
  WorkerProcess worker(args, log.string());
  const auto status = worker.exit_status(30000ms);
  REQUIRE(status.has_value());
  return {*status, worker.log()};
}

// A session whose worker "far" (listen tcp://127.0.0.1:PORT) hosts `blocks`, each on a path of its
// name, with `plugins` in its configuration; and `blockflow-worker --join ... --name far --once
// worker_args...` as an operator would start it on the other host.
class JoinedWorker {
 public:
  JoinedWorker(const std::vector<std::string>& worker_args, std::vector<BlockDescription> blocks,
               std::vector<std::string> plugins)
      : listen_(fmt::format("tcp://127.0.0.1:{}", test::free_port())),
        worker_(WorkerProcess::join_args(listen_, "far", worker_args)) {
    WorkerOptions o = test::test_worker("far");
    o.plugins = std::move(plugins);
    o.listen = listen_;
    o.start_timeout = absl::Seconds(30);
    session.add_site(make_worker(o));
    for (auto& b : blocks) {
      b.placement = "far";
      const std::string name = b.name;
      session.add_block(std::move(b)).add_path(Path::chain(name, {name}));
    }
  }
  ~JoinedWorker() {
    session.shutdown();
    (void)worker_.exit_status(5000ms);  // then killed if it still runs
  }
  JoinedWorker(const JoinedWorker&) = delete;
  JoinedWorker& operator=(const JoinedWorker&) = delete;

  // start()'s error message; fails the test if the session started.
  std::string start_error() {
    const absl::Status status = session.start();
    REQUIRE_FALSE(status.ok());
    return std::string(status.message());
  }
  // The worker's exit status once it has exited (within `within`).
  std::optional<int> exit_status(std::chrono::milliseconds within) { return worker_.exit_status(within); }

 private:
  std::string listen_;
  WorkerProcess worker_;

 public:
  Session session;
};

// The start error of a worker with `--models scratch.models()` asked for a TorchScript `file`.
std::string refused(const Scratch& scratch, const std::string& file) {
  JoinedWorker w({"--models", scratch.models().string()}, {script_block("m", file)}, {});
  const std::string message = w.start_error();
  const auto status = w.exit_status(10000ms);  // refused and gone (--once), not crashed
  REQUIRE(status.has_value());
  CHECK(WIFEXITED(*status));
  CHECK(WEXITSTATUS(*status) == 1);
  return message;
}

std::string replaced(std::string text, const std::string& from, const std::string& to) {
  for (auto at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size())) text.replace(at, from.size(), to);
  return text;
}

}  // namespace

TEST_CASE("a joined worker without --plugin refuses a plugin its session names, naming it and --plugin",
          "[worker_allowlist]") {
  JoinedWorker w({}, {test::plugin_block("affine", "affine", "")}, {BLOCKFLOW_TEST_PLUGIN});
  const std::string message = w.start_error();
  CHECK_THAT(message, Contains(fmt::format("worker far: plugin '{}' is not among this worker's --plugin arguments",
                                           BLOCKFLOW_TEST_PLUGIN)));
  const auto status = w.exit_status(10000ms);
  REQUIRE(status.has_value());
  CHECK(WIFEXITED(*status));
  CHECK(WEXITSTATUS(*status) == 1);
}

TEST_CASE("a joined worker loads a plugin given with --plugin (its path or a link to it) and runs its block",
          "[worker_allowlist]") {
  Scratch scratch;
  std::string allowed = BLOCKFLOW_TEST_PLUGIN;
  SECTION("the plugin's path") {}
  SECTION("a symbolic link to it: compared once links are resolved") {
    allowed = (scratch.root / "plugin-link.so").string();
    fs::create_symlink(BLOCKFLOW_TEST_PLUGIN, allowed);
  }
  JoinedWorker w({"--plugin", allowed}, {test::plugin_block("affine", "affine", "")}, {BLOCKFLOW_TEST_PLUGIN});
  test::require_started(w.session);
  const Tensor x = at::arange(8, at::kFloat).reshape({2, 4});
  Result r = w.session.submit("affine", x).get();
  INFO(r.status.ToString());
  REQUIRE(r.ok());
  CHECK(at::equal(r.output(), x * 3 + 1));
}

TEST_CASE("a joined worker refuses TorchScript files outside --models, the same way whether or not they exist",
          "[worker_allowlist]") {
  Scratch scratch;
  const std::string outside = scratch.outside().string();
  SECTION("an absolute path") {
    const std::string exists = refused(scratch, outside + "/exists.pt");
    const std::string missing = refused(scratch, outside + "/missing.pt");
    CHECK_THAT(exists, Contains(fmt::format("block 'm': TorchScript path '{}/exists.pt' is not inside the models directory "
                                            "(this worker's --models)", outside)));
    CHECK(replaced(exists, "exists.pt", "missing.pt") == missing);
  }
  SECTION("a relative path that climbs out with ..") {
    const std::string exists = refused(scratch, "../outside/exists.pt");
    const std::string missing = refused(scratch, "../outside/missing.pt");
    CHECK_THAT(exists, Contains("TorchScript path '../outside/exists.pt' is not inside the models directory "
                                "(this worker's --models)"));
    CHECK(replaced(exists, "exists.pt", "missing.pt") == missing);
  }
  SECTION("a symbolic link in the models directory to a file outside") {
    fs::create_symlink(scratch.outside() / "exists.pt", scratch.models() / "link.pt");
    CHECK_THAT(refused(scratch, "link.pt"), Contains("TorchScript path 'link.pt' is not inside the models directory"));
  }
}

TEST_CASE("a joined worker without --models refuses every TorchScript block, naming --models", "[worker_allowlist]") {
  Scratch scratch;
  const std::string inside = (scratch.models() / "double.pt").string();
  JoinedWorker w({}, {script_block("m", inside)}, {});
  CHECK_THAT(w.start_error(),
             Contains(fmt::format("block 'm': TorchScript path '{}' refused: this worker was started without --models DIR",
                                  inside)));
}

TEST_CASE("a joined worker loads TorchScript files inside --models, relative or absolute", "[worker_allowlist]") {
  Scratch scratch;
  JoinedWorker w({"--models", scratch.models().string()},
                 {script_block("relative", "double.pt"), script_block("absolute", (scratch.models() / "double.pt").string())},
                 {});
  test::require_started(w.session);
  const Tensor x = at::arange(8, at::kFloat).reshape({2, 4});
  for (const char* task : {"relative", "absolute"}) {
    Result r = w.session.submit(task, x).get();
    INFO(task << ": " << r.status.ToString());
    REQUIRE(r.ok());
    CHECK(at::equal(r.output(), x * 2));
  }
}

TEST_CASE("blockflow-worker checks --plugin and --models when it starts, and takes them only with --join",
          "[worker_allowlist]") {
  Scratch scratch;
  const fs::path log = scratch.root / "stderr";
  const std::string join[] = {"--join", "tcp://127.0.0.1:1", "--name", "far", "--once"};
  const std::vector<std::string> joined(std::begin(join), std::end(join));
  auto with = [&](std::vector<std::string> args, const std::vector<std::string>& more) {
    args.insert(args.end(), more.begin(), more.end());
    return args;
  };
  auto [missing_plugin, plugin_text] = run_worker(with(joined, {"--plugin", "/nonexistent/p.so"}), log);
  CHECK(WEXITSTATUS(missing_plugin) == 2);
  CHECK_THAT(plugin_text, Contains("--plugin /nonexistent/p.so: no such file"));
  auto [missing_dir, dir_text] = run_worker(with(joined, {"--models", "/nonexistent/models"}), log);
  CHECK(WEXITSTATUS(missing_dir) == 2);
  CHECK_THAT(dir_text, Contains("--models /nonexistent/models: no such directory"));
  auto [child, child_text] = run_worker({"--name", "w", "--control", "ipc:///x", "--requests", "ipc:///y", "--results",
                                         "ipc:///z", "--parent", "1", "--plugin", BLOCKFLOW_TEST_PLUGIN},
                                        log);
  CHECK(WEXITSTATUS(child) == 2);
  CHECK_THAT(child_text, Contains("--plugin, --models, --key and --session-key are for --join"));
  auto [bad_parent, parent_text] = run_worker(
      {"--name", "w", "--control", "ipc:///x", "--requests", "ipc:///y", "--results", "ipc:///z", "--parent", "abc"}, log);
  CHECK(WEXITSTATUS(bad_parent) == 2);
  CHECK_THAT(parent_text, Contains("--parent takes a whole number") && Contains("'abc'"));
}

TEST_CASE("a joined worker refuses the endpoints and files its session's configuration names; nothing is touched",
          "[worker_allowlist]") {
  Scratch scratch;
  const fs::path victim = scratch.root / "victim.txt";
  std::ofstream(victim) << "operator's file\n";
  std::string field, value;
  SECTION("a peer endpoint over a file (binding it would unlink the file)") {
    field = "peer_endpoint";
    value = "ipc://" + victim.string();
  }
  SECTION("a peer endpoint open to every interface") {
    field = "peer_endpoint";
    value = "tcp://0.0.0.0:0";
  }
  SECTION("a data link to a local socket") {
    field = "data_link";
    value = victim.string();
  }
  // A fake session: whoever answers at the address the worker joins.
  const int port = test::free_port();
  zmq::context_t context;
  zmq::socket_t session(context, zmq::socket_type::router);
  session.set(zmq::sockopt::rcvtimeo, 20000);
  session.set(zmq::sockopt::linger, 0);
  session.bind(fmt::format("tcp://127.0.0.1:{}", port));
  WorkerProcess worker(WorkerProcess::join_args(fmt::format("tcp://127.0.0.1:{}", port), "far"));
  std::vector<zmq::message_t> hello;
  REQUIRE(zmq::recv_multipart(session, std::back_inserter(hello)));
  REQUIRE(hello.size() >= 2);
  nlohmann::json config = {{"type", "config"}, {"blocks", nlohmann::json::array()}, {"requests_port", port + 1},
                           {"results_port", port + 2}, {field, value}};
  if (field == "data_link") config["channel"] = "shm";
  const std::string identity = hello.front().to_string(), text = config.dump();
  std::array<zmq::const_buffer, 2> out{zmq::buffer(identity), zmq::buffer(text)};
  REQUIRE(zmq::send_multipart(session, out));
  std::optional<nlohmann::json> answer;
  for (int i = 0; i < 10 && !answer; ++i) {  // the first answer that is not a heartbeat
    std::vector<zmq::message_t> frames;
    REQUIRE(zmq::recv_multipart(session, std::back_inserter(frames)));
    auto json = nlohmann::json::parse(frames.back().to_string(), nullptr, false);
    if (json.is_object() && json.value("type", "") != "heartbeat") answer = json;
  }
  REQUIRE(answer.has_value());
  CHECK(answer->value("type", "") == "load_error");
  CHECK_THAT(answer->value("message", ""), Contains(fmt::format("configuration field '{}'", field)));
  const auto status = worker.exit_status(10000ms);
  REQUIRE(status.has_value());
  CHECK(WIFEXITED(*status));
  CHECK(fs::is_regular_file(victim));
  std::stringstream kept;
  kept << std::ifstream(victim).rdbuf();
  CHECK(kept.str() == "operator's file\n");
}

TEST_CASE("a joined worker bounds the warm-up of a plugin's block as any deployment from the wire",
          "[worker_allowlist]") {
  BlockDescription b = test::plugin_block("affine", "affine", "");
  b.options.warmup_runs = 100000;
  JoinedWorker w({"--plugin", BLOCKFLOW_TEST_PLUGIN}, {b}, {BLOCKFLOW_TEST_PLUGIN});
  CHECK_THAT(w.start_error(), Contains("warmup_runs 100000 is above"));
}
