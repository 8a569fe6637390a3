// Built against the installed package by the install_consumer ctest:
//   consumer MODEL.pt EXPECTED_WORKER
// A block in the host's threads and a TorchScript block in a worker process, which must be the
// installed blockflow-worker (found beside the installed library, without configuration).
#include <blockflow/blockflow.hpp>
#include <blockflow/channel/process_channel.hpp>
#include <blockflow/worker/worker_site.hpp>

#include <ATen/ATen.h>  // tensor operators: blockflow.hpp only declares the Tensor type

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>

int main(int argc, char** argv) {
  namespace bf = blockflow;
  if (argc != 3) return 2;
  bf::BlockDescription conv;
  conv.name = "conv";
  conv.torchscript = argv[1];
  conv.placement = "w1";
  conv.options.intra_op_threads = 1;
  bf::WorkerOptions w1;
  w1.name = "w1";
  auto site = bf::make_worker(w1);
  bf::Session session;
  session.add_site(site)
      .add_block(conv)
      .add_block(bf::Block::callable("inc", [](bf::Tensors&& in) -> absl::StatusOr<bf::Tensors> {
        return bf::Tensors{in.at(0) + 1};
      }))
      .add_path(bf::Path::chain("t", {"inc"}))
      .add_path(bf::Path::chain("c", {"conv"}));
  if (auto status = session.start(); !status.ok()) {
    std::cerr << status << "\n";
    return 1;
  }
  const bf::Result r = session.submit("t", at::zeros({1})).get();
  if (!r.ok() || r.output().item<float>() != 1.0f) return 1;
  const bf::Result c = session.submit("c", at::ones({1, 3, 16, 16})).get();
  if (!c.ok() || c.output().size(1) != 8) {
    std::cerr << "worker block: " << c.status << "\n";
    return 1;
  }
  const std::string exe = std::filesystem::read_symlink("/proc/" + std::to_string(site->pid()) + "/exe");
  if (std::filesystem::canonical(exe) != std::filesystem::canonical(argv[2])) {
    std::cerr << "worker runs " << exe << ", expected the installed " << argv[2] << "\n";
    return 1;
  }
  // blockflow::channels: a tensor through a shm:// channel, both ends here.
  const std::string uri = "shm://consumer-" + std::to_string(::getpid());
  auto receiver = bf::open_channel(uri, bf::ChannelRole::kReceiver);
  auto sender = bf::open_channel(uri, bf::ChannelRole::kSender);
  if (!receiver.ok() || !sender.ok()) {
    std::cerr << "channel: " << receiver.status() << " / " << sender.status() << "\n";
    return 1;
  }
  bf::Envelope e;
  e.tensors = {at::full({4}, 5.0f)};
  if (!(*sender)->send(std::move(e)).status.ok()) return 1;
  auto got = (*receiver)->receive(absl::Now() + absl::Seconds(10));
  if (!got || got->tensors.at(0).sum().item<float>() != 20.0f) {
    std::cerr << "channel: nothing or a wrong tensor on " << uri << "\n";
    return 1;
  }
  std::cout << "consumer: ok (blockflow " << bf::kVersionString << ", worker " << exe << ")\n";
  return 0;
}
