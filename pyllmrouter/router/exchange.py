"""One request from its lease to its release: the one place where a caller's stop is kept.

    Router.call/acall ─lease─▶ Exchange.send ──Call──▶ worker: the model's engine
                                  │ first(): the first reply ◀── Result(HttpReply) | Chunk(head) | Failed
                                  │   whole: the lease released at once
                                  │   stream: a Stream over the same Pending, the lease released
                                  │           with its final reply
                                  └─ stop(): the caller stopped waiting

The invariant, on every path (sync or async, whole or streamed, ``timeout=``, a task
cancelled, an iterator closed, dropped or collected, ``Router.close()``): when the caller
stops waiting, the work stops.  ``stop()`` tells the worker at once (Cancel: the request's
StopFlag, which llama.cpp's engine looks at within 50 ms, cmake/llama_engine.cmake) and
releases the lease when the worker's final reply comes, read in the background: the
request's slot is free and its lease gone, whoever reads nothing more.  ``stop()`` runs once,
from any thread; an exchange whose final reply was read needs none.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from typing import Any, Awaitable, Callable

from pyllmrouter.errors import RequestTimeout, RouterClosed, RouterError
from pyllmrouter.protocol import Call, Chunk, Failed, HttpReply
from pyllmrouter.router.services.streams import Stream, error_of, unless_gone

__all__ = ["Exchange"]


class Exchange:
    """A request sent on a lease: its first reply awaited, its stream handed out, its end
    (read, or stopped) releasing the lease exactly once."""

    def __init__(self, lease: Any, release: Callable[[Any], None], closed: Callable[[], bool]):
        """``release(lease)`` ends the lease (the scheduler's); ``closed()``: whether the
        router was closed (a request cut by the close fails with RouterClosed)."""
        self.lease = lease
        self.name = lease.name
        self._release = release
        self._closed = closed
        self._pending: Any = None
        self._stream: Stream | None = None
        self._lock = threading.Lock()
        self._ended = False  # the lease released
        self._stopped = False

    # -- the lease's one end -----------------------------------------------------------

    def _end(self) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = True
        self._release(self.lease)

    def error(self, reply: Failed) -> RouterError:
        """The error a final Failed reply is: RouterClosed where the router's close cut it."""
        if self._closed():
            return RouterClosed(f"the router was closed while model {self.name!r} served the request")
        return error_of(self.name, reply)

    # -- sending and the first reply ------------------------------------------------------

    def send(self, method: str, path: str, body: bytes, query: dict[str, str] | None,
             headers: dict[str, str] | None = None, files: dict[str, tuple[str, str, bytes]] | None = None) -> None:
        """The request to the lease's worker (a worker that died since raises WorkerDied, the
        lease released)."""
        lease = self.lease
        try:
            self._pending = lease.worker.call(lambda rid: Call(rid, lease.name, method, path, body, dict(query or {}),
                                                               dict(headers or {}), dict(files or {})))
        except BaseException:
            self._end()
            raise

    def first(self, deadline: float | None, timeout: float | None) -> Any:
        """The first reply, waited for in this thread no later than ``deadline`` (then the
        request is stopped: RequestTimeout); any exception here stops it too."""
        try:
            return self._pending.get(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            self.stop()
            raise RequestTimeout(self.name, timeout) from None
        except BaseException:
            self.stop()
            raise

    async def afirst(self, deadline: float | None, timeout: float | None,
                     watch: "asyncio.Future | None", departure: Callable[[], "asyncio.Future | None"]) -> Any:
        """The first reply, awaited in the event loop (woken by the worker's reader thread);
        the request stopped if the caller leaves (its task cancelled, ``watch`` done: an HTTP
        client gone, Withdrawn) or ``deadline`` passes (RequestTimeout)."""
        try:
            while (first := self._pending.get_nowait()) is None:
                watch = watch or departure()
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    await asyncio.wait_for(unless_gone(self._pending.wait_async(), watch, self.name), left)
                except asyncio.TimeoutError:
                    raise RequestTimeout(self.name, timeout) from None
            return first
        except BaseException:
            self.stop()
            raise

    def opened(self, first: Any, deadline: float | None = None,
               timeout: float | None = None) -> "tuple[HttpReply, Stream | None]":
        """The first reply as the caller gets it: a whole reply (the lease released now), or
        a stream's head and its Stream (chunks read no later than ``deadline``)."""
        if isinstance(first, Chunk) and isinstance(first.value, HttpReply):
            self._stream = Stream(self.name, self._pending, self._end, first.value.body, deadline, timeout,
                                  errors=self.error)
            return first.value, self._stream
        self._end()
        if isinstance(first, Failed):
            raise self.error(first)
        return first.value, None

    # -- the caller stopped waiting ---------------------------------------------------------

    def stop(self) -> None:
        """The caller stopped waiting: the worker told now, the lease released with the
        worker's final reply (read in the background).  Once; from any thread."""
        with self._lock:
            if self._stopped or self._ended:
                return
            self._stopped = True
        if self._stream is not None:
            self._stream.abandon()
            return
        if self._pending is None:  # nothing was sent
            self._end()
            return
        try:
            self._pending.cancel()
        finally:
            if not sys.is_finalizing():  # at exit a thread never starts (Stream.abandon says more)
                threading.Thread(target=self._drain, name=f"stop-{self.name}", daemon=True).start()

    def _drain(self) -> None:
        try:
            while isinstance(self._pending.get(), Chunk):  # a stream that began: its end is the final reply
                pass
        finally:
            self._end()


def departure(gone: Callable[[], Awaitable[Any]] | None) -> "asyncio.Future | None":
    """A task that ends when the caller has left (None: nothing to watch)."""
    return asyncio.ensure_future(gone()) if gone is not None else None
