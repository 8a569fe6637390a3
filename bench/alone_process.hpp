#pragma once
// The baseline a user would run instead of BlockFlow: one model in a clean process of its own.
//
// The benchmark starts itself again (posix_spawn of /proc/self/exe, never fork: this process has
// initialised libtorch and OpenMP) with `--mode alone`: the child loads the model as a block would
// (same TorchScriptOptions), sets its intra-op threads on its main thread, and then, for each line
// "N" on its stdin, runs N forward passes on its main thread and answers one line of N times in
// milliseconds. Several models, comma-separated, run as a chain (each one's output is the next one's
// input): the split model with no session at all, the floor of what a pipeline of its blocks costs. The parent alternates rounds of its own measurements with rounds of the child's, so
// that noise of the shared machine falls on both alike.

#include <blockflow/blockflow.hpp>
#include <blockflow/core/detail/clock.hpp>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <fmt/format.h>

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

extern char** environ;

namespace blockflow::bench {

/// "a,b,c,d"
inline std::string dims_arg(const std::vector<std::int64_t>& shape) {
  std::string dims;
  for (auto d : shape) dims += (dims.empty() ? "" : ",") + std::to_string(d);
  return dims;
}

/// Starts this benchmark again (`/proc/self/exe ARGS...`) with `in` as its stdin and `out` as its
/// stdout, `extra_env` ("K=V") added to (and overriding) this process's environment. The caller
/// closes its copies of `in` and `out`; every other descriptor of this process must be close-on-exec.
inline pid_t spawn_self(const std::vector<std::string>& args, int in, int out, const std::vector<std::string>& extra_env) {
  std::vector<std::string> all = {"pipeline_bench"};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_store(extra_env);
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    const std::string key = entry.substr(0, entry.find('='));
    const bool overridden = std::any_of(extra_env.begin(), extra_env.end(),
                                        [&](const std::string& x) { return x.substr(0, x.find('=')) == key; });
    if (!overridden) env_store.push_back(entry);
  }
  std::vector<char*> envp;
  for (auto& e : env_store) envp.push_back(e.data());
  envp.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in, STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, out, STDOUT_FILENO);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) throw std::runtime_error(fmt::format("bench: posix_spawn failed ({})", rc));
  return pid;
}

/// The parent's handle on the child. Not thread-safe.
class AloneProcess {
 public:
  /// Starts `/proc/self/exe --mode alone --model FILE[,FILE...] --threads T --shape a,b,c,d --optimize 0|1
  /// --device cpu|cuda`. On cuda each timed pass is what a user's own code does: the host input to
  /// the GPU, the forward, the result back to the host (as the bench's client times a request).
  AloneProcess(const std::string& model, int threads, const std::vector<std::int64_t>& shape, bool optimize,
               const std::string& device = "cpu") {
    int to_child[2], from_child[2];
    if (::pipe2(to_child, O_CLOEXEC) != 0 || ::pipe2(from_child, O_CLOEXEC) != 0) throw std::runtime_error("alone: pipe() failed");
    pid_ = spawn_self({"--mode", "alone", "--model", model, "--threads", std::to_string(threads), "--shape", dims_arg(shape),
                       "--optimize", optimize ? "1" : "0", "--device", device},
                      // On the GPU, scripts/gpu.sh's copy witness (LD_PRELOAD) counts the session's
                      // processes only: the baseline's copies in and out are its own.
                      to_child[0], from_child[1], device == "cuda" ? std::vector<std::string>{"LD_PRELOAD="}
                                                                   : std::vector<std::string>{});
    ::close(to_child[0]);
    ::close(from_child[1]);
    in_ = ::fdopen(to_child[1], "w");
    out_ = ::fdopen(from_child[0], "r");
    if (read_line() != "ready") throw std::runtime_error("alone: the baseline process did not start");
  }
  ~AloneProcess() {
    if (in_ != nullptr) std::fclose(in_);  // EOF: the child exits
    if (out_ != nullptr) std::fclose(out_);
    int status = 0;
    if (pid_ > 0) ::waitpid(pid_, &status, 0);
  }
  AloneProcess(const AloneProcess&) = delete;
  AloneProcess& operator=(const AloneProcess&) = delete;

  /// Runs `n` forward passes in the child; their times in ms.
  std::vector<double> run(int n) {
    std::fprintf(in_, "%d\n", n);
    std::fflush(in_);
    std::istringstream line(read_line());
    std::vector<double> ms;
    for (double v; line >> v;) ms.push_back(v);
    if (static_cast<int>(ms.size()) != n) throw std::runtime_error("alone: short answer from the baseline process");
    return ms;
  }

  /// The child's side: `main` calls this for --mode alone.
  static int serve(const std::string& model, int threads, const std::vector<std::int64_t>& shape, bool optimize,
                   const std::string& device = "cpu") {
    const bool cuda = device == "cuda";
    at::internal::lazy_init_num_threads();
    at::set_num_threads(threads);
    std::vector<std::shared_ptr<Block>> chain;
    for (std::size_t from = 0; from <= model.size();) {
      const std::size_t comma = std::min(model.find(',', from), model.size());
      BlockDescription d;
      d.name = "alone";
      d.torchscript = model.substr(from, comma - from);
      d.torchscript_options.optimize_for_inference = optimize;
      if (cuda) d.options.device = "cuda:0";
      auto block = make_block(d);
      if (!block.ok()) {
        std::cerr << block.status() << "\n";
        return 1;
      }
      chain.push_back(*std::move(block));
      from = comma + 1;
    }
    c10::InferenceMode inference_mode;
    const at::Tensor x = at::randn(shape);
    auto forward = [&] {
      Tensors t{cuda ? x.to(c10::Device("cuda:0")) : x};
      for (auto& block : chain) {
        auto out = block->forward(std::move(t));
        if (!out.ok()) return false;
        t = *std::move(out);
      }
      if (cuda) (void)t.at(0).cpu();  // waits for the GPU, as the client's result does
      return true;
    };
    for (int i = 0; i < 3; ++i) (void)forward();
    std::printf("ready\n");
    std::fflush(stdout);
    for (int n; std::scanf("%d", &n) == 1;) {
      std::string line;
      for (int i = 0; i < n; ++i) {
        const std::int64_t t0 = detail::now_ns();
        if (!forward()) return 1;
        line += fmt::format("{}{:.4f}", i ? " " : "", static_cast<double>(detail::now_ns() - t0) / 1e6);
      }
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    }
    return 0;
  }

 private:
  std::string read_line() {
    std::string line;
    for (int c; (c = std::fgetc(out_)) != EOF && c != '\n';) line.push_back(static_cast<char>(c));
    return line;
  }
  pid_t pid_ = -1;
  std::FILE* in_ = nullptr;
  std::FILE* out_ = nullptr;
};

}  // namespace blockflow::bench
