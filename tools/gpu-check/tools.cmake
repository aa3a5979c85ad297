# llama-bench only (the sparq-cpp GPU check)
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(llama-bench)
