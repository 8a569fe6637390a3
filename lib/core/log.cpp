#include <blockflow/core/detail/log.hpp>
#include <blockflow/core/detail/mutex.hpp>

#include <fmt/format.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <string>

namespace blockflow {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};

blockflow::detail::Mutex& sink_mu() {
  static blockflow::detail::Mutex mu;
  return mu;
}

// Held by shared_ptr: a message being written keeps the sink it started with alive.
std::shared_ptr<const LogSink>& sink_slot() {
  static std::shared_ptr<const LogSink> sink;
  return sink;
}

void to_stderr(LogLevel level, std::string_view message) {
  const std::string line = fmt::format("blockflow: [{}] {}\n", to_string(level), message);
  std::fwrite(line.data(), 1, line.size(), stderr);  // one write: lines of two threads never interleave
}

}  // namespace

std::string_view to_string(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarning: return "warning";
    case LogLevel::kError: return "error";
  }
  return "?";
}

void set_log_sink(LogSink sink) {
  auto next = sink ? std::make_shared<const LogSink>(std::move(sink)) : nullptr;
  blockflow::detail::MutexLock lock(&sink_mu());
  sink_slot() = std::move(next);
}

void set_log_level(LogLevel level) { g_level.store(static_cast<int>(level), std::memory_order_relaxed); }

namespace detail {

void log(LogLevel level, std::string_view message) {
  if (static_cast<int>(level) < g_level.load(std::memory_order_relaxed)) return;
  std::shared_ptr<const LogSink> sink;
  {
    blockflow::detail::MutexLock lock(&sink_mu());
    sink = sink_slot();
  }
  if (!sink) return to_stderr(level, message);
  try {
    (*sink)(level, message);
  } catch (...) {  // a throwing sink must not take a compute lane down
    to_stderr(LogLevel::kError, "the log sink threw; message: " + std::string(message));
  }
}

void RateLimitedLog::log(LogLevel level, std::string_view message) {
  std::uint64_t dropped = 0;
  {
    blockflow::detail::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    if (now - window_start_ >= period_) {
      window_start_ = now;
      in_window_ = 0;
    }
    if (in_window_ >= burst_) {
      ++dropped_since_;
      ++dropped_total_;
      return;
    }
    ++in_window_;
    dropped = std::exchange(dropped_since_, 0);
  }
  if (dropped == 0) return detail::log(level, message);
  detail::log(level, fmt::format("{} ({} similar message(s) suppressed)", message, dropped));
}

std::uint64_t RateLimitedLog::suppressed() const {
  blockflow::detail::MutexLock lock(&mu_);
  return dropped_total_;
}

}  // namespace detail
}  // namespace blockflow
