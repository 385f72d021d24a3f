"""Which model serves a conversation's resumable stream (llama-server's X-Conversation-Id).

    remember(conv_id, model)  a POST that carries the header: its model owns the stream
    owner(conv_id)            the model to ask for GET /v1/stream, /v1/streams/lookup,
                              DELETE /v1/stream (None: unknown, or forgotten)
    forget(conv_id)           DELETE /v1/stream

As llama-server's router does (its conv_model_tracker): best effort, the owner's
engine answers for the stream itself.  Bounded: the least recently remembered go first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

__all__ = ["Conversations"]


class Conversations:
    def __init__(self, keep: int = 10_000):
        self._keep = keep
        self._lock = threading.Lock()
        self._owners: OrderedDict[str, str] = OrderedDict()

    def remember(self, conv_id: str, model: str) -> None:
        if not conv_id:
            return
        with self._lock:
            self._owners.pop(conv_id, None)
            self._owners[conv_id] = model
            while len(self._owners) > self._keep:
                self._owners.popitem(last=False)

    def owner(self, conv_id: str) -> str | None:
        with self._lock:
            return self._owners.get(conv_id)

    def forget(self, conv_id: str) -> None:
        with self._lock:
            self._owners.pop(conv_id, None)
