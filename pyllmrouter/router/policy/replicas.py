"""Instances of one model (pure): which serves a request, and when one more loads.

A model with ``replicas = N`` (its preset's key, ``ModelConfig.replicas``) may run as up
to N instances, each on a device set of its own: the model's own record (the primary) and
extra records named ``NAME#2``, ``NAME#3``...  (hidden from the model lists, shown as the
model's ``instances``).  An extra instance loads by demand and goes first when room is
needed:

    pick(instances)          the instance a request goes to: the fewest requests in flight
                             (the primary first among equals)
    wants_more(...)          one more instance is asked for when the model's requests wait
                             (more in flight than its instances have slots), it may have more,
                             none is loading already, and a device set is left for it
    replica_name(model, k)   NAME#k
    free_name(model, taken)  the first NAME#k no record or alias holds: an old instance of the
                             model (one still finishing after a reload changed the model, or
                             removed and added it again) keeps its name until it goes

Where an extra instance may load is admission's to say, with the rules of any load (exact
bytes, busy and persistent models never evicted), except that its wait drains nothing:
it loads where there is room, or not at all (router/jobs.py: replicate).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

__all__ = ["Instance", "pick", "wants_more", "replica_name", "free_name", "SEPARATOR"]

SEPARATOR = "#"


@dataclass(frozen=True)
class Instance:
    name: str
    leases: int  # requests in flight
    slots: int  # its engine's parallel slots
    primary: bool


def pick(instances: list[Instance]) -> str | None:
    """The instance with the fewest requests in flight (None: no instance can take one)."""
    if not instances:
        return None
    return min(instances, key=lambda i: (i.leases, not i.primary, i.name)).name


def wants_more(limit: int, running: list[Instance], loading: int, free_sets: int, arriving: int = 0) -> bool:
    """Whether one more instance should load now: the model may have more than it has, its
    requests wait (more in flight than all its instances' slots, ``arriving`` counted: a
    request about to take its lease), none is already loading, and a device set is left
    where it could go."""
    if limit <= len(running) + loading or loading or free_sets <= 0 or not running:
        return False
    return sum(i.leases for i in running) + arriving > sum(i.slots for i in running)


def replica_name(model: str, k: int) -> str:
    return f"{model}{SEPARATOR}{k}"


def free_name(model: str, taken: Callable[[str], bool]) -> str:
    """The first ``NAME#k`` (k from 2) that ``taken`` says nobody holds."""
    return next(name for k in itertools.count(2) if not taken(name := replica_name(model, k)))
