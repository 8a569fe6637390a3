// What a worker forked from the fork server takes from the application besides its command line
// (detail/fork_server.hpp): the environment (variables read at load must match the server's; glibc's
// MALLOC_* ones are applied with mallopt()), and the working directory, umask and resource limits
// the application has when it asks, as an exec'd worker would inherit them.
#include <blockflow/worker/detail/fork_server.hpp>
#include <blockflow/worker/detail/launch_worker.hpp>
#include <blockflow/core/detail/utf8_text.hpp>

#include <fcntl.h>
#include <malloc.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

namespace blockflow::detail {
namespace {

// glibc's tuning variables that mallopt() applies, and its parameters.
const std::map<std::string, int>& malloc_parameters() {
  static const std::map<std::string, int> parameters = {
      {"MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD}, {"MALLOC_TRIM_THRESHOLD_", M_TRIM_THRESHOLD},
      {"MALLOC_TOP_PAD_", M_TOP_PAD},               {"MALLOC_MMAP_MAX_", M_MMAP_MAX},
      {"MALLOC_ARENA_MAX", M_ARENA_MAX},            {"MALLOC_ARENA_TEST", M_ARENA_TEST}};
  return parameters;
}

// This process's umask, read without setting it (umask() would change it for every thread a moment).
// -1 where /proc does not say (Linux < 4.7).
int current_umask() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("Umask:", 0) == 0) return static_cast<int>(std::strtol(line.c_str() + 6, nullptr, 8));
  }
  return -1;
}

}  // namespace

std::map<std::string, std::string> by_name(const std::vector<std::string>& environment) {
  std::map<std::string, std::string> out;
  for (const auto& e : environment) {
    const auto eq = e.find('=');
    out[e.substr(0, eq)] = eq == std::string::npos ? "" : e.substr(eq + 1);
  }
  return out;
}

bool applied_by_mallopt(const std::string& name) { return malloc_parameters().count(name) != 0; }

bool read_when_loaded(const std::string& name) {
  for (const char* prefix : {"GOMP_", "OMP_", "KMP_", "LD_", "MALLOC_", "GLIBC_TUNABLES", "MKL_", "DNNL_", "ONEDNN_",
                             "OPENBLAS_", "ATEN_", "TORCH_", "PYTORCH_", "ASAN_", "LSAN_", "UBSAN_", "TSAN_"}) {
    if (name.rfind(prefix, 0) == 0) return true;
  }
  return false;
}

void apply_malloc_environment(const std::vector<std::string>& environment) {
  for (const auto& [name, value] : by_name(environment)) {
    const auto it = malloc_parameters().find(name);
    if (it == malloc_parameters().end()) continue;
    char* end = nullptr;
    const long v = std::strtol(value.c_str(), &end, 10);
    if (end != value.c_str() && *end == '\0') (void)::mallopt(it->second, static_cast<int>(v));
  }
}

nlohmann::json process_context() {
  nlohmann::json out = nlohmann::json::object();
  if (char* cwd = ::getcwd(nullptr, 0); cwd != nullptr) {
    // JSON carries UTF-8 only: a directory named otherwise is not sent (the worker keeps the server's).
    if (const std::string dir = cwd; utf8_or_replaced(dir) == dir) out["cwd"] = dir;
    std::free(cwd);
  }
  if (const int mask = current_umask(); mask >= 0) out["umask"] = mask;
  nlohmann::json limits = nlohmann::json::array();
  for (int resource = 0; resource < RLIM_NLIMITS; ++resource) {
    struct rlimit limit {};
    if (::getrlimit(static_cast<__rlimit_resource>(resource), &limit) != 0) continue;
    limits.push_back({resource, static_cast<std::uint64_t>(limit.rlim_cur), static_cast<std::uint64_t>(limit.rlim_max)});
  }
  out["rlimits"] = std::move(limits);
  return out;
}

void apply_process_context(const nlohmann::json& context) {
  if (!context.is_object()) return;
  // Best effort, as far as the server's own state allows (a hard limit it lowered cannot rise).
  if (context.contains("cwd") && context["cwd"].is_string()) {
    const std::string dir = context["cwd"].get<std::string>();
    if (::chdir(dir.c_str()) != 0) {
      std::fprintf(stderr, "%s: cannot enter the application's working directory '%s': %s (it keeps the fork server's)\n",
                   worker_label().c_str(), dir.c_str(), std::strerror(errno));
    }
  }
  if (context.contains("umask") && context["umask"].is_number_integer()) ::umask(static_cast<mode_t>(context["umask"].get<int>() & 0777));
  if (context.contains("rlimits") && context["rlimits"].is_array()) {
    for (const auto& l : context["rlimits"]) {
      if (!l.is_array() || l.size() != 3 || !l[0].is_number_integer() || !l[1].is_number_unsigned() || !l[2].is_number_unsigned()) {
        continue;
      }
      const int resource = l[0].get<int>();
      if (resource < 0 || resource >= RLIM_NLIMITS) continue;
      const struct rlimit limit {static_cast<rlim_t>(l[1].get<std::uint64_t>()), static_cast<rlim_t>(l[2].get<std::uint64_t>())};
      (void)::setrlimit(static_cast<__rlimit_resource>(resource), &limit);
    }
  }
}

}  // namespace blockflow::detail
