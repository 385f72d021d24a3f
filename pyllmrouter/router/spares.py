"""Workers started to measure a model, kept a little while for the load that usually follows.

    Measurer ──put(worker)──▶ Spares ──take(devices)──▶ Scheduler._ensure_worker: adopted as
                               │                          the device set's worker
                               └── expire() (the reaper, once a second) / close(): stopped

A model's first request measures it in a worker masked as its own worker will be
(when none runs yet), then loads it there.  Without spares that is two process
starts, and on a GPU two backend initialisations, before the first token; with
them the worker that measured the model serves it.  Only a model's one candidate
device set keeps its spare (pinned, or a machine with one GPU); with several, the
spares of the sets not chosen would hold their devices' contexts for nothing.  One
that no load takes is stopped once ``linger`` seconds have passed, so an idle spare
holds its devices' context (which admission sees as used) only that long.
"""

from __future__ import annotations

import threading
import time

from pyllmrouter.router.pool import WorkerHandle

__all__ = ["Spares"]


class Spares:
    def __init__(self, linger: float = 10.0):
        self._linger = linger
        self._lock = threading.Lock()
        self._held: dict[frozenset[str], tuple[WorkerHandle, float]] = {}  # devices -> (worker, stop at)

    def put(self, worker: WorkerHandle) -> None:
        """Keep ``worker`` (started for its device set, hosting nothing) for a while."""
        with self._lock:
            old = self._held.get(worker.devices)
            self._held[worker.devices] = (worker, time.monotonic() + self._linger)
        if old is not None and old[0] is not worker:
            old[0].stop()

    def take(self, devices: frozenset[str]) -> WorkerHandle | None:
        """The spare of ``devices``, alive, now the caller's; None if there is none."""
        with self._lock:
            held = self._held.pop(devices, None)
        if held is None:
            return None
        if held[0].alive:
            return held[0]
        held[0].stop()
        return None

    def expire(self) -> None:
        """Stop the spares kept past their time."""
        now = time.monotonic()
        with self._lock:
            gone = [w for w, until in self._held.values() if until <= now]
            self._held = {d: (w, until) for d, (w, until) in self._held.items() if until > now}
        for w in gone:
            w.stop()

    def close(self) -> None:
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for w, _ in held:
            w.stop()
