"""The router's side of a worker process: start, send, route replies, notice death.

    Router ──call(msg)──▶ WorkerHandle ──pipe──▶ worker process (masked)
           ◀─Pending.get()── reader thread ◀─pipe── replies, routed by req_id

A dead worker (crash, kill -9) closes the pipe: the reader thread fails every
pending call with WorkerDied (nobody waits forever) and tells the router, which
marks the worker's models unloaded.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import queue
import threading
import time
from typing import Any, Callable

from .errors import WorkerDied
from .protocol import FINAL, Batch, Cancel, Failed, Ready, Shutdown
from .worker import worker_main

__all__ = ["WorkerHandle", "Pending"]

class Pending:
    """Replies to one call, in order; the last one is final (Result, Failed, ...)."""

    def __init__(self, req_id: int, worker: "WorkerHandle"):
        self.req_id = req_id
        self.worker = worker
        self._replies: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, msg: Any) -> None:
        self._replies.put(msg)

    def get(self, timeout: float | None = None) -> Any:
        try:
            return self._replies.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no reply from worker {self.worker.name} within {timeout} s") from None

    def get_nowait(self) -> Any | None:
        try:
            return self._replies.get_nowait()
        except queue.Empty:
            return None

    def cancel(self) -> None:
        self.worker.send(Cancel(self.req_id))


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
        self._send_lock = threading.Lock()
        self._process: mp.process.BaseProcess | None = None
        self._conn = None
        self._reader: threading.Thread | None = None
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

    def _exitcode(self) -> int | None:
        if self._process is None:
            return None
        self._process.join(1)
        return self._process.exitcode

    def send(self, msg: Any) -> None:
        with self._send_lock:
            self._conn.send(msg)

    def call(self, make: Callable[[int], Any]) -> Pending:
        """Send ``make(req_id)``; the replies arrive on the returned Pending."""
        req_id = next(self._ids)
        pending = Pending(req_id, self)
        with self._lock:
            if not self.alive:
                raise WorkerDied(f"worker {self.name} is not running")
            self._pending[req_id] = pending
        try:
            self.send(make(req_id))
        except (OSError, ValueError) as e:
            with self._lock:
                self._pending.pop(req_id, None)
            raise WorkerDied(f"worker {self.name} is gone: {e}") from None
        return pending

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            for m in msg.messages if isinstance(msg, Batch) else (msg,):
                with self._lock:
                    pending = self._pending.get(m.req_id)
                    if isinstance(m, FINAL):
                        self._pending.pop(m.req_id, None)
                if pending is not None:
                    pending.put(m)
        self._died()

    def _died(self) -> None:
        with self._lock:
            was_alive, self.alive = self.alive, False
            orphans, self._pending = list(self._pending.values()), {}
        code = self._exitcode()
        for p in orphans:
            p.put(Failed(p.req_id, "WorkerDied", f"worker {self.name} (pid {self.pid}) exited with code {code}"))
        if was_alive:
            self.on_death(self)

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the worker to exit; kill it if it does not. Leaves no process."""
        if self._process is None:
            return
        with self._lock:
            self.alive = False
        try:
            self.send(Shutdown())
        except (OSError, ValueError):
            pass
        deadline = time.monotonic() + timeout
        self._process.join(max(0.0, deadline - time.monotonic()))
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        if self._conn is not None:
            self._conn.close()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(5)
