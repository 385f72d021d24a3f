"""What the ingress and a node's replica pass each other (plain, picklable values)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["NodeRequest", "Accepted", "Head", "Started"]


@dataclass(frozen=True)
class NodeRequest:
    """An HTTP request for one node's ``pyllmrouter serve`` app.

    ``model``: the model it is for (the request router places it by that model's bytes);
    ``node``: the one node it must go to (cluster views ask every node); ``exclude``:
    nodes that refused the model already, or were lost; ``whole``: the reply comes in one
    piece, after a ``Started`` where it runs (it took a slot of its model as it took the
    model; one queued in the engine behind others has none); ``waited``: seconds the
    request waited on a node lost before it began to answer (it keeps its place in line)."""

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
    reply's, before its status).  Lost now, it is not sent elsewhere, its generation was
    under way."""

    node: str


@dataclass(frozen=True)
class Head:
    """The reply's status and headers, and its node: a stream's first item (the body
    follows as bytes items); a whole reply comes as (Head, body) after its Started."""

    status: int
    headers: tuple[tuple[str, str], ...]
    node: str
    actor: str = ""  # the replica's actor id: a call that fails names it (RayActorError.actor_id)
