// KPI sampling and the metrics exports: /proc figures move the right way, the sampler switches on
// and off (in workers too, through the control plane), no GPU is reported as such, the JSON
// snapshot round-trips, and the Prometheus text parses and holds every metric of docs/metrics.md
// with its documented labels.
#include "worker_util.hpp"

#include <blockflow/core/kpi.hpp>
#include <blockflow/observe/metrics_http.hpp>

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

using namespace blockflow;
using Catch::Matchers::Contains;
using Catch::Matchers::StartsWith;
using Catch::Matchers::EndsWith;
using namespace std::chrono_literals;

namespace {

using test::eventually;

struct Documented {
  std::string type;
  std::set<std::string> labels;
  std::string what;
};

// The table of docs/metrics.md: metric -> type, labels.
std::map<std::string, Documented> documented_metrics() {
  std::ifstream in(std::string(BLOCKFLOW_SOURCE_DIR) + "/docs/metrics.md");
  REQUIRE(in.good());
  std::map<std::string, Documented> out;
  const std::regex row(R"(^\| `(blockflow_[a-z_]+)` \| (\w+) \|\s*([a-z_, ]*?)\s*\| (.*) \|$)");
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (!std::regex_match(line, m, row)) continue;
    Documented d{m[2], {}, m[4]};
    std::stringstream labels(m[3]);
    for (std::string label; std::getline(labels, label, ',');) {
      label.erase(0, label.find_first_not_of(' '));
      label.erase(label.find_last_not_of(' ') + 1);
      if (!label.empty()) d.labels.insert(label);
    }
    out[m[1]] = d;
  }
  return out;
}

struct Family {
  std::string type;
  std::vector<std::map<std::string, std::string>> samples;  // labels of each sample
};

// Parses the text exposition format strictly; fails the test on any line that does not fit.
std::map<std::string, Family> parse_prometheus(const std::string& text) {
  std::map<std::string, Family> families;
  const std::regex help(R"(^# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) \S.*$)");
  const std::regex type(R"(^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|summary|histogram|untyped)$)");
  const std::regex sample(R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? ([-+]?([0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?|NaN|[+-]?Inf))$)");
  const std::regex label(R"(([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)\"(,|$))");
  std::istringstream in(text);
  std::string current;
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    INFO(line);
    if (std::regex_match(line, m, help)) continue;
    if (std::regex_match(line, m, type)) {
      REQUIRE(families.count(m[1]) == 0);  // one TYPE per family
      families[m[1]].type = m[2];
      current = m[1];
      continue;
    }
    REQUIRE(std::regex_match(line, m, sample));
    std::string name = m[1];
    for (const char* suffix : {"_sum", "_count"}) {  // a summary's own series
      const std::string s = suffix;
      if (name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0 &&
          families.count(name.substr(0, name.size() - s.size())) != 0 &&
          families[name.substr(0, name.size() - s.size())].type == "summary") {
        name = name.substr(0, name.size() - s.size());
      }
    }
    REQUIRE(name == current);  // samples follow their family's TYPE, families not interleaved
    std::map<std::string, std::string> labels;
    std::string rest = m[3];
    for (std::sregex_iterator it(rest.begin(), rest.end(), label), end; it != end; ++it) labels[(*it)[1]] = (*it)[2];
    families[name].samples.push_back(labels);
  }
  return families;
}

// A session with a block in threads and one in a worker over shared memory, traffic done.
void busy_session(Session& session) {
  auto affine = test::plugin_block("affine", "affine", "w1");
  affine.options.memory_bytes = 1 << 20;  // a profiled block: the site's memory figures are exported
  session.add_site(make_worker(test::test_worker("w1", "shm")))
      .add_block(affine)
      .add_block(test::unary("double", [](const Tensor& x) { return x * 2; }))
      .add_path(Path::chain("t", {"affine", "double"}));
  test::require_started(session);
  for (int i = 0; i < 5; ++i) REQUIRE(session.submit("t", at::ones({4})).get().ok());
}

}  // namespace

TEST_CASE("process figures move the right way: RSS after an allocation, CPU time under load", "[kpi]") {
  const ProcessSample before = sample_process();
  CHECK(before.rss_bytes > 0);
  CHECK(before.threads >= 1);
  std::vector<char> big(256u << 20);
  for (std::size_t i = 0; i < big.size(); i += 4096) big[i] = 1;  // touch every page
  // Busy until the kernel's own clock says this process used 0.2 s of CPU more (a wall-clock spin
  // gets less than that on a loaded machine), so the sampler's figure has something to show.
  auto cpu_now = [] {
    timespec ts{};
    ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) / 1e9;
  };
  volatile double sink = 0;
  const double cpu_until = cpu_now() + 0.2;
  const auto give_up = std::chrono::steady_clock::now() + 60s;
  while (cpu_now() < cpu_until && std::chrono::steady_clock::now() < give_up) sink = sink + 1.0;
  const ProcessSample after = sample_process();
  CHECK(after.rss_bytes - before.rss_bytes > (200 << 20));
  CHECK(after.cpu_seconds - before.cpu_seconds > 0.1);
  CHECK(after.voluntary_context_switches + after.involuntary_context_switches >=
        before.voluntary_context_switches + before.involuntary_context_switches);
  CHECK(big[4096] == 1);
}

TEST_CASE("the sampler runs only while enabled, at its period; no GPU is said, not raised", "[kpi]") {
  KpiSampler sampler;
  CHECK_FALSE(sampler.enabled());
  std::this_thread::sleep_for(100ms);
  CHECK(sampler.samples_taken() == 0);
  CHECK(sampler.latest().time_s == 0);
  sampler.set(true, absl::Milliseconds(20));
  REQUIRE(eventually([&] { return sampler.samples_taken() >= 5; }));
  const KpiSample k = sampler.latest();
  CHECK(k.time_s > 0);
  CHECK(k.process.rss_bytes > 0);
  CHECK(k.process.cpu_utilisation >= 0);
  if (!GpuProbe::instance().available()) {
    CHECK_THAT(k.gpu_status, StartsWith("no GPU"));
    CHECK(k.gpus.empty());
    CHECK(k.energy_j == 0);
  }
  // libtorch's CUDA allocator: figures where this process used a GPU, otherwise a reason.
  std::vector<TorchCudaMemory> direct;
  const std::string torch_status = sample_torch_cuda(direct);
  CHECK(k.torch_cuda_status == torch_status);
  if (torch_status != "ok") {
    CHECK(k.torch_cuda.empty());
    CHECK_FALSE(torch_status.empty());
  }
  sampler.set(false, absl::ZeroDuration());
  std::this_thread::sleep_for(50ms);
  const auto stopped_at = sampler.samples_taken();
  std::this_thread::sleep_for(200ms);
  CHECK(sampler.samples_taken() == stopped_at);
  CHECK(sampler.period() == absl::Milliseconds(20));
}

TEST_CASE("the sampler: a new period takes effect at once; an infinite one samples once, never spins", "[kpi]") {
  KpiSampler slow;
  slow.set(true, absl::Hours(1));
  REQUIRE(eventually([&] { return slow.samples_taken() == 1; }));
  slow.set(true, absl::Milliseconds(10));  // not an hour from now: at once, then every 10 ms
  CHECK(eventually([&] { return slow.samples_taken() >= 5; }));
  KpiSampler forever;
  forever.set(true, absl::InfiniteDuration());
  REQUIRE(eventually([&] { return forever.samples_taken() >= 1; }));
  std::this_thread::sleep_for(300ms);
  CHECK(forever.samples_taken() == 1);
}

TEST_CASE("set_sampling reaches the workers through the control plane, and switches off", "[kpi]") {
  Session session;
  busy_session(session);
  auto m = session.metrics();
  CHECK_FALSE(m.sampling);
  CHECK(m.host.time_s == 0);
  CHECK(m.sites.at(0).kpi.time_s == 0);

  session.set_sampling(true, absl::Milliseconds(50));
  REQUIRE(eventually([&] { return session.metrics().sites.at(0).kpi.time_s > 0; }));
  m = session.metrics();
  CHECK(m.sampling);
  CHECK(m.sampling_period_s == Approx(0.05));
  CHECK(m.host.process.rss_bytes > 0);
  const KpiSample& w = m.sites.at(0).kpi;
  CHECK(w.process.rss_bytes > 100 << 20);  // a worker with libtorch loaded
  CHECK(w.process.threads >= 2);
  CHECK_FALSE(w.gpu_status.empty());

  session.set_sampling(false);
  REQUIRE(eventually([&] { return !session.metrics().sampling && session.metrics().sites.at(0).kpi.time_s == 0; }));
  // The worker really stopped: its next heartbeats carry no sample.
  std::this_thread::sleep_for(300ms);
  CHECK(session.metrics().sites.at(0).kpi.time_s == 0);
}

TEST_CASE("the JSON snapshot round-trips", "[kpi]") {
  Session session;
  busy_session(session);
  session.set_sampling(true, absl::Milliseconds(50));
  REQUIRE(eventually([&] { return session.metrics().sites.at(0).kpi.time_s > 0; }));
  const MetricsSnapshot m = session.metrics();
  const std::string json = m.to_json();
  auto back = MetricsSnapshot::from_json(json);
  REQUIRE(back.ok());
  CHECK(back->to_json() == json);
  CHECK(back->blocks.size() == 2);
  CHECK(back->sites.at(0).shm_requests.handles == m.sites.at(0).shm_requests.handles);
  CHECK(back->sites.at(0).kpi.process.rss_bytes == m.sites.at(0).kpi.process.rss_bytes);
  CHECK_THAT(std::string(MetricsSnapshot::from_json("{not json").status().message()), Contains("not JSON"));
  CHECK_THAT(std::string(MetricsSnapshot::from_json(R"({"blocks": 3})").status().message()), Contains("metrics snapshot"));
}

TEST_CASE("Prometheus text parses and has every documented metric with its labels", "[kpi]") {
  const auto documented = documented_metrics();
  REQUIRE(documented.size() > 40);
  Session session;
  busy_session(session);
  session.set_sampling(true, absl::Milliseconds(50));
  REQUIRE(eventually([&] { return session.metrics().sites.at(0).kpi.time_s > 0; }));
  const std::string text = session.metrics().to_prometheus();
  const auto families = parse_prometheus(text);
  // The metrics documented "on demand only:" come from a session whose blocks load on demand.
  BlockRegistry::global().add("kpi_on_demand", [](const std::string& name, const BlockOptions& options) {
    return Block::callable(name, [](Tensors&& in) -> absl::StatusOr<Tensors> { return Tensors{in.at(0) + 1}; }, options);
  });
  SessionOptions on_demand_options;
  on_demand_options.memory_budget = 1 << 20;
  on_demand_options.memory_policy = SessionOptions::MemoryPolicy::kOnDemand;
  Session on_demand(on_demand_options);
  BlockDescription d;
  d.name = "loaded_on_demand";
  d.factory = "kpi_on_demand";
  d.options.memory_bytes = 1 << 19;
  on_demand.add_block(d).add_path(Path::chain("t", {"loaded_on_demand"}));
  REQUIRE(on_demand.start().ok());
  REQUIRE(on_demand.submit("t", at::zeros({1})).get().ok());
  const std::string on_demand_text = on_demand.metrics().to_prometheus();
  const auto on_demand_families = parse_prometheus(on_demand_text);
  {  // A path with no request yet: its quantiles are NaN (no sample), not 0 s.
    Session idle;
    idle.add_block(test::unary("idle_block", [](const Tensor& x) { return x; })).add_path(Path::chain("idle", {"idle_block"}));
    REQUIRE(idle.start().ok());
    const std::string idle_text = idle.metrics().to_prometheus();
    CHECK_THAT(idle_text, Contains("blockflow_path_latency_seconds{path=\"idle\",quantile=\"0.99\"} NaN\n"));
    CHECK_THAT(idle_text, Contains("blockflow_path_latency_seconds_count{path=\"idle\"} 0\n"));
  }

  const bool gpu = GpuProbe::instance().available();
  std::vector<TorchCudaMemory> torch_cuda;
  const bool torch_gpu = sample_torch_cuda(torch_cuda) == "ok";
  for (const auto& [name, doc] : documented) {
    INFO(name);
    if ((doc.what.rfind("GPU:", 0) == 0 && !gpu) || (doc.what.rfind("torch CUDA:", 0) == 0 && !torch_gpu)) {
      CHECK(families.count(name) == 0);  // absent, not zero, on a machine without a GPU
      continue;
    }
    if (doc.what.rfind("direct edges only:", 0) == 0) {  // worker_test's and direct_edges_test's
      CHECK(families.count(name) == 0);
      continue;
    }
    if (doc.what.rfind("cuda_graph only:", 0) == 0) {  // blocks with BlockOptions::cuda_graph: the [cuda] tests
      CHECK(families.count(name) == 0);
      continue;
    }
    const bool only_on_demand = doc.what.rfind("on demand only:", 0) == 0;
    if (only_on_demand) CHECK(families.count(name) == 0);  // absent where no block loads on demand
    const auto& where = only_on_demand ? on_demand_families : families;
    REQUIRE(where.count(name) == 1);
    CHECK(where.at(name).type == doc.type);
    REQUIRE_FALSE(where.at(name).samples.empty());
    for (const auto& labels : where.at(name).samples) {
      std::set<std::string> keys;
      for (const auto& [k, v] : labels) {
        if (k != "quantile") keys.insert(k);
      }
      CHECK(keys == doc.labels);
    }
  }
  for (const auto* all : {&families, &on_demand_families}) {
    for (const auto& [name, family] : *all) {
      INFO(name);
      CHECK(documented.count(name) == 1);  // nothing undocumented
    }
  }
  // Nor what this session does not write: every metric name the writer has (lib/core/metrics.cpp).
  std::ifstream writer(std::string(BLOCKFLOW_SOURCE_DIR) + "/lib/core/metrics.cpp");
  const std::string source((std::istreambuf_iterator<char>(writer)), std::istreambuf_iterator<char>());
  const std::regex metric_name(R"re("(blockflow_[a-z_]+)")re");
  int written = 0;
  for (std::sregex_iterator it(source.begin(), source.end(), metric_name), end; it != end; ++it, ++written) {
    INFO((*it)[1].str());
    CHECK(documented.count((*it)[1].str()) == 1);
  }
  CHECK(written > 80);
  CHECK_THAT(on_demand_text, Contains("blockflow_block_loads_total{block=\"loaded_on_demand\",placement=\"threads\",device=\"cpu\"} 1\n"));
  // A few values, checked: the worker's edge copied nothing; the host and w1 are sampled.
  CHECK_THAT(text, Contains("blockflow_edge_copied_bytes_total{worker=\"w1\",channel=\"shm\"} 0\n"));
  CHECK_THAT(text, Contains("blockflow_block_processed_total{block=\"affine\",placement=\"w1\",device=\"cpu\"} 5\n"));
  CHECK_THAT(text, Contains("blockflow_gpu_available{process=\"host\"} "));
  CHECK_THAT(text, Contains("blockflow_process_threads{process=\"w1\"} "));
  CHECK_THAT(text, Contains("blockflow_sampling_enabled 1\n"));
}

namespace {

// A raw HTTP/1.1 GET to 127.0.0.1:port; the whole response.
// A TCP connection to the loopback port.
int connect_to(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<std::uint16_t>(port));
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0);
  return fd;
}

std::string http_get(int port, const std::string& target) {
  const int fd = connect_to(port);
  const std::string request = "GET " + target + " HTTP/1.1\r\nHost: localhost\r\n\r\n";
  REQUIRE(::send(fd, request.data(), request.size(), 0) == static_cast<ssize_t>(request.size()));
  std::string response;
  char buffer[4096];
  for (ssize_t n; (n = ::recv(fd, buffer, sizeof buffer, 0)) > 0;) response.append(buffer, static_cast<std::size_t>(n));
  ::close(fd);
  return response;
}

}  // namespace

TEST_CASE("the metrics endpoint serves Prometheus text and JSON on loopback; the textfile is atomic", "[kpi]") {
  Session session;
  busy_session(session);
  MetricsHttpServer server(session, "127.0.0.1:0");
  REQUIRE(server.port() > 0);
  const std::string prom = http_get(server.port(), "/metrics");
  CHECK_THAT(prom, StartsWith("HTTP/1.1 200 OK\r\n"));
  CHECK_THAT(prom, Contains("Content-Type: text/plain; version=0.0.4"));
  const std::string body = prom.substr(prom.find("\r\n\r\n") + 4);
  CHECK_FALSE(parse_prometheus(body).empty());
  CHECK_THAT(body, Contains("blockflow_path_completed_total{path=\"t\"} 5\n"));
  const std::string json = http_get(server.port(), "/metrics.json");
  CHECK_THAT(json, Contains("application/json"));
  CHECK(MetricsSnapshot::from_json(json.substr(json.find("\r\n\r\n") + 4)).ok());
  CHECK_THAT(http_get(server.port(), "/nope"), StartsWith("HTTP/1.1 404"));
  CHECK(server.requests_served() == 3);
  {  // A POST with a body it never reads: 405 naming GET, the whole reply (what the client still
     // sends is read until it closes, not reset under the reply).
    const int fd = connect_to(server.port());
    const std::string post = "POST /metrics HTTP/1.1\r\nHost: localhost\r\nContent-Length: 200000\r\n\r\n" +
                             std::string(200000, 'x');
    std::size_t sent = 0;
    while (sent < post.size()) {
      const ssize_t n = ::send(fd, post.data() + sent, post.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) break;
      sent += static_cast<std::size_t>(n);
    }
    ::shutdown(fd, SHUT_WR);
    std::string response;
    char buffer[4096];
    for (ssize_t n; (n = ::recv(fd, buffer, sizeof buffer, 0)) > 0;) response.append(buffer, static_cast<std::size_t>(n));
    ::close(fd);
    CHECK_THAT(response, StartsWith("HTTP/1.1 405"));
    CHECK_THAT(response, Contains("\r\nAllow: GET\r\n"));
    CHECK_THAT(response, EndsWith("only GET\n"));
  }
  CHECK(server.requests_served() == 4);
  CHECK_THROWS_WITH(MetricsHttpServer(session, "localhost:1"), Contains("'localhost' is not an IPv4 address"));
  for (const std::string port : {"70000", "-1", "", "8o", "123456"}) {  // never wrapped to another port
    CHECK_THROWS_WITH(MetricsHttpServer(session, "127.0.0.1:" + port), Contains("bad port (0-65535)"));
  }

  const std::string file = "/tmp/blockflow-kpi-test-" + std::to_string(::getpid()) + ".prom";
  REQUIRE(write_prometheus_file(session.metrics(), file).ok());
  std::ifstream in(file);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(parse_prometheus(text).count("blockflow_block_processed_total") == 1);
  std::remove(file.c_str());
  CHECK_FALSE(write_prometheus_file(session.metrics(), "/nonexistent-dir/x.prom").ok());
}

TEST_CASE("textfile writers in parallel each replace the file whole, and leave no temporary behind", "[kpi]") {
  Session session;
  busy_session(session);
  const MetricsSnapshot snapshot = session.metrics();
  const std::string expected = snapshot.to_prometheus();
  char dir_template[] = "/tmp/blockflow-textfile-XXXXXX";
  REQUIRE(::mkdtemp(dir_template) != nullptr);
  const std::string dir = dir_template;
  const std::string file = dir + "/blockflow.prom";
  std::atomic<int> failed{0};
  auto write_many = [&] {
    for (int i = 0; i < 200; ++i) failed += write_prometheus_file(snapshot, file).ok() ? 0 : 1;
  };
  std::thread a(write_many), b(write_many);
  a.join();
  b.join();
  CHECK(failed.load() == 0);
  std::ifstream in(file);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(text == expected);
  struct stat st {};
  REQUIRE(::stat(file.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0644);
  std::vector<std::string> left;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) left.push_back(entry.path().filename().string());
  CHECK(left == std::vector<std::string>{"blockflow.prom"});
  std::filesystem::remove_all(dir);
}

TEST_CASE("a slow metrics client holds no scrape back; it is closed at its deadline", "[kpi]") {
  Session session;
  busy_session(session);
  MetricsHttpServer server(session, "127.0.0.1:0");
  const int slow = connect_to(server.port());
  REQUIRE(::send(slow, "G", 1, 0) == 1);  // and nothing more: the attack sends a byte every 1.5 s
  const std::string scraped = http_get(server.port(), "/metrics");
  CHECK_THAT(scraped, StartsWith("HTTP/1.1 200 OK\r\n"));
  // Served while the slow one was still open (one connection at a time closed it first).
  char byte = 0;
  CHECK(::recv(slow, &byte, 1, MSG_DONTWAIT) == -1);
  CHECK(errno == EAGAIN);
  // At its deadline the server gives up on it: end of stream, no reply.
  pollfd p{slow, POLLIN, 0};
  REQUIRE(::poll(&p, 1, 30000) == 1);
  CHECK(::recv(slow, &byte, 1, 0) == 0);
  ::close(slow);
  CHECK(server.requests_served() == 1);
}

TEST_CASE("64 idle metrics clients keep no scraper out: the one waiting longest for its request makes room", "[kpi]") {
  Session session;
  busy_session(session);
  MetricsHttpServer server(session, "127.0.0.1:0");
  std::vector<int> idle;
  for (int i = 0; i < 64; ++i) idle.push_back(connect_to(server.port()));
  // Each accepted in turn (a byte answered by nothing shows it is open at the server).
  const std::string scraped = http_get(server.port(), "/metrics");
  CHECK_THAT(scraped, StartsWith("HTTP/1.1 200 OK\r\n"));
  // The first idle one was closed for it; the last one is still open (their 2 s are not up).
  pollfd first{idle.front(), POLLIN, 0};
  REQUIRE(::poll(&first, 1, 30000) == 1);
  char byte = 0;
  CHECK(::recv(idle.front(), &byte, 1, 0) == 0);
  CHECK(::recv(idle.back(), &byte, 1, MSG_DONTWAIT) == -1);
  CHECK(errno == EAGAIN);
  for (const int fd : idle) ::close(fd);
  CHECK(server.requests_served() == 1);
}

TEST_CASE("names that are not UTF-8 (C++ API) reach metrics as U+FFFD: the JSON is served, Prometheus text is valid",
          "[kpi]") {
  Session session;
  session.add_block(test::unary("caf\xe9", [](const Tensor& x) { return x + 1; }))
      .add_path(Path::chain("t\xff", {"caf\xe9"}));
  test::require_started(session);
  REQUIRE(session.submit("t\xff", at::ones({2})).get().ok());
  MetricsHttpServer server(session, "127.0.0.1:0");
  const std::string json = http_get(server.port(), "/metrics.json");
  REQUIRE_THAT(json, StartsWith("HTTP/1.1 200 OK\r\n"));
  auto back = MetricsSnapshot::from_json(json.substr(json.find("\r\n\r\n") + 4));
  REQUIRE(back.ok());
  REQUIRE(back->blocks.size() == 1);
  CHECK(back->blocks[0].name == "caf\xEF\xBF\xBD");
  const std::string prom = http_get(server.port(), "/metrics");
  CHECK_THAT(prom, Contains("blockflow_path_completed_total{path=\"t\xEF\xBF\xBD\"} 1\n"));
  CHECK(prom.find("\xe9\"") == std::string::npos);
}
