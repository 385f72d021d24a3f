#!/usr/bin/env bash
# What scripts/gpu_check.sh installs, in one folder, for a GPU machine with no network:
#
#   scripts/wheelhouse.sh [--out DIR] [--python X.Y] [--cuda ARCH] [--present NAMES]
#
#   DIR/*.whl      the package's dependencies, the gpu-check extra's and what the build of
#                  the extension needs (scikit-build-core, pybind11, setuptools), as binary
#                  wheels for CPython X.Y (default: this machine's) on manylinux x86_64
#   DIR/sdist/     the trimmed llama-cpp-python sdist (vendor/fetch.py trimmed): the sources
#                  of the wheel, of the extension and of the peer (llama-server), 4 MB
#   DIR/cuda/      with --cuda ARCH: llama-cpp-python built HERE with CUDA for that one
#                  architecture (no GPU needed: nvcc, cuBLAS's headers and a libcuda to link),
#                  so that the lent GPU machine compiles no CUDA at all; the CPU kernels are
#                  built for x86-64-v3 (AVX2, FMA, F16C), not for this machine's processor.
#                  The wheel (256 MB: a wheel holds no links, each library is there six
#                  times) is kept folded, scripts/wheelpack.py: 42 MB for sm_90
#   --present      the distributions the target's Python already has (comma-separated, or
#                  @FILE, one per line): not downloaded, and the check's virtual environment
#                  then sees the system's packages (DIR/system-site); what travels to a
#                  machine that takes 64 MiB at most
#
#   scripts/gpu_check.sh --wheelhouse DIR     installs from it, with the package index off
#
# The CUDA toolkit is CUDAToolkit_ROOT, else the one nvcc on the PATH belongs to.  Where it
# lacks cuBLAS (a toolkit installed from pip wheels), cuBLAS's wheel for the same CUDA is
# fetched into the cache; libcuda.so must be in the toolkit's lib64/stubs, the system's
# libraries or CUDA_DRIVER_LIB (on Debian: `apt-get download libcuda1` from non-free, then
# `dpkg -x`).  The build directory is kept in the cache: a second run compiles what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
out="wheelhouse"
pyver=""
arch=""
present=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="${2:?--out needs a directory}"; shift ;;
    --python) pyver="${2:?--python needs a version, e.g. 3.12}"; shift ;;
    --cuda) arch="${2:?--cuda needs an architecture, e.g. 90}"; shift ;;
    --present) present="${2:?--present needs names}"; shift ;;
    *) echo "usage: scripts/wheelhouse.sh [--out DIR] [--python X.Y] [--cuda ARCH] [--present NAMES]" >&2; exit 2 ;;
  esac
  shift
done
py="${PYTHON:-.venv/bin/python}"
[ -x "$py" ] || py=$(command -v python3)
py=$(cd "$(dirname "$py")" && pwd)/$(basename "$py")
[ -n "$pyver" ] || pyver=$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
cache="${PYLLMROUTER_CACHE:-$HOME/.cache/pyllmrouter}"
mkdir -p "$out/sdist"
out=$(cd "$out" && pwd)
t0=$SECONDS

# -- the wheels: what pyproject.toml asks for, read from it (llama-cpp-python apart: built) --
mapfile -t reqs < <("$py" - <<'EOF'
import tomllib, pathlib
p = tomllib.loads(pathlib.Path("pyproject.toml").read_text())
reqs = p["project"]["dependencies"] + p["project"]["optional-dependencies"]["gpu-check"]
reqs += p["build-system"]["requires"] + ["setuptools>=70.1", "ninja"]
for r in reqs:
    if not r.startswith("llama-cpp-python"):
        print(r)
EOF
)
# llama-cpp-python's own dependencies (its wheel is installed with them)
reqs+=("typing-extensions>=4.5" "diskcache>=5.6.1" "jinja2>=2.11.3")
platforms=()
for n in 17 24 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
echo "wheels for CPython $pyver: ${reqs[*]}"
"$py" -m pip download --disable-pip-version-check -q --only-binary=:all: --implementation cp \
  --python-version "$pyver" "${platforms[@]}" -d "$out" "${reqs[@]}"
cp "$("$py" vendor/fetch.py trimmed)" "$out/sdist/"
rm -f "$out/system-site"
if [ -n "$present" ]; then  # what the target has: not carried
  [ "${present#@}" = "$present" ] || present=$(tr '\n' ',' < "${present#@}")
  "$py" -c '
import pathlib, re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).strip().lower()
out, names = pathlib.Path(sys.argv[1]), {norm(n) for n in sys.argv[2].split(",") if n.strip()}
for whl in out.glob("*.whl"):
    if norm(whl.name.split("-")[0]) in names:
        whl.unlink()
' "$out" "$present"
  echo "$present" > "$out/system-site"
fi
echo "wheels and the trimmed sdist: $(du -sh "$out" | cut -f1) in $((SECONDS - t0)) s"

# -- the CUDA build of llama-cpp-python ------------------------------------------------------
if [ -n "$arch" ]; then
  root="${CUDAToolkit_ROOT:-}"
  if [ -z "$root" ] && command -v nvcc >/dev/null; then  # where nvcc says it lives (it may be a wrapper)
    top=$(nvcc --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
    [ -n "$top" ] && root=$(cd "$top" && pwd -P)
  fi
  [ -n "$root" ] && [ -x "$root/bin/nvcc" ] || { echo "no CUDA toolkit: put nvcc on the PATH or set CUDAToolkit_ROOT" >&2; exit 1; }
  cuda_ver=$("$root/bin/nvcc" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')
  major=${cuda_ver%%.*}
  # a toolkit of our own beside the cache: the given one, cuBLAS if it lacks it, libcuda to link
  kit="$cache/cuda-$cuda_ver"
  if [ ! -e "$kit/.complete" ]; then
    rm -rf "$kit"; mkdir -p "$kit"
    cp -a "$root/." "$kit/"
    inc="$kit/include"; lib="$kit/lib64"
    [ -d "$kit/targets/x86_64-linux/include" ] && inc="$kit/targets/x86_64-linux/include" && lib="$kit/targets/x86_64-linux/lib"
    if [ ! -e "$inc/cublas_v2.h" ]; then
      name="nvidia-cublas"; [ "$major" -ge 13 ] || name="nvidia-cublas-cu$major"
      echo "the toolkit has no cuBLAS: $name==$cuda_ver.* from its wheel"
      tmp=$(mktemp -d)
      "$py" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: -d "$tmp" "$name==$cuda_ver.*"
      (cd "$tmp" && "$py" -m zipfile -e ./*.whl x)
      cp -a "$tmp"/x/nvidia/*/include/. "$inc/"
      cp -a "$tmp"/x/nvidia/*/lib/. "$lib/"
      for f in "$lib"/libcublas*.so.*; do ln -sf "$(basename "$f")" "${f%%.so.*}.so"; done
      rm -rf "$tmp"
    fi
    driver="${CUDA_DRIVER_LIB:-}"
    [ -n "$driver" ] || driver=$(ls "$kit"/lib64/stubs/libcuda.so "$kit"/targets/x86_64-linux/lib/stubs/libcuda.so 2>/dev/null | head -1 || true)
    [ -n "$driver" ] || driver=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so(\.1)? / {print $NF; exit}')
    if [ -z "$driver" ]; then
      echo "no libcuda.so to link ggml's CUDA backend with: set CUDA_DRIVER_LIB (the toolkit's stubs," \
           "or the driver's; on Debian: apt-get download libcuda1 from non-free, then dpkg -x)" >&2
      exit 1
    fi
    mkdir -p "$lib/stubs"
    [ -e "$lib/stubs/libcuda.so" ] || cp -L "$driver" "$lib/stubs/libcuda.so"
    touch "$kit/.complete"
  fi
  version=$("$py" -c 'import json; print(json.load(open("vendor/pin.json"))["version"])')
  # a fixed source and build directory: a second run compiles only what changed
  src="$cache/cuda-wheel-src"
  build="$cache/cuda-wheel-build-$arch"
  if [ ! -e "$src/.from" ] || [ "$(cat "$src/.from")" != "$(sha256sum < "$out/sdist/"*.tar.gz)" ]; then
    rm -rf "$src"; mkdir -p "$src"
    tar -xzf "$out"/sdist/*.tar.gz -C "$src" --strip-components=1
    sha256sum < "$out/sdist/"*.tar.gz > "$src/.from"
  fi
  mkdir -p "$out/cuda"
  rm -f "$out"/cuda/*.whl "$out"/cuda/*.whl.tar.xz
  echo "building llama-cpp-python $version with CUDA $cuda_ver for sm_$arch ($(nproc) cores; build directory $build)"
  b0=$SECONDS
  PATH="$kit/bin:$(dirname "$py"):$PATH" CUDAToolkit_ROOT="$kit" CUDACXX="$kit/bin/nvcc" \
    CMAKE_ARGS="-DGGML_RPC=ON -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$arch -DGGML_NATIVE=OFF -DCUDAToolkit_ROOT=$kit" \
    CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
    "$py" -m pip wheel --disable-pip-version-check -q --no-deps --no-build-isolation -w "$out/cuda" \
      -C build-dir="$build" "$src"
  whl=$(ls "$out"/cuda/*.whl)
  echo "built in $((SECONDS - b0)) s: $whl ($(du -h "$whl" | cut -f1)); per part: $py scripts/build_times.py $build"
  "$py" scripts/wheelpack.py pack "$whl" "$whl.tar.xz" && rm "$whl"
  echo "folded: $whl.tar.xz ($(du -h "$whl.tar.xz" | cut -f1))"
fi
echo "wheelhouse in $out ($(du -sh "$out" | cut -f1)), $((SECONDS - t0)) s"
