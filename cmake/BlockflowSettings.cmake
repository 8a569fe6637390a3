# Private compile settings for BlockFlow's own targets (library, tests, examples, benchmarks).
# Consumers of the installed package never see these flags.
add_library(blockflow_settings INTERFACE)
target_compile_features(blockflow_settings INTERFACE cxx_std_17)
target_compile_options(blockflow_settings INTERFACE -Wall -Wextra -Wpedantic -Wno-unused-parameter)
if(BLOCKFLOW_WARNINGS_AS_ERRORS)
  target_compile_options(blockflow_settings INTERFACE -Werror)
endif()
# A unity build (CMAKE_UNITY_BUILD, as scripts/sanitize.sh makes) compiles each .cpp included from
# a generated file, where GCC takes an anonymous-namespace member type for one from a header.
if(CMAKE_UNITY_BUILD AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  target_compile_options(blockflow_settings INTERFACE -Wno-subobject-linkage)
endif()
