#!/usr/bin/env python3
"""Per-request overhead, in one run: the engine in-process, our Python API, our HTTP
server, llama-server, and llama-server in router mode (the same job as ours: models
behind one address, one hop to the engine).

    scripts/build_llama_tools.sh llama-server    # once: llama.cpp of the pinned sdist
    python bench/http_bench.py [--requests N] [--rounds R] [--clients 1,8,16,64] [--model tiny|100m] [--out FILE]
    python bench/http_bench.py --gpu     # every layer on the GPU (CUDA builds of both); the
                                         # Python API's path is left out (its router would
                                         # need the real devices beside the HTTP servers)

Short completions (8 tokens, greedy) on the tiny llama, with the same llama-server
arguments everywhere (4 slots), at 1 and 16 concurrent clients; each path is
measured in every round, in an order that rotates, so all paths see the same
machine.  HTTP clients use one httpx connection each.  Prints a table (p50/p99
per request and requests/s, and the ratio of our HTTP p50 to each llama-server's,
per round and as a geometric mean; and for the routers, the CPU their own process
spent per request, engines aside) and writes JSON (default
bench/results/http_bench.json).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx
from _load import own_cpu, percentile, ratio_interval, run_clients, save, thread_cpu

from pyllmrouter import ModelSpec
from pyllmrouter.tools import tinymodels
from pyllmrouter.config import ModelConfig
from pyllmrouter.devices import EmulatedInventory
from pyllmrouter.engine.loader import engine_args, load, request
from pyllmrouter.tools.loopback import free_port, llama_tool, start_serve, wait_healthy
from pyllmrouter.router.api import Router
from pyllmrouter.tables import render

BODY = {"prompt": "hello", "max_tokens": 8, "temperature": 0.0}
# "HTTP": ours (a worker writes the response on the client's connection, and reads the next
# requests like it there itself); "HTTP no follow": ours with --follow-ms 0 (the router reads
# every request); "HTTP relay": ours with --no-native (every response relayed through the
# router process, the path before)
PATHS = ("engine in-process", "python API", "HTTP", "HTTP no follow", "HTTP relay", "llama-server",
         "llama-server router")
SHAPES = {"tiny": None, "100m": tinymodels.LLAMA_100M}


def measure(fn, clients: int, per_client: int, router_pid: int | None = None, procs: int = 1) -> dict:
    """Latency and rate; with ``router_pid``, the CPU that process itself (its children
    aside: a router's, not its engines') spent per request."""
    before = thread_cpu(router_pid) if router_pid else {}
    run = run_clients(fn, clients, per_client, errors=(httpx.HTTPError,), procs=procs)
    out = {"p50_ms": percentile(run.seconds, 0.5) * 1e3, "p99_ms": percentile(run.seconds, 0.99) * 1e3,
           "req_s": len(run.seconds) / run.wall, "errors": len(run.errors), "first_errors": run.errors[:3]}
    if router_pid:
        own = own_cpu(before, thread_cpu(router_pid), router_pid)
        out["router_cpu_us"] = 1e6 * own / max(1, len(run.seconds))
    return out


@dataclass(frozen=True)
class HttpCall:
    """The calls of a client (``run_clients``): BODY posted on one connection; the status each.
    A plain class, so that client processes (``--client-procs``) make their own."""

    base: str

    def __call__(self, _i: int) -> Callable[[], int]:
        c = httpx.Client(base_url=self.base, timeout=60)
        return lambda: c.post("/v1/completions", json={"model": "m", **BODY}).raise_for_status().status_code


def gmean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=96, help="requests per path, level and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", default="1,16", help="concurrency levels, comma-separated")
    ap.add_argument("--model", choices=sorted(SHAPES), default="tiny",
                    help="tiny (2 layers: the path around the engine is what is measured) or 100m")
    ap.add_argument("--gpu", action="store_true", help="every layer on the GPU, in every path")
    ap.add_argument("--client-procs", type=int, default=1,
                    help="spread the HTTP clients over this many processes (default 1: threads of this one)")
    ap.add_argument("--llama-server", type=Path, default=llama_tool("llama-server"))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "http_bench.json")
    args = ap.parse_args()
    paths = tuple(p for p in PATHS if not (args.gpu and p == "python API"))
    if not args.llama_server.exists():
        raise SystemExit(f"{args.llama_server} not found: run scripts/build_llama_tools.sh llama-server first")
    results: dict[tuple[int, str], list[dict]] = {}
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["PYLLMROUTER_CACHE"] = str(Path(tmp) / "cache")
        path = (tinymodels.write_tiny_set(Path(tmp) / "models")["tiny-llama"] if SHAPES[args.model] is None
                else tinymodels.write_llama(Path(tmp) / "m.gguf", SHAPES[args.model]))
        spec = ModelSpec(path, n_ctx=1024, n_gpu_layers=-1 if args.gpu else None)
        preset = Path(tmp) / "p.ini"
        preset.write_text(f"[m]\nmodel = {path}\nc = 1024\nnp = 4\nkv-unified = true\nfit = off\n"
                          + ("ngl = all\n" if args.gpu else "") + "load-on-startup = true\n")
        devices = [] if args.gpu else ["--emulate-devices", "GPU0=1TiB"]
        engine = load(spec, name="m")
        router = None if args.gpu else Router([ModelConfig("m", spec)], inventory=EmulatedInventory({"GPU0": 1 << 40}),
                                              margin=0)
        try:
            ours, ours_base = start_serve(["--models-preset", str(preset), *devices])
            procs.append(ours)
            relay, relay_base = start_serve(["--models-preset", str(preset), *devices, "--no-native"])
            procs.append(relay)
            unfollowed, unfollowed_base = start_serve(["--models-preset", str(preset), *devices, "--follow-ms", "0"])
            procs.append(unfollowed)
            single_port, router_port = free_port(), free_port()
            single = subprocess.Popen([str(args.llama_server), *engine_args(spec, "m"), "--host", "127.0.0.1",
                                       "--port", str(single_port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(single)
            theirs = subprocess.Popen([str(args.llama_server), "--models-preset", str(preset), "--host", "127.0.0.1",
                                       "--port", str(router_port), "--models-max", "1"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(theirs)
            bases = {"HTTP": ours_base, "HTTP no follow": unfollowed_base, "HTTP relay": relay_base,
                     "llama-server": f"http://127.0.0.1:{single_port}",
                     "llama-server router": f"http://127.0.0.1:{router_port}"}
            # the process that routes (its engines are its children): CPU per request is counted for it
            router_pids = {"HTTP": ours.pid, "HTTP no follow": unfollowed.pid, "HTTP relay": relay.pid,
                           "llama-server router": theirs.pid}
            wait_healthy(bases["llama-server"], single)
            wait_healthy(bases["llama-server router"], theirs)
            calls = {
                "engine in-process": lambda _i: lambda: request(engine, "/v1/completions", BODY),
                **({} if router is None else
                   {"python API": lambda _i: lambda: router.complete("m", "hello", max_tokens=8, temperature=0.0)}),
                **{name: HttpCall(base) for name, base in bases.items()},
            }
            for name, make in calls.items():  # warm: models loaded, slots used once
                measure(make, 4, 2)
            for rnd in range(args.rounds):
                for clients in [int(c) for c in args.clients.split(",")]:
                    per = max(1, args.requests // clients)
                    order = paths[rnd % len(paths):] + paths[:rnd % len(paths)]
                    for name in order:
                        results.setdefault((clients, name), []).append(  # in-process paths: threads
                            measure(calls[name], clients, per, router_pids.get(name),
                                    args.client_procs if name in bases else 1))
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(30)
            if router is not None:
                router.close()
            engine.close()
    rows, table = [], []
    for (clients, name), rounds in results.items():
        ours = results[(clients, "HTTP")]
        rate = ratio_interval([o["req_s"] for o in ours], [r["req_s"] for r in rounds])
        row = {"path": name, "clients": clients,
               "p50_ms": gmean([r["p50_ms"] for r in rounds]), "p99_ms": max(r["p99_ms"] for r in rounds),
               "req_s": gmean([r["req_s"] for r in rounds]), "errors": sum(r["errors"] for r in rounds),
               "our_http_p50_ratio": gmean([o["p50_ms"] / r["p50_ms"] for o, r in zip(ours, rounds)]),
               "our_http_req_s_ratio": list(rate), "rounds": rounds}
        cpu = [r["router_cpu_us"] for r in rounds if "router_cpu_us" in r]
        row["router_cpu_us"] = statistics.median(cpu) if cpu else None
        rows.append(row)
        table.append([name, clients, f"{row['p50_ms']:.2f}", f"{row['p99_ms']:.2f}", f"{row['req_s']:.1f}",
                      f"{row['our_http_p50_ratio']:.2f}", f"{rate[0]:.2f} [{rate[1]:.2f}, {rate[2]:.2f}]",
                      "-" if row["router_cpu_us"] is None else f"{row['router_cpu_us']:.0f}", row["errors"]])
    print(render(["path", "clients", "p50 ms", "p99 ms (max)", "req/s", "our HTTP p50 / this p50",
                  "our HTTP req/s / this [95% CI]", "router process CPU us/request (median)", "failed requests"],
                 table))
    for row in rows:
        for e in sorted({e for r in row["rounds"] for e in r["first_errors"]})[:3]:
            print(f"  {row['path']}, {row['clients']} clients: {e}")
    save(args.out, {"bench": "http", "model": args.model, "gpu": args.gpu, "rows": rows})


if __name__ == "__main__":
    main()
