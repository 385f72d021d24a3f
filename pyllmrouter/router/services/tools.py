"""llama-server's services beside its models, for the HTTP server: what its HTTP layer
makes of the router's llama-server arguments (CORS, API keys), and its /tools (built-in
tools, MCP servers' tools) and /cors-proxy, served in a worker of their own.

    serve ──settings(args)──▶ python -m pyllmrouter.engine.settings ARGS (short-lived:
                              llama.cpp's parser) ──▶ {cors_*, api_keys, tools, mcp, ui_mcp_proxy}
    GET|POST /tools, /cors-proxy ──▶ Services.acall ──Call(SERVICES)──▶ services worker
        (StartServices: llama-server's server_tools, server_mcp, CORS proxy handlers; a
        feature that is off answers llama-server's 403) ◀── reply | stream

The services worker sees no GPU (it loads no model), holds the MCP servers as its
children, and is started again at the next call if it died.  The router process loads
no llama.cpp.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from typing import Any, Awaitable, Callable

from pyllmrouter.errors import WorkerDied
from pyllmrouter.protocol import SERVICES, Call, Chunk, Failed, HttpReply, StartServices
from pyllmrouter.router.workers.handle import WorkerHandle
from pyllmrouter.router.services.streams import Stream, unless_gone, value_of

__all__ = ["Services", "settings", "wanted"]

_NAME = "llama-server services"


def settings(args: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """What llama-server's HTTP layer makes of ``args`` (llama.cpp's parser, in a
    short-lived process); ValueError names a bad argument."""
    proc = subprocess.run([sys.executable, "-m", "pyllmrouter.engine.settings", *args], capture_output=True,
                          text=True, timeout=120)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise ValueError(f"llama.cpp's parser refused the server arguments {list(args)}: "
                         f"{proc.stderr.strip()[-500:]}")
    return json.loads(lines[-1])


def wanted(cfg: dict[str, Any]) -> bool:
    """Whether the arguments turn on a service (otherwise every one is llama-server's 403)."""
    return bool(cfg.get("tools") or cfg.get("mcp") or cfg.get("ui_mcp_proxy"))


class Services:
    def __init__(self, args: tuple[str, ...], env: dict[str, str], timeout: float = 120.0):
        """``args``: the router's llama-server arguments; ``env``: the worker's (no GPU)."""
        self._args, self._env, self._timeout = tuple(args), dict(env), timeout
        self._lock = threading.Lock()  # one start at a time; _worker changes under it
        self._worker: WorkerHandle | None = None
        self._closed = False

    def start(self) -> None:
        """Start the worker and the services (RuntimeError: they did not start)."""
        self._running()

    def _running(self) -> WorkerHandle:
        with self._lock:
            if self._closed:
                raise WorkerDied("llama-server's services are closed (the router is shutting down)")
            worker = self._worker
            if worker is not None and worker.alive:
                return worker
            worker = WorkerHandle(_NAME, frozenset(), self._env, lambda w: None)
            worker.start()
            reply = worker.call(lambda rid: StartServices(rid, self._args)).get(self._timeout)
            if isinstance(reply, Failed):
                worker.stop()
                raise RuntimeError(f"llama-server's services did not start: {reply.message}")
            self._worker = worker
            return worker

    async def acall(self, method: str, path: str, body: bytes, query: dict[str, str], headers: dict[str, str],
                    gone: Callable[[], Awaitable[Any]] | None = None) -> tuple[HttpReply, Stream | None]:
        """llama-server's reply for (method, path); a stream's chunks as a Stream.  A caller
        that leaves (``gone()`` returns) before the first reply cancels the call."""
        worker = self._worker if self._worker is not None and self._worker.alive else None
        if worker is None:
            worker = await asyncio.to_thread(self._running)
        pending = worker.call(lambda rid: Call(rid, SERVICES, method, path, body, dict(query), dict(headers)))
        watch = asyncio.ensure_future(gone()) if gone is not None else None
        try:
            while (first := pending.get_nowait()) is None:
                await unless_gone(pending.wait_async(), watch, _NAME)
        except BaseException:
            try:
                pending.cancel()
            except (OSError, ValueError):  # the worker is gone: nothing runs there any more
                pass
            raise
        finally:
            if watch is not None:
                watch.cancel()
        if isinstance(first, Chunk) and isinstance(first.value, HttpReply):
            return first.value, Stream(_NAME, pending, lambda: None, first.value.body)
        return value_of(_NAME, first), None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            worker, self._worker = self._worker, None
        if worker is not None:
            try:
                worker.stop()
            except WorkerDied:
                pass
