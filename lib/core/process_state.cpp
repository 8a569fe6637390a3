// What /proc says of a process (see process_state.hpp).
#include <blockflow/core/detail/process_state.hpp>

#include <fmt/format.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace blockflow::detail {

std::vector<std::string> stat_fields(long pid) {
  std::ifstream in(pid == 0 ? std::string("/proc/self/stat") : fmt::format("/proc/{}/stat", pid));
  std::string stat;
  std::vector<std::string> rest;
  if (!std::getline(in, stat)) return rest;
  const auto close = stat.rfind(')');  // the command name may hold spaces and parentheses
  if (close == std::string::npos) return rest;
  std::istringstream fields(stat.substr(close + 1));
  for (std::string field; fields >> field;) rest.push_back(field);
  return rest;
}

bool process_exiting(long pid) {
  const std::vector<std::string> rest = stat_fields(pid);
  if (rest.empty()) return true;  // gone already
  if (rest[0] == "Z" || rest[0] == "X" || rest[0] == "x") return true;
  // Field 9, the task's flags: PF_EXITING is set as the exit starts, whatever its status (an
  // exit(0) too), and never for a process merely stopped.
  constexpr std::size_t kFlags = 9 - 3;
  constexpr unsigned long kPfExiting = 0x4;
  if (rest.size() <= kFlags) return false;
  return (std::strtoul(rest[kFlags].c_str(), nullptr, 10) & kPfExiting) != 0;
}

int process_threads(long pid) {
  std::ifstream in(pid == 0 ? std::string("/proc/self/status") : fmt::format("/proc/{}/status", pid));
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("Threads:", 0) == 0) return std::atoi(line.c_str() + 8);
  }
  return 0;
}

long process_parent(long pid) {
  const std::vector<std::string> rest = stat_fields(pid);
  return rest.size() > 1 ? std::atol(rest[1].c_str()) : 0;  // field 4
}

}  // namespace blockflow::detail
