"""The router's end of a worker's native data path (the worker's end: csrc/conduit.h).

    hand(request, client fd) ──sendmsg, one SOCK_SEQPACKET datagram with the fd──▶ worker
        the worker's C++ answers on the client's socket itself (llama-server's handler,
        the reply's bytes written there), then
    the loop's reader ◀── done {id, status, bytes, keep, error} ── worker: the future
        resolves (read in the event loop that handed it over, add_reader: one wake-up per
        request, never per token, and no thread between)
    where the worker follows the connection (reads its next requests itself):
    the loop's reader ◀── progress {id, answers} ── worker, every report period: counted
    end_follows(model, epoch, at) ──a datagram without a descriptor──▶ worker: the model's
        follows of leases before epoch end by then, and their connections come back with done
        (never dropped: a full channel sends it when it has room)

A request is handed over whole or not at all: a datagram too big, or a worker whose
channel is full (it stopped reading), is refused at once (``hand`` returns None) and the
caller relays the request through the pipe instead.  A worker that dies fails every
request it holds (WorkerDied).  Nothing here blocks the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

from pyllmrouter.errors import WorkerDied

__all__ = ["Conduit", "Connection", "Served", "MAX_MESSAGE", "channel"]

MAX_MESSAGE = 256 * 1024  # one datagram: the worker's receive buffer (csrc/conduit.h)
EOF_GRACE = 5.0  # seconds after the worker's end closed before its requests fail here, if its handle has not said it died


@dataclass(frozen=True)
class Connection:
    """A client's connection as the server lends it: whether it is kept alive after this
    request, headers the server would add to the response (CORS), how the server stops
    using it (``begin``: its socket's descriptor at that moment, or None where the client
    has gone) and how it takes it back unused (``undo``).  The descriptor is asked for at
    the hand-over itself: a number taken earlier may be another client's by then."""

    keep_alive: bool
    extra_headers: tuple[tuple[str, str], ...]
    begin: Callable[[], "int | None"]
    undo: Callable[[], None]


@dataclass(frozen=True)
class Served:
    """A request the worker answered on the client's connection itself (and the next ones
    it read there itself, if any)."""

    status: int  # the HTTP status it wrote (0: it wrote nothing)
    bytes: int  # what it wrote, head included
    keep: bool  # the response went out whole and the connection may take the next request
    error: str = ""
    # where the worker read the connection's next requests itself (a hand-over's follow), each
    # request it answered that no progress listed, in order: (status, bytes, seconds it took
    # there); status, bytes and keep above are the last one's.  None: it read none
    answers: tuple[tuple[int, int, float], ...] | None = None


def channel() -> tuple[socket.socket, socket.socket]:
    """A (router's end, worker's end) pair; each end's buffers hold a whole datagram."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for s in (ours, theirs):
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                s.setsockopt(socket.SOL_SOCKET, opt, 4 * MAX_MESSAGE)
            except OSError:
                pass  # the system's cap: a datagram over it is refused and relayed
    return ours, theirs


class Conduit:
    """One worker's channel.  Its ``done`` messages are read in the event loop that hands
    requests over (``loop.add_reader``, bound at the first hand-over): no reader thread, no
    cross-thread wake-up per request.  A hand-over from another loop is refused (None: the
    caller relays it)."""

    def __init__(self, sock: socket.socket, name: str):
        sock.setblocking(False)  # sends never wait (a full channel relays); reads are the loop's
        self._sock = sock
        self._name = name
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # _pending, _closed, _loop, _ends: hand (loop), end_follows and close (any thread)
        self._pending: dict[int, asyncio.Future] = {}
        self._progress: dict[int, Callable[[tuple], None]] = {}  # a followed request's answers, as they come
        self._ends: collections.deque[tuple[str, int, float]] = collections.deque()  # ends the channel had no room for
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._detached = False  # the socket left the loop and is closed

    def hand(self, header: dict, body: bytes, fd: int,
             progress: "Callable[[tuple[tuple[int, int, float], ...]], None] | None" = None,
             ) -> "asyncio.Future[Served] | None":
        """Hand the request and the client's connection ``fd`` over; the future of what the
        worker did with it, or None where it cannot take it now (too big, its channel full,
        a loop other than the one bound): nothing was sent then.  WorkerDied if the worker
        is gone.  ``progress``: called in the loop with the answers a worker following the
        connection lists before it gives it back (as ``Served.answers``)."""
        rid = next(self._ids)
        message = json.dumps({**header, "id": rid}).encode() + b"\0" + body
        if len(message) > MAX_MESSAGE:
            return None
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._closed:
                raise WorkerDied(f"worker {self._name} is not running")
            if self._loop is None:
                self._loop = loop
                loop.add_reader(self._sock.fileno(), self._read)
            elif self._loop is not loop:
                return None
            fut = loop.create_future()
            self._pending[rid] = fut
            if progress is not None:
                self._progress[rid] = progress
        try:
            socket.send_fds(self._sock, [message], [fd], socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            self._forget(rid)
            return None
        except OSError as e:
            self._forget(rid)
            raise WorkerDied(f"worker {self._name} is not running ({e})") from None
        return fut

    def _forget(self, rid: int) -> "asyncio.Future | None":
        with self._lock:
            self._progress.pop(rid, None)
            return self._pending.pop(rid, None)

    def end_follows(self, model: str, epoch: int, at: float) -> None:
        """The worker's follows of ``model`` whose leases came before ``epoch`` end by ``at``
        (time.monotonic; now: after the request each is answering), from any thread.  Never
        dropped: where the channel is full, it is sent once the worker reads again (the
        bound loop's writer), or never where the worker is gone (its follows are too).  No
        loop bound yet: nothing was handed over, so nothing is followed."""
        with self._lock:
            if self._closed or self._loop is None:
                return
            self._ends.append((model, epoch, at))
            if len(self._ends) > 1:
                return  # behind those still waiting for room: the writer sends it
            loop = self._loop
        if not self._send_ends():
            try:
                loop.call_soon_threadsafe(self._arm_writer)
            except RuntimeError:
                pass  # that loop is closed: nobody is followed any more

    def _send_ends(self) -> bool:
        """Every end still to go sent, as far as the channel takes them (any thread): True
        once none is left."""
        with self._lock:
            while self._ends:
                model, epoch, at = self._ends[0]
                ms = max(0, int((at - time.monotonic()) * 1000))
                try:
                    self._sock.send(json.dumps({"end": model, "epoch": epoch, "ms": ms}).encode(),
                                    socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    return False
                except OSError:  # the worker is gone, and its follows with it
                    self._ends.clear()
                    return True
                self._ends.popleft()
            return True

    def _arm_writer(self) -> None:
        """In the bound loop: the ends left sent when the channel has room again."""
        if self._detached:
            return

        def flush() -> None:
            if self._send_ends() or self._detached:
                self._loop.remove_writer(self._sock.fileno())
        self._loop.add_writer(self._sock.fileno(), flush)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    def _read(self) -> None:
        """In the bound loop: every ``done`` that has come."""
        while True:
            try:
                data = self._sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                # the worker's end closed: its process is ending, and its handle's reader fails
                # what it held once the router has moved its models (close(), after on_death),
                # so a request that sees the failure sees the new state; failed here only if
                # that never comes
                loop = self._loop
                loop.remove_reader(self._sock.fileno())
                loop.call_later(EOF_GRACE, self.close)
                return
            try:
                done = json.loads(data)
                rid = int(done["id"])
                answers = done.get("answers")
                if answers is not None:
                    answers = tuple((int(a[0]), int(a[1]), float(a[2])) for a in answers)
                if done.get("progress"):
                    with self._lock:
                        progress = self._progress.get(rid)
                    if progress is not None and answers:
                        progress(answers)
                    continue
                served = Served(int(done["status"]), int(done["bytes"]), bool(done["keep"]), done.get("error") or "",
                                answers)
            except (ValueError, KeyError, TypeError, IndexError):
                continue
            fut = self._forget(rid)
            if fut is not None and not fut.done():
                fut.set_result(served)

    def close(self) -> None:
        """The worker is gone (any thread): every request it held fails (WorkerDied), and the
        socket leaves the loop and closes (in the loop, where it was registered)."""
        with self._lock:
            self._closed = True
            orphans, self._pending = list(self._pending.values()), {}
            self._progress = {}
            self._ends.clear()
            loop = self._loop
        for fut in orphans:
            _settle(fut, WorkerDied(f"worker {self._name} ended while it answered a request"))
        if loop is None:
            self._detach()
            return
        try:
            loop.call_soon_threadsafe(self._detach)
        except RuntimeError:  # that loop is closed: its selector is gone with it
            self._detach()

    def let_go(self) -> None:
        """In a fork's child: its copy of the socket closed, taking no lock (router/home.py)."""
        self._sock.close()

    def _detach(self) -> None:
        if self._detached:
            return
        self._detached = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.remove_reader(self._sock.fileno())
                loop.remove_writer(self._sock.fileno())
            except (ValueError, OSError):
                pass
        self._sock.close()


def _settle(fut: asyncio.Future, outcome: BaseException) -> None:
    """``fut`` fails with ``outcome``, from any thread (in its own loop)."""

    def done() -> None:
        if not fut.done():
            fut.set_exception(outcome)
    try:
        fut.get_loop().call_soon_threadsafe(done)
    except RuntimeError:
        pass  # that loop is closed: nobody waits any more
