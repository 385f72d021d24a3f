"""The scheduler: owns every model's state, the admission queue and the workers.

    lease(name) ──▶ ticket joins the FIFO queue ──▶ until LOADED and it may lease:
        read free memory (inventory, outside the lock)
        under the lock: admission.decide(view, request)      (pure)
            Admit  ──▶ LOADING + reservation ──▶ background load
            Evict  ──▶ victims UNLOADING ──▶ background unloads
            Wait   ──▶ maybe a background probe or fit; busy models in the way drain
            Never  ──▶ NeverFits (at once)
        wait on the condition
    LOADED ──▶ leases += 1, return a Lease;  release(lease) ──▶ leases -= 1, notify

Callers hold a ``Lease`` (the model's name and the worker captured when the lease
was taken), never a ``Record``: records change under the lock only, and a
model's state only in ``_move``, which checks the transition (state.py).

All state lives under one lock (``self._cond``).  Nothing does I/O while
holding it: free memory is read before the lock is taken; probes, worker
starts, loads and unloads run in background threads and report back under the
lock.  A decision and the state change it implies (reserve, mark UNLOADING)
happen in the same critical section, so no other thread can act on a stale
check.  Deciding is pure (admission.py, placement.py).

FIFO: a ticket may start a load only if no earlier ticket that also waits for
a load could use one of the same devices.  Requests for a LOADED model go
ahead, except for a model being drained for an earlier waiter: it takes new
requests only for ``turn`` seconds, then finishes what it has and is evicted.
Two models that cannot be co-resident are thus served in turns, not per
request.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

from pyllmrouter.router import admission
from pyllmrouter.router import placement
from pyllmrouter.config import ModelConfig, RouterOptions
from pyllmrouter.devices import HOST, Inventory
from pyllmrouter.errors import (LoadFailed, NeverFits, NotLoaded, QueueTimeout, RouterClosed, UnknownModel,
                                WorkerDied, Withdrawn)
from pyllmrouter.router.keep import KeepStore, identity
from pyllmrouter.router.measure import Measurer, worker_spec
from pyllmrouter.protocol import ErrorKind, Failed, LoadModel, Loaded, Unloaded, UnloadModel
from pyllmrouter.spec import ModelSpec
from pyllmrouter.router.state import State, check_transition, evictable, holds_memory
from pyllmrouter.router.pool import WorkerHandle
from pyllmrouter.router.records import Lease, Record, Ticket

__all__ = ["Scheduler", "Record", "Lease", "KEPT"]

KEPT = "(kept prompt states)"  # a resident that holds host memory: the kept states in RAM


def _fit_over(device_set: frozenset[str], local: dict[str, str], params: dict[str, Any]) -> tuple[str, ...]:
    """The devices a fit may share a model over: the set's real devices and the host
    (layers, experts, the context); where there are none (the host alone, emulated
    devices), the set itself, whose context alone can shrink; none where llama-server's
    fit is off for the model (--fit off)."""
    if not params.get("fit", True):
        return ()
    if local:
        return (*sorted(local), HOST)
    return tuple(sorted(device_set)) if params.get("ctx_auto") else ()


class Scheduler:
    def __init__(self, models: list[ModelConfig], inventory: Inventory, options: RouterOptions):
        self.options = options
        self.inventory = inventory
        self._devices = {d.name: d for d in inventory.devices()}
        self._records: dict[str, Record] = {}
        self._aliases: dict[str, str] = {}
        for m in models:
            if m.name in self._records or m.name in self._aliases:
                raise ValueError(f"model name {m.name!r} is used twice")
            for d in m.devices or ():
                if d not in self._devices:
                    raise ValueError(f"model {m.name!r} is pinned to unknown device {d!r} "
                                     f"(devices: {', '.join(self._devices)})")
            if m.spec.draft_devices and not set(m.spec.draft_devices) <= set(m.devices or ()):
                raise ValueError(f"model {m.name!r}: its draft's devices {', '.join(m.spec.draft_devices)} must be "
                                 f"among the devices it is pinned to")
            self._records[m.name] = Record(m)
            for a in m.aliases:
                if a in self._records or a in self._aliases:
                    raise ValueError(f"alias {a!r} of model {m.name!r} is used twice")
                self._aliases[a] = m.name
        self._cond = threading.Condition()
        self._queue: list[Ticket] = []
        self._seq = itertools.count(1)
        self._workers: dict[frozenset[str], WorkerHandle] = {}
        self._worker_locks: dict[frozenset[str], threading.Lock] = {}
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.events: list[tuple[float, str, str, str]] = []  # (time, event, model, devices), the last 1000
        self.counters = {"loads": 0, "evictions": 0, "load_failures": 0, "worker_deaths": 0}
        self.on_wait: Any = None  # called as on_wait(model, seconds) for every lease (metrics)
        self._measure = Measurer(inventory, options.load_timeout, self._running_worker,
                                 self._ensure_worker if options.keep_idle_workers else None)
        ram = options.kv_keep_ram
        if ram is None:
            ram = inventory.free().get(HOST, 0) // 8
        self._keep = KeepStore(ram, options.kv_keep_dir, options.kv_keep_disk) if ram > 0 else None
        self._spilling = False  # kept states are leaving RAM for host memory a load wants

    # -- lookup --------------------------------------------------------------

    def resolve(self, name: str) -> Record:
        real = self._aliases.get(name, name)
        rec = self._records.get(real)
        if rec is None:
            raise UnknownModel(name, list(self._records))
        return rec

    def records(self) -> list[Record]:
        return list(self._records.values())

    # -- accounting (lock held) ---------------------------------------------

    def _capacity(self, device: str) -> int:
        total = self._devices[device].total
        return min(total, self.options.budgets.get(device, total)) - self.options.margin

    def _held(self) -> dict[str, int]:
        held: dict[str, int] = {}
        for r in self._records.values():
            if holds_memory(r.state):
                for d, n in r.need.items():
                    held[d] = held.get(d, 0) + n
        for w in self._workers.values():
            for d, n in w.overhead.items():
                held[d] = held.get(d, 0) + n
        if self._keep is not None:  # kept prompt states in RAM are host memory
            held[HOST] = held.get(HOST, 0) + self._keep.held_ram()
        return held

    def _available(self, free: dict[str, int]) -> dict[str, int]:
        """Per device, what our models may still take, from ``free`` (the inventory's
        reading, taken before the lock: it reads /proc and NVML)."""
        held = self._held()
        out = {}
        for name, dev in self._devices.items():
            # what other programs use: the device's use minus what we hold
            external = max(0, dev.total - free.get(name, dev.total) - held.get(name, 0))
            out[name] = min(self._capacity(name), dev.total - external - self.options.margin) - held.get(name, 0)
        if self.options.max_models:
            out[placement.COUNT] = self.options.max_models - held.get(placement.COUNT, 0)
        return out

    def _candidates(self, rec: Record) -> list[frozenset[str]]:
        if rec.config.devices:
            return [frozenset(rec.config.devices)]
        gpus = [n for n, d in self._devices.items() if d.kind != "cpu"]
        return [frozenset({g}) for g in gpus] or [frozenset({HOST})]

    def _residents(self, ticket: Ticket, ignore_busy: bool = False, leaving: bool = False) -> list[placement.Resident]:
        """Models holding memory; evictable only if idle and no earlier request waits for them
        (``ignore_busy``: if not persistent; ``leaving``: models already unloading count too)."""
        # an earlier request that may take a lease keeps its model (one blocked by a drain does not)
        awaited = {t.name for t in self._queue
                   if t.seq < ticket.seq and self._may_lease(self._records[t.name], t)}
        residents = [
            placement.Resident(
                r.name, r.need, r.last_used,
                (leaving and r.state is State.UNLOADING)
                or (evictable(r.state, 0, r.config.persistent) if ignore_busy
                    else evictable(r.state, r.leases, r.config.persistent) and r.name not in awaited),
            )
            for r in self._records.values() if holds_memory(r.state)
        ]
        kept = self._keep.held_ram() if self._keep is not None else 0
        if kept:  # kept prompt states give way first (spilled to disk or dropped), before any model
            residents.append(placement.Resident(KEPT, {HOST: kept}, float("-inf"), not self._spilling))
        return residents

    def check_invariant(self) -> dict[str, int]:
        """Bytes held per device; raises if any device holds more than its capacity."""
        with self._cond:
            held = self._held()
            for d, n in held.items():
                if d == placement.COUNT:
                    if self.options.max_models and n > self.options.max_models:
                        raise AssertionError(f"{n} models held, limit {self.options.max_models}")
                elif n > self._capacity(d):
                    raise AssertionError(f"{d}: {n} bytes held > capacity {self._capacity(d)}")
            return held

    # -- leases ----------------------------------------------------------------

    def lease(self, name: str, timeout: float | None = None, autoload: bool | None = None,
              gone: threading.Event | None = None) -> Lease:
        """Block until ``name`` is LOADED and take a lease on it.  Once ``gone`` is set
        (``withdraw``) the wait ends with Withdrawn: the ticket leaves the queue, and what
        it alone asked for (a load, a drain of a busy model) does not happen."""
        rec = self.resolve(name)
        timeout = self.options.queue_timeout if timeout is None else timeout
        autoload = self.options.autoload if autoload is None else autoload
        with self._cond:
            if self._closed:
                raise RouterClosed("router is closed")
            if rec.state is not State.LOADED and not autoload:
                raise NotLoaded(rec.name, rec.state.value)
            ticket = Ticket(rec.name, next(self._seq), rec.error_epoch, time.monotonic())
            self._queue.append(ticket)
        deadline = ticket.created + timeout
        free: dict[str, int] | None = None  # the inventory's reading, taken since the last wait
        try:
            while True:
                with self._cond:
                    if self._closed:
                        raise RouterClosed("router is closed")
                    if gone is not None and gone.is_set():
                        raise Withdrawn(rec.name)
                    if rec.error_epoch > ticket.epoch:
                        raise LoadFailed(rec.name, rec.reason or "unknown reason")
                    if rec.state is State.LOADED and self._may_lease(rec, ticket):
                        return self._take(rec, ticket)
                    stale = rec.state is State.UNLOADED and free is None
                    if not stale:
                        why = "waiting"
                        if rec.state is State.UNLOADED:
                            why = self._admit(rec, ticket, free)
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            raise QueueTimeout(rec.name, timeout, why)
                        self._cond.wait(min(remaining, 0.25))
                        free = None
                if stale:
                    free = self.inventory.free()  # I/O, only when admission needs it: never under the lock
        finally:
            with self._cond:
                self._queue.remove(ticket)
                for r in self._records.values():
                    if r.drain is not None and r.drain[1] == ticket.seq:
                        r.drain = None  # its waiter is gone; a later waiter sets its own
                self._cond.notify_all()

    def withdraw(self, gone: threading.Event) -> None:
        """The caller of a waiting ``lease(..., gone=gone)`` has left: end its wait now."""
        with self._cond:
            gone.set()
            self._cond.notify_all()

    def try_lease(self, name: str) -> Lease | None:
        """A lease on ``name`` if it can be taken at once (LOADED, not draining for an
        earlier waiter), else None; never waits, never starts a load."""
        rec = self.resolve(name)
        with self._cond:
            if self._closed or rec.state is not State.LOADED:
                return None
            ticket = Ticket(rec.name, next(self._seq), rec.error_epoch, time.monotonic())
            return self._take(rec, ticket) if self._may_lease(rec, ticket) else None

    def _take(self, rec: Record, ticket: Ticket) -> Lease:
        rec.leases += 1
        rec.last_used = time.monotonic()
        if self.on_wait is not None:
            self.on_wait(rec.name, rec.last_used - ticket.created)
        return Lease(rec.name, rec.worker)

    def release(self, lease: Lease) -> None:
        with self._cond:
            rec = self._records[lease.name]
            rec.leases -= 1
            rec.last_used = time.monotonic()
            self._cond.notify_all()

    def _may_lease(self, rec: Record, ticket: Ticket) -> bool:
        if rec.drain is None:
            return True
        deadline, waiter_seq = rec.drain
        return ticket.seq < waiter_seq or time.monotonic() < deadline

    # -- admission (lock held) -----------------------------------------------

    def _earlier_loader_blocks(self, rec: Record, ticket: Ticket) -> bool:
        mine = set().union(*self._candidates(rec))
        for t in self._queue:
            if t.seq >= ticket.seq:
                return False
            other = self._records[t.name]
            if other is rec:
                return True  # an earlier ticket of the same model drives its load
            if other.state is State.UNLOADED and mine & set().union(*self._candidates(other)):
                return True
        return False

    def _admit(self, rec: Record, ticket: Ticket, free: dict[str, int]) -> str:
        """Move ``rec`` towards LOADING if it is this ticket's turn; say why not.
        ``free`` is the inventory's reading, taken before the lock."""
        available = self._available(free)
        decision = admission.decide(self._view(ticket, available), self._request(rec, ticket))
        if isinstance(decision, admission.Never):
            rec.error_epoch += 1
            rec.reason = decision.why
            raise NeverFits(rec.name, decision.device, decision.need, decision.capacity, decision.why)
        if isinstance(decision, admission.Evict):
            for v in decision.victims:
                if v == KEPT:
                    self._spilling = True
                    self._spawn(self._spill)
                else:
                    self._begin_unload(self._records[v], evicted=True)
            return "evicting idle models"
        if isinstance(decision, admission.Wait):
            if decision.probe:
                rec.probing = True
                self._spawn(self._probe_requirements, rec)
            if decision.fit is not None:
                rec.fitting = True
                job = decision.fit
                self._spawn(self._fit, rec, job.device_set, job.spec, dict(job.grant))
            deadline = ticket.created + self.options.turn
            for v in decision.drain:
                victim = self._records[v]
                if victim.drain is None or victim.drain[1] > ticket.seq:
                    victim.drain = (deadline, ticket.seq)
            return decision.why
        self._move(rec, State.LOADING)
        rec.device_set, rec.need, rec.reason = decision.device_set, dict(decision.need), None
        rec.load_spec, rec.fit = decision.spec, decision.fit
        self._spawn(self._load, rec)
        return "loading"

    def _view(self, ticket: Ticket, available: dict[str, int]) -> admission.View:
        capacity = {d: self._capacity(d) for d in self._devices}
        if self.options.max_models:
            capacity[placement.COUNT] = self.options.max_models
        return admission.View(available, capacity, tuple(self._residents(ticket)),
                              tuple(self._residents(ticket, ignore_busy=True)),
                              tuple(self._residents(ticket, ignore_busy=True, leaving=True)))

    def _request(self, rec: Record, ticket: Ticket) -> admission.Request:
        options = None
        if rec.requirements is not None:
            options = []
            for ds in self._candidates(rec):
                local = self.inventory.to_local(ds)  # a fit can only move bytes off real devices
                spec = worker_spec(rec.config.spec, ds, local)
                options.append(admission.Option(ds, rec.requirements[ds], spec, _fit_over(ds, local, rec.params[ds])))
            options = tuple(options)
        return admission.Request(rec.name, options, rec.fits, self._earlier_loader_blocks(rec, ticket),
                                 rec.probing, rec.fitting)

    @property
    def keep(self) -> KeepStore | None:
        """The store of prompt states kept across eviction (None: keeping is off)."""
        return self._keep

    def _move(self, rec: Record, new: State, reason: str | None = None) -> None:
        """The one place a model's state changes (lock held), checked against
        state.TRANSITIONS.  UNLOADED holds nothing: the reservation, the worker, a
        drain and the live bytes go with it, and ``reason`` says why, if given."""
        check_transition(rec.state, new)
        rec.state = new
        if new is State.UNLOADED:
            rec.need, rec.worker, rec.drain, rec.live = {}, None, None, {}
            if reason is not None:
                rec.reason = reason

    def _begin_unload(self, rec: Record, evicted: bool = False) -> None:
        self._move(rec, State.UNLOADING)
        self._event("evict" if evicted else "unload", rec.name)
        if evicted:
            self.counters["evictions"] += 1
        self._spawn(self._unload, rec)

    # -- background work -------------------------------------------------------

    def _spawn(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def _event(self, what: str, name: str) -> None:
        rec = self._records[name]
        where = "+".join(sorted(rec.device_set)) if rec.device_set else ""
        self.events.append((time.monotonic(), what, name, where))
        del self.events[:-1000]

    def _spill(self) -> None:
        """Host memory is wanted: kept prompt states leave RAM (file work, outside the lock)."""
        try:
            self._keep.spill()
        finally:
            with self._cond:
                self._spilling = False
                self.events.append((time.monotonic(), "spill", KEPT, HOST))
                self._cond.notify_all()

    def _probe_requirements(self, rec: Record) -> None:
        reqs: dict[frozenset[str], dict[str, int]] = {}
        parts: dict[frozenset[str], dict[str, dict]] = {}
        params: dict[frozenset[str], dict[str, Any]] = {}
        error = None
        try:
            candidates = self._candidates(rec)
            for ds in candidates:
                spec = worker_spec(rec.config.spec, ds, self.inventory.to_local(ds))
                reqs[ds], parts[ds], params[ds] = self._measure.requirement(spec, ds, only=len(candidates) == 1)
                if self.options.max_models:
                    reqs[ds][placement.COUNT] = 1
        except Exception as e:  # noqa: BLE001 - reported to every waiting request
            error = e
        with self._cond:
            rec.probing = False
            if error is None:
                rec.requirements, rec.components, rec.params = reqs, parts, params
            else:
                rec.error_epoch += 1
                rec.reason = f"cannot measure memory: {error}"
            self._cond.notify_all()

    def measure(self, name: str) -> None:
        """Probe ``name``'s bytes now (no load), unless measured or being measured."""
        with self._cond:
            rec = self.resolve(name)
            if rec.requirements is not None or rec.probing:
                return
            rec.probing = True
        self._probe_requirements(rec)

    def _fit(self, rec: Record, ds: frozenset[str], spec: ModelSpec, grant: dict[str, int]) -> None:
        """Fit ``spec`` into ``grant`` and remember the result for that grant."""
        fitted, error = None, None
        try:
            fitted = self._measure.fit(spec, ds, grant)
        except Exception as e:  # noqa: BLE001 - reported to every waiting request
            error = e
        with self._cond:
            rec.fitting = False
            if fitted is not None:
                rec.fits.add(ds, fitted)
                self.events.append((time.monotonic(), "fit" if fitted.ok else "no-fit", rec.name,
                                    "+".join(sorted(ds))))
            else:
                rec.error_epoch += 1
                rec.reason = f"cannot fit: {error}"
            self._cond.notify_all()

    def _running_worker(self, device_set: frozenset[str]) -> WorkerHandle | None:
        with self._cond:
            return self._workers.get(device_set)

    def workers(self) -> list[WorkerHandle]:
        with self._cond:
            return [w for w in self._workers.values() if w.alive]

    def _ensure_worker(self, device_set: frozenset[str]) -> WorkerHandle:
        with self._cond:
            lock = self._worker_locks.setdefault(device_set, threading.Lock())
        with lock:
            with self._cond:
                w = self._workers.get(device_set)
                if w is not None and w.alive:
                    return w
            w = WorkerHandle("+".join(sorted(device_set)), device_set, self.inventory.mask_env(device_set),
                             self._on_worker_death)
            w.start()
            self._refresh_overhead(w)
            with self._cond:
                self._workers[device_set] = w
                self._cond.notify_all()
            return w

    def _refresh_overhead(self, worker: WorkerHandle) -> None:
        """A worker's own cost on its GPUs: what the device reports for the process
        (context, cuBLAS workspace, pools) minus the probed bytes of its models."""
        usage = self.inventory.process_usage(worker.pid) if worker.pid else {}
        if not usage:
            return
        with self._cond:
            for device, used in usage.items():
                models = sum(r.need.get(device, 0) for r in self._records.values()
                             if r.worker is worker and r.state is State.LOADED)
                worker.overhead[device] = max(0, used - models)

    def _load(self, rec: Record) -> None:
        try:
            worker = self._ensure_worker(rec.device_set)
            free = self.inventory.free()
            with self._cond:
                # the worker's measured overhead now counts: does the reservation still fit?
                available = self._available(free)
                mine = {d: available.get(d, 0) + n for d, n in rec.need.items()}
                if placement.shortfall(rec.need, mine):
                    self._move(rec, State.UNLOADED)
                    self._cond.notify_all()
                    return
            cfg = rec.config
            spec = rec.load_spec or worker_spec(cfg.spec, rec.device_set, self.inventory.to_local(rec.device_set))
            ident, keep_dir, restore = None, None, []
            if self._keep is not None and (ident := identity(cfg.name, spec)) is not None:
                keep_dir, restore = str(self._keep.dir_for(ident)), self._keep.prepare(ident)
            pending = worker.call(lambda rid: LoadModel(rid, cfg.name, spec, keep_dir, tuple(restore),
                                                          self.options.stream_interval))
            reply = pending.get(self.options.load_timeout)
            if isinstance(reply, Loaded) and restore:  # the states are in the KV now, or refused
                self._keep.consumed(ident, restore, reply.restored, reply.refused)
        except Exception as e:  # noqa: BLE001
            reply = Failed(0, ErrorKind.WORKER_DIED if isinstance(e, WorkerDied) else ErrorKind.INTERNAL,
                           f"{type(e).__name__}: {e}")
        with self._cond:
            if rec.state is not State.LOADING:  # the worker died meanwhile and said so
                return
            if isinstance(reply, Loaded):
                self._move(rec, State.LOADED)
                rec.worker, rec.live, rec.identity = worker, dict(reply.pools), ident
                rec.last_used = time.monotonic()
                rec.loads += 1
                self.counters["loads"] += 1
                self._event("load", rec.name)
                loaded = True
            else:
                loaded = False
                self._move(rec, State.UNLOADED, reply.message)
                rec.error_epoch += 1
                self.counters["load_failures"] += 1
                self._event("load-failed", rec.name)
            self._cond.notify_all()
        if loaded:
            self._refresh_overhead(worker)

    def _unload(self, rec: Record) -> None:
        with self._cond:
            worker, ident = rec.worker, rec.identity
        keep = self._keep is not None and ident is not None
        if worker is not None and worker.alive:
            try:
                reply = worker.call(lambda rid: UnloadModel(rid, rec.name, keep)).get(self.options.load_timeout)
                if keep and isinstance(reply, Unloaded):
                    self._keep.add(ident, list(reply.kept))  # I/O: outside the lock
                    self._keep.hit(reply.hits)
            except Exception:  # noqa: BLE001 - a dead worker has freed the memory anyway
                pass
        with self._cond:
            if rec.state is State.UNLOADING:
                self._move(rec, State.UNLOADED)
            self._cond.notify_all()
        if not self.options.keep_idle_workers and worker is not None:
            self._stop_if_idle(worker)

    def _stop_if_idle(self, worker: WorkerHandle) -> None:
        with self._cond:
            if any(r.worker is worker for r in self._records.values()):
                return
            self._workers.pop(worker.devices, None)
        worker.stop()
        with self._cond:
            self._cond.notify_all()

    def _on_worker_death(self, worker: WorkerHandle) -> None:
        with self._cond:
            self.counters["worker_deaths"] += 1
            if self._workers.get(worker.devices) is worker:
                del self._workers[worker.devices]
            for r in self._records.values():
                if r.worker is worker or (r.state is State.LOADING and r.device_set == worker.devices):
                    self._move(r, State.UNLOADED, f"worker process {worker.pid} died")
                    self._event("worker-died", r.name)
            self._cond.notify_all()

    # -- explicit control ------------------------------------------------------

    def unload(self, name: str, wait: float | None = 30.0) -> bool:
        """Unload ``name`` once idle (waits for in-flight requests). False if not loaded."""
        rec = self.resolve(name)
        deadline = time.monotonic() + (wait or 0)
        with self._cond:
            while rec.state is State.LOADED and rec.leases > 0 and time.monotonic() < deadline:
                self._cond.wait(0.1)
            if rec.state is not State.LOADED or rec.leases > 0:
                return False
            self._begin_unload(rec)
            while wait and rec.state is State.UNLOADING and time.monotonic() < deadline:
                self._cond.wait(0.1)
            return True

    def reap_idle(self) -> list[str]:
        """Unload models idle longer than their ttl; returns their names."""
        now = time.monotonic()
        out = []
        with self._cond:
            for r in self._records.values():
                ttl = r.config.ttl
                if ttl and evictable(r.state, r.leases, False) and now - r.last_used > ttl:
                    self._begin_unload(r)
                    out.append(r.name)
        return out

    def close(self) -> None:
        with self._cond:
            self._closed = True
            workers = list(self._workers.values())
            self._workers.clear()
            for r in self._records.values():
                if r.state is not State.UNLOADED:
                    self._move(r, State.UNLOADED)
                r.leases = 0
            self._cond.notify_all()
        for w in workers:
            w.stop()
        for t in list(self._threads):
            t.join(5)
        if self._keep is not None:
            self._keep.close()

    # -- status ----------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        free = self.inventory.free()
        with self._cond:
            names = {r.identity: r.name for r in self._records.values() if r.identity}
        kept = self._keep.report(names) if self._keep is not None else {"enabled": False, "models": {}}
        with self._cond:
            available = self._available(free)
            held = self._held()
            models = {r.name: r.report(kept["models"].get(r.name)) for r in self._records.values()}
            devices = {
                n: {"kind": d.kind, "total": d.total, "free": free.get(n), "capacity": self._capacity(n),
                    "held": held.get(n, 0), "available": available.get(n)}
                for n, d in self._devices.items()
            }
            workers = [{"devices": sorted(w.devices), "pid": w.pid, "alive": w.alive, "overhead": w.overhead}
                       for w in self._workers.values()]
            return {"models": models, "devices": devices, "workers": workers, "counters": dict(self.counters),
                    "queue": len(self._queue), "kept": {k: v for k, v in kept.items() if k != "models"}}
