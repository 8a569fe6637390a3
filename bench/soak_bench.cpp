// soak: the split ResNet50 in 4 worker processes over shm, under open-loop Poisson traffic at a
// fraction (--load, 0.9) of its measured saturation, for --seconds (600), while a worker is killed
// with SIGKILL every 30 s (w1, w2, w3, w4, w1, ...; the session restarts it) and task_a is re-routed
// with apply() every 45 s (its last block alternates between block4 and head_b, both loaded in w4:
// no block is added or removed).
//
// Phase 1 measures the saturation: --saturation-s (20) seconds with 16 requests kept in flight,
// completions counted after the first 5 s. Phase 2 is the soak. Prints one line at its start (t_s 0,
// with "cpu", "threads" and the starting levels), one every 30 s:
//   {"bench":"soak","t_s":..,"sent":..,"completed":..,"failed":..,"lost":..,"outstanding":..,
//    "rss_mb":{"host":..,"w1":..,...},"shm_slots_in_use":..,"shm_slots_idle_min":..,"shm_objects":..,"shm_orphans":..,
//    "fds":..,"worker_fds":{...},"restarts":..,"version":..}
// and, after the traffic stops and what is in flight resolves (up to 30 s), a final line with
// "final":true, the totals, the distinct error messages, each process's RSS slope and one boolean
// per target. The bench measures and prints; it asserts nothing (exit status 1 only when set-up fails).
// Each time a producer's shm pools change (a pool made or trimmed, as its site reports them), a line
//   {"bench":"soak_pools","t_s":..,"producer":"w1"|"host>w1",..,"age_s":..,"pools":..,"created":..,
//    "trimmed":..,"slots_in_use":..,"slots_total":..,"mapped_mb":..,"in_flight":..}
// ("w1": the worker's own pools; "host>w1": the host's pools for its requests to w1), and the final
// line's shm_pools_made_after_first_minute counts per producer the pools made in the span the slopes
// cover: what moves a producer's owned RSS in steps.
//
// What the fields mean:
//   lost          in a 30 s line: requests with no reply for 30 s so far; in the final line:
//                 sent - completed - failed once the 30 s drain wait is over.
//   failed        requests that resolved with an error. Each error message must name a killed
//                 worker ("worker w2 killed by signal 9"); unexplained_failures counts those that
//                 name no worker killed before they resolved.
//   rss_mb        /proc/<pid>/statm resident pages of the host and of each worker (pid() of its
//                 WorkerSite; null while it is down). private_mb: resident minus shared pages
//                 (statm's third field), i.e. without the mapped shm pools and library pages: the
//                 pools grow in steps under bursts of traffic, up to 1 GiB per producer
//                 (ShmPoolOptions::max_total_bytes), which the total follows; a leak shows in the
//                 private figure. owned_mb: rss_mb minus the pages of other processes' pools this one
//                 has mapped (its smaps), so that every pool page counts once, in the process that
//                 made it: a consumer's total also follows its peers' pools (a killed peer's go, its
//                 restart's come), which the producer already counts.
//   shm_slots_in_use  sum over the workers of SiteStats::shm_requests.slots_in_use (the host's
//                 pools) and shm_results.slots_in_use (the worker's, as of its last heartbeat), now.
//                 Under traffic it follows the requests in flight, so the target compares
//                 shm_slots_idle_min: the least of it seen (sampled every 100 ms) at moments when the
//                 session had had nothing in flight for 200 ms (a worker's figure is its last
//                 heartbeat's, every 100 ms), since the previous line (null: no such moment).
//   shm_objects   shm pools (memfds "blockflow-<id>", shm_pool.hpp) that a live process of the run
//                 (the host, a worker) maps, made by the host or a live worker (the pool id's high 32
//                 bits; pools are made on demand, so this may grow with the traffic); shm_orphans:
//                 those made by the workers killed, which live on while a process still maps them.
//   fds           entries of /proc/self/fd (the host) less its shm pools' memfds (each pool, its own or
//                 one given to it, keeps its descriptor while it is mapped, and pools follow the
//                 traffic); worker_fds: entries of /proc/<pid>/fd.
//   shm_pools_created, shm_pools_trimmed  in the final line: pools made and removed after idling, summed
//                 over the host's pools and each worker's current incarnation (ShmPoolOptions::idle_trim_max).
//   rss_slope_mb_per_min, owned_slope_mb_per_min, private_slope_mb_per_min  per name: least squares over the samples
//                 (every 5 s) taken once the soak has run 60 s and the process has lived 60 s, with one intercept per process
//                 (a restarted worker starts again from its idle size; its growth is what counts).
//                 null: no such samples (a short run, or a worker killed every 120 s never lives 60 s
//                 into the second minute of the soak before its next kill).
// Targets: lost == 0; unexplained_failures == 0; every private slope < 1 MB/min (the total one is
// printed and checked too: it includes the pool pages); at every line after a kill, shm_orphans
// back to its starting level, and, taken at the moments since the previous line when nothing was
// in flight, the least slots in use (shm_slots_idle_min) and the least host descriptors at their
// starting levels (a line with no such moment, the system saturated all along, is counted in
// lines_without_idle_moment and left to the next idle moment: a slot or descriptor a kill kept
// would still be missing then); after the drain, all three back to their starting levels.
//
//   soak_bench --models DIR [--seconds S] [--threads T] [--load F] [--saturation-s S] [--kill-every-s S]
//              [--max-in-flight N]
//
// --max-in-flight N (4; 0: no limit) is the session's max_in_flight_per_task: the backlog that a
// restarting worker leaves waits at the task's entry (the one input tensor the bench submits again
// and again) rather than as activations in the workers' shm pools.
//
// --kill-every-s 0 kills nothing: with the 30 s kills a worker lives 120 s, so its slope covers
// only its second minute (pools still being mapped on demand); without kills it covers the run.

#include "bench_util.hpp"

#include <blockflow/blockflow.hpp>
#include <blockflow/deploy/deployment.hpp>
#include <blockflow/worker/worker_site.hpp>
#include <blockflow/channel/detail/shm_pool.hpp>  // pool ids in memfd names

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cctype>
#include <csignal>
#include <cstdlib>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>

namespace bf = blockflow;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kWorkers = 4;
constexpr double kApplyEveryS = 45, kPrintEveryS = 30, kRssEveryS = 5, kDrainS = 30;
constexpr double kSettledS = 60;  // RSS slopes: samples once the soak and the process are a minute old

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Resident pages of the shm pools of other processes that `pid` has mapped, in MB (its smaps: a
// mapping of /memfd:blockflow-<16 hex> whose producer pid, the id's high 32 bits, is not `pid`).
std::optional<double> foreign_pools_mb(const std::string& proc, std::int64_t pid) {
  std::ifstream in("/proc/" + proc + "/smaps");
  if (!in) return std::nullopt;
  std::string line;
  bool foreign = false;
  long kb = 0;
  while (std::getline(in, line)) {
    const auto at = line.find("/memfd:");
    if (!line.empty() && std::isxdigit(static_cast<unsigned char>(line[0])) && line.find('-') < line.find(' ')) {
      // a mapping's header line: its path is the last field (" (deleted)" may follow)
      const auto id = at == std::string::npos ? std::nullopt
                                              : bf::detail::shm_pool_id(std::string_view(line).substr(at, line.find(' ', at) - at));
      foreign = id && bf::detail::shm_pool_producer(*id) != pid;
    } else if (foreign && line.rfind("Rss:", 0) == 0) {
      kb += std::strtol(line.c_str() + 4, nullptr, 10);
    }
  }
  return static_cast<double>(kb) / 1024.0;
}

// How a process's resident memory is counted.
enum class Rss {
  total,     // statm's resident pages, as `ps` shows them: the peers' pools it has mapped included
  owned,     // total minus the pages of other processes' pools it has mapped: every page counted once,
             // in the process that made it (its own pools stay in)
  private_,  // resident minus shared (statm's third field: file-backed and shared-memory pages, so
             // every pool and the libraries are left out); what a leak grows
};

// Resident memory of a process in MB; nullopt when it is gone.
std::optional<double> rss_mb(const std::string& proc, Rss kind = Rss::total) {
  std::ifstream in("/proc/" + proc + "/statm");
  long size = 0, resident = 0, shared = 0;
  if (!(in >> size >> resident >> shared)) return std::nullopt;
  const long pages = kind == Rss::private_ ? resident - shared : resident;
  const double mb = static_cast<double>(pages) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / 1048576.0;
  if (kind != Rss::owned) return mb;
  const std::int64_t pid = proc == "self" ? static_cast<std::int64_t>(::getpid()) : std::stoll(proc);
  const auto foreign = foreign_pools_mb(proc, pid);
  if (!foreign) return std::nullopt;
  return mb - *foreign;
}

// Open descriptors of a process; -1 when it is gone.
int fd_count(const std::string& pid) {
  std::error_code ec;
  int n = 0;
  for (std::filesystem::directory_iterator it("/proc/" + pid + "/fd", ec), end; !ec && it != end; it.increment(ec)) ++n;
  return ec ? -1 : n;
}

// The shm pools mapped by `pid` (its maps: /memfd:blockflow-<16 hex>).
void mapped_pools(std::int64_t pid, std::set<std::uint64_t>& ids) {
  std::ifstream in(fmt::format("/proc/{}/maps", pid));
  std::string line;
  while (std::getline(in, line)) {
    const auto at = line.find("/memfd:");
    if (at == std::string::npos) continue;
    if (const auto id = bf::detail::shm_pool_id(std::string_view(line).substr(at, line.find(' ', at) - at))) ids.insert(*id);
  }
}

// The pools made by one of `pids` (the pool id's high 32 bits) that a live process of `pids` maps:
// those of live producers and those of dead ones (orphans, while some process still maps them).
struct ShmObjects {
  int live = 0, orphaned = 0;
};
ShmObjects shm_objects(const std::set<std::int64_t>& pids) {
  std::set<std::uint64_t> ids;
  for (const std::int64_t pid : pids) {
    if (::kill(static_cast<pid_t>(pid), 0) == 0) mapped_pools(pid, ids);
  }
  ShmObjects n;
  for (const std::uint64_t id : ids) {
    if (pids.count(bf::detail::shm_pool_producer(id)) == 0) continue;
    ++(::kill(static_cast<pid_t>(bf::detail::shm_pool_producer(id)), 0) == 0 ? n.live : n.orphaned);
  }
  return n;
}

// The host's descriptors, less its shm pools' memfds (each pool mapped here keeps one open while it
// is: pools come and go with the traffic, a leaked descriptor stays).
int host_fds(const bf::MetricsSnapshot&) {
  std::error_code ec;
  int pools = 0;
  for (std::filesystem::directory_iterator it("/proc/self/fd", ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code link_ec;
    const std::string target = std::filesystem::read_symlink(it->path(), link_ec).string();
    if (!link_ec && bf::detail::shm_pool_id(target.substr(0, target.find(' '))).has_value()) ++pools;
  }
  return fd_count("self") - pools;
}

std::uint64_t slots_in_use(const bf::MetricsSnapshot& m) {
  std::uint64_t n = 0;
  for (const auto& s : m.sites) n += s.shm_requests.slots_in_use + s.shm_results.slots_in_use;
  return n;
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) out += fmt::format("\\u{:04x}", c);
    else out += c;
  }
  return out + "\"";
}

template <class T>
std::string json_or_null(const std::optional<T>& v, const char* format = "{}") {
  return v ? fmt::format(fmt::runtime(format), *v) : "null";
}

// One RSS sample of one process.
struct RssSample {
  double t_s;
  std::int64_t pid;
  double mb;
};

// MB/min: least squares slope with one intercept per process (pooled within-process fit).
std::optional<double> rss_slope(const std::vector<RssSample>& samples) {
  std::map<std::int64_t, std::pair<double, double>> sums;  // pid -> (sum t, sum mb)
  std::map<std::int64_t, int> counts;
  for (const auto& s : samples) {
    sums[s.pid].first += s.t_s;
    sums[s.pid].second += s.mb;
    ++counts[s.pid];
  }
  double sxy = 0, sxx = 0;
  for (const auto& s : samples) {
    const double n = counts[s.pid], dt = s.t_s - sums[s.pid].first / n;
    sxy += dt * (s.mb - sums[s.pid].second / n);
    sxx += dt * dt;
  }
  if (sxx <= 0) return std::nullopt;
  return sxy / sxx * 60.0;
}

// Requests sent and how each resolved; filled by the traffic thread and the completion callbacks.
// Thread-safe.
class Ledger {
 public:
  struct Counts {
    long sent = 0, completed = 0, failed = 0, outstanding = 0, overdue = 0, unexplained = 0;
  };

  std::uint64_t begin() {
    std::lock_guard lock(mu_);
    ++sent_;
    open_.emplace(next_id_, Clock::now());
    return next_id_++;
  }
  void finish(std::uint64_t id, const bf::Result& r) {
    std::lock_guard lock(mu_);
    open_.erase(id);
    if (r.ok()) {
      ++completed_;
      return;
    }
    ++failed_;
    const std::string message(r.status.message());
    bool named = false;
    for (const auto& w : killed_) named = named || message.find("worker " + w) != std::string::npos;
    if (!named) ++unexplained_;
    std::string key = message.substr(0, 100);
    if (errors_.size() >= 20 && errors_.count(key) == 0) key = "(other messages)";
    ++errors_[key];
  }
  void killed(const std::string& worker) {
    std::lock_guard lock(mu_);
    killed_.insert(worker);
  }
  Counts counts(double overdue_after_s = kDrainS) const {
    std::lock_guard lock(mu_);
    Counts c{sent_, completed_, failed_, static_cast<long>(open_.size()), 0, unexplained_};
    const auto limit = Clock::now() - std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(overdue_after_s));
    for (const auto& [id, t] : open_) c.overdue += t < limit ? 1 : 0;
    return c;
  }
  std::string errors_json() const {
    std::lock_guard lock(mu_);
    std::string out;
    for (const auto& [message, n] : errors_) out += fmt::format("{}{}:{}", out.empty() ? "" : ",", json_string(message), n);
    return "{" + out + "}";
  }

 private:
  mutable std::mutex mu_;
  long sent_ = 0, completed_ = 0, failed_ = 0, unexplained_ = 0;
  std::uint64_t next_id_ = 0;
  std::map<std::uint64_t, Clock::time_point> open_;
  std::set<std::string> killed_;
  std::map<std::string, long> errors_;
};

std::string block_json(const std::string& models, const std::string& name, const std::string& shape, int threads,
                       const std::string& placement) {
  return fmt::format(R"({{"name": "{}", "torchscript": "{}/{}.pt", "intra_op_threads": {}, "input_shapes": [{}], )"
                     R"("warmup_runs": 1, "placement": "{}"}})",
                     name, models, name, threads, shape, placement);
}

// The deployment: block1..block4 in w1..w4, head_b in w4 too; task_a ends with `head`.
bf::Deployment deployment(const std::string& models, int threads, const std::string& head) {
  const std::string blocks = fmt::format(
      "{}, {}, {}, {}, {}", block_json(models, "block1", "[-1, 3, 224, 224]", threads, "w1"),
      block_json(models, "block2", "[-1, 256, 56, 56]", threads, "w2"),
      block_json(models, "block3", "[-1, 512, 28, 28]", threads, "w3"),
      block_json(models, "block4", "[-1, 1024, 14, 14]", threads, "w4"),
      block_json(models, "head_b", "[-1, 1024, 14, 14]", threads, "w4"));
  auto d = bf::Deployment::parse(
      fmt::format(R"({{"blocks": [{}], "tasks": {{"task_a": ["block1", "block2", "block3", "{}"]}}}})", blocks, head));
  if (!d.ok()) throw std::runtime_error(d.status().ToString());
  return *std::move(d);
}

// Completions per second with `window` requests kept in flight for `seconds` (the first 5 s not
// counted); returns once all of them resolved.
double saturation_rps(bf::Session& session, const bf::Tensor& x, double seconds, int window = 16) {
  std::mutex mu;
  std::condition_variable cv;
  int in_flight = 0;
  long counted = 0;
  const auto t0 = Clock::now();
  const double warm_s = std::min(5.0, seconds / 4);
  // Requests that do not come back within 2 minutes end the bench: the session is shut down first,
  // which resolves them, so that no callback outlives the locals it uses.
  auto give_up = [&](std::unique_lock<std::mutex>& lock, const std::string& what) {
    const int stuck = in_flight;
    lock.unlock();
    session.shutdown();
    lock.lock();
    cv.wait(lock, [&] { return in_flight == 0; });
    throw std::runtime_error(fmt::format("saturation: {} requests still unresolved 2 minutes {}", stuck, what));
  };
  while (seconds_since(t0) < seconds) {
    std::unique_lock lock(mu);
    if (!cv.wait_for(lock, std::chrono::minutes(2), [&] { return in_flight < window; })) {  // woken by a completion
      give_up(lock, "into the run");
    }
    ++in_flight;
    lock.unlock();
    session.submit("task_a", {x}, [&](bf::Result&&) {
      std::lock_guard done(mu);
      --in_flight;
      const double t = seconds_since(t0);
      if (t >= warm_s && t < seconds) ++counted;
      cv.notify_all();
    });
  }
  std::unique_lock lock(mu);
  if (!cv.wait_for(lock, std::chrono::minutes(2), [&] { return in_flight == 0; })) give_up(lock, "after the last was sent");
  return static_cast<double>(counted) / (seconds - warm_s);
}

// The levels a leak would raise, taken with nothing in flight.
struct Levels {
  std::uint64_t slots = 0;
  int fds = 0;
  ShmObjects objects;
};

}  // namespace

int main(int argc, char** argv) try {
  std::string models;
  double seconds = 600, load = 0.9, saturation_s = 20, kill_every_s = 30;
  int threads = 2, max_in_flight = 4;
  bf::bench::parse_options(argc, argv, [&](const std::string& a, const std::string& v) {
    if (a == "--models") models = v;
    else if (a == "--seconds") seconds = std::stod(v);
    else if (a == "--threads") threads = std::stoi(v);
    else if (a == "--load") load = std::stod(v);
    else if (a == "--saturation-s") saturation_s = std::stod(v);
    else if (a == "--kill-every-s") kill_every_s = std::stod(v);  // 0: no kills (workers' RSS over a long life)
    else if (a == "--max-in-flight") max_in_flight = std::stoi(v);  // SessionOptions::max_in_flight_per_task; 0: none
    else return false;
    return true;
  });
  if (models.empty()) {
    throw std::invalid_argument("usage: soak_bench --models DIR [--seconds S] [--threads T] [--load F] [--saturation-s S] [--kill-every-s S] [--max-in-flight N]");
  }
  const auto origin = Clock::now();
  Ledger ledger;  // outlives the session: its destructor may still resolve requests
  bf::SessionOptions session_options;
  session_options.max_in_flight_per_task = max_in_flight;
  bf::Session session(session_options);
  std::vector<std::shared_ptr<bf::WorkerSite>> workers;
  std::vector<std::string> names;
  for (int w = 1; w <= kWorkers; ++w) {
    bf::WorkerOptions o;
    o.name = fmt::format("w{}", w);
    o.channel = "shm";
    // Every kill is restarted: one restart per kill with some to spare. The backoff doubles after
    // each restart of a worker (capped at 2^10 x); 10 ms keeps the 5th restart of a 600 s run at 160 ms
    // and a longer soak's worst at ~10 s, well inside the 120 s between two kills of one worker.
    o.max_restarts = kill_every_s > 0 ? static_cast<int>(seconds / kill_every_s / kWorkers) + 4 : 4;
    o.restart_backoff = absl::Milliseconds(10);
    workers.push_back(bf::make_worker(o));
    names.push_back(o.name);
    session.add_site(workers.back());
  }
  const bf::Deployment first = deployment(models, threads, "block4");
  for (const auto& b : first.blocks) session.add_block(b);
  for (auto& p : first.paths()) session.add_path(std::move(p));
  if (auto status = session.start(); !status.ok()) throw std::runtime_error(status.ToString());
  const bf::Tensor x = at::randn({1, 3, 224, 224});

  // Every pid of the run with when it was first seen (for shm_objects and the processes' ages).
  std::map<std::int64_t, double> first_seen{{::getpid(), 0.0}};
  std::set<std::int64_t> pids{::getpid()};
  auto watch_pids = [&] {
    for (const auto& w : workers) {
      const std::int64_t pid = w->pid();
      if (pid > 0 && pids.insert(pid).second) first_seen[pid] = seconds_since(origin);
    }
  };
  watch_pids();
  auto levels_at_rest = [&] {  // nothing in flight: let releases and a heartbeat arrive, then read
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    watch_pids();
    const bf::MetricsSnapshot m = session.metrics();
    return Levels{slots_in_use(m), host_fds(m), shm_objects(pids)};
  };

  const double sat = saturation_rps(session, x, saturation_s);
  if (!(sat > 0)) throw std::runtime_error("no request completed while measuring the saturation");
  const double rate = load * sat;
  const Levels start = levels_at_rest();

  bf::bench::PoissonTraffic traffic(rate, [&] {
    const std::uint64_t id = ledger.begin();
    session.submit("task_a", {x}, [&ledger, id](bf::Result&& r) { ledger.finish(id, r); });
  });

  const auto soak0 = Clock::now();
  const double soak_origin_s = seconds_since(origin);
  std::map<std::string, std::vector<RssSample>> rss, owned_rss, private_rss;  // "host", "w1".. -> samples for the slopes
  std::optional<std::uint64_t> idle_min;              // least slots in use with nothing in flight
  std::optional<double> quiet_since;                  // nothing in flight since then
  constexpr double kQuietS = 0.2;                     // two worker heartbeats
  int idle_fds_min = INT_MAX;                         // least host descriptors then
  bool slots_back = true, fds_back = true, orphans_back = true;
  int kills = 0, kills_skipped = 0, applies = 0, apply_errors = 0, checks = 0, checks_without_idle = 0;
  double apply_ms_max = 0;
  auto sample_rss = [&] {
    const double t = seconds_since(origin);
    auto keep = [&](const std::string& key, std::int64_t pid, const std::string& proc) {
      if (t - soak_origin_s < kSettledS || t - first_seen[pid] < kSettledS) return;
      if (auto mb = rss_mb(proc)) rss[key].push_back({t, pid, *mb});
      if (auto mb = rss_mb(proc, Rss::owned)) owned_rss[key].push_back({t, pid, *mb});
      if (auto mb = rss_mb(proc, Rss::private_)) private_rss[key].push_back({t, pid, *mb});
    };
    keep("host", ::getpid(), "self");
    for (std::size_t i = 0; i < workers.size(); ++i) {
      const std::int64_t pid = workers[i]->pid();
      if (pid > 0) keep(names[i], pid, std::to_string(pid));
    }
  };
  auto print_line = [&](double t, const bf::MetricsSnapshot& m, const Levels& now, bool first_line) {
    const Ledger::Counts c = ledger.counts();
    std::string rss_json = fmt::format("\"host\":{:.1f}", rss_mb("self").value_or(0));
    std::string private_json = fmt::format("\"host\":{:.1f}", rss_mb("self", Rss::private_).value_or(0));
    std::string owned_json = fmt::format("\"host\":{:.1f}", rss_mb("self", Rss::owned).value_or(0));
    std::string fds_json;
    std::uint64_t restarts = 0;
    for (std::size_t i = 0; i < workers.size(); ++i) {
      const std::int64_t pid = workers[i]->pid();
      const std::string p = std::to_string(pid);
      rss_json += fmt::format(",\"{}\":{}", names[i], pid > 0 ? json_or_null(rss_mb(p), "{:.1f}") : "null");
      private_json += fmt::format(",\"{}\":{}", names[i], pid > 0 ? json_or_null(rss_mb(p, Rss::private_), "{:.1f}") : "null");
      owned_json += fmt::format(",\"{}\":{}", names[i], pid > 0 ? json_or_null(rss_mb(p, Rss::owned), "{:.1f}") : "null");
      const int fds = pid > 0 ? fd_count(p) : -1;
      fds_json += fmt::format("{}\"{}\":{}", i ? "," : "", names[i], fds >= 0 ? std::to_string(fds) : "null");
    }
    for (const auto& s : m.sites) restarts += s.restarts;
    // Every line says the machine and the threads it was measured with; the first one the run's settings.
    const std::string head =
        fmt::format("\"cpu\":{},\"threads\":{},\"hardware_threads\":{},", json_string(bf::bench::cpu_model()), threads,
                    std::thread::hardware_concurrency()) +
        (first_line ? fmt::format("\"workers\":{},\"channel\":\"shm\",\"saturation_rps\":{:.2f},\"rate_rps\":{:.2f},"
                                  "\"duration_s\":{},\"kill_every_s\":{},\"max_in_flight_per_task\":{},",
                                  kWorkers, sat, rate, seconds, kill_every_s, max_in_flight)
                    : std::string());
    fmt::print("{{\"bench\":\"soak\",{}\"t_s\":{:.0f},\"sent\":{},\"completed\":{},\"failed\":{},\"lost\":{},"
               "\"outstanding\":{},\"rss_mb\":{{{}}},\"owned_mb\":{{{}}},\"private_mb\":{{{}}},\"shm_slots_in_use\":{},\"shm_slots_idle_min\":{},"
               "\"shm_objects\":{},\"shm_orphans\":{},\"fds\":{},\"worker_fds\":{{{}}},\"restarts\":{},\"version\":{}}}\n",
               head, t, c.sent, c.completed, c.failed, c.overdue, c.outstanding, rss_json, owned_json, private_json, slots_in_use(m),
               first_line ? std::to_string(start.slots) : json_or_null(idle_min), now.objects.live, now.objects.orphaned,
               now.fds, fds_json,
               restarts, m.version);
    std::fflush(stdout);
  };
  print_line(0, session.metrics(), start, true);

  // Pool events: each producer's pools as its site last reported them (the worker's own pools, and
  // the host's pools towards that worker). A change prints a "soak_pools" line; pools made once the
  // soak and the producer are a minute old (the span the slopes cover) are counted per producer.
  struct PoolView {
    std::int64_t pid = 0;
    std::uint64_t pools = 0, created = 0, trimmed = 0;
  };
  std::map<std::string, PoolView> pool_views;
  std::map<std::string, std::uint64_t> pools_made_late;
  auto watch_pools = [&](const bf::MetricsSnapshot& m) {
    const double now = seconds_since(origin);
    auto see = [&](const std::string& key, std::int64_t pid, const bf::ShmEdgeStats& s) {
      PoolView& v = pool_views[key];
      const PoolView seen{pid, s.pools, s.pools_created, s.pools_trimmed};
      const auto born = first_seen.find(pid);
      if (pid == 0 || born == first_seen.end()) return;  // down, or restarted since watch_pids()
      if (v.pid != pid) {
        // A new life: until its first heartbeat its site still reports the previous life's pools.
        v = seen;
        return;
      }
      if (v.pools == seen.pools && v.created == seen.created && v.trimmed == seen.trimmed) return;
      const double age = now - born->second;
      if (seen.created > v.created && age >= kSettledS && now - soak_origin_s >= kSettledS) {
        pools_made_late[key] += seen.created - v.created;
      }
      fmt::print("{{\"bench\":\"soak_pools\",{},\"threads\":{},\"t_s\":{:.1f},\"producer\":\"{}\",\"age_s\":{:.1f},\"pools\":{},"
                 "\"created\":{},\"trimmed\":{},\"slots_in_use\":{},\"slots_total\":{},\"mapped_mb\":{:.0f},\"in_flight\":{}}}\n",
                 bf::bench::machine_json(), threads, now - soak_origin_s, key, age, s.pools, s.pools_created, s.pools_trimmed, s.slots_in_use, s.slots_total,
                 static_cast<double>(s.bytes_mapped) / (1 << 20), m.in_flight);
      v = seen;
    };
    for (const auto& s : m.sites) {
      see(s.name, s.pid, s.shm_results);
      see("host>" + s.name, ::getpid(), s.shm_requests);
    }
  };

  double next_print = kPrintEveryS, next_kill = kill_every_s > 0 ? kill_every_s : seconds + 1, next_apply = kApplyEveryS, next_rss = 0;
  for (;;) {
    const double t = seconds_since(soak0);
    watch_pids();
    const bf::MetricsSnapshot m = session.metrics();
    watch_pools(m);
    // A worker's slots in use are those of its last heartbeat (every 100 ms): read them once the
    // session has had nothing in flight for two heartbeats, so that they describe the idle state.
    if (m.in_flight != 0) {
      quiet_since.reset();
    } else if (!quiet_since) {
      quiet_since = t;
    } else if (t - *quiet_since >= kQuietS) {
      idle_min = std::min(idle_min.value_or(UINT64_MAX), slots_in_use(m));
      idle_fds_min = std::min(idle_fds_min, host_fds(m));
    }
    if (t >= next_rss) {
      sample_rss();
      next_rss += kRssEveryS;
    }
    if (t >= next_print) {
      const Levels now{slots_in_use(m), host_fds(m), shm_objects(pids)};
      print_line(t, m, now, false);
      if (kills > 0) {  // a line after a kill: what it took must be back
        orphans_back = orphans_back && now.objects.orphaned <= start.objects.orphaned;
        if (idle_min) {  // slots and descriptors: at the moments with nothing in flight
          ++checks;
          slots_back = slots_back && *idle_min <= start.slots;
          fds_back = fds_back && idle_fds_min <= start.fds;
        } else {
          ++checks_without_idle;  // saturated all along: the next idle moment (or the drain) checks it
        }
      }
      idle_min.reset();
      idle_fds_min = INT_MAX;
      next_print += kPrintEveryS;
    }
    if (t >= seconds) break;
    if (t >= next_kill) {
      const std::size_t k = static_cast<std::size_t>(kills + kills_skipped) % workers.size();
      const std::int64_t pid = workers[k]->pid();
      ledger.killed(names[k]);  // before the kill: its failures may come at once
      if (pid > 0 && ::kill(static_cast<pid_t>(pid), SIGKILL) == 0) ++kills;
      else ++kills_skipped;  // down (still restarting): the next one is killed next time
      next_kill += kill_every_s;
    }
    if (t >= next_apply) {
      const auto t0 = Clock::now();
      const auto v = session.apply(deployment(models, threads, applies % 2 == 0 ? "head_b" : "block4"));
      apply_ms_max = std::max(apply_ms_max, seconds_since(t0) * 1e3);
      if (v.ok()) {
        ++applies;
      } else {
        std::cerr << "soak_bench: apply: " << v.status() << "\n";
        ++apply_errors;
      }
      next_apply += kApplyEveryS;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  traffic.stop();
  const double traffic_s = seconds_since(soak0);
  const auto drain_until = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(kDrainS));
  while (ledger.counts().outstanding > 0 && Clock::now() < drain_until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const Ledger::Counts c = ledger.counts(0);
  const Levels end = levels_at_rest();
  const bf::MetricsSnapshot m = session.metrics();

  std::string slopes, owned_slopes, private_slopes, points;
  bool slopes_ok = true, owned_slopes_ok = true, private_slopes_ok = true;
  for (const std::string key : {"host", "w1", "w2", "w3", "w4"}) {
    const char* comma = key == "host" ? "" : ",";
    const auto slope = rss_slope(rss[key]);
    const auto private_slope = rss_slope(private_rss[key]);
    const auto owned_slope = rss_slope(owned_rss[key]);
    owned_slopes_ok = owned_slopes_ok && (!owned_slope || *owned_slope < 1.0);
    owned_slopes += fmt::format("{}\"{}\":{}", comma, key, json_or_null(owned_slope, "{:.3f}"));
    slopes_ok = slopes_ok && (!slope || *slope < 1.0);
    private_slopes_ok = private_slopes_ok && (!private_slope || *private_slope < 1.0);
    slopes += fmt::format("{}\"{}\":{}", comma, key, json_or_null(slope, "{:.3f}"));
    private_slopes += fmt::format("{}\"{}\":{}", comma, key, json_or_null(private_slope, "{:.3f}"));
    points += fmt::format("{}\"{}\":{}", comma, key, rss[key].size());
  }
  std::string late;
  for (const auto& [key, n] : pools_made_late) late += fmt::format("{}\"{}\":{}", late.empty() ? "" : ",", key, n);
  std::uint64_t restarts = 0, site_failed = 0, pools_created = 0, pools_trimmed = 0;
  for (const auto& s : m.sites) {
    restarts += s.restarts;
    site_failed += s.failed_requests;
    pools_created += s.shm_requests.pools_created + s.shm_results.pools_created;
    pools_trimmed += s.shm_requests.pools_trimmed + s.shm_results.pools_trimmed;
  }
  const long lost = c.sent - c.completed - c.failed;
  fmt::print(
      "{{\"bench\":\"soak\",{},\"threads\":{},\"final\":true,\"duration_s\":{:.0f},\"rate_rps\":{:.2f},\"saturation_rps\":{:.2f},"
      "\"sent\":{},\"completed\":{},\"failed\":{},\"lost\":{},\"unexplained_failures\":{},\"errors\":{},"
      "\"kills\":{},\"kills_skipped\":{},\"restarts\":{},\"site_failed_requests\":{},\"applies\":{},\"apply_errors\":{},"
      "\"apply_ms_max\":{:.1f},\"rss_slope_mb_per_min\":{{{}}},\"owned_slope_mb_per_min\":{{{}}},\"private_slope_mb_per_min\":{{{}}},"
      "\"rss_slope_points\":{{{}}},\"shm_pools_made_after_first_minute\":{{{}}},\"shm_pools_created\":{},\"shm_pools_trimmed\":{},"
      "\"start\":{{\"shm_slots_in_use\":{},\"fds\":{},\"shm_objects\":{},\"shm_orphans\":{}}},"
      "\"end\":{{\"shm_slots_in_use\":{},\"fds\":{},\"shm_objects\":{},\"shm_orphans\":{}}},\"checks_after_kills\":{},\"lines_without_idle_moment\":{},"
      "\"targets\":{{\"lost_zero\":{},\"failures_name_killed_worker\":{},\"rss_slopes_under_1_mb_per_min\":{},"
      "\"owned_slopes_under_1_mb_per_min\":{},\"private_slopes_under_1_mb_per_min\":{},"
      "\"slots_back\":{},\"fds_back\":{},\"shm_orphans_back\":{}}}}}\n",
      bf::bench::machine_json(), threads, traffic_s, rate, sat, c.sent, c.completed, c.failed, lost, c.unexplained, ledger.errors_json(), kills,
      kills_skipped, restarts, site_failed, applies, apply_errors, apply_ms_max, slopes, owned_slopes, private_slopes, points, late, pools_created, pools_trimmed, start.slots, start.fds,
      start.objects.live, start.objects.orphaned, end.slots, end.fds, end.objects.live, end.objects.orphaned, checks, checks_without_idle, lost == 0, c.unexplained == 0, slopes_ok, owned_slopes_ok, private_slopes_ok,
      slots_back && end.slots <= start.slots, fds_back && end.fds <= start.fds,
      orphans_back && end.objects.orphaned <= start.objects.orphaned);
  std::fflush(stdout);
  session.shutdown();
  return 0;
} catch (const std::exception& e) {
  std::cerr << "soak_bench: " << e.what() << "\n";
  return 1;
}
