// cold_start: time from process start to the first resolved request (issue 20), in one run:
//   monolithic  the whole ResNet50 in a process of its own, loaded as a block is (freeze,
//               optimize_for_inference) and run once: what a user runs instead;
//   threads     the split in a session, its four blocks on the lanes;
//   workers     the split in a session of four worker processes over shm.
// Each measurement is a fresh process (posix_spawn of this program, `--child MODE`), the modes
// alternating round by round after one unmeasured round (page cache). The time runs from just before
// posix_spawn to the child's line saying that its first request resolved; the child also reports
// its session's StartStats (metrics().start). One line per mode, then the ratios to the monolithic.
//
// usage: cold_start_bench --models DIR [--rounds N] [--threads T]
#include "alone_process.hpp"
#include "bench_util.hpp"
#include "resnet_split.hpp"

#include <blockflow/blockflow.hpp>
#include <blockflow/core/detail/clock.hpp>
#include <blockflow/worker/worker_site.hpp>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <map>

namespace bf = blockflow;

namespace {

// The child: brings the mode up, resolves one request, prints "first_result START_MS PROCESS_TO_FIRST_MS".
int child(const std::string& mode, const std::string& models, int threads) {
  const at::Tensor x = at::randn({1, 3, 224, 224});
  if (mode == "monolithic") {
    at::set_num_threads(threads);
    auto block = bf::make_block(bf::bench::model_block(models, "monolithic", {1, 3, 224, 224}, threads, true));
    if (!block.ok()) throw std::runtime_error(block.status().ToString());
    c10::InferenceMode inference_mode;
    auto out = (*block)->forward({x});
    if (!out.ok()) throw std::runtime_error(out.status().ToString());
    fmt::print("first_result 0 {:.1f}\n", bf::process_age_seconds() * 1e3);
    return 0;
  }
  bf::Session session;
  const bool workers = mode == "workers";
  int w = 0;
  for (const auto& [name, shape] : bf::bench::resnet_split_stages()) {
    auto d = bf::bench::model_block(models, name, shape, threads, true);
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
  if (auto status = session.start(); !status.ok()) throw std::runtime_error(status.ToString());
  bf::Result r = session.submit("split", x).get();
  if (!r.ok()) throw std::runtime_error(r.status.ToString());
  const auto start = session.metrics().start;
  fmt::print("first_result {:.1f} {:.1f}\n", start.start_ms, start.time_to_first_result_ms);
  std::fflush(stdout);
  return 0;
}

struct Sample {
  double first_result_ms = 0;  // posix_spawn -> the child's line
  double start_ms = 0;         // the child's Session::start()
  double internal_ms = 0;      // the child's own process start -> first result
};

Sample measure(const std::string& mode, const std::string& models, int threads) {
  int from_child[2];
  int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (devnull < 0 || ::pipe2(from_child, O_CLOEXEC) != 0) throw std::runtime_error("cold_start: pipe");
  const std::int64_t t0 = bf::detail::now_ns();
  const pid_t pid = bf::bench::spawn_self({"--child", mode, "--models", models, "--threads", std::to_string(threads)},
                                          devnull, from_child[1], {});
  ::close(from_child[1]);
  ::close(devnull);
  FILE* out = ::fdopen(from_child[0], "r");
  char line[256] = {};
  Sample s;
  bool got = false;
  while (std::fgets(line, sizeof line, out) != nullptr) {
    if (std::sscanf(line, "first_result %lf %lf", &s.start_ms, &s.internal_ms) == 2) {
      s.first_result_ms = static_cast<double>(bf::detail::now_ns() - t0) / 1e6;
      got = true;
      break;
    }
  }
  std::fclose(out);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (!got) throw std::runtime_error(fmt::format("cold_start: the {} child gave no first result", mode));
  return s;
}

}  // namespace

int main(int argc, char** argv) try {
  std::string models, child_mode;
  int rounds = 5, threads = 2;
  bf::bench::parse_options(argc, argv, [&](const std::string& a, const std::string& v) {
    if (a == "--models") models = v;
    else if (a == "--rounds") rounds = std::max(1, std::stoi(v));
    else if (a == "--threads") threads = std::stoi(v);
    else if (a == "--child") child_mode = v;
    else return false;
    return true;
  });
  if (models.empty()) throw std::invalid_argument("usage: cold_start_bench --models DIR [--rounds N] [--threads T]");
  if (!child_mode.empty()) return child(child_mode, models, threads);
  const std::vector<std::string> modes = {"monolithic", "threads", "workers"};
  for (const auto& mode : modes) (void)measure(mode, models, threads);  // page cache, unmeasured
  std::map<std::string, std::vector<Sample>> samples;
  for (int r = 0; r < rounds; ++r) {
    for (const auto& mode : modes) samples[mode].push_back(measure(mode, models, threads));
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
               "\"start_ms\":{:.1f},\"process_to_first_result_ms\":{:.1f},\"runs_ms\":[{:.1f}],\"rounds\":{},"
               "\"threads\":{},\"hardware_threads\":{},\"cpu\":\"{}\"}}\n",
               mode, first, first / monolithic, median(v, &Sample::start_ms), median(v, &Sample::internal_ms),
               fmt::join(runs, ","), rounds, threads, std::thread::hardware_concurrency(), bf::bench::cpu_model());
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "cold_start_bench: %s\n", e.what());
  return 1;
}
