"""One node's replica: the ``pyllmrouter serve`` app of that node, called in-process.

    ingress ──NodeRequest──▶ NodeRouter.handle ──ASGI──▶ create_app(Router): the same
            ◀── Head, bytes, bytes...  ◀────────────────  code as ``pyllmrouter serve``
            ◀── Accepted first (this node and replica have it), Started once it holds a slot
                of its model (streams and whole replies) and, for a ticket, claimed it in the
                ingress's ledger (ray/ledger.py), then Head, bytes... or (Head, body); a Beat
                every BEAT seconds with nothing else to send

The replica's Router owns every device of its node.  It is built from the same
arguments as ``pyllmrouter serve`` (and the same LLAMA_ARG_* / PYLLMROUTER_*
variables of that host), so the replica asks Ray for no GPU: its workers mask
themselves as they do under ``serve``.  Every model is measured when the replica
starts, so its statistics carry each model's bytes before any request, and the
worker of a model's only device set is started then (router/workers/measure.py), so the
first request finds it.

With ``PYLLMROUTER_RUN_LOG`` set (a directory), the replica appends a line to
``<dir>/<node>.log`` for each request that carries ``X-Request-Id``: "started" where it
took a slot of its model, "answered" with the status where its reply began, each written
at once (a node killed later keeps what it wrote): which node ran what, for counting
runs per request across nodes (bench/ray_bench.py --kill-node).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from typing import Any, AsyncIterator
from urllib.parse import urlencode

import ray

from pyllmrouter.config import MiB
from pyllmrouter.errors import RouterError
from pyllmrouter.ray import failover
from pyllmrouter.ray.messages import BEAT, Accepted, Beat, Head, NodeRequest, Started
from pyllmrouter.ray.ranking import node_stats
from pyllmrouter import endpoints
from pyllmrouter.server.app import create_app
from pyllmrouter.server.forwarded import FORWARDED, Forwarded
from pyllmrouter.server.run import parse_serve_args, router_from_args

__all__ = ["NodeRouter", "CLAIM_TIMEOUT"]

CLAIM_TIMEOUT = 10.0  # seconds the ledger has to answer a claim: none, the request does not run


class NodeRouter:
    """The replica class (deployed by ``pyllmrouter.ray.deploy``): ``serve_args`` are
    ``pyllmrouter serve``'s arguments without host and port."""

    def __init__(self, serve_args: list[str], stats_period: float = 1.0):
        args = parse_serve_args(serve_args)
        self.silent_after = failover.silent_after(stats_period)
        self.node = ray.get_runtime_context().get_node_id()
        self.actor = ray.get_runtime_context().get_actor_id() or ""
        self.router = router_from_args(args)
        self.app = create_app(self.router, close_router=False, max_body=int(args.max_body_mb * MiB))
        self._lifespan = None
        self._started = asyncio.Lock()
        self._readings = 0  # statistics read so far (record_routing_stats)
        log_dir = os.environ.get("PYLLMROUTER_RUN_LOG")
        self._run_log = os.open(os.path.join(log_dir, f"{self.node}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                                0o644) if log_dir else None
        threading.Thread(target=self._measure_all, name="measure", daemon=True).start()

    def _measure_all(self) -> None:
        for config in self.router.models():
            try:
                self.router.scheduler.measure(config.name)
            except RouterError:
                pass  # recorded on the model: a request for it gets the reason

    def record_routing_stats(self) -> dict[str, Any]:
        """What the request router ranks this node by; ``seq`` changes with every reading
        (a count, not a clock: no host's clock is compared with another's), so statistics
        that stop changing for ``silent_after`` seconds of the router's own clock are a node
        that stopped answering (request_router.py)."""
        self._readings += 1
        return {**node_stats(self.node, self.router.status(), self.router.options.max_models),
                "seq": self._readings, "silent_after": self.silent_after}

    async def ping(self, request: NodeRequest) -> str:
        """This node's id: the ingress asks, after a call failed, which nodes still answer."""
        return self.node

    async def _start(self) -> None:
        async with self._started:
            if self._lifespan is None:
                api = self.app.app  # the FastAPI app behind the guard
                self._lifespan = api.router.lifespan_context(api)
                await self._lifespan.__aenter__()

    async def handle(self, request: NodeRequest) -> AsyncIterator[Accepted | Head | bytes | Started | tuple[Head, bytes]]:
        """The reply of this node's app: Accepted at once; a Started once the request
        holds a slot of its model; then a Head and the body in chunks as the app writes
        them, or for ``request.whole`` (Head, body).  Cancelled (the client left): the app
        sees a disconnect, and a generation stops."""
        if request.node is not None and request.node != self.node:  # never answer for another node
            yield Head(421, (("content-type", "application/json"),), self.node, self.actor)
            yield json.dumps({"error": {"message": f"this is node {self.node}, not {request.node}",
                                        "type": "misdirected_request", "code": 421}}).encode()
            return
        yield Accepted(self.node, self.actor)
        await self._start()
        call = _AppCall(request, self.node, self._run_log)
        task = asyncio.get_running_loop().create_task(call.run(self.app))
        head, body = None, []
        try:
            while (message := await _next(call.messages)) is not None:
                if isinstance(message, (Started, Beat)):
                    yield message
                elif message["type"] == "http.response.start":
                    headers = tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"])
                    head = Head(message["status"], headers, self.node, self.actor)
                    call.ran(f"answered {head.status}")
                    if not request.whole:
                        yield head
                elif message.get("body"):
                    if request.whole:
                        body.append(message["body"])
                    else:
                        yield message["body"]
            task.result()  # an error in the app is this call's error
            if request.whole:
                if head is None:  # the app ended without a reply
                    raise RuntimeError(f"node {self.node}'s app sent no reply")
                yield head, b"".join(body)
        finally:
            call.left.set()

    def __del__(self) -> None:
        router = getattr(self, "router", None)
        if router is not None:
            router.close()


class _AppCall:
    """One NodeRequest as this node's app runs it (``NodeRouter.handle`` reads what it
    sends): its ASGI scope, its receive (the body, then a disconnect once ``left`` is set:
    the reply done, or the call cancelled), its messages queued, a Started among them where
    it takes a slot of its model, and its lines in the run log (``run_log``: the file's
    descriptor, or None)."""

    def __init__(self, request: NodeRequest, node: str, run_log: int | None):
        self.request, self.node, self.run_log = request, node, run_log
        self.rid = next((v for k, v in request.headers if k.lower() == "x-request-id"), None)
        self.messages: asyncio.Queue = asyncio.Queue()  # the app's ASGI messages, then None at its end
        self.left = asyncio.Event()
        self._body_given = False
        self.scope = self._scope()

    def ran(self, what: str) -> None:
        """The run log's line, written at once (one write: whole, appended)."""
        if self.run_log is not None and self.rid:
            os.write(self.run_log, f"{self.rid}\t{what}\t{self.node}\n".encode())

    async def _running(self) -> bool:
        """A slot held: may it run here? (the ledger says; ray/ledger.py)"""
        request = self.request
        try:
            claimed = await asyncio.wait_for(request.ledger.claim.remote(request.ticket), CLAIM_TIMEOUT)
        except (asyncio.TimeoutError, ray.exceptions.RayError):
            return False  # unknown: it does not run here (Unclaimed, 503: the ingress may send it on)
        if claimed:
            self.ran("started")
            self.messages.put_nowait(Started(self.node))
        return bool(claimed)

    async def _slotted(self) -> bool:
        """A slot held by one that takes a slot, with no ticket: it runs."""
        self.ran("started")
        self.messages.put_nowait(Started(self.node))
        return True

    def _scope(self) -> dict[str, Any]:
        request = self.request
        # a model's inference POST waits for a free slot here, in arrival order with the others (not
        # in the engine's queue): one with a ticket claims it first; one without (a conversation's,
        # one for a named node) is never sent on
        takes = request.method == "POST" and endpoints.repeatable("POST", request.path, {}) \
            and endpoints.takes_slot(request.path)
        wait = self._running if request.ticket is not None else self._slotted if takes else None
        return {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
            "scheme": "http", "path": request.path, "raw_path": request.path.encode(), "root_path": "",
            "query_string": urlencode(request.query).encode(),
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers],
            "client": ("ray", 0), "server": ("pyllmrouter", 0),
            "extensions": {FORWARDED: Forwarded(request.waited, wait)},
        }

    async def _receive(self) -> dict[str, Any]:
        if not self._body_given:
            self._body_given = True
            return {"type": "http.request", "body": self.request.body, "more_body": False}
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def run(self, app) -> None:
        """The request through ``app``; its messages end with None."""
        try:
            await app(self.scope, self._receive, self.messages.put)
        finally:
            self.messages.put_nowait(None)


async def _next(messages: asyncio.Queue) -> Any:
    """The app's next message, or a Beat where it has none for BEAT seconds."""
    try:
        async with asyncio.timeout(BEAT):  # no task of its own (wait_for makes one a message)
            return await messages.get()
    except TimeoutError:
        return Beat()
