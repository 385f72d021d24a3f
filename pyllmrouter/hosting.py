"""Worker side: one llama.cpp server engine per loaded model.

    worker main thread ── Call ──▶ EngineHost.call ──▶ one thread per request:
        engine.handle(method, path, query, headers, body, stop)     [GIL released]
          plain reply ─▶ Result(HttpReply)
          stream      ─▶ Chunk(HttpReply head), Chunk(bytes)* as next() yields, Result(None)
    Cancel ──────▶ EngineHost.cancel: the request's StopFlag (llama.cpp's should_stop)
    UnloadModel ─▶ EngineHost.close: stop every request, wait for it, free the engine

The engine is llama-server's own (``csrc/engine.cpp``): its slot loop runs on a
thread of its own and batches the requests of every request thread, as
llama-server's HTTP threads do.  Nothing here reads a request body.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from .protocol import Call, Chunk, Failed, HttpReply, Result

__all__ = ["EngineHost"]


class EngineHost:
    """One model's engine and its requests in flight (owned by the worker's main thread;
    the request threads touch only their own entry of ``_stops`` under the lock)."""

    stats = None  # llama-server's /metrics has the engine's counters

    def __init__(self, name: str, engine: Any, stop_flag: Callable[[], Any], send: Callable[[Any], None]):
        self.name = name
        self.engine = engine
        self._stop_flag = stop_flag
        self._send = send
        self._lock = threading.Lock()
        self._stops: dict[int, Any] = {}  # req_id -> StopFlag of a request in flight
        self._threads: dict[int, threading.Thread] = {}
        self._closing = False

    def call(self, msg: Call) -> None:
        flag = self._stop_flag()
        with self._lock:
            if self._closing:
                self._send(Failed(msg.req_id, "ModelNotLoaded", f"model {self.name!r} is unloading"))
                return
            self._stops[msg.req_id] = flag
            t = threading.Thread(target=self._serve, args=(msg, flag), name=f"call-{self.name}", daemon=True)
            self._threads[msg.req_id] = t
            t.start()  # under the lock: close() never joins a thread that has not started

    def cancel(self, req_id: int) -> bool:
        with self._lock:
            flag = self._stops.get(req_id)
        if flag is not None:
            flag.set()
        return flag is not None

    def _serve(self, msg: Call, flag: Any) -> None:
        rid = msg.req_id
        try:
            reply = self.engine.handle(msg.method, msg.path, msg.query, msg.headers, msg.body, "", flag)
            head = HttpReply(reply.status, reply.content_type, dict(reply.headers), reply.data, reply.is_stream)
            if not head.stream:
                self._send(Result(rid, head))
                return
            self._send(Chunk(rid, head))
            more = True
            while more:
                more, chunk = reply.next()
                if chunk:
                    self._send(Chunk(rid, chunk))
                if flag.is_set:
                    break
            del reply  # on_complete, as llama-server's connection ends
            self._send(Result(rid, None))
        except Exception as e:  # noqa: BLE001 - the request fails, the worker goes on
            self._send(Failed(rid, "InternalError", f"{type(e).__name__}: {e}"))
        finally:
            with self._lock:
                self._stops.pop(rid, None)
                self._threads.pop(rid, None)

    def close(self) -> None:
        """Stop every request in flight, wait for their threads, free the engine."""
        with self._lock:
            self._closing = True
            threads = list(self._threads.values())
            for flag in self._stops.values():
                flag.set()
        for t in threads:
            t.join()
        self.engine.close()
