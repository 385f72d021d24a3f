"""The scheduler: decides who is served, what loads where, and what gives way.

    lease(name) ──▶ ticket joins the FIFO queue ──▶ until LOADED and it may lease:
        read free memory (inventory, outside the lock)
        under the Book's lock: admission.decide(view, request)      (pure)
            Admit  ──▶ LOADING + reservation ──▶ background load (jobs.py)
            Evict  ──▶ victims UNLOADING ──▶ background unloads
            Wait   ──▶ maybe a background probe or fit; busy models in the way drain
            Never  ──▶ NeverFits (at once)
        wait on the Book's condition
    LOADED ──▶ a Lease (Book.take);  release(lease) ──▶ the model's next step (roster.settle)

    add_model / remove_model / replace_model / reconcile ──▶ the live list (roster.py)
    a model with replicas = N: a request goes to one of its instances (replicas.pick),
        and one more loads where its requests wait (roster.grow)
    a lease whose worker follows the client's connection (reads its next requests itself)
        lasts as long as they come: Book.end_follows gives the connection back where the
        model's requests must be seen here again (unload, retirement, drain, a new instance)

The state (records, queue, condition, events, counters, workers) is the Book's
(book.py): the scheduler reads it and changes it through the Book's methods, holding
its lock across a decision and the changes it implies, so no other thread acts on a
stale check.  Nothing does I/O under it: free memory is read before the lock is taken;
probes, worker starts, loads and unloads run in background threads (jobs.py).
Deciding is pure (policy/: admission, placement, queueing, replicas; registry.step).

FIFO: a ticket may start a load only if no earlier ticket that also waits for
a load could use one of the same devices.  Requests for a LOADED model go
ahead, except for a model being drained for an earlier waiter: it takes new
requests only for ``turn`` seconds, then finishes what it has and is evicted.
Two models that cannot be co-resident are thus served in turns, not per
request.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

from pyllmrouter.config import ModelConfig, RouterOptions
from pyllmrouter.devices import HOST, Inventory
from pyllmrouter.errors import (LoadFailed, NeverFits, NotLoaded, QueueFull, QueueTimeout, RouterClosed, UnknownModel,
                                Withdrawn)
from pyllmrouter.router import report
from pyllmrouter.router.book import HISTORY, Book, capacity
from pyllmrouter.router.jobs import Jobs
from pyllmrouter.router.policy import admission, placement, queueing, replicas
from pyllmrouter.router.policy.fitbook import fit_over
from pyllmrouter.router.policy.state import State, evictable, holds_memory
from pyllmrouter.router.records import Fate, Lease, Record, Ticket
from pyllmrouter.router.registry import tuned_only
from pyllmrouter.router.roster import Roster
from pyllmrouter.router.workers.costs import WorkerCosts
from pyllmrouter.router.workers.keep import KeepStore
from pyllmrouter.router.workers.measure import Measurer, worker_spec
from pyllmrouter.router.workers.handle import START_TIMEOUT, Launch, WorkerHandle
from pyllmrouter.router.workers.sets import WORKER, WorkerSet

__all__ = ["Scheduler", "Record", "Lease", "KEPT"]

KEPT = "(kept prompt states)"  # a resident that holds host memory: the kept states in RAM
_FIRST_TO_GO = -1e300  # an idle extra instance's place in the eviction order: after empty workers, before models


def budget_note(budget: int | None) -> str:
    return f", budget {budget / 2**20:.0f} MiB" if budget is not None else ""


class Scheduler:
    def __init__(self, models: list[ModelConfig], inventory: Inventory, options: RouterOptions,
                 launch: Launch = WorkerHandle, costs: WorkerCosts | None = None):
        """``launch``: makes a worker's handle (a process of ours; the tests' simulated
        world passes its own); ``costs``: a worker's bytes before it runs (costs.py)."""
        self.options = options
        self.inventory = inventory
        devices = {d.name: d for d in inventory.devices()}
        unusable = [f"{d.name} ({d.total / 2**20:.0f} MiB{budget_note(options.budgets.get(d.name))}) can hold "
                    f"{capacity(d, options) / 2**20:.0f} MiB for models with a margin of "
                    f"{options.margin / 2**20:.0f} MiB" for d in devices.values() if capacity(d, options) <= 0]
        if unusable:  # no request could ever be served there: say so now, not at each request
            raise ValueError("devices that can hold nothing: " + "; ".join(unusable) +
                             " (a smaller margin, --models-memory-margin MiB, or a larger budget or device)")
        ram = options.kv_keep_ram
        if ram is None:
            ram = inventory.free().get(HOST, 0) // 8
        keep = KeepStore(ram, options.kv_keep_dir, options.kv_keep_disk) if ram > 0 else None
        self._book = book = Book(devices, options, lambda cond: WorkerSet(inventory, cond, self._on_worker_death,
                                                                          self._worker_started, launch, costs), keep)
        for m in models:
            book.add(m)
        measure = Measurer(inventory, options.load_timeout, book.workers.running_for, book.workers.ensure,
                           book.hosts_models, launch)
        self._jobs = Jobs(book, measure, inventory, options, settle=lambda rec: self._roster.settle(rec),
                          reap=self.reap_workers)
        self._roster = Roster(book, self._jobs, self._load_instance)

    # -- what others read --------------------------------------------------------------

    @property
    def bus(self):
        """What the router did, kept and pushed to listeners (services/events.py)."""
        return self._book.bus

    @property
    def book(self) -> Book:
        """The scheduler's state, and its one owner (book.py)."""
        return self._book

    @property
    def jobs(self) -> Jobs:
        """The scheduler's background half (jobs.py)."""
        return self._jobs

    @property
    def workers(self) -> WorkerSet:
        return self._book.workers

    @property
    def keep(self) -> KeepStore | None:
        """The store of prompt states kept across eviction (None: keeping is off)."""
        return self._book.keep

    @property
    def counters(self) -> dict[str, int]:
        return self._book.counters()

    @property
    def on_wait(self):
        return self._book.on_wait

    @on_wait.setter
    def on_wait(self, fn) -> None:
        """Called as on_wait(model, seconds) for every lease (metrics)."""
        self._book.on_wait = fn

    @property
    def events(self) -> list[tuple[float, str, str, str]]:
        """What happened to the models lately, as (time, event, model, devices) (book.HISTORY)."""
        return [(e.t, e.event, e.model, e.devices) for e in self._book.bus.recent() if e.event in HISTORY]

    def resolve(self, name: str) -> Record:
        return self._book.resolve(name)

    def canonical(self, name: str) -> str | None:
        """The listed model ``name`` (or an alias) is (None: none is)."""
        rec = self._book.get(name)
        return rec.name if rec is not None else None

    def records(self) -> list[Record]:
        return self._book.records()

    def configs(self) -> dict[str, ModelConfig]:
        """Every model's config, as it will be (a changed model's new one)."""
        return self._book.configs()

    def check_invariant(self) -> dict[str, int]:
        """Bytes held per device; raises if any device holds more than its capacity."""
        book = self._book
        with book.locked():
            held = book.held()
            for d, n in held.items():
                if d == placement.COUNT:
                    if self.options.max_models and n > self.options.max_models:
                        raise AssertionError(f"{n} models held, limit {self.options.max_models}")
                elif n > book.capacity(d):
                    raise AssertionError(f"{d}: {n} bytes held > capacity {book.capacity(d)}")
            return held

    def status(self) -> dict[str, Any]:
        """Every model, device and worker as plain values (report.py)."""
        return report.status(self._book, self.inventory)

    # -- leases ----------------------------------------------------------------------------

    def lease(self, name: str, timeout: float | None = None, autoload: bool | None = None,
              gone=None, prefer: str | None = None, loader: bool = False, waited: float = 0.0,
              slot: bool = False) -> Lease:
        """Block until ``name`` is LOADED and take a lease on it.  Once ``gone`` is set
        (``withdraw``) the wait ends with Withdrawn: the ticket leaves the queue, and what
        it alone asked for (a load, a drain of a busy model) does not happen.  ``prefer``:
        the instance of the model to take where it has a free slot (a conversation's last).
        ``loader``: the lease that loads the instance ``name`` itself (roster.grow): no
        queue limit refuses or counts it, it drains nothing, and ``timeout`` bounds its
        wait for room; once admitted, a new worker's start and the load bound it (their
        own timeouts, START_TIMEOUT and ``load_timeout``).  ``waited``: seconds the
        request waited on another node before (it keeps its place in line: Book.enqueue);
        ``slot``: the lease is taken only with one of the instance's slots free, in the
        order such requests came (the request runs at once, never queued in its engine:
        a cluster's node says so before it runs, ray/ledger.py); a wait for a slot of the
        loaded model has no limit (as a wait in its engine's queue), and may start another
        instance of it (``replicas``); ``timeout`` counts from now."""
        book = self._book
        timeout = self.options.queue_timeout if timeout is None else timeout
        autoload = self.options.autoload if autoload is None else autoload
        with book.locked():
            if book.closed:
                raise RouterClosed("router is closed")
            rec = book.resolve(name)
            if rec.state is not State.LOADED and not autoload:
                raise NotLoaded(rec.name, rec.state.value)
            refused = None if loader else self._queue_refusal(rec)
            if refused is not None:
                raise QueueFull(rec.name, refused.scope, refused.limit, refused.waiting)
            ticket = book.enqueue(rec, loader, waited, name, slot)
        try:
            return self._wait_for(ticket, timeout, autoload, gone, prefer, slot)
        finally:
            book.dequeue(ticket)
            if ticket.rec.primary is not None:  # an extra instance nobody waits for any more goes
                self._roster.settle(ticket.rec)

    def _wait_for(self, ticket: Ticket, timeout: float, autoload: bool, gone, prefer: str | None, slot: bool) -> Lease:
        """``lease``'s wait, its ticket queued: a lease once one may be taken, a load (or an
        eviction, a drain) admitted meanwhile where the ticket's turn has come."""
        book = self._book
        deadline = time.monotonic() + timeout
        reading: tuple[Any, dict[str, int]] | None = None  # (the Book's mark, free memory), since the last wait
        loading_until: float | None = None  # a loader's: once its instance was admitted (LOADING)
        while True:
            with book.locked():
                rec = book.follow(ticket)
                if book.closed:
                    raise RouterClosed("router is closed")
                if gone is not None and gone.is_set():
                    raise Withdrawn(rec.name)
                if rec.error_epoch > ticket.epoch:
                    raise LoadFailed(rec.name, rec.reason or "unknown reason")
                ready = self._ready_instance(rec, ticket, prefer, slot) if rec.fate is None else None
                if ready is not None and slot and book.first_waiting(ticket.rec, slot=True) is not ticket:
                    ready = None  # one waits for a slot before it: in the order they came
                if ready is not None:
                    return self._take(ready, ticket)
                to_load = rec.fate is None and rec.state is State.UNLOADED
                if to_load and not autoload:  # it was unloaded while this request waited
                    raise NotLoaded(rec.name, rec.state.value)
                # a later request of a model waiting for its load waits behind the first
                # (admission would say so): no reading of free memory, no view of the devices
                behind = to_load and book.first_waiting(rec) is not ticket
                # a reading taken before bytes settled may not show them allocated: read again
                stale = to_load and not behind and (reading is None or reading[0] != book.mark())
                if stale and reading is not None and time.monotonic() > deadline:  # bytes settling all along
                    raise QueueTimeout(rec.name, timeout, ticket.why or "waiting")
                if not stale:
                    why = "waiting" if rec.fate is None else "waiting for its new configuration"
                    if to_load:
                        why = admission.BEHIND if behind else self._admit(rec, ticket, reading[1])
                    # for a free slot of the loaded model: its engine's queue kept here, with no
                    # limit in time (as the engine's); another instance where it may have one
                    for_slot = slot and not to_load and rec.fate is None and rec.state is State.LOADED
                    if for_slot:
                        why, deadline = "waiting for a free slot", time.monotonic() + timeout
                        self._roster.grow(rec.primary or rec, arriving=1)
                    book.note(ticket, why)
                    if ticket.loader and rec.state is State.LOADING:  # admitted: its worker's start and load bound it
                        if loading_until is None:
                            loading_until = time.monotonic() + START_TIMEOUT + self.options.load_timeout
                        deadline = max(deadline, loading_until)
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise QueueTimeout(rec.name, timeout, why)
                    book.wait(min(remaining, 0.25))
                    reading = None
            if stale:  # I/O, only when admission needs it: never under the lock
                reading = self.read_free()

    def read_free(self) -> tuple[Any, dict[str, int]]:
        """The inventory's free memory and the Book's mark taken just before it (no lock
        held: it reads /proc and NVML); a decision uses it only while the mark stands."""
        mark = self._book.mark()
        return mark, self.inventory.free()

    def withdraw(self, gone) -> None:
        """The caller of a waiting ``lease(..., gone=gone)`` has left: end its wait now."""
        gone.set()
        self._book.notify()

    def try_lease(self, name: str, prefer: str | None = None, slot: bool = False) -> Lease | None:
        """A lease on ``name`` if it can be taken at once (LOADED, not draining for an earlier
        waiter, not retiring; ``slot``: as ``lease``), else None; never waits nor loads."""
        book = self._book
        with book.locked():
            rec = book.resolve(name)
            if book.closed or rec.fate is not None:
                return None
            if self._queue_refusal(rec) is not None:
                return None  # lease() says which limit
            if slot and book.first_waiting(rec, slot=True) is not None:
                return None  # behind those waiting for a slot
            ticket = book.ticket(rec)
            ready = self._ready_instance(rec, ticket, prefer, slot)
            return self._take(ready, ticket) if ready is not None else None

    def _load_instance(self, rec: Record) -> None:
        """An instance loads by a lease of its own, in the background (jobs.replicate)."""
        self._jobs.spawn(self._jobs.replicate, rec,
                         lambda: self.lease(rec.name, self.options.turn, autoload=True, loader=True), self.release)

    def _take(self, rec: Record, ticket: Ticket) -> Lease:
        """A lease, taken last: what may fail before it (growing the model) has not failed."""
        if not ticket.loader:
            self._roster.grow(rec.primary or rec, arriving=1)
        return self._book.take(rec, ticket)

    def _ready_instance(self, rec: Record, ticket: Ticket, prefer: str | None = None,
                        slot: bool = False) -> Record | None:
        """The loaded instance of ``rec``'s model a request goes to (lock held): ``prefer``
        where it is one with a free slot (the instance that served the conversation last:
        its prompt is in that engine's cache), else the fewest in flight; None where none
        can take it now (``slot``: none has a slot free).  An extra instance's name (a
        resumable stream's owner) is that instance alone."""
        book = self._book
        candidates = [rec] if rec.primary is not None or ticket.loader else book.instances(rec)
        ready = {r.name: r for r in candidates  # (a worker dead but not yet seen to be: none)
                 if r.state is State.LOADED and r.fate is None and not r.gone and self._may_lease(r, ticket)
                 and (not slot or r.leases < r.slots()) and not r.worker.exited()}
        last = ready.get(prefer) if prefer is not None else None
        if last is not None and last.leases < last.slots():
            return last
        name = replicas.pick([replicas.Instance(r.name, r.leases, r.slots(), r.primary is None)
                              for r in ready.values()])
        return ready.get(name) if name is not None else None

    def release(self, lease: Lease) -> None:
        book = self._book
        with book.locked():
            self._roster.settle(book.release(lease))
            book.notify()

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
        waiter = next((t for t in self._book.tickets() if t.seq == waiter_seq), None)
        return waiter is None or self._book.rank(ticket) < self._book.rank(waiter)

    def _queue_refusal(self, rec: Record) -> "queueing.Refusal | None":
        """The limit one more request of ``rec``'s model (all its instances) would cross,
        if any (lock held).  Requests holding no slot: queued here, or past a model's slots
        (queueing.tally: an instance's own load is none)."""
        if not (rec.config.max_queue or self.options.max_queue):
            return None
        book = self._book
        queued = [queueing.Queued(t.rec.name, t.loader) for t in book.tickets()]
        held = [queueing.Held(r.name, (r.primary or r).name, r.leases, r.slots(), r.state is State.LOADED)
                for r in book.records()]
        mine, total = queueing.tally((rec.primary or rec).name, queued, held)
        return queueing.refusal(mine, rec.config.max_queue, total, self.options.max_queue)

    # -- the live model list (roster.py) ------------------------------------------------

    def add_model(self, cfg: ModelConfig) -> None:
        """A new model, servable at once (ValueError: its name or an alias is taken)."""
        self._roster.add(cfg)

    def remove_model(self, name: str) -> None:
        """``name`` takes no new request, finishes those in flight, unloads and goes."""
        with self._book.locked():
            self._roster.retire(self._book.resolve(name), None)

    def replace_model(self, cfg: ModelConfig) -> None:
        """``cfg`` replaces the model of its name once that one has finished its requests
        and unloaded; requests that come meanwhile wait for the new config."""
        book = self._book
        with book.locked():
            rec = book.named(cfg.name)
            if rec is None or rec.fate is Fate.REMOVE or rec.primary is not None:
                raise UnknownModel(cfg.name, list(book.configs()))
            if (rec.replacement or rec.config) != cfg:
                book.validate([*(c for n, c in book.configs().items() if n != cfg.name), cfg])
                if rec.fate is None and tuned_only(rec.config, cfg):  # scheduling or aliases alone: in place
                    self._roster.tune(rec, cfg)
                else:
                    self._roster.retire(rec, cfg)

    def reconcile(self, configs: Iterable[ModelConfig]) -> dict[str, list[str]]:
        """Make the list the sources' new one (models added through the API stay): new
        names added, changed configs replaced (or tuned in place), names gone removed.
        Each change is checked first, so a bad list changes nothing (ValueError)."""
        with self._book.locked():
            changes = self._roster.reconcile(configs)
            self._book.event("models_reload", "*")
            self._book.notify()
        return {"added": [c.name for c in changes.add], "removed": list(changes.remove),
                "changed": [c.name for c in (*changes.replace, *changes.tune)]}

    # -- admission (the Book's lock held) ------------------------------------------------------

    def _earlier_loader_blocks(self, rec: Record, ticket: Ticket) -> bool:
        """Whether a request ranked before this one (priority, then FIFO) waits for a load that
        could use one of the same devices: it goes first."""
        book = self._book
        mine = set().union(*book.candidates(rec))
        now = time.monotonic()
        me = book.rank(ticket, now)
        for t in book.tickets():
            if t is ticket or book.rank(t, now) >= me:
                continue
            other = t.rec
            if other is rec:
                return True  # an earlier ticket of the same model drives its load
            if other.state is State.UNLOADED and not other.gone and mine & set().union(*book.candidates(other)):
                return True
        return False

    def _admit(self, rec: Record, ticket: Ticket, free: dict[str, int]) -> str:
        """Move ``rec`` towards LOADING if it is this ticket's turn; say why not.
        ``free`` is the inventory's reading, taken before the lock."""
        book = self._book
        available = book.available(free)
        request = self._request(rec, ticket)
        decision = admission.decide(self._view(ticket, available, book.available(free, hoped=True)), request)
        if isinstance(decision, admission.Never):
            book.failed(rec, decision.why)
            raise NeverFits(rec.name, decision.device, decision.need, decision.capacity, decision.why)
        if isinstance(decision, admission.Evict):
            short = placement.shortfall(decision.need, available)
            for v in decision.victims:
                if v == KEPT:
                    book.spill(True)
                    self._jobs.spawn(self._jobs.spill)
                elif v.startswith(WORKER):
                    self._jobs.stop_worker(book.workers.by_name(v), "room", newcomer=rec.name)
                else:
                    victim = book.named(v)
                    book.event("evicted", v, newcomer=rec.name, bytes=dict(victim.need),
                               short={d: n for d, n in short.items() if victim.need.get(d, 0) > 0})
                    self._jobs.unload_now(victim, evicted=True)
            return "evicting idle models"
        if isinstance(decision, admission.Wait):
            if decision.probe:
                book.measuring(rec, probing=True)
                token = book.workers.reserve(request.probe_worker[0], decision.worker) if request.probe_worker else None
                self._jobs.spawn(self._jobs.probe, rec, token)  # its worker's bytes held until it runs
            if decision.fit is not None:
                book.measuring(rec, fitting=True)
                job = decision.fit
                token = book.workers.reserve(job.device_set, dict(job.worker))
                self._jobs.spawn(self._jobs.fit, rec, job.device_set, job.spec, dict(job.grant), token)
            deadline = ticket.created + self.options.turn
            for v in (decision.drain if rec.primary is None and not ticket.loader else ()):  # an instance's load drains nothing
                victim = book.named(v)
                if victim is None:  # an empty worker or the kept states: nothing to drain, they go when evicted
                    continue
                owner = next((t for t in book.tickets() if victim.drain and t.seq == victim.drain[1]), None)
                if victim.drain is None or owner is None or book.rank(ticket) < book.rank(owner):
                    book.drain(victim, deadline, ticket.seq)
                    book.end_follows(victim, deadline)
            if decision.short and decision.short != ticket.short:
                book.note(ticket, ticket.why, decision.short)
                book.event("waiting", rec.name, why=decision.why, short=dict(decision.short))
            return decision.why
        attempt = book.start_load(rec, decision.device_set, decision.need, decision.spec, decision.fit)
        token = book.workers.reserve(decision.device_set, dict(decision.worker))  # the worker it starts, held until it runs
        self._jobs.spawn(self._jobs.load, rec, attempt, decision.device_set, token)
        return "loading"

    def _residents(self, ticket: Ticket, ignore_busy: bool = False, leaving: bool = False) -> list[placement.Resident]:
        """Models holding memory; evictable only if idle and no earlier request waits for them
        (``ignore_busy``: if not persistent; ``leaving``: models already unloading count too).
        Empty workers too: evictable, before any model; with ``leaving``, the ones stopping."""
        book = self._book
        # a request ranked before this one that may take a lease keeps its model (one blocked by
        # a drain does not)
        now = time.monotonic()
        me = book.rank(ticket, now)
        awaited = {t.rec.name for t in book.tickets() if book.rank(t, now) < me and self._may_lease(t.rec, t)}
        residents = [
            placement.Resident(
                r.name, r.need, r.last_used if r.primary is None else _FIRST_TO_GO,
                (leaving and r.state is State.UNLOADING)
                or (evictable(r.state, 0, r.config.persistent) if ignore_busy
                    else evictable(r.state, r.leases, r.config.persistent) and r.name not in awaited),
            )
            for r in book.records() if holds_memory(r.state)
        ]
        residents = placement.with_shares(residents, book.workers.owners(book.records(), book.candidates(ticket.rec)))
        # the states written in RAM: a reservation for an unload's states is that unload's, not
        # something a spill can free (counted there, a spill freed nothing and admission asked again)
        kept = book.keep.kept_ram() if book.keep is not None else 0
        if kept:  # kept prompt states give way first (spilled to disk or dropped), before any model
            residents.append(placement.Resident(KEPT, {HOST: kept}, float("-inf"), not book.spilling))
        book.workers.note(book.busy_sets(), time.monotonic())  # the reaper's view (any waiting request)
        residents += [book.workers.resident(w, book.workers.empty(w, book.busy_sets(ticket))) for w in book.workers.running()]
        residents += [book.workers.resident(w, leaving) for w in book.workers.stopping()]  # their bytes go soon
        return residents

    def _view(self, ticket: Ticket, available: dict[str, int], hoped: dict[str, int]) -> admission.View:
        capacity = {d: self._book.capacity(d) for d in self._book.devices}
        if self.options.max_models:
            capacity[placement.COUNT] = self.options.max_models
        return admission.View(available, capacity, tuple(self._residents(ticket)),
                              tuple(self._residents(ticket, ignore_busy=True)),
                              tuple(self._residents(ticket, ignore_busy=True, leaving=True)), hoped)

    def _request(self, rec: Record, ticket: Ticket) -> admission.Request:
        options, probe_worker, workers = None, None, self._book.workers
        if rec.requirements is None:
            probe_worker = workers.probe_cost(self._book.candidates(rec), self._book.hosts_models, rec.name)
        else:
            options = []
            for ds in self._book.candidates(rec):
                local = self.inventory.to_local(ds)  # a fit can only move bytes off real devices
                spec = worker_spec(rec.config.spec, ds, local)
                worker, starts = workers.overhead_of(ds)
                options.append(admission.Option(ds, rec.requirements[ds], spec, fit_over(ds, local, rec.params[ds]),
                                                worker, starts, starts and workers.costs.guessed(ds)))
            options = tuple(options)
        return admission.Request(rec.name, options, rec.fits, self._earlier_loader_blocks(rec, ticket),
                                 rec.probing, rec.fitting, probe_worker,
                                 any(workers.costs.guessed(ds) for ds in self._book.candidates(rec)))

    # -- workers ----------------------------------------------------------------------------------

    def end_all_follows(self) -> None:
        """Every follow of every model ends after its request (a server shutting down: the
        connections come back to it, and close)."""
        self._book.end_all_follows()

    def reap_workers(self) -> list[WorkerHandle]:
        """Stop the workers empty for longer than the idle timeout (0: at once; -1: never)."""
        book = self._book
        timeout = self.options.worker_idle_timeout
        with book.locked():
            book.workers.note(book.busy_sets(), time.monotonic())
            if timeout < 0 or book.closed:
                return []
            gone = [w for w, idle in book.workers.idle(time.monotonic()).items() if idle >= timeout]
            for w in gone:
                self._jobs.stop_worker(w, "idle")
            return gone

    def _worker_started(self, worker: WorkerHandle) -> None:
        self._jobs.refresh_overhead(worker)  # its GPU context counts from now on
        self._book.bus.publish("worker-started", "", "+".join(sorted(worker.devices)), pid=worker.pid)

    def _on_worker_death(self, worker: WorkerHandle) -> None:
        book = self._book
        with book.locked():
            for r in book.worker_died(worker):
                self._roster.settle(r)
            book.notify()

    def measure(self, name: str) -> None:
        """Probe ``name``'s bytes now (no load), unless measured, being measured, or the workers
        it starts (reserved until they run) do not fit now: a request's admission probes then."""
        book = self._book
        free = self.read_free()
        with book.locked():
            rec = book.resolve(name)
            if rec.requirements is not None or rec.probing:
                return
            worker = self._request(rec, book.ticket(rec)).probe_worker
            if worker is not None and (free[0] != book.mark() or placement.shortfall(worker[1], book.available(free[1]))):
                return
            book.measuring(rec, probing=True)
            token = book.workers.reserve(*worker) if worker is not None else None
        self._jobs.probe(rec, token)

    # -- explicit control -----------------------------------------------------------------------

    def unload(self, name: str, wait: float | None = 30.0) -> bool:
        """Unload ``name`` once idle (waits for in-flight requests). False if not loaded."""
        book = self._book
        deadline = time.monotonic() + (wait or 0)
        with book.locked():
            rec = book.resolve(name)
            book.ask_unload(rec, rec.state is State.LOADED)  # its requests now wait for the unload, then load it again
            book.end_follows(rec)
            try:
                while rec.state is State.LOADED and rec.leases > 0 and time.monotonic() < deadline:
                    book.wait(0.1)
            finally:
                book.ask_unload(rec, False)
            if rec.state is not State.LOADED or rec.leases > 0:
                return False
            self._jobs.unload_now(rec)
            while wait and rec.state is State.UNLOADING and time.monotonic() < deadline:
                book.wait(0.1)
            return True

    def keep_alive(self, name: str, seconds: float | None) -> str:
        """``name``'s idle time from now on (Ollama's keep_alive): ``seconds`` (0: unloaded
        once idle; below 0: never for idleness), None: its config's ttl again.  Only when it
        goes idle changes: admission and eviction stay as they are.  Its record's name."""
        with self._book.locked():
            rec = self._book.resolve(name)
            self._book.keep_alive(rec.primary or rec, seconds)
            return rec.name

    def reap_idle(self) -> list[str]:
        """Unload models idle longer than their ttl; returns their names."""
        now = time.monotonic()
        out = []
        with self._book.locked():
            for r in self._book.records():
                ttl = r.ttl()
                if ttl is not None and evictable(r.state, r.leases, False) and now - r.last_used > ttl:
                    self._jobs.unload_now(r)
                    out.append(r.name)
        return out

    def close(self) -> None:
        for w in self._book.close():
            w.stop()
        self._jobs.join(5)
        if self._book.keep is not None:
            self._book.keep.close()
