#pragma once
// Internal: a process-wide scope around building and warming up blocks, entered on whichever lane
// does it. A worker process installs one that keeps its slot allocator off (weights, frozen
// constants and prepacked weights live as long as the block and must not hold result slots).

#include <functional>
#include <memory>

namespace blockflow::detail {

/// Returns a token; the scope lasts while the token lives.
using BuildScope = std::function<std::shared_ptr<void>()>;

/// Installs the scope (before a session starts). Thread-safe.
void set_build_scope(BuildScope scope);
/// Enters the installed scope (null token when none).
[[nodiscard]] std::shared_ptr<void> enter_build_scope();

}  // namespace blockflow::detail
