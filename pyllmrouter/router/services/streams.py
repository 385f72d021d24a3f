"""A request's reply as it comes from a worker: the chunks of a stream (``Stream``), the
errors a final reply is, and the wait for it that a caller who leaves cuts short.

    worker ──Chunk(HttpReply head) Chunk(bytes)* Result | Failed──▶ Pending ──▶ Stream
        __next__ (a thread) or anext_batch (a coroutine, woken by the reader thread);
        the final reply ends it: on_end() once (the model's lease released)
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from typing import Any, Awaitable, Callable

from pyllmrouter.errors import RequestFailed, RequestTimeout, RouterError, WorkerDied, Withdrawn
from pyllmrouter.protocol import Chunk, ErrorKind, Failed
from pyllmrouter.router import home

__all__ = ["Stream", "unless_gone", "value_of", "error_of"]


class Stream:
    """Chunks of one streaming request; ``cancel()`` may be called from any thread.

    ``on_end()`` (a model's lease released) runs exactly once: when the final
    reply arrives, whether the stream was read to its end, closed or cancelled.
    """

    def __init__(self, name: str, pending, on_end: Callable[[], None], first: bytes = b"",
                 deadline: float | None = None, timeout: float | None = None,
                 errors: Callable[[Failed], RouterError] | None = None):
        """``deadline`` (time.monotonic): a reader still waiting then ends the stream (its
        generation stopped) with RequestTimeout, naming ``timeout``, the request's own;
        ``errors``: the error a final Failed reply is (default: ``error_of``)."""
        self._name = name  # what the errors name (the model)
        self._errors = errors or (lambda reply: error_of(name, reply))
        self._deadline, self._timeout = deadline, timeout
        self._first = [first] if first else []  # the chunk that came with the head
        self._pending = pending
        self._on_end = on_end
        self._done = False
        self._cancelled = False  # stopped by its caller: its final reply is its end, not an error
        self._lock = threading.Lock()
        self._read = threading.Lock()  # one reader at a time (a drain may race a reader)
        self._failure: RouterError | None = None  # a failure found by anext_batch, raised next
        self._pid = os.getpid()  # its worker is this process's (router/home.py)

    @property
    def done(self) -> bool:
        """Whether the final reply has arrived (nothing more will come)."""
        return self._done

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> bytes:
        home.here(self._pid)
        with self._read:
            if self._failure is not None:
                failure, self._failure = self._failure, None
                raise failure
            if self._first:
                return self._first.pop()
            if self._done:
                raise StopIteration
            try:
                msg = self._pending.get(None if self._deadline is None else max(0.0, self._deadline - time.monotonic()))
            except TimeoutError:
                msg = None
            if isinstance(msg, Chunk):
                return msg.value
            if msg is not None:
                self._finish(msg)
        if msg is None:  # past the request's deadline: it stops, and its end is read in the background
            self._deadline = None
            self.abandon()
            raise RequestTimeout(self._name, self._timeout)
        if isinstance(msg, Failed) and not self._cancelled:
            raise self._errors(msg)
        raise StopIteration

    async def anext_batch(self) -> list[bytes]:
        """The next chunk and every further one already here ([] at the end), awaited in
        the event loop (woken by the worker's reader thread), not in a thread."""
        home.here(self._pid)
        while (out := self._ready()) is None:
            await self._pending.wait_async()
        return out

    def _ready(self) -> list[bytes] | None:
        """The chunks already here, [] at the end, None if none is here yet; a failure
        is raised once, after the chunks that came before it."""
        with self._read:
            out, self._first = self._first, []
            while not self._done:
                msg = self._pending.get_nowait()
                if msg is None:
                    break
                if isinstance(msg, Chunk):
                    out.append(msg.value)
                    continue
                self._finish(msg)
                if isinstance(msg, Failed) and not self._cancelled:
                    self._failure = self._errors(msg)
            if out:
                return out
            if self._failure is not None:
                failure, self._failure = self._failure, None
                raise failure
            return [] if self._done else None

    def _finish(self, final: Any) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._on_end()

    def cancel(self) -> None:
        """Stop generation (thread-safe). Whoever reads the stream then sees its end.  In a
        fork's child, nothing: the request is the parent's (router/home.py)."""
        if not self._done and os.getpid() == self._pid:
            self._cancelled = True
            self._pending.cancel()

    def close(self) -> None:
        """Cancel and wait for the worker's final reply (the lease is then free); in a fork's
        child, nothing."""
        if os.getpid() == self._pid:
            self.cancel()
            self._drain()

    async def aclose(self) -> None:
        """``close`` in the event loop: cancel, and await the worker's final reply."""
        self.cancel()
        while not self._done and os.getpid() == self._pid:
            try:
                await self.anext_batch()
            except RouterError:
                return

    def _drain(self) -> None:
        while not self._done:
            try:
                next(self)
            except (StopIteration, RouterError):
                return

    def abandon(self) -> None:
        """Cancel without waiting: the final reply is read (and the lease freed) in the background.
        Not while the interpreter finalizes (a stream collected at exit): a thread started then
        never runs, and Thread.start would wait for it for ever; the process is ending anyway.
        Not in a fork's child: the request is the parent's."""
        if not self._done and os.getpid() == self._pid:
            self.cancel()
            if not sys.is_finalizing():
                threading.Thread(target=self._drain, daemon=True).start()

    def __del__(self) -> None:
        self.abandon()


async def unless_gone(work: Awaitable[Any], watch: "asyncio.Future | None", model: str) -> Any:
    """``work``'s result, or Withdrawn if ``watch`` (the caller left) completes first."""
    if watch is None:
        return await work
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    if not task.done():
        task.cancel()
        raise Withdrawn(model)
    return task.result()


def value_of(name: str, reply: Any) -> Any:
    """A final reply's value, or the error a Failed one is (naming ``name``)."""
    if isinstance(reply, Failed):
        raise error_of(name, reply)
    return reply.value


def error_of(name: str, reply: Failed) -> RouterError:
    if reply.kind in (ErrorKind.WORKER_DIED, ErrorKind.NOT_LOADED):  # gone under the request: 503, retry
        return WorkerDied(f"model {name!r}: {reply.message}")
    return RequestFailed(name, reply.kind.value, reply.message)
