#pragma once
// The floor under any pipeline that runs one block per process (workers mode): the four blocks in
// four clean processes of their own, run one after the other with nothing moved between them. Each
// stage process (`/proc/self/exe --mode stage`) loads its block as a worker would, makes a random
// input of the block's input shape once, and for each byte on its stdin runs one forward pass on its
// main thread and writes one byte to its stdout, which is the next stage's stdin. The parent times a
// byte from the first stage's stdin to the last stage's stdout. What is left is the cost of running
// the blocks in four processes in turn (scheduler wake-ups, each process's OpenMP team waking after
// the others ran, caches and TLBs shared with the other processes), which no channel can remove;
// moving the tensors is the channels' cost, measured by the hop bench. The stages get the environment
// the session's workers get (WorkerOptions::environment), so that both run under the same settings.
// With `serialized`, the floor of a serialized channel instead: the stages are joined by Unix stream
// sockets (socketpair, as under zmq's ipc://) and each request's tensors cross them as raw bytes (an
// 8-byte length, then the bytes): the parent writes the input, each stage reads its input straight
// into its input tensor, runs its block on it and writes its output's bytes to the next, and the
// parent reads the last one. That is the kernel's two copies per edge and nothing else: no framing,
// no header, no extra thread.

#include "alone_process.hpp"

#include <sys/socket.h>

namespace blockflow::bench {

class ProcessChain {
 public:
  struct Stage {
    std::string model;
    std::vector<std::int64_t> input_shape;
  };

  /// Starts one process per stage and passes one byte through the chain (each stage has loaded and
  /// warmed its block when it returns).
  ProcessChain(const std::vector<Stage>& stages, int threads, bool optimize, const std::vector<std::string>& env,
               bool serialized = false)
      : serialized_(serialized) {
    // pipe: [0] reads, [1] writes; a socketpair's two ends do both, used the same way.
    auto join = [&](int fds[2]) {
      const int rc = serialized ? ::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) : ::pipe2(fds, O_CLOEXEC);
      if (rc != 0) throw std::runtime_error("chain: pipe() or socketpair() failed");
    };
    if (serialized) input_ = at::randn(stages.at(0).input_shape);
    int first[2];
    join(first);
    in_ = first[1];
    int read_end = first[0];
    for (const Stage& stage : stages) {
      int next[2];
      join(next);
      pids_.push_back(spawn_self({"--mode", "stage", "--model", stage.model, "--threads", std::to_string(threads), "--shape",
                                  dims_arg(stage.input_shape), "--optimize", optimize ? "1" : "0", "--serialized",
                                  serialized ? "1" : "0"},
                                 read_end, next[1], env));
      ::close(read_end);
      ::close(next[1]);
      read_end = next[0];
    }
    out_ = read_end;
    (void)run(1);
  }
  ~ProcessChain() {
    ::close(in_);  // EOF: the first stage exits, its stdout closes, and so on down the chain
    ::close(out_);
    for (pid_t pid : pids_) {
      int status = 0;
      ::waitpid(pid, &status, 0);
    }
  }
  ProcessChain(const ProcessChain&) = delete;
  ProcessChain& operator=(const ProcessChain&) = delete;

  /// Passes `n` bytes through the chain one at a time; each one's time in ms.
  std::vector<double> run(int n) {
    std::vector<double> ms;
    for (int i = 0; i < n; ++i) {
      const std::int64_t t0 = detail::now_ns();
      if (serialized_) {
        if (!write_tensor(in_, input_) || !read_bytes(out_, output_)) throw std::runtime_error("chain: a stage died");
        ms.push_back(static_cast<double>(detail::now_ns() - t0) / 1e6);
        continue;
      }
      char byte = 1;
      if (::write(in_, &byte, 1) != 1 || ::read(out_, &byte, 1) != 1) throw std::runtime_error("chain: a stage died");
      ms.push_back(static_cast<double>(detail::now_ns() - t0) / 1e6);
    }
    return ms;
  }

  /// The stage's side: `main` calls this for --mode stage.
  static int serve(const std::string& model, int threads, const std::vector<std::int64_t>& shape, bool optimize,
                   bool serialized) {
    at::internal::lazy_init_num_threads();
    at::set_num_threads(threads);
    BlockDescription d;
    d.name = "stage";
    d.torchscript = model;
    d.torchscript_options.optimize_for_inference = optimize;
    auto block = make_block(d);
    if (!block.ok()) {
      std::cerr << block.status() << "\n";
      return 1;
    }
    c10::InferenceMode inference_mode;
    const at::Tensor x = at::randn(shape);
    for (int i = 0; i < 3; ++i) (void)(*block)->forward({x});
    if (serialized) {
      for (std::uint64_t n = 0; read_all(STDIN_FILENO, &n, sizeof n);) {
        if (n != x.nbytes() || !read_all(STDIN_FILENO, x.data_ptr(), n)) return 1;
        auto out = (*block)->forward({x});
        if (!out.ok() || out->empty() || !write_tensor(STDOUT_FILENO, out->front())) return 1;
      }
      return 0;
    }
    for (char byte; ::read(STDIN_FILENO, &byte, 1) == 1;) {
      if (!(*block)->forward({x}).ok() || ::write(STDOUT_FILENO, &byte, 1) != 1) return 1;
    }
    return 0;
  }

 private:
  // All `n` bytes through `io` (::read or ::write), or false.
  template <typename Io, typename Bytes>
  static bool all(Io io, int fd, Bytes* p, std::size_t n) {
    while (n > 0) {
      const ssize_t done = io(fd, p, n);
      if (done <= 0) return false;
      p += done;
      n -= static_cast<std::size_t>(done);
    }
    return true;
  }
  static bool read_all(int fd, void* into, std::size_t n) { return all(::read, fd, static_cast<char*>(into), n); }
  static bool write_all(int fd, const void* from, std::size_t n) {
    return all(::write, fd, static_cast<const char*>(from), n);
  }
  static bool write_tensor(int fd, const at::Tensor& t) {
    const at::Tensor c = t.contiguous();
    const std::uint64_t n = c.nbytes();
    return write_all(fd, &n, sizeof n) && write_all(fd, c.data_ptr(), n);
  }
  // Into `buffer`, reused (its size is the last length read).
  static bool read_bytes(int fd, std::vector<char>& buffer) {
    std::uint64_t n = 0;
    if (!read_all(fd, &n, sizeof n)) return false;
    buffer.resize(n);
    return read_all(fd, buffer.data(), n);
  }

  bool serialized_ = false;
  at::Tensor input_;          // serialized: the first stage's input
  std::vector<char> output_;  // serialized: the last stage's output
  std::vector<pid_t> pids_;
  int in_ = -1;
  int out_ = -1;
};

}  // namespace blockflow::bench
