#!/usr/bin/env bash
# Build llama.cpp's own programs (default: llama-server) from the pinned
# llama-cpp-python sdist's llama.cpp source, into the cache directory; prints
# the bin directory. Used by the benchmarks that compare against llama-server
# and by the rpc-server test bed. Nothing of llama.cpp is committed.
#
#   scripts/build_llama_tools.sh [TARGET ...]      e.g. llama-server rpc-server
#   scripts/build_llama_tools.sh --installed-ggml [TARGET ...]
#       link the programs to the libggml that llama-cpp-python installed (the same
#       backends, a CUDA one included, without compiling ggml a second time: on a GPU
#       machine this saves a whole CUDA build); only llama.cpp's own code is compiled
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-.venv/bin/python}"
export PATH="$(dirname "$py"):$PATH"  # cmake/ninja installed into the virtual environment, if any
cache="${PYLLMROUTER_CACHE:-$HOME/.cache/pyllmrouter}"
src="$cache/llama.cpp-src"
build="$cache/llama.cpp-build"
ggml_args=()
if [ "${1:-}" = "--installed-ggml" ]; then
  shift
  located=$("$py" vendor/fetch.py locate)  # VERSION;SITE_PACKAGES;LIB_DIR of the installed wheel
  site=$(echo "$located" | cut -d';' -f2)
  libdir=$(echo "$located" | cut -d';' -f3)
  build="$cache/llama.cpp-build-installed-ggml-$(printf '%s' "$libdir" | sha256sum | cut -c1-12)"
  ggml_args=(-DLLAMA_USE_SYSTEM_GGML=ON "-Dggml_DIR=$site/lib/cmake/ggml"
             "-DCMAKE_BUILD_RPATH=$libdir" "-DCMAKE_PREFIX_PATH=$site;$site/lib/cmake")
fi
"$py" vendor/fetch.py source --out "$src" >/dev/null  # the trimmed sdist holds what these programs read
targets=("$@")
cpu_flags=$(scripts/cpu_flags.sh)  # as the wheel's ggml is built (setup.sh): the same kernels
ggml_args+=("-DCMAKE_C_FLAGS=$cpu_flags" "-DCMAKE_CXX_FLAGS=$cpu_flags")
[ ${#targets[@]} -gt 0 ] || targets=(llama-server)
cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_RPC=ON ${CMAKE_ARGS:-} "${ggml_args[@]}" >&2
cmake --build "$build" --target "${targets[@]}" -j "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" >&2 \
  || { echo "building ${targets[*]} failed" >&2; exit 1; }
echo "$build/bin"
