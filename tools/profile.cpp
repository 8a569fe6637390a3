// blockflow-profile: measures blocks on this machine and writes a profile document
// (docs/profile.md) for the planner.
//
//   blockflow-profile MODEL.pt... --input 1,3,224,224 [--threads 2] [--out profile.json]
//   blockflow-profile --deployment deploy.json [--models DIR] [--out profile.json]
//
// TorchScript files given in a row form a chain: the first takes --input, each next one the outputs
// of the one before (--shape NAME=a,b,c,d sets a block's input shape instead). A deployment's
// blocks take their "input_shapes" (or --shape). Options: --threads T (intra-op threads of blocks
// that do not set theirs; default 2), --device cpu|cuda:N, --batches 1,2,4,8, --quick (a first look,
// and for tests), --no-channels (skip the channel costs), --no-rate-sweep (latencies only:
// max_rate_rps 0), --optimize 0|1 (TorchScript
// optimize_for_inference, default 1). Progress on stderr; the document on stdout or --out. Blocks
// are measured under the glibc malloc settings of a worker process (core/detail/malloc_settings.hpp).
#include "tool_output.hpp"

#include <blockflow/core/block.hpp>
#include <blockflow/core/detail/flag_number.hpp>
#include <blockflow/core/detail/malloc_settings.hpp>
#include <blockflow/core/names.hpp>
#include <blockflow/deploy/deployment.hpp>
#include <blockflow/plan/profile.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <thread>

namespace bf = blockflow;

namespace {

// "a,b,c" as whole numbers from `min` to `max`; errors name `flag`.
std::vector<std::int64_t> dims(const std::string& flag, const std::string& text, std::int64_t min, std::int64_t max) {
  std::vector<std::int64_t> out;
  std::size_t from = 0;
  while (from <= text.size()) {
    const std::size_t comma = std::min(text.find(',', from), text.size());
    out.push_back(bf::detail::flag_number<std::int64_t>(flag, text.substr(from, comma - from), min, max));
    from = comma + 1;
  }
  return out;
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

int usage(const std::string& problem) {
  std::cerr << "blockflow-profile: " << problem
            << "\nusage: blockflow-profile MODEL.pt... --input a,b,c,d | --deployment FILE [--models DIR]\n"
               "       [--shape NAME=a,b,c,d]... [--threads T] [--device D] [--batches 1,2,4,8] [--quick]\n"
               "       [--no-channels] [--no-rate-sweep] [--optimize 0|1] [--out FILE]\n";
  return 2;
}

// A profile names each TorchScript file by its absolute path (symbolic links and ".." resolved): the
// deployment blockflow-plan writes from it then names the same file wherever it is applied from, and
// a server that confines paths to its models directory accepts it when it lies there, whatever
// directory the profile was taken from.
std::string absolute_path(const std::string& file) {
  std::error_code ec;
  const auto path = std::filesystem::weakly_canonical(std::filesystem::absolute(file, ec), ec);
  return ec ? file : path.string();
}

}  // namespace

int main(int argc, char** argv) try {
  // Blocks are measured under the malloc settings a worker process runs them with.
  if (!bf::detail::use_worker_malloc_settings()) {
    std::cerr << "blockflow-profile: the workers' malloc settings were not applied (AddressSanitizer's heap, or glibc refused)\n";
  }
  std::vector<std::string> files;
  std::string deployment, models, input, out_file, device = "cpu";
  std::map<std::string, std::vector<std::int64_t>> shapes;
  int threads = 2;
  bool channels = true, optimize = true, optimize_given = false, device_given = false;
  bf::ProfileOptions options;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--deployment") deployment = value();
    else if (a == "--models") models = value();
    else if (a == "--input") input = value();
    else if (a == "--shape") {
      const std::string v = value();
      const auto eq = v.find('=');
      if (eq == std::string::npos) return usage("--shape wants NAME=a,b,c,d");
      shapes[v.substr(0, eq)] = dims("--shape " + v.substr(0, eq), v.substr(eq + 1), 0, std::int64_t{1} << 31);
    } else if (a == "--threads") threads = bf::detail::flag_number(a, value(), 1, 1024);  // validate()'s bound
    else if (a == "--device") {
      device = value();
      device_given = true;
    } else if (a == "--batches") {
      options.batch_sizes.clear();
      for (auto b : dims(a, value(), 1, bf::kMaxBatchSize)) options.batch_sizes.push_back(static_cast<int>(b));
    } else if (a == "--quick") options.quick = true;
    else if (a == "--no-channels") channels = false;
    else if (a == "--no-rate-sweep") options.rate_sweep = false;
    else if (a == "--optimize") {
      const std::string v = value();
      if (v != "0" && v != "1") return usage("--optimize takes 0 or 1, not '" + v + "'");
      optimize = v == "1";
      optimize_given = true;
    }
    else if (a == "--out") out_file = value();
    else if (!a.empty() && a[0] == '-') return usage("unknown option " + a);
    else files.push_back(a);
  }
  if (deployment.empty() == files.empty()) return usage("give TorchScript files or --deployment, not both");
  if (!deployment.empty() && (device_given || optimize_given || !input.empty())) {
    return usage("--device, --optimize and --input are for TorchScript files; a deployment's blocks say their own");
  }
  // A wrong --out fails now, not after minutes of measuring.
  if (auto problem = out_file.empty() ? std::string() : bf::tools::check_writable(out_file); !problem.empty()) {
    std::cerr << "blockflow-profile: " << problem << "\n";
    return 1;
  }
  std::vector<bf::BlockDescription> blocks;
  if (!deployment.empty()) {
    auto d = bf::load_deployment(deployment, models);
    if (!d.ok()) {
      std::cerr << "blockflow-profile: " << d.status().message() << "\n";
      return 1;
    }
    blocks = d->blocks;
    for (auto& b : blocks) {
      if (!b.torchscript.empty()) b.torchscript = absolute_path(b.torchscript);
    }
  } else {
    for (const auto& f : files) {
      bf::BlockDescription d;
      d.name = std::filesystem::path(f).stem().string();  // named as the planner reads it back: checked now
      if (auto status = bf::check_name("block", d.name); !status.ok()) {
        return usage(fmt::format("{}: {} (a block is named after its file)", f, std::string(status.message())));
      }
      for (const auto& before : blocks) {
        if (before.name == d.name) return usage(fmt::format("{}: a second file of block name '{}'", f, d.name));
      }
      d.torchscript = absolute_path(f);
      blocks.push_back(d);
    }
    if (input.empty() && !shapes.count(blocks.front().name)) return usage("--input: the first block's input shape");
    if (!input.empty()) blocks.front().options.input_shapes = {dims("--input", input, 0, std::int64_t{1} << 31)};
  }
  for (const auto& [name, shape] : shapes) {
    if (std::none_of(blocks.begin(), blocks.end(), [&](const bf::BlockDescription& b) { return b.name == name; })) {
      return usage(fmt::format("--shape {}: no block of that name", name));
    }
  }
  options.progress = [](std::string_view line) { std::cerr << "blockflow-profile: " << line << "\n"; };
  bf::Profile profile;
  profile.cpu = cpu_model();
  profile.hardware_threads = static_cast<int>(std::thread::hardware_concurrency());
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    bf::BlockDescription& d = blocks[i];
    if (d.options.intra_op_threads == 0) d.options.intra_op_threads = threads;
    if (!d.torchscript.empty() && deployment.empty()) {
      d.options.device = device;
      d.torchscript_options.optimize_for_inference = optimize;
    }
    if (auto it = shapes.find(d.name); it != shapes.end()) d.options.input_shapes = {it->second};
    if (d.options.input_shapes.empty() && deployment.empty() && i > 0) {
      d.options.input_shapes = profile.blocks.back().output_shapes;  // a chain: the previous block's outputs
    }
    auto p = bf::profile_block(d, options);
    if (!p.ok()) {
      std::cerr << "blockflow-profile: " << p.status().message() << "\n";
      return 1;
    }
    profile.blocks.push_back(*std::move(p));
  }
  if (channels) {
    auto costs = bf::profile_channels(options);
    if (!costs.ok()) {
      std::cerr << "blockflow-profile: channels: " << costs.status().message() << "\n";
      return 1;
    }
    profile.channels = *std::move(costs);
  }
  const std::string text = profile.to_json() + "\n";
  // What the planner reads back: a profile it would refuse is an error here, naming the field.
  if (auto back = bf::Profile::parse(text, out_file.empty() ? "the profile" : out_file); !back.ok()) {
    std::cerr << "blockflow-profile: " << back.status().message() << "\n";
    return 1;
  }
  if (out_file.empty()) {
    std::cout << text;
    return bf::tools::stdout_written("blockflow-profile") ? 0 : 1;
  }
  if (auto problem = bf::tools::write_file_atomic(out_file, text); !problem.empty()) {
    std::cerr << "blockflow-profile: " << problem << "\n";
    return 1;
  }
  std::cerr << "blockflow-profile: wrote " << out_file << "\n";
  return 0;
} catch (const std::invalid_argument& e) {
  return usage(e.what());
} catch (const std::exception& e) {
  std::cerr << "blockflow-profile: " << e.what() << "\n";
  return 1;
}
