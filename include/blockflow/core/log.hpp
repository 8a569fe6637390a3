#pragma once
/// @file
/// @brief Where the library's own messages go. By default each message of level kInfo and above is
/// written to stderr as one line, "blockflow: [warning] ...". An application routes them into its
/// own logging (or silences them) with set_log_sink(); messages that can repeat per request or per
/// frame (a malformed frame, a refused peer) are rate-limited at the source, and the next message
/// that gets through says how many were suppressed. A worker process logs to its own stderr, which
/// a WorkerSite's child inherits from the host.
///
/// @code
/// blockflow::set_log_sink([](blockflow::LogLevel level, std::string_view message) {
///   my_logger.write(blockflow::to_string(level), message);
/// });
/// blockflow::set_log_level(blockflow::LogLevel::kWarning);  // drop kInfo
/// @endcode

#include <functional>
#include <string_view>

namespace blockflow {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

/// "debug", "info", "warning", "error".
[[nodiscard]] std::string_view to_string(LogLevel level);

/// @brief Receives one message (no trailing newline). Called on the thread that logs (a compute
/// lane, a site's thread, ...), possibly from several threads at once: it must be thread-safe and
/// must not call back into the session.
using LogSink = std::function<void(LogLevel level, std::string_view message)>;

/// @brief Replaces the sink for the whole process; an empty function restores the stderr default.
/// Safe to call at any time, from any thread; a message being written meanwhile goes to either.
void set_log_sink(LogSink sink);

/// @brief Messages below `level` are dropped before they reach the sink (default kInfo).
void set_log_level(LogLevel level);

}  // namespace blockflow
