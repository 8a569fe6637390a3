#include <blockflow/core/detail/build_scope.hpp>

#include <mutex>

namespace blockflow::detail {
namespace {
std::mutex scope_mu;
BuildScope& installed() {
  static BuildScope scope;
  return scope;
}
}  // namespace

void set_build_scope(BuildScope scope) {
  std::lock_guard lock(scope_mu);
  installed() = std::move(scope);
}

std::shared_ptr<void> enter_build_scope() {
  BuildScope scope;
  {
    std::lock_guard lock(scope_mu);
    scope = installed();
  }
  return scope ? scope() : nullptr;
}

}  // namespace blockflow::detail
