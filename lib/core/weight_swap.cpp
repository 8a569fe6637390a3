// Paging a block's weights out to a file and back in (include/blockflow/core/detail/weight_swap.hpp).
#include <blockflow/core/detail/cpu_allocator_override.hpp>
#include <blockflow/core/detail/log.hpp>
#include <blockflow/core/detail/weight_swap.hpp>

#include <c10/core/CPUAllocator.h>
#include <fmt/format.h>

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace blockflow::detail {

struct WeightSwap::State {
  struct Region {
    std::size_t len = 0;
    std::int64_t offset = -1;  // where its copy is in the file; -1: not saved yet
  };
  std::string owner;
  Options options;
  std::weak_ptr<State> self;
  std::mutex mu;
  std::map<char*, Region> regions;  // guarded by mu
  std::int64_t bytes = 0;           // guarded by mu
  int fd = -1;                      // guarded by mu; made at the first swap_out()
  std::int64_t file_end = 0;        // guarded by mu
  ~State() {
    if (fd >= 0) ::close(fd);
  }
};

namespace {

using State = WeightSwap::State;

std::size_t page_size() {
  static const std::size_t size = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return size;
}

std::size_t whole_pages(std::size_t n) { return (n + page_size() - 1) / page_size() * page_size(); }

std::string errno_text(int error) { return std::strerror(error); }

thread_local State* t_capture = nullptr;

// The captured mappings still allocated, by address, with the swap each belongs to. Never
// destroyed: tensors may be freed during the process's exit.
struct Registry {
  std::shared_mutex mu;  // shared for the look-up every raw free makes; exclusive to add or remove
  std::unordered_map<void*, std::shared_ptr<State>> owners;
  std::atomic<std::size_t> live{0};
};
Registry& registry() {
  static auto* r = new Registry();
  return *r;
}

c10::DeleterFnPtr g_next_raw_deleter = nullptr;  // the previous allocator's, for what is not ours

void release(State& s, char* base) {
  std::lock_guard<std::mutex> lock(s.mu);
  const auto it = s.regions.find(base);
  if (it == s.regions.end()) return;
  if (it->second.offset >= 0 && s.fd >= 0) {
    (void)::fallocate(s.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, it->second.offset,
                      static_cast<off_t>(it->second.len));  // its copy is not needed any more
  }
  ::munmap(base, it->second.len);
  s.bytes -= static_cast<std::int64_t>(it->second.len);
  s.regions.erase(it);
}

// The deleter of every pointer our allocator gives out, and its raw_deleter: what is not a captured
// mapping goes to the previous allocator's.
void free_any(void* p) {
  if (p == nullptr) return;
  Registry& r = registry();
  if (r.live.load(std::memory_order_acquire) > 0) {
    bool ours = false;
    {
      std::shared_lock<std::shared_mutex> lock(r.mu);
      ours = r.owners.count(p) != 0;
    }
    std::shared_ptr<State> owner;
    if (ours) {
      std::unique_lock<std::shared_mutex> lock(r.mu);
      const auto it = r.owners.find(p);
      if (it != r.owners.end()) {
        owner = std::move(it->second);
        r.owners.erase(it);
        r.live.fetch_sub(1, std::memory_order_release);
      }
    }
    if (owner) {
      release(*owner, static_cast<char*>(p));
      return;
    }
  }
  g_next_raw_deleter(p);
}

void* map_captured(State& s, std::size_t n) {
  const std::size_t len = whole_pages(n);
  void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  std::shared_ptr<State> owner = s.self.lock();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.regions.emplace(static_cast<char*>(p), State::Region{len, -1});
    s.bytes += static_cast<std::int64_t>(len);
  }
  Registry& r = registry();
  std::unique_lock<std::shared_mutex> lock(r.mu);
  r.owners.emplace(p, std::move(owner));
  r.live.fetch_add(1, std::memory_order_release);
  return p;
}

class CapturingAllocator final : public c10::Allocator {
 public:
  explicit CapturingAllocator(c10::Allocator* next) : next_(next) {}
  c10::DataPtr allocate(size_t n) BLOCKFLOW_ALLOCATE_CONST override {
    State* s = t_capture;
    if (s != nullptr && n >= page_size()) {
      if (void* p = map_captured(*s, n)) return {p, p, &free_any, c10::Device(c10::DeviceType::CPU)};
    }
    return next_->allocate(n);
  }
  BLOCKFLOW_CPU_COPY_DATA
  c10::DeleterFnPtr raw_deleter() const override { return &free_any; }

 private:
  c10::Allocator* next_;
};

bool install() {
  static const bool installed = [] {
    c10::Allocator* next = c10::GetCPUAllocator();
    if (next == nullptr || next->raw_deleter() == nullptr) return false;
    g_next_raw_deleter = next->raw_deleter();
    static auto* ours = new CapturingAllocator(next);
    // In front of what is there (libtorch's own at priority 0, a worker's slot allocator at 100,
    // which, installed after this, wraps it in turn; either order makes one chain).
    c10::SetCPUAllocator(ours, /*priority=*/100);
    return c10::GetCPUAllocator() == ours;
  }();
  return installed;
}

absl::Status open_file(State& s) {
  std::string dir = s.options.directory;
  if (dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    dir = tmp != nullptr && *tmp != '\0' ? tmp : "/var/tmp";
  }
  int fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {  // a file system without O_TMPFILE: a named file, unlinked at once
    std::string path = dir + "/blockflow-swap-XXXXXX";
    fd = ::mkostemp(path.data(), O_CLOEXEC);
    if (fd >= 0) ::unlink(path.c_str());
  }
  if (fd < 0) {
    return absl::UnavailableError(fmt::format("block '{}': cannot make a swap file in '{}': {}", s.owner, dir, errno_text(errno)));
  }
  struct statfs fs {};
  if (::fstatfs(fd, &fs) == 0 && static_cast<long>(fs.f_type) == static_cast<long>(TMPFS_MAGIC)) {
    static std::mutex warned_mu;
    static std::set<std::string> warned;
    std::lock_guard<std::mutex> lock(warned_mu);
    if (warned.insert(dir).second) {
      log(LogLevel::kWarning, fmt::format("swap directory '{}' is a tmpfs: the weights of evicted blocks stay in memory there "
                                          "(SessionOptions::swap.directory, docs/memory.md)", dir));
    }
  }
  s.fd = fd;
  return absl::OkStatus();
}

absl::Status write_all(const State& s, const char* data, std::size_t len, std::int64_t offset) {
  while (len > 0) {
    const ssize_t n = ::pwrite(s.fd, data, len, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::ResourceExhaustedError(
          fmt::format("block '{}': writing its weights to the swap file failed: {}", s.owner, errno_text(n < 0 ? errno : ENOSPC)));
    }
    data += n;
    len -= static_cast<std::size_t>(n);
    offset += n;
  }
  return absl::OkStatus();
}

// Maps the file's copy over the region (private: writes stay in this process), the old pages freed.
// The file mapping is made first, so a failure leaves the region as it was.
absl::Status map_copy(const State& s, char* base, std::size_t len, std::int64_t offset) {
  void* copy = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE, s.fd, static_cast<off_t>(offset));
  if (copy == MAP_FAILED) {
    return absl::ResourceExhaustedError(fmt::format("block '{}': mapping its swap file failed: {}", s.owner, errno_text(errno)));
  }
  if (::mremap(copy, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, base) == MAP_FAILED) {
    const int error = errno;
    ::munmap(copy, len);
    return absl::ResourceExhaustedError(fmt::format("block '{}': mapping its swap file failed: {}", s.owner, errno_text(error)));
  }
  return absl::OkStatus();
}

// /proc/self/pagemap's entries for [base, base + len): bit 63 present, 62 swapped, 61 a file page.
absl::Status page_entries(const State& s, const char* base, std::size_t len, std::vector<std::uint64_t>& out) {
  // Opened once it opens (a failure, say out of descriptors, is tried again next time, not kept).
  static std::atomic<int> opened{-1};
  int pagemap = opened.load(std::memory_order_acquire);
  if (pagemap < 0) {
    const int fd = ::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      return absl::UnavailableError(
          fmt::format("block '{}': /proc/self/pagemap cannot be read: {}", s.owner, errno_text(errno)));
    }
    int none = -1;
    if (opened.compare_exchange_strong(none, fd, std::memory_order_acq_rel)) {
      pagemap = fd;
    } else {
      ::close(fd);  // another thread's is kept
      pagemap = none;
    }
  }
  out.resize(len / page_size());
  const auto offset = static_cast<off_t>(reinterpret_cast<std::uintptr_t>(base) / page_size() * sizeof(std::uint64_t));
  const auto want = static_cast<ssize_t>(out.size() * sizeof(std::uint64_t));
  if (::pread(pagemap, out.data(), static_cast<std::size_t>(want), offset) != want) {
    return absl::UnavailableError(fmt::format("block '{}': /proc/self/pagemap cannot be read: {}", s.owner, errno_text(errno)));
  }
  return absl::OkStatus();
}

constexpr std::uint64_t kPresent = 1ULL << 63, kSwapped = 1ULL << 62, kFilePage = 1ULL << 61;

// A page of a saved region that differs from its copy: written since (a private copy), or swapped.
bool written(std::uint64_t entry) { return ((entry & kPresent) != 0 && (entry & kFilePage) == 0) || (entry & kSwapped) != 0; }

}  // namespace

WeightSwap::WeightSwap(std::string owner, Options options) : state_(std::make_shared<State>()) {
  state_->owner = std::move(owner);
  state_->options = std::move(options);
  state_->self = state_;
}

WeightSwap::~WeightSwap() = default;  // regions still allocated keep the state (and the file) alive

bool WeightSwap::available() { return install(); }

WeightSwap::Capture::Capture(WeightSwap& swap) : previous_(t_capture) {
  if (install()) t_capture = swap.state_.get();
}

WeightSwap::Capture::~Capture() { t_capture = static_cast<State*>(previous_); }

WeightSwap::Pause::Pause() : previous_(std::exchange(t_capture, nullptr)) {}

WeightSwap::Pause::~Pause() { t_capture = static_cast<State*>(previous_); }

std::int64_t WeightSwap::bytes() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->bytes;
}

std::int64_t WeightSwap::resident_bytes() const {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  std::int64_t resident = 0;
  std::vector<std::uint64_t> entries;
  for (const auto& [base, r] : s.regions) {
    if (!page_entries(s, base, r.len, entries).ok()) return -1;
    for (const std::uint64_t e : entries) {
      if ((e & kPresent) != 0) resident += static_cast<std::int64_t>(page_size());
    }
  }
  return resident;
}

absl::Status WeightSwap::swap_out() {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.regions.empty()) return absl::OkStatus();
  if (s.fd < 0) {
    if (auto status = open_file(s); !status.ok()) return status;
  }
  std::vector<std::uint64_t> entries;
  for (auto& [base, r] : s.regions) {
    if (r.offset < 0) {  // the first time: all of it
      const std::int64_t offset = s.file_end;
      if (auto status = write_all(s, base, r.len, offset); !status.ok()) return status;
      if (auto status = map_copy(s, base, r.len, offset); !status.ok()) return status;
      r.offset = offset;
      s.file_end += static_cast<std::int64_t>(r.len);
      continue;
    }
    if (auto status = page_entries(s, base, r.len, entries); !status.ok()) return status;
    for (std::size_t i = 0; i < entries.size();) {  // save the runs of written pages
      if (!written(entries[i])) {
        ++i;
        continue;
      }
      std::size_t j = i;
      while (j < entries.size() && written(entries[j])) ++j;
      const std::size_t from = i * page_size(), bytes = (j - i) * page_size();
      if (auto status = write_all(s, base + from, bytes, r.offset + static_cast<std::int64_t>(from)); !status.ok()) return status;
      i = j;
    }
    // Dropped: the next access reads the file, which has every page's latest content now.
    if (::madvise(base, r.len, MADV_DONTNEED) != 0) {
      return absl::InternalError(fmt::format("block '{}': dropping its weights' pages failed: {}", s.owner, errno_text(errno)));
    }
  }
  if (s.options.drop_page_cache) {
    (void)::fdatasync(s.fd);
    (void)::posix_fadvise(s.fd, 0, 0, POSIX_FADV_DONTNEED);
  }
  return absl::OkStatus();
}

absl::Status WeightSwap::swap_in() {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  for (const auto& [base, r] : s.regions) {
    if (r.offset < 0) continue;  // never swapped out: resident
    if (::madvise(base, r.len, MADV_POPULATE_READ) == 0) continue;
    if (errno != EINVAL) {
      return absl::DataLossError(fmt::format("block '{}': reading its weights back from the swap file failed: {}", s.owner,
                                             errno_text(errno)));
    }
    // A kernel before 5.14: touch every page.
    for (std::size_t at = 0; at < r.len; at += page_size()) (void)*static_cast<volatile const char*>(base + at);
  }
  return absl::OkStatus();
}

}  // namespace blockflow::detail
