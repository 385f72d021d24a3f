"""Concurrent clients for the benchmarks: each thread makes its own call and repeats it."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["ClientRun", "percentile", "run_clients"]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


@dataclass
class ClientRun:
    seconds: list[float] = field(default_factory=list)  # per call
    values: list[Any] = field(default_factory=list)  # what each call returned
    errors: list[str] = field(default_factory=list)
    wall: float = 0.0


def run_clients(make_call: Callable[[int], Callable[[], Any]], clients: int, per_client: int,
                errors: tuple[type[BaseException], ...] = ()) -> ClientRun:
    """``clients`` threads; thread i calls ``make_call(i)()`` ``per_client`` times."""
    run, lock = ClientRun(), threading.Lock()

    def client(i: int) -> None:
        call = make_call(i)
        for _ in range(per_client):
            t0 = time.perf_counter()
            try:
                value = call()
            except errors as e:
                with lock:
                    run.errors.append(f"{type(e).__name__}: {e}")
                continue
            with lock:
                run.seconds.append(time.perf_counter() - t0)
                run.values.append(value)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    run.wall = time.perf_counter() - t0
    return run
