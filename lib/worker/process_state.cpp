// What /proc says of a supervised child (see process_state.hpp).
#include <blockflow/worker/detail/process_state.hpp>

#include <fmt/format.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace blockflow::detail {

bool process_exiting(long pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string stat;
  if (!std::getline(in, stat)) return true;  // gone already
  const auto close = stat.rfind(')');        // the command name may hold spaces and parentheses
  if (close == std::string::npos) return false;
  std::istringstream fields(stat.substr(close + 1));
  std::vector<std::string> rest;  // field 3 (state) on
  for (std::string field; fields >> field;) rest.push_back(field);
  if (rest.empty()) return false;
  if (rest[0] == "Z" || rest[0] == "X" || rest[0] == "x") return true;
  // Field 9, the task's flags: PF_EXITING is set as the exit starts, whatever its status (an
  // exit(0) too), and never for a process merely stopped.
  constexpr std::size_t kFlags = 9 - 3;
  constexpr unsigned long kPfExiting = 0x4;
  if (rest.size() <= kFlags) return false;
  return (std::strtoul(rest[kFlags].c_str(), nullptr, 10) & kPfExiting) != 0;
}

}  // namespace blockflow::detail
