#!/usr/bin/env bash
# Compiler flags ggml needs on this machine's CPU beyond -march=native (one line; nothing
# when none): setup.sh builds llama-cpp-python's ggml with them, build_llama_tools.sh
# llama-server and rpc-server, so the engine and its peer run the same kernels.
#
# A CPU with Intel AMX (amx_tile in /proc/cpuinfo): the pinned llama.cpp's AMX kernels
# (ggml-cpu/amx, used for Q4_K and Q8_0 weights) load their tile configuration from a
# stack buffer that GCC may optimise away, and the next tile instruction faults (SIGILL in
# tinygemm_kernel_amx; upstream llama.cpp pull request 26954): ggml is built without AMX
# there, and uses its AVX-512 kernels instead.
set -euo pipefail
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  echo "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
