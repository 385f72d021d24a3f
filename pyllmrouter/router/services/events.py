"""What the router did, as it happens: kept (the last ``keep``) and pushed to listeners.

    scheduler (lock held) ──publish(event, model, devices, data)──▶ EventBus
        ├─ the ring of recent events (GET /events, status)
        └─ each listener's push(event): never blocks; a listener that cannot keep up says
           so (push returns False) and is dropped; one that raises is dropped too, its
           error logged with its traceback (never silently: ``listener_failed``)

Publishing happens under the scheduler's lock, so a listener's push must only hand
the event over (an SSE client's is ``call_soon_threadsafe`` onto its own bounded
queue): a slow client never holds the scheduler.  Events are plain frozen data.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["Event", "EventBus", "LOG"]

LOG = logging.getLogger(__name__)  # a listener's error is logged here, with its traceback


@dataclass(frozen=True)
class Event:
    seq: int
    t: float  # monotonic seconds
    event: str  # load-start, load, load-failed, evict, unload, evicted, waiting, worker-died, fit, ...
    model: str
    devices: str = ""  # "GPU0+GPU1"
    data: dict[str, Any] = field(default_factory=dict)


class EventBus:
    def __init__(self, keep: int = 1000):
        self._lock = threading.Lock()
        self._ring: deque[Event] = deque(maxlen=keep)
        self._listeners: dict[int, Callable[[Event], bool]] = {}
        self._ids = itertools.count(1)
        self._seq = itertools.count(1)

    def publish(self, event: str, model: str, devices: str = "", **data: Any) -> Event:
        ev = Event(next(self._seq), time.monotonic(), event, model, devices, data)
        with self._lock:
            self._ring.append(ev)
            listeners = list(self._listeners.items())
        gone = [key for key, push in listeners if not _pushed(push, ev)]
        if gone:
            with self._lock:
                for key in gone:
                    self._listeners.pop(key, None)
        return ev

    def recent(self) -> list[Event]:
        with self._lock:
            return list(self._ring)

    def listen(self, push: Callable[[Event], bool]) -> Callable[[], None]:
        """Call ``push(event)`` for every event from now on (it must not block; False drops
        the listener); returns the function that stops it."""
        key = next(self._ids)
        with self._lock:
            self._listeners[key] = push

        def stop() -> None:
            with self._lock:
                self._listeners.pop(key, None)

        return stop

    def end_listeners(self) -> None:
        """Every listener told that its stream ends (``push(None)``: the server is stopping,
        so a client's /models/sse does not hold the shutdown), then dropped."""
        with self._lock:
            listeners = list(self._listeners.values())
            self._listeners.clear()
        for push in listeners:
            _pushed(push, None)

    def listeners(self) -> int:
        with self._lock:
            return len(self._listeners)


def _pushed(push: Callable[[Event], bool], ev: Event | None) -> bool:
    try:
        return push(ev) is not False
    except Exception:  # noqa: BLE001 - a listener that fails is dropped, the publisher goes on
        LOG.exception("an event listener (%r) raised on %s: it is dropped", push,
                      "the end of events" if ev is None else f"event {ev.event!r} of {ev.model!r}")
        return False
