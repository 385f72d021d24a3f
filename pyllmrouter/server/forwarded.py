"""A request that a cluster's ingress sent on to this node's app (``ray/replica.py``).

The replica puts a ``Forwarded`` in the ASGI scope's extensions under ``FORWARDED``: the
seconds the request already waited (it went to a node that was lost before it began to
answer, and keeps its place in line here), and, for a request the ingress may send to
another node (a repeatable one: ray/failover.py), what to await once it holds a free
slot of its model, before it runs: True, it runs here (the cluster's ledger says this
node claimed it: lost now, it is not sent elsewhere); False, the ingress gave it up (it
never runs here).  Only the replica sets it: no header a client sends can."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable

__all__ = ["FORWARDED", "Forwarded", "forwarded_of"]

FORWARDED = "pyllmrouter.forwarded"  # the ASGI scope extension's name


@dataclass(frozen=True)
class Forwarded:
    waited: float  # seconds, before this node had the request
    running: Callable[[], Awaitable[bool]] | None = None  # awaited once, with a slot held


def forwarded_of(scope: dict) -> Forwarded | None:
    """The ``Forwarded`` of a request's ASGI scope: None for one a client sent here."""
    return scope.get("extensions", {}).get(FORWARDED)
