#!/usr/bin/env python3
"""One hot model under many clients, with replicas = 1 and replicas = 2, side by side.

    python bench/replica_bench.py [--clients 16] [--requests-per-client 4] [--rounds 3] [--tokens 32]
                                  [--threads 1] [--gpu]

Two devices (emulated GPUs, each with room for one instance; --gpu: the machine's own),
one model (the 100M generated llama), each configuration served by ``pyllmrouter serve``
from a preset that differs in ``replicas`` alone.  The clients stream completions; per
round and configuration: requests/s, p50/p99 latency, and the router's loads and
evictions.  The rounds alternate the order.  On a CPU machine the instances share the
cores: ``--threads`` per instance (default 1) is what each would have of a device of its
own, so replicas = 2 shows what a second device adds where the first one is the limit.
Writes JSON (default bench/results/replica_bench.json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from _load import percentile, ratio_interval, run_clients, save, stream_sse

from pyllmrouter.tables import render
from pyllmrouter.tools import tinymodels
from pyllmrouter.tools.loopback import start_serve



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--gpu", action="store_true", help="the machine's devices, every layer offloaded")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "replica_bench.json")
    args = ap.parse_args()
    runs: dict[int, list[dict]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        model = tinymodels.write_llama(Path(tmp) / "hot.gguf", tinymodels.LLAMA_100M)
        servers = {}
        try:
            for n in (1, 2):
                preset = Path(tmp) / f"r{n}.ini"
                preset.write_text(f"[hot]\nmodel = {model}\nc = 4096\nnp = {args.parallel}\nt = {args.threads}\n"
                                  f"tb = {args.threads}\nngl = {'all' if args.gpu else '0'}\nreplicas = {n}\n"
                                  "load-on-startup = true\n")
                devices = [] if args.gpu else ["--emulate-devices", "GPU0=4GiB,GPU1=4GiB", "--models-memory-margin",
                                               "0"]
                servers[n] = start_serve(["--models-preset", str(preset), "--no-models-cache", *devices],
                                         env={**os.environ, "PYLLMROUTER_CACHE": str(Path(tmp) / f"c{n}")})
            for rnd in range(args.rounds):
                for n in ((1, 2) if rnd % 2 == 0 else (2, 1)):
                    base = servers[n][1]

                    def make(_i, base=base):
                        client = httpx.Client(base_url=base, timeout=600)
                        body = {"model": "hot", "prompt": "hello world " * 8, "max_tokens": args.tokens,
                                "temperature": 0, "stream": True, "ignore_eos": True}

                        def call():
                            t0 = time.perf_counter()
                            stream_sse(client, "/v1/completions", body,
                                       lambda e: e["choices"][0].get("text") if e["choices"] else None)
                            return time.perf_counter() - t0
                        return call
                    run = run_clients(make, args.clients, args.requests_per_client, errors=(httpx.HTTPError,))
                    events = httpx.get(base + "/events", timeout=30).json()["data"]
                    runs[n].append({"req_s": len(run.values) / run.wall, "p50_s": percentile(run.values, 0.5),
                                    "p99_s": percentile(run.values, 0.99), "errors": len(run.errors),
                                    "loads": sum(e["event"] == "load" for e in events),
                                    "evictions": sum(e["event"] == "evict" for e in events),
                                    "instances": sum(1 for e in events if e["event"] == "replica-start")})
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(30)
    rows = []
    for n in (1, 2):
        rs = runs[n]
        rows.append([n, f"{statistics.fmean(r['req_s'] for r in rs):.2f}",
                     f"{statistics.median(r['p50_s'] for r in rs) * 1e3:.0f}",
                     f"{max(r['p99_s'] for r in rs) * 1e3:.0f}", rs[-1]["loads"], rs[-1]["evictions"],
                     sum(r["errors"] for r in rs)])
    gm, lo, hi = ratio_interval([r["req_s"] for r in runs[2]], [r["req_s"] for r in runs[1]])
    print(render(["replicas", "req/s", "p50 ms", "p99 ms (max)", "loads", "evictions", "failed"], rows))
    print(f"\nreplicas = 2 over replicas = 1, requests/s per round: {gm:.2f} [{lo:.2f}, {hi:.2f}] (95% CI)")
    save(args.out, {"bench": "replicas", "clients": args.clients, "threads": args.threads,
                    "gpu": args.gpu, "runs": runs, "ratio": [gm, lo, hi]})


if __name__ == "__main__":
    main()
