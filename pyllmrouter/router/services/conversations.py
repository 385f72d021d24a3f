"""Which model serves a conversation's resumable stream (llama-server's X-Conversation-Id).

    remember(conv_id, model) -> ticket   a POST that carries the header: its model owns the
                                         stream; the ticket is that request's claim
    alive(conv_id, ticket)               the claim still holds (no stop, no newer request)
    on_end(conv_id, ticket, fn)          fn() once the claim ends (a stop, a newer request for
                                         the conversation, or the oldest forgotten): a request
                                         parked while its model loads is cancelled by it
    served_by(conv_id, ticket, name)     the instance that took the request (replicas = N):
                                         the conversation's stream and cached prompt are there
    owner(conv_id)                       the model (or instance) to ask for GET /v1/stream,
                                         /v1/streams/lookup, DELETE /v1/stream (None: unknown,
                                         or forgotten); a conversation's next request prefers it
    forget(conv_id)                      DELETE /v1/stream (a stop)

As llama-server's router does (its conv_model_tracker): best effort, the owner's
engine answers for the stream itself.  Bounded: the least recently remembered go first.
Callbacks run outside the lock.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from typing import Callable

__all__ = ["Conversations"]


class Conversations:
    def __init__(self, keep: int = 10_000):
        self._keep = keep
        self._lock = threading.Lock()
        self._owners: OrderedDict[str, tuple[str, int]] = OrderedDict()  # conv_id -> (model, ticket)
        self._ends: dict[int, list[Callable[[], None]]] = {}  # ticket -> what to call when it ends
        self._tickets = itertools.count(1)

    def remember(self, conv_id: str, model: str) -> int:
        """The request's ticket (0: no conversation)."""
        if not conv_id:
            return 0
        ended: list[int] = []
        with self._lock:
            ticket = next(self._tickets)
            old = self._owners.pop(conv_id, None)
            if old is not None:
                ended.append(old[1])
            self._owners[conv_id] = (model, ticket)
            while len(self._owners) > self._keep:
                ended.append(self._owners.popitem(last=False)[1][1])
            calls = [fn for t in ended for fn in self._ends.pop(t, ())]
        for fn in calls:
            fn()
        return ticket

    def served_by(self, conv_id: str, ticket: int, instance: str) -> None:
        """The instance of its model that took the request of ``ticket`` (an extra instance,
        replicas = N): the conversation's stream is in that instance's engine."""
        with self._lock:
            entry = self._owners.get(conv_id)
            if entry is not None and entry[1] == ticket:
                self._owners[conv_id] = (instance, ticket)

    def alive(self, conv_id: str, ticket: int) -> bool:
        with self._lock:
            entry = self._owners.get(conv_id)
        return entry is not None and entry[1] == ticket

    def on_end(self, conv_id: str, ticket: int, fn: Callable[[], None]) -> Callable[[], None]:
        """Call ``fn()`` once the ticket's claim ends (at once if it has); returns the call
        that takes ``fn`` back (the request ended first)."""
        with self._lock:
            entry = self._owners.get(conv_id)
            live = entry is not None and entry[1] == ticket
            if live:
                self._ends.setdefault(ticket, []).append(fn)
        if not live:
            fn()

        def off() -> None:
            with self._lock:
                fns = self._ends.get(ticket)
                if fns is not None and fn in fns:
                    fns.remove(fn)
                    if not fns:
                        del self._ends[ticket]
        return off

    def owner(self, conv_id: str) -> str | None:
        with self._lock:
            entry = self._owners.get(conv_id)
        return entry[0] if entry is not None else None

    def forget(self, conv_id: str) -> None:
        with self._lock:
            entry = self._owners.pop(conv_id, None)
            calls = self._ends.pop(entry[1], []) if entry is not None else []
        for fn in calls:
            fn()
