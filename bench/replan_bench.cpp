// replan (issue 19): three tasks over three worker processes that are not restarted; one worker is
// killed under traffic and the session re-plans (SessionOptions::on_site_lost = replanner()).
//   classify  block1 -> block2 -> block3 -> block4
//   task_b    block1 -> block2 -> block3 -> head_b
//   features  block1 -> block2
// 1. Profiles the five blocks here (blockflow::profile_block, quick, one intra-op thread each) and
//    the channels.
// 2. Picks the tasks' rate: the same for each, raised in steps of 5% from a low one until the plan
//    over the three workers (one lane each) still admits every task but a re-plan without the
//    worker that runs block3 must demote or refuse one (SLOs: 4x, 5x, 6x the task's profiled p50
//    sum, so `features` has the loosest).
// 3. Deploys that plan (the session in this process, the blocks in the workers), drives every task
//    with a closed-loop client, kills the worker after a warm-up and keeps the clients going until
//    the re-planned deployment has served every task again.
// Prints one JSON line: the machine, the rate, the lost worker, kill -> loss detected, loss -> the
// re-planned deployment applied (ReplanStats::last_ms), kill -> each task's first result again,
// requests failed after the kill (naming the lost worker, and any other), and the changes with
// their reasons (as the session logged them).
//
// usage: replan_bench --models DIR [--warmup-s S] [--after-s S]
#include "bench_util.hpp"
#include "resnet_split.hpp"

#include <blockflow/blockflow.hpp>
#include <blockflow/plan/replan.hpp>
#include <blockflow/worker/worker_site.hpp>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <csignal>
#include <iostream>
#include <map>
#include <optional>
#include <mutex>
#include <thread>

namespace bf = blockflow;
using Clock = std::chrono::steady_clock;

namespace {

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

bf::PlanInput make_input(const std::string& models) {
  bf::PlanInput in;
  bf::ProfileOptions quick;
  quick.quick = true;
  auto stages = bf::bench::resnet_split_stages();
  stages.emplace_back("head_b", std::vector<std::int64_t>{1, 1024, 14, 14});
  for (const auto& [name, shape] : stages) {
    auto p = bf::profile_block(bf::bench::model_block(models, name, shape, 1, true), quick);
    if (!p.ok()) throw std::runtime_error(p.status().ToString());
    in.profile.blocks.push_back(*std::move(p));
  }
  auto channels = bf::profile_channels(quick);
  if (!channels.ok()) throw std::runtime_error(channels.status().ToString());
  in.profile.channels = *std::move(channels);
  for (const char* w : {"w1", "w2", "w3"}) {
    bf::PlanSite s;
    s.name = w;
    in.sites.push_back(s);
  }
  const std::vector<std::tuple<std::string, std::vector<std::string>, double>> tasks = {
      {"classify", {"block1", "block2", "block3", "block4"}, 4.0},
      {"task_b", {"block1", "block2", "block3", "head_b"}, 5.0},
      {"features", {"block1", "block2"}, 6.0}};
  for (const auto& [name, path, slo_factor] : tasks) {
    double p50 = 0;
    for (const auto& b : path) p50 += in.profile.block(b)->at_batch(1)->p50_ms;
    in.tasks.emplace_back(name, path, 1.0, slo_factor * p50);
  }
  return in;
}

std::string site_of(const bf::Plan& p, const std::string& block) {
  for (const auto& b : p.blocks) {
    if (b.block == block) return b.site;
  }
  return "";
}

bool all_admitted(const bf::Plan& p) {
  return std::all_of(p.tasks.begin(), p.tasks.end(), [](const bf::TaskVerdict& v) { return v.admitted; });
}

// Step 2: the rate, the plan deployed, and the worker to lose.
std::tuple<double, bf::Plan, std::string> pick_rate(bf::PlanInput& in) {
  double rate = 0.5;
  std::optional<std::tuple<double, bf::Plan, std::string>> last;
  for (int step = 0; step < 120; ++step, rate *= 1.05) {
    for (auto& t : in.tasks) t.rate_rps = rate;
    auto p = bf::plan(in);
    if (!p.ok()) throw std::runtime_error(p.status().ToString());
    if (!all_admitted(*p)) break;
    const std::string lost = site_of(*p, "block3");
    auto r = bf::replan(in, *p, {lost});
    if (!r.ok()) throw std::runtime_error(r.status().ToString());
    last.emplace(rate, *p, lost);
    if (!r->changes.empty()) break;
  }
  if (!last) throw std::runtime_error("no rate at which the plan admits every task");
  for (auto& t : in.tasks) t.rate_rps = std::get<0>(*last);
  return *last;
}

// A closed-loop client of one task: counts what comes back after `kill_at` is set.
struct Client {
  std::string task;
  std::atomic<int> ok{0}, failed_named{0}, failed_other{0};
  std::atomic<double> first_ok_after_kill_ms{0};
  std::string sample;  // the last other failure
};

}  // namespace

int main(int argc, char** argv) try {
  std::string models;
  double warmup_s = 3, after_s = 3;
  bf::bench::parse_options(argc, argv, [&](const std::string& k, const std::string& v) {
    if (k == "--models") models = v;
    else if (k == "--warmup-s") warmup_s = std::stod(v);
    else if (k == "--after-s") after_s = std::stod(v);
    else return false;
    return true;
  });
  if (models.empty()) throw std::invalid_argument("usage: replan_bench --models DIR [--warmup-s S] [--after-s S]");
  bf::PlanInput in = make_input(models);
  auto [rate, deployed, lost] = pick_rate(in);
  const auto t_replan = Clock::now();
  auto expected = bf::replan(in, deployed, {lost});
  const double replan_compute_ms = ms_since(t_replan);
  if (!expected.ok()) throw std::runtime_error(expected.status().ToString());
  auto deployment = bf::Deployment::parse(deployed.deployment_json(in));
  if (!deployment.ok()) throw std::runtime_error(deployment.status().ToString());

  std::mutex log_mu;
  std::vector<std::string> changes_logged;
  bf::set_log_sink([&](bf::LogLevel level, std::string_view message) {
    if (level == bf::LogLevel::kWarning && (message.find("demoted after") != std::string_view::npos ||
                                            message.find("refused after") != std::string_view::npos)) {
      std::lock_guard lock(log_mu);
      changes_logged.emplace_back(message);
    }
    if (level >= bf::LogLevel::kError) fmt::print(stderr, "replan_bench: {}\n", message);
  });
  bf::SessionOptions options;
  options.intra_op_threads = 1;
  options.on_site_lost = bf::replanner(in);
  bf::Session session(options);
  bf::WorkerOptions workers;
  workers.max_restarts = 0;
  bf::add_deployment(session, *deployment, workers);
  if (auto status = session.start(); !status.ok()) throw std::runtime_error(status.ToString());
  std::int64_t pid = 0;
  for (const auto& s : session.metrics().sites) pid = s.name == lost ? s.pid : pid;
  // kill(0) would kill this process group (the bench's driver, a CI job): a worker must be found.
  if (pid <= 0) throw std::runtime_error(fmt::format("no live worker process for site '{}' to lose", lost));

  const at::Tensor x = at::randn({1, 3, 224, 224});
  std::atomic<bool> run{true};
  std::atomic<bool> killed{false};
  std::atomic<int> finished{0};  // clients that have ended
  Clock::time_point kill_at;
  std::vector<std::unique_ptr<Client>> clients;
  std::vector<std::thread> threads;
  for (const auto& t : in.tasks) {
    clients.push_back(std::make_unique<Client>());
    Client& c = *clients.back();
    c.task = t.name;
    threads.emplace_back([&, &c = c] {
      struct Finished {
        std::atomic<int>& n;
        ~Finished() { ++n; }
      } mark{finished};
      while (run.load()) {
        const bool submitted_after = killed.load();
        bf::Result r = session.submit(c.task, x).get();
        // Counted when it resolved after the kill: the requests in flight at the kill are the ones
        // most likely to fail (a failure of one submitted just before had gone uncounted).
        if (!killed.load()) continue;  // the warm-up
        if (r.ok()) {
          ++c.ok;
          if (submitted_after && c.first_ok_after_kill_ms.load() == 0) c.first_ok_after_kill_ms = ms_since(kill_at);
        } else if (std::string(r.status.message()).find("worker " + lost) != std::string::npos) {
          ++c.failed_named;
        } else {
          ++c.failed_other;
          std::lock_guard lock(log_mu);
          c.sample = r.status.ToString();
        }
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(warmup_s));
  kill_at = Clock::now();
  killed = true;
  ::kill(static_cast<pid_t>(pid), SIGKILL);
  double detected_ms = 0;
  while (ms_since(kill_at) < 60000) {
    const auto m = session.metrics();
    if (detected_ms == 0 && !m.replan.lost_sites.empty()) detected_ms = ms_since(kill_at);
    const bool served = std::all_of(clients.begin(), clients.end(), [&](const auto& c) {
      return c->first_ok_after_kill_ms.load() > 0 || std::any_of(expected->changes.begin(), expected->changes.end(), [&](const bf::TaskChange& ch) { return ch.task == c->task && ch.refused; });
    });
    if ((m.replan.applied > 0 || m.replan.failed > 0) && served) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(after_s));
  run = false;
  // Each client ends with its request in hand; one that is not back within a minute is ended by
  // shutdown() (which resolves every request still in flight) rather than waited on for ever.
  const auto m = session.metrics();
  const auto give_up = Clock::now() + std::chrono::minutes(1);
  while (finished.load() < static_cast<int>(threads.size()) && Clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const bool stuck = finished.load() < static_cast<int>(threads.size());
  session.shutdown();
  for (auto& t : threads) t.join();
  if (stuck) std::cerr << "replan_bench: a client's request was still unresolved a minute after the run: ended by shutdown()\n";
  bf::set_log_sink(nullptr);

  nlohmann::json tasks = nlohmann::json::array();
  int failed_named = 0, failed_other = 0;
  for (const auto& c : clients) {
    failed_named += c->failed_named;
    failed_other += c->failed_other;
    tasks.push_back({{"task", c->task}, {"ok_after_kill", c->ok.load()}, {"failed_naming_lost", c->failed_named.load()},
                     {"failed_other", c->failed_other.load()}, {"first_result_after_kill_ms", c->first_ok_after_kill_ms.load()},
                     {"other_error", c->sample}});
  }
  nlohmann::json line = {{"bench", "replan"},
                         {"cpu", bf::bench::cpu_model()},
                         {"hardware_threads", std::thread::hardware_concurrency()},
                         {"intra_op_threads", 1},
                         {"rate_rps_per_task", rate},
                         {"lost", lost},
                         {"kill_to_detected_ms", detected_ms},
                         {"loss_to_applied_ms", m.replan.last_ms},
                         {"replan_compute_ms", replan_compute_ms},
                         {"apply_total_ms", m.last_update.total_ms},
                         {"replans_applied", m.replan.applied},
                         {"replans_failed", m.replan.failed},
                         {"replan_error", m.replan.last_error},
                         {"failed_naming_lost", failed_named},
                         {"failed_other", failed_other},
                         {"tasks", tasks},
                         {"changes", changes_logged}};
  fmt::print("{}\n", line.dump());
  return m.replan.applied == 1 && failed_other == 0 ? 0 : 1;
} catch (const std::exception& e) {
  fmt::print(stderr, "replan_bench: {}\n", e.what());
  return 1;
}
