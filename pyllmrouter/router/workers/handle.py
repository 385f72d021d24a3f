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
import contextlib
import itertools
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections import deque
from multiprocessing.connection import Connection, Pipe
from typing import Any, Callable

from pyllmrouter.errors import WorkerDied
from pyllmrouter.router import home
from pyllmrouter.router.workers.conduit import Conduit, channel
from pyllmrouter.protocol import FINAL, Batch, Cancel, ErrorKind, Failed, Ping, Ready, Shutdown

__all__ = ["WorkerHandle", "Pending", "WORKER_ENTRY", "Launch"]

# A worker is a fresh interpreter (spawned, never forked: no lock or thread of the router
# is copied into it) that starts from pyllmrouter's own entry point.  multiprocessing's
# spawn would first run the application's main module again in the child (a script without
# an ``if __name__ == "__main__"`` guard would then start its own router there); this
# imports nothing of the application: the parent's sys.path, then the worker.
#
# The app's signals are the app's: a worker runs in a session of its own (a terminal's
# Ctrl-C, ``kill -TERM -PGID`` do not reach it), and it starts with SIGINT and SIGTERM
# blocked (``_app_signals_held``), which its first instruction turns to ignored (a
# signal to every process of a service, as systemd's stop sends, finds them ignored
# from exec on).  It ends when its router says so, when the router's end of its pipe
# closes, or when the router's process is gone (engine/worker.py watches it).
WORKER_ENTRY = "pyllmrouter.engine.worker"
_APP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_BOOT = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM)); "
         "import json, os, sys; sys.path[:] = json.loads(os.environ.pop('PYLLMROUTER_SYS_PATH')); "
         f"from {WORKER_ENTRY} import main; main()")
_TAIL = 20  # lines of a worker's stderr kept to explain its death
START_TIMEOUT = 120.0  # seconds a worker has to initialise its backends once spawned
# a line that says why a process ended: ggml's abort or assert ("file.cpp:547: Failed to
# connect..."), Python's exception line, or a line that says error or failed; not a frame
# of the backtrace ggml prints after its message
_REASON = re.compile(r"^(\S+\.(c|cc|cpp|cu|h|hpp):\d+: .+|[A-Za-z_][\w.]*(Error|Exception|Exit)\b.*"
                     r"|[^#\s\[].*\b(error|failed)\b.*)$", re.I)

class Pending:
    """Replies to one call, in order; the last one is final (Result, Failed, ...).

    A thread blocks in ``get``; a coroutine awaits ``wait_async``, which
    the reader thread wakes with one ``call_soon_threadsafe`` per event loop and
    pipe message (no thread hop per chunk).  Every coroutine waiting is woken (a stream's
    reader and a task closing it may wait at once).
    """

    def __init__(self, req_id: int, worker: "WorkerHandle", ping: bool = False):
        self.req_id = req_id
        self.worker = worker
        self.ping = ping  # the heartbeat: it keeps no worker busy
        self._replies: deque = deque()
        self._cond = threading.Condition(threading.Lock())
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    def put(self, msg: Any) -> list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]:
        """Add a reply; returns the coroutine waiters to wake."""
        with self._cond:
            self._replies.append(msg)
            self._cond.notify()
            waiters, self._waiters = self._waiters, []
        return waiters

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
            self._waiters.append((loop, fut))
        try:
            await fut
        finally:
            with self._cond:
                self._waiters = [w for w in self._waiters if w[1] is not fut]

    def cancel(self) -> None:
        """Ask the worker to stop the request (queued; a worker that is gone has no request
        to stop: its Pending gets WorkerDied)."""
        try:
            self.worker.send(Cancel(self.req_id))
        except WorkerDied:
            pass


@contextlib.contextmanager
def _app_signals_held():
    """SIGINT and SIGTERM blocked in this thread meanwhile: a process started here inherits
    the mask across exec, so neither can end it before its first instruction ignores them
    (blocked, not ignored, here: the app's own handlers still get them, in its main thread,
    or once the mask is restored)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _APP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _deliver(deliveries: list[tuple[Pending, Any]]) -> None:
    """Put each reply on its Pending, then wake the coroutines waiting for them with
    one call_soon_threadsafe per event loop."""
    waiters: dict[asyncio.AbstractEventLoop, list[asyncio.Future]] = {}
    for pending, msg in deliveries:
        for loop, fut in pending.put(msg):
            waiters.setdefault(loop, []).append(fut)
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
    """One worker process, seen from the router (``Launch`` makes one: this class, or a
    stand-in with the same surface where processes are simulated)."""

    def __init__(self, name: str, devices: frozenset[str], env: dict[str, str],
                 on_death: Callable[["WorkerHandle"], None]):
        self.name = name
        self.devices = devices
        self.env = env
        self.on_death = on_death
        self.pid: int | None = None
        self.overhead: dict[str, int] = {}
        self.alive = False
        self.death = ""  # once it died: its exit status and why (" (exit code -9): ...")
        self._pending: dict[int, Pending] = {}
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # what the writer thread sends, in order
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._stderr: deque[str] = deque(maxlen=_TAIL)  # the last lines the worker wrote there
        self._reason: str | None = None  # the last of them that said why (_REASON)
        self._relay: threading.Thread | None = None
        self.conduit: Conduit | None = None  # the worker's native data path, once it runs
        self._reader: threading.Thread | None = None
        self._writer: threading.Thread | None = None
        self._ids = itertools.count(1)

    def start(self, timeout: float = START_TIMEOUT) -> None:
        """Spawn the process and wait until it has initialised its backends."""
        parent, child = Pipe()
        ours, theirs = channel()  # the native data path: connections handed over (conduit.py)
        env = {**os.environ, **self.env, "PYLLMROUTER_SYS_PATH": json.dumps(sys.path)}
        try:
            with _app_signals_held():
                self._process = subprocess.Popen(
                    [sys.executable, "-c", _BOOT, WORKER_ENTRY, str(os.getpid()), str(theirs.fileno()),
                     str(child.fileno())], pass_fds=(child.fileno(), theirs.fileno()), env=env,
                    stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        except OSError as e:  # no process at all (out of memory, no executable)
            ours.close()
            raise WorkerDied(f"worker {self.name} could not start: {e}") from None
        finally:
            child.close()
            theirs.close()
        self.conduit = Conduit(ours, self.name)
        self._conn = parent
        home.hold(self)  # a fork's child lets its copies go: the worker sees our end close
        self._relay = threading.Thread(target=self._relay_stderr, name=f"stderr-{self.name}", daemon=True)
        self._relay.start()
        if not parent.poll(timeout):
            self._process.kill()
            raise WorkerDied(f"worker {self.name} did not start within {timeout} s{self._last_words()}")
        try:
            ready = parent.recv()
        except (EOFError, OSError):
            code = self._exitcode()
            raise WorkerDied(f"worker {self.name} exited while starting (exit code {code}){self._last_words()}") \
                from None
        assert isinstance(ready, Ready), ready
        self.pid, self.overhead, self.alive = ready.pid, dict(ready.overhead), True
        self._reader = threading.Thread(target=self._read, name=f"reader-{self.name}", daemon=True)
        self._reader.start()
        self._writer = threading.Thread(target=self._write, name=f"writer-{self.name}", daemon=True)
        self._writer.start()

    def let_go(self) -> None:
        """In a fork's child: its copies of the worker's pipe and channel closed (the
        parent's stay open; router/home.py)."""
        if self._conn is not None:
            self._conn.close()
        if self.conduit is not None:
            self.conduit.let_go()

    def _exitcode(self) -> int | None:
        """The process's exit status (-N: killed by signal N), waiting a second at most."""
        if self._process is None:
            return None
        try:
            return self._process.wait(1)
        except subprocess.TimeoutExpired:
            return None

    def _relay_stderr(self) -> None:
        """Pass the worker's stderr on to ours, keeping its last lines (why it died)."""
        for raw in self._process.stderr:
            line = raw.decode(errors="replace")
            if line.strip():
                self._stderr.append(line.rstrip())
                if _REASON.match(line.strip()):
                    self._reason = line.strip()
            try:
                sys.stderr.write(line)
                sys.stderr.flush()
            except (OSError, ValueError, AttributeError):
                pass  # no stderr here (closed, or a pythonw): the tail is still kept
        self._process.stderr.close()

    def _last_words(self) -> str:
        """': <why, from the worker's stderr>' (the last line that says why, else its last
        line), once its stderr is read to the end (a backtrace takes a few seconds)."""
        if self._relay is not None and self._relay is not threading.current_thread():
            self._relay.join(10)
        why = self._reason or (self._stderr[-1] if self._stderr else None)
        return f": {why}" if why else ""

    def _alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def exited(self) -> bool:
        """Its process has ended, whether or not its reader has seen it yet (a request sent
        now would meet a dead worker: it waits for the model's reload instead)."""
        return self._process is not None and self._process.poll() is not None

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
        """Calls waiting for their final reply (requests, loads, probes, fits, requests handed
        over on the native data path), the heartbeat aside."""
        with self._lock:
            relayed = sum(1 for p in self._pending.values() if not p.ping)
        return relayed + (self.conduit.in_flight() if self.conduit is not None else 0)

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
        if self._alive():
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
        why = self._last_words() if code else ""
        self.death = f" (exit code {code}){why}"
        if was_alive:  # the router learns first, so whoever sees the failure sees the new state
            self.on_death(self)
        if self.conduit is not None:  # the requests it answered natively fail too
            self.conduit.close()
        _deliver([(p, Failed(p.req_id, ErrorKind.WORKER_DIED, f"worker {self.name} (pid {self.pid}) exited with code {code}{why}"))
                  for p in orphans])

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the worker to exit; kill it if it does not. Leaves no process."""
        if self._process is None:
            return
        with self._lock:
            self.alive = False
        self._outbox.put(Shutdown())  # after whatever was queued; a hung worker is killed below
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(5)
        if self._conn is not None:
            self._conn.close()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(5)
        if self._writer is not None and self._writer is not threading.current_thread():
            self._writer.join(5)
        if self._relay is not None and self._relay is not threading.current_thread():
            self._relay.join(5)
        if self.conduit is not None:
            self.conduit.close()


# what makes a worker's handle: (name, device set, mask environment, on_death) -> a handle
# not started yet (WorkerHandle itself; the scheduler's tests pass simulated ones)
Launch = Callable[[str, frozenset, dict, Callable[[WorkerHandle], None]], WorkerHandle]
