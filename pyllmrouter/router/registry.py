"""The live model list: models by name and alias, and what happens to one that is
removed or changed while it serves.

    validate(configs)      ──▶ the whole list checked (names and aliases used once, devices
                               known): a list that cannot stand changes nothing
    add(config)            ──▶ a Record (its name free, the list with it valid)
    set_retiring(rec, cfg) ──▶ rec.fate = REMOVE, or the config that replaces it; the
                               aliases are the list's at once (one may shadow the name of a
                               removed model still finishing: it means its new owner)
    step(state, leases, fate) (pure) ──▶ what the scheduler does next with a retiring model:
        NONE    no fate, or it must wait (loading, unloading)
        UNLOAD  loaded and idle: unload it (its requests in flight have finished)
        TAKE_OUT unloaded: drop it, or swap in the Record of its new config
    take_out(rec)          ──▶ dropped (REMOVE) or a new Record for the new config, which
                               waiting requests follow (``Record.successor``)

The scheduler owns the registry and calls it under its lock only; nothing here
does I/O.  A model that is removed or changed takes no new request (a waiter of
a removed model gets ModelRemoved; one of a changed model waits for the new
config), finishes what it has, and unloads; only then does it go.

    diff(current, new) (pure) ──▶ Changes(add, remove, replace, tune): the reconciliation
        of the sources' new list with the router's (models added through the API stay);
        a config whose only changes are how its requests are scheduled or the names it
        answers to (TUNABLE: priority, max-queue, replicas, aliases) is tuned in place:
        nothing unloads, nothing waiting is lost
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace as with_fields
from typing import Iterable, Mapping

from pyllmrouter.config import ModelConfig
from pyllmrouter.router.records import Fate, Record
from pyllmrouter.router.policy.state import State

__all__ = ["Registry", "Fate", "Step", "step", "Changes", "diff", "API"]

API = "api"  # the source of models added through the API: a reload of the other sources keeps them


class Step(enum.Enum):
    NONE = "none"
    UNLOAD = "unload"
    TAKE_OUT = "take-out"


def step(state: State, leases: int, retiring: bool) -> Step:
    """What a retiring model (removed, or changed) needs next: unloaded once it is loaded
    and idle, finished once unloaded; a loading or unloading one waits."""
    if not retiring:
        return Step.NONE
    if state is State.LOADED:
        return Step.UNLOAD if leases == 0 else Step.NONE
    if state is State.UNLOADED:
        return Step.TAKE_OUT
    return Step.NONE


@dataclass(frozen=True)
class Changes:
    add: tuple[ModelConfig, ...] = ()
    remove: tuple[str, ...] = ()
    replace: tuple[ModelConfig, ...] = ()
    tune: tuple[ModelConfig, ...] = ()


TUNABLE = ("priority", "max_queue", "replicas", "aliases")  # a reload changes these in place


def tuned_only(old: ModelConfig, new: ModelConfig) -> bool:
    """Whether ``new`` differs from ``old`` in TUNABLE fields alone (and does differ)."""
    return old != new and with_fields(old, **{f: getattr(new, f) for f in TUNABLE}) == new


def diff(current: Mapping[str, ModelConfig], new: Iterable[ModelConfig]) -> Changes:
    """From the router's models to the sources' new list: new names are added, changed
    configs replace theirs, names gone from the sources are removed (but models added
    through the API, which no source lists)."""
    new_by_name = {c.name: c for c in new}
    add = tuple(c for n, c in new_by_name.items() if n not in current)
    changed = [c for n, c in new_by_name.items() if n in current and current[n] != c]
    replace = tuple(c for c in changed if not tuned_only(current[c.name], c))
    tune = tuple(c for c in changed if tuned_only(current[c.name], c))
    remove = tuple(n for n, c in current.items() if n not in new_by_name and c.source != API)
    return Changes(add, remove, replace, tune)


class Registry:
    """Models by name, and the list's aliases; the scheduler's lock is held for every call.

    Names: every live record's own, unique (a removed model still finishing its requests
    keeps its name until it goes; a changed model's new config takes the name once the old
    one has gone).  Aliases: the list's as it is now, each naming the record of its model;
    one may shadow the name of a removed model that is still finishing (a client asking
    for it means the model the list gives that alias now)."""

    def __init__(self, devices: Iterable[str]):
        self._devices = tuple(devices)
        self._records: dict[str, Record] = {}
        self._aliases: dict[str, str] = {}

    def named(self, name: str) -> Record | None:
        """The record whose own name is ``name`` (never through an alias)."""
        return self._records.get(name)

    def get(self, name: str) -> Record | None:
        """The record a client's ``name`` means: the model the list gives that alias, else
        the record of that name."""
        return self._records.get(self._aliases.get(name, name))

    def names(self) -> list[str]:
        return list(self._records)

    def records(self) -> list[Record]:
        return list(self._records.values())

    def configs(self) -> dict[str, ModelConfig]:
        """The config each name will have: a retiring model's new config, if it has one (a
        model's extra instances are not models of the list)."""
        return {n: (r.replacement or r.config) for n, r in self._records.items()
                if r.fate is not Fate.REMOVE and r.primary is None}

    def instances(self, rec: Record) -> list[Record]:
        """A model's instances: its own record, then its extra ones (replicas.py)."""
        return [rec, *(r for r in self._records.values() if r.primary is rec)]

    def relink(self) -> None:
        """The aliases, from the list as it is now (after a config changed in place)."""
        self._relink()

    def _relink(self) -> None:
        """The aliases, from the list as it is now (a changed model's new config's)."""
        self._aliases = {a: name for name, cfg in self.configs().items() for a in cfg.aliases}

    def validate(self, configs: Iterable[ModelConfig]) -> None:
        """ValueError unless ``configs``, as the whole list, can stand: every name and alias
        used once (an alias is no model's name), every device known, a draft's devices among
        its model's, and no name an extra instance of a model holds now."""
        seen: dict[str, str] = {}
        configs = list(configs)
        for cfg in configs:
            if cfg.name in seen:
                raise ValueError(f"model name {cfg.name!r} is used twice")
            seen[cfg.name] = cfg.name
            r = self._records.get(cfg.name)
            if r is not None and r.primary is not None:
                raise ValueError(f"model name {cfg.name!r} is an instance of {r.primary.name!r}")
        for cfg in configs:
            for a in cfg.aliases:
                if a in seen or a == cfg.name:
                    raise ValueError(f"alias {a!r} of model {cfg.name!r} is used twice")
                r = self._records.get(a)
                if r is not None and r.primary is not None:
                    raise ValueError(f"alias {a!r} of model {cfg.name!r} is an instance of {r.primary.name!r}")
                seen[a] = cfg.name
            for d in cfg.devices or ():
                if d not in self._devices:
                    raise ValueError(f"model {cfg.name!r} is pinned to unknown device {d!r} "
                                     f"(devices: {', '.join(self._devices)})")
            if cfg.spec.draft_devices and not set(cfg.spec.draft_devices) <= set(cfg.devices or ()):
                raise ValueError(f"model {cfg.name!r}: its draft's devices {', '.join(cfg.spec.draft_devices)} must "
                                 f"be among the devices it is pinned to")

    def check(self, cfg: ModelConfig) -> None:
        """ValueError if ``cfg`` cannot join the list as it is: its name or an alias is taken
        (a removed model still finishing holds its name until it goes), or the list with it
        would not stand (``validate``)."""
        if cfg.name in self._records:
            leaving = self._records[cfg.name].fate is Fate.REMOVE
            raise ValueError(f"model name {cfg.name!r} is used twice" +
                             (" (a removed model of that name is still finishing its requests)" if leaving else ""))
        self.validate([*self.configs().values(), cfg])

    def add(self, cfg: ModelConfig, listed: bool = False) -> Record:
        """A new model (``listed``: the whole list it comes with was validated: only its name
        is checked, the list being changed step by step meanwhile)."""
        if listed and cfg.name in self._records:
            raise ValueError(f"model name {cfg.name!r} is used twice")
        if not listed:
            self.check(cfg)
        rec = Record(cfg)
        self._records[cfg.name] = rec
        self._relink()
        return rec

    def add_replica(self, cfg: ModelConfig, primary: Record) -> Record:
        """An extra instance of ``primary``'s model, measured as it is (same file, same spec)."""
        if cfg.name in self._records or cfg.name in self._aliases:
            raise ValueError(f"model name {cfg.name!r} is used twice")
        rec = Record(cfg, primary=primary, requirements=primary.requirements, components=primary.components,
                     params=primary.params, fits=primary.fits)
        self._records[cfg.name] = rec
        return rec

    def drop(self, rec: Record) -> None:
        """An extra instance that unloaded goes from the list (its waiters, if any, fail)."""
        if rec.primary is not None and self._records.get(rec.name) is rec:
            del self._records[rec.name]
            rec.gone = True

    def set_retiring(self, rec: Record, replacement: ModelConfig | None) -> None:
        """Mark ``rec`` removed (``replacement`` None) or replaced by a new config (the list
        with it validated by the caller); the aliases follow the list at once."""
        rec.fate = Fate.REPLACE if replacement is not None else Fate.REMOVE
        rec.replacement = replacement
        self._relink()

    def revive(self, rec: Record, cfg: ModelConfig) -> None:
        """A removed model, still finishing its requests, listed again: it stays, as it is
        (the same config) or to be replaced by ``cfg`` once it has finished."""
        if cfg == rec.config:
            rec.fate, rec.replacement = None, None
            self._relink()
        else:
            self.set_retiring(rec, cfg)

    def take_out(self, rec: Record) -> Record | None:
        """An unloaded retiring model goes: dropped, or its new config's Record takes its
        name (returned; ``rec.successor`` points waiters to it)."""
        if self._records.get(rec.name) is not rec:
            return None
        del self._records[rec.name]
        rec.gone = True
        new = None
        if rec.fate is Fate.REPLACE and rec.replacement is not None:
            new = self._records[rec.name] = Record(rec.replacement)
            rec.successor = new
        self._relink()
        return new
