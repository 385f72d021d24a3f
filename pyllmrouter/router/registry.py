"""The live model list: models by name and alias, and what happens to one that is
removed or changed while it serves.

    add(config)            ──▶ a Record (names and aliases checked: unique, devices known)
    retire(rec, fate)      ──▶ rec.fate = REMOVE, or the config that replaces it
    step(state, leases, fate) (pure) ──▶ what the scheduler does next with a retiring model:
        NONE    no fate, or it must wait (loading, unloading)
        UNLOAD  loaded and idle: unload it (its requests in flight have finished)
        FINISH  unloaded: drop it, or swap in the Record of its new config
    finish(rec)            ──▶ dropped (REMOVE) or a new Record for the new config, which
                               waiting requests follow (``Record.successor``)

The scheduler owns the registry and calls it under its lock only; nothing here
does I/O.  A model that is removed or changed takes no new request (a waiter of
a removed model gets ModelRemoved; one of a changed model waits for the new
config), finishes what it has, and unloads; only then does it go.

    diff(current, new) (pure) ──▶ Changes(add, remove, replace, tune): the reconciliation
        of the sources' new list with the router's (models added through the API stay);
        a config whose only changes are how its requests are scheduled (TUNABLE: priority,
        max-queue, replicas) is tuned in place: nothing unloads, nothing waiting is lost
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
    FINISH = "finish"


def step(state: State, leases: int, retiring: bool) -> Step:
    """What a retiring model (removed, or changed) needs next: unloaded once it is loaded
    and idle, finished once unloaded; a loading or unloading one waits."""
    if not retiring:
        return Step.NONE
    if state is State.LOADED:
        return Step.UNLOAD if leases == 0 else Step.NONE
    if state is State.UNLOADED:
        return Step.FINISH
    return Step.NONE


@dataclass(frozen=True)
class Changes:
    add: tuple[ModelConfig, ...] = ()
    remove: tuple[str, ...] = ()
    replace: tuple[ModelConfig, ...] = ()
    tune: tuple[ModelConfig, ...] = ()


TUNABLE = ("priority", "max_queue", "replicas")  # a reload changes these in place


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
    """Models by name and alias; the scheduler's lock is held for every call."""

    def __init__(self, devices: Iterable[str], records: Mapping[str, Record] | None = None,
                 aliases: Mapping[str, str] | None = None):
        self._devices = tuple(devices)
        self._records: dict[str, Record] = dict(records or {})
        self._aliases: dict[str, str] = dict(aliases or {})

    def trial(self) -> "Registry":
        """A copy to try changes on first: its records are copies (what a change does to
        them stays there), its names and aliases the same."""
        copies = {n: with_fields(r) for n, r in self._records.items()}
        return Registry(self._devices, copies, self._aliases)

    def revive(self, rec: Record, cfg: ModelConfig) -> None:
        """A removed model, still finishing its requests, listed again: it stays, as it is
        (the same config) or to be replaced by ``cfg`` once it has finished."""
        if cfg == rec.config:
            rec.fate, rec.replacement = None, None
        else:
            self.retire(rec, cfg)

    def get(self, name: str) -> Record | None:
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

    def held_by_leaving(self, cfg: ModelConfig) -> bool:
        """Whether ``cfg``'s name or an alias is held by a model that is leaving (removed,
        still finishing its requests): it can join once that one has gone."""
        names = {cfg.name, *cfg.aliases}
        return any(r.fate is Fate.REMOVE and names & {r.name, *r.config.aliases} for r in self._records.values())

    def check(self, cfg: ModelConfig, replacing: Record | None = None) -> None:
        """ValueError if ``cfg`` cannot join: its name or an alias is taken, or it names a
        device the router does not have."""
        taken = {n for n, r in self._records.items() if r is not replacing}
        taken |= {a for a, n in self._aliases.items() if self._records[n] is not replacing}
        if cfg.name in taken:
            raise ValueError(f"model name {cfg.name!r} is used twice")
        for a in cfg.aliases:
            if a in taken or a == cfg.name:
                raise ValueError(f"alias {a!r} of model {cfg.name!r} is used twice")
        for d in cfg.devices or ():
            if d not in self._devices:
                raise ValueError(f"model {cfg.name!r} is pinned to unknown device {d!r} "
                                 f"(devices: {', '.join(self._devices)})")
        if cfg.spec.draft_devices and not set(cfg.spec.draft_devices) <= set(cfg.devices or ()):
            raise ValueError(f"model {cfg.name!r}: its draft's devices {', '.join(cfg.spec.draft_devices)} must be "
                             f"among the devices it is pinned to")

    def add(self, cfg: ModelConfig) -> Record:
        self.check(cfg)
        rec = Record(cfg)
        self._records[cfg.name] = rec
        for a in cfg.aliases:
            self._aliases[a] = cfg.name
        return rec

    def retire(self, rec: Record, replacement: ModelConfig | None) -> None:
        """Mark ``rec`` removed (``replacement`` None) or replaced by a new config (checked now)."""
        if replacement is not None:
            self.check(replacement, replacing=rec)
        rec.fate = Fate.REPLACE if replacement is not None else Fate.REMOVE
        rec.replacement = replacement

    def finish(self, rec: Record) -> Record | None:
        """An unloaded retiring model goes: dropped, or its new config's Record takes its
        name (returned; ``rec.successor`` points waiters to it)."""
        if self._records.get(rec.name) is not rec:
            return None
        del self._records[rec.name]
        for a in rec.config.aliases:
            self._aliases.pop(a, None)
        rec.gone = True
        if rec.fate is Fate.REPLACE and rec.replacement is not None:
            new = self.add(rec.replacement)
            rec.successor = new
            return new
        return None
