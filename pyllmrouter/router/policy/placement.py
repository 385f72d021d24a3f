"""Placement policy: pure functions, no I/O, no clocks, no locks.

Inputs are plain numbers: what a model needs per device, what each device has
available now for our models (capacity - margin - other programs - what our
resident models hold), and the resident models that could be evicted.  The
router asks; this module answers.

    never_fits(need, capacity)      a device the model can never fit on, even empty
    pick_victims(need, avail, res)  least recently used idle models on the short
                                    devices, until the model fits (None: cannot)
    choose(candidates, avail, res)  the device set: one that fits without evicting
                                    (most headroom first), else the fewest evictions
    grant(devices, avail, res)      what a model may be given per device: available
                                    now plus what the evictable residents hold there
    with_shares(res, workers)       each model's share of its worker's own bytes counted
                                    as its own, where every model of that worker may go

A limit on the number of loaded models is one more "device" whose capacity is
that number and on which every model needs 1, so the same eviction rule serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

__all__ = ["Resident", "Plan", "Shortfall", "shortfall", "never_fits", "pick_victims", "choose", "grant",
           "with_shares", "COUNT"]

COUNT = "#models"  # the pseudo-device of --models-max


@dataclass(frozen=True)
class Resident:
    """A model that holds memory: evictable only if loaded, idle and not persistent."""

    name: str
    need: Mapping[str, int]
    last_used: float
    evictable: bool


@dataclass(frozen=True)
class Plan:
    device_set: frozenset[str]
    need: Mapping[str, int]
    victims: tuple[str, ...]


@dataclass(frozen=True)
class Shortfall:
    """A device the model can never fit on: what it needs there against what the device
    can ever hold for models (the NeverFits error carries these figures)."""

    device: str
    need: int
    capacity: int

    def __str__(self) -> str:
        if self.device == COUNT:
            return f"the model limit is {self.capacity}"
        return (f"needs {self.need} bytes ({self.need / 2**20:.1f} MiB) on {self.device}, "
                f"which can hold at most {self.capacity} bytes ({self.capacity / 2**20:.1f} MiB) "
                f"for models even when empty")


def grant(devices: Iterable[str], available: Mapping[str, int], residents: Iterable[Resident]) -> dict[str, int]:
    """Per device: what is available now plus what the evictable residents hold there."""
    out = {d: available.get(d, 0) for d in devices}
    for r in residents:
        if r.evictable:
            for d, n in r.need.items():
                if d in out:
                    out[d] += n
    return out


def with_shares(residents: Sequence[Resident], workers: Mapping[str, tuple[str, Mapping[str, int]]]) -> list[Resident]:
    """``residents`` with each model's share of its worker's own bytes added to its own
    (``workers``: model name -> (its worker's name, the worker's bytes)), where every model of
    that worker is evictable: the worker goes when its last model does, so evicting them
    all frees its bytes too (the shares add up to them).  Elsewhere unchanged."""
    members: dict[str, list[Resident]] = {}
    for r in residents:
        if r.name in workers:
            members.setdefault(workers[r.name][0], []).append(r)
    out = []
    for r in residents:
        group = members.get(workers[r.name][0]) if r.name in workers else None
        if not group or not all(m.evictable for m in group):
            out.append(r)
            continue
        need, first = dict(r.need), group[0] is r
        for d, n in workers[r.name][1].items():
            share, rest = divmod(n, len(group))
            need[d] = need.get(d, 0) + share + (rest if first else 0)
        out.append(Resident(r.name, need, r.last_used, r.evictable))
    return out


def shortfall(need: Mapping[str, int], available: Mapping[str, int]) -> dict[str, int]:
    """Bytes missing per device (only devices that are short)."""
    return {d: n - available.get(d, 0) for d, n in need.items() if n > available.get(d, 0)}


def never_fits(need: Mapping[str, int], capacity: Mapping[str, int]) -> Shortfall | None:
    for d, n in need.items():
        cap = capacity.get(d, 0)
        if n > cap:
            return Shortfall(d, n, cap)
    return None


def pick_victims(need: Mapping[str, int], available: Mapping[str, int],
                 residents: Iterable[Resident]) -> tuple[str, ...] | None:
    """Evict least recently used first, only models holding bytes on a short device."""
    short = shortfall(need, available)
    if not short:
        return ()
    avail = dict(available)
    victims = []
    for r in sorted((r for r in residents if r.evictable), key=lambda r: (r.last_used, r.name)):
        if not any(r.need.get(d, 0) > 0 for d in short):
            continue
        victims.append(r.name)
        for d, n in r.need.items():
            avail[d] = avail.get(d, 0) + n
        short = shortfall(need, avail)
        if not short:
            return tuple(victims)
    return None


def _headroom(need: Mapping[str, int], available: Mapping[str, int]) -> int:
    """The smallest free space left on any real device after placing ``need``."""
    rest = [available.get(d, 0) - n for d, n in need.items() if d != COUNT]
    return min(rest) if rest else 0


def choose(candidates: Sequence[tuple[frozenset[str], Mapping[str, int]]], available: Mapping[str, int],
           residents: Sequence[Resident]) -> Plan | None:
    """Where to load: no evictions if possible (most headroom), else fewest evictions."""
    best: tuple[tuple, Plan] | None = None
    for device_set, need in candidates:
        victims = pick_victims(need, available, residents)
        if victims is None:
            continue
        freed = dict(available)
        for r in residents:
            if r.name in victims:
                for d, n in r.need.items():
                    freed[d] = freed.get(d, 0) + n
        key = (len(victims), -_headroom(need, freed), sorted(device_set))
        if best is None or key < best[0]:
            best = (key, Plan(frozenset(device_set), dict(need), victims))
    return None if best is None else best[1]
