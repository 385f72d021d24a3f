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

    add_model / remove_model / replace_model / reconcile ──▶ the live list (roster.py,
        registry.py): a removed or changed model takes no new request, finishes what it
        has, unloads, and goes (or makes room for its new config, which its waiters follow)
    a model with replicas = N: a request goes to one of its instances (replicas.pick),
        and one more loads where its requests wait (roster.grow)
    a lease whose worker follows the client's connection (reads its next requests itself)
        lasts as long as they come: end_follows gives the connection back where the
        model's requests must be seen here again (unload, retirement, drain, a new instance)

Callers hold a ``Lease`` (the model's name and the worker captured when the lease
was taken), never a ``Record``: records change under the lock only, and a
model's state only in ``_move``, which checks the transition (state.py).

All state lives under one lock (``self._cond``).  Nothing does I/O while
holding it: free memory is read before the lock is taken; probes, worker
starts, loads and unloads run in background threads (jobs.py) and report back
under the lock.  A decision and the state change it implies (reserve, mark
UNLOADING) happen in the same critical section, so no other thread can act on a
stale check.  Deciding is pure (admission.py, placement.py, registry.step).

FIFO: a ticket may start a load only if no earlier ticket that also waits for
a load could use one of the same devices.  Requests for a LOADED model go
ahead, except for a model being drained for an earlier waiter: it takes new
requests only for ``turn`` seconds, then finishes what it has and is evicted.
Two models that cannot be co-resident are thus served in turns, not per
request.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Any, Iterable

from pyllmrouter.config import ModelConfig, RouterOptions
from pyllmrouter.devices import HOST, Inventory
from pyllmrouter.errors import (LoadFailed, ModelRemoved, NeverFits, NotLoaded, QueueFull, QueueTimeout,
                                RouterClosed, UnknownModel, Withdrawn)
from pyllmrouter.router import admission, placement, queueing, replicas, report
from pyllmrouter.router.fitbook import fit_over
from pyllmrouter.router.events import EventBus
from pyllmrouter.router.jobs import Jobs
from pyllmrouter.router.keep import KeepStore
from pyllmrouter.router.measure import Measurer, worker_spec
from pyllmrouter.router.pool import WorkerHandle
from pyllmrouter.router.records import Fate, Lease, Record, Ticket
from pyllmrouter.router.registry import Registry
from pyllmrouter.router.roster import Roster
from pyllmrouter.router.state import State, check_transition, evictable, holds_memory
from pyllmrouter.router.workers import WORKER, WorkerSet

__all__ = ["Scheduler", "Record", "Lease", "KEPT"]

KEPT = "(kept prompt states)"  # a resident that holds host memory: the kept states in RAM
_FIRST_TO_GO = -1e300  # an idle extra instance's place in the eviction order: after empty workers, before models
_HISTORY = frozenset({"load", "evict", "unload", "load-failed", "load-retry", "worker-died", "fit", "no-fit",
                      "spill"})


def budget_note(budget: int | None) -> str:
    return f", budget {budget / 2**20:.0f} MiB" if budget is not None else ""


class Scheduler:
    def __init__(self, models: list[ModelConfig], inventory: Inventory, options: RouterOptions):
        self.options = options
        self.inventory = inventory
        self._devices = {d.name: d for d in inventory.devices()}
        unusable = [f"{d.name} ({d.total / 2**20:.0f} MiB{budget_note(options.budgets.get(d.name))}) can hold "
                    f"{self._capacity(d.name) / 2**20:.0f} MiB for models with a margin of "
                    f"{options.margin / 2**20:.0f} MiB" for d in self._devices.values() if self._capacity(d.name) <= 0]
        if unusable:  # no request could ever be served there: say so now, not at each request
            raise ValueError("devices that can hold nothing: " + "; ".join(unusable) +
                             " (a smaller margin, --models-memory-margin MiB, or a larger budget or device)")
        self._registry = Registry(self._devices)
        for m in models:
            self._registry.add(m)
        self._cond = threading.Condition()
        self._queue: list[Ticket] = []
        self._seq = itertools.count(1)
        self._closed = False
        self.bus = EventBus()
        self.counters = {"loads": 0, "evictions": 0, "load_failures": 0, "worker_deaths": 0,
                         "workers_stopped_idle": 0, "workers_stopped_for_room": 0}
        self.on_wait: Any = None  # called as on_wait(model, seconds) for every lease (metrics)
        self.workers = WorkerSet(inventory, self._cond, self._on_worker_death, self._worker_started)
        measure = Measurer(inventory, options.load_timeout, self.workers.running_for, self.workers.ensure,
                           self._hosts_models)
        ram = options.kv_keep_ram
        if ram is None:
            ram = inventory.free().get(HOST, 0) // 8
        self._keep = KeepStore(ram, options.kv_keep_dir, options.kv_keep_disk) if ram > 0 else None
        self._jobs = Jobs(self, measure)
        self._roster = Roster(self, self._registry)
        self._spilling = False  # kept states are leaving RAM for host memory a load wants

    # -- lookup --------------------------------------------------------------

    def resolve(self, name: str) -> Record:
        with self._cond:
            return self._resolve(name)

    def _hosts_models(self, device_set: frozenset[str]) -> bool:
        """Whether the worker of ``device_set`` hosts a model (loading, loaded or unloading)."""
        with self._cond:
            return any(r.state is not State.UNLOADED and r.device_set == device_set
                       for r in self._registry.records())

    def canonical(self, name: str) -> str | None:
        """The listed model ``name`` (or an alias) is (None: none is)."""
        with self._cond:
            rec = self._registry.get(name)
            return rec.name if rec is not None else None

    def _resolve(self, name: str) -> Record:
        rec = self._registry.get(name)
        if rec is None or rec.fate is Fate.REMOVE:
            raise UnknownModel(name, [n for n, r in self._registry.configs().items()])
        return rec

    def records(self) -> list[Record]:
        with self._cond:
            return self._registry.records()

    @property
    def events(self) -> list[tuple[float, str, str, str]]:
        """What happened to the models lately, as (time, event, model, devices): loads,
        evictions, unloads, failures, fits, spills, dead workers (the bus has more)."""
        return [(e.t, e.event, e.model, e.devices) for e in self.bus.recent() if e.event in _HISTORY]

    def configs(self) -> dict[str, ModelConfig]:
        """Every model's config, as it will be (a changed model's new one)."""
        with self._cond:
            return self._registry.configs()

    # -- accounting (lock held) ---------------------------------------------

    def _capacity(self, device: str) -> int:
        total = self._devices[device].total
        return min(total, self.options.budgets.get(device, total)) - self.options.margin

    def _held(self) -> dict[str, int]:
        held: dict[str, int] = {}
        for r in self._registry.records():
            if holds_memory(r.state):
                for d, n in r.need.items():
                    held[d] = held.get(d, 0) + n
        for w in self.workers.all():
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
        if rec.primary is not None:  # an extra instance: where its model's others are not
            others = {r.device_set for r in self._registry.instances(rec.primary) if r is not rec and r.device_set}
            return [ds for ds in self._candidates(rec.primary) if ds not in others]
        if rec.config.devices:
            return [frozenset(rec.config.devices)]
        gpus = [n for n, d in self._devices.items() if d.kind != "cpu"]
        return [frozenset({g}) for g in gpus] or [frozenset({HOST})]

    def _busy_sets(self) -> set[frozenset[str]]:
        """Device sets in use (lock held): a model there, or a waiting request that may go there."""
        busy = {r.device_set for r in self._registry.records() if holds_memory(r.state) and r.device_set}
        for t in self._queue:
            busy.update(self._candidates(t.rec))
        return busy

    def _residents(self, ticket: Ticket, ignore_busy: bool = False, leaving: bool = False) -> list[placement.Resident]:
        """Models holding memory; evictable only if idle and no earlier request waits for them
        (``ignore_busy``: if not persistent; ``leaving``: models already unloading count too).
        Empty workers too: evictable, before any model; with ``leaving``, the ones stopping."""
        # a request ranked before this one that may take a lease keeps its model (one blocked by
        # a drain does not)
        now = time.monotonic()
        me = self._rank(ticket, now)
        awaited = {t.rec.name for t in self._queue if self._rank(t, now) < me and self._may_lease(t.rec, t)}
        residents = [
            placement.Resident(
                r.name, r.need, r.last_used if r.primary is None else _FIRST_TO_GO,
                (leaving and r.state is State.UNLOADING)
                or (evictable(r.state, 0, r.config.persistent) if ignore_busy
                    else evictable(r.state, r.leases, r.config.persistent) and r.name not in awaited),
            )
            for r in self._registry.records() if holds_memory(r.state)
        ]
        kept = self._keep.held_ram() if self._keep is not None else 0
        if kept:  # kept prompt states give way first (spilled to disk or dropped), before any model
            residents.append(placement.Resident(KEPT, {HOST: kept}, float("-inf"), not self._spilling))
        self.workers.note(self._busy_sets(), time.monotonic())
        residents += [self.workers.resident(w) for w in self.workers.running()]
        residents += [self.workers.resident(w, leaving) for w in self.workers.stopping()]  # their bytes go soon
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
              gone: threading.Event | None = None, prefer: str | None = None) -> Lease:
        """Block until ``name`` is LOADED and take a lease on it.  Once ``gone`` is set
        (``withdraw``) the wait ends with Withdrawn: the ticket leaves the queue, and what
        it alone asked for (a load, a drain of a busy model) does not happen.  ``prefer``:
        the instance of the model to take where it has a free slot (a conversation's last)."""
        timeout = self.options.queue_timeout if timeout is None else timeout
        autoload = self.options.autoload if autoload is None else autoload
        with self._cond:
            if self._closed:
                raise RouterClosed("router is closed")
            rec = self._resolve(name)
            if rec.state is not State.LOADED and not autoload:
                raise NotLoaded(rec.name, rec.state.value)
            refused = self._queue_refusal(rec)
            if refused is not None:
                raise QueueFull(rec.name, refused.scope, refused.limit, refused.waiting)
            ticket = Ticket(rec, next(self._seq), rec.error_epoch, time.monotonic())
            self._queue.append(ticket)
        deadline = ticket.created + timeout
        free: dict[str, int] | None = None  # the inventory's reading, taken since the last wait
        try:
            while True:
                with self._cond:
                    rec = self._follow(ticket)
                    if self._closed:
                        raise RouterClosed("router is closed")
                    if gone is not None and gone.is_set():
                        raise Withdrawn(rec.name)
                    if rec.error_epoch > ticket.epoch:
                        raise LoadFailed(rec.name, rec.reason or "unknown reason")
                    ready = self._ready_instance(rec, ticket, prefer) if rec.fate is None else None
                    if ready is not None:
                        return self._take(ready, ticket)
                    stale = rec.fate is None and rec.state is State.UNLOADED and free is None
                    if not stale:
                        why = "waiting" if rec.fate is None else "waiting for its new configuration"
                        if rec.fate is None and rec.state is State.UNLOADED:
                            why = self._admit(rec, ticket, free)
                        ticket.why = why
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
                for r in self._registry.records():
                    if r.drain is not None and r.drain[1] == ticket.seq:
                        r.drain = None  # its waiter is gone; a later waiter sets its own
                self._cond.notify_all()

    def _follow(self, ticket: Ticket) -> Record:
        """The ticket's model now: a changed model's new Record; ModelRemoved if it went."""
        while ticket.rec.gone:
            if ticket.rec.successor is None:
                raise ModelRemoved(ticket.rec.name)
            ticket.rec = ticket.rec.successor
            ticket.epoch = ticket.rec.error_epoch
        if ticket.rec.fate is Fate.REMOVE:
            raise ModelRemoved(ticket.rec.name)
        return ticket.rec

    def withdraw(self, gone: threading.Event) -> None:
        """The caller of a waiting ``lease(..., gone=gone)`` has left: end its wait now."""
        with self._cond:
            gone.set()
            self._cond.notify_all()

    def try_lease(self, name: str, prefer: str | None = None) -> Lease | None:
        """A lease on ``name`` if it can be taken at once (LOADED, not draining for an
        earlier waiter, not retiring), else None; never waits, never starts a load."""
        with self._cond:
            rec = self._resolve(name)
            if self._closed or rec.fate is not None:
                return None
            if self._queue_refusal(rec) is not None:
                return None  # lease() says which limit
            ticket = Ticket(rec, next(self._seq), rec.error_epoch, time.monotonic())
            ready = self._ready_instance(rec, ticket, prefer)
            return self._take(ready, ticket) if ready is not None else None

    def _take(self, rec: Record, ticket: Ticket) -> Lease:
        rec.leases += 1
        rec.last_used = time.monotonic()
        if self.on_wait is not None:
            self.on_wait((rec.primary or rec).name, rec.last_used - ticket.created)
        self._roster.grow(rec.primary or rec)
        return Lease(rec.name, rec.worker, rec, rec.drain[0] if rec.drain is not None else None, rec.follow_epoch)

    # -- instances (replicas.py) ---------------------------------------------------

    def _slots(self, rec: Record) -> int:
        params = (rec.params.get(rec.device_set) or {}) if rec.device_set else {}
        return int(params.get("n_parallel") or 1)

    def _ready_instance(self, rec: Record, ticket: Ticket, prefer: str | None = None) -> Record | None:
        """The loaded instance of ``rec``'s model a request goes to (lock held): ``prefer``
        where it is one with a free slot (the instance that served the conversation last:
        its prompt is in that engine's cache), else the fewest in flight; None where none
        can take it now.  A name that is an extra instance's (a resumable stream's owner)
        is that instance alone."""
        candidates = [rec] if rec.primary is not None else self._registry.instances(rec)
        ready = {r.name: r for r in candidates
                 if r.state is State.LOADED and r.fate is None and not r.gone and self._may_lease(r, ticket)}
        last = ready.get(prefer) if prefer is not None else None
        if last is not None and last.leases < self._slots(last):
            return last
        name = replicas.pick([replicas.Instance(r.name, r.leases, self._slots(r), r.primary is None)
                              for r in ready.values()])
        return ready.get(name) if name is not None else None

    def release(self, lease: Lease) -> None:
        with self._cond:
            rec = lease.record
            rec.leases -= 1
            rec.last_used = time.monotonic()
            self._settle(rec)
            self._cond.notify_all()

    def _may_lease(self, rec: Record, ticket: Ticket) -> bool:
        """A model drained for a waiter takes the requests that rank before that waiter's,
        and others only for its turn; one an unload waits for takes none."""
        if rec.unload_asked:
            return False
        if rec.drain is None:
            return True
        deadline, waiter_seq = rec.drain
        if time.monotonic() < deadline:
            return True
        waiter = next((t for t in self._queue if t.seq == waiter_seq), None)
        return waiter is None or self._rank(ticket) < self._rank(waiter)

    def _rank(self, ticket: Ticket, now: float | None = None) -> tuple[int, int]:
        """A waiting request's place (queueing.rank): priority, raised by its wait, then FIFO."""
        return queueing.rank(ticket.rec.config.priority, ticket.created, ticket.seq,
                             time.monotonic() if now is None else now, self.options.priority_age)

    def _queue_refusal(self, rec: Record) -> "queueing.Refusal | None":
        """The limit one more request of ``rec``'s model (all its instances) would cross,
        if any (lock held).  Requests holding no slot: queued here, or past a model's slots;
        the queue is read once."""
        if not (rec.config.max_queue or self.options.max_queue):
            return None
        tickets = collections.Counter(t.rec.name for t in self._queue)
        model = rec.primary or rec
        total = mine = 0
        for r in self._registry.records():
            n = queueing.waiting(tickets[r.name], r.leases, self._slots(r), r.state is State.LOADED)
            total += n
            mine += n if (r.primary or r) is model else 0
        return queueing.refusal(mine, rec.config.max_queue, total, self.options.max_queue)

    # -- the live model list (roster.py) ----------------------------------------

    def add_model(self, cfg: ModelConfig) -> None:
        """A new model, servable at once (ValueError: its name or an alias is taken)."""
        with self._cond:
            self._roster.add(cfg)
            self._cond.notify_all()

    def remove_model(self, name: str) -> None:
        """``name`` takes no new request, finishes those in flight, unloads and goes."""
        with self._cond:
            self._roster.retire(self._resolve(name), None)

    def replace_model(self, cfg: ModelConfig) -> None:
        """``cfg`` replaces the model of its name once that one has finished its requests
        and unloaded; requests that come meanwhile wait for the new config."""
        with self._cond:
            rec = self._resolve(cfg.name)
            if (rec.replacement or rec.config) != cfg:
                self._roster.retire(rec, cfg)

    def reconcile(self, configs: Iterable[ModelConfig]) -> dict[str, list[str]]:
        """Make the list the sources' new one (models added through the API stay): new
        names added, changed configs replaced (or tuned in place), names gone removed.
        Each change is checked first, so a bad list changes nothing (ValueError)."""
        with self._cond:
            changes = self._roster.reconcile(configs)
            self._event("models_reload", "*")
            self._cond.notify_all()
        return {"added": [c.name for c in changes.add], "removed": list(changes.remove),
                "changed": [c.name for c in (*changes.replace, *changes.tune)]}

    def _settle(self, rec: Record) -> None:
        self._roster.settle(rec)

    # -- admission (lock held) -----------------------------------------------

    def _earlier_loader_blocks(self, rec: Record, ticket: Ticket) -> bool:
        """Whether a request ranked before this one (priority, then FIFO) waits for a load that
        could use one of the same devices: it goes first."""
        mine = set().union(*self._candidates(rec))
        now = time.monotonic()
        me = self._rank(ticket, now)
        for t in self._queue:
            if t is ticket or self._rank(t, now) >= me:
                continue
            other = t.rec
            if other is rec:
                return True  # an earlier ticket of the same model drives its load
            if other.state is State.UNLOADED and not other.gone and mine & set().union(*self._candidates(other)):
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
            self._event("load-failed", rec.name, reason=decision.why)
            raise NeverFits(rec.name, decision.device, decision.need, decision.capacity, decision.why)
        if isinstance(decision, admission.Evict):
            short = placement.shortfall(decision.need, available)
            for v in decision.victims:
                if v == KEPT:
                    self._spilling = True
                    self._jobs.spawn(self._jobs.spill)
                elif v.startswith(WORKER):
                    self._stop_worker(self.workers.by_name(v), "room", newcomer=rec.name)
                else:
                    victim = self._registry.get(v)
                    self._event("evicted", v, newcomer=rec.name, bytes=dict(victim.need),
                                short={d: n for d, n in short.items() if victim.need.get(d, 0) > 0})
                    self._begin_unload(victim, evicted=True)
            return "evicting idle models"
        if isinstance(decision, admission.Wait):
            if decision.probe:
                rec.probing = True
                self._jobs.spawn(self._jobs.probe, rec)
            if decision.fit is not None:
                rec.fitting = True
                job = decision.fit
                self._jobs.spawn(self._jobs.fit, rec, job.device_set, job.spec, dict(job.grant))
            deadline = ticket.created + self.options.turn
            for v in (decision.drain if rec.primary is None else ()):  # an extra instance drains nothing
                victim = self._registry.get(v)
                owner = next((t for t in self._queue if victim.drain and t.seq == victim.drain[1]), None)
                if victim.drain is None or owner is None or self._rank(ticket) < self._rank(owner):
                    victim.drain = (deadline, ticket.seq)
                    self.end_follows(victim, deadline)
            if decision.short and decision.short != ticket.short:
                ticket.short = dict(decision.short)
                self._event("waiting", rec.name, why=decision.why, short=dict(decision.short))
            return decision.why
        self._move(rec, State.LOADING)
        rec.device_set, rec.need, rec.reason = decision.device_set, dict(decision.need), None
        rec.load_spec, rec.fit = decision.spec, decision.fit
        self._event("load-start", rec.name)
        self._jobs.spawn(self._jobs.load, rec)
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
                options.append(admission.Option(ds, rec.requirements[ds], spec, fit_over(ds, local, rec.params[ds])))
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
        self._jobs.spawn(self._jobs.unload, rec)

    def end_follows(self, rec: Record, at: float | None = None) -> None:
        """The connections ``rec``'s worker follows for it (reads their next requests itself,
        server/connection.py) come back to the router by ``at`` (time.monotonic; None: after
        the request each is answering), whose requests it must see again: an unload or a
        retirement waits for the model's leases, a drain for its turn, and a new instance
        takes its share of them only through the router (lock held).  It covers every lease
        of ``rec`` taken before it (``Lease.epoch``)."""
        conduit = rec.worker.conduit if rec.worker is not None and rec.leases > 0 else None
        if conduit is not None:
            rec.follow_epoch += 1
            conduit.end_follows(rec.name, rec.follow_epoch, time.monotonic() if at is None else at)

    def end_all_follows(self) -> None:
        """Every follow of every model ends after its request (a server shutting down: the
        connections come back to it, and close)."""
        with self._cond:
            for rec in self._registry.records():
                self.end_follows(rec)

    def _event(self, what: str, name: str, **data: Any) -> None:
        rec = self._registry.get(name)
        where = "+".join(sorted(rec.device_set)) if rec is not None and rec.device_set else ""
        self.bus.publish(what, name, where, **data)

    def _stop_worker(self, worker: WorkerHandle, reason: str, **data: Any) -> None:
        """An empty worker goes (lock held): its bytes stay held until its process ends."""
        self.workers.retire(worker)
        self.counters["workers_stopped_idle" if reason == "idle" else "workers_stopped_for_room"] += 1
        self.bus.publish("worker-stopping", "", "+".join(sorted(worker.devices)), reason=reason, pid=worker.pid,
                         **data)
        self._jobs.spawn(self._jobs.stop_worker, worker)

    def reap_workers(self) -> list[WorkerHandle]:
        """Stop the workers empty for longer than the idle timeout (0: at once; -1: never)."""
        timeout = self.options.worker_idle_timeout
        with self._cond:
            self.workers.note(self._busy_sets(), time.monotonic())
            if timeout < 0 or self._closed:
                return []
            gone = [w for w, idle in self.workers.idle(time.monotonic()).items() if idle >= timeout]
            for w in gone:
                self._stop_worker(w, "idle")
            return gone

    def _worker_started(self, worker: WorkerHandle) -> None:
        self._jobs.refresh_overhead(worker)  # its GPU context counts from now on
        self.bus.publish("worker-started", "", "+".join(sorted(worker.devices)), pid=worker.pid)

    def _on_worker_death(self, worker: WorkerHandle) -> None:
        with self._cond:
            self.counters["worker_deaths"] += 1
            self.workers.forget(worker)
            for r in self._registry.records():
                if r.worker is worker or (r.state is State.LOADING and r.device_set == worker.devices):
                    self._move(r, State.UNLOADED, f"worker process {worker.pid} died")
                    self._event("worker-died", r.name, pid=worker.pid)
                    self._settle(r)
            self._cond.notify_all()

    def measure(self, name: str) -> None:
        """Probe ``name``'s bytes now (no load), unless measured or being measured."""
        with self._cond:
            rec = self._resolve(name)
            if rec.requirements is not None or rec.probing:
                return
            rec.probing = True
        self._jobs.probe(rec)

    # -- explicit control ------------------------------------------------------

    def unload(self, name: str, wait: float | None = 30.0) -> bool:
        """Unload ``name`` once idle (waits for in-flight requests). False if not loaded."""
        deadline = time.monotonic() + (wait or 0)
        with self._cond:
            rec = self._resolve(name)
            rec.unload_asked = rec.state is State.LOADED  # its requests now wait for the unload, then load it again
            self.end_follows(rec)
            try:
                while rec.state is State.LOADED and rec.leases > 0 and time.monotonic() < deadline:
                    self._cond.wait(0.1)
            finally:
                rec.unload_asked = False
                self._cond.notify_all()
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
            for r in self._registry.records():
                ttl = r.config.ttl
                if ttl and evictable(r.state, r.leases, False) and now - r.last_used > ttl:
                    self._begin_unload(r)
                    out.append(r.name)
        return out

    def close(self) -> None:
        with self._cond:
            self._closed = True
            workers = self.workers.take_all()
            for r in self._registry.records():
                if r.state is not State.UNLOADED:
                    self._move(r, State.UNLOADED)
                r.leases = 0
            self._cond.notify_all()
        for w in workers:
            w.stop()
        self._jobs.join(5)
        if self._keep is not None:
            self._keep.close()

    # -- status ----------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Every model, device and worker as plain values (report.py)."""
        return report.status(self)
