#pragma once
// Internal: the text of the exception being handled, for messages that say where it came from.
// Call it inside a catch block: c10::Error's message without its backtrace, a std::exception's
// what(), or "an exception of unknown type".
#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace blockflow::detail {

inline std::string current_exception_text() {
  try {
    throw;
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception of unknown type";
  }
}

}  // namespace blockflow::detail
