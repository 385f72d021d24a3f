"""The worker processes: one per device set, started on demand, given back when empty.

    ensure(ds) ──▶ the running worker of ds, or a new one (one start at a time per set,
                   outside the scheduler's lock) registered under it, its overhead known
    note(busy, now) ──▶ which workers are empty (no model, nothing in flight, no waiting
                   request for their device set), and since when
    retire(w)  ──▶ out of the map, but still holding its bytes until its process has ended
                   (stopped(w)): a model admitted in its room never meets its context
    get(ds), all(), forget(worker), take_all()   (the scheduler's lock held)
    overhead_of(ds) ──▶ the set's worker's bytes before any model, and whether a load there
                   starts it (running: its own; not yet: its estimate, costs.py)
    learn(w, measured) ──▶ a running worker's measured bytes: its own, and the estimate
                   of the next worker of its kind
    reserve(ds, bytes) ──▶ held for a worker about to start (a load, probe or fit admitted
                   with it), until it runs or fails to start (``starting``); a probe's
                   short-lived workers are held the same way (``probe_cost``)

An empty worker is a resident of admission (``resident``): it holds its overhead on its
devices (a GPU context per device, and its own host memory), and admission may stop it
to make room, before any model (restarting it costs a process start, no model load).
The map is the scheduler's state: read and changed under the scheduler's lock
(``cond``); processes are started and stopped outside it.
"""

from __future__ import annotations

import itertools
import threading
from typing import Callable, Iterable

from pyllmrouter.devices import Inventory
from pyllmrouter.memory import cache_dir
from pyllmrouter.router.policy import placement
from pyllmrouter.router.policy.state import holds_memory
from pyllmrouter.router.records import Record
from pyllmrouter.router.workers.costs import WorkerCosts
from pyllmrouter.router.workers.handle import Launch, WorkerHandle

__all__ = ["WorkerSet", "worker_name", "WORKER"]

WORKER = "(worker "  # the prefix of an empty worker's name as a resident of admission


def worker_name(device_set: frozenset[str]) -> str:
    return f"{WORKER}{'+'.join(sorted(device_set))})"


class WorkerSet:
    def __init__(self, inventory: Inventory, cond: threading.Condition,
                 on_death: Callable[[WorkerHandle], None],
                 on_start: Callable[[WorkerHandle], None] = lambda w: None,
                 launch: Launch = WorkerHandle, costs: WorkerCosts | None = None):
        """``on_death``: the worker's process ended (called from its reader thread);
        ``on_start``: a new worker runs (called once it is registered, no lock held);
        ``launch``: makes a worker's handle (a process of ours; a simulated one in tests);
        ``costs``: what a worker costs before it runs (learned as workers start)."""
        self._inventory = inventory
        self.costs = costs or WorkerCosts(inventory, cache_dir() / "workers.json")
        self._cond = cond
        self._on_death = on_death
        self._on_start = on_start
        self._launch = launch
        self.version = 0  # bumped when a worker's bytes become settled (registered): Book.mark
        # reserved for a worker about to start: its bytes, and the jobs (tokens) that count on it
        self._starting: dict[frozenset[str], tuple[dict[str, int], set[int]]] = {}
        self._tokens = itertools.count(1)
        self._workers: dict[frozenset[str], WorkerHandle] = {}
        self._stopping: list[WorkerHandle] = []  # retired, their processes not ended yet
        self._idle_since: dict[WorkerHandle, float] = {}  # empty workers, since when
        self._start_locks: dict[frozenset[str], threading.Lock] = {}

    # -- the scheduler's lock held ---------------------------------------------------

    def get(self, device_set: frozenset[str]) -> WorkerHandle | None:
        return self._workers.get(device_set)

    def all(self) -> list[WorkerHandle]:
        """Every worker that holds device memory: running, and retired but not ended yet."""
        return [*self._workers.values(), *self._stopping]

    def running(self) -> list[WorkerHandle]:
        return list(self._workers.values())

    def stopping(self) -> list[WorkerHandle]:
        return list(self._stopping)

    def overhead_of(self, device_set: frozenset[str]) -> tuple[dict[str, int], bool]:
        """The bytes the worker of ``device_set`` holds before any model, and whether a load
        there starts it: its running worker's, or those reserved for it (held already), else
        its estimate (a load there adds them): never below what it will hold."""
        w = self._workers.get(device_set)
        if w is not None:
            return dict(w.overhead), False
        if device_set in self._starting:
            return dict(self._starting[device_set][0]), False
        return self.costs.estimate(device_set), True

    def learn(self, worker: WorkerHandle, measured: dict[str, int]) -> None:
        """``worker``'s own bytes as measured (per device measured): its overhead from now on,
        and the estimate of the next worker of its kind."""
        worker.overhead.update(measured)
        self.costs.learn(worker.devices, measured)

    def reserve(self, device_set: frozenset[str], bytes_: dict[str, int]) -> int | None:
        """The bytes of a worker a load, probe or fit will start on ``device_set``, held from
        now until it runs (``ensure``) or every job counting on them has given them back
        (``unreserve``): two admissions never both count the room a coming worker takes.  The
        job's token (None: nothing to reserve: its worker runs, or it has no bytes)."""
        if device_set in self._workers or not bytes_:
            return None
        token = next(self._tokens)
        held, jobs = self._starting.get(device_set, (dict(bytes_), set()))
        self._starting[device_set] = (held, jobs | {token})
        return token

    def starting(self) -> list[dict[str, int]]:
        """The bytes reserved for workers about to start."""
        return [held for held, _ in self._starting.values()]

    def unreserve(self, token: int | None) -> None:
        """A job gives back what it reserved (it ended, or its worker runs); the reservation
        goes with the last job counting on it.  A token of an earlier reservation (its worker
        ran meanwhile) touches none made since."""
        if token is None:
            return
        with self._cond:
            for key, (held, jobs) in list(self._starting.items()):
                if token in jobs and jobs - {token}:
                    self._starting[key] = (held, jobs - {token})
                elif token in jobs:
                    del self._starting[key]
                    self._cond.notify_all()

    def probe_cost(self, candidates: list[frozenset[str]], hosts_models: Callable[[frozenset[str]], bool],
                   name: str) -> tuple[frozenset[str], dict[str, int]] | None:
        """What a probe of model ``name`` on ``candidates`` starts, as (key, bytes) to reserve:
        its only set's worker (kept: the load will use it), else short-lived ones (one at a
        time: the most of any on each device; key: the model's own), a set's worker hosting
        models reading a new file first in a host-only one (Measurer); None: nothing starts."""
        if len(candidates) == 1 and candidates[0] not in self._workers:
            bytes_, starts = self.overhead_of(candidates[0])
            return (candidates[0], bytes_) if starts and bytes_ else None
        most: dict[str, int] = {}
        for ds in candidates:
            running = ds in self._workers
            if running and not hosts_models(ds):
                continue
            for d, n in self.costs.estimate(frozenset() if running else ds).items():
                most[d] = max(most.get(d, 0), n)
        return (frozenset({f"(probe {name})"}), most) if most else None

    def owners(self, records: Iterable[Record], keep: Iterable[frozenset[str]]) -> dict[str, tuple[str, dict]]:
        """Model name -> (its worker's name, the worker's bytes), for the models that hold
        memory in a running worker not of ``keep`` (the sets a newcomer may load into: that
        worker stays), as placement.with_shares reads them."""
        keep = set(keep)
        return {r.name: (worker_name(r.device_set), dict(w.overhead)) for r in records
                if holds_memory(r.state) and r.device_set not in keep and (w := self._workers.get(r.device_set))}

    def by_name(self, name: str) -> WorkerHandle | None:
        return next((w for ds, w in self._workers.items() if worker_name(ds) == name), None)

    def forget(self, worker: WorkerHandle) -> bool:
        """Out of the map, if it is still its device set's worker."""
        self._idle_since.pop(worker, None)
        if worker in self._stopping:
            self._stopping.remove(worker)
        if self._workers.get(worker.devices) is worker:
            del self._workers[worker.devices]
            return True
        return False

    def take_all(self) -> list[WorkerHandle]:
        workers, self._workers = [*self._workers.values(), *self._stopping], {}
        self._stopping, self._idle_since, self._starting = [], {}, {}
        return workers

    def note(self, busy: Iterable[frozenset[str]], now: float) -> None:
        """Which workers are empty now: no model on their device set (loading, loaded or
        unloading), no call in flight (a probe, a fit), and no waiting request that may
        use them (``busy``: the device sets in any of these uses)."""
        busy = set(busy)
        for ds, w in self._workers.items():
            if ds in busy or w.in_flight():
                self._idle_since.pop(w, None)
            else:
                self._idle_since.setdefault(w, now)

    def empty(self, worker: WorkerHandle, busy: Iterable[frozenset[str]]) -> bool:
        """Whether ``worker`` is empty for a request that sees ``busy`` device sets in use."""
        return worker.devices not in set(busy) and not worker.in_flight()

    def idle(self, now: float) -> dict[WorkerHandle, float]:
        """Empty workers (as of the last ``note``) and for how many seconds."""
        return {w: now - t for w, t in self._idle_since.items()}

    def resident(self, worker: WorkerHandle, evictable: bool | None = None) -> placement.Resident:
        """The worker as a resident of admission: its overhead, evictable if empty (or as
        given); first among equals (restarting one costs less than reloading a model)."""
        return placement.Resident(worker_name(worker.devices), dict(worker.overhead), float("-inf"),
                                  worker in self._idle_since if evictable is None else evictable)

    def retire(self, worker: WorkerHandle) -> None:
        """Stop using ``worker``: its bytes stay held until ``stopped``."""
        if self.forget(worker):
            self._stopping.append(worker)

    def stopped(self, worker: WorkerHandle) -> None:
        if worker in self._stopping:
            self._stopping.remove(worker)

    # -- no lock held -----------------------------------------------------------------

    def running_for(self, device_set: frozenset[str]) -> WorkerHandle | None:
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
            w = self._launch("+".join(sorted(device_set)), device_set, self._inventory.mask_env(device_set),
                             self._on_death)
            w.start()  # a failed start: each job counting on its reservation gives its own back
            # what it holds before any model: its process (its Ready), its GPUs' contexts as the
            # device tells them (nothing else runs there yet), or as configured (emulated)
            measured = {**dict(w.overhead), **self._inventory.process_usage(w.pid),
                        **self._inventory.worker_overhead(device_set)}
            # where nothing tells (a driver that lists no process, as in a container), the
            # estimate stands for them (never below); Jobs.refresh_overhead measures again
            w.overhead.update({**self.costs.estimate(device_set), **measured})
            self.costs.learn(device_set, measured)
            with self._cond:  # its own bytes held from now, in its reservation's place
                self._workers[device_set] = w
                self._starting.pop(device_set, None)
                self.version += 1
                self._cond.notify_all()
            self._on_start(w)
            return w
