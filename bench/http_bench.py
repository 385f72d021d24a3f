#!/usr/bin/env python3
"""HTTP overhead: direct llama_cpp.Llama vs the Python API vs HTTP, in one run.

    python bench/http_bench.py [--requests N] [--out FILE]

Short completions (8 tokens) on the tiny llama, at 1 and 16 concurrent clients.
Direct calls share one Llama behind a lock (a Llama serves one request at a
time, as a worker's model does).  The HTTP server runs as ``pyllmrouter
serve`` in its own process; clients use one httpx connection each.  Prints a
table and writes JSON (default bench/results/http_bench.json).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
from pathlib import Path

import httpx
from _load import percentile, run_clients

from pyllmrouter import ModelSpec, tinymodels
from pyllmrouter.config import ModelConfig
from pyllmrouter.devices import EmulatedInventory
from pyllmrouter.loader import load
from pyllmrouter.loopback import start_serve
from pyllmrouter.router import Router
from pyllmrouter.tables import render

KW = dict(max_tokens=8, temperature=0.0)


def measure(fn, clients: int, per_client: int) -> dict:
    run = run_clients(fn, clients, per_client)
    return {"p50_ms": percentile(run.seconds, 0.5) * 1e3, "p99_ms": percentile(run.seconds, 0.99) * 1e3,
            "req_s": len(run.seconds) / run.wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=160, help="requests per concurrency level")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "http_bench.json")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["PYLLMROUTER_CACHE"] = str(Path(tmp) / "cache")
        path = tinymodels.write_tiny_set(Path(tmp) / "models")["tiny-llama"]
        spec = ModelSpec(path, n_ctx=1024)

        llm, llm_lock = load(spec), threading.Lock()

        def direct(_i):
            def call():
                with llm_lock:
                    llm.create_completion("hello", **KW)
            return call

        router = Router([ModelConfig("m", spec)], inventory=EmulatedInventory({"GPU0": 1 << 40}), margin=0)
        router.complete("m", "hello", **KW)

        def api(_i):
            return lambda: router.complete("m", "hello", **KW)

        preset = Path(tmp) / "p.ini"
        preset.write_text(f"[m]\nmodel = {path}\nc = 1024\n")
        server, base = start_serve(["--models-preset", str(preset), "--emulate-devices", "GPU0=1TiB"])
        try:
            httpx.post(base + "/v1/completions", json={"model": "m", "prompt": "hello", **KW}, timeout=60)

            def http(_i):
                c = httpx.Client(base_url=base, timeout=60)
                return lambda: c.post("/v1/completions", json={"model": "m", "prompt": "hello", **KW}).raise_for_status()

            for clients in (1, 16):
                per = max(1, args.requests // clients)
                for name, fn in (("direct llama_cpp", direct), ("python API", api), ("HTTP", http)):
                    rows.append({"path": name, "clients": clients, **measure(fn, clients, per)})
        finally:
            server.terminate()
            server.wait(30)
            router.close()
            llm.close()
    base_rows = {(r["clients"], r["path"]): r for r in rows}
    for r in rows:
        d = base_rows[(r["clients"], "direct llama_cpp")]
        a = base_rows[(r["clients"], "python API")]
        r["added_vs_direct_p50_ms"] = r["p50_ms"] - d["p50_ms"]
        r["added_vs_api_p50_ms"] = r["p50_ms"] - a["p50_ms"]
    print(render(["path", "clients", "p50 ms", "p99 ms", "req/s", "+p50 vs direct ms", "+p50 vs API ms"],
                 [[r["path"], r["clients"], f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['req_s']:.1f}",
                   f"{r['added_vs_direct_p50_ms']:.2f}", f"{r['added_vs_api_p50_ms']:.2f}"] for r in rows]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"bench": "http", "rows": rows}, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
