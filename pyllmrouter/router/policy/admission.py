"""Admission: one pure function from a snapshot to a decision.

    decide(view, request) ──▶ Admit(device set, bytes, spec, fit)   load it there now
                              Evict(victims)                        unload these idle models first
                              Wait(why, probe?, fit?, drain)        not yet; start a probe or a fit,
                                                                    or let busy models drain
                              Never(device, need, capacity, why)    no state of the router admits it

The scheduler builds the ``View`` (what is available per device, which residents
may be evicted for this request) and the ``Request`` (the model's options per
device set, whether an earlier request goes first) under its lock, calls
``decide`` and carries the decision out in the same critical section.  Nothing
here reads a clock, a device or a lock; placement.py does the arithmetic.

Two figures of what is available (policy/accounting.py): ``available``, what the devices
surely have now (every byte of a load or unload under way counted against it, whatever
part of it free memory shows), and ``hoped``, what they will have once those settle.  A
model is admitted only where it fits ``available``; what to evict, drain or fit for is
weighed against ``hoped``, so bytes in flight never cost a resident its place: a model
that fits only once they settle waits for them (``SETTLING``).  A worker that a load,
probe or fit starts is placed the same way, with its bytes (``Admit.worker``,
``FitJob.worker``, ``Request.probe_worker``: the scheduler reserves them until it runs).

A request's option is a device set with the model's probed bytes there, and the bytes
the set's worker holds before any model (``worker``): the model can ever fit only with
them, is placed with them where its load starts that worker (``starts``), and reserves
its own.  If the
bytes do not fit what the model could be granted there (available now plus what
evictable residents hold) and fitting is on, the option's spec is replaced by a
fit into that grant (from the model's ``Fits``); a grant with no fit yet asks for
one (``Wait.fit``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

from pyllmrouter.router.policy import placement
from pyllmrouter.devices import HOST
from pyllmrouter.router.policy.fitbook import Fits, Fitted, mib
from pyllmrouter.spec import ModelSpec

__all__ = ["Option", "View", "Request", "Admit", "Evict", "Wait", "Never", "FitJob", "decide"]


@dataclass(frozen=True)
class Option:
    """A device set the model may use: its probed bytes there and the spec to load."""

    device_set: frozenset[str]
    need: Mapping[str, int]  # bytes per device (and placement.COUNT when models are counted)
    spec: ModelSpec
    fit_over: tuple[str, ...] = ()  # devices a fit may share the model over (the set's real
    # devices and the host); empty: the spec is loaded as given
    worker: Mapping[str, int] = field(default_factory=dict)  # bytes per device the set's worker
    # holds before any model (never reserved for the model)
    starts: bool = False  # the load starts that worker: placing the model takes its bytes too
    guessed: bool = False  # its worker's bytes are partly a default (none of its kind has run yet)

    @property
    def fitting(self) -> bool:
        return bool(self.fit_over)

    @property
    def overhead(self) -> Mapping[str, int]:
        """What the load adds beside the model's bytes: a worker it starts."""
        return self.worker if self.starts else {}

    def room(self, need: Mapping[str, int], worker: bool = False) -> dict[str, int]:
        """What placing ``need`` (the model's bytes) on this option takes: need + overhead
        (``worker``: with the worker's bytes whether it runs or not: what the device must
        ever hold)."""
        out = dict(need)
        for d, n in (self.worker if worker else self.overhead).items():
            out[d] = out.get(d, 0) + n
        return out


@dataclass(frozen=True)
class View:
    available: Mapping[str, int]  # per device (and placement.COUNT): what our models may surely take now
    capacity: Mapping[str, int]  # per device (and placement.COUNT): the most our models may ever hold
    evictable: tuple[placement.Resident, ...]  # residents, evictable if this request may evict them
    drainable: tuple[placement.Resident, ...]  # residents, evictable if idle and not persistent
    grantable: tuple[placement.Resident, ...]  # as drainable, and those already leaving
    # what they may take once our loads and unloads under way have settled (None: available);
    # the room to evict, drain or fit for: never a shortfall that is only bytes in flight
    hoped: Mapping[str, int] | None = None

    @property
    def settled(self) -> Mapping[str, int]:
        return self.available if self.hoped is None else self.hoped


@dataclass(frozen=True)
class Request:
    name: str
    options: tuple[Option, ...] | None  # None: the model's memory is not measured yet
    fits: Fits
    blocked: bool = False  # an earlier request that could use the same devices goes first
    probing: bool = False  # a probe runs already
    fitting: bool = False  # a fit runs already
    # the worker a probe starts (the model's only device set, where none runs): its bytes
    probe_worker: tuple[frozenset[str], Mapping[str, int]] | None = None
    probe_guessed: bool = False  # its bytes are partly a default (no worker of that kind has run yet)


@dataclass(frozen=True)
class Admit:
    device_set: frozenset[str]
    need: Mapping[str, int]
    spec: ModelSpec
    fit: Fitted | None  # None: the spec as given
    worker: Mapping[str, int] = field(default_factory=dict)  # the worker the load starts: its bytes


@dataclass(frozen=True)
class Evict:
    victims: tuple[str, ...]
    need: Mapping[str, int] = field(default_factory=dict)  # what the model needs where it goes


@dataclass(frozen=True)
class FitJob:
    device_set: frozenset[str]
    spec: ModelSpec
    grant: Mapping[str, int]
    worker: Mapping[str, int] = field(default_factory=dict)  # the worker the fit starts: its bytes


@dataclass(frozen=True)
class Wait:
    why: str
    probe: bool = False  # start measuring the model's memory
    fit: FitJob | None = None  # start this fit
    drain: tuple[str, ...] = ()  # busy models in the way: they take new requests for one turn only
    short: Mapping[str, int] = field(default_factory=dict)  # waiting for memory: bytes missing per device
    worker: Mapping[str, int] = field(default_factory=dict)  # the probe's workers: the bytes to reserve


@dataclass(frozen=True)
class Never:
    device: str
    need: int
    capacity: int
    why: str


Decision = Admit | Evict | Wait | Never


BEHIND = "queued behind earlier requests for the same devices"
SETTLING = "waiting for loads and unloads under way to settle"


def decide(view: View, request: Request) -> Decision:
    if request.blocked:
        return Wait(BEHIND)
    if request.options is None:
        if request.probing:
            return Wait("measuring its memory")
        worker = request.probe_worker
        if worker is not None and request.probe_guessed:  # a guess asks for no more than there can be
            worker = (worker[0], _guess(view, worker[1], {}))
        return _room_for_worker(view, worker) or Wait("measuring its memory", probe=True,
                                                      worker=dict(worker[1]) if worker else {})
    ready, why, never, job = _ready(view, request)
    room = _room_for_worker(view, (job.device_set, job.worker)) if job is not None and job.worker else None
    if room is not None:  # the fit would start its set's worker, which has no room yet: not now
        job = None
    if not ready:
        if why is None and never is not None:
            return never
        return room or Wait(why or "waiting", fit=job)
    # placed with the overhead the load adds (a worker to start); reserved: the model's own bytes
    candidates = [(o.device_set, o.room(o.need)) for o, _ in ready]
    # admitted only where it surely fits now; what to evict or drain, where it would fit once
    # what is under way settles (bytes in flight are never a reason to evict)
    now = placement.choose(candidates, view.available, ())
    plan = now or placement.choose(candidates, view.settled, view.evictable)
    if plan is None:
        idle = placement.choose(candidates, view.settled, view.drainable)
        short = min((placement.shortfall(need, view.settled) for _, need in candidates),
                    key=lambda s: sum(s.values()))
        return Wait("waiting for busy models to finish", fit=job, drain=idle.victims if idle else (), short=short)
    option, fit = next((o, f) for o, f in ready if o.device_set == plan.device_set)
    if plan.victims:
        return Evict(plan.victims, plan.need)
    if now is None:
        return Wait(SETTLING, fit=job)
    return Admit(plan.device_set, dict(option.need), fit.spec if fit else option.spec, fit, dict(option.overhead))


def _guess(view: View, worker: Mapping[str, int], need: Mapping[str, int]) -> dict[str, int]:
    """A worker's guessed bytes (none of its kind has run: starting one is how its cost is
    learned) given at most what ``need`` leaves of the room there can be: available now and
    what the evictable residents hold, within each device's capacity."""
    room = placement.grant(worker, view.available, view.evictable)
    return {d: min(n, max(0, min(room.get(d, 0), view.capacity.get(d, 0)) - need.get(d, 0)))
            for d, n in worker.items()}


def _room_for_worker(view: View, worker: tuple[frozenset[str], Mapping[str, int]] | None) -> Decision | None:
    """None where the worker a probe or fit starts (device set, bytes) fits now (or none
    starts); else evict idle residents for it, or wait."""
    if not worker or not worker[1]:
        return None
    worst = placement.never_fits(worker[1], view.capacity)
    if worst is not None:
        return Never(worst.device, worst.need, worst.capacity,
                     f"its worker's own {worst.need} bytes on {worst.device} pass the {worst.capacity} bytes it can "
                     f"ever hold for models")
    candidates = [(worker[0], worker[1])]
    if placement.choose(candidates, view.available, ()) is not None:
        return None
    plan = placement.choose(candidates, view.settled, view.evictable)
    if plan is None:  # busy models in the way take new requests for one turn, as for a model's own bytes
        idle = placement.choose(candidates, view.settled, view.drainable)
        return Wait("waiting for room for its worker", drain=idle.victims if idle else (),
                    short=placement.shortfall(worker[1], view.settled))
    return Evict(plan.victims, plan.need) if plan.victims else Wait(SETTLING)


def _ready(view: View, request: Request):
    """The options that can be placed now, each as (option with the bytes to place, its
    fit or None); why the others cannot yet; the first that can never be admitted; and a
    fit to start."""
    ready: list[tuple[Option, Fitted | None]] = []
    why: str | None = None
    never: Never | None = None
    job: FitJob | None = None
    for option in request.options or ():
        if option.guessed:  # a guess never makes a model never fit: at most the room the model leaves
            option = replace(option, worker=_guess(view, option.worker, option.need))
        worst = placement.never_fits(option.room(option.need, worker=True), view.capacity)
        if worst is not None and (worst.device == placement.COUNT or not option.fitting):
            # the message names the candidate closest to fitting (the biggest device)
            if never is None or worst.capacity - worst.need > never.capacity - never.need:
                beside = option.worker.get(worst.device, 0)
                detail = str(worst) + (f", its worker's own {beside} bytes there included" if beside else "")
                never = Never(worst.device, worst.need, worst.capacity, detail)
            continue
        bytes_ = {d: n for d, n in option.need.items() if d != placement.COUNT}
        grant = placement.grant(option.fit_over, view.settled, view.grantable) if option.fitting else {}
        grant = {d: n - option.overhead.get(d, 0) for d, n in grant.items()}  # the worker's bytes are not the model's
        if not option.fitting or not placement.shortfall(bytes_, grant):
            ready.append((option, None))
            continue
        fitted = request.fits.lookup(option.device_set, grant)
        if fitted is not None and not fitted.ok:  # no fit now: with nothing else held?
            most = {d: view.capacity.get(d, 0) - option.worker.get(d, 0) for d in grant}
            if grant != most:
                fitted, grant = request.fits.lookup(option.device_set, most), most
                if fitted is not None and fitted.ok:
                    why = why or "waiting for memory that models which cannot be evicted hold"
                    continue
        if fitted is None:
            if not request.fitting and job is None:
                job = FitJob(option.device_set, option.spec, grant, dict(option.overhead))
            why = why or "fitting into its grant"
            continue
        if not fitted.ok:
            never = never or Never(HOST, sum(bytes_.values()), sum(grant.values()),
                                   f"no fit into {mib(grant)}: {fitted.error}")
            continue
        need = dict(fitted.need)
        if placement.COUNT in option.need:
            need[placement.COUNT] = option.need[placement.COUNT]
        ready.append((Option(option.device_set, need, fitted.spec, option.fit_over, option.worker, option.starts),
                      fitted))
    return ready, why, never, job
