// What the command-line tools write: a file whole or not at all, and standard output checked, so
// that a full disk or a wrong path is an error naming the file, never a silent success.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

namespace blockflow::tools {

// A new file beside `path` (PATH.tmp.XXXXXX), made exclusively (never through a link planted at its
// name): its descriptor (-1, errno set, when it could not be made), its name in `name`.
inline int temporary_beside(const std::string& path, std::string& name) {
  std::vector<char> pattern(path.begin(), path.end());
  for (const char c : std::string(".tmp.XXXXXX")) pattern.push_back(c);
  pattern.push_back('\0');
  const int fd = ::mkostemp(pattern.data(), O_CLOEXEC);
  name = pattern.data();
  return fd;
}

// Writes `text` to `path`. A regular file (or a new one) is written through a temporary file beside
// it, made exclusively (mkstemp), synced and renamed over `path`: a reader sees the old file or the
// new one, never a part; an existing file's mode is kept. A symbolic link, a file of several hard
// links, a device or a pipe (/dev/stdout) is written in place instead, never replaced.
// "" or the error, naming `path`.
inline std::string write_file_atomic(const std::string& path, const std::string& text) {
  struct stat st {};
  const bool exists = ::lstat(path.c_str(), &st) == 0;
  const bool in_place = exists && (!S_ISREG(st.st_mode) || st.st_nlink > 1);
  std::string temporary = path;
  int fd = -1;
  if (in_place) {
    fd = ::open(path.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC);
  } else {
    fd = temporary_beside(path, temporary);
    if (fd >= 0) (void)::fchmod(fd, exists ? (st.st_mode & 07777) : 0644);
  }
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

// Whether `path` can be written now: checked before a long run whose result goes there (a file is
// made and removed beside it). "" or the error, naming `path`.
inline std::string check_writable(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return "cannot write " + path + ": it is a directory";
    if (!S_ISREG(st.st_mode)) return ::access(path.c_str(), W_OK) == 0 ? "" : "cannot write " + path + ": " + std::strerror(errno);
  }
  std::string name;
  const int fd = temporary_beside(path, name);
  if (fd < 0) return "cannot write " + path + ": " + std::strerror(errno);
  ::close(fd);
  ::unlink(name.c_str());
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
