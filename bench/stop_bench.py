#!/usr/bin/env python3
"""How soon a request's slot is free after its caller stops waiting, per path of the Python API.

    python bench/stop_bench.py [--tries 5] [--out FILE]

The 100M model (``-np 2``, 3000 tokens asked, end of sequence ignored) generates far longer
than each try; the caller stops once the engine decodes for it: a whole reply past its
``timeout=``, the same while a second request keeps the engine busy, an awaiting task
cancelled, a stream closed.  From the moment the stop returns (or raises), llama-server's
``GET /slots`` is read every few milliseconds (on the model's other slot) until no slot but
the busy neighbour's processes.  Before the engine's change (cmake/llama_engine.cmake) a
whole reply's slot stayed busy about 0.7 s, and never came free while another request kept
the engine busy (reported as the bound, ``--limit``).  Prints a table and writes JSON
(default bench/results/stop_bench.json).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from _load import save

from pyllmrouter import ModelConfig, ModelSpec, Router
from pyllmrouter.errors import RequestTimeout
from pyllmrouter.tables import render
from pyllmrouter.tools import tinymodels

LONG = {"max_tokens": 3000, "ignore_eos": True}
MESSAGES = [{"role": "user", "content": "tell me a long story"}]


def busy(router: Router) -> int:
    reply, _ = router.call("m", "GET", "/slots")
    return sum(1 for s in reply.json() if s["is_processing"])


def until_busy(router: Router, n: int, limit: float) -> float:
    t0 = time.monotonic()
    while busy(router) != n and time.monotonic() - t0 < limit:
        time.sleep(0.002)
    return time.monotonic() - t0


def sync_timeout(router: Router, others: int) -> None:
    try:
        router.chat("m", MESSAGES, timeout=0.5, **LONG)
    except RequestTimeout:
        pass


def task_cancelled(router: Router, others: int) -> None:
    async def main():
        task = asyncio.ensure_future(router.achat("m", MESSAGES, **LONG))
        await asyncio.to_thread(until_busy, router, others + 1, 30)
        await asyncio.sleep(0.2)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
    asyncio.run(main())


def stream_closed(router: Router, others: int) -> None:
    with router.chat("m", MESSAGES, stream=True, **LONG) as events:
        for i, _ in enumerate(events):
            if i == 20:
                break


PATHS = {"sync timeout=": (sync_timeout, 0), "sync timeout=, engine busy with another": (sync_timeout, 1),
         "async task cancelled": (task_cancelled, 0), "stream left by with": (stream_closed, 0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tries", type=int, default=5)
    ap.add_argument("--limit", type=float, default=10.0, help="seconds a slot is waited for before giving up")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "stop_bench.json")
    args = ap.parse_args()
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = tinymodels.write_llama(Path(tmp) / "m.gguf", tinymodels.LLAMA_100M)
        with Router([ModelConfig("m", ModelSpec(str(path), ("-np", "2", "-c", "8192")))]) as router:
            router.complete("m", "warm", max_tokens=2)
            for name, (stop, others) in PATHS.items():
                for _ in range(args.tries):
                    neighbour = router.chat("m", MESSAGES, stream=True, **LONG) if others else None
                    if neighbour is not None:
                        next(neighbour)
                    stop(router, others)
                    results.setdefault(name, []).append(until_busy(router, others, args.limit))
                    if neighbour is not None:
                        neighbour.close()
                    until_busy(router, 0, 30)
    rows = [[name, f"{statistics.median(v) * 1e3:.0f}", f"{max(v) * 1e3:.0f}",
             " ".join(f"{x * 1e3:.0f}" for x in v)] for name, v in results.items()]
    print(render(["path", "slot free after, median ms", "max ms", "each try ms"], rows))
    save(args.out, {"bench": "stop", "tries": args.tries, "limit_s": args.limit, "seconds": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
