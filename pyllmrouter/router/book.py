"""The scheduler's state, and its one owner.

    Book ── records     every model's Record, by name and alias (registry.py)
         ── queue       the requests waiting for a model (Tickets), in arrival order
         ── condition   what every waiting request waits on; notified by each change
         ── events      what happened (EventBus: /events, /models/sse) and the counters
         ── workers     the worker of each device set (WorkerSet), guarded by the same lock

    Scheduler (decides) ─┐                    ┌─▶ records, queue, events, counters
    Jobs (background) ───┼── Book's methods ──┤
    Roster (the list) ───┘                    └─▶ notify the waiters
    report.status ◀── Book's reads (plain values)

Every change to a record, a ticket, the queue or the counters is a method of the Book,
taken under its lock; the others read records' fields (under ``locked()``) and call the
methods, never its underscored names.  The lock is re-entrant: the scheduler holds it
across a decision and the changes it implies (``with book.locked(): ...``), so no decision
acts on a state another thread changed meanwhile, and each method takes it again on its
own.  Nothing here does I/O: free memory is read before the lock is taken (after
``mark``), and process starts, loads and file work run outside it.  A model's state
changes in one place, ``move``, which checks the transition (state.py).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from typing import Any, Callable, Iterator

from pyllmrouter.config import ModelConfig, RouterOptions
from pyllmrouter.devices import HOST, Device
from pyllmrouter.errors import ModelRemoved, UnknownModel
from pyllmrouter.router.policy import accounting, placement, queueing
from pyllmrouter.router.policy.fitbook import Fitted
from pyllmrouter.router.policy.state import State, check_transition, holds_memory
from pyllmrouter.router.records import Fate, Lease, Record, Ticket
from pyllmrouter.router.registry import Registry
from pyllmrouter.router.services.events import EventBus
from pyllmrouter.router.workers.keep import KeepStore
from pyllmrouter.router.workers.handle import WorkerHandle
from pyllmrouter.router.workers.sets import WorkerSet

__all__ = ["Book", "HISTORY", "capacity"]

# the events status() and the Python API's ``events`` list (the bus has more)
HISTORY = frozenset({"load", "evict", "unload", "load-failed", "load-retry", "worker-died", "fit", "no-fit",
                     "spill"})


def capacity(device: Device, options: RouterOptions) -> int:
    """What our models may hold on ``device``: its size (or its budget), less the margin."""
    return min(device.total, options.budgets.get(device.name, device.total)) - options.margin


class Book:
    def __init__(self, devices: dict[str, Device], options: RouterOptions, workers: Callable[..., WorkerSet],
                 keep: KeepStore | None):
        """``workers(cond)``: the WorkerSet, made with the Book's condition (its map is
        read and changed under the Book's lock)."""
        self.options = options
        self.devices = dict(devices)
        self.bus = EventBus()
        self.keep = keep
        self._cond = threading.Condition(threading.RLock())
        self._registry = Registry(self.devices)
        self._queue: list[Ticket] = []
        self._queue_version = 0  # changes whenever a ticket joins, leaves or follows a new record
        self._firsts: tuple[int, dict[int, tuple[Ticket | None, Ticket | None]]] = (-1, {})  # first_waiting
        self._seq = itertools.count(1)
        self._closed = False
        self._spilling = False  # kept states are leaving RAM for host memory a load wants
        self._settled_version = 0  # bumped when bytes become settled (mark)
        self._moves = 0  # every model's state changes so far
        self._counters = {"loads": 0, "evictions": 0, "load_failures": 0, "worker_deaths": 0,
                          "workers_stopped_idle": 0, "workers_stopped_for_room": 0}
        self.on_wait: Callable[[str, float], None] | None = None  # every lease's wait (metrics)
        self.workers = workers(self._cond)

    # -- the lock ----------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The Book's lock, held across a decision and the changes it implies."""
        with self._cond:
            yield

    def wait(self, timeout: float) -> None:
        """Until a change (or ``timeout``), the lock held (it is released meanwhile)."""
        with self._cond:
            self._cond.wait(timeout)

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def spilling(self) -> bool:
        return self._spilling

    def counters(self) -> dict[str, int]:
        with self._cond:
            return dict(self._counters)

    # -- lookup -----------------------------------------------------------------------

    def get(self, name: str) -> Record | None:
        """The record of ``name`` (or an alias), retiring ones included."""
        with self._cond:
            return self._registry.get(name)

    def named(self, name: str) -> Record | None:
        """The record whose own name is ``name`` (no alias: the scheduler's own lookups)."""
        with self._cond:
            return self._registry.named(name)

    def resolve(self, name: str) -> Record:
        """The record of a listed model (UnknownModel: none, or removed)."""
        with self._cond:
            rec = self._registry.get(name)
            if rec is None or rec.fate is Fate.REMOVE:
                raise UnknownModel(name, list(self._registry.configs()))
            return rec

    def records(self) -> list[Record]:
        with self._cond:
            return self._registry.records()

    def configs(self) -> dict[str, ModelConfig]:
        """Every model's config, as it will be (a changed model's new one)."""
        with self._cond:
            return self._registry.configs()

    def instances(self, rec: Record) -> list[Record]:
        """A model's instances: its own record, then its extra ones."""
        with self._cond:
            return self._registry.instances(rec)

    def tickets(self) -> list[Ticket]:
        """The waiting requests, in arrival order."""
        with self._cond:
            return list(self._queue)

    # -- accounting ---------------------------------------------------------------------

    def capacity(self, device: str) -> int:
        return capacity(self.devices[device], self.options)
    def _tally(self) -> tuple[dict[str, int], dict[str, int]]:
        """(held, settled) bytes per device (policy/accounting.py ``tally``)."""
        kept = (self.keep.held_ram(), self.keep.kept_ram()) if self.keep is not None else (0, 0)
        workers = self.workers
        return accounting.tally([(r.state, r.need) for r in self._registry.records()],
                            [w.overhead for w in workers.running()],
                            [*(w.overhead for w in workers.stopping()), *workers.starting()], kept)

    def held(self) -> dict[str, int]:
        """Bytes held per device: models that hold memory, workers' own, kept states in RAM."""
        with self._cond:
            return self._tally()[0]

    def mark(self) -> tuple[int, int, int]:
        """Read before a reading of free memory, and checked when it is used: it changes
        whenever bytes become settled (a model LOADED, a worker started or its overhead
        measured, kept states written), which the reading may predate (policy/accounting.py)."""
        with self._cond:
            return self._settled_version, self.workers.version, self.keep.version if self.keep is not None else 0

    def external(self, free: dict[str, int]) -> dict[str, int]:
        """Per device, what other programs may be using, erring high (policy/accounting.py)."""
        with self._cond:
            return accounting.external({n: d.total for n, d in self.devices.items()}, free, self._tally()[1])

    def available(self, free: dict[str, int], hoped: bool = False) -> dict[str, int]:
        """Per device, what our models may surely take now, from ``free`` (the inventory's
        reading, taken before the lock, after ``mark``); ``hoped``: once what is under way
        has settled (policy/accounting.py)."""
        with self._cond:
            held, settled = self._tally()
            out = accounting.available({n: d.total for n, d in self.devices.items()},
                                   {n: self.capacity(n) for n in self.devices}, self.options.margin, free, held,
                                   held if hoped else settled)
            if self.options.max_models:
                out[placement.COUNT] = self.options.max_models - held.get(placement.COUNT, 0)
            return out

    def candidates(self, rec: Record) -> list[frozenset[str]]:
        """The device sets a model may load on: its pinned ones, else each GPU (the host
        without one).  An instance goes where the model's other instances that hold memory
        are not (an extra one: nowhere else; the model's own, back while extra ones serve:
        anywhere if they hold every set).  An instance that holds no memory holds no set."""
        with self._cond:
            primary = rec.primary or rec
            if primary.config.devices:
                base = [frozenset(primary.config.devices)]
            else:
                gpus = [n for n, d in self.devices.items() if d.kind != "cpu"]
                base = [frozenset({g}) for g in gpus] or [frozenset({HOST})]
            others = {r.device_set for r in self._registry.instances(primary)
                      if r is not rec and r.device_set and holds_memory(r.state)}
            free = [ds for ds in base if ds not in others]
            return free if free or rec.primary is not None else base

    def busy_sets(self, upto: Ticket | None = None) -> set[frozenset[str]]:
        """Device sets in use: a model there, or a waiting request that may go there (``upto``:
        it, or one ranked before it: one behind never keeps an empty worker from it)."""
        with self._cond:
            busy = {r.device_set for r in self._registry.records() if holds_memory(r.state) and r.device_set}
            now = time.monotonic()
            for t in (t for t in self._queue if upto is None or t is upto or self.rank(t, now) < self.rank(upto, now)):
                busy.update(self.candidates(t.rec))
            return busy

    def hosts_models(self, device_set: frozenset[str]) -> bool:
        """Whether the worker of ``device_set`` hosts a model (loading, loaded or unloading)."""
        with self._cond:
            return any(r.state is not State.UNLOADED and r.device_set == device_set
                       for r in self._registry.records())

    def rank(self, ticket: Ticket, now: float | None = None) -> tuple[int, float, int]:
        """A waiting request's place (queueing.rank): priority, raised by its wait, then FIFO."""
        return queueing.rank(ticket.rec.config.priority, ticket.created, ticket.seq,
                             time.monotonic() if now is None else now, self.options.priority_age)

    # -- the queue ----------------------------------------------------------------------

    def enqueue(self, rec: Record, loader: bool = False, waited: float = 0.0, asked: str = "", slot=False) -> Ticket:
        """A waiting request for ``rec`` (by the name ``asked``; ``loader``: an instance's load;
        ``slot``: Scheduler.lease's) joins the queue.  ``waited``: seconds it waited elsewhere
        (a request another node took and lost): it counts as arrived then, before those since."""
        with self._cond:
            ticket = Ticket(rec, next(self._seq), rec.error_epoch, time.monotonic() - max(0.0, waited), loader=loader,
                            asked=asked, slot=slot)
            at = len(self._queue)
            while at and self._queue[at - 1].created > ticket.created:
                at -= 1
            self._queue.insert(at, ticket)
            self._queue_version += 1
            return ticket

    def first_waiting(self, rec: Record, slot: bool = False) -> Ticket | None:
        """The earliest waiting request for ``rec`` (``slot``: for a free slot of it), in arrival
        order, which within one model is rank order.  Read once per change of the queue."""
        with self._cond:
            version, firsts = self._firsts
            if version != self._queue_version:
                firsts = {}
                for t in self._queue:
                    first, first_slot = firsts.get(id(t.rec), (None, None))
                    firsts[id(t.rec)] = (first or t, first_slot or (t if t.slot else None))
                self._firsts = (self._queue_version, firsts)
            return firsts.get(id(rec), (None, None))[slot]

    def ticket(self, rec: Record) -> Ticket:
        """A request's place, for one that takes a lease at once (not queued)."""
        return Ticket(rec, next(self._seq), rec.error_epoch, time.monotonic())

    def dequeue(self, ticket: Ticket) -> None:
        """A waiting request leaves the queue, and the drain it set, if any; the last waiter
        of a model whose load is to be tried again (its second chance) takes that with it."""
        with self._cond:
            self._queue.remove(ticket)
            self._queue_version += 1
            for r in self._registry.records():
                if r.drain is not None and r.drain[1] == ticket.seq:
                    r.drain = None  # its waiter is gone; a later waiter sets its own
            rec = ticket.rec
            if rec.second_chance and rec.state is State.UNLOADED and not any(t.rec is rec for t in self._queue):
                rec.second_chance = False  # nobody retried: the next load's failure gets its own chance
            self._cond.notify_all()

    def follow(self, ticket: Ticket) -> Record:
        """The ticket's model now: a changed model's new Record; ModelRemoved if it went."""
        with self._cond:
            while ticket.rec.gone:
                if ticket.rec.successor is None:
                    raise ModelRemoved(ticket.rec.name)
                ticket.rec = ticket.rec.successor
                ticket.epoch = ticket.rec.error_epoch
                self._queue_version += 1
            if ticket.rec.fate is Fate.REMOVE:  # its name may be another model's alias in the list now
                heir = self._registry.get(ticket.asked or ticket.rec.name)
                if heir is None or heir is ticket.rec or heir.fate is Fate.REMOVE:
                    raise ModelRemoved(ticket.rec.name)
                ticket.rec, ticket.epoch = heir, heir.error_epoch
                self._queue_version += 1
            return ticket.rec

    def note(self, ticket: Ticket, why: str, short: dict[str, int] | None = None) -> None:
        """What a waiting request waits for (and the shortfall last reported for it)."""
        with self._cond:
            ticket.why = why
            if short is not None:
                ticket.short = dict(short)

    # -- leases ---------------------------------------------------------------------------

    def take(self, rec: Record, ticket: Ticket) -> Lease:
        """A lease on the LOADED ``rec``."""
        with self._cond:
            rec.leases += 1
            rec.last_used = time.monotonic()
            (rec.primary or rec).keep = None  # a request's keep_alive (if any) is set once it holds this
            if self.on_wait is not None:
                self.on_wait((rec.primary or rec).name, rec.last_used - ticket.created)
            return Lease(rec.name, rec.worker, rec, rec.drain[0] if rec.drain is not None else None,
                         rec.follow_epoch, slot=rec.leases <= rec.slots())

    def release(self, lease: Lease) -> Record:
        with self._cond:
            rec = lease.record
            rec.leases -= 1
            rec.last_used = time.monotonic()
            return rec

    def ask_unload(self, rec: Record, asked: bool) -> None:
        """An unload waits for ``rec``'s leases: it takes no new one meanwhile."""
        with self._cond:
            rec.unload_asked = asked
            self._cond.notify_all()

    def keep_alive(self, rec: Record, seconds: float | None) -> None:
        """``rec``'s (a model's own) idle time as a request set it (Record.keep), from now."""
        with self._cond:
            rec.keep = seconds
            for r in self._registry.instances(rec):
                r.last_used = max(r.last_used, time.monotonic())

    def drain(self, rec: Record, deadline: float, seq: int) -> None:
        """``rec`` takes new requests until ``deadline`` only, for the waiter ``seq``."""
        with self._cond:
            rec.drain = (deadline, seq)

    def end_follows(self, rec: Record, at: float | None = None) -> None:
        """The connections ``rec``'s worker follows for it come back to the router by ``at``
        (time.monotonic; None: after the request each is answering), for every lease of
        ``rec`` taken before now (``Lease.epoch``; docs/ARCHITECTURE.md, the native path)."""
        with self._cond:
            conduit = rec.worker.conduit if rec.worker is not None and rec.leases > 0 else None
            if conduit is not None:
                rec.follow_epoch += 1
                conduit.end_follows(rec.name, rec.follow_epoch, time.monotonic() if at is None else at)

    def end_all_follows(self) -> None:
        with self._cond:
            for rec in self._registry.records():
                self.end_follows(rec)

    # -- a model's state ---------------------------------------------------------------------

    def move(self, rec: Record, new: State, reason: str | None = None) -> None:
        """The one place a model's state changes, checked against state.TRANSITIONS.
        UNLOADED holds nothing: the reservation, the worker, a drain and the live bytes go
        with it, and ``reason`` says why, if given."""
        with self._cond:
            check_transition(rec.state, new)
            rec.state = new
            self._moves += 1
            if new is State.UNLOADED:
                rec.need, rec.worker, rec.drain, rec.live = {}, None, None, {}
                if reason is not None:
                    rec.reason = reason
            self._cond.notify_all()

    def start_load(self, rec: Record, device_set: frozenset[str], need: dict[str, int], spec,
                   fit: Fitted | None) -> int:
        """``rec`` admitted: LOADING on ``device_set``, ``need`` reserved there; the load's
        attempt number (what its job reports back with: a late answer of an earlier
        attempt changes nothing)."""
        with self._cond:
            self.move(rec, State.LOADING)
            rec.device_set, rec.need, rec.reason = device_set, dict(need), None
            rec.load_spec, rec.fit = spec, fit
            rec.attempt += 1
            self.event("load-start", rec.name)
            return rec.attempt

    def loading(self, rec: Record, attempt: int) -> bool:
        """Whether ``rec`` is LOADING, in this attempt."""
        with self._cond:
            return rec.state is State.LOADING and rec.attempt == attempt

    def failed(self, rec: Record, reason: str, counted: bool = False) -> None:
        """``rec``'s waiters give up with ``reason`` (a failed probe, fit or load, or a model
        that never fits); ``counted``: a load failure."""
        with self._cond:
            rec.error_epoch += 1
            rec.reason = reason
            if counted:
                self._counters["load_failures"] += 1
            self.event("load-failed", rec.name, reason=reason)
            self._cond.notify_all()

    def begin_unload(self, rec: Record, evicted: bool = False) -> None:
        with self._cond:
            self.move(rec, State.UNLOADING)
            self.event("evict" if evicted else "unload", rec.name)
            if evicted:
                self._counters["evictions"] += 1

    def loaded(self, rec: Record, worker: WorkerHandle, pools: dict[str, int], ident: str | None,
               seconds: float) -> None:
        with self._cond:
            self.move(rec, State.LOADED)
            rec.second_chance = False
            rec.worker, rec.live, rec.identity = worker, dict(pools), ident
            rec.last_used = time.monotonic()
            rec.loads += 1
            self._settled_version += 1
            self._counters["loads"] += 1
            self.event("load", rec.name, seconds=round(seconds, 3))

    def load_retry(self, rec: Record, reason: str, detail: str) -> None:
        """A load that failed for want of device memory, or whose worker died under it, once:
        its waiters stay, and admission runs again on a fresh reading of the free memory."""
        with self._cond:
            rec.second_chance = True
            self.event("load-retry", rec.name, reason=reason, devices_now=detail)
            self.move(rec, State.UNLOADED, reason)

    def load_failed(self, rec: Record, reason: str) -> None:
        with self._cond:
            rec.second_chance = False
            self.move(rec, State.UNLOADED, reason)
            self.failed(rec, reason, counted=True)

    def load_cancelled(self, rec: Record, worker: WorkerHandle, reason: str) -> None:
        """A load past its timeout: its waiters fail, its bytes held until its cancel ends."""
        with self._cond:
            self.move(rec, State.UNLOADING)
            rec.worker, rec.identity = worker, None
            self.failed(rec, reason, counted=True)

    def unloaded(self, rec: Record) -> None:
        with self._cond:
            if rec.state is State.UNLOADING:
                self.move(rec, State.UNLOADED)
                self.event("unloaded", rec.name)

    def worker_died(self, worker: WorkerHandle) -> list[Record]:
        """``worker``'s process ended: the models it held or was loading are UNLOADED (a load
        it died under: ``died_loading``, no storm of workers until the queue timeout)."""
        with self._cond:
            self._counters["worker_deaths"] += 1
            self.workers.forget(worker)
            gone = []
            for r in self._registry.records():
                if r.worker is worker or (r.state is State.LOADING and r.device_set == worker.devices):
                    self.event("worker-died", r.name, pid=worker.pid)
                    if r.state is State.LOADING:
                        self.died_loading(r, f"worker process {worker.pid} died during the load{worker.death}")
                    else:
                        self.move(r, State.UNLOADED, f"worker process {worker.pid} died")
                    gone.append(r)
            return gone

    def died_loading(self, rec: Record, reason: str) -> None:
        """``rec``'s worker died under its load: tried once more, then its waiters fail."""
        with self._cond:
            self.load_failed(rec, reason) if rec.second_chance else self.load_retry(rec, reason, "")

    # -- measuring ------------------------------------------------------------------------

    def measuring(self, rec: Record, probing: bool | None = None, fitting: bool | None = None) -> None:
        """A probe or a fit of ``rec`` starts (True) or ends (False)."""
        with self._cond:
            if probing is not None:
                rec.probing = probing
            if fitting is not None:
                rec.fitting = fitting
            self._cond.notify_all()

    def probed(self, rec: Record, requirements: dict, components: dict, params: dict) -> None:
        with self._cond:
            rec.probing = False
            rec.requirements, rec.components, rec.params = requirements, components, params
            self._cond.notify_all()

    def fitted(self, rec: Record, device_set: frozenset[str], fitted: Fitted) -> None:
        with self._cond:
            rec.fitting = False
            rec.fits.add(device_set, fitted)
            self.bus.publish("fit" if fitted.ok else "no-fit", rec.name, "+".join(sorted(device_set)),
                             n_ctx=fitted.n_ctx, layers=dict(fitted.layers), error=fitted.error)
            self._cond.notify_all()

    # -- workers and kept states ---------------------------------------------------------------

    @property
    def moves(self) -> int:
        """Model state changes so far (read before a reading of a process's usage)."""
        return self._moves

    def set_overhead(self, worker: WorkerHandle, usage: dict[str, int], since: int | None = None) -> None:
        """A worker's own cost on its GPUs: what the device reports for the process minus its
        models' bytes; not where a model loads or unloads there, now or since ``since``."""
        with self._cond:
            records = self._registry.records()
            if since is not None and since != self._moves or any(
                    r.state is not State.LOADED and (r.worker is worker or r.device_set == worker.devices)
                    for r in records if holds_memory(r.state)):
                return  # its bytes would pass for the worker's own
            loaded = [r for r in records if r.worker is worker and r.state is State.LOADED]
            self.workers.learn(worker, {d: max(0, used - sum(r.need.get(d, 0) for r in loaded))
                                        for d, used in usage.items()})
            self._settled_version += 1

    def stop_worker(self, worker: WorkerHandle, reason: str, **data: Any) -> None:
        """An empty worker goes: its bytes stay held until its process ends."""
        with self._cond:
            self.workers.retire(worker)
            self._counters["workers_stopped_idle" if reason == "idle" else "workers_stopped_for_room"] += 1
            self.bus.publish("worker-stopping", "", "+".join(sorted(worker.devices)), reason=reason, pid=worker.pid,
                             **data)

    def worker_stopped(self, worker: WorkerHandle) -> None:
        with self._cond:
            self.workers.stopped(worker)
            self.bus.publish("worker-stopped", "", "+".join(sorted(worker.devices)), pid=worker.pid)
            self._cond.notify_all()

    def spill(self, started: bool) -> None:
        """Kept states start leaving RAM (True), or have left (False)."""
        with self._cond:
            self._spilling = started
            if not started:
                self.bus.publish("spill", "(kept prompt states)", "CPU")
            self._cond.notify_all()

    # -- the live list ---------------------------------------------------------------------------

    def add(self, cfg: ModelConfig, listed: bool = False) -> Record:
        """A new model (ValueError: its name or an alias is taken; ``listed``: Registry.add)."""
        with self._cond:
            rec = self._registry.add(cfg, listed)
            self._cond.notify_all()
            return rec

    def validate(self, configs: list[ModelConfig]) -> None:
        """ValueError unless ``configs`` can stand as the whole list (Registry.validate)."""
        with self._cond:
            self._registry.validate(configs)

    def revive(self, rec: Record, cfg: ModelConfig) -> None:
        with self._cond:
            self._registry.revive(rec, cfg)
            self._cond.notify_all()

    def set_retiring(self, rec: Record, replacement: ModelConfig | None) -> None:
        with self._cond:
            self._registry.set_retiring(rec, replacement)
            self._cond.notify_all()

    def set_fate(self, rec: Record, fate: Fate) -> None:
        with self._cond:
            rec.fate = fate

    def tune(self, rec: Record, cfg: ModelConfig) -> None:
        """``rec``'s config replaced in place (how its requests are scheduled, its aliases)."""
        with self._cond:
            rec.config = cfg
            self._registry.relink()
            self._cond.notify_all()

    def take_out(self, rec: Record) -> Record | None:
        with self._cond:
            new = self._registry.take_out(rec)
            self._cond.notify_all()
            return new

    def add_replica(self, cfg: ModelConfig, primary: Record) -> Record:
        with self._cond:
            return self._registry.add_replica(cfg, primary)

    def drop(self, rec: Record) -> None:
        with self._cond:
            self._registry.drop(rec)
            self._cond.notify_all()

    def event(self, what: str, name: str, **data: Any) -> None:
        with self._cond:
            rec = self._registry.named(name)
            where = "+".join(sorted(rec.device_set)) if rec is not None and rec.device_set else ""
            self.bus.publish(what, name, where, **data)

    def close(self) -> list[WorkerHandle]:
        """No more requests: every model UNLOADED, no lease held; the workers to stop."""
        with self._cond:
            self._closed = True
            workers = self.workers.take_all()
            for r in self._registry.records():
                if r.state is not State.UNLOADED:
                    self.move(r, State.UNLOADED)
                r.leases = 0
            self._cond.notify_all()
            return workers
