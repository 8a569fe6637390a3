// A small BlockFlow server for remote clients in any language (see examples/python_client.py and
// docs/wire-format.md).
//
//   serve [--endpoint EP] [--metrics HOST:PORT] [--sampling MS] [--control EP] [--models DIR] [--empty]
//         [--no-stdin] [--max-in-flight-per-task N]
//         [--key SERVER.key_secret --authorized-keys DIR [--control-authorized-keys DIR] | --insecure]
//
// EP defaults to tcp://127.0.0.1:5555; "tcp://127.0.0.1:*" picks a free port. The server prints
// exactly one line to stdout, `serving on <endpoint>` (the port resolved), then serves until
// SIGINT/SIGTERM or until its stdin reaches EOF, so a driver can stop it by closing the pipe it
// writes to. With --no-stdin only a signal stops it: use that when stdin is /dev/null (e.g.
// `serve &` in a non-interactive shell). Everything else it says goes to stderr.
//
// --metrics serves the session's metrics over HTTP (GET /metrics: Prometheus text, /metrics.json),
// on loopback unless HOST says otherwise; --sampling MS switches KPI sampling on at that period;
// --control EP serves the control endpoint that blockflowctl talks to (apply, status, metrics);
// the deployments it applies take their TorchScript files from --models DIR (default: the current
// directory; files outside it are refused), and a placement they name starts a worker process.
// --max-in-flight-per-task N lets at most N requests of each task into the session's blocks at
// once; the others wait at the task's entry, in order (SessionOptions::max_in_flight_per_task, default
// 0: no window; docs/lanes.md, "Entry window"): what bounds the memory a burst of clients can make the
// blocks hold.
// --empty starts without the tasks below: a session for `blockflowctl apply` to fill (a deployment
// replaces every block, and these C++ ones could not be described in it).
// --key and --authorized-keys put both endpoints behind CURVE (keys from `blockflowctl keygen`; a
// client is admitted when its public key is in DIR); without them a TCP address other than the
// loopback is refused, unless --insecure (docs/security.md). The control endpoint reconfigures the
// server (it applies deployments, starts workers), so with --key and --control it admits only the
// keys of --control-authorized-keys DIR: a key allowed to submit requests is not thereby allowed to
// reconfigure (name the same directory to allow every client both).
//
// Tasks, each one C++ callable block:
//   affine  x -> 3*x + 1 (one floating-point tensor)
//   sum2    (a, b) -> a + b (two tensors in one message)
//   fails   always fails with FailedPrecondition naming a cause, to show what clients see
//
//   ./serve --endpoint tcp://127.0.0.1:5555 --no-stdin &
//   python3 examples/python_client.py tcp://127.0.0.1:5555
//
//   blockflowctl keygen server --dir keys; blockflowctl keygen alice --dir keys
//   mkdir keys/clients && cp keys/alice.key keys/clients/
//   ./serve --endpoint tcp://10.0.0.1:5555 --key keys/server.key_secret --authorized-keys keys/clients --no-stdin &
//   python3 examples/python_client.py tcp://10.0.0.1:5555 --key keys/alice.key_secret --server-key keys/server.key

#include <blockflow/blockflow.hpp>
#include <blockflow/serve/control_endpoint.hpp>
#include <blockflow/observe/metrics_http.hpp>
#include <blockflow/serve/client_endpoint.hpp>
#include <blockflow/worker/worker_site.hpp>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <iostream>
#include <optional>
#include <string>

namespace bf = blockflow;

namespace {

// Error messages need not name the block: the session prefixes "block '<name>': ".
absl::Status expect_inputs(const bf::Tensors& in, std::size_t count) {
  if (in.size() != count) {
    return absl::InvalidArgumentError(fmt::format("expected {} input tensor(s), got {}", count, in.size()));
  }
  return absl::OkStatus();
}

void add_blocks(bf::Session& session) {
  session.add_block(bf::Block::callable("affine", [](bf::Tensors&& in) -> absl::StatusOr<bf::Tensors> {
    if (auto status = expect_inputs(in, 1); !status.ok()) return status;
    if (!at::isFloatingType(in[0].scalar_type())) {
      return absl::InvalidArgumentError(
          fmt::format("expected a floating-point tensor, got {}", std::string(c10::toString(in[0].scalar_type()))));
    }
    return bf::Tensors{in[0] * 3 + 1};
  }));
  session.add_block(bf::Block::callable("sum2", [](bf::Tensors&& in) -> absl::StatusOr<bf::Tensors> {
    if (auto status = expect_inputs(in, 2); !status.ok()) return status;
    if (in[0].sizes() != in[1].sizes()) {
      return absl::InvalidArgumentError(fmt::format("shapes differ: [{}] vs [{}]", fmt::join(in[0].sizes(), ", "),
                                                    fmt::join(in[1].sizes(), ", ")));
    }
    return bf::Tensors{in[0] + in[1]};
  }));
  session.add_block(bf::Block::callable("fails", [](bf::Tensors&&) -> absl::StatusOr<bf::Tensors> {
    return absl::FailedPreconditionError("calibration table not loaded (this demo block always fails)");
  }));
  session.add_path(bf::Path::chain("affine", {"affine"}))
      .add_path(bf::Path::chain("sum2", {"sum2"}))
      .add_path(bf::Path::chain("fails", {"fails"}));
}

// Blocks until SIGINT/SIGTERM arrives (read from `signal_fd`) or, when `watch_stdin`, stdin hits
// EOF or an error. Returns what stopped it.
std::string wait_for_stop(int signal_fd, bool watch_stdin) {
  pollfd fds[2] = {{signal_fd, POLLIN, 0}, {STDIN_FILENO, POLLIN, 0}};
  const nfds_t count = watch_stdin ? 2 : 1;
  while (true) {
    if (::poll(fds, count, -1) < 0) {
      if (errno == EINTR) continue;
      return fmt::format("poll failed: {}", std::strerror(errno));
    }
    if ((fds[0].revents & POLLIN) != 0) {
      signalfd_siginfo info{};
      if (::read(signal_fd, &info, sizeof info) == static_cast<ssize_t>(sizeof info)) {
        return fmt::format("signal {}", strsignal(static_cast<int>(info.ssi_signo)));
      }
      return "signal";
    }
    if (count == 2 && fds[1].revents != 0) {
      char buffer[4096];  // whatever is written to stdin is read and ignored; only EOF matters
      const ssize_t n = ::read(STDIN_FILENO, buffer, sizeof buffer);
      if (n == 0) return "stdin closed";
      if (n < 0 && errno != EINTR && errno != EAGAIN) return fmt::format("stdin: {}", std::strerror(errno));
    }
  }
}

// `text` as a whole number from 0 into `out`; false, said on stderr naming the flag, when it is not one.
bool whole_number(const char* flag, const std::string& text, int& out) {
  int value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size() || value < 0) {
    std::cerr << "serve: " << flag << " takes a whole number from 0, not '" << text << "'\n";
    return false;
  }
  out = value;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::string endpoint = "tcp://127.0.0.1:5555";
  bool watch_stdin = true;
  std::string metrics_address, control_address, models_dir = ".";
  bool examples = true;
  int sampling_ms = 0;
  bf::ServerSecurity security;
  std::string control_keys_dir;  // the control endpoint's own allow-list
  bf::SessionOptions session_options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--endpoint" && i + 1 < argc) {
      endpoint = argv[++i];
    } else if (arg == "--metrics" && i + 1 < argc) {
      metrics_address = argv[++i];
    } else if (arg == "--control" && i + 1 < argc) {
      control_address = argv[++i];
    } else if (arg == "--empty") {
      examples = false;
    } else if (arg == "--models" && i + 1 < argc) {
      models_dir = argv[++i];
    } else if (arg == "--sampling" && i + 1 < argc) {
      if (!whole_number("--sampling", argv[++i], sampling_ms)) return 2;
    } else if (arg == "--no-stdin") {
      watch_stdin = false;
    } else if (arg == "--max-in-flight-per-task" && i + 1 < argc) {
      if (!whole_number("--max-in-flight-per-task", argv[++i], session_options.max_in_flight_per_task)) return 2;
    } else if (arg == "--key" && i + 1 < argc) {
      security.secret_key_file = argv[++i];
    } else if (arg == "--authorized-keys" && i + 1 < argc) {
      security.authorized_keys_dir = argv[++i];
    } else if (arg == "--control-authorized-keys" && i + 1 < argc) {
      control_keys_dir = argv[++i];
    } else if (arg == "--insecure") {
      security.insecure = true;
    } else {
      std::cerr << "usage: serve [--endpoint tcp://127.0.0.1:5555] [--metrics 127.0.0.1:9464] [--sampling MS] "
                   "[--control tcp://127.0.0.1:5560] [--models DIR] [--empty] [--no-stdin] [--max-in-flight-per-task N] "
                   "[--key SERVER.key_secret --authorized-keys DIR [--control-authorized-keys DIR] | --insecure]\n";
      return arg == "--help" || arg == "-h" ? 0 : 2;
    }
  }
  if (!control_address.empty() && security.curve() && control_keys_dir.empty()) {
    std::cerr << "serve: --control with --key needs --control-authorized-keys DIR: the keys that may reconfigure the "
                 "server (apply deployments, start workers), which --authorized-keys (the keys that may submit "
                 "requests) does not grant; name the same directory to allow every client both\n";
    return 2;
  }
  if (!control_keys_dir.empty() && !security.curve()) {
    std::cerr << "serve: --control-authorized-keys needs --key and --authorized-keys\n";
    return 2;
  }

  // Block the stop signals before any thread starts (threads inherit the mask), then read them
  // from a signalfd in the main thread: no async handler, no race with the session's threads.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  if (pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr) != 0) {
    std::cerr << "serve: pthread_sigmask failed\n";
    return 1;
  }
  const int signal_fd = ::signalfd(-1, &stop_signals, SFD_CLOEXEC);
  if (signal_fd < 0) {
    std::cerr << "serve: signalfd failed: " << std::strerror(errno) << "\n";
    return 1;
  }

  bf::Session session(session_options);
  if (examples) add_blocks(session);
  // Deployments applied through the control endpoint may place blocks in worker processes: each
  // placement they name starts one (and one left without blocks stops), with the deployment's
  // settings for it ("sites": memory budget and policy, lanes).
  session.set_site_factory([](const bf::SiteSettings& settings) {
    return bf::make_worker(bf::worker_options_for({}, settings));
  });
  if (auto status = session.start(); !status.ok()) {
    std::cerr << "serve: " << status << "\n";
    return 1;
  }

  if (sampling_ms > 0) session.set_sampling(true, absl::Milliseconds(sampling_ms));
  std::optional<bf::ClientEndpoint> server;
  std::optional<bf::MetricsHttpServer> metrics;
  std::optional<bf::ControlEndpoint> control;
  try {
    bf::ClientEndpointOptions client_options;
    client_options.security = security;
    server.emplace(session, endpoint, client_options);
    if (!control_address.empty()) {
      bf::ControlOptions control_options;
      control_options.security = security;
      if (security.curve()) control_options.security.authorized_keys_dir = control_keys_dir;
      control_options.models_dir = models_dir;
      control.emplace(session, control_address, control_options);
      std::cerr << "serve: control endpoint on " << control->endpoint() << "\n";
    }
    if (!metrics_address.empty()) {
      metrics.emplace(session, metrics_address);
      std::cerr << "serve: metrics on http://" << metrics_address.substr(0, metrics_address.rfind(':')) << ":"
                << metrics->port() << "/metrics\n";
    }
  } catch (const std::exception& e) {
    std::cerr << "serve: " << e.what() << "\n";
    session.shutdown();
    return 1;
  }
  std::cout << "serving on " << server->endpoint() << std::endl;  // the one stdout line; flushed

  const std::string reason = wait_for_stop(signal_fd, watch_stdin);
  // The endpoint drains first: new requests are refused (Unavailable) while those in flight are
  // answered, for up to 5 s; the session then drains whatever is left (replies to those are dropped:
  // the endpoint no longer sends).
  server->drain(absl::Seconds(5));
  metrics.reset();
  control.reset();
  session.shutdown();
  std::cerr << fmt::format("serve: stopped ({}); {} replies sent, {} malformed frames, {} peers refused\n", reason,
                           server->served(), server->malformed_frames(), server->auth_failures());
  server.reset();
  ::close(signal_fd);
  return 0;
}
