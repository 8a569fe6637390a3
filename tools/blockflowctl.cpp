// blockflowctl: drives a running session through its control endpoint (ControlEndpoint).
//
//   blockflowctl [--endpoint EP] apply DEPLOYMENT.json    re-deploy under traffic; prints the new version
//   blockflowctl [--endpoint EP] status                   version, tasks, blocks, workers (JSON)
//   blockflowctl [--endpoint EP] metrics [--json|--prometheus]   both by default
//   blockflowctl [--endpoint EP] sampling on|off [--period MS]
//   blockflowctl keygen NAME [--dir DIR]      writes DIR/NAME.key and DIR/NAME.key_secret (CURVE)
//
// EP defaults to $BLOCKFLOW_CONTROL, else tcp://127.0.0.1:5560. An endpoint with CURVE keys
// (ControlOptions::security) takes `--key NAME.key_secret --server-key SESSION.key` (or
// $BLOCKFLOW_KEY and $BLOCKFLOW_SERVER_KEY) before the command. Exit status: 0 when the session
// says ok, 1 when it refuses (its error is printed), 2 for usage errors or no answer.

#include "tool_output.hpp"

#include <blockflow/channel/detail/curve_keys.hpp>
#include <blockflow/core/detail/json_depth.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <zmq.hpp>

#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <vector>

namespace {

constexpr const char* kUsage =
    "usage: blockflowctl [--endpoint EP] [--key FILE.key_secret --server-key FILE.key] "
    "(apply FILE | status | metrics [--json|--prometheus] | sampling on|off [--period MS])\n"
    "   or: blockflowctl keygen NAME [--dir DIR]";

int usage(const std::string& why) {
  std::cerr << "blockflowctl: " << why << "\n" << kUsage << "\n";
  return 2;
}

std::string env_or(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : fallback;
}

int keygen(const std::vector<std::string>& args) {
  std::string dir = ".";
  if (args.size() == 4 && args[2] == "--dir") dir = args[3];
  else if (args.size() != 2) return usage("keygen takes NAME [--dir DIR]");
  char public_key[41], secret_key[41];
  if (zmq_curve_keypair(public_key, secret_key) != 0) {
    std::cerr << "blockflowctl: this libzmq cannot make CURVE keys: " << zmq_strerror(zmq_errno()) << "\n";
    return 1;
  }
  std::string error;
  if (const int e = blockflow::detail::write_key_files(dir, args[1], {public_key, secret_key}, error); e != 0) {
    std::cerr << "blockflowctl: " << error << "\n";
    return e == EINVAL ? 2 : 1;  // a name the rule refuses is a usage error
  }
  std::cout << fmt::format("wrote {0}/{1}.key (public) and {0}/{1}.key_secret (secret, 0600); fingerprint {2}\n", dir,
                           args[1], blockflow::detail::key_fingerprint(public_key));
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  std::vector<std::string> args(argv + 1, argv + argc);
  const char* env = std::getenv("BLOCKFLOW_CONTROL");
  std::string endpoint = env != nullptr && *env != '\0' ? env : "tcp://127.0.0.1:5560";
  std::string key = env_or("BLOCKFLOW_KEY", ""), server_key = env_or("BLOCKFLOW_SERVER_KEY", "");
  while (!args.empty() && (args[0] == "--endpoint" || args[0] == "--key" || args[0] == "--server-key")) {
    if (args.size() < 2) return usage(args[0] + " needs a value");
    (args[0] == "--endpoint" ? endpoint : args[0] == "--key" ? key : server_key) = args[1];
    args.erase(args.begin(), args.begin() + 2);
  }
  if (args.empty()) return usage("no command");
  if (args[0] == "keygen") return keygen(args);
  const std::string cmd = args[0];
  nlohmann::ordered_json request = {{"cmd", cmd}};  // ordered: a deployment's tasks keep the file's order
  std::string format = "both";
  int timeout_ms = 10000;
  if (cmd == "apply") {
    if (args.size() != 2) return usage("apply takes one file");
    std::ifstream in(args[1]);
    if (!in) return usage(fmt::format("cannot read '{}'", args[1]));
    std::stringstream text;
    text << in.rdbuf();
    // Refused here as the session would refuse it (the request around it is one more level):
    // dumping a deeper document recurses once a level.
    if (blockflow::detail::json_nests_deeper(text.str(), 63)) {
      std::cerr << fmt::format("blockflowctl: '{}' nests deeper than 63 levels (64 with the request around it)\n", args[1]);
      return 1;
    }
    request["deployment"] = nlohmann::ordered_json::parse(text.str(), nullptr, false);
    if (request["deployment"].is_discarded()) {
      std::cerr << fmt::format("blockflowctl: '{}' is not valid JSON\n", args[1]);
      return 1;
    }
    timeout_ms = 300000;  // loading and warming up models takes a while
    if (text.str().size() > (std::size_t{1} << 20)) {  // ControlOptions::max_message_bytes' default
      std::cerr << fmt::format("blockflowctl: note: '{}' is {} bytes, over the 1 MiB a control endpoint takes by default "
                               "(ControlOptions::max_message_bytes): one with the default refuses it or drops the connection\n",
                               args[1], text.str().size());
    }
  } else if (cmd == "status") {
    if (args.size() != 1) return usage("status takes no argument");
  } else if (cmd == "metrics") {
    if (args.size() == 2 && (args[1] == "--json" || args[1] == "--prometheus")) format = args[1].substr(2);
    else if (args.size() != 1) return usage("metrics takes --json or --prometheus");
  } else if (cmd == "sampling") {
    if (args.size() < 2 || (args[1] != "on" && args[1] != "off")) return usage("sampling on|off");
    request["enabled"] = args[1] == "on";
    if (args.size() == 4 && args[2] == "--period") {
      int period = 0;
      const auto [end, error] = std::from_chars(args[3].data(), args[3].data() + args[3].size(), period);
      if (error != std::errc() || end != args[3].data() + args[3].size() || period <= 0) {
        return usage(fmt::format("--period takes a whole number of milliseconds above 0, not '{}'", args[3]));
      }
      request["period_ms"] = period;
    } else if (args.size() != 2) {
      return usage("sampling on|off [--period MS]");
    }
  } else {
    return usage(fmt::format("unknown command '{}'", cmd));
  }

  zmq::context_t context(1);
  zmq::socket_t socket(context, zmq::socket_type::req);
  socket.set(zmq::sockopt::linger, 0);
  socket.set(zmq::sockopt::rcvtimeo, timeout_ms);
  socket.set(zmq::sockopt::sndtimeo, 5000);
  if (!key.empty()) {
    std::string error;
    if (!blockflow::detail::configure_curve_client(socket, key, server_key, error)) return usage(error);
  }
  try {
    socket.connect(endpoint);
  } catch (const zmq::error_t& e) {  // a malformed endpoint ("127.0.0.1:5560" without tcp://)
    return usage(fmt::format("cannot connect to '{}': {}", endpoint, e.what()));
  }
  if (!socket.send(zmq::buffer(request.dump()), zmq::send_flags::none)) {
    std::cerr << fmt::format("blockflowctl: cannot send to {}\n", endpoint);
    return 2;
  }
  zmq::message_t message;
  if (!socket.recv(message)) {
    if (cmd == "apply") {  // it may be queued behind other updates: a retry could apply it twice
      std::cerr << fmt::format("blockflowctl: sent to {}, no answer within {} s: the update may still be applied "
                               "(see `blockflowctl status`: its version and \"updating\") before you send it again\n",
                               endpoint, timeout_ms / 1000);
      return 2;
    }
    std::cerr << fmt::format("blockflowctl: no answer from {} within {} s (is a session serving its control endpoint there? one with CURVE keys answers only a --key it admits)\n",
                             endpoint, timeout_ms / 1000);
    return 2;
  }
  const auto reply = nlohmann::json::parse(message.to_string(), nullptr, false);
  if (reply.is_discarded() || !reply.is_object()) {
    std::cerr << "blockflowctl: the answer is not JSON\n";
    return 2;
  }
  // Fields read as what they must be: an answer of another shape is named, not a type_error.
  const auto field = [&](const char* name, nlohmann::json::value_t type) -> const nlohmann::json* {
    const auto it = reply.find(name);
    return it != reply.end() && it->type() == type ? &*it : nullptr;
  };
  const auto* ok = field("ok", nlohmann::json::value_t::boolean);
  if (ok == nullptr || !ok->get<bool>()) {
    const auto* error = field("error", nlohmann::json::value_t::string);
    std::cerr << "blockflowctl: " << (error != nullptr ? error->get<std::string>() : std::string("refused")) << "\n";
    return 1;
  }
  if (cmd == "apply") {
    const auto* version = field("version", nlohmann::json::value_t::number_unsigned);
    if (version == nullptr) {
      std::cerr << "blockflowctl: the answer to apply has no version\n";
      return 2;
    }
    std::cout << fmt::format("applied: version {}\n", version->get<std::uint64_t>());
  } else if (cmd == "status") {
    std::cout << reply.dump(2) << "\n";
  } else if (cmd == "metrics") {
    const auto* metrics = field("metrics", nlohmann::json::value_t::object);
    const auto* prometheus = field("prometheus", nlohmann::json::value_t::string);
    if (metrics == nullptr || prometheus == nullptr) {
      std::cerr << "blockflowctl: the answer to metrics lacks \"metrics\" or \"prometheus\"\n";
      return 2;
    }
    if (format != "prometheus") std::cout << metrics->dump(2) << "\n";
    if (format != "json") std::cout << prometheus->get<std::string>();
  } else {
    std::cout << "ok\n";
  }
  return blockflow::tools::stdout_written("blockflowctl") ? 0 : 1;
} catch (const std::exception& e) {
  std::cerr << "blockflowctl: " << e.what() << "\n";
  return 2;
}
