"""A request that a cluster's ingress sent on to this node's app (``ray/replica.py``).

The replica puts a ``Relayed`` in the ASGI scope's extensions under ``RELAYED``: the
seconds the request already waited (it went to a node that was lost before it began to
answer, and keeps its place in line here), and what to call where the request takes one
of its model's slots as it takes the model (it runs here at once: lost now, it is not
sent elsewhere).  Only the
replica sets it: no header a client sends can."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["RELAYED", "Relayed"]

RELAYED = "pyllmrouter.relayed"  # the ASGI scope extension's name


@dataclass(frozen=True)
class Relayed:
    waited: float  # seconds, before this node had the request
    running: Callable[[], None]  # called once, where the request runs at once
