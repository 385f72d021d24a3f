#!/usr/bin/env python3
"""What a web page, or one heavy request, can do to a router on a workstation.

    python bench/safety_bench.py [--ids 1000000] [--out FILE]

``pyllmrouter serve`` with its defaults (loopback, no API key) and one tiny model.  The
drive-by requests a page of another site can send without a preflight (a rebound
``Host``, a foreign ``Origin``, a text/plain body), each with its status and the
``Access-Control-Allow-Origin`` it got back; then ``POST /v1/streams/lookup`` with
``--ids`` copies of one remembered conversation id, while a client asks ``/health``
every 5 ms: the lookup's status and time, and the slowest ``/health`` meanwhile (the
event loop's stall).  Prints a table and writes JSON (default
bench/results/safety_bench.json).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import httpx

from _load import save

from pyllmrouter.tables import render
from pyllmrouter.tools import tinymodels
from pyllmrouter.tools.loopback import start_serve

EVIL = "http://evil.example"


def drive_by(base: str, port: int) -> list[tuple[str, int, str | None]]:
    """(request, status, Access-Control-Allow-Origin) of each request a foreign page sends."""
    out = []
    with httpx.Client(base_url=base, timeout=60) as http:
        r = http.post("/models/load", content='{"model":"m"}',
                      headers={"Origin": EVIL, "Host": f"evil.example:{port}", "Content-Type": "text/plain"})
        out.append(("POST /models/load, rebound Host", r.status_code, r.headers.get("access-control-allow-origin")))
        http.post("/models/unload", json={"model": "m"})
        r = http.post("/models/load", content='{"model":"m"}', headers={"Origin": EVIL, "Content-Type": "text/plain"})
        out.append(("POST /models/load, foreign Origin", r.status_code, r.headers.get("access-control-allow-origin")))
        r = http.get("/models", headers={"Origin": EVIL})
        out.append(("GET /models, foreign Origin", r.status_code, r.headers.get("access-control-allow-origin")))
    return out


def big_lookup(base: str, ids: int) -> dict:
    """A lookup of ``ids`` copies of one remembered conversation id, /health polled meanwhile."""
    conv = "c1"  # short: a million copies stay under the default 8 MiB body limit, so the lookup itself answers
    httpx.post(base + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1},
               headers={"X-Conversation-Id": conv}, timeout=120)  # remembered
    body = json.dumps({"conversation_ids": [conv] * ids}).encode()
    worst, stop = [0.0], threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=base, timeout=600) as http:
            while not stop.is_set():
                t0 = time.perf_counter()
                http.get("/health")
                worst[0] = max(worst[0], time.perf_counter() - t0)
                time.sleep(0.005)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.2)
    t0 = time.perf_counter()
    r = httpx.post(base + "/v1/streams/lookup", content=body, headers={"Content-Type": "application/json"},
                   timeout=600)
    took = time.perf_counter() - t0
    time.sleep(0.2)
    stop.set()
    poller.join()
    return {"ids": ids, "bytes": len(body), "status": r.status_code, "seconds": took,
            "health_worst_ms": worst[0] * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ids", type=int, default=1_000_000)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "safety_bench.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = tinymodels.write_tiny_set(Path(tmp))["tiny-llama"]
        preset = Path(tmp) / "p.ini"
        preset.write_text(f"[m]\nmodel = {model}\nc = 256\n")
        proc, base = start_serve(["--models-preset", str(preset), "--no-models-cache", "--emulate-devices",
                                  "GPU0=1GiB", "--models-memory-margin", "0"])
        try:
            port = int(base.rsplit(":", 1)[1])
            requests = drive_by(base, port)
            lookup = big_lookup(base, args.ids)
        finally:
            proc.terminate()
            proc.wait(30)
    print(render(["drive-by request", "status", "Access-Control-Allow-Origin"],
                 [[name, status, allow or "-"] for name, status, allow in requests]))
    print(f"\nPOST /v1/streams/lookup, {lookup['ids']:,} ids ({lookup['bytes'] / 2**20:.1f} MiB): "
          f"{lookup['status']} in {lookup['seconds']:.2f} s; slowest /health meanwhile {lookup['health_worst_ms']:.0f} ms")
    save(args.out, {"bench": "safety", "drive_by": requests, "lookup": lookup})


if __name__ == "__main__":
    main()
