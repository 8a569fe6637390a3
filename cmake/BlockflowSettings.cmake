# Private compile settings for BlockFlow's own targets (library, tests, examples, benchmarks).
# Consumers of the installed package never see these flags.
add_library(blockflow_settings INTERFACE)
target_compile_features(blockflow_settings INTERFACE cxx_std_17)
target_compile_options(blockflow_settings INTERFACE -Wall -Wextra -Wpedantic -Wno-unused-parameter)
if(BLOCKFLOW_WARNINGS_AS_ERRORS)
  target_compile_options(blockflow_settings INTERFACE -Werror)
endif()
