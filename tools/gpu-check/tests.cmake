# test-backend-ops and the GPU check's op bench only (the sparq-cpp GPU check); they need ggml alone
add_executable(test-backend-ops test-backend-ops.cpp)
target_link_libraries(test-backend-ops PRIVATE ggml)
target_compile_features(test-backend-ops PRIVATE cxx_std_17)
add_executable(sparq-op-bench ${CMAKE_SOURCE_DIR}/sparq/op-bench.cpp)
target_link_libraries(sparq-op-bench PRIVATE ggml)
target_compile_features(sparq-op-bench PRIVATE cxx_std_17)
