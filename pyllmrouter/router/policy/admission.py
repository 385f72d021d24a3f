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

from dataclasses import dataclass, field
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
    available: Mapping[str, int]  # per device (and placement.COUNT): what our models may still take
    capacity: Mapping[str, int]  # per device (and placement.COUNT): the most our models may ever hold
    evictable: tuple[placement.Resident, ...]  # residents, evictable if this request may evict them
    drainable: tuple[placement.Resident, ...]  # residents, evictable if idle and not persistent
    grantable: tuple[placement.Resident, ...]  # as drainable, and those already leaving


@dataclass(frozen=True)
class Request:
    name: str
    options: tuple[Option, ...] | None  # None: the model's memory is not measured yet
    fits: Fits
    blocked: bool = False  # an earlier request that could use the same devices goes first
    probing: bool = False  # a probe runs already
    fitting: bool = False  # a fit runs already


@dataclass(frozen=True)
class Admit:
    device_set: frozenset[str]
    need: Mapping[str, int]
    spec: ModelSpec
    fit: Fitted | None  # None: the spec as given


@dataclass(frozen=True)
class Evict:
    victims: tuple[str, ...]
    need: Mapping[str, int] = field(default_factory=dict)  # what the model needs where it goes


@dataclass(frozen=True)
class FitJob:
    device_set: frozenset[str]
    spec: ModelSpec
    grant: Mapping[str, int]


@dataclass(frozen=True)
class Wait:
    why: str
    probe: bool = False  # start measuring the model's memory
    fit: FitJob | None = None  # start this fit
    drain: tuple[str, ...] = ()  # busy models in the way: they take new requests for one turn only
    short: Mapping[str, int] = field(default_factory=dict)  # waiting for memory: bytes missing per device


@dataclass(frozen=True)
class Never:
    device: str
    need: int
    capacity: int
    why: str


Decision = Admit | Evict | Wait | Never


BEHIND = "queued behind earlier requests for the same devices"


def decide(view: View, request: Request) -> Decision:
    if request.blocked:
        return Wait(BEHIND)
    if request.options is None:
        return Wait("measuring its memory", probe=not request.probing)
    ready, why, never, job = _ready(view, request)
    if not ready:
        if why is None and never is not None:
            return never
        return Wait(why or "waiting", fit=job)
    # placed with the overhead the load adds (a worker to start); reserved: the model's own bytes
    candidates = [(o.device_set, o.room(o.need)) for o, _ in ready]
    plan = placement.choose(candidates, view.available, view.evictable)
    if plan is None:
        idle = placement.choose(candidates, view.available, view.drainable)
        short = min((placement.shortfall(need, view.available) for _, need in candidates),
                    key=lambda s: sum(s.values()))
        return Wait("waiting for busy models to finish", fit=job, drain=idle.victims if idle else (), short=short)
    option, fit = next((o, f) for o, f in ready if o.device_set == plan.device_set)
    if plan.victims:
        return Evict(plan.victims, plan.need)
    return Admit(plan.device_set, dict(option.need), fit.spec if fit else option.spec, fit)


def _ready(view: View, request: Request):
    """The options that can be placed now, each as (option with the bytes to place, its
    fit or None); why the others cannot yet; the first that can never be admitted; and a
    fit to start."""
    ready: list[tuple[Option, Fitted | None]] = []
    why: str | None = None
    never: Never | None = None
    job: FitJob | None = None
    for option in request.options or ():
        worst = placement.never_fits(option.room(option.need, worker=True), view.capacity)
        if worst is not None and (worst.device == placement.COUNT or not option.fitting):
            # the message names the candidate closest to fitting (the biggest device)
            if never is None or worst.capacity - worst.need > never.capacity - never.need:
                beside = option.worker.get(worst.device, 0)
                detail = str(worst) + (f", its worker's own {beside} bytes there included" if beside else "")
                never = Never(worst.device, worst.need, worst.capacity, detail)
            continue
        bytes_ = {d: n for d, n in option.need.items() if d != placement.COUNT}
        grant = placement.grant(option.fit_over, view.available, view.grantable) if option.fitting else {}
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
                job = FitJob(option.device_set, option.spec, grant)
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
