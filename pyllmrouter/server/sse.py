"""GET /models/sse: the router's events as llama-server's router sends them, and ours.

    EventBus ──listen(push)──▶ push: call_soon_threadsafe onto this client's queue (never blocks;
                               a client more than ``backlog`` events behind is dropped)
    queue ──▶ payload(event) ──▶ "data: {model, event, data}\\n\\n"

llama-server's events and payloads: ``status_change`` {status: loading | loaded |
unloaded, exit_code; while loading, progress: {stages, current, value}}, ``models_reload``, ``download_progress`` {progress: {url: {done,
total}}}, ``download_finished``, ``download_failed``, ``model_remove``.  Ours go as they
are: ``evicted`` {newcomer, bytes, short}: the device and the bytes that forced it,
``waiting`` {why, short}: the short device and by how much, and the rest (``added``,
``change``, ``fit``, ``evict``, ``spill``, ``worker-started``, ...).
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any, AsyncIterator

from pyllmrouter.router.services.events import Event, EventBus

__all__ = ["payload", "event_stream"]

_STATUS = {"load-start": ("loading", None), "load": ("loaded", None), "unloaded": ("unloaded", 0),
           "load-failed": ("unloaded", 1), "worker-died": ("unloaded", -9)}
_AS_IS = {"models_reload", "download_progress", "download_finished", "download_failed", "model_remove"}


def payload(ev: Event) -> dict[str, Any]:
    """An event as llama-server's router sends it on /models/sse (ours: as they are)."""
    if ev.event == "load-progress":  # llama-server's: a loading status with its child's progress
        return {"model": ev.model, "event": "status_change",
                "data": {"status": "loading", "progress": ev.data.get("progress", {}),
                         **({"devices": ev.devices} if ev.devices else {})}}
    if ev.event in _STATUS:
        status, code = _STATUS[ev.event]
        data: dict[str, Any] = {"status": status}
        if code is not None:
            data["exit_code"] = code
        if "reason" in ev.data:
            data["reason"] = ev.data["reason"]
        if ev.devices:
            data["devices"] = ev.devices
        return {"model": ev.model, "event": "status_change", "data": data}
    data = dict(ev.data)
    if ev.event not in _AS_IS and ev.devices:
        data.setdefault("devices", ev.devices)
    return {"model": ev.model, "event": ev.event, **({"data": data} if data else {})}


async def event_stream(bus: EventBus, backlog: int = 1024, ping: float = 15.0) -> AsyncIterator[bytes]:
    """The SSE body of one client, until it leaves or falls ``backlog`` events behind."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Event | None] = asyncio.Queue()
    lock = threading.Lock()
    pending = [0]  # events pushed, not yet taken

    def push(ev: Event | None) -> bool:  # None: the server is stopping
        with lock:
            behind = pending[0] >= backlog
            pending[0] += 1
        try:
            loop.call_soon_threadsafe(queue.put_nowait, None if behind else ev)  # None: it ends there
            return not behind and ev is not None
        except RuntimeError:  # the client's loop is closed
            return False

    stop = bus.listen(push)
    try:
        while True:
            try:
                ev = await asyncio.wait_for(queue.get(), ping)
            except asyncio.TimeoutError:
                yield b": ping\n\n"  # a closed connection shows on the next write
                continue
            with lock:
                pending[0] -= 1
            if ev is None:
                return  # too far behind, or the server stops: dropped (it may come back and read /models)
            yield b"data: " + json.dumps(payload(ev)).encode() + b"\n\n"
    finally:
        stop()
