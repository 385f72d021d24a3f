#!/usr/bin/env python3
"""Router overhead against the same llama.cpp server engine called in-process, in one run.

    python bench/router_bench.py [--requests N] [--out FILE]

For each model size (tiny, and a ~100M-parameter "small" model whose tokens
take milliseconds), measures with the same spec and prompts:
  - p50/p99 latency of short completions (8 tokens), direct vs through the router;
  - streaming tokens/s (64 tokens), direct vs router;
  - time to first token on a cold model: direct (engine load + first token in-process)
    vs router (worker start + load + first token).
Then, on two models that cannot be co-resident (models-max 1): loads per
request under alternating traffic, sequential and with 4 concurrent clients
per model.  Prints a table and writes JSON (default bench/results/router_bench.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from _load import percentile, save

from pyllmrouter import ModelSpec, probe
from pyllmrouter.tools import tinymodels
from pyllmrouter.config import ModelConfig
from pyllmrouter.devices import EmulatedInventory
from pyllmrouter.engine.loader import load, request
from pyllmrouter.router.api import Router
from pyllmrouter.tables import render

SMALL = tinymodels.Shape("llama", n_embd=1024, n_layer=8, n_head=16, n_head_kv=4, n_ff=2816)


def latencies(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def stream_rate(chunks) -> float:
    t0 = time.perf_counter()
    n = sum(1 for c in chunks if c["choices"] and c["choices"][0].get("text"))
    return n / (time.perf_counter() - t0)


def engine_stream(engine, body: dict):
    """The events of a streamed request to an engine in this process (as dicts)."""
    reply = engine.handle("POST", "/v1/completions", {}, {}, json.dumps({**body, "stream": True}).encode())
    more = True
    while more:
        more, chunk = reply.next()
        for line in chunk.decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def bench_size(name: str, spec: ModelSpec, n: int) -> dict:
    """Direct and routed requests interleaved, so both see the same machine noise."""
    kw = dict(max_tokens=8, temperature=0.0)
    inv = EmulatedInventory({"GPU0": 1 << 40})

    def stream_direct():
        return stream_rate(engine_stream(llm, {"prompt": "hello", "max_tokens": 64, "temperature": 0.0}))

    def stream_routed():
        return stream_rate(router.complete("m", "hello", stream=True, max_tokens=64, temperature=0.0))

    t0 = time.perf_counter()
    llm = load(spec)
    next(engine_stream(llm, {"prompt": "hello", **kw}))
    direct_cold = time.perf_counter() - t0
    with Router([ModelConfig("m", spec)], inventory=inv, margin=0) as router:
        t0 = time.perf_counter()
        next(iter(router.complete("m", "hello", stream=True, **kw)))
        router_cold = time.perf_counter() - t0
        direct, routed = [], []
        for _ in range(n):
            direct += latencies(lambda: request(llm, "/v1/completions", {"prompt": "hello", **kw}), 1)
            routed += latencies(lambda: router.complete("m", "hello", **kw), 1)
        rates_direct, rates_routed = [], []
        for _ in range(5):
            rates_direct.append(stream_direct())
            rates_routed.append(stream_routed())
    llm.close()
    direct_rate, routed_rate = statistics.median(rates_direct), statistics.median(rates_routed)
    return {
        "model": name, "requests": n,
        "direct_p50_ms": percentile(direct, 0.5) * 1e3, "direct_p99_ms": percentile(direct, 0.99) * 1e3,
        "router_p50_ms": percentile(routed, 0.5) * 1e3, "router_p99_ms": percentile(routed, 0.99) * 1e3,
        "added_p50_ms": (percentile(routed, 0.5) - percentile(direct, 0.5)) * 1e3,
        "direct_stream_tok_s": direct_rate, "router_stream_tok_s": routed_rate,
        "stream_ratio": routed_rate / direct_rate,
        "direct_cold_ttft_s": direct_cold, "router_cold_ttft_s": router_cold,
    }


def bench_alternating(a: ModelSpec, b: ModelSpec, rounds: int, clients: int) -> dict:
    inv = EmulatedInventory({"GPU0": 1 << 40})
    models = [ModelConfig("a", a), ModelConfig("b", b)]
    out = {}
    with Router(models, inventory=inv, margin=0, max_models=1) as r:
        for i in range(rounds):
            r.complete("a" if i % 2 == 0 else "b", "x", max_tokens=4)
        out["sequential_loads_per_request"] = r.status()["counters"]["loads"] / rounds
    with Router(models, inventory=inv, margin=0, max_models=1, turn=1.0) as r:
        def client(model: str) -> None:
            for _ in range(rounds // 2):
                r.complete(model, "x", max_tokens=4)

        threads = [threading.Thread(target=client, args=(m,)) for m in ("a", "b") for _ in range(clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        total = len(threads) * (rounds // 2)
        out["concurrent_clients_per_model"] = clients
        out["concurrent_requests"] = total
        out["concurrent_loads_per_request"] = r.status()["counters"]["loads"] / total
        out["concurrent_seconds"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "router_bench.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["PYLLMROUTER_CACHE"] = str(Path(tmp) / "cache")
        tiny = tinymodels.write_tiny_set(Path(tmp) / "models")
        small = tinymodels.write_llama(Path(tmp) / "small.gguf", SMALL)
        specs = {"tiny-llama": ModelSpec(tiny["tiny-llama"], n_ctx=1024),
                 "small-llama (100M)": ModelSpec(small, n_ctx=1024)}
        for s in specs.values():
            probe(s)
        rows = [bench_size(name, spec, args.requests if "tiny" in name else max(20, args.requests // 10))
                for name, spec in specs.items()]
        alt = bench_alternating(specs["tiny-llama"], ModelSpec(tiny["tiny-moe"], n_ctx=1024), 40, 4)

    print(render(
        ["model", "direct p50 ms", "router p50 ms", "added p50 ms", "direct p99 ms", "router p99 ms",
         "direct tok/s", "router tok/s", "ratio", "cold TTFT direct s", "cold TTFT router s"],
        [[r["model"], f"{r['direct_p50_ms']:.3f}", f"{r['router_p50_ms']:.3f}", f"{r['added_p50_ms']:.3f}",
          f"{r['direct_p99_ms']:.3f}", f"{r['router_p99_ms']:.3f}", f"{r['direct_stream_tok_s']:.0f}",
          f"{r['router_stream_tok_s']:.0f}", f"{r['stream_ratio']:.3f}", f"{r['direct_cold_ttft_s']:.3f}",
          f"{r['router_cold_ttft_s']:.3f}"] for r in rows]))
    print(f"\nalternating two models, models-max 1: sequential {alt['sequential_loads_per_request']:.2f} "
          f"loads/request; {alt['concurrent_clients_per_model']} clients per model "
          f"({alt['concurrent_requests']} requests): {alt['concurrent_loads_per_request']:.3f} loads/request")
    save(args.out, {"bench": "router", "sizes": rows, "alternating": alt})


if __name__ == "__main__":
    main()
