// cold_start: time from process start to the first resolved request (issue 20), in one run:
//   monolithic  the whole ResNet50 in a process of its own, loaded as a block is (freeze,
//               optimize_for_inference) and run once: what a user runs instead;
//   threads     the split in a session, its four blocks on the lanes;
//   workers     the split in a session of four worker processes over shm, each started as a new
//               program (blockflow-worker, which loads libtorch once configured);
//   workers_forked  the same with the workers forked from a fork server (start_fork_server() first
//               in main(); the process runs with GOMP_SPINCOUNT=10000, the workers' default, so
//               that their environment lets them be forked);
//   two_tasks   the split and a second task (block1-3 and head_b) in threads: start() loads all five;
//   two_tasks_warming  the same with SessionOptions::serve_while_warming: the split's first result
//               once its four blocks have loaded, head_b loading after;
// and, to show what is physically possible on the machine, floors with no session at all:
//   threads_floor  the four blocks loaded at once, one thread per core, and chained once with no
//                  warm-up (the first forward pays TorchScript's profiling run, as the monolithic's does);
//   libtorch_floor  this program bringing libtorch up (dynamic linking and libtorch's static
//                  initialisers: ~300 ms on the 2-core machine) and running one op, nothing loaded:
//                  what every mode, the monolithic included, pays before its first model byte;
//   workers_floor  a process that starts four processes of this program at once, each bringing
//                  libtorch up and loading nothing, and reports when the last is up;
//   forked_floor   what a fork server could give workers: one process brings libtorch up, runs no
//                  op, and forks four children that each load one block of the split and run it
//                  once, with one intra-op thread (four loads on the cores at once; with two threads
//                  each, their OpenMP teams oversubscribe the cores); it reports when the last child
//                  is done (no session, no hand-offs).
// Each measurement is a fresh process (posix_spawn of this program, `--child MODE`), the modes
// alternating round by round after one unmeasured round (page cache). The time runs from just before
// posix_spawn to the child's line saying that its first request resolved; the child also reports
// its session's StartStats (metrics().start). One line per mode, then the ratios to the monolithic.
//
// usage: cold_start_bench --models DIR [--rounds N] [--threads T] [--warmup-runs N] [--modes monolithic,M,...]
#include "alone_process.hpp"
#include "bench_util.hpp"
#include "resnet_split.hpp"

#include <blockflow/blockflow.hpp>
#include <blockflow/core/detail/clock.hpp>
#include <blockflow/worker/fork_server.hpp>
#include <blockflow/worker/worker_site.hpp>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <map>
#include <sstream>

namespace bf = blockflow;

namespace {

struct Sample {
  double first_result_ms = 0;  // posix_spawn -> the child's line
  double start_ms = 0;         // the child's Session::start()
  double internal_ms = 0;      // the child's own process start -> first result
  double request_ms = 0;       // the first request itself (its e2e; the first forward with no session)
};

Sample measure(const std::string& mode, const std::string& models, int threads, int warmup_runs);

// The child: brings the mode up, resolves one request, prints
// "first_result START_MS PROCESS_TO_FIRST_MS FIRST_REQUEST_MS".
int child(const std::string& mode, const std::string& models, int threads, int warmup_runs) {
  if (mode == "forked_floor") {  // before any op: no OpenMP team exists to be lost in the children
    std::vector<pid_t> children;
    for (const auto& [name, shape] : bf::bench::resnet_split_stages()) {
      const pid_t pid = ::fork();
      if (pid < 0) throw std::runtime_error("forked_floor: fork failed");
      if (pid == 0) {
        at::set_num_threads(1);
        auto block = bf::make_block(bf::bench::model_block(models, name, shape, 1, true));
        if (!block.ok()) ::_exit(1);
        c10::InferenceMode inference_mode;
        auto out = (*block)->forward({at::zeros(shape)});
        ::_exit(out.ok() ? 0 : 1);
      }
      children.push_back(pid);
    }
    for (const pid_t pid : children) {
      int status = 0;
      if (::waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        throw std::runtime_error("forked_floor: a child failed");
      }
    }
    fmt::print("first_result 0 {:.1f} 0\n", bf::process_age_seconds() * 1e3);
    return 0;
  }
  const at::Tensor x = at::randn({1, 3, 224, 224});
  if (mode == "libtorch" || mode == "libtorch_floor") {  // libtorch up, nothing loaded (also a workers_floor child)
    at::set_num_threads(threads);
    (void)(x + 1);
    fmt::print("first_result 0 {:.1f} 0\n", bf::process_age_seconds() * 1e3);
    return 0;
  }
  if (mode == "workers_floor") {
    std::vector<std::thread> starting;
    for (int i = 0; i < 4; ++i) starting.emplace_back([&] { (void)measure("libtorch", models, threads, warmup_runs); });
    for (auto& t : starting) t.join();
    fmt::print("first_result 0 {:.1f} 0\n", bf::process_age_seconds() * 1e3);
    return 0;
  }
  if (mode == "threads_floor") {
    const auto& stages = bf::bench::resnet_split_stages();
    std::vector<std::shared_ptr<bf::Block>> blocks(stages.size());
    std::atomic<std::size_t> next{0};
    std::vector<std::thread> builders;
    for (unsigned b = 0; b < std::max(1U, std::thread::hardware_concurrency()); ++b) {
      builders.emplace_back([&] {
        for (std::size_t i = next++; i < stages.size(); i = next++) {
          auto made = bf::make_block(bf::bench::model_block(models, stages[i].first, stages[i].second, threads, true));
          if (made.ok()) blocks[i] = *made;
        }
      });
    }
    for (auto& t : builders) t.join();
    at::set_num_threads(threads);
    c10::InferenceMode inference_mode;
    const std::int64_t t0 = bf::detail::now_ns();
    bf::Tensors values{x};
    for (auto& block : blocks) {
      if (!block) throw std::runtime_error("threads_floor: a block did not load");
      auto out = block->forward(std::move(values));
      if (!out.ok()) throw std::runtime_error(out.status().ToString());
      values = *std::move(out);
    }
    fmt::print("first_result 0 {:.1f} {:.1f}\n", bf::process_age_seconds() * 1e3, (bf::detail::now_ns() - t0) / 1e6);
    return 0;
  }
  if (mode == "monolithic") {
    at::set_num_threads(threads);
    auto block = bf::make_block(bf::bench::model_block(models, "monolithic", {1, 3, 224, 224}, threads, true));
    if (!block.ok()) throw std::runtime_error(block.status().ToString());
    c10::InferenceMode inference_mode;
    const std::int64_t t0 = bf::detail::now_ns();
    auto out = (*block)->forward({x});
    if (!out.ok()) throw std::runtime_error(out.status().ToString());
    fmt::print("first_result 0 {:.1f} {:.1f}\n", bf::process_age_seconds() * 1e3, (bf::detail::now_ns() - t0) / 1e6);
    return 0;
  }
  // two_tasks: the split and a second task over its first three blocks and head_b, in threads;
  // two_tasks_warming: the same with SessionOptions::serve_while_warming (start() returns before the
  // blocks load; the split's first result comes once its four blocks have, head_b loading after).
  const bool two_tasks = mode == "two_tasks" || mode == "two_tasks_warming";
  bf::SessionOptions session_options;
  session_options.serve_while_warming = mode == "two_tasks_warming";
  bf::Session session(session_options);
  const bool workers = mode == "workers" || mode == "workers_forked";
  int w = 0;
  for (const auto& [name, shape] : bf::bench::resnet_split_stages()) {
    auto d = bf::bench::model_block(models, name, shape, threads, true);
    if (warmup_runs >= 0) d.options.warmup_runs = warmup_runs;
    if (workers) {
      bf::WorkerOptions o;
      o.name = fmt::format("w{}", ++w);
      o.channel = "shm";
      session.add_site(bf::make_worker(o));
      d.placement = o.name;
    }
    session.add_block(d);
  }
  session.add_path(bf::Path::chain("split", {"block1", "block2", "block3", "block4"}));
  if (two_tasks) {
    auto d = bf::bench::model_block(models, "head_b", {1, 1024, 14, 14}, threads, true);
    if (warmup_runs >= 0) d.options.warmup_runs = warmup_runs;
    session.add_block(d).add_path(bf::Path::chain("split_b", {"block1", "block2", "block3", "head_b"}));
  }
  if (auto status = session.start(); !status.ok()) throw std::runtime_error(status.ToString());
  bf::Result r = session.submit("split", x).get();
  if (!r.ok()) throw std::runtime_error(r.status.ToString());
  const auto start = session.metrics().start;
  fmt::print("first_result {:.1f} {:.1f} {:.1f}\n", start.start_ms, start.time_to_first_result_ms, r.trace.e2e_ms());
  std::fflush(stdout);
  return 0;
}

Sample measure(const std::string& mode, const std::string& models, int threads, int warmup_runs) {
  int from_child[2];
  int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (devnull < 0 || ::pipe2(from_child, O_CLOEXEC) != 0) throw std::runtime_error("cold_start: pipe");
  const std::int64_t t0 = bf::detail::now_ns();
  const pid_t pid = bf::bench::spawn_self({"--child", mode, "--models", models, "--threads", std::to_string(threads),
                                           "--warmup-runs", std::to_string(warmup_runs)},
                                          devnull, from_child[1],
                                          mode == "workers_forked" ? std::vector<std::string>{"GOMP_SPINCOUNT=10000"}
                                                                   : std::vector<std::string>{});
  ::close(from_child[1]);
  ::close(devnull);
  // The child's lines, read as they come, for up to 5 minutes: a child that hangs is killed, not waited on.
  constexpr std::int64_t kChildLimitNs = 300'000'000'000;
  Sample s;
  bool got = false, hung = false;
  std::string text;
  while (!got) {
    const std::int64_t left_ms = (t0 + kChildLimitNs - bf::detail::now_ns()) / 1'000'000;
    pollfd p{from_child[0], POLLIN, 0};
    const int ready = left_ms <= 0 ? 0 : ::poll(&p, 1, static_cast<int>(left_ms));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) {
      hung = true;
      break;
    }
    char chunk[256];
    const ssize_t n = ::read(from_child[0], chunk, sizeof chunk);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // the child closed its end (it ended)
    text.append(chunk, static_cast<std::size_t>(n));
    for (std::size_t eol; !got && (eol = text.find('\n')) != std::string::npos; text.erase(0, eol + 1)) {
      if (std::sscanf(text.substr(0, eol).c_str(), "first_result %lf %lf %lf", &s.start_ms, &s.internal_ms, &s.request_ms) == 3) {
        s.first_result_ms = static_cast<double>(bf::detail::now_ns() - t0) / 1e6;
        got = true;
      }
    }
  }
  ::close(from_child[0]);
  if (hung) ::kill(pid, SIGKILL);
  // The child ends after its first result: one that has not within a minute is killed, not waited on.
  int status = 0;
  const std::int64_t until = bf::detail::now_ns() + 60'000'000'000;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (bf::detail::now_ns() > until) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      break;
    }
    ::usleep(10'000);
  }
  if (hung) throw std::runtime_error(fmt::format("cold_start: the {} child gave no first result within 5 minutes: killed", mode));
  if (!got) throw std::runtime_error(fmt::format("cold_start: the {} child gave no first result", mode));
  return s;
}

}  // namespace

int main(int argc, char** argv) try {
  for (int i = 1; i + 1 < argc; ++i) {  // first thing, while this process has one thread
    if (std::string(argv[i]) == "--child" && std::string(argv[i + 1]) == "workers_forked") {
      if (auto started = bf::start_fork_server(); !started.ok()) throw std::runtime_error(started.ToString());
    }
  }
  std::string models, child_mode;
  int rounds = 5, threads = 2, warmup_runs = -1;  // -1: BlockOptions' default
  std::vector<std::string> only;                  // --modes a,b: these modes only (and monolithic, for the ratios)
  bf::bench::parse_options(argc, argv, [&](const std::string& a, const std::string& v) {
    if (a == "--models") models = v;
    else if (a == "--rounds") rounds = std::max(1, std::stoi(v));
    else if (a == "--threads") threads = std::stoi(v);
    else if (a == "--child") child_mode = v;
    else if (a == "--warmup-runs") warmup_runs = std::stoi(v);
    else if (a == "--modes") {
      std::stringstream list(v);
      for (std::string m; std::getline(list, m, ',');) only.push_back(m);
    }
    else return false;
    return true;
  });
  if (models.empty()) throw std::invalid_argument("usage: cold_start_bench --models DIR [--rounds N] [--threads T]");
  if (!child_mode.empty()) return child(child_mode, models, threads, warmup_runs);
  std::vector<std::string> modes = {"monolithic",    "threads",       "workers",      "workers_forked",
                                   "threads_floor", "libtorch_floor", "workers_floor", "forked_floor",
                                   "two_tasks",     "two_tasks_warming"};
  if (!only.empty()) {
    modes = only;
    if (std::find(modes.begin(), modes.end(), "monolithic") == modes.end()) modes.insert(modes.begin(), "monolithic");
  }
  for (const auto& mode : modes) (void)measure(mode, models, threads, warmup_runs);  // page cache, unmeasured
  std::map<std::string, std::vector<Sample>> samples;
  for (int r = 0; r < rounds; ++r) {
    for (const auto& mode : modes) samples[mode].push_back(measure(mode, models, threads, warmup_runs));
  }
  auto median = [](const std::vector<Sample>& v, double Sample::*field) {
    std::vector<double> x;
    for (const auto& s : v) x.push_back(s.*field);
    return bf::bench::percentile(x, 0.5);
  };
  const double monolithic = median(samples["monolithic"], &Sample::first_result_ms);
  for (const auto& mode : modes) {
    const auto& v = samples[mode];
    std::vector<double> runs;
    for (const auto& s : v) runs.push_back(s.first_result_ms);
    const double first = median(v, &Sample::first_result_ms);
    fmt::print("{{\"bench\":\"cold_start\",\"mode\":\"{}\",\"first_result_ms\":{:.1f},\"over_monolithic\":{:.3f},"
               "\"start_ms\":{:.1f},\"process_to_first_result_ms\":{:.1f},\"first_request_ms\":{:.1f},\"runs_ms\":[{:.1f}],"
               "\"rounds\":{},\"warmup_runs\":{},\"threads\":{},\"hardware_threads\":{},\"cpu\":\"{}\"}}\n",
               mode, first, first / monolithic, median(v, &Sample::start_ms), median(v, &Sample::internal_ms),
               median(v, &Sample::request_ms), fmt::join(runs, ","), rounds,
               warmup_runs >= 0 ? warmup_runs : bf::BlockOptions{}.warmup_runs, threads, std::thread::hardware_concurrency(),
               bf::bench::cpu_model());
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "cold_start_bench: %s\n", e.what());
  return 1;
}
