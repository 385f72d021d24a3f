#!/usr/bin/env bash
# Install pyllmrouter into .venv on a fresh machine (Python 3.10+, a C++ compiler).
#
#   scripts/setup.sh          runtime: llama-cpp-python (pinned) + pyllmrouter
#   scripts/setup.sh --test   the same, plus what the tests and benchmarks need
#
# llama-cpp-python is built once from its pinned sdist (downloaded through pip,
# checked by sha256 against vendor/pin.json) and the wheel is cached under
# ~/.cache/pyllmrouter/wheels/<hash of CMAKE_ARGS>, so a CUDA build and a CPU
# build never mix.  GPU builds work as llama-cpp-python's do:
#   CMAKE_ARGS="-DGGML_CUDA=on" scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
venv="${VENV:-.venv}"
cache="${PYLLMROUTER_CACHE:-$HOME/.cache/pyllmrouter}"

[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
py="$venv/bin/python"
pip() { "$py" -m pip --disable-pip-version-check -q "$@"; }

pip install --upgrade pip
pip install "scikit-build-core>=0.10" "pybind11>=2.12"
command -v cmake >/dev/null || pip install "cmake>=3.21"
command -v ninja >/dev/null || pip install ninja

version=$("$py" -c 'import json; print(json.load(open("vendor/pin.json"))["version"])')
if [ "$("$py" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))' 2>/dev/null)" != "$version" ]; then
  # GGML_RPC: rpc-server devices on loopback are the multi-device test bed
  args="-DGGML_RPC=ON ${CMAKE_ARGS:-}"
  key=$(printf '%s %s' "$version" "$args" | sha256sum | cut -c1-16)
  wheels="$cache/wheels/$key"
  if ! ls "$wheels"/llama_cpp_python-"$version"-*.whl >/dev/null 2>&1; then
    sdist=$("$py" vendor/fetch.py sdist)
    echo "building llama-cpp-python $version ($args); this takes a few minutes"
    CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
      "$py" -m pip wheel -q --no-deps -w "$wheels" "$sdist"
  fi
  pip install "$wheels"/llama_cpp_python-"$version"-*.whl
fi

# the staging header needs the sdist even when the wheel came from the cache
"$py" vendor/fetch.py sdist >/dev/null
pip install --no-build-isolation -e ".$extras"
echo "pyllmrouter installed in $venv"
