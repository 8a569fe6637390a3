// The control endpoint while an update runs: status and metrics are answered meanwhile, the apply
// is answered once it is done, and destroying the endpoint cancels the update instead of waiting.
#include "gate_site.hpp"
#include "test_util.hpp"

#include <blockflow/serve/control_endpoint.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <future>

using namespace blockflow;
using Catch::Matchers::Contains;
using namespace std::chrono_literals;

namespace {


const std::string kApplyThroughGate = std::string(R"({"cmd": "apply", "deployment": )") + test::kThroughGate + "}";

// A REQ client of the endpoint.
struct Client {
  zmq::context_t context{1};
  zmq::socket_t socket{context, zmq::socket_type::req};
  explicit Client(const std::string& endpoint) {
    socket.set(zmq::sockopt::linger, 0);
    socket.connect(endpoint);
  }
  void send(const std::string& text) { REQUIRE(socket.send(zmq::buffer(text), zmq::send_flags::none)); }
  // The reply, or null if none came within `within`.
  nlohmann::json receive(std::chrono::milliseconds within) {
    zmq::pollitem_t item{socket.handle(), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, within) == 0) return nullptr;
    zmq::message_t reply;
    REQUIRE(socket.recv(reply));
    return nlohmann::json::parse(reply.to_string());
  }
};

}  // namespace

TEST_CASE("control: status and metrics are answered while an apply runs; the apply when it is done", "[control]") {
  Session session;
  auto gate = test::start_with_gate(session);
  ControlEndpoint endpoint(session, "tcp://127.0.0.1:*");
  Client updater(endpoint.endpoint()), watcher(endpoint.endpoint());
  updater.send(kApplyThroughGate);
  REQUIRE(gate->wait_until_updating());
  watcher.send(R"({"cmd": "status"})");
  const auto status = watcher.receive(30s);  // a REP endpoint answered nothing until the update ended
  REQUIRE_FALSE(status.is_null());
  CHECK(status["ok"] == true);
  CHECK(status["updating"] == true);
  CHECK(status["version"] == 0);
  watcher.send(R"({"cmd": "metrics"})");
  const auto metrics = watcher.receive(30s);
  REQUIRE_FALSE(metrics.is_null());
  CHECK(metrics["ok"] == true);
  CHECK(updater.receive(0ms).is_null());  // still running
  gate->open();
  const auto applied = updater.receive(30s);
  REQUIRE_FALSE(applied.is_null());
  INFO(applied.dump());
  CHECK(applied["ok"] == true);
  CHECK(applied["version"] == 1);
  watcher.send(R"({"cmd": "status"})");
  const auto after = watcher.receive(30s);
  REQUIRE_FALSE(after.is_null());
  CHECK(after["updating"] == false);
  CHECK(after["tasks"].size() == 2);
}

TEST_CASE("control: destroying the endpoint cancels the apply in progress instead of waiting for it", "[control]") {
  Session session;
  auto gate = test::start_with_gate(session);
  auto endpoint = std::make_unique<ControlEndpoint>(session, "tcp://127.0.0.1:*");
  Client updater(endpoint->endpoint());
  updater.send(kApplyThroughGate);
  REQUIRE(gate->wait_until_updating());
  auto destroyed = std::async(std::launch::async, [&] { endpoint.reset(); });
  REQUIRE(destroyed.wait_for(30s) == std::future_status::ready);  // the gate would hold it 60 s
  CHECK(session.metrics().version == 0);                           // cancelled: nothing changed
  CHECK(session.submit("t", at::zeros({1})).get().output().item<double>() == 1);
}

TEST_CASE("control: destroying the endpoint leaves the application's own apply() alone", "[control]") {
  // Before, its cancel loop cancelled whichever apply() was in progress: the application's, which
  // its queued apply waited behind.
  Session session;
  auto gate = test::start_with_gate(session);
  const Deployment through_gate = test::parse(test::kThroughGate);
  auto own = std::async(std::launch::async, [&] { return session.apply(through_gate); });
  REQUIRE(gate->wait_until_updating());
  auto endpoint = std::make_unique<ControlEndpoint>(session, "tcp://127.0.0.1:*");
  Client updater(endpoint->endpoint()), watcher(endpoint->endpoint());
  updater.send(kApplyThroughGate);
  const auto give_up = std::chrono::steady_clock::now() + 60s;
  for (bool waiting = false; !waiting;) {  // the endpoint's apply waits behind the application's
    REQUIRE(std::chrono::steady_clock::now() < give_up);
    watcher.send(R"({"cmd": "status"})");
    const auto status = watcher.receive(30s);
    REQUIRE_FALSE(status.is_null());
    waiting = status["updating"] == true;
  }
  auto destroyed = std::async(std::launch::async, [&] { endpoint.reset(); });
  // Its cancel loop runs meanwhile (every 2 ms, once its serving thread has stopped, within 100
  // ms): the application's apply() must still be waiting at the gate after it.
  CHECK(own.wait_for(1s) == std::future_status::timeout);
  gate->open();
  REQUIRE(own.wait_for(30s) == std::future_status::ready);
  const auto version = own.get();
  INFO(version.status().ToString());
  CHECK(version.ok());
  REQUIRE(destroyed.wait_for(30s) == std::future_status::ready);
  CHECK(session.metrics().version >= 1);
}

TEST_CASE("control: limits on what one request may ask, each refusal naming its limit", "[control]") {
  Session session;
  auto gate = test::start_with_gate(session);
  ControlOptions options;
  options.models_dir = BLOCKFLOW_TEST_MODELS_DIR;
  options.max_message_bytes = 4096;
  options.max_workers = 2;
  ControlEndpoint endpoint(session, "tcp://127.0.0.1:*", options);
  Client client(endpoint.endpoint());
  auto ask = [&](const std::string& text) {
    client.send(text);
    auto reply = client.receive(30s);
    REQUIRE_FALSE(reply.is_null());
    CHECK(reply["ok"] == false);
    return reply["error"].get<std::string>();
  };
  CHECK_THAT(ask(std::string(70, '[') + std::string(70, ']')), Contains("JSON nests deeper than 64 levels"));
  CHECK_THAT(ask(R"({"cmd": "status", "pad": ")" + std::string(5000, 'x') + "\"}"),
             Contains("over the limit of 4096 (ControlOptions::max_message_bytes)"));
  CHECK_THAT(ask(R"({"cmd": "apply", "deployment": {"blocks": [{"name": "a", "factory": "upd_add_1", "placement": "w1"},
              {"name": "b", "factory": "upd_add_1", "placement": "w2"}, {"name": "c", "factory": "upd_add_1", "placement": "w3"}],
              "tasks": {"t": ["a", "b", "c"]}}})"),
             Contains("names 3 worker placements, over the limit of 2 (ControlOptions::max_workers)"));
  CHECK_THAT(ask(R"({"cmd": "apply", "deployment": {"blocks": [{"name": "p", "torchscript": "/etc/passwd"}], "tasks": {"t": ["p"]}}})"),
             Contains("block 'p': TorchScript path '/etc/passwd' is not inside the models directory"));
  CHECK_THAT(ask(R"({"cmd": "apply", "deployment": {"blocks": [{"name": "a", "factory": "upd_add_1", "placement": "../w"}],
              "tasks": {"t": ["a"]}}})"),
             Contains("placement name '../w' starts with . or -"));
  std::string tasks;
  for (int i = 0; i < 129; ++i) tasks += fmt::format(R"({}"t{}": ["a"])", i > 0 ? "," : "", i);
  CHECK_THAT(ask(R"({"cmd": "apply", "deployment": {"blocks": [{"name": "a", "factory": "upd_add_1"}], "tasks": {)" + tasks + "}}}"),
             Contains("has 129 tasks, over the limit of 128 (ControlOptions::max_tasks)"));
  for (const char* period : {R"("100")", "4294967297", "0", "0.5", "true"}) {
    CHECK_THAT(ask(fmt::format(R"({{"cmd": "sampling", "enabled": true, "period_ms": {}}})", period)),
               Contains("sampling's \"period_ms\" must be a whole number of milliseconds from 1 to 3600000"));
  }
  CHECK(session.metrics().version == 0);
}

TEST_CASE("control: a message of more frames than a request has is dropped unanswered; the next is answered", "[control]") {
  Session session;
  (void)test::start_with_gate(session);
  ControlEndpoint endpoint(session, "tcp://127.0.0.1:*", ControlOptions{});
  zmq::context_t context{1};
  zmq::socket_t dealer{context, zmq::socket_type::dealer};
  dealer.set(zmq::sockopt::linger, 0);
  dealer.connect(endpoint.endpoint());
  // 100 empty routing frames (a few bytes in all, but each held, and each sent back in a reply).
  for (int i = 0; i < 100; ++i) REQUIRE(dealer.send(zmq::message_t(), zmq::send_flags::sndmore));
  REQUIRE(dealer.send(zmq::message_t(), zmq::send_flags::sndmore));
  REQUIRE(dealer.send(zmq::buffer(std::string(R"({"cmd": "too-many-frames"})")), zmq::send_flags::none));
  REQUIRE(dealer.send(zmq::message_t(), zmq::send_flags::sndmore));
  REQUIRE(dealer.send(zmq::buffer(std::string(R"({"cmd": "status"})")), zmq::send_flags::none));
  // The first reply to come is the status's: the other got none.
  zmq::pollitem_t item{dealer.handle(), 0, ZMQ_POLLIN, 0};
  REQUIRE(zmq::poll(&item, 1, std::chrono::milliseconds(30000)) == 1);
  std::vector<zmq::message_t> reply;
  REQUIRE(zmq::recv_multipart(dealer, std::back_inserter(reply)));
  REQUIRE(reply.size() == 2);  // the delimiter, the reply
  CHECK(reply[0].size() == 0);
  const auto answer = nlohmann::json::parse(reply[1].to_string());
  CHECK(answer.value("ok", false));
  CHECK(answer.dump().find("too-many-frames") == std::string::npos);
  CHECK(endpoint.requests_served() == 1);
}
