# Install rules and the package config, so find_package(blockflow) works for an installed copy.
include(CMakePackageConfigHelpers)

set(_bf_installed blockflow_core)
if(TARGET blockflow_zmq)
  list(APPEND _bf_installed blockflow_channels blockflow_workers blockflow_plan blockflow_zmq blockflow-worker blockflow-profile blockflow-plan blockflow-loadgen blockflowctl)  # executables go to bin/
endif()
install(TARGETS ${_bf_installed} EXPORT blockflowTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
if(TARGET blockflow_worker_runtime)  # loaded by bin/blockflow-worker from ../lib
  install(TARGETS blockflow_worker_runtime LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
endif()
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/blockflow DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT blockflowTargets NAMESPACE blockflow:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/blockflow)

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/blockflowConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/blockflowConfig.cmake
                              INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/blockflow)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/blockflowConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/blockflowConfig.cmake ${PROJECT_BINARY_DIR}/blockflowConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/blockflow)
install(FILES ${PROJECT_SOURCE_DIR}/LICENSE ${PROJECT_SOURCE_DIR}/docs/wire-format.md DESTINATION ${CMAKE_INSTALL_DATADIR}/doc/blockflow)

if(BLOCKFLOW_BUILD_TESTS)
  # Installs this build into a private prefix and builds tests/consumer against it.
  add_test(NAME install_consumer
           COMMAND ${CMAKE_COMMAND} -DBUILD_DIR=${PROJECT_BINARY_DIR} -DSOURCE_DIR=${PROJECT_SOURCE_DIR}
                   -DGENERATOR=${CMAKE_GENERATOR} -DMODEL=${BLOCKFLOW_TEST_MODELS_DIR}/cnn_block1.pt
                   -P ${PROJECT_SOURCE_DIR}/cmake/RunConsumerTest.cmake)
  set_tests_properties(install_consumer PROPERTIES LABELS "cpu;install" TIMEOUT 600
                       PASS_REGULAR_EXPRESSION "consumer: ok" FIXTURES_REQUIRED test_models)
endif()
