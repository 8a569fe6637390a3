# ctest helper: cmake --install into BUILD_DIR/_install, then configure, build and run the consumer
# project in tests/consumer with find_package(blockflow).
set(prefix ${BUILD_DIR}/_install)
set(consumer_build ${BUILD_DIR}/_consumer)
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}")
  endif()
endfunction()
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
# Every installed program starts from the prefix alone (no LD_LIBRARY_PATH, no ld.so cache entry):
# each library finds the others beside it. Their usage errors are fine; a loader error is not.
foreach(tool blockflow-loadgen blockflow-plan blockflow-profile blockflow-worker blockflowctl)
  if(EXISTS ${prefix}/bin/${tool})
    execute_process(COMMAND ${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH ${prefix}/bin/${tool} --help
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
    if(rc EQUAL 127 OR err MATCHES "error while loading shared libraries")
      message(FATAL_ERROR "installed ${tool} does not start: ${err}")
    endif()
  endif()
endforeach()
run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer -B ${consumer_build} -G ${GENERATOR}
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=${prefix})
run(${CMAKE_COMMAND} --build ${consumer_build})
# The consumer places a block in a worker: the installed bin/blockflow-worker must be the one found.
run(${consumer_build}/consumer ${MODEL} ${prefix}/bin/blockflow-worker)
