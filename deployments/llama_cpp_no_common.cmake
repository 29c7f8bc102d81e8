# Included by llama.cpp's CMakeLists.txt right after its project() call when llama-cpp-python is
# built by `make install-llm` (-DCMAKE_PROJECT_llama.cpp_INCLUDE=<this file>, in the Makefile's
# LLAMA_CMAKE_ARGS). llama-cpp-python forces LLAMA_BUILD_COMMON on, but its Python package loads only
# libllama and libggml*: llama.cpp's `common` library (its CLI and server helpers: argument parsing,
# chat templates, JSON schemas, HTTP) is compiled and shipped unused. A normal variable shadows the
# forced cache entry in llama.cpp's directory scope, so `common` is neither compiled nor installed.
set(LLAMA_BUILD_COMMON OFF)
