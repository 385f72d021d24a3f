"""What the ingress and a node's replica pass each other (plain, picklable values)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["NodeRequest", "Head"]


@dataclass(frozen=True)
class NodeRequest:
    """An HTTP request for one node's ``pyllmrouter serve`` app.

    ``model``: the model it is for (the request router places it by that model's bytes);
    ``node``: the one node it must go to (cluster views ask every node); ``exclude``:
    nodes that refused the model already."""

    method: str
    path: str
    query: tuple[tuple[str, str], ...] = ()
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    model: str | None = None
    node: str | None = None
    exclude: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class Head:
    """The first item a replica yields: the reply's status and headers, and its node.
    The body follows as bytes items."""

    status: int
    headers: tuple[tuple[str, str], ...]
    node: str
