#!/usr/bin/env python3
"""Many models on a Ray cluster: pyllmrouter (memory-aware request router, one
Router per node) against Ray Serve's own model multiplexing (count-based LRU per
replica), on the same local cluster and the same workload, one after the other.

The cluster: a head and three nodes, each with one emulated device (32, 48 and
96 MiB; this machine has no GPU).  Seven models of mixed sizes (5 to 51 MiB by the
probe, 144 MiB in all: placed by memory, all of them fit at once) from the tiny
generated GGUFs, and a skewed request mix (the smallest model most asked for).
Each is reached by its own front door: ours through its ingress, Serve's
multiplexing through Serve's HTTP proxy (the clients send the model in
Serve's ``serve_multiplexed_model_id`` header, by which the proxy routes).
Serve's multiplexing runs once per ``--per-replica`` value: a count per replica
cannot be right for nodes of different sizes.  Each of ``--rounds`` rounds deploys
every router afresh and drives the same requests through it, in an order that
rotates from round to round; the probe cache stays (the first round measures the
models, later ones redeploy on a host that has).  Reports per router the loads and
failures of each round, requests/s over all rounds, p50/p99 over all requests, and
the geometric mean of the per-round requests/s ratios with a 95 % confidence
interval (the machine is shared and noisy: one round is not a comparison).  Prints
a table and writes JSON (default bench/results/ray_bench.json).

With ``--kill-node`` every run loses the 48 MiB node under load (``--fault kill``: its
raylet and every process under it SIGKILLed; ``--fault stop``: SIGSTOPped, a silent node
that resets nothing) once ``--kill-at`` of the requests have been sent, and starts a
node in its place once ``--restart-at`` have been (bench/_ray_kill.py).  The requests
then mix whole and streamed completions, loads and slot saves (Serve's multiplexing:
whole completions only), each with its own X-Request-Id, which our replicas log as they
start and answer it; the table gives per round ok, sent on (ours), failed by kind, the
requests that ran on two nodes (must be 0) and those that ran but were reported failed,
the seconds from the fault to the first success of a model that lived there, and p99
latency before, during and after and per quarter (default
bench/results/ray_kill_bench.json, ray_stop_bench.json with ``--fault stop``;
``--control``: the same windows, no fault).

    python bench/ray_bench.py [--requests N] [--clients C] [--per-replica K,K] [--rounds R] [--out FILE]
    python bench/ray_bench.py --kill-node [--fault kill|stop] [--kill-at 0.3] [--restart-at 0.5] ...
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import ray
from ray import serve
from ray.cluster_utils import Cluster

sys.path.insert(0, str(Path(__file__).parent))
import _ray_kill  # noqa: E402
from _load import percentile, ratio_interval, run_clients  # noqa: E402
from _ray_baseline import COUNTERS, Counters, build as build_baseline  # noqa: E402

from pyllmrouter.ray.deploy import HEAD_RESOURCE, deploy  # noqa: E402
from pyllmrouter.ray.ingress import node_ids  # noqa: E402
from pyllmrouter.tables import render  # noqa: E402
from pyllmrouter.tools import tinymodels  # noqa: E402
from pyllmrouter.tools.loopback import free_port  # noqa: E402
from pyllmrouter.tools.raynodes import add_node, kill_node  # noqa: E402

STATS_PERIOD = 0.5  # seconds between two reads of a node's statistics by our request router
NODES = (32, 48, 96)  # MiB: every model fits at once if placed by memory (176 MiB for 144)
MODELS = {  # name: (tiny model, context, share of requests)
    "a": ("tiny-llama", 2048, 30), "c": ("tiny-llama", 8192, 20), "b": ("tiny-moe", 2048, 15),
    "e": ("tiny-llama", 16384, 12), "d": ("tiny-moe", 8192, 10), "f": ("tiny-moe", 16384, 8),
    "big": ("tiny-llama", 32768, 5),
}


def workload(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    names = list(MODELS)
    return rng.choices(names, weights=[MODELS[m][2] for m in names], k=n)


def drive(base: str, order: list[str], clients: int, headers_for) -> dict:
    """``clients`` threads take the requests in order; per request its latency or error."""
    queue = list(order)
    lock = threading.Lock()

    def make(_i):
        client = httpx.Client(base_url=base, timeout=300)

        def call():
            with lock:
                if not queue:
                    return None
                model = queue.pop(0)
            r = client.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 8},
                            headers=headers_for(model))
            if r.status_code != 200:
                raise RuntimeError(f"{model}: HTTP {r.status_code}: {r.text[:200]}")
            return model
        return call

    run = run_clients(make, clients, -(-len(order) // clients), errors=(RuntimeError, httpx.HTTPError))
    done = [s for s, v in zip(run.seconds, run.values) if v is not None]
    return {"ok": len(done), "errors": len(run.errors), "first_errors": run.errors[:3], "wall_s": run.wall,
            "rps": len(done) / run.wall, "p99_ms": percentile(done, 0.99) * 1e3 if done else float("nan"),
            "seconds": done}


def ours(cluster_address: str, preset: Path, port: int, order: list[str], clients: int, run=None,
         slots: Path | None = None) -> dict:
    deploy(["--models-preset", str(preset), "--models-memory-margin", "0", "--queue-timeout", "300",
            *(["--slot-save-path", f"{slots}/"] if slots is not None else [])],
           address=cluster_address, port=port, stats_period=STATS_PERIOD)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # every node has measured every model
        view = httpx.get(base + "/models", timeout=60).json()
        if view["data"] and all(len(m["nodes"]) == len(NODES) and all(
                e["memory"]["requirement"] for e in m["nodes"].values()) for m in view["data"]):
            time.sleep(2 * STATS_PERIOD)  # and the request router has read every node's statistics since
            break
        time.sleep(0.5)
    result = (run or drive)(base, order, clients, lambda m: {})
    view = httpx.get(base + "/models", timeout=60).json()
    events = httpx.get(base + "/events", timeout=60).json()["data"]
    result.update(loads=sum(e["loads"] for m in view["data"] for e in m["nodes"].values()),
                  evictions=sum(1 for e in events if e["event"] == "evict"),
                  failed_loads=sum(1 for e in events if e["event"] == "load-failed"))
    serve.delete("pyllmrouter")
    return result


def baseline(preset: Path, port: int, order: list[str], clients: int, per_replica: int, run=None) -> dict:
    counters = Counters.options(name=COUNTERS, resources={HEAD_RESOURCE: 0.001}).remote()  # not on a node killed
    serve.run(build_baseline(str(preset), len(NODES), per_replica), name="multiplexed", route_prefix="/")
    result = (run or drive)(f"http://127.0.0.1:{port}", order, clients, lambda m: {"serve_multiplexed_model_id": m})
    result.update(ray.get(counters.get.remote()))
    serve.delete("multiplexed")
    ray.kill(counters)  # its name is free for the next round's
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--per-replica", default="2,3", help="Serve's max_num_models_per_replica, one run each "
                                                            "(none: ours alone)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="default bench/results/ray_bench.json (ray_kill_bench.json)")
    ap.add_argument("--kill-node", action="store_true", help="lose the 48 MiB node under load in every run")
    ap.add_argument("--kill-at", type=float, default=0.25, help="the share of requests sent before the kill")
    ap.add_argument("--restart-at", type=float, default=0.4, help="the share sent before a node starts again")
    ap.add_argument("--control", action="store_true", help="with --kill-node: the same runs and windows, no kill")
    ap.add_argument("--fault", choices=("kill", "stop"), default="kill",
                    help="with --kill-node: SIGKILL the node, or SIGSTOP it (a silent node)")
    a = ap.parse_args()
    a.out = a.out or str(Path(__file__).parent / "results" / (
        ("ray_kill_control.json" if a.control else f"ray_{a.fault}_bench.json") if a.kill_node else "ray_bench.json"))

    d = Path(tempfile.mkdtemp(prefix="ray-bench-"))
    tiny = tinymodels.write_tiny_set(d / "models")
    preset = d / "models.ini"
    preset.write_text("".join(f"[{name}]\nmodel = {tiny[kind]}\nctx-size = {ctx}\nparallel = 1\n\n"
                              for name, (kind, ctx, _) in MODELS.items()))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})

    run_log = d / "runs"
    run_log.mkdir()
    (d / "slots").mkdir()

    def start_node(mib: int):
        return add_node(cluster, mib, d / "cache", run_log=run_log if a.kill_node else None)

    nodes = [start_node(mib) for mib in NODES]
    ray.init(address=cluster.address)
    port, base_port = free_port(), free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": base_port}, proxy_location="HeadOnly")
    order = workload(a.requests)
    per_replica = {f"Serve multiplexing, {k} per replica": int(k) for k in a.per_replica.split(",") if k != "none"}
    names = ["pyllmrouter", *per_replica]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    try:
        for rnd in range(a.rounds):
            for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                outage = run = None
                if a.kill_node:  # the middle node, lost and started again (--control: neither)
                    outage = _ray_kill.Outage(None if a.control else nodes[1], lambda: start_node(NODES[1]), a.fault)

                    def run(base, order_, clients_, headers_for, outage=outage, tag=f"{rnd}-{names.index(name)}-",
                            whole_only=name != "pyllmrouter"):
                        records = _ray_kill.drive(base, order_, clients_, headers_for, outage, a.kill_at, a.restart_at,
                                                  whole_only, tag)
                        ran = {k: v for k, v in _ray_kill.runs(run_log).items() if k.startswith(tag)}
                        return {**_ray_kill.summary(records, outage, ran), "records": records}
                if name == "pyllmrouter":
                    runs[name].append(ours(cluster.address, preset, port, order, a.clients, run, d / "slots"))
                else:
                    runs[name].append(baseline(preset, base_port, order, a.clients, per_replica[name], run))
                if outage is not None and outage.node is not None:
                    nodes[1] = _recover(cluster, outage, start_node)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()

    if a.kill_node:
        return _kill_report(a, names, runs)

    def per_round(name: str, key: str) -> str:
        return "/".join(str(r[key]) for r in runs[name])

    def pooled(name: str) -> dict:
        rs, seconds = runs[name], [s for r in runs[name] for s in r["seconds"]]
        return {"rps": sum(r["ok"] for r in rs) / sum(r["wall_s"] for r in rs),
                "p50_ms": percentile(seconds, 0.5) * 1e3 if seconds else float("nan"),
                "p99_ms": percentile(seconds, 0.99) * 1e3 if seconds else float("nan")}

    summary = {n: pooled(n) for n in names}
    rows = [[k] + [per_round(n, k) for n in names] for k in ("loads", "evictions", "failed_loads", "ok", "errors")]
    rows.append(["p99_ms per round"] + ["/".join(f"{r['p99_ms']:.0f}" for r in runs[n]) for n in names])
    rows += [[k] + [f"{summary[n][k]:.1f}" for n in names] for k in ("rps", "p50_ms", "p99_ms")]
    ratios = {n: ratio_interval([r["rps"] for r in runs["pyllmrouter"]], [r["rps"] for r in runs[n]])
              for n in names[1:]}
    rows.append(["rps ratio (ours / theirs) [95% CI]", ""] + [f"{g:.2f} [{lo:.2f}, {hi:.2f}]"
                                                            for g, lo, hi in ratios.values()])
    print(f"{a.requests} requests, {a.clients} clients, 3 nodes ({', '.join(f'{n} MiB' for n in NODES)}), "
          f"{len(MODELS)} models, {a.rounds} rounds (counts: each round's; rps: all rounds')\n")
    print(render([""] + names, rows))
    for n in names[1:]:
        errors = [e for r in runs[n] for e in r["first_errors"]]
        if errors:
            print(f"\n{n}, first errors:", *errors[:3], sep="\n  ")
    for rs in runs.values():
        for r in rs:
            r.pop("seconds")
    out = {"nodes_mib": NODES, "models": {m: v[:2] for m, v in MODELS.items()}, "requests": a.requests,
           "clients": a.clients, "rounds": a.rounds, "summary": summary, "runs": runs,
           "rps_ratio": {n: list(v) for n, v in ratios.items()}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {a.out}")
    return 0


def _recover(cluster: Cluster, outage: "_ray_kill.Outage", start_node) -> object:
    """After a round that lost a node: the node started again (if the round ended first),
    the lost one dropped from the cluster's list, and Ray's view back to three live nodes
    (a redeploy counts the live nodes): the node that stands in for the lost one."""
    new = outage.new_node or start_node(NODES[1])
    kill_node(outage.node)  # a stopped node never comes back
    cluster.remove_node(outage.node, allow_graceful=False)
    deadline = time.monotonic() + 120
    while len(node_ids()) != len(NODES) and time.monotonic() < deadline:
        time.sleep(1)
    return new


def _kill_report(a, names: list[str], runs: dict[str, list[dict]]) -> int:
    keys = ("wall_s", "kill_s", "restart_s", "ok", "retried", "failed", "ran_twice", "ran_but_failed",
            "in_flight_at_kill", "in_flight_at_kill_failed", "first_moved_success_s", "rejoin_s",
            "p99_ms_before", "p99_ms_during", "p99_ms_after")

    def cell(r: dict, key: str) -> str:
        v = r[key]
        return "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))

    rows = [[k] + ["/".join(cell(r, k) for r in runs[n]) for n in names] for k in keys]
    def kinds(name: str) -> str:  # over all rounds
        total: dict[str, int] = {}
        for r in runs[name]:
            for kind, count in r["failed_kinds"].items():
                total[kind] = total.get(kind, 0) + count
        return "; ".join(f"{kind}: {count}" for kind, count in sorted(total.items())) or "-"

    rows.append(["p99_ms per quarter"] + [" | ".join("/".join(f"{q:.0f}" for q in r["p99_ms_quarters"])
                                                         for r in runs[n]) for n in names])
    rows.append(["ok by kind sent (all rounds)"] + ["; ".join(f"{k}: {sum(r['ok_by_kind'].get(k, 0) for r in runs[n])}"
                                                             for k in sorted(runs[n][0]["ok_by_kind"])) for n in names])
    rows.append(["failed, by kind (all rounds)"] + [kinds(n) for n in names])
    faulted = "killed (SIGKILL)" if a.fault == "kill" else "silenced (SIGSTOP)"
    what = (f"no node faulted (the control: windows at {a.kill_at:.0%} and {a.restart_at:.0%})" if a.control else
            f"the {NODES[1]} MiB node {faulted} after {a.kill_at:.0%} of the requests were sent and a node started "
            f"again after {a.restart_at:.0%}")
    print(f"{a.requests} requests, {a.clients} clients, 3 nodes ({', '.join(f'{n} MiB' for n in NODES)}), {what}; "
          f"{a.rounds} rounds (each cell: round 1/2/3)\n")
    print(render([""] + names, rows))
    for rs in runs.values():
        for r in rs:
            r.pop("records")
    out = {"nodes_mib": NODES, "killed_mib": NODES[1], "fault": None if a.control else a.fault,
           "kill_at": a.kill_at, "restart_at": a.restart_at,
           "requests": a.requests, "clients": a.clients, "rounds": a.rounds, "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
