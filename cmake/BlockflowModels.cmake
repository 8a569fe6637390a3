# Model export as ctest fixtures: nothing generated is committed, the models are written into the
# build tree by Debian's python3-torch when a test that needs them runs.
set(BLOCKFLOW_TEST_MODELS_DIR ${PROJECT_BINARY_DIR}/test_models)
set(BLOCKFLOW_DEMO_MODELS_DIR ${PROJECT_BINARY_DIR}/models)

add_test(NAME export_test_models
         COMMAND ${BLOCKFLOW_PYTHON} ${PROJECT_SOURCE_DIR}/tests/export_test_models.py --out ${BLOCKFLOW_TEST_MODELS_DIR})
set_tests_properties(export_test_models PROPERTIES FIXTURES_SETUP test_models LABELS setup)

add_test(NAME export_demo_models
         COMMAND ${BLOCKFLOW_PYTHON} ${PROJECT_SOURCE_DIR}/scripts/export_models.py --out ${BLOCKFLOW_DEMO_MODELS_DIR})
set_tests_properties(export_demo_models PROPERTIES FIXTURES_SETUP demo_models LABELS setup)
