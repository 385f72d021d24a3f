"""The router's side of a worker process: start, send, route replies, notice death.

    Router ──call(msg)──▶ WorkerHandle ──queue──▶ writer thread ──pipe──▶ worker process (masked)
           ◀─Pending.get()── reader thread ◀─pipe── replies, routed by req_id
    coroutine ◀─wait_async()─┘ (woken by call_soon_threadsafe, once per loop and message)

Sending never blocks the caller: a message is queued, and the writer thread alone
writes the pipe, in order.  A worker that stops reading (hung, kill -STOP) blocks
only its writer: the event loop, the scheduler and the heartbeat's ping() go on, and
the heartbeat, getting no answer, kills it.  A dead worker (crash, kill -9) closes
the pipe: the reader thread fails every pending call with WorkerDied (nobody waits
forever) and tells the router, which marks the worker's models unloaded.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import queue
import threading
import time
from collections import deque
from typing import Any, Callable

from pyllmrouter.errors import WorkerDied
from pyllmrouter.protocol import FINAL, Batch, Cancel, ErrorKind, Failed, Ping, Ready, Shutdown
from pyllmrouter.engine.worker import worker_main

__all__ = ["WorkerHandle", "Pending"]

class Pending:
    """Replies to one call, in order; the last one is final (Result, Failed, ...).

    A thread blocks in ``get``; a coroutine awaits ``wait_async``, which
    the reader thread wakes with one ``call_soon_threadsafe`` per event loop and
    pipe message (no thread hop per chunk).
    """

    def __init__(self, req_id: int, worker: "WorkerHandle", ping: bool = False):
        self.req_id = req_id
        self.worker = worker
        self.ping = ping  # the heartbeat: it keeps no worker busy
        self._replies: deque = deque()
        self._cond = threading.Condition(threading.Lock())
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None

    def put(self, msg: Any) -> tuple[asyncio.AbstractEventLoop, asyncio.Future] | None:
        """Add a reply; returns the coroutine waiter to wake, if one is waiting."""
        with self._cond:
            self._replies.append(msg)
            self._cond.notify()
            waiter, self._waiter = self._waiter, None
        return waiter

    def get(self, timeout: float | None = None) -> Any:
        with self._cond:
            if not self._cond.wait_for(lambda: self._replies, timeout):
                raise TimeoutError(f"no reply from worker {self.worker.name} within {timeout} s")
            return self._replies.popleft()

    def get_nowait(self) -> Any | None:
        try:
            return self._replies.popleft()
        except IndexError:
            return None

    async def wait_async(self) -> None:
        """Wait in the running event loop until a reply is here (without taking it)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cond:
            if self._replies:
                return
            self._waiter = (loop, fut)
        try:
            await fut
        finally:
            with self._cond:
                if self._waiter is not None and self._waiter[1] is fut:
                    self._waiter = None

    def cancel(self) -> None:
        """Ask the worker to stop the request (queued; a worker that is gone has no request
        to stop: its Pending gets WorkerDied)."""
        try:
            self.worker.send(Cancel(self.req_id))
        except WorkerDied:
            pass


def _deliver(deliveries: list[tuple[Pending, Any]]) -> None:
    """Put each reply on its Pending, then wake the coroutines waiting for them with
    one call_soon_threadsafe per event loop."""
    waiters: dict[asyncio.AbstractEventLoop, list[asyncio.Future]] = {}
    for pending, msg in deliveries:
        if (w := pending.put(msg)) is not None:
            waiters.setdefault(w[0], []).append(w[1])
    for loop, futures in waiters.items():
        try:
            loop.call_soon_threadsafe(_wake, futures)
        except RuntimeError:
            pass  # that loop is closed: nobody is waiting any more


def _wake(futures: list[asyncio.Future]) -> None:
    for fut in futures:
        if not fut.done():
            fut.set_result(None)


class WorkerHandle:
    def __init__(self, name: str, devices: frozenset[str], env: dict[str, str],
                 on_death: Callable[["WorkerHandle"], None]):
        self.name = name
        self.devices = devices
        self.env = env
        self.on_death = on_death
        self.pid: int | None = None
        self.overhead: dict[str, int] = {}
        self.alive = False
        self._pending: dict[int, Pending] = {}
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # what the writer thread sends, in order
        self._process: mp.process.BaseProcess | None = None
        self._conn = None
        self._reader: threading.Thread | None = None
        self._writer: threading.Thread | None = None
        self._ids = itertools.count(1)

    def start(self, timeout: float = 120.0) -> None:
        """Spawn the process and wait until it has initialised its backends."""
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._process = ctx.Process(target=worker_main, args=(child, self.env), name=f"pyllmrouter-{self.name}",
                                    daemon=True)
        self._process.start()
        child.close()
        self._conn = parent
        if not parent.poll(timeout):
            self._process.kill()
            raise WorkerDied(f"worker {self.name} did not start within {timeout} s")
        try:
            ready = parent.recv()
        except (EOFError, OSError):
            raise WorkerDied(f"worker {self.name} exited while starting (exit code {self._exitcode()})") from None
        assert isinstance(ready, Ready), ready
        self.pid, self.overhead, self.alive = ready.pid, dict(ready.overhead), True
        self._reader = threading.Thread(target=self._read, name=f"reader-{self.name}", daemon=True)
        self._reader.start()
        self._writer = threading.Thread(target=self._write, name=f"writer-{self.name}", daemon=True)
        self._writer.start()

    def _exitcode(self) -> int | None:
        if self._process is None:
            return None
        self._process.join(1)
        return self._process.exitcode

    def send(self, msg: Any) -> None:
        """Queue ``msg`` for the writer thread (never blocks); WorkerDied if the worker is
        not running."""
        if not self.alive:
            raise WorkerDied(f"worker {self.name} is not running")
        self._outbox.put(msg)

    def _write(self) -> None:
        """The writer thread: the pipe's only writer, until Shutdown is sent or the pipe breaks
        (the reader then sees the worker end)."""
        while True:
            msg = self._outbox.get()
            try:
                self._conn.send(msg)
            except (OSError, ValueError):
                return
            if isinstance(msg, Shutdown):
                return

    def call(self, make: Callable[[int], Any]) -> Pending:
        """Send ``make(req_id)``; the replies arrive on the returned Pending."""
        req_id = next(self._ids)
        msg = make(req_id)
        pending = Pending(req_id, self, ping=isinstance(msg, Ping))
        with self._lock:
            if not self.alive:
                raise WorkerDied(f"worker {self.name} is not running")
            self._pending[req_id] = pending
            self._outbox.put(msg)  # under the lock: never after _died has failed the pending calls
        return pending

    def in_flight(self) -> int:
        """Calls waiting for their final reply (requests, loads, probes, fits), the heartbeat aside."""
        with self._lock:
            return sum(1 for p in self._pending.values() if not p.ping)

    def ping(self) -> Pending | None:
        """Send the heartbeat; its Pending gets Result(None) if the worker answers (None:
        the worker is already gone)."""
        try:
            return self.call(Ping)
        except WorkerDied:
            return None

    def kill(self) -> None:
        """End a worker that stopped answering: its reader then sees the pipe close, and the
        worker is dead as if it had crashed (its requests fail with WorkerDied)."""
        if self._process is not None and self._process.is_alive():
            self._process.kill()

    def wait_dead(self, timeout: float) -> bool:
        """Wait until the reader has seen the process end (its pending calls failed, the
        router told); whether it has."""
        if self._reader is None or self._reader is threading.current_thread():
            return not self.alive
        self._reader.join(timeout)
        return not self._reader.is_alive()

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            deliveries = []
            for m in msg.messages if isinstance(msg, Batch) else (msg,):
                with self._lock:
                    pending = self._pending.get(m.req_id)
                    if isinstance(m, FINAL):
                        self._pending.pop(m.req_id, None)
                if pending is not None:
                    deliveries.append((pending, m))
            _deliver(deliveries)
        self._died()

    def _died(self) -> None:
        with self._lock:
            was_alive, self.alive = self.alive, False
            orphans, self._pending = list(self._pending.values()), {}
        self._outbox.put(Shutdown())  # the writer ends too (its send fails on the closed pipe)
        code = self._exitcode()
        if was_alive:  # the router learns first, so whoever sees the failure sees the new state
            self.on_death(self)
        _deliver([(p, Failed(p.req_id, ErrorKind.WORKER_DIED, f"worker {self.name} (pid {self.pid}) exited with code {code}"))
                  for p in orphans])

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the worker to exit; kill it if it does not. Leaves no process."""
        if self._process is None:
            return
        with self._lock:
            self.alive = False
        self._outbox.put(Shutdown())  # after whatever was queued; a hung worker is killed below
        deadline = time.monotonic() + timeout
        self._process.join(max(0.0, deadline - time.monotonic()))
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        if self._conn is not None:
            self._conn.close()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(5)
        if self._writer is not None and self._writer is not threading.current_thread():
            self._writer.join(5)
