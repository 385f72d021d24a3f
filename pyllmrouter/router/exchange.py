"""One request from its lease to its release: the one object that owns it, on every path.

    Router.call/acall/arelay/serve_now (Methods) ──Ask──▶ Exchange
        lease: taken here (hold: waited for in this thread; ahold: in the event loop, or in
               a thread with the caller's departure watched; take_now: only where it can be now)
        claim: a cluster's node asks whether the request may run (``Ask.running``)
        hand:  the request and the client's connection to the worker (``Ask.hand``: the
               native path), the lease released with the worker's answer
        send:  ──Call──▶ worker: the model's engine (the pipe); the first reply ◀── Result(HttpReply)
               | Chunk(head) | Failed
               whole: the lease released at once; stream: a Stream over the same Pending, the
               lease released with its final reply
        stop(): the caller stopped waiting
        _end(): the lease released: the one place, once

The sending modes (whole or streamed, sync or async, relayed, native, a conversation's turn,
a claimed run) are fields of the one ``Ask``, not entry points of their own.

The invariant, on every path (sync or async, whole or streamed, ``timeout=``, a task
cancelled, an iterator closed, dropped or collected, ``Router.close()``): when the caller
stops waiting, the work stops.  ``stop()`` tells the worker at once (Cancel: the request's
StopFlag, which llama.cpp's engine looks at within 50 ms, cmake/llama_engine.cmake) and
releases the lease when the worker's final reply comes, read in the background: the
request's slot is free and its lease gone, whoever reads nothing more.  ``stop()`` runs once,
from any thread; an exchange whose final reply was read needs none.  A request handed over
to the worker on the client's connection is the worker's to end: its lease is released when
the worker's answer comes, whoever awaits it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import numbers
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterator, Mapping

from pyllmrouter.errors import (QueueTimeout, RequestFailed, RequestTimeout, RouterClosed, RouterError, Unclaimed,
                                Withdrawn)
from pyllmrouter.protocol import Call, Chunk, Failed, HttpReply
from pyllmrouter.router.services.streams import Stream, error_of, unless_gone
from pyllmrouter.router.workers.conduit import Connection, Served

__all__ = ["Ask", "Exchange", "Hand", "body_of", "checked_seconds", "ok_or_raise", "remaining"]

_POOLING_HINT = ("; an embedding model served for /v1/embeddings needs a pooling: start it with "
                 "ModelSpec(path, ('--embedding', '--pooling', 'mean')) (or cls, last, rank)")


def body_of(body: bytes | Mapping[str, Any]) -> bytes:
    """A request body: bytes as they are, a dict as JSON."""
    return body if isinstance(body, (bytes, bytearray)) else json.dumps(dict(body)).encode()


def remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def checked_seconds(name: str, value: Any, zero: bool = False) -> float | None:
    """``value`` as seconds (None, or more than a thread can wait: no bound): a TypeError for
    what is not a real number (numpy's included), a ValueError for a negative one, NaN, or 0
    where ``zero`` is not allowed."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy's bool is no Real
        raise TypeError(f"{name} must be a number of seconds (an int or a float) or None, "
                        f"not {type(value).__name__} {value!r}")
    try:
        seconds = float(value)
    except OverflowError:
        seconds = math.inf
    if math.isnan(seconds) or seconds < 0 or (seconds == 0 and not zero):
        raise ValueError(f"{name} must be {'0 or more' if zero else 'more than 0'} seconds, not {value!r}")
    return None if seconds > threading.TIMEOUT_MAX else seconds


def ok_or_raise(model: str, reply: HttpReply) -> HttpReply:
    """``reply``, or RequestFailed carrying its status and llama.cpp's message."""
    if reply.status < 400:
        return reply
    try:
        data = json.loads(reply.body)
    except ValueError:
        data = None
    err = data.get("error") if isinstance(data, dict) else None
    message = err.get("message") if isinstance(err, dict) else reply.body.decode(errors="replace")
    if "Pooling type 'none'" in message:
        message += _POOLING_HINT
    raise RequestFailed(model, f"HTTP {reply.status}", message, status=reply.status)


@dataclass(frozen=True)
class Hand:
    """The native mode of a request: answered by its worker on the client's ``connection``
    itself where the worker can take it (router/workers/conduit.py).  ``follow``: the next
    requests like this one that the worker may read itself on the connection (server/connection.py,
    ``Handover.follow``), under the same lease; ``progress`` gets the answers listed meanwhile."""

    connection: Connection
    query_string: str = ""
    follow: dict | None = None
    progress: Callable[[tuple], None] | None = None


@dataclass(frozen=True)
class Ask:
    """One request as the router takes it: what is sent (``model``, ``method``, ``path``,
    ``body`` bytes or a dict sent as JSON, ``query``, ``headers``, ``files``: a multipart
    request's files), how long it may take (``timeout``: the whole request; ``wait``: the
    wait for its model, default the router's queue_timeout), ``autoload`` and
    ``raise_for_status`` (``Router.call``), and how it is sent:

    ``gone()`` returns when the caller left (an HTTP client disconnected: a wait for the
    model withdrawn, Withdrawn; a request in flight stopped); ``leased`` gets the name of the
    instance that takes the request (the model's, or an extra one's); ``prefer``: the
    instance to take where it has a free slot (a conversation's last); ``waited``: seconds
    the request already waited on another node (it keeps its place in line here); with
    ``running``, the lease waits for one of the instance's slots to be free (the request
    runs at once, never queued in its engine), then ``running()`` says whether it may run:
    False (its cluster's ingress gave it up, ray/ledger.py) ends it with Unclaimed;
    ``hand``: the native mode (``Hand``)."""

    model: str
    method: str
    path: str
    body: bytes | Mapping[str, Any] = b""
    query: dict[str, str] | None = None
    headers: dict[str, str] | None = None
    files: dict[str, tuple[str, str, bytes]] | None = None
    timeout: float | None = None
    wait: float | None = None
    autoload: bool | None = None
    raise_for_status: bool = True
    gone: Callable[[], Awaitable[Any]] | None = None
    leased: Callable[[str], None] | None = None
    prefer: str | None = None
    waited: float = 0.0
    running: Callable[[], Awaitable[bool]] | None = None
    hand: Hand | None = None


class Exchange:
    """One request's life: its lease taken, the request sent (or handed over), its first
    reply awaited, its stream handed out, and its end (read, answered, or stopped)
    releasing the lease exactly once."""

    def __init__(self, sched: Any, ask: Ask, queue_timeout: float, fake_timing: float,
                 closed: Callable[[], bool]):
        """``sched``: the scheduler whose lease it takes and releases; ``queue_timeout``: the
        wait for the model where ``ask`` names none; ``fake_timing``: seconds the request
        holds its lease before it is sent (RouterOptions.debug_fake_timing); ``closed()``:
        whether the router was closed (a request cut by the close fails with RouterClosed)."""
        self.ask = ask
        self.name = ask.model
        self.lease: Any = None
        self.timeout = checked_seconds("timeout", ask.timeout)
        self.wait = checked_seconds("wait", ask.wait, zero=True)
        self.deadline = None if self.timeout is None else time.monotonic() + self.timeout
        self._sched = sched
        self._queue_timeout = queue_timeout
        self._fake = fake_timing
        self._closed = closed
        self._watch: asyncio.Future | None = None  # the caller's departure, watched since a wait
        self._pending: Any = None
        self._stream: Stream | None = None
        self._handed: asyncio.Future | None = None  # the worker's answer on the client's connection
        self._lock = threading.Lock()
        self._ended = False  # the lease released
        self._stopped = False

    # -- the lease's one end -----------------------------------------------------------

    def _end(self) -> None:
        with self._lock:
            if self._ended or self.lease is None:
                return
            self._ended = True
        self._sched.release(self.lease)

    def error(self, reply: Failed) -> RouterError:
        """The error a final Failed reply is: RouterClosed where the router's close cut it."""
        if self._closed():
            return RouterClosed(f"the router was closed while model {self.name!r} served the request")
        return error_of(self.name, reply)

    # -- whole lives ------------------------------------------------------------------------

    def run(self) -> "tuple[HttpReply, Stream | None]":
        """The request in this thread (``Router.call``): the lease waited for, the request sent,
        its first reply read no later than the deadline."""
        self.hold()
        if self._fake > 0:
            time.sleep(self._fake)  # busy on the model meanwhile (the lease is held)
        self.send()
        reply, stream = self.opened(self.first(), self.deadline, self.timeout)
        return self._checked(reply), stream

    async def arun(self) -> "Served | tuple[HttpReply, Stream | None]":
        """The request in the event loop (``Router.acall``, ``arelay``): Served where
        the worker answered on the client's connection (``Ask.hand``), else (reply, stream)."""
        ask = self.ask
        await self.ahold(slot=ask.running is not None)
        try:
            try:
                if ask.running is not None and not await ask.running():
                    raise Unclaimed(ask.model)
                if ask.leased is not None:
                    ask.leased(self.lease.name)
                if ask.hand is not None:
                    self._unwatch()  # once handed over, a client that leaves is the worker's to notice
                    served = self.hand()
                    if served is not None:
                        return await asyncio.shield(served)  # the worker's answer; the lease ends with it
                self.send()
            except BaseException:
                self.stop()
                raise
            # handed over or not, a native request's client is not watched after its lease
            first = await self.afirst(ask.gone if ask.hand is None else None)
            reply, stream = self.opened(first)
            return self._checked(reply), stream
        finally:
            self._unwatch()

    def run_now(self) -> "asyncio.Future | None":
        """The native request where nothing need wait (``Router.serve_now``), without a
        coroutine: handed over at once where the model can take it now and its worker the
        connection (the future of the worker's answer); None where not (nothing taken,
        nothing sent)."""
        if self._fake > 0:
            return None
        try:
            lease = self._sched.try_lease(self.ask.model)
        except RouterError:
            return None
        if lease is None:
            return None
        self._took(lease)
        try:
            served = self.hand()
        except RouterError:
            return None  # the lease is released, the connection undone
        if served is None:
            self._end()
        return served

    def _checked(self, reply: HttpReply) -> HttpReply:
        return ok_or_raise(self.ask.model, reply) if self.ask.raise_for_status else reply

    # -- the lease ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _bound(self) -> Iterator[float]:
        """The seconds the request may wait for its model: ``wait`` (default queue_timeout), and
        no later than its own deadline; a QueueTimeout that the deadline caused is the
        request's RequestTimeout."""
        wait = self._queue_timeout if self.wait is None else self.wait
        left = remaining(self.deadline)
        try:
            yield wait if left is None else min(wait, left)
        except QueueTimeout:
            if left is not None and left < wait:
                raise RequestTimeout(self.ask.model, self.timeout) from None
            raise

    def _took(self, lease: Any) -> None:
        self.lease = lease
        self.name = lease.name

    def hold(self) -> None:
        """The model's lease, waited for in this thread."""
        with self._bound() as bound:
            self._took(self._sched.lease(self.ask.model, bound, self.ask.autoload))

    def load(self, timeout: float | None) -> None:
        """The model loaded (``Router.load``): its lease waited for at most ``timeout`` seconds
        (default: queue_timeout), and ended at once."""
        self._took(self._sched.lease(self.ask.model, timeout, autoload=True))
        self._end()

    async def ahold(self, slot: bool = False) -> None:
        """The model's lease, taken in the event loop where it can be now, else waited for in a
        thread with the caller's departure watched (a task: made only for a wait, kept until
        the exchange's first reply).  ``slot``: with one of the instance's slots free
        (Scheduler.lease)."""
        ask = self.ask
        try:
            with self._bound() as bound:
                lease = self._sched.try_lease(ask.model, ask.prefer, slot)
                if lease is None:
                    self._watch = departure(ask.gone)
                    lease = await self._await_lease(bound, slot)
            self._took(lease)
            if self._fake > 0:
                await asyncio.sleep(self._fake)  # busy on the model meanwhile (the lease is held)
        except BaseException:
            self._unwatch()
            self._end()
            raise

    async def _await_lease(self, bound: float, slot: bool) -> Any:
        """A lease waited for in a thread; withdrawn if the caller leaves meanwhile (a lease
        the thread took all the same is released when it returns)."""
        ask = self.ask
        left = threading.Event()
        fut = asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self._sched.lease, ask.model, bound, ask.autoload, left, ask.prefer,
                                    waited=ask.waited, slot=slot))
        try:
            return await unless_gone(asyncio.shield(fut), self._watch, ask.model)
        except BaseException:
            self._sched.withdraw(left)
            fut.add_done_callback(self._late)
            raise

    def _late(self, fut: "asyncio.Future") -> None:
        """The lease a withdrawn wait took all the same: released."""
        if not fut.cancelled() and fut.exception() is None:
            self._took(fut.result())
            self._end()

    def _unwatch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    # -- the native mode: the worker answers on the client's connection ----------------------

    def hand(self) -> "asyncio.Future | None":
        """The request and its connection handed to the lease's worker: the future of its
        answer (the lease released when it comes), or None where the worker cannot take it
        now (nothing was sent; the lease is still held).  Withdrawn (the lease released)
        where the client has gone by now."""
        ask, lease, hand = self.ask, self.lease, self.ask.hand
        conduit = lease.worker.conduit
        if conduit is None:
            return None
        connection = hand.connection
        header = {"model": lease.name, "method": ask.method, "path": ask.path, "query": dict(ask.query or {}),
                  "query_string": hand.query_string, "headers": dict(ask.headers or {}),
                  "extra": [list(h) for h in connection.extra_headers], "keep_alive": connection.keep_alive}
        follow = self._follow(hand.follow)
        if follow is not None:
            header["follow"] = follow
        fd = connection.begin()  # the connection's descriptor now, sent at once (no await between)
        if fd is None:  # the client has gone: nobody to answer
            self._end()
            raise Withdrawn(lease.name)
        try:
            served = conduit.hand(header, body_of(ask.body), fd, hand.progress)
        except BaseException:
            connection.undo()
            self._end()
            raise
        if served is None:
            connection.undo()
            return None
        self._handed = served
        served.add_done_callback(self._answered)
        return served

    def _follow(self, follow: dict | None) -> dict | None:
        """A follow under this lease: the router's later ends cover it (its epoch), and on a
        model being drained for a waiter it never reads past the lease's turn (the scheduler
        ends the follows of a model it must see the requests of again: ``Scheduler.end_follows``)."""
        if follow is None:
            return None
        follow = {**follow, "epoch": self.lease.epoch}
        if self.lease.until is not None:
            ms = int((self.lease.until - time.monotonic()) * 1000)
            follow = {**follow, "end_ms": ms} if ms > 0 else None
        return follow

    def _answered(self, fut: "asyncio.Future") -> None:
        """The worker's answer to a request handed over came (or the worker died): the lease
        ends; an error is the awaiting caller's (if it left, it is dropped here)."""
        self._end()
        if not fut.cancelled():
            fut.exception()

    # -- sending on the pipe and the first reply --------------------------------------------

    def send(self) -> None:
        """The request to the lease's worker (a worker that died since raises WorkerDied, the
        lease released)."""
        ask, lease = self.ask, self.lease
        body = body_of(ask.body)
        try:
            self._pending = lease.worker.call(lambda rid: Call(rid, lease.name, ask.method, ask.path, body,
                                                               dict(ask.query or {}), dict(ask.headers or {}),
                                                               dict(ask.files or {})))
        except BaseException:
            self._end()
            raise

    def first(self) -> Any:
        """The first reply, waited for in this thread no later than the deadline (then the
        request is stopped: RequestTimeout); any exception here stops it too."""
        try:
            return self._pending.get(remaining(self.deadline))
        except TimeoutError:
            self.stop()
            raise RequestTimeout(self.name, self.timeout) from None
        except BaseException:
            self.stop()
            raise

    async def afirst(self, gone: Callable[[], Awaitable[Any]] | None) -> Any:
        """The first reply, awaited in the event loop (woken by the worker's reader thread);
        the request stopped if the caller leaves (its task cancelled, the departure watched
        since the wait for the lease done or ``gone()`` returned: an HTTP client gone,
        Withdrawn) or the deadline passes (RequestTimeout)."""
        watch = self._watch
        try:
            while (first := self._pending.get_nowait()) is None:
                watch = watch or departure(gone)
                try:
                    await asyncio.wait_for(unless_gone(self._pending.wait_async(), watch, self.name),
                                           remaining(self.deadline))
                except asyncio.TimeoutError:
                    raise RequestTimeout(self.name, self.timeout) from None
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
        worker's final reply (read in the background).  Once; from any thread.  A request
        handed over is the worker's: its answer ends the lease."""
        with self._lock:
            if self._stopped or self._ended or self._handed is not None:
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
