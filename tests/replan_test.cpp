// Re-planning after a lost site (plan/replan.hpp, docs/replan.md): the plan for the remaining sites
// keeps blocks where they are and demotes, then refuses, the loosest SLO first; a session given
// replanner() applies it when a worker uses up its restarts, under traffic, and without one it only
// reports the loss.
#include "plan_util.hpp"
#include "test_util.hpp"
#include "worker_util.hpp"

#include <blockflow/plan/replan.hpp>

#include <mutex>

using namespace blockflow;
using namespace blockflow::test;
using Catch::Matchers::Contains;

namespace {

// Three blocks on three one-lane sites, one task each at 0.6 of a lane; their SLOs tight, loose, mid.
PlanInput three_tasks() {
  return input({block("A", 100), block("B", 100), block("C", 100)},
               {{"tight", {"A"}, 60, 50}, {"loose", {"B"}, 60, 500}, {"mid", {"C"}, 60, 100}},
               {site("w1"), site("w2"), site("w3")});
}

const TaskChange* change_of(const Replan& r, const std::string& task) {
  for (const auto& c : r.changes) {
    if (c.task == task) return &c;
  }
  return nullptr;
}

}  // namespace

TEST_CASE("a re-plan moves the lost site's blocks, keeps the others, and demotes the loosest SLO to make room", "[replan]") {
  const PlanInput in = three_tasks();
  const Plan before = planned(in);
  REQUIRE(site_of(before, "A") != site_of(before, "B"));
  REQUIRE(site_of(before, "C") != site_of(before, "A"));
  const std::string lost = site_of(before, "C");
  auto r = replan(in, before, {lost});
  INFO(r.status());
  REQUIRE(r.ok());
  for (const auto& v : r->plan.tasks) CHECK(v.admitted);
  // C (0.6 of a lane) fits nowhere next to 0.6: the loosest SLO whose room lets it in is 'loose'.
  REQUIRE(r->changes.size() == 1);
  const TaskChange* c = change_of(*r, "loose");
  REQUIRE(c != nullptr);
  CHECK_FALSE(c->refused);
  CHECK(c->rate_before == Approx(60));
  CHECK(c->rate_after == Approx(30));
  CHECK_THAT(c->reason, Contains("task 'loose': demoted after losing site '" + lost + "' from 60.0 to 30.0 req/s"));
  CHECK_THAT(c->reason, Contains("loosest SLO (500.0 ms)"));
  CHECK_THAT(c->reason, Contains("task 'mid'"));  // the one it made room for
  CHECK(site_of(r->plan, "A") == site_of(before, "A"));  // untouched
  CHECK(site_of(r->plan, "B") == site_of(before, "B"));
  CHECK(site_of(r->plan, "C") == site_of(before, "B"));  // next to the demoted task
  CHECK(r->input.sites.size() == 2);
  // The deployment names the remaining sites only, and the report says what changed.
  auto d = Deployment::parse(r->deployment_json());
  REQUIRE(d.ok());
  CHECK(d->tasks.size() == 3);
  for (const auto& b : d->blocks) CHECK(b.placement != lost);
  CHECK_THAT(r->report_json({lost}), Contains("\"refused\": false"));
}

TEST_CASE("a task that does not fit the remaining sites even alone is demoted, then refused; the others stay", "[replan]") {
  // 'big' needs 160 MB over two sites of 100 MB: losing one leaves no room for it at any rate.
  auto in = input({block("A", 100, 80), block("B", 100, 80), block("C", 100, 10)},
                  {{"big", {"A", "B"}, 10, 200}, {"small", {"C"}, 10, 200}}, {site("w1", 1, 100), site("w2", 1, 100)});
  const Plan before = planned(in);
  REQUIRE(verdict(before, "big").admitted);
  auto r = replan(in, before, {site_of(before, "B")});
  INFO(r.status());
  REQUIRE(r.ok());
  REQUIRE(r->changes.size() == 1);
  CHECK(r->changes[0].task == "big");
  CHECK(r->changes[0].refused);
  CHECK(r->changes[0].rate_after == 0);
  CHECK_THAT(r->changes[0].reason, Contains("task 'big': refused after losing site"));
  CHECK_THAT(r->changes[0].reason, Contains("does not fit on the remaining sites even alone"));
  CHECK_THAT(r->changes[0].reason, Contains("MB"));
  REQUIRE(r->plan.tasks.size() == 1);
  CHECK(r->plan.tasks[0].task == "small");
  CHECK(r->plan.tasks[0].admitted);
  auto d = Deployment::parse(r->deployment_json());
  REQUIRE(d.ok());
  REQUIRE(d->tasks.size() == 1);
  CHECK(d->tasks[0].first == "small");
}

TEST_CASE("when no single task's room lets the refused one in, the loosest of all makes room, not the refused one",
          "[replan]") {
  // Four one-lane sites: 'loose' and 'mid' at 0.6 of a lane each, 'tight' a chain of two blocks at 0.8
  // each. Losing both of tight's sites leaves it room only once both others have made room.
  auto in = input({block("L", 100), block("M", 100), block("T1", 100), block("T2", 100)},
                  {{"loose", {"L"}, 60, 5000}, {"mid", {"M"}, 60, 4000}, {"tight", {"T1", "T2"}, 80, 1000}},
                  {site("w1"), site("w2"), site("w3"), site("w4")});
  in.profile.channels = {{"inproc", 0, 0}, {"shm", 0, 0}};  // hand-offs cost no lane here
  const Plan before = planned(in);
  for (const auto& v : before.tasks) REQUIRE(v.admitted);
  REQUIRE(site_of(before, "T1") != site_of(before, "T2"));
  auto r = replan(in, before, {site_of(before, "T1"), site_of(before, "T2")});
  INFO(r.status());
  REQUIRE(r.ok());
  CHECK(change_of(*r, "tight") == nullptr);  // the tightest SLO keeps its rate
  const TaskChange* loose = change_of(*r, "loose");
  REQUIRE(loose != nullptr);
  CHECK(loose->rate_after < 60);
  CHECK_THAT(loose->reason, Contains("no single task's room lets in the others"));
  const TaskChange* mid = change_of(*r, "mid");
  REQUIRE(mid != nullptr);
  CHECK(mid->rate_after < 60);
  CHECK(verdict(r->plan, "tight").admitted);
}

TEST_CASE("a block that stays keeps its max_batch: the re-plan's prediction uses it, and makes room when it must",
          "[replan]") {
  // 'S' stays on its site; at batch 4 it takes twice its batch-1 time (twice the rate per lane). 'X'
  // gains nothing from batching. Losing X's site, the plan fits X next to S by batching S to 4: S
  // cannot change its batch in place, so that plan does not hold.
  auto in = input({block("S", 100, 10, 1024, 2.0), block("X", 100)}, {{"s", {"S"}, 60, 1000}, {"x", {"X"}, 60, 2000}},
                  {site("w1"), site("w2")});
  const Plan before = planned(in);
  REQUIRE(site_of(before, "S") != site_of(before, "X"));
  auto r = replan(in, before, {site_of(before, "X")});
  INFO(r.status());
  REQUIRE(r.ok());
  for (const auto& b : r->plan.blocks) {
    if (b.block != "S") continue;
    for (const auto& d : before.blocks) {
      if (d.block == "S") CHECK(b.max_batch == d.max_batch);  // as deployed
    }
  }
  for (const auto& l : r->plan.sites) CHECK(l.lanes_used <= l.lanes + 1e-9);  // no site over-committed
  // The prediction with S's kept batch refuses the tasks on the over-committed site; 'x', the looser,
  // makes room.
  const TaskChange* x = change_of(*r, "x");
  REQUIRE(x != nullptr);
  CHECK(x->rate_after < 60);
  CHECK(change_of(*r, "s") == nullptr);  // never for a looser task
  for (const auto& v : r->plan.tasks) CHECK(v.admitted);
}

TEST_CASE("a re-plan names a lost site it does not know, and refuses to lose every site", "[replan]") {
  const PlanInput in = three_tasks();
  const Plan before = planned(in);
  CHECK_THAT(std::string(replan(in, before, {"w9"}).status().message()), Contains("lost site 'w9' is not one of the input's sites"));
  CHECK_THAT(std::string(replan(in, before, {"w1", "w2", "w3"}).status().message()), Contains("every site is lost"));
}

namespace {

// The three tasks as C++ blocks of the test plugin ("affine": 3x+1) in three worker processes that
// are not restarted.
PlanInput plugin_tasks() {
  PlanInput in = three_tasks();
  for (auto& b : in.profile.blocks) b.source = "affine";
  return in;
}

WorkerOptions no_restarts() {
  WorkerOptions o = test_worker("");
  o.max_restarts = 0;
  return o;
}

// The plan's deployment of plugin_tasks() in `session`, its workers not restarted; returns the
// worker that runs C (the one the tests lose).
std::string deploy(Session& session, const PlanInput& in, const Plan& plan) {
  auto deployment = Deployment::parse(plan.deployment_json(in));
  REQUIRE(deployment.ok());
  add_deployment(session, *deployment, no_restarts());
  return site_of(plan, "C");
}

std::int64_t pid_of(const Session& session, const std::string& site) {
  for (const auto& s : session.metrics().sites) {
    if (s.name == site) return s.pid;
  }
  return 0;
}

}  // namespace

TEST_CASE("a session re-plans when a worker is lost for good, under traffic: every request resolves", "[replan]") {
  const PlanInput in = plugin_tasks();
  const Plan before = planned(in);
  // Shared with the sink, which stays installed until the end of the test whatever happens.
  struct Warnings {
    std::mutex mu;
    std::vector<std::string> lines;
  };
  auto warnings = std::make_shared<Warnings>();
  set_log_sink([warnings](LogLevel level, std::string_view message) {
    std::lock_guard lock(warnings->mu);
    if (level == LogLevel::kWarning) warnings->lines.emplace_back(message);
  });
  struct Unset {
    ~Unset() { set_log_sink(nullptr); }
  } unset;
  SessionOptions options;
  options.on_site_lost = replanner(in);
  Session session(options);
  const std::string lost = deploy(session, in, before);
  REQUIRE(session.start().ok());
  const std::int64_t pid = pid_of(session, lost);
  REQUIRE(pid > 0);
  const auto affine = [](const Tensor& t) { return t.eq(7.0f).all().item<bool>(); };  // 3 x 2 + 1
  LoadClients mid(session, "mid", at::full({1, 8}, 2.0f), 2, "worker " + lost, affine);
  LoadClients loose(session, "loose", at::full({1, 8}, 2.0f), 1, "worker " + lost, affine);
  REQUIRE(mid.wait_ok(20));
  REQUIRE(::kill(static_cast<pid_t>(pid), SIGKILL) == 0);
  CHECK(eventually([&] { return session.metrics().replan.applied == 1; }, std::chrono::milliseconds(30000)));
  CHECK(mid.wait_ok(20));  // the task is back, on a remaining site
  mid.finish();
  loose.finish();
  // Every request resolved: with its result, or failing with an error that names the lost worker.
  CHECK(mid.resolved == mid.submitted);
  CHECK(mid.other == 0);
  INFO(mid.sample);
  CHECK(loose.other == 0);
  CHECK(loose.named == 0);  // its worker stayed
  const auto m = session.metrics();
  CHECK(m.replan.lost_sites == std::vector<std::string>{lost});
  CHECK(m.replan.failed == 0);
  CHECK(m.replan.last_ms > 0);
  CHECK(m.replan.last_version == m.version);
  for (const auto& b : m.blocks) {
    if (b.name == "C") CHECK(b.placement == site_of(before, "B"));
  }
  for (const auto& s : m.sites) CHECK(s.name != lost);  // stopped once its blocks moved
  std::lock_guard lock(warnings->mu);
  bool demoted = false;
  for (const auto& w : warnings->lines) demoted = demoted || w.find("task 'loose': demoted after losing site '" + lost + "'") != std::string::npos;
  CHECK(demoted);
}

TEST_CASE("without a re-plan function, a lost worker shows in the metrics and the deployment stays; one started again "
          "under its name is not lost, until it is", "[replan]") {
  const PlanInput in = plugin_tasks();
  Session session;
  const std::string lost = deploy(session, in, planned(in));
  REQUIRE(session.start().ok());
  const std::int64_t pid = pid_of(session, lost);
  REQUIRE(pid > 0);
  REQUIRE(::kill(static_cast<pid_t>(pid), SIGKILL) == 0);
  CHECK(eventually([&] { return !session.metrics().replan.lost_sites.empty(); }));
  const auto m = session.metrics();
  CHECK(m.replan.lost_sites == std::vector<std::string>{lost});
  CHECK(m.replan.losses == 1);
  CHECK(m.replan.applied == 0);
  CHECK(m.version == 0);
  bool reported = false;
  for (const auto& s : m.sites) reported = reported || (s.name == lost && s.lost && s.pid == 0);
  CHECK(reported);
  CHECK_THAT(m.to_prometheus(), Contains("blockflow_worker_lost{worker=\"" + lost + "\",kind=\"worker\"} 1"));
  const Result r = session.submit("mid", at::full({1, 8}, 2.0f)).get();
  CHECK_FALSE(r.ok());
  CHECK_THAT(std::string(r.status.message()), Contains("worker " + lost));
  const Result other = session.submit("tight", at::full({1, 8}, 2.0f)).get();
  INFO(other.status);
  REQUIRE(other.ok());
  CHECK(other.output().eq(7.0f).all().item<bool>());

  // An update without the lost site stops it; one that names it again starts a new worker of its
  // name, which is not lost, until it is.
  auto original = Deployment::parse(planned(in).deployment_json(in));
  REQUIRE(original.ok());
  Deployment without = *original;
  without.blocks.erase(std::remove_if(without.blocks.begin(), without.blocks.end(),
                                      [&](const BlockDescription& b) { return b.placement == lost; }),
                       without.blocks.end());
  without.tasks.erase(std::remove_if(without.tasks.begin(), without.tasks.end(),
                                     [](const auto& t) { return t.first == "mid"; }),
                      without.tasks.end());
  auto v1 = session.apply(without);
  INFO(v1.status().ToString());
  REQUIRE(v1.ok());
  for (const auto& s : session.metrics().sites) CHECK(s.name != lost);  // stopped, gone
  auto v2 = session.apply(*original);
  INFO(v2.status().ToString());
  REQUIRE(v2.ok());
  const std::int64_t again = pid_of(session, lost);
  REQUIRE(again > 0);
  CHECK(session.metrics().replan.lost_sites.empty());
  CHECK(session.submit("mid", at::full({1, 8}, 2.0f)).get().ok());
  REQUIRE(::kill(static_cast<pid_t>(again), SIGKILL) == 0);
  CHECK(eventually([&] { return session.metrics().replan.lost_sites == std::vector<std::string>{lost}; }));
  CHECK(session.metrics().replan.losses == 2);
  CHECK_THAT(session.metrics().to_prometheus(), Contains("blockflow_sites_lost_total 2"));
}

TEST_CASE("a re-plan leaves alone a task with no block on the over-committed site, the loosest though it is",
          "[replan]") {
  // T1 (X on wA, the loosest SLO) never shares a site with T2. Losing wC moves Z next to Y on wB,
  // which is over-committed with Y at its deployed batch 1: T2 makes room, T1 stays as it is.
  auto in = input({block("X", 100, 10), block("Y", 100, 20, 1024, 2.0), block("Z", 100, 20)},
                  {{"T1", {"X"}, 50, 1000}, {"T2", {"Y", "Z"}, 60, 500}},
                  {site("wA", 1, 15), site("wB"), site("wC")});
  const Plan before = planned(in);
  REQUIRE(site_of(before, "X") == "wA");
  const std::string lost = site_of(before, "Z");
  REQUIRE(lost != site_of(before, "Y"));
  auto r = replan(in, before, {lost});
  INFO(r.status());
  REQUIRE(r.ok());
  CHECK(change_of(*r, "T1") == nullptr);  // before: demoted three times, then refused
  CHECK(verdict(r->plan, "T1").admitted);
  CHECK(verdict(r->plan, "T1").rate_rps == Approx(50));
}
