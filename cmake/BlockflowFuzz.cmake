# libFuzzer target for the wire header codec (tests/fuzz/wire_format_fuzz.cpp) and a bounded ctest,
# `fuzz_wire_format` (label `fuzz`), that runs it for 20 s.
#
# BlockFlow is built with g++, which has no libFuzzer, so the fuzzer cannot be an add_executable():
# a custom command compiles and links it with clang++ against the same Debian absl and fmt shared
# libraries (both compilers use libstdc++ there, so the C++ ABI matches). Only the codec and the
# entry point are instrumented: the codec is the code that parses untrusted bytes.
#
# Expects absl and fmt to be found already; include it where enable_testing() is in effect.

find_program(BLOCKFLOW_CLANGXX NAMES clang++ clang++-18 clang++-17 clang++-16 clang++-15 clang++-14
             DOC "clang++ used to build the libFuzzer targets")
set(_bf_fuzz_default OFF)
if(BLOCKFLOW_CLANGXX)
  set(_bf_fuzz_default ON)
endif()
option(BLOCKFLOW_FUZZ "Build the libFuzzer target for the wire format (needs clang++) and its ctest"
       ${_bf_fuzz_default})

if(NOT BLOCKFLOW_CLANGXX)
  message(STATUS "libFuzzer target skipped: no clang++")
  return()
endif()
if(NOT BLOCKFLOW_FUZZ)
  message(STATUS "libFuzzer target skipped: BLOCKFLOW_FUZZ is OFF")
  return()
endif()

# A clang++ without the libFuzzer runtime (libclang_rt.fuzzer) would only fail at build time; probe
# once and skip cleanly instead.
if(NOT DEFINED BLOCKFLOW_CLANG_LINKS_LIBFUZZER)
  set(_bf_probe_dir ${PROJECT_BINARY_DIR}/CMakeFiles/blockflow_fuzz_probe)
  file(WRITE ${_bf_probe_dir}/probe.cpp
       "#include <cstddef>\n#include <cstdint>\n"
       "extern \"C\" int LLVMFuzzerTestOneInput(const std::uint8_t*, std::size_t) { return 0; }\n")
  execute_process(COMMAND ${BLOCKFLOW_CLANGXX} -fsanitize=fuzzer,address probe.cpp -o probe
                  WORKING_DIRECTORY ${_bf_probe_dir} RESULT_VARIABLE _bf_probe_rc OUTPUT_QUIET ERROR_QUIET)
  if(_bf_probe_rc EQUAL 0)
    set(BLOCKFLOW_CLANG_LINKS_LIBFUZZER TRUE CACHE INTERNAL "clang++ links -fsanitize=fuzzer,address")
  else()
    set(BLOCKFLOW_CLANG_LINKS_LIBFUZZER FALSE CACHE INTERNAL "clang++ links -fsanitize=fuzzer,address")
  endif()
endif()
if(NOT BLOCKFLOW_CLANG_LINKS_LIBFUZZER)
  message(STATUS "libFuzzer target skipped: ${BLOCKFLOW_CLANGXX} cannot link -fsanitize=fuzzer,address")
  return()
endif()

# The link line of imported targets, walked by hand because no CMake target is involved: the file of
# every non-interface library in the closure of INTERFACE_LINK_LIBRARIES, plus plain flags
# (Debian's absl adds -latomic inside --push-state/--pop-state). Generator expressions in those
# lists are platform switches that do not apply here and are skipped.
function(_blockflow_fuzz_link_items out)
  set(items)
  set(seen)
  set(queue ${ARGN})
  while(queue)
    list(POP_FRONT queue item)
    if(TARGET ${item})
      if(item IN_LIST seen)
        continue()
      endif()
      list(APPEND seen ${item})
      get_target_property(type ${item} TYPE)
      if(NOT type STREQUAL "INTERFACE_LIBRARY")
        list(APPEND items "$<TARGET_FILE:${item}>")
      endif()
      get_target_property(deps ${item} INTERFACE_LINK_LIBRARIES)
      if(deps)
        list(APPEND queue ${deps})
      endif()
    elseif(item MATCHES "^-")
      list(APPEND items ${item})
    endif()
  endwhile()
  list(REMOVE_DUPLICATES items)  # first occurrences keep each push-state/-latomic/pop-state in order
  set(${out} ${items} PARENT_SCOPE)
endfunction()

# Compile flags the imported targets ask for (fmt's FMT_SHARED), and their include directories
# except the compiler's own (an explicit -isystem /usr/include breaks libstdc++'s #include_next).
function(_blockflow_fuzz_compile_flags out)
  set(flags)
  foreach(target IN LISTS ARGN)
    get_target_property(defs ${target} INTERFACE_COMPILE_DEFINITIONS)
    foreach(def IN LISTS defs)
      if(def AND NOT def MATCHES "^\\$<")
        list(APPEND flags -D${def})
      endif()
    endforeach()
    get_target_property(dirs ${target} INTERFACE_INCLUDE_DIRECTORIES)
    foreach(dir IN LISTS dirs)
      if(dir AND NOT dir IN_LIST CMAKE_CXX_IMPLICIT_INCLUDE_DIRECTORIES AND NOT dir STREQUAL "/usr/include")
        list(APPEND flags -isystem ${dir})
      endif()
    endforeach()
  endforeach()
  list(REMOVE_DUPLICATES flags)
  set(${out} ${flags} PARENT_SCOPE)
endfunction()

set(_bf_fuzz_deps absl::status absl::statusor absl::strings fmt::fmt)
_blockflow_fuzz_link_items(_bf_fuzz_libs ${_bf_fuzz_deps})
_blockflow_fuzz_compile_flags(_bf_fuzz_cflags ${_bf_fuzz_deps})

set(_bf_fuzz_dir ${PROJECT_BINARY_DIR}/fuzz)
set(_bf_fuzz_exe ${_bf_fuzz_dir}/wire_format_fuzz)
set(_bf_fuzz_corpus ${_bf_fuzz_dir}/wire_format_corpus)
set(_bf_fuzz_sources ${PROJECT_SOURCE_DIR}/lib/channel/wire_format.cpp ${PROJECT_SOURCE_DIR}/tests/fuzz/wire_format_fuzz.cpp)

add_custom_command(
  OUTPUT ${_bf_fuzz_exe}
  COMMAND ${CMAKE_COMMAND} -E make_directory ${_bf_fuzz_dir} ${_bf_fuzz_corpus}
  COMMAND ${BLOCKFLOW_CLANGXX} -std=c++17 -O1 -g -fno-omit-frame-pointer -fsanitize=fuzzer,address
          ${_bf_fuzz_cflags} -I${PROJECT_SOURCE_DIR}/include ${_bf_fuzz_sources} ${_bf_fuzz_libs} -o ${_bf_fuzz_exe}
  DEPENDS ${_bf_fuzz_sources} ${PROJECT_SOURCE_DIR}/include/blockflow/channel/wire_format.hpp
  COMMENT "Building libFuzzer target wire_format_fuzz with ${BLOCKFLOW_CLANGXX}"
  COMMAND_EXPAND_LISTS VERBATIM)
add_custom_target(blockflow_wire_format_fuzz ALL DEPENDS ${_bf_fuzz_exe})

# The corpus lives in the build tree and grows across runs; the fuzzer writes three valid headers
# into it at start-up (BLOCKFLOW_FUZZ_SEED_DIR), so even the first run begins from real frames.
# A crash leaves its input next to the binary (crash-<sha1>), to be replayed with `wire_format_fuzz FILE`.
add_test(NAME fuzz_wire_format
         COMMAND ${_bf_fuzz_exe} -max_total_time=20 -rss_limit_mb=1024 -seed=1 -print_final_stats=1
                 -artifact_prefix=${_bf_fuzz_dir}/ ${_bf_fuzz_corpus}
         WORKING_DIRECTORY ${_bf_fuzz_dir})
set_tests_properties(fuzz_wire_format PROPERTIES
  LABELS fuzz TIMEOUT 120 ENVIRONMENT "BLOCKFLOW_FUZZ_SEED_DIR=${_bf_fuzz_corpus}")
