"""ray_bench.py --kill-node: one node of the cluster lost under load, and started again.

``drive`` sends the round's requests from ``clients`` threads, in order; once
``kill_at`` of them have been sent, the node is faulted: killed (its raylet and every
process under it, SIGKILL: pyllmrouter.tools.raynodes; connections reset at once) or
stopped (SIGSTOP: a silent node, nothing reset, calls unanswered until Ray declares it
dead), and once ``restart_at`` have been, a node is started in its place (as ``ray
start`` would: a new node id).  The requests are of four kinds (``KINDS``, by index):
whole completions, streamed completions, loads (POST /models/load) and slot saves (POST
/slots/0?action=save), each with its own X-Request-Id; Serve's multiplexing takes whole
completions only, so every kind is one there.  Every request is recorded: when it was
sent and answered, its status (a stream that ends with an error event is a failure),
the node that answered and, for ours, the nodes lost before it was sent on
(x-pyllmrouter-retried).  ``runs`` reads the replicas' run logs (replica.py,
PYLLMROUTER_RUN_LOG): the nodes each request was started or answered on.

``summary`` reads a round: ok, retried, failed by kind; the requests that ran on two
nodes (must be 0) and those that ran but were reported failed; the seconds from the
kill to the first success of a model that lived on the killed node (the node that
answered it last before the kill); the seconds from the restart to the new node's
first answer; p99 latency of the requests sent before the kill, between the kill and
the new node's first answer (the restart, where it gave none), and after, and per
quarter of the requests by index (the same windows with and without a fault).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx

from _load import percentile  # noqa: E402

from pyllmrouter.tools.raynodes import kill_node, stop_node

KINDS = ("whole", "whole", "stream", "whole", "stream", "load", "whole", "stream", "whole", "save")  # by index % 10


@dataclass
class Outage:
    """The node to kill and what starts it again: ``restart()`` returns the new node.
    ``node`` None: a control run (nothing killed, the same windows measured)."""

    node: Any
    restart: Callable[[], Any]
    fault: str = "kill"  # kill | stop
    killed_at: float | None = None
    restarted_at: float | None = None
    new_node: Any = None


def _send(http: httpx.Client, i: int, model: str, headers: dict, whole_only: bool) -> tuple[int, Any, str]:
    """Request ``i`` of its kind: (status, headers, text); a stream's text is its events."""
    kind = "whole" if whole_only else KINDS[i % len(KINDS)]
    body = {"model": model, "prompt": "hi", "max_tokens": 8}
    if kind == "load":
        r = http.post("/models/load", json={"model": model}, headers=headers)
    elif kind == "save":
        r = http.post("/slots/0", params={"action": "save", "model": model}, json={"filename": f"r{i}.bin"},
                      headers=headers)
    elif kind == "stream":
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=headers) as r:
            text = "".join(r.iter_text())
        failed = r.status_code == 200 and any(line.startswith("data: {\"error\"") for line in text.splitlines())
        return (502 if failed else r.status_code), r.headers, text
    else:
        r = http.post("/v1/completions", json=body, headers=headers)
    return r.status_code, r.headers, r.text


def runs(log_dir: Path | None) -> dict[str, dict[str, set[str]]]:
    """{request id: {"started": nodes, "answered": nodes}} from the replicas' run logs."""
    out: dict[str, dict[str, set[str]]] = {}
    for f in sorted(log_dir.glob("*.log")) if log_dir is not None else ():
        for line in f.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) == 3:
                rid, what, node = parts
                event, *status = what.split()
                if event == "started" or (status and status[0].startswith("2")):  # a refusal ran nothing
                    out.setdefault(rid, {"started": set(), "answered": set()})[event].add(node)
    return out


def drive(base: str, order: list[str], clients: int, headers_for, outage: Outage, kill_at: float,
          restart_at: float, whole_only: bool = False, tag: str = "") -> list[dict]:
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
                status, headers, text = _send(http, i, model, {**headers_for(model), "x-request-id": f"{tag}r{i}"},
                                              whole_only)
            except httpx.HTTPError as e:
                status, headers, text = 0, {}, f"{type(e).__name__}: {e}"
            with lock:
                records.append({"i": i, "id": f"{tag}r{i}", "kind_sent": "whole" if whole_only else KINDS[i % len(KINDS)],
                                "model": model, "sent": t0, "done": time.monotonic(), "status": status,
                                "node": headers.get("x-pyllmrouter-node"),
                                "retried": headers.get("x-pyllmrouter-retried"),
                                "kind": None if status == 200 else _kind(status, text),
                                "error": None if status == 200 else text[:300]})

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    if reached[kill_n].wait(600):
        outage.killed_at = time.monotonic()
        if outage.node is not None:  # None: a control run, the same windows without the fault
            (stop_node if outage.fault == "stop" else kill_node)(outage.node)
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


def summary(records: list[dict], outage: Outage, ran: dict[str, dict[str, set[str]]] | None = None) -> dict:
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
    ran = ran or {}
    twice = sorted(rid for rid, where in ran.items() if len(where["started"] | where["answered"]) > 1)
    ran_failed = [x["id"] for x in records if x["kind"] and (ran.get(x["id"], {}).get("started")
                                                             or ran.get(x["id"], {}).get("answered"))]
    quarters = [p99(lambda x, q=q: q * len(records) // 4 <= x["i"] < (q + 1) * len(records) // 4) for q in range(4)]
    return {"failures": [{k: x[k] for k in ("id", "kind_sent", "model", "status", "node", "error")} | {
                "sent_s": x["sent"] - start, "took_s": x["done"] - x["sent"]} for x in records if x["kind"]][:50],
            "ran_twice": len(twice), "ran_twice_ids": twice[:10], "ran_but_failed": len(ran_failed),
            "ran_logged": len(ran), "p99_ms_quarters": quarters,
            "ok_by_kind": {k: sum(1 for x in records if x["kind_sent"] == k and x["status"] == 200)
                           for k in sorted({x["kind_sent"] for x in records})},
            "failed_by_kind_sent": {k: sum(1 for x in records if x["kind_sent"] == k and x["kind"])
                                    for k in sorted({x["kind_sent"] for x in records})},"wall_s": max(x["done"] for x in records) - start, "kill_s": k - start,
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
