"""A node's reply, read by the ingress: its items within their deadlines, then the
client's response (whole, or an event stream), the answer once every node has refused
a request, and the words for a node's failure.

    replies ──▶ next_item: Beats skipped; none within SILENT seconds: Silent
            ──▶ relay(head, rest): the body whole (a node lost before its end: 502), or
                chunk by chunk as an event stream (a node lost or silent: an error event)
    refusals ─▶ NodeRefusals: each node's; once all have refused, 507 with each node's
                figures, 503 where a node held out may take it, else the last 429 or 503
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from ray.exceptions import RayError
from ray.serve.exceptions import RayServeException
from starlette.responses import JSONResponse, Response, StreamingResponse

from pyllmrouter.ray import cluster, failover
from pyllmrouter.ray.messages import BEAT, Beat, Head
from pyllmrouter.server.api_errors import ApiError

__all__ = ["SILENT", "Silent", "next_item", "chunks_of", "relay", "NodeRefusals", "fate", "lost_message",
           "node_named"]

SILENT = 5 * BEAT  # seconds without any item (a Beat comes every BEAT seconds) that mean the node is silent


class Silent(Exception):
    """No item (not even a Beat) within SILENT seconds: the node's replica stopped (a hung
    or stopped host sends nothing, and Ray declares it dead only a minute later)."""


async def next_item(replies, seconds: float = SILENT) -> Any:
    """The reply's next item other than a Beat; Silent where none comes within ``seconds``
    (each Beat restarts the count); StopAsyncIteration at its end."""
    while True:
        try:
            async with asyncio.timeout(seconds):  # no task of its own: one per streamed chunk
                item = await replies.__anext__()
        except TimeoutError:
            raise Silent() from None
        if not isinstance(item, Beat):
            return item


async def chunks_of(replies) -> AsyncIterator[bytes]:
    """The rest of a reply's items (its body's chunks), by ``next_item``."""
    while True:
        try:
            yield await next_item(replies)
        except StopAsyncIteration:
            return


def node_named(node: str | None) -> str:
    return f"node {node}" if node else "the node"


def fate(began: bool, repeats: bool, node: str | None) -> str:
    """What a client may assume of a request a node failed under."""
    if began:
        return "the request was running there"
    if not repeats:
        return (f"the request may have run on {node_named(node)} (it is not sent to another node: running it "
                f"twice could be seen)")
    return "the request did not start there"


def lost_message(what: str, e: BaseException, began: bool, retried: str | None, repeats: bool,
                 node: str | None) -> str:
    why = f"{node_named(node)} serving '{what}' died: {type(e).__name__}"
    if retried and not began:
        return f"{why} (the request was sent on once already, after node {retried} was lost)"
    return f"{why} ({fate(began, repeats, node)})"


def _failure(e: BaseException) -> str:
    return "it stopped answering" if isinstance(e, Silent) else type(e).__name__


async def relay(head: Head, replies, model: str | None, retried: str | None = None, lost: Any = None) -> Response:
    """The node's reply (``replies``: its body, or the rest of its items): whole (a node
    that dies or falls silent before its end gives 502), or as an event stream (one that
    does ends it with an error event).  ``retried``: the nodes lost before this one took
    the request (the x-pyllmrouter-retried header); ``lost(error, node)``: told of a
    failure under way."""
    headers = {k: v for k, v in head.headers if k.lower() not in ("content-length",)}
    headers["x-pyllmrouter-node"] = head.node
    if retried is not None:
        headers["x-pyllmrouter-retried"] = retried
    died = f"the node serving '{model}' died" if model else "the node died"
    if isinstance(replies, bytes):
        return Response(replies, status_code=head.status, headers=headers)
    if not headers.get("content-type", "").startswith("text/event-stream"):
        try:
            data = b"".join([c async for c in chunks_of(replies)])
        except (RayError, RayServeException, Silent) as e:
            replies.cancel()
            if lost is not None:
                lost(e, head.node)
            raise ApiError(502, f"{died}: {_failure(e)}", "server_error", "node_died") from None
        return Response(data, status_code=head.status, headers=headers)

    async def chunks():
        try:
            async for chunk in chunks_of(replies):
                yield chunk
        except (RayError, RayServeException, Silent) as e:
            if lost is not None:
                lost(e, head.node)
            error = {"error": {"message": f"{died}: {_failure(e)}", "type": "server_error", "code": 502}}
            yield b"data: " + json.dumps(error).encode() + b"\n\n"
        finally:
            replies.cancel()

    return StreamingResponse(chunks(), status_code=head.status, headers=headers)


class NodeRefusals:
    """The nodes that refused one request before anything ran: each 507's figures, and the
    last 429 or 503 as its node gave it."""

    def __init__(self, model: str | None):
        self.model = model
        self.figures: dict[str, Any] = {}  # node -> its 507's figures (None: it said 429 or 503)
        self.last: tuple[Head, bytes] | None = None  # the last 429 or 503

    def nodes(self) -> set[str]:
        return set(self.figures)

    async def add(self, head: Head, rest: Any) -> bool:
        """A refusal (its Head, and its body or the stream of it) recorded; True where its
        node had refused the request already."""
        try:
            data = rest if isinstance(rest, bytes) else b"".join([c async for c in chunks_of(rest)])
        except (RayError, RayServeException, Silent):  # the node lost while it said why it refused: it stands
            data = b""
        repeated = head.node in self.figures
        if head.status == 507:
            self.figures[head.node] = json.loads(data or b"{}")
        else:
            self.figures[head.node], self.last = None, (head, data)
        return repeated

    async def answer(self, held: set[str], retried: str | None) -> Response:
        """The request's answer once every node has refused it (``held``: the nodes held out
        after a failure that did not refuse it)."""
        if self.last is None and held:  # a node held out may hold it: not a permanent 507
            raise ApiError(503, f"model '{self.model}' fits on no node that answers now; node(s) "
                                f"{', '.join(sorted(held))}, held out after a failure for up to "
                                f"{failover.HOLD:g} s, may", "server_error", "nodes_held",
                           headers={"Retry-After": str(int(failover.HOLD))})
        if self.last is None:
            return JSONResponse(cluster.no_node_fits(self.model, self.figures), status_code=507)
        return await relay(*self.last, self.model, retried)
