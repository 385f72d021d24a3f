"""The worker processes: one per device set, started on demand, found by the loads.

    ensure(ds) ──▶ the running worker of ds, or a new one (one start at a time per set,
                   outside the scheduler's lock) registered under it
    get(ds), all(), forget(worker), take_all()   (the scheduler's lock held)

The map is the scheduler's state: it is read and changed under the scheduler's
lock (``cond``), and a worker's process is started and stopped outside it.
"""

from __future__ import annotations

import threading
from typing import Callable

from pyllmrouter.devices import Inventory
from pyllmrouter.router.pool import WorkerHandle

__all__ = ["WorkerSet"]


class WorkerSet:
    def __init__(self, inventory: Inventory, cond: threading.Condition,
                 on_death: Callable[[WorkerHandle], None],
                 on_start: Callable[[WorkerHandle], None] = lambda w: None):
        """``on_death``: the worker's process ended (called from its reader thread);
        ``on_start``: a new worker runs (called once it is registered, no lock held)."""
        self._inventory = inventory
        self._cond = cond
        self._on_death = on_death
        self._on_start = on_start
        self._workers: dict[frozenset[str], WorkerHandle] = {}
        self._start_locks: dict[frozenset[str], threading.Lock] = {}

    # -- the scheduler's lock held ---------------------------------------------------

    def get(self, device_set: frozenset[str]) -> WorkerHandle | None:
        return self._workers.get(device_set)

    def all(self) -> list[WorkerHandle]:
        return list(self._workers.values())

    def forget(self, worker: WorkerHandle) -> bool:
        """Out of the map, if it is still its device set's worker."""
        if self._workers.get(worker.devices) is worker:
            del self._workers[worker.devices]
            return True
        return False

    def take_all(self) -> list[WorkerHandle]:
        workers, self._workers = list(self._workers.values()), {}
        return workers

    # -- no lock held -----------------------------------------------------------------

    def running(self, device_set: frozenset[str]) -> WorkerHandle | None:
        with self._cond:
            return self._workers.get(device_set)

    def alive(self) -> list[WorkerHandle]:
        with self._cond:
            return [w for w in self._workers.values() if w.alive]

    def ensure(self, device_set: frozenset[str]) -> WorkerHandle:
        """The device set's worker, started if none runs (one start at a time per set)."""
        with self._cond:
            lock = self._start_locks.setdefault(device_set, threading.Lock())
        with lock:
            with self._cond:
                w = self._workers.get(device_set)
                if w is not None and w.alive:
                    return w
            w = WorkerHandle("+".join(sorted(device_set)), device_set, self._inventory.mask_env(device_set),
                             self._on_death)
            w.start()
            with self._cond:
                self._workers[device_set] = w
                self._cond.notify_all()
            self._on_start(w)
            return w
