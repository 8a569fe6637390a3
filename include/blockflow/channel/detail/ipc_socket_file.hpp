#pragma once
// Internal: the file an ipc:// endpoint's bind made. libzmq 4.3 leaves it behind when the socket
// closes; whoever bound it removes it when its end goes, unless another process has bound the path
// since (a file of another inode is left alone).

#include <sys/stat.h>
#include <unistd.h>

#include <optional>
#include <string>

namespace blockflow::detail {

class IpcSocketFile {
 public:
  /// The file `endpoint` (as bound: ZeroMQ's last_endpoint) names; nullopt for another transport,
  /// an abstract socket (ipc://@name) or a file that cannot be read.
  static std::optional<IpcSocketFile> of(const std::string& endpoint) {
    if (endpoint.rfind("ipc://", 0) != 0 || endpoint.size() <= 6 || endpoint[6] == '@') return std::nullopt;
    IpcSocketFile file;
    file.path_ = endpoint.substr(6);
    struct stat st {};
    if (::stat(file.path_.c_str(), &st) != 0) return std::nullopt;
    file.device_ = st.st_dev;
    file.inode_ = st.st_ino;
    return file;
  }
  /// Removes the file if it is still the one bound. Call once the socket is closed.
  void remove() const {
    struct stat st {};
    if (::stat(path_.c_str(), &st) == 0 && st.st_dev == device_ && st.st_ino == inode_) ::unlink(path_.c_str());
  }

 private:
  std::string path_;
  dev_t device_ = 0;
  ino_t inode_ = 0;
};

}  // namespace blockflow::detail
