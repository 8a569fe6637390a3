// What the command-line tools write: a file whole or not at all, and standard output checked, so
// that a full disk or a wrong path is an error naming the file, never a silent success.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>

namespace blockflow::tools {

// Writes `text` to `path` through a temporary file beside it (written, synced, renamed over
// `path`): a reader sees the old file or the new one, never a part. "" or the error, naming `path`.
// Something that is not a regular file (/dev/stdout, a pipe) is written in place, never replaced.
inline std::string write_file_atomic(const std::string& path, const std::string& text) {
  struct stat st {};
  const bool in_place = ::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode);
  const std::string temporary = in_place ? path : path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return "cannot write " + path + ": " + std::strerror(errno);
  std::size_t done = 0;
  int error = 0;
  while (done < text.size() && error == 0) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n > 0) done += static_cast<std::size_t>(n);
    else if (n < 0 && errno != EINTR) error = errno;
    else if (n == 0) error = EIO;
  }
  if (error == 0 && ::fsync(fd) != 0 && errno != EINVAL) error = errno;  // EINVAL: a file that cannot sync (/dev/...)
  if (::close(fd) != 0 && error == 0) error = errno;
  if (error == 0 && !in_place && ::rename(temporary.c_str(), path.c_str()) != 0) error = errno;
  if (error != 0) {
    if (!in_place) ::unlink(temporary.c_str());
    return "cannot write " + path + ": " + std::strerror(error);
  }
  return "";
}

// Whether a file can be made where `path` names, now: checked before a long run whose result goes
// there. "" or the error, naming `path`.
inline std::string check_writable(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) return "";  // a device or a pipe: written in place
  const std::string probe = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return "cannot write " + path + ": " + std::strerror(errno);
  ::close(fd);
  ::unlink(probe.c_str());
  return "";
}

// Flushes standard output: false, with a message on standard error, when what was printed did not
// all go out (a closed pipe, a full disk).
inline bool stdout_written(const char* tool) {
  std::cout.flush();
  if (std::cout) return true;
  std::cerr << tool << ": cannot write standard output\n";
  return false;
}

}  // namespace blockflow::tools
