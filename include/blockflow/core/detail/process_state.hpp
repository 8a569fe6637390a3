#pragma once
// Internal: what the kernel says of a process (a child the host supervises, the fork server, the
// sender at the other end of a shm:// link that ended).
#include <string>
#include <vector>

namespace blockflow::detail {

/// Whether process `pid` is on its way out: gone, a zombie, or a process whose exit has begun. The
/// kernel flags a task PF_EXITING (field 9 of /proc/PID/stat) when its exit starts; tearing down a
/// large address space (an ASan process's shadow memory, a worker holding GBs of weights) can take
/// a second more before the process can be reaped. A supervisor that sees heartbeats stop waits for
/// such a process and reports how it died, instead of calling it silent.
bool process_exiting(long pid);

/// The fields of /proc/PID/stat (pid 0: this process) after the command name: [0] is field 3 (the
/// state); empty when the process is gone.
std::vector<std::string> stat_fields(long pid);

/// Process `pid`'s thread count (/proc/PID/status; pid 0: this process); 0 when it is gone.
int process_threads(long pid);

/// Process `pid`'s parent (field 4 of /proc/PID/stat); 0 when it is gone.
long process_parent(long pid);

}  // namespace blockflow::detail
