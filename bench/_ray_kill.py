"""ray_bench.py --kill-node: one node of the cluster lost under load, and started again.

``drive`` sends the round's requests from ``clients`` threads, in order; once
``kill_at`` of them have been sent, the node is killed (its raylet and every process
under it, SIGKILL: pyllmrouter.tools.raynodes), and once ``restart_at`` have been, a
node is started in its place (as ``ray start`` would: a new node id).  Every request
is recorded: when it was sent and answered, its status, the node that answered and,
for ours, the nodes lost before it was sent on (x-pyllmrouter-retried).

``summary`` reads a round: ok, retried, failed by kind; the seconds from the kill to
the first success of a model that lived on the killed node (the node that answered it
last before the kill); the seconds from the restart to the new node's first answer;
p99 latency of the requests sent before the kill, between the kill and the new node's
first answer (the restart, where it gave none), and after.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import httpx

from _load import percentile  # noqa: E402

from pyllmrouter.tools.raynodes import kill_node


@dataclass
class Outage:
    """The node to kill and what starts it again: ``restart()`` returns the new node.
    ``node`` None: a control run (nothing killed, the same windows measured)."""

    node: Any
    restart: Callable[[], Any]
    killed_at: float | None = None
    restarted_at: float | None = None
    new_node: Any = None


def drive(base: str, order: list[str], clients: int, headers_for, outage: Outage, kill_at: float,
          restart_at: float) -> list[dict]:
    """The caller's thread kills and restarts (Ray starts a node from the main thread only)
    when the clients have sent the kill_at-th and restart_at-th request."""
    queue = list(enumerate(order))
    lock = threading.Lock()
    records: list[dict] = []
    kill_n, restart_n = int(kill_at * len(order)), int(restart_at * len(order))
    reached = {kill_n: threading.Event(), restart_n: threading.Event()}

    def client() -> None:
        http = httpx.Client(base_url=base, timeout=300)
        while True:
            with lock:
                if not queue:
                    return
                i, model = queue.pop(0)
            if i in reached:
                reached[i].set()
            t0 = time.monotonic()
            try:
                r = http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 8},
                              headers=headers_for(model))
                status, headers, text = r.status_code, r.headers, r.text
            except httpx.HTTPError as e:
                status, headers, text = 0, {}, f"{type(e).__name__}: {e}"
            with lock:
                records.append({"i": i, "model": model, "sent": t0, "done": time.monotonic(), "status": status,
                                "node": headers.get("x-pyllmrouter-node"),
                                "retried": headers.get("x-pyllmrouter-retried"),
                                "kind": None if status == 200 else _kind(status, text)})

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    if reached[kill_n].wait(600):
        outage.killed_at = time.monotonic()
        if outage.node is not None:  # None: a control run, the same windows without the kill
            kill_node(outage.node)
    if reached[restart_n].wait(600):
        outage.restarted_at = time.monotonic()
        if outage.node is not None:
            outage.new_node = outage.restart()
    for t in threads:
        t.join()
    return sorted(records, key=lambda r: r["i"])


def _kind(status: int, text: str) -> str:
    """A failure's kind: its status and error code (or the first words of its text)."""
    try:
        err = json.loads(text).get("error", {})
        what = err.get("code") if isinstance(err, dict) else None
        what = what or (err.get("message", "") if isinstance(err, dict) else str(err))[:40]
        if what == "node_died":  # which of the two: it ran there, or its node was lost twice
            what += " (running)" if "running there" in err.get("message", "") else " (lost twice)"
    except (ValueError, AttributeError):
        what = text[:40]
    return f"{status} {what}".strip()


def summary(records: list[dict], outage: Outage) -> dict:
    killed = outage.node.node_id if outage.node is not None else None
    new = outage.new_node.node_id if outage.new_node is not None else None
    k, r = outage.killed_at, outage.restarted_at or float("inf")
    last: dict[str, str | None] = {}
    for rec in sorted((x for x in records if x["done"] < k and x["status"] == 200), key=lambda x: x["done"]):
        last[rec["model"]] = rec["node"]
    lived = {m for m, n in last.items() if killed is not None and n == killed}
    moved = [x["done"] - k for x in records if x["model"] in lived and x["done"] > k and x["status"] == 200
             and x["node"] != killed]
    back = [x["done"] - r for x in records if new is not None and x["node"] == new]
    end = r + min(back) if back else r  # the outage ends with the new node's first answer
    failed: dict[str, int] = {}
    for x in records:
        if x["kind"]:
            failed[x["kind"]] = failed.get(x["kind"], 0) + 1

    def p99(sel) -> float:
        xs = [x["done"] - x["sent"] for x in records if sel(x) and x["status"] == 200]
        return percentile(xs, 0.99) * 1e3 if xs else float("nan")

    start = min(x["sent"] for x in records)
    return {"wall_s": max(x["done"] for x in records) - start, "kill_s": k - start,
            "restart_s": (outage.restarted_at - start) if outage.restarted_at else None,
            "ok": sum(x["status"] == 200 for x in records), "retried": sum(bool(x["retried"]) for x in records),
            "failed": sum(failed.values()), "failed_kinds": failed,
            "in_flight_at_kill": sum(1 for x in records if x["sent"] < k < x["done"]),
            "in_flight_at_kill_failed": sum(1 for x in records if x["kind"] and x["sent"] < k < x["done"]),
            "models_on_killed_node": sorted(lived), "first_moved_success_s": min(moved) if moved else None,
            "rejoin_s": min(back) if back else None,
            "p99_ms_before": p99(lambda x: x["sent"] < k), "p99_ms_during": p99(lambda x: k <= x["sent"] < end),
            "p99_ms_after": p99(lambda x: x["sent"] >= end),
            # by request index, the same windows with and without a kill (--control)
            "p99_ms_first_quarter": p99(lambda x: x["i"] < len(records) // 4),
            "p99_ms_last_quarter": p99(lambda x: x["i"] >= len(records) * 3 // 4)}
