// blockflow-loadgen: drives a session with synthetic traffic and reports what it got.
//
//   blockflow-loadgen (--deployment FILE [--models DIR] [--plugin LIB.so]... | --endpoint EP)
//                     [--tasks T1,T2] [--shape 1x3x224x224]
//                     (--clients N | --rate R | --sweep R1,R2,... | --task-rates T1=R1,T2=R2)
//                     [--duration SECONDS | --requests N] [--warmup N] [--lanes N] [--max-in-flight N]
//                     [--json FILE] [--quiet]
//
// Target: a session built here from a deployment file (the JSON an optimiser sends; blocks placed
// in workers get child worker processes), or a running session's client endpoint
// (ClientEndpoint, e.g. the serve example). --lanes N: the session's compute lanes
// (SessionOptions::lanes; 0, the default: as many as the cores hold, elastic: docs/lanes.md).
// --max-in-flight N: at most N requests of each task inside the session's blocks, the others waiting
// at the task's entry (SessionOptions::max_in_flight_per_task; 0, the default: no window;
// docs/lanes.md, "Entry window"); the line then gives "waited_at_entry", the requests that waited.
// Load: N synchronous clients (closed loop), or open-loop Poisson arrivals at R requests/s spread
// evenly over the tasks; --sweep runs one Poisson run per rate and then reports the saturation
// point, the first rate whose throughput falls below 95% of the offered rate; --task-rates gives
// each task a Poisson stream of its own at its own rate, all at once (what a planner admitted), and
// the line then holds each task's figures. Latency counts from the scheduled arrival, so a
// generator or a session that falls behind shows up as latency.
//
// One JSON line per run on stdout (and in --json FILE):
//   {"bench":"loadgen","mode":"poisson","rate_per_s":..,"clients":..,"sent":..,"completed":..,
//    "failed":..,"duration_s":..,"throughput_per_s":..,"p50_ms":..,"p90_ms":..,"p99_ms":..,
//    "rss_mb":..,"blocks":[{"name":..,"wait_p50_ms":..,"compute_p50_ms":..,"overhead_p50_ms":..}],
//    "lanes":[{"lane":..,"threads":..,"runs":..,"one_thread_runs":..,"busy":..}],
//    "per_task":[{"task":..,"rate_per_s":..,"sent":..,"completed":..,"failed":..,"throughput_per_s":..,
//                 "p50_ms":..,"p90_ms":..,"p99_ms":..}],  (with --task-rates)
//    "max_in_flight_per_task":..,"waited_at_entry":..,  (with --max-in-flight)
//    "first_error":".."}
// then, after a sweep, {"bench":"saturation","rate_per_s":..,"throughput_per_s":..}. rss_mb (this
// process and its workers), blocks (from each request's trace) and lanes (the session's compute
// lanes over the run; busy: busy time over the run's duration) exist for in-process runs only;
// energy_j_per_inference too, and only where NVML reports power (the run then samples every process).
// Progress goes to stderr once a second unless --quiet. An arrival due after the run's end is not
// sent (--duration; --requests counts requests instead, not both). Exit status: 0; 1 when no
// warm-up request succeeded (its error on stderr, no run), when a run sent requests and none
// succeeded (its line is printed), or on a failure to write; 2 for a usage error.

#include "bench_util.hpp"  // bench/: percentiles shared with the benchmarks
#include "tool_output.hpp"

#include <blockflow/blockflow.hpp>
#include <blockflow/serve/client_endpoint.hpp>
#include <blockflow/deploy/deployment.hpp>
#include <blockflow/core/kpi.hpp>
#include <blockflow/core/detail/flag_number.hpp>
#include <blockflow/worker/worker_site.hpp>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

namespace bf = blockflow;
using Clock = std::chrono::steady_clock;

namespace {

struct Args {
  std::string deployment, models, endpoint, json_file;
  std::vector<std::string> tasks, plugins;
  std::vector<std::int64_t> shape;
  int clients = 0;
  std::vector<double> rates;
  std::vector<std::pair<std::string, double>> task_rates;  // --task-rates: a stream per task
  bool sweep = false;
  double duration_s = 10;
  long requests = 0;  // 0: run for duration_s
  int warmup = 3;
  int lanes = 0;  // SessionOptions::lanes
  int max_in_flight = 0;  // SessionOptions::max_in_flight_per_task
  bool quiet = false;
};

constexpr const char* kUsage =
    "usage: blockflow-loadgen (--deployment FILE [--models DIR] [--plugin LIB.so]... | --endpoint EP) [--tasks T1,T2] [--shape 1x3x224x224]\n"
    "                         (--clients N | --rate R | --sweep R1,R2,... | --task-rates T1=R1,T2=R2)\n"
    "                         [--duration S | --requests N] [--warmup N]\n"
    "                         [--lanes N] [--max-in-flight N] [--json FILE] [--quiet]";

std::vector<std::string> split(const std::string& s, char by) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string part; std::getline(in, part, by);) {
    if (!part.empty()) out.push_back(part);
  }
  return out;
}

template <typename T>
T number(const std::string& flag, const std::string& text, T min, T max) {
  return blockflow::detail::flag_number<T>(flag, text, min, max);
}

Args parse(int argc, char** argv) {
  Args a;
  bool duration_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(k + " needs a value\n" + kUsage);
      return argv[++i];
    };
    if (k == "--deployment") a.deployment = value();
    else if (k == "--models") a.models = value();
    else if (k == "--endpoint") a.endpoint = value();
    else if (k == "--plugin") a.plugins.push_back(value());
    else if (k == "--tasks") a.tasks = split(value(), ',');
    else if (k == "--shape") {
      a.shape.clear();
      for (const auto& d : split(value(), 'x')) a.shape.push_back(number<std::int64_t>(k, d, 0, std::int64_t{1} << 31));
    } else if (k == "--clients") a.clients = number(k, value(), 1, 100000);
    else if (k == "--rate" || k == "--sweep") {
      if (!a.rates.empty()) throw std::invalid_argument("give one of --rate and --sweep, once");
      for (const auto& r : split(value(), ',')) a.rates.push_back(number(k, r, 1e-6, 1e7));
      a.sweep = k == "--sweep";
    } else if (k == "--task-rates") {
      for (const auto& part : split(value(), ',')) {
        const auto eq = part.find('=');
        if (eq == std::string::npos || eq == 0) throw std::invalid_argument("--task-rates: expected TASK=RATE, got '" + part + "'");
        const std::string task = part.substr(0, eq);
        for (const auto& [named, rate] : a.task_rates) {
          if (named == task) throw std::invalid_argument("--task-rates: task '" + task + "' is given twice");
        }
        a.task_rates.emplace_back(task, number("--task-rates " + task, part.substr(eq + 1), 1e-6, 1e7));
      }
    } else if (k == "--duration") {
      a.duration_s = number(k, value(), 1e-3, 1e6);
      duration_given = true;
    } else if (k == "--requests") a.requests = number<long>(k, value(), 1, 1'000'000'000'000L);
    else if (k == "--warmup") a.warmup = number(k, value(), 0, 1000000);
    else if (k == "--lanes") a.lanes = number(k, value(), 0, 4096);
    else if (k == "--max-in-flight") a.max_in_flight = number(k, value(), 0, 1 << 30);
    else if (k == "--json") a.json_file = value();
    else if (k == "--quiet") a.quiet = true;
    else if (k == "--help" || k == "-h") {
      std::cout << kUsage << "\n";
      std::exit(0);
    } else {
      throw std::invalid_argument("unknown argument " + k + "\n" + kUsage);
    }
  }
  if (duration_given && a.requests > 0) throw std::invalid_argument("give --duration or --requests, not both");
  if (a.deployment.empty() == a.endpoint.empty()) throw std::invalid_argument(std::string("give --deployment or --endpoint\n") + kUsage);
  if (!a.task_rates.empty()) {
    if (!a.rates.empty() || a.clients > 0 || !a.tasks.empty() || a.requests > 0) {
      throw std::invalid_argument("--task-rates names the tasks and their rates: not with --tasks, --clients, --rate, --sweep or --requests");
    }
    double total = 0;
    for (const auto& [task, rate] : a.task_rates) {
      if (rate <= 0) throw std::invalid_argument("--task-rates: the rate of '" + task + "' must be > 0");
      a.tasks.push_back(task);
      total += rate;
    }
    a.rates = {total};
  }
  if ((a.clients > 0) == !a.rates.empty()) throw std::invalid_argument(std::string("give --clients, --rate, --sweep or --task-rates\n") + kUsage);
  for (double r : a.rates) {
    if (r <= 0) throw std::invalid_argument("rates must be > 0");
  }
  if (!a.endpoint.empty() && a.tasks.empty()) throw std::invalid_argument("--endpoint needs --tasks");
  if (a.lanes < 0) throw std::invalid_argument("--lanes must be >= 0");
  if (a.max_in_flight < 0) throw std::invalid_argument("--max-in-flight must be >= 0");
  if (!a.endpoint.empty() && a.max_in_flight > 0) {
    throw std::invalid_argument("--max-in-flight sets this process's session: not with --endpoint (the server sets its own)");
  }
  if (!a.endpoint.empty() && a.shape.empty()) throw std::invalid_argument("--endpoint needs --shape");
  return a;
}

using blockflow::bench::percentile;  // nearest rank, as in the benchmarks

// What one run measured. Thread-safe.
struct Tally {
  std::mutex mu;
  long sent = 0, completed = 0, failed = 0;
  std::vector<double> latency_ms;
  std::map<std::string, std::vector<double>> wait, compute, overhead;  // per block, from traces
  std::string first_error;

  void done(double ms, const absl::Status& status, const bf::RequestTrace* trace) {
    std::lock_guard lock(mu);
    if (!status.ok()) {
      ++failed;
      if (first_error.empty()) first_error = status.ToString();
      return;
    }
    ++completed;
    latency_ms.push_back(ms);
    if (trace == nullptr) return;
    for (const auto& hop : trace->hops) {
      if (hop.block.empty()) continue;
      wait[hop.block].push_back(hop.wait_ms());
      compute[hop.block].push_back(hop.compute_ms());
      overhead[hop.block].push_back(hop.overhead_ms());
    }
  }
  long outstanding() {
    std::lock_guard lock(mu);
    return sent - completed - failed;
  }
  // For a tally of one request that was never counted as sent: not answered yet?
  bool outstanding_of_one() {
    std::lock_guard lock(mu);
    return completed + failed == 0;
  }
  // Adds `other`'s answers; `with_sent`: its requests sent too (a tally of its own stream).
  void merge(Tally& other, bool with_sent = false) {
    std::scoped_lock lock(mu, other.mu);
    if (with_sent) sent += other.sent;
    completed += other.completed;
    failed += other.failed;
    latency_ms.insert(latency_ms.end(), other.latency_ms.begin(), other.latency_ms.end());
    for (auto [from, into] : {std::pair{&other.wait, &wait}, std::pair{&other.compute, &compute},
                              std::pair{&other.overhead, &overhead}}) {
      for (auto& [block, values] : *from) (*into)[block].insert((*into)[block].end(), values.begin(), values.end());
    }
    if (first_error.empty()) first_error = other.first_error;
  }
};

// The target: an in-process session or a remote endpoint. submit() is asynchronous for both.
class Target {
 public:
  virtual ~Target() = default;
  // The target keeps `tally` alive until the request is answered: an answer may come after the run
  // that sent it gave up waiting.
  virtual void submit(const std::string& task, const bf::Tensors& inputs, Clock::time_point arrival,
                      std::shared_ptr<Tally> tally) = 0;
  // The run gave up waiting: requests not yet sent are not sent (they count as failed).
  virtual void abandon() {}
  virtual void drain() {}
  virtual std::optional<double> rss_mb() { return std::nullopt; }
  /// GPU energy integrated so far (joules), where power readings exist.
  virtual std::optional<double> energy_j() { return std::nullopt; }
  /// The in-process session's compute lanes (cumulative counters), where there is one.
  virtual std::vector<bf::LaneMetrics> lanes() { return {}; }
  /// Requests that have waited at a task's entry (the session's entry window) so far, where known.
  virtual std::optional<std::uint64_t> waited_at_entry() { return std::nullopt; }
};

class InProcess final : public Target {
 public:
  explicit InProcess(const Args& args) : session_(session_options(args)) {
    auto d = bf::load_deployment(args.deployment, args.models);
    if (!d.ok()) throw std::runtime_error(d.status().ToString());
    deployment_ = *d;
    // C++ blocks by factory: registered here for blocks in this process, and in every worker.
    for (const auto& plugin : args.plugins) {
      if (auto status = bf::load_plugin(plugin); !status.ok()) throw std::runtime_error(status.ToString());
    }
    bf::WorkerOptions defaults;
    defaults.plugins = args.plugins;
    bf::add_deployment(session_, deployment_, defaults);
    if (auto status = session_.start(); !status.ok()) throw std::runtime_error(status.ToString());
    // With power readings (NVML), sample every process so energy per inference can be reported.
    if (bf::GpuProbe::instance().available()) session_.set_sampling(true, absl::Milliseconds(100));
  }
  ~InProcess() override { session_.shutdown(); }
  void submit(const std::string& task, const bf::Tensors& inputs, Clock::time_point arrival,
              std::shared_ptr<Tally> tally) override {
    session_.submit(task, inputs, [arrival, tally = std::move(tally)](bf::Result&& r) {
      const double ms = std::chrono::duration<double, std::milli>(Clock::now() - arrival).count();
      tally->done(ms, r.status, &r.trace);
    });
  }
  std::optional<double> rss_mb() override {
    double bytes = static_cast<double>(bf::sample_process().rss_bytes);
    for (const auto& s : session_.metrics().sites) bytes += static_cast<double>(s.rss_bytes);
    return bytes / 1048576.0;
  }
  std::optional<double> energy_j() override {
    const bf::MetricsSnapshot m = session_.metrics();
    if (!m.sampling || m.host.gpus.empty()) return std::nullopt;
    return m.host.energy_j;  // NVML's power is per device: the host's reading covers every process on it
  }
  std::vector<bf::LaneMetrics> lanes() override { return session_.metrics().lanes; }
  std::optional<std::uint64_t> waited_at_entry() override {
    std::uint64_t waited = 0;
    for (const auto& p : session_.metrics().paths) waited += p.waited_at_entry;
    return waited;
  }
  const bf::Deployment& deployment() const { return deployment_; }

 private:
  static bf::SessionOptions session_options(const Args& args) {
    bf::SessionOptions options;
    options.lanes = args.lanes;
    options.max_in_flight_per_task = args.max_in_flight;
    return options;
  }

  bf::Deployment deployment_;
  bf::Session session_;
};

// RemoteClient is synchronous: a pool of client threads takes arrivals from a queue.
class Remote final : public Target {
 public:
  Remote(std::string endpoint, int threads) : state_(std::make_shared<State>()) {
    state_->endpoint = std::move(endpoint);
    (void)bf::RemoteClient(state_->endpoint);  // a malformed endpoint throws here, named, not on a pool thread
    for (int i = 0; i < threads; ++i) pool_.emplace_back([state = state_] { main(*state); });
  }
  // Requests not sent yet are not sent. A pool thread waiting for a reply (a dead endpoint: up to
  // its 60 s timeout) is let go rather than waited for; it holds the state it uses.
  ~Remote() override {
    abandon();
    {
      std::lock_guard lock(state_->mu);
      state_->stopping = true;
    }
    state_->changed.notify_all();
    for (auto& t : pool_) t.detach();
  }
  void submit(const std::string& task, const bf::Tensors& inputs, Clock::time_point arrival,
              std::shared_ptr<Tally> tally) override {
    {
      std::lock_guard lock(state_->mu);
      state_->queue.push_back({task, inputs, arrival, std::move(tally)});
    }
    state_->changed.notify_one();
  }
  void abandon() override {
    std::deque<Job> dropped;
    {
      std::lock_guard lock(state_->mu);
      dropped.swap(state_->queue);
    }
    for (auto& job : dropped) {
      job.tally->done(0, absl::CancelledError("not sent: the run gave up waiting (the endpoint did not keep up)"),
                      nullptr);
    }
  }

 private:
  struct Job {
    std::string task;
    bf::Tensors inputs;
    Clock::time_point arrival;
    std::shared_ptr<Tally> tally;
  };
  struct State {
    std::string endpoint;
    std::mutex mu;
    std::condition_variable changed;
    std::deque<Job> queue;
    bool stopping = false;
  };
  static void main(State& s) {
    bf::RemoteClient client(s.endpoint, absl::Seconds(60));
    while (true) {
      Job job;
      {
        std::unique_lock lock(s.mu);
        s.changed.wait(lock, [&] { return s.stopping || !s.queue.empty(); });
        if (s.queue.empty()) return;
        job = std::move(s.queue.front());
        s.queue.pop_front();
      }
      auto out = client.submit(job.task, job.inputs);
      const double ms = std::chrono::duration<double, std::milli>(Clock::now() - job.arrival).count();
      job.tally->done(ms, out.status(), nullptr);
    }
  }
  const std::shared_ptr<State> state_;
  std::vector<std::thread> pool_;
};

struct Run {
  std::string mode;
  double rate = 0;  // offered, Poisson
  int clients = 0;
};

nlohmann::json measure(const Args& args, Target& target, const std::vector<std::string>& tasks,
                       const std::map<std::string, bf::Tensors>& inputs, const Run& run) {
  const auto tally_owner = std::make_shared<Tally>();  // answers may come after this run gave up
  Tally& tally = *tally_owner;
  const std::optional<double> energy_before = target.energy_j();
  const std::vector<bf::LaneMetrics> lanes_before = target.lanes();
  const std::optional<std::uint64_t> waited_before = target.waited_at_entry();
  const auto start = Clock::now();
  const auto end = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(args.duration_s));
  std::atomic<long> issued{0};
  auto more = [&] {
    return args.requests > 0 ? issued.load() < args.requests : Clock::now() < end;
  };
  auto issue = [&](Clock::time_point arrival) {
    const long n = issued++;
    const std::string& task = tasks[static_cast<std::size_t>(n) % tasks.size()];
    {
      std::lock_guard lock(tally.mu);
      ++tally.sent;
    }
    target.submit(task, inputs.at(task), arrival, tally_owner);
  };
  std::atomic<bool> running{true};
  std::thread progress([&] {
    while (running) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      static thread_local auto next = Clock::now() + std::chrono::seconds(1);
      if (args.quiet || Clock::now() < next) continue;
      next = Clock::now() + std::chrono::seconds(1);
      std::lock_guard lock(tally.mu);
      std::cerr << fmt::format("loadgen: {} {:.1f} s: sent {} completed {} failed {} p50 {:.2f} ms\n",
                               run.mode == "poisson" ? fmt::format("{:g}/s", run.rate) : fmt::format("{} clients", run.clients),
                               std::chrono::duration<double>(Clock::now() - start).count(), tally.sent, tally.completed,
                               tally.failed, percentile(tally.latency_ms, 0.5));
    }
  });
  // --task-rates: a Poisson stream per task, each with its own tally.
  std::map<std::string, std::shared_ptr<Tally>> by_task;
  if (run.mode == "poisson" && !args.task_rates.empty()) {
    std::vector<std::thread> streams;
    std::uint64_t seed = 42;
    for (const auto& [task_name, rate] : args.task_rates) {
      const auto own_owner = std::make_shared<Tally>();
      by_task[task_name] = own_owner;
      streams.emplace_back([&, own_owner, task = task_name, rate = rate, seed = seed++] {
        Tally& own = *own_owner;
        std::mt19937_64 random(seed);
        std::exponential_distribution<double> gap(rate);
        for (auto next = start; next < end;  // an arrival after the run's end is not sent
             next += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap(random)))) {
          std::this_thread::sleep_until(next);
          {
            std::lock_guard lock(own.mu);
            ++own.sent;
          }
          target.submit(task, inputs.at(task), next, own_owner);
        }
      });
    }
    for (auto& t : streams) t.join();
  } else if (run.mode == "poisson") {
    std::mt19937_64 random(42);
    std::exponential_distribution<double> gap(run.rate);
    auto next = start;
    while (more() && (args.requests > 0 || next < end)) {  // an arrival after the run's end is not sent
      std::this_thread::sleep_until(next);
      issue(next);
      next += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap(random)));
    }
  } else {
    // Closed loop: each client submits, waits for its answer, submits again.
    std::vector<std::thread> clients;
    for (int c = 0; c < run.clients; ++c) {
      clients.emplace_back([&] {
        while (args.requests > 0 || Clock::now() < end) {
          const long n = issued++;  // taken, then checked: N clients send N requests in all, no more
          if (args.requests > 0 && n >= args.requests) break;
          const auto own_owner = std::make_shared<Tally>();  // this one request, so the client can wait for it
          Tally& own = *own_owner;
          const std::string& task = tasks[static_cast<std::size_t>(n) % tasks.size()];
          {
            std::lock_guard lock(tally.mu);
            ++tally.sent;
          }
          target.submit(task, inputs.at(task), Clock::now(), own_owner);
          while (own.outstanding_of_one()) std::this_thread::sleep_for(std::chrono::microseconds(100));
          tally.merge(own);
        }
      });
    }
    for (auto& t : clients) t.join();
  }
  // Wait for what is still outstanding (60 s at most).
  const auto give_up = Clock::now() + std::chrono::seconds(60);
  auto outstanding = [&] {
    long n = tally.outstanding();
    for (auto& [task, own] : by_task) n += own->outstanding();
    return n;
  };
  while (outstanding() > 0 && Clock::now() < give_up) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  if (outstanding() > 0) target.abandon();
  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  running = false;
  progress.join();
  nlohmann::json per_task = nlohmann::json::array();
  for (const auto& [task, rate] : args.task_rates) {
    auto it = by_task.find(task);
    if (it == by_task.end()) continue;
    Tally& own = *it->second;
    {
      std::lock_guard lock(own.mu);
      per_task.push_back({{"task", task}, {"rate_per_s", rate}, {"sent", own.sent}, {"completed", own.completed},
                          {"failed", own.failed}, {"throughput_per_s", static_cast<double>(own.completed) / elapsed},
                          {"p50_ms", percentile(own.latency_ms, 0.5)}, {"p90_ms", percentile(own.latency_ms, 0.9)},
                          {"p99_ms", percentile(own.latency_ms, 0.99)}});
    }
    tally.merge(own, /*with_sent=*/true);
  }

  std::lock_guard lock(tally.mu);
  nlohmann::json line = {{"bench", "loadgen"},
                         {"mode", run.mode},
                         {"tasks", tasks},
                         {"sent", tally.sent},
                         {"completed", tally.completed},
                         {"failed", tally.failed},
                         {"lost", tally.sent - tally.completed - tally.failed},
                         {"duration_s", elapsed},
                         {"throughput_per_s", static_cast<double>(tally.completed) / elapsed},
                         {"p50_ms", percentile(tally.latency_ms, 0.5)},
                         {"p90_ms", percentile(tally.latency_ms, 0.9)},
                         {"p99_ms", percentile(tally.latency_ms, 0.99)}};
  if (run.mode == "poisson") line["rate_per_s"] = run.rate;
  else line["clients"] = run.clients;
  if (auto rss = target.rss_mb()) line["rss_mb"] = *rss;
  // The whole device's power over the run (other work on the GPU counts too).
  if (auto energy = target.energy_j(); energy && energy_before && tally.completed > 0) {
    line["energy_j_per_inference"] = (*energy - *energy_before) / static_cast<double>(tally.completed);
  }
  if (!tally.compute.empty()) {
    nlohmann::json blocks = nlohmann::json::array();
    for (const auto& [name, compute] : tally.compute) {
      blocks.push_back({{"name", name},
                        {"wait_p50_ms", percentile(tally.wait[name], 0.5)},
                        {"compute_p50_ms", percentile(compute, 0.5)},
                        {"overhead_p50_ms", percentile(tally.overhead[name], 0.5)}});
    }
    line["blocks"] = blocks;
  }
  // The lanes over this run: units run, how many with one thread, busy time over the run.
  const std::vector<bf::LaneMetrics> lanes_after = target.lanes();
  if (!lanes_after.empty() && lanes_after.size() == lanes_before.size()) {
    nlohmann::json lanes = nlohmann::json::array();
    for (std::size_t i = 0; i < lanes_after.size(); ++i) {
      const auto& a = lanes_after[i];
      const auto& b = lanes_before[i];
      lanes.push_back({{"lane", a.index}, {"threads", a.threads}, {"runs", a.runs - b.runs},
                       {"one_thread_runs", a.one_thread_runs - b.one_thread_runs},
                       {"busy", (a.busy_s - b.busy_s) / elapsed}});
    }
    line["lanes"] = lanes;
  }
  if (!per_task.empty()) line["per_task"] = per_task;
  if (args.max_in_flight > 0) {
    line["max_in_flight_per_task"] = args.max_in_flight;
    if (const auto waited = target.waited_at_entry(); waited && waited_before) line["waited_at_entry"] = *waited - *waited_before;
  }
  if (!tally.first_error.empty()) line["first_error"] = tally.first_error;
  return line;
}

}  // namespace

int main(int argc, char** argv) try {
  const Args args = parse(argc, argv);
  if (!args.json_file.empty()) {  // before the session starts: a wrong path fails now, not after the runs
    if (auto problem = blockflow::tools::check_writable(args.json_file); !problem.empty()) throw std::invalid_argument("--json: " + problem);
  }
  std::unique_ptr<Target> target;
  std::vector<std::string> tasks = args.tasks;
  std::map<std::string, bf::Tensors> inputs;
  at::manual_seed(0);
  if (!args.deployment.empty()) {
    auto in_process = std::make_unique<InProcess>(args);
    const bf::Deployment& d = in_process->deployment();
    if (tasks.empty()) {
      for (const auto& path : d.paths()) tasks.push_back(path.task());
    }
    for (const auto& task : tasks) {
      const auto paths = d.paths();
      auto it = std::find_if(paths.begin(), paths.end(), [&](const auto& p) { return p.task() == task; });
      if (it == paths.end()) throw std::invalid_argument("unknown task '" + task + "' in " + args.deployment);
      const auto entry = std::find_if(it->nodes().begin(), it->nodes().end(),
                                      [](const auto& n) { return n.inputs.empty() && !n.block.empty(); });
      const std::string entry_block = entry == it->nodes().end() ? std::string() : entry->block;
      const auto& first = *std::find_if(d.blocks.begin(), d.blocks.end(), [&](const auto& b) { return b.name == entry_block; });
      std::vector<std::int64_t> shape = args.shape;
      if (shape.empty()) {  // the first entry block's declared input shape, -1 as 1
        if (first.options.input_shapes.empty()) {
          throw std::invalid_argument("task '" + task + "': its first block declares no input_shapes; give --shape");
        }
        shape = first.options.input_shapes.front();
        for (auto& dim : shape) dim = dim < 0 ? 1 : dim;
      }
      // Its declared dtype: random floats, or zeros of an integer or bool dtype (token id 0 is
      // valid for any embedding).
      const at::ScalarType dtype = first.options.input_dtypes.empty() ? at::kFloat : first.options.input_dtypes.front();
      inputs[task] = {at::isFloatingType(dtype) ? at::randn(shape, at::TensorOptions().dtype(dtype))
                                                : at::zeros(shape, at::TensorOptions().dtype(dtype))};
    }
    target = std::move(in_process);
  } else {
    for (const auto& task : tasks) inputs[task] = {at::randn(args.shape)};
    target = std::make_unique<Remote>(args.endpoint, args.clients > 0 ? args.clients : 32);
  }
  if (tasks.empty()) throw std::invalid_argument("no tasks to drive");

  // Warm-up: a few synchronous requests per task, not counted; none answered is the end.
  {
    Args warm = args;
    warm.requests = args.warmup * static_cast<long>(tasks.size());
    warm.quiet = true;
    if (!args.quiet && warm.requests > 0) std::cerr << "loadgen: warm-up, " << warm.requests << " requests\n";
    if (warm.requests > 0) {
      const nlohmann::json line = measure(warm, *target, tasks, inputs, Run{"clients", 0, 1});
      if (line["completed"].get<long>() == 0) {
        std::cerr << "blockflow-loadgen: no warm-up request succeeded: " << line.value("first_error", std::string("none answered")) << "\n";
        return 1;
      }
    }
  }

  std::ofstream json_out;  // a line per run as it ends (after the warm-up: a failed one leaves the file as it was)
  if (!args.json_file.empty()) {
    json_out.open(args.json_file);
    if (!json_out) throw std::runtime_error("--json: cannot write " + args.json_file);
  }
  bool any_failed_whole = false;  // a run that sent requests and had none succeed
  auto emit = [&](const nlohmann::json& line) {
    std::cout << line.dump() << std::endl;
    if (json_out.is_open() && !(json_out << line.dump() << "\n" << std::flush)) {
      throw std::runtime_error("--json: cannot write " + args.json_file);
    }
    if (line.contains("sent") && line["sent"].get<long>() > 0 && line["completed"].get<long>() == 0) any_failed_whole = true;
  };
  std::optional<nlohmann::json> saturation;
  if (args.clients > 0) {
    emit(measure(args, *target, tasks, inputs, Run{"clients", 0, args.clients}));
  } else {
    for (double rate : args.rates) {
      const nlohmann::json line = measure(args, *target, tasks, inputs, Run{"poisson", rate, 0});
      emit(line);
      if (args.sweep && !saturation && line["throughput_per_s"].get<double>() < 0.95 * rate) {
        saturation = nlohmann::json{{"bench", "saturation"}, {"rate_per_s", rate},
                                    {"throughput_per_s", line["throughput_per_s"]}};
      }
    }
    if (args.sweep) {
      emit(saturation ? *saturation
                      : nlohmann::json{{"bench", "saturation"}, {"rate_per_s", nullptr},
                                       {"note", fmt::format("not reached up to {:g}/s", args.rates.back())}});
    }
  }
  if (!blockflow::tools::stdout_written("blockflow-loadgen")) return 1;
  if (any_failed_whole) {
    std::cerr << "blockflow-loadgen: a run had no request succeed (its line's first_error says why)\n";
    return 1;
  }
  return 0;
} catch (const std::invalid_argument& e) {  // the command line
  std::cerr << "blockflow-loadgen: " << e.what() << "\n";
  return 2;
} catch (const std::exception& e) {
  std::cerr << "blockflow-loadgen: " << e.what() << "\n";
  return 1;
}
