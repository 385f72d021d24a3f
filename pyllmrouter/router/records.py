"""The scheduler's records: what it knows of each model, what a request holds (a
Lease), and what a waiting request is (a Ticket).  Records change only under the
scheduler's lock, and a model's state only through ``Book.move``."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pyllmrouter.config import ModelConfig
from pyllmrouter.router.policy.fitbook import Fits, Fitted
from pyllmrouter.router.workers.handle import WorkerHandle
from pyllmrouter.router.policy.placement import COUNT
from pyllmrouter.router.policy.state import State, holds_memory
from pyllmrouter.spec import ModelSpec

__all__ = ["Record", "Lease", "Ticket", "Fate"]


class Fate(enum.Enum):
    """What happens to a model removed from, or changed in, the live model list."""

    REMOVE = "remove"
    REPLACE = "replace"


@dataclass(eq=False)
class Record:
    """The router's view of one model (guarded by the scheduler lock)."""

    config: ModelConfig
    state: State = State.UNLOADED
    leases: int = 0
    last_used: float = 0.0
    device_set: frozenset[str] | None = None
    need: dict[str, int] = field(default_factory=dict)  # reserved bytes per device (+ COUNT)
    worker: WorkerHandle | None = None
    reason: str | None = None  # why it is UNLOADED (failed load, dead worker)
    requirements: dict[frozenset[str], dict[str, int]] | None = None
    components: dict[frozenset[str], dict[str, dict]] = field(default_factory=dict)  # per pool, as probed
    params: dict[frozenset[str], dict] = field(default_factory=dict)  # llama-server's reading of the spec, as probed
    fits: Fits = field(default_factory=Fits)  # specs fitted into grants, per device set
    fitting: bool = False
    fit: Fitted | None = None  # the fit being loaded or loaded (None: the spec as given)
    load_spec: ModelSpec | None = None  # the worker spec chosen at admission
    probing: bool = False
    error_epoch: int = 0  # bumped by each failure: tickets older than it give up
    drain: tuple[float, int] | None = None  # (deadline, seq of the ticket that waits)
    unload_asked: bool = False  # an unload waits for its leases: it takes no new one meanwhile
    follow_epoch: int = 0  # the router's ends of its followed connections so far (end_follows)
    loads: int = 0
    attempt: int = 0  # loads started (each LOADING is one attempt: a job reports back with its number)
    second_chance: bool = False  # a load that failed for want of device memory is being retried
    live: dict[str, int] = field(default_factory=dict)  # bytes the worker measured after load
    identity: str | None = None  # the loaded configuration's, for kept prompt states (keep.py)
    # the live model list (registry.py): a model removed or changed finishes its requests, unloads, goes
    fate: Fate | None = None
    replacement: ModelConfig | None = None  # the config that takes over (Fate.REPLACE)
    successor: "Record | None" = None  # the Record of that config, once this one is gone
    gone: bool = False  # no longer in the list: its waiters follow ``successor``, or fail
    primary: "Record | None" = None  # an extra instance's model (replicas.py); None: the model's own
    # its idle time as the last request set it (Ollama's keep_alive; any request without one
    # puts None back): None, the config's ttl; below 0, never unloaded for idleness (eviction
    # still may: keep is not persistent).  The model's own record holds it for its instances.
    keep: float | None = None

    @property
    def name(self) -> str:
        return self.config.name

    def ttl(self) -> float | None:
        """Seconds idle before it is unloaded (None: never): the model's keep as the last
        request set it, else the config's; a persistent model's is always its config's (an
        operator's pin is not a client's to lift)."""
        keep = (self.primary or self).keep
        if keep is None or self.config.persistent:
            return self.config.ttl
        return None if keep < 0 else keep

    def slots(self) -> int:
        """Its engine's parallel slots, as probed on its device set (1 until known)."""
        params = (self.params.get(self.device_set) or {}) if self.device_set else {}
        return int(params.get("n_parallel") or 1)

    def context(self) -> dict | None:
        """The context the model is (or would be) loaded with: the fit's, or as probed on
        its device set (the first candidate's while it is not loaded)."""
        params = self.params.get(self.device_set) if self.device_set else None
        params = params or next(iter(self.params.values()), None)
        if params is None:
            return None
        fitted = self.fit.n_ctx if self.fit is not None and holds_memory(self.state) else None
        return {"n_ctx": fitted or params.get("n_ctx"), "n_ctx_train": params.get("n_ctx_train"),
                "slots": params.get("n_parallel"), "unified": params.get("kv_unified"),
                "auto": bool(params.get("ctx_auto")), "fitted": fitted is not None}

    def report(self, kept: dict[str, int] | None) -> dict:
        """The model in ``status()`` (lock held): plain values only."""
        held = holds_memory(self.state)
        return {
            "state": self.state.value, "leases": self.leases,
            # the list's aliases: a changed model's new config's, none once removed
            "aliases": [] if self.fate is Fate.REMOVE else list((self.replacement or self.config).aliases),
            "devices": sorted(self.device_set) if self.device_set and held else [],
            "held": {d: n for d, n in self.need.items() if d != COUNT} if held else {},
            "last_used": self.last_used,
            "requirement": {"+".join(sorted(ds)): {d: n for d, n in need.items() if d != COUNT}
                            for ds, need in (self.requirements or {}).items()},
            "components": {"+".join(sorted(ds)): parts for ds, parts in self.components.items()},
            "fit": self.fit.to_dict() if self.fit and held else None,
            "context": self.context(),
            "live": dict(self.live), "reason": self.reason, "loads": self.loads,
            "persistent": self.config.persistent, "ttl": self.ttl(), "source": self.config.source,
            "projector": any(p.get("mmproj") for p in self.params.values()),
            "pending": self.fate.value if self.fate is not None else None,
            "replica_of": self.primary.name if self.primary is not None else None,
            "replicas": self.config.replicas,
            "kept": kept or {"ram": 0, "disk": 0, "files": 0},
        }


@dataclass(frozen=True, eq=False)
class Lease:
    """A request's hold on a LOADED model: its name and the worker that hosted it when
    the lease was taken (captured under the lock).  If that worker dies, a call on it
    raises WorkerDied.  ``Scheduler.release`` ends it, once.  ``record`` is the
    scheduler's (the model leased, even once a new config has taken its name): callers
    never read it."""

    name: str
    worker: WorkerHandle
    record: "Record" = field(repr=False)
    # the end of the turn (time.monotonic) of a model being drained for a waiter when the
    # lease was taken: what it lets a worker read on a connection must end by then
    until: float | None = None
    # the model's follow_epoch when the lease was taken: every end_follows after it ends
    # what this lease lets a worker read (the worker compares the two, whatever order the
    # hand-over and the end reach it in)
    epoch: int = 0
    # whether one of the instance's slots was free when the lease was taken (else the
    # request waits in its engine's queue behind the others)
    slot: bool = True


@dataclass(eq=False)
class Ticket:
    """A request waiting for its model (under the scheduler's lock): the model's Record
    (a changed model's new one, once it takes over), its place in the FIFO queue (seq),
    the model's failure count when it arrived (epoch), when it arrived, and the
    shortfall last reported for it (bytes per device)."""

    rec: Record
    seq: int
    epoch: int
    created: float
    short: dict[str, int] = field(default_factory=dict)
    why: str = ""  # what it waits for, as last told
    # the load of one instance of a model (an extra one, or its own back): counted in no queue
    # limit and refused by none, drains nothing, takes that instance only
    loader: bool = False
    asked: str = ""  # the name the request gave (a name or an alias): a removed model's waiter follows it
    slot: bool = False  # it takes a lease only with a slot free, in arrival order (Scheduler.lease)

    @property
    def name(self) -> str:
        return self.rec.name
