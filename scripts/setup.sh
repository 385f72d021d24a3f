#!/usr/bin/env bash
# Install pyllmrouter into .venv on a fresh machine (Python 3.10+, a C++ compiler).
#
#   scripts/setup.sh               runtime: llama-cpp-python (pinned) + pyllmrouter
#   scripts/setup.sh --test        the same, plus what the tests and benchmarks need
#   scripts/setup.sh --cuda 90     CUDA build for one GPU architecture (90: H100/H200),
#                                  plus nvidia-ml-py; combine with --test for the GPU suite
#   scripts/setup.sh --extra NAME  also the package's extra NAME (gpu-check: what
#                                  scripts/gpu_check.sh runs, without the whole test set)
#   scripts/setup.sh --wheel FILE  llama-cpp-python from this wheel, built before (by
#                                  scripts/wheelhouse.sh --cuda ARCH on another machine):
#                                  nothing of ggml is compiled here
#   scripts/setup.sh --peer        also llama-server linked to that same ggml (the peer the
#                                  benchmarks measure against), built beside the extension
#
# Each part's time is printed ("time: PART N s").  Offline, pip installs from a folder of
# wheels with PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR (scripts/wheelhouse.sh makes one).
#
# llama-cpp-python is built once from its pinned sdist (downloaded through pip,
# checked by sha256 against vendor/pin.json; the build reads its trimmed copy, 4 MB
# instead of 76, vendor/fetch.py trimmed) and the wheel is cached under
# ~/.cache/pyllmrouter/wheels/<hash of CMAKE_ARGS>, so a CUDA build and a CPU
# build never mix.  GPU builds work as llama-cpp-python's do:
#   CMAKE_ARGS="-DGGML_CUDA=on" scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

extras=()
cuda=""
wheel=""
peer=0
while [ $# -gt 0 ]; do
  case "$1" in
    --test) extras+=(test) ;;
    --cuda) cuda="${2:?--cuda needs an architecture, e.g. 90}"; shift ;;
    --extra) extras+=("${2:?--extra needs the name of an extra}"); shift ;;
    --wheel) wheel="${2:?--wheel needs a llama-cpp-python wheel}"; shift ;;
    --peer) peer=1 ;;
    *) echo "usage: scripts/setup.sh [--test] [--cuda ARCH] [--extra NAME] [--wheel FILE] [--peer]" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$cuda" ]; then
  extras+=(nvidia)
  CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$cuda ${CMAKE_ARGS:-}"
fi
venv="${VENV:-.venv}"
cache="${PYLLMROUTER_CACHE:-$HOME/.cache/pyllmrouter}"
t0=$SECONDS
took() { echo "time: $1 $((SECONDS - $2)) s"; }

# VENV_SYSTEM_SITE=1: the environment sees the system's packages (a GPU machine's own numpy,
# pytest...: what a wheelhouse made with --present leaves out)
venv_args=()
[ "${VENV_SYSTEM_SITE:-0}" != 1 ] || venv_args+=(--system-site-packages)
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "${venv_args[@]}" "$venv"
py="$venv/bin/python"
pip() { "$py" -m pip --disable-pip-version-check -q "$@"; }

pip install --upgrade pip
# --no-build-isolation builds sdist-only dependencies (wget) with the venv's own setuptools:
# the one a venv starts with may predate bdist_wheel in setuptools (70.1)
pip install "setuptools>=70.1" "scikit-build-core>=0.10" "pybind11>=2.12"
command -v cmake >/dev/null || pip install "cmake>=3.21"
command -v ninja >/dev/null || pip install ninja

version=$("$py" -c 'import json; print(json.load(open("vendor/pin.json"))["version"])')
# GGML_RPC: rpc-server devices on loopback are the multi-device test bed
args="-DGGML_RPC=ON ${CMAKE_ARGS:-}"
cpu_flags=$(scripts/cpu_flags.sh)  # what ggml needs on this CPU beyond -march=native (AMX off where it faults)
key=$(printf '%s %s %s' "$version" "$args" "$cpu_flags" | sha256sum | cut -c1-16)
took "tools" "$t0"
t=$SECONDS
installed=$("$py" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))' 2>/dev/null || true)
if [ -n "$wheel" ]; then
  case "$(basename "$wheel")" in
    llama_cpp_python-"$version"-*.whl) ;;
    *) echo "--wheel $wheel: not llama-cpp-python $version, the version vendor/pin.json pins" >&2; exit 2 ;;
  esac
  key="prebuilt $(sha256sum < "$wheel" | cut -c1-16)"
  if [ "$installed" != "$version" ] || [ "$(cat "$venv/.llama-cpp-build" 2>/dev/null)" != "$key" ]; then
    pip install --force-reinstall --no-deps "$wheel"
    pip install "$wheel"  # its dependencies
    echo "$key" > "$venv/.llama-cpp-build"
  fi
elif [ "$installed" != "$version" ] || [ "$(cat "$venv/.llama-cpp-build" 2>/dev/null)" != "$key" ]; then
  wheels="$cache/wheels/$key"
  if ! ls "$wheels"/llama_cpp_python-"$version"-*.whl >/dev/null 2>&1; then
    sdist=$("$py" vendor/fetch.py trimmed)  # what the build reads: 4 MB instead of 76
    echo "building llama-cpp-python $version ($args); this takes a few minutes"
    CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
      CFLAGS="$cpu_flags ${CFLAGS:-}" CXXFLAGS="$cpu_flags ${CXXFLAGS:-}" \
      "$py" -m pip wheel -q --no-deps -w "$wheels" "$sdist"
  fi
  pip install --force-reinstall --no-deps "$wheels"/llama_cpp_python-"$version"-*.whl
  pip install "$wheels"/llama_cpp_python-"$version"-*.whl  # its dependencies
  echo "$key" > "$venv/.llama-cpp-build"
fi

# the extension's build reads the pinned source (headers, llama.cpp's common and server)
# even when the wheel came from the cache: the trimmed sdist holds them; llama.cpp's own
# server test suite (scripts/llama_server_suite.py, the test extra) reads the whole one
"$py" vendor/fetch.py trimmed >/dev/null
[[ " ${extras[*]-} " != *" test "* ]] || "$py" vendor/fetch.py sdist >/dev/null
took "llama-cpp-python" "$t"
# the peer, linked to the ggml just installed, compiles beside the extension (both read
# llama.cpp's common and server sources; neither compiles ggml)
peer_pid=""
if [ "$peer" = 1 ]; then
  "$py" vendor/fetch.py source >/dev/null  # extracted once, before the two builds that read it start
  t_peer=$SECONDS
  PYTHON="$py" scripts/build_llama_tools.sh --installed-ggml llama-server > "$venv/.peer-build.log" 2>&1 &
  peer_pid=$!
fi
t=$SECONDS
spec="."
[ ${#extras[@]} -gt 0 ] && spec=".[$(IFS=,; echo "${extras[*]}")]"
pip install --no-build-isolation -e "$spec"
# the package's bytecode, compiled once now as pip does for a wheel: an editable install
# leaves it to the first import, and an environment with PYTHONDONTWRITEBYTECODE set would
# compile every module again in every process (the router's and each worker's start)
"$py" -m compileall -q -j 0 pyllmrouter >/dev/null
took "extension" "$t"
if [ -n "$peer_pid" ]; then
  if wait "$peer_pid"; then
    took "peer" "$t_peer"
    echo "llama-server: $(tail -1 "$venv/.peer-build.log")/llama-server"
  else
    tail -20 "$venv/.peer-build.log" >&2
    echo "building llama-server failed (the log: $venv/.peer-build.log)" >&2
    exit 1
  fi
fi
if [[ " ${extras[*]-} " == *" test "* ]]; then
  # llama.cpp's rpc-server (pinned source): real ggml devices for the multi-device tests;
  # llama-server (pinned source): the peer the parity tests compare our engine's replies with
  PYTHON="$py" scripts/build_llama_tools.sh ggml-rpc-server llama-server >/dev/null
  # the page's tests drive Debian's chromium (no browser download); where apt cannot be
  # used (not root, not Debian) they skip and say why
  if ! command -v chromedriver >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
      || echo "chromium could not be installed: the page's browser tests will skip" >&2
  fi
fi
took "setup" "$t0"
echo "pyllmrouter installed in $venv"
