#!/usr/bin/env python3
"""Soak: ``pyllmrouter serve`` under 16 clients for 10 minutes, with trouble.

Three generated models (about 4 MiB each) on two emulated GPUs of 5 MiB (loads,
evictions and waits all the time); each client loops: a random model, a random
kind of request (chat, streamed chat, completion, embedding-free tokenize), and one
time in five it leaves mid-request (a stream dropped after its first chunk, or a
request given up after a random short timeout).  Once a minute a worker is stopped
with SIGSTOP: the heartbeat must kill it and the router go on.  A request that never
ends (no answer, no error, within 120 s) is counted as hung: there must be none.

Prints a table and writes JSON (default bench/results/soak_bench.json): requests
answered, errors by kind, hung, workers stopped and killed, and the router's RSS at
the start and at the end.

With ``--max-queue N`` (the router's bound on waiting requests) and ``--model-max-queue
N`` (each model's preset key ``max-queue``), requests past a bound are refused (503 and
429, with Retry-After): they are counted apart, and still none may hang.  With
``--replicas N`` each model may run as N instances (one more loads where its requests
wait); with ``--reload-every S`` the preset is rewritten and read again (``GET
/models?reload=1``) every S seconds, in turn changing a model's context (it finishes its
requests, unloads and comes back) and a model's priority (tuned in place).  Once the
clients stop, every instance's requests in flight must come back to 0 (no lease left).

    python bench/soak_bench.py [--minutes 10] [--clients 16] [--max-queue N] [--model-max-queue N]
                               [--replicas N] [--reload-every S] [--kill-loads-every S] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _load import save  # noqa: E402

from pyllmrouter.tables import render  # noqa: E402
from pyllmrouter.tools import tinymodels  # noqa: E402
from pyllmrouter.tools.loopback import start_serve  # noqa: E402

HUNG_AFTER = 120.0  # seconds without an end: a request counted as hung


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts: collections.Counter = collections.Counter()
        self.open: dict[int, float] = {}  # request -> when it started (those not ended yet)

    def start(self, rid: int) -> None:
        with self.lock:
            self.open[rid] = time.monotonic()

    def end(self, rid: int, kind: str) -> None:
        with self.lock:
            self.open.pop(rid, None)
            self.counts[kind] += 1

    def hung(self) -> int:
        now = time.monotonic()
        with self.lock:
            return sum(1 for t in self.open.values() if now - t > HUNG_AFTER)


def client(base: str, models: list[str], tally: Tally, stop: threading.Event, seed: int, ids) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=base, timeout=HUNG_AFTER) as http:
        while not stop.is_set():
            rid = next(ids)
            model = rng.choice(models)
            kind = rng.choice(["chat", "stream", "complete", "tokenize"])
            leave = rng.random() < 0.2
            body = {"model": model, "max_tokens": rng.randint(4, 64)}
            tally.start(rid)
            try:
                if kind == "stream":
                    body.update(messages=[{"role": "user", "content": "tell me a story"}], stream=True)
                    with http.stream("POST", "/v1/chat/completions", json=body) as r:
                        for _ in r.iter_lines():
                            if leave:
                                break  # the client drops the stream
                        tally.end(rid, "left" if leave else f"http {r.status_code}")
                    continue
                if kind == "chat":
                    path, body = "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "hi"}]}
                elif kind == "complete":
                    path, body = "/v1/completions", {**body, "prompt": "Once upon a time"}
                else:
                    path, body = "/tokenize", {"model": model, "content": "hello world"}
                timeout = rng.uniform(0.05, 0.5) if leave else HUNG_AFTER
                r = http.post(path, json=body, timeout=timeout)
                tally.end(rid, f"http {r.status_code}")
            except httpx.TimeoutException:
                tally.end(rid, "left" if leave else "client timeout")
            except httpx.HTTPError as e:
                tally.end(rid, f"transport: {type(e).__name__}")


def stopper(base: str, stop: threading.Event, period: float, log: list) -> None:
    """Once a period: SIGSTOP one worker; note whether the heartbeat killed it."""
    rng = random.Random(7)
    while not stop.wait(period):
        try:
            workers = [w for w in httpx.get(base + "/devices", timeout=10).json()["workers"] if w["alive"]]
        except httpx.HTTPError as e:
            log.append({"error": f"/devices: {e}"})
            continue
        if not workers:
            continue
        pid = rng.choice(workers)["pid"]
        t0 = time.monotonic()
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            continue
        killed = None
        while time.monotonic() - t0 < 30:
            try:
                os.kill(pid, 0)
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().split()[2] == "Z":
                        killed = time.monotonic() - t0
                        break
            except (ProcessLookupError, FileNotFoundError):
                killed = time.monotonic() - t0
                break
            time.sleep(0.1)
        log.append({"pid": pid, "killed_after_s": None if killed is None else round(killed, 2)})
        if killed is None:
            os.kill(pid, signal.SIGCONT)


def load_killer(base: str, stop: threading.Event, period: float, log: list) -> None:
    """Once a period: the next model seen loading has its worker SIGKILLed while it loads (a
    crash under a load: the load is tried once more on a new worker, a second death fails
    its waiters with the reason)."""
    while not stop.wait(period):
        armed = time.monotonic()
        while not stop.is_set() and time.monotonic() - armed < period:
            try:
                models = httpx.get(base + "/models", timeout=10).json()["data"]
                loading = [m for m in models if m["status"]["value"] == "loading" and m["memory"]["devices"]]
                if not loading:
                    time.sleep(0.01)
                    continue
                devices = sorted(loading[0]["memory"]["devices"])
                workers = httpx.get(base + "/devices", timeout=10).json()["workers"]
                pid = next((w["pid"] for w in workers if w["alive"] and w["devices"] == devices), None)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    log.append({"killed_during_load": loading[0]["id"], "pid": pid})
                    break
            except (httpx.HTTPError, ProcessLookupError, KeyError):
                time.sleep(0.05)


def reloader(base: str, preset: Path, versions: list[str], stop: threading.Event, period: float,
             log: list) -> None:
    """Every period: the preset's next version written, and the list read again."""
    k = 0
    while not stop.wait(period):
        k += 1
        preset.write_text(versions[k % len(versions)])
        try:
            r = httpx.get(base + "/models?reload=1", timeout=60)
            log.append({"reload": k, "status": r.status_code})
        except httpx.HTTPError as e:
            log.append({"reload": k, "error": type(e).__name__})


def leases_left(base: str) -> float:
    """Requests in flight, every instance of every model (/metrics)."""
    text = httpx.get(base + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pyllmrouter_model_requests_in_flight{"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--heartbeat", type=float, default=3.0)
    ap.add_argument("--max-queue", type=int, default=0, help="serve --max-queue (0: no bound)")
    ap.add_argument("--model-max-queue", type=int, default=0, help="each model's max-queue (0: no bound)")
    ap.add_argument("--replicas", type=int, default=1, help="each model's replicas (instances by demand)")
    ap.add_argument("--reload-every", type=float, default=0.0, help="rewrite and reload the preset every S seconds")
    ap.add_argument("--kill-loads-every", type=float, default=0.0,
                    help="every S seconds, SIGKILL the worker of the next load that starts, while it loads")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "soak_bench.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        m = tinymodels.write_tiny_set(Path(tmp) / "models")
        preset = Path(tmp) / "models.ini"
        bound = f"max-queue = {args.model_max_queue}\n" if args.model_max_queue else ""
        bound += f"replicas = {args.replicas}\n" if args.replicas > 1 else ""

        def version(small_ctx: int, priority: int) -> str:
            return (f"[chat]\nmodel = {m['tiny-llama']}\nc = 2048\nnp = 4\n{bound}priority = {priority}\n\n"
                    f"[moe]\nmodel = {m['tiny-moe']}\nc = 2048\nnp = 4\n{bound}\n"
                    f"[small]\nmodel = {m['tiny-llama']}\nc = {small_ctx}\nnp = 2\n{bound}")
        versions = [version(512, 0), version(1024, 0), version(1024, 3), version(512, 3)]
        preset.write_text(versions[0])
        proc, base = start_serve(["--models-preset", str(preset), "--no-models-cache",
                                  "--emulate-devices", "GPU0=5MiB,GPU1=5MiB", "--models-memory-margin", "0",
                                  "--heartbeat", str(args.heartbeat), "--queue-timeout", "30",
                                  "--kv-keep-ram", "64", "--max-queue", str(args.max_queue)])
        try:
            rss_start = rss_mib(proc.pid)
            tally, stop, log = Tally(), threading.Event(), []
            ids = iter(range(1, 1 << 62))
            threads = [threading.Thread(target=client, args=(base, ["chat", "moe", "small"], tally, stop, i, ids),
                                        daemon=True) for i in range(args.clients)]
            threads.append(threading.Thread(target=stopper, args=(base, stop, 60.0, log), daemon=True))
            reloads: list = []
            if args.reload_every > 0:
                threads.append(threading.Thread(target=reloader, daemon=True,
                                                args=(base, preset, versions, stop, args.reload_every, reloads)))
            kills: list = []
            if args.kill_loads_every > 0:
                threads.append(threading.Thread(target=load_killer, daemon=True,
                                                args=(base, stop, args.kill_loads_every, kills)))
            for t in threads:
                t.start()
            t0 = time.monotonic()
            while time.monotonic() - t0 < args.minutes * 60:
                time.sleep(5)
                print(f"  {time.monotonic() - t0:6.0f} s  {dict(tally.counts)}", flush=True)
            stop.set()
            for t in threads:
                t.join(HUNG_AFTER + 10)
            hung = tally.hung() + sum(t.is_alive() for t in threads)
            deadline, left = time.monotonic() + 30, None
            while time.monotonic() < deadline and (left := leases_left(base)) > 0:
                time.sleep(0.5)
            rss_end = rss_mib(proc.pid)
            health = httpx.get(base + "/health", timeout=10).status_code
            status = httpx.get(base + "/devices", timeout=10).json()
            counters = {line.split()[0].removeprefix("pyllmrouter_").removesuffix("_total"): float(line.split()[1])
                        for line in httpx.get(base + "/metrics", timeout=10).text.splitlines()
                        if line.startswith("pyllmrouter_") and line.split()[0].endswith("_total")}
        finally:
            proc.terminate()
            proc.wait(60)
    answered = sum(n for k, n in tally.counts.items() if k == "http 200")
    errors = {k: n for k, n in tally.counts.items() if k != "http 200"}
    rows = [["answered (200)", answered], *[[k, n] for k, n in sorted(errors.items())],
            ["hung (no end in 120 s)", hung], ["workers stopped", len([e for e in log if "pid" in e])],
            ["... killed by the heartbeat", len([e for e in log if e.get("killed_after_s") is not None])],
            *[[f"router: {k}", int(counters[k])] for k in ("loads", "evictions", "worker_deaths") if k in counters],
            ["reloads (ok / all)", f"{sum(1 for r in reloads if r.get('status') == 200)} / {len(reloads)}"],
            ["workers killed during a load", len(kills)],
            ["requests in flight once the clients stopped", int(left or 0)],
            ["router RSS start (MiB)", f"{rss_start:.1f}"], ["router RSS end (MiB)", f"{rss_end:.1f}"],
            ["/health at the end", health]]
    print(render(["", "value"], rows))
    save(args.out, {
        "bench": "soak", "minutes": args.minutes, "clients": args.clients, "heartbeat": args.heartbeat,
        "max_queue": args.max_queue, "model_max_queue": args.model_max_queue, "replicas": args.replicas,
        "reload_every": args.reload_every, "reloads": reloads, "in_flight_after": left,
        "kill_loads_every": args.kill_loads_every, "killed_during_loads": kills,
        "answered": answered, "errors": errors, "hung": hung, "stops": log, "counters": counters,
        "rss_mib": {"start": round(rss_start, 1), "end": round(rss_end, 1)}, "health_at_end": health,
        "workers_at_end": status["workers"]})


if __name__ == "__main__":
    main()
