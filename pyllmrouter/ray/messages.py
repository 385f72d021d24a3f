"""What the ingress and a node's replica pass each other (plain, picklable values)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["NodeRequest", "Accepted", "Head", "Started", "Beat", "BEAT"]

BEAT = 2.0  # seconds between two Beats of a reply that has nothing else to say


@dataclass(frozen=True)
class NodeRequest:
    """An HTTP request for one node's ``pyllmrouter serve`` app.

    ``model``: the model it is for (the request router places it by that model's bytes);
    ``node``: the one node it must go to (cluster views ask every node); ``exclude``:
    nodes that refused the model already, or were lost; ``whole``: the reply comes in one
    piece, after a ``Started`` where it runs (it took a slot of its model as it took the
    model; one queued in the engine behind others has none); ``waited``: seconds the
    request waited on a node lost before it began to answer (it keeps its place in line);
    ``ticket`` and ``ledger``: a request the ingress may send to another node (repeatable)
    runs only once the node has claimed its ticket in the ingress's ledger (an actor
    handle: ray/ledger.py), with a slot of its model free; each attempt has its own."""

    method: str
    path: str
    query: tuple[tuple[str, str], ...] = ()
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    model: str | None = None
    node: str | None = None
    exclude: frozenset[str] = field(default_factory=frozenset)
    whole: bool = False
    waited: float = 0.0
    ticket: str | None = None
    ledger: Any = None


@dataclass(frozen=True)
class Accepted:
    """Every reply's first item, sent as the node's replica takes the request (before its
    app sees it): which node and replica have it.  None within the ingress's deadline: no
    replica answers (a stuck one, or none left while Serve queues the call)."""

    node: str
    actor: str = ""


@dataclass(frozen=True)
class Started:
    """The request runs on ``node``: it took a free slot of its model (a stream's or a whole
    reply's, before its status), and for a ticket, the node claimed it in the ledger.  Lost
    now, it is not sent elsewhere, its generation was under way."""

    node: str


@dataclass(frozen=True)
class Beat:
    """The node's replica is alive and still has the request: sent every ``BEAT`` seconds
    in which the reply has nothing else to send (waiting for a model or a slot, a long
    prompt, a whole reply's generation).  None for a while: the node is silent."""


@dataclass(frozen=True)
class Head:
    """The reply's status and headers, and its node: a stream's first item (the body
    follows as bytes items); a whole reply comes as (Head, body) after its Started."""

    status: int
    headers: tuple[tuple[str, str], ...]
    node: str
    actor: str = ""  # the replica's actor id: a call that fails names it (RayActorError.actor_id)
