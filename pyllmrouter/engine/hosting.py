"""Worker side: one llama.cpp server engine per loaded model.

    worker main thread ── Call ──▶ EngineHost.call ──▶ a call thread (kept between requests):
        engine.handle(method, path, query, headers, body, stop)     [GIL released]
          plain reply ─▶ Result(HttpReply)
          stream      ─▶ Chunk(HttpReply head, its body the stream's first chunk), then
                         _native.pump: a C++ thread reads the rest of the stream as
                         llama.cpp yields it into the model's Outbox
    sender thread: Outbox.take() ─▶ every chunk there, of every stream, in one pipe message
                   (Batch of Chunk(bytes)*, Result(None) at a stream's end, Failed at a
                   stream stopped under way); takes come
                   stream_interval apart, so fast tokens leave in groups
    Cancel ──────▶ EngineHost.cancel: the request's StopFlag (llama.cpp's should_stop)
    UnloadModel ─▶ EngineHost.close: stop every request, wait for its end, free the engine

The engine is llama-server's own (``csrc/engine.cpp``): its slot loop runs on a
thread of its own and batches the requests of every call thread, as
llama-server's HTTP threads do; the chunks of one decode step leave the worker
together.  Nothing here reads a request body.
"""

from __future__ import annotations

import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from pyllmrouter.protocol import Batch, Call, Chunk, ErrorKind, Failed, HttpReply, Result

__all__ = ["EngineHost"]

_LOG = logging.getLogger(__name__)
_MAX_CALLS = 1024  # a model's requests in flight in its engine at once (the rest wait for a thread)
_CACHE_N = re.compile(rb'"cache_n":(\d+)')  # in llama-server's timings of a request's final reply


class EngineHost:
    """One model's engine and its requests in flight.  ``_stops`` (a request's StopFlag,
    until its last reply is sent: the requests in flight) and ``_closing`` change under
    ``_lock``."""

    def __init__(self, name: str, engine: Any, native: Any, send: Callable[[Any], None],
                 keep_dir: str | None = None, restored: int = 0, stream_interval: float = 0.0,
                 conduit: Any = None):
        """``conduit``: the worker's native data path, which answers the requests the router
        hands over for this model (the relay of Call messages serves the rest)."""
        self.name = name
        self.engine = engine
        self._conduit = conduit
        self.keep_dir = keep_dir  # where the router keeps its slot states (not a client-reachable path)
        self._native = native
        self._send = send
        self._lock = threading.Condition()
        self._stops: dict[int, Any] = {}  # req_id -> StopFlag of a request in flight
        self._closing = False
        self._awaited = restored  # slots restored at load whose first use is still to come
        self._restored = restored
        self.hits = 0  # requests that took tokens from a restored slot's cache
        self._outbox = native.Outbox(stream_interval)
        self._sender = threading.Thread(target=self._send_chunks, name=f"send-{name}", daemon=True)
        self._sender.start()
        # the call threads: kept between requests, one more only when none is idle (the
        # executor's own policy), since starting a thread waits for it to take the GIL once
        # (milliseconds to a first token while other threads hold it)
        self._calls = ThreadPoolExecutor(max_workers=_MAX_CALLS, thread_name_prefix=f"call-{name}")
        if conduit is not None:  # the restored slots' first uses are counted there, and here
            conduit.attach(name, engine, restored)

    def call(self, msg: Call) -> None:
        flag = self._native.StopFlag()
        with self._lock:
            if self._closing:
                self._send(Failed(msg.req_id, ErrorKind.NOT_LOADED, f"model {self.name!r} is unloading"))
                return
            self._stops[msg.req_id] = flag
        self._calls.submit(self._serve, msg, flag)

    def _seen(self, data: bytes) -> None:
        """A reply's bytes, while restored states await their use: a request whose timings
        say it took tokens from the cache used one (``_lock`` held)."""
        for m in _CACHE_N.finditer(data):
            if self._awaited and int(m.group(1)) > 0:
                self._awaited -= 1
                self.hits += 1

    def cancel(self, req_id: int) -> bool:
        with self._lock:
            flag = self._stops.get(req_id)
        if flag is not None:
            flag.set()
        return flag is not None

    def _serve(self, msg: Call, flag: Any) -> None:
        rid, streaming = msg.req_id, False
        try:
            reply = self.engine.handle(msg.method, msg.path, msg.query, msg.headers, msg.body, "", flag, msg.files)
            body = reply.data  # a request stopped before its reply was whole: llama-server's 503 (EngineReply::cut)
            if reply.is_stream and body:  # llama-server's first chunk, here already: it leaves with the head
                body = reply.next()[1]
            head = HttpReply(reply.status, reply.content_type, dict(reply.headers), body, reply.is_stream)
            if self._awaited:
                with self._lock:
                    self._seen(head.body)
            if not head.stream:
                self._send(Result(rid, head))
                return
            self._send(Chunk(rid, head))  # before any chunk: the pump starts after this send
            self._native.pump(reply, rid, self._outbox)
            del reply  # the pump's now: it releases it before the stream's last item
            streaming = True
        except Exception as e:  # noqa: BLE001 - a bug: logged, the request fails, the worker goes on
            _LOG.exception("%s %s %s", self.name, msg.method, msg.path)
            self._send(Failed(rid, ErrorKind.INTERNAL, f"{type(e).__name__}: {e}"))
        finally:
            if not streaming:  # a stream is in flight until the sender sends its last reply
                with self._lock:
                    self._stops.pop(rid, None)
                    self._lock.notify_all()

    def _stopped(self, rid: int) -> Failed:
        """The end of a stream stopped before its last result (an unload, a close, its caller
        gone): a failure, never a stream's normal end (the relay closes such a stream
        unfinished)."""
        with self._lock:
            why = "is unloading" if self._closing else "stopped the request"
        return Failed(rid, ErrorKind.NOT_LOADED, f"model {self.name!r} {why} before its reply was whole")

    def _send_chunks(self) -> None:
        """The sender thread: what the pumps left, in one message per take."""
        while True:
            items = self._outbox.take(5.0)
            if any(item[0] < 0 for item in items):  # woken by close(): every stream has ended
                return
            if not items:
                continue
            msgs = [(self._stopped(rid) if cut else Result(rid, None)) if last else Chunk(rid, chunk)
                    for rid, chunk, last, cut in items]
            self._send(msgs[0] if len(msgs) == 1 else Batch(msgs))
            with self._lock:
                for rid, chunk, last, _ in items:
                    if last:
                        self._stops.pop(rid, None)
                    elif self._awaited:
                        self._seen(chunk)
                self._lock.notify_all()

    def close(self, before_free: Callable[[Any], Any] | None = None) -> Any:
        """Stop every request in flight, wait for its last reply, call ``before_free(engine)``
        (with no request running: to save the slots), free the engine; ``before_free``'s
        result."""
        if self._conduit is not None:  # its native requests: stopped and waited for first
            native_hits = self._conduit.detach(self.name)
            with self._lock:  # each path counted the restored slots' first uses it saw
                self.hits = min(self._restored, self.hits + native_hits)
        with self._lock:
            self._closing = True
            for flag in self._stops.values():
                flag.set()
            self._lock.wait_for(lambda: not self._stops)
        self._calls.shutdown()
        self._outbox.wake()
        self._sender.join()
        try:
            return before_free(self.engine) if before_free is not None else None
        finally:
            self.engine.close()
