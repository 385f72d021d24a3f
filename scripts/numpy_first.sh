#!/usr/bin/env bash
# numpy imported before llama.cpp's libraries, and where a crash there comes from.
#
#   scripts/numpy_first.sh PYTHON OUT_DIR
#
# Imports numpy, then the extension (and, apart, llama_cpp), each in a fresh interpreter.
# Where one dies, the same again with the loader's trace (LD_DEBUG=files: which library
# was loaded and initialised last), and with cuda-gdb's backtrace where it is installed
# (it debugs host code too): OUT_DIR/numpy-first-*.txt.  Exit 1 if any died.
set -uo pipefail
py="${1:?PYTHON}"
out="${2:?OUT_DIR}"
mkdir -p "$out"
rc=0
for what in "pyllmrouter._native" "llama_cpp.llama_cpp"; do
  code="import numpy; import $what; print('$what after numpy: ok')"
  if "$py" -X faulthandler -c "$code"; then
    continue
  fi
  rc=1
  tag=${what//./-}
  echo "$what after numpy died; tracing it into $out/numpy-first-$tag-*.txt"
  LD_DEBUG=files "$py" -X faulthandler -c "$code" > "$out/numpy-first-$tag-ld-debug.txt" 2>&1
  tail -15 "$out/numpy-first-$tag-ld-debug.txt"
  # importing llama_cpp initialises ggml's CUDA backend (cuInit) with numpy's OpenBLAS threads
  # already running: the same with one OpenBLAS thread, and with OpenBLAS loaded but no pool
  for env in OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1; do
    if env "$env" "$py" -c "$code" > /dev/null 2>&1; then
      echo "$what after numpy with $env: ok"
    else
      echo "$what after numpy with $env: died too"
    fi
  done
  if command -v cuda-gdb >/dev/null; then
    timeout 120 cuda-gdb -q -batch -ex run -ex bt -ex "info sharedlibrary" --args "$py" -c "$code" \
      > "$out/numpy-first-$tag-backtrace.txt" 2>&1
    grep -A25 "^#0" "$out/numpy-first-$tag-backtrace.txt" | head -30
  fi
done
exit "$rc"
