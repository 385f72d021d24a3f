"""The cluster's one address: HTTP in, each request to the node the request router picks.

    client ──HTTP──▶ Ingress ──NodeRequest(model)──▶ MemoryAwareRouter ──▶ a node's NodeRouter
                       │    ◀── Head, body chunks ───────────────────────────────┘
                       │    507 (it never fits there): again, without that node; every node
                       │    refused: 507 with each node's figures
                       └── /models, /v1/models, /devices, /events: every node asked
                           (NodeRequest(node=...)), the answers merged (cluster.py)

The ingress listens on its address itself (uvicorn in the replica's event loop), as
Serve's direct ingress does: Serve's HTTP proxy would be one more hop, and its routing
sees a header, not the model in the body.  A node that dies under a request ends it
with a clear error: 502 before the reply started, an SSE error event after; only a
repeatable request that had not begun is sent to another node (failover.py), and it
runs on one node at most: a node runs it only once it has claimed its ticket in this
ingress's ledger, and it is sent on only once the ledger says no node had (ledger.py).
A node that sends nothing (not even its Beat) for answer.SILENT seconds is silent:
held out, as a lost one is.
``?node=ID`` sends a request to one node; a slot action (POST /slots/{id}) goes to the
one node where its model is loaded (or the one ``?node=`` names), never elsewhere.
Nodes held out after a failure are still asked by the cluster's views (marked ``held``)
and by an unload; their absence never turns into a 507.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from dataclasses import replace
from typing import Any

import ray
import uvicorn
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from ray.exceptions import ActorDiedError, RayError
from ray.serve.exceptions import RayServeException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pyllmrouter.ray import cluster, failover, ranking
from pyllmrouter.ray.ledger import Ledger
from pyllmrouter.ray.messages import Accepted, Beat, Head, NodeRequest, Started
from pyllmrouter.ray.answer import NodeRefusals, Silent, chunks_of, fate, lost_message, next_item, node_named, relay
from pyllmrouter import endpoints
from pyllmrouter.server.app import DEFAULT_HEADERS, HTTP_PROTOCOL, guard_error
from pyllmrouter.server.body import json_object, model_named
from pyllmrouter.server.body import read_or_refuse, replay
from pyllmrouter.server.api_errors import ApiError, error_response

__all__ = ["Ingress", "NODE_RESOURCE", "node_ids"]

NODE_RESOURCE = "pyllmrouter"  # the custom resource that marks a node for one replica
FAN_OUT = ("/models", "/v1/models", "/devices", "/events")
# a node's refusals of a request it has not begun: tried on another node (each node once)
RETRIED = frozenset({507, 429, 503})
NOTHING_RAN = frozenset({507, 429})  # refusals that leave nothing run: any request is tried elsewhere
ASK_TIMEOUT = 10.0  # seconds a node has to answer a management question
ACCEPT_TIMEOUT = 10.0  # seconds a node's replica has to take a request (its Accepted): none, silent
OLLAMA_LISTS = ("/api/tags", "/api/ps")
RE_PLACE_PERIOD = 5.0  # seconds between two looks for models evicted lately that fit free elsewhere
PING_TIMEOUT = 2.0  # seconds a node has to answer, after a call to some node failed
# pings a node gets while another node's replica answers them: Serve hands a chosen replica
# to the oldest call waiting, so under load one ping may be answered by another node
PINGS = 3

_LOG = logging.getLogger("pyllmrouter.ray")


class Ingress:
    """The ingress replica (deployed by ``pyllmrouter.ray.deploy``): serves HTTP on
    ``host:port`` from the moment it is constructed until Serve stops it."""

    async def __init__(self, nodes, host: str, port: int, api_key: str | None = None, max_body: int = 8 << 20,
                       access_log: bool = False):
        self.nodes = nodes  # the NodeRouter deployment's handle
        self._lost = failover.LostNodes(time.monotonic)  # this event loop's only
        self._probing: tuple[float, asyncio.Future | None] = (0.0, None)  # the last round of pings: when, what
        self._actors: dict[str, str] = {}  # a replica's actor id -> its node, as its replies say
        self._ledger = _new_ledger()  # this event loop's; the actor dies with this process
        self._issued = 0  # the last attempt's ticket (ledger.py): each attempt its own, in order
        self._in_flight: dict[int, None] = {}  # tickets whose call is under way, lowest first
        self.api_key, self.max_body = api_key, max_body
        try:  # bound here: a port in use is this constructor's error (uvicorn would exit the process)
            listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        except OSError as e:
            raise RuntimeError(f"the ingress cannot listen on {host}:{port}: {e.strerror or e}") from None
        config = uvicorn.Config(self.asgi, lifespan="off", interface="asgi3", http=HTTP_PROTOCOL,
                                headers=DEFAULT_HEADERS, log_level="info" if access_log else "warning",
                                access_log=access_log)
        self._server = uvicorn.Server(config)
        self._serving = asyncio.get_running_loop().create_task(self._server.serve(sockets=[listener]))
        self._re_placing = asyncio.get_running_loop().create_task(self._re_place_loop())
        while not self._server.started:
            if self._serving.done():
                self._serving.result()
                raise RuntimeError(f"the ingress stopped before it served {host}:{port}")
            await asyncio.sleep(0.01)

    async def asgi(self, scope, receive, send) -> None:
        """One request: its body read whole (counted as it comes, refused at the limit),
        then answered; a client that leaves before the answer cancels it on its node
        (whole replies too: the node's generation stops)."""
        if scope["type"] != "http":
            return
        body = await read_or_refuse(scope, receive, send, self.max_body)
        if body is None:
            return  # answered (413), or the client left before its body had come
        left = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            left.set()

        async def after_body() -> dict[str, Any]:
            await left.wait()
            return {"type": "http.disconnect"}

        watcher = asyncio.ensure_future(watch())
        try:
            answer = asyncio.ensure_future(self.respond(Request(scope, replay(body, after_body))))
            gone = asyncio.ensure_future(left.wait())
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
            if not answer.done():  # the client left: the call to its node is cancelled
                answer.cancel()
                await asyncio.gather(answer, return_exceptions=True)
                return
            await answer.result()(scope, replay(b"", after_body), send)
        finally:
            watcher.cancel()

    async def _re_place_loop(self) -> None:
        """Every RE_PLACE_PERIOD: the models the nodes evicted since the last look, loaded
        nowhere now, are loaded where they fit in free memory (ranking.re_place): a node that
        joins takes back what the others pushed out, and models that keep evicting each
        other for the same bytes end on different nodes.  Each node's events are read by
        their sequence numbers, not by any clock."""
        seen: dict[str, int] = {}  # node -> the last event it has told of (this loop's only)
        pending: dict[str, None] = {}  # models evicted and not loaded since, the latest last (this loop's only)
        while not self._server.should_exit:  # set as Serve stops this replica (__del__)
            await asyncio.sleep(RE_PLACE_PERIOD)
            try:
                await self._keep_ledger()
                await self._re_place(seen, pending)
            except Exception as e:  # noqa: BLE001 - the next round tries again
                _LOG.warning("re-placing evicted models failed: %s: %s", type(e).__name__, e)

    async def _keep_ledger(self) -> None:
        """A ledger found dead is replaced: the claims sent to it fail (their requests do not
        run: 503, sent on), the next tickets go to the new one."""
        try:
            await asyncio.wait_for(self._ledger.size.remote(), ASK_TIMEOUT)
        except ActorDiedError:  # dead for good (unreachable for now is not: it may still grant claims)
            _LOG.warning("the ledger died: a new one takes the next requests' claims")
            old, self._ledger = self._ledger, _new_ledger()
            with contextlib.suppress(Exception):  # (dead: nothing to stop)
                ray.kill(old)
        except (asyncio.TimeoutError, RayError):
            pass  # slow or unreachable, not dead: its requests keep it (they are judged by it alone)

    async def _re_place(self, seen: dict[str, int], pending: dict[str, None]) -> None:
        for node, reply in (await self._ask_all(NodeRequest("GET", "/events"))).items():
            if "error" in reply:
                continue  # not read this round: its events are read next time
            events = [e for e in reply.get("data", ()) if isinstance(e, dict)]
            if node in seen and max([0] + [e.get("seq", 0) for e in events]) < seen[node]:
                seen[node] = 0  # its replica started again (its count too): all it tells is news
            if node in seen:  # a node's first reading is its history, not news
                for e in events:
                    if e.get("event") == "evict" and e.get("seq", 0) > seen[node]:
                        pending.pop(e["model"], None)
                        pending[e["model"]] = None
            seen[node] = max([seen.get(node, 0)] + [e.get("seq", 0) for e in events])
        if not pending:
            return
        views = {n: v for n, v in (await self._ask_all(NodeRequest("GET", "/models"))).items()
                 if "error" not in v and not v.get("held")}
        entries = [e for v in views.values() for e in v.get("data", ())]
        held = {e["id"] for e in entries if e["status"]["value"] in ("loaded", "loading")}
        for model in [m for m in pending if m in held or m not in {e["id"] for e in entries}]:
            del pending[model]  # loaded again meanwhile, or listed nowhere now
        for model, node in ranking.re_place(views, list(pending)[::-1]):
            _LOG.info("'%s', evicted and loaded nowhere since, fits free on node %s: loaded there", model, node)
            del pending[model]
            await self._respond(NodeRequest("POST", "/models/load", body=json.dumps({"model": model}).encode(),
                                            headers=(("content-type", "application/json"),), node=node), None)

    def check_health(self) -> None:
        """Serve's health check: a server that stopped makes Serve replace this replica."""
        if self._serving.done():
            raise RuntimeError("the ingress's HTTP server stopped")

    def __del__(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            server.should_exit = True  # it closes its socket and connections within 0.1 s


    async def respond(self, request: Request) -> Response:
        headers = {k.lower(): v for k, v in request.headers.items()}
        err = guard_error(request.url.path, headers, self.api_key, self.max_body)
        if err is not None:
            return error_response(err)
        try:
            return await self._route(request)
        except ApiError as e:
            return error_response(e)

    async def _route(self, request: Request) -> Response:
        path, method = request.url.path, request.method
        query = tuple((k, v) for k, v in request.query_params.items() if k != "node")
        body = await request.body()
        headers = {k.lower(): v for k, v in request.headers.items()}
        plain = NodeRequest(method, path, query, tuple((k, v) for k, v in request.headers.items()
                                                       if k.lower() not in ("host", "content-length")), body)
        node = request.query_params.get("node")
        if node:
            return await self._respond(replace(plain, node=node), None)
        if path == "/health":
            return JSONResponse({"status": "ok"})
        if method == "GET" and path in FAN_OUT:
            return await self._cluster_view(plain)
        if method == "POST" and path == "/models/unload":
            return await self._unload(plain)
        if method == "GET":
            model, stream, data = dict(query).get("model"), False, {}
        else:  # as a node's app reads it: a JSON body's (or a multipart form's) "model", else ?model=
            ctype = headers.get("content-type", "")
            model = model_named(ctype, body, dict(query))  # 400 for a body that is not JSON
            data = {} if ctype.lower().startswith("multipart/") else json.loads(body or b"{}")  # read: valid
            data = data if isinstance(data, dict) else {}
            if model is None and path.startswith("/api/") and isinstance(data.get("name"), str) and data["name"]:
                model = data["name"]  # Ollama's bodies name it so too
            # Ollama's chat and generate stream unless told not to
            stream = data.get("stream") is True or (path in ("/api/chat", "/api/generate")
                                                    and data.get("stream") is not False)
        if model is None and method == "GET" and path in ("/props", "/metrics"):
            return JSONResponse({"role": "router", "cluster": True, "nodes": sorted(await asyncio.to_thread(node_ids))})
        if model is None and method == "GET" and path in OLLAMA_LISTS:  # every node's list, each name once
            per_node = await self._ask_all(plain)
            listed = [m for _, r in sorted(per_node.items()) for m in r.get("models", ())]
            if path == "/api/tags":  # a model is listed once; a loaded one (ps) once a node it is loaded on
                listed = list({m.get("name"): m for m in listed}.values())
            return JSONResponse({"models": listed})
        if model is None and method == "GET" and path == "/api/version":
            return await self._respond(replace(plain, node=min(await asyncio.to_thread(node_ids))), None)
        if model is None:
            raise ApiError(400, "'model' is required (a model id from GET /v1/models)", param="model")
        if method == "POST" and path.startswith("/slots/"):
            return await self._slot_action(plain, model)
        # Ollama's load (or with keep_alive 0, unload), without a prompt, is not repeatable
        repeats = endpoints.repeatable(method, path, headers) and not endpoints.load_only(path, data)
        return await self._respond(replace(plain, model=model), model, stream=stream, repeats=repeats)

    async def _respond(self, plain: NodeRequest, model: str | None, stream: bool = True,
                       repeats: bool = False) -> Response:
        """``plain`` on the node the request router picks; a node that refuses it before
        doing anything (507: it never fits there; 429 or 503: its queue is full, or it
        cannot serve it now) is left out of the next attempt, each node once, until every
        node has refused: then 507 with each node's figures where every one said 507, else
        the last refusal as that node gave it.  A node lost before its reply began
        (failover.py), or silent (no item for answer.SILENT seconds; no replica took the
        request within ACCEPT_TIMEOUT), is left out and the request sent to another, once,
        with the seconds it waited, where it is ``repeats`` (endpoints.repeatable) and no
        node had claimed its ticket (ray/ledger.py: the abandon that says so also forbids
        a later claim).  A request that does not ask for a stream takes its reply in one
        piece (Started, then one message, not one per chunk)."""
        refusals = NodeRefusals(model)
        arrived = time.monotonic()
        retried: str | None = None  # the lost nodes, once the request was sent on
        misdirected = 0  # 421s from a replica of another node
        # runs only once its node claimed it in the ledger: lost or silent, it is sent on only if none had
        ticketed = repeats and model is not None and plain.node is None and plain.method == "POST" \
            and endpoints.takes_slot(plain.path)
        while True:
            plain = replace(plain, exclude=plain.exclude | self._lost.now(), whole=not stream,
                            ticket=self._issue() if ticketed else None,
                            ledger=self._ledger if ticketed else None)  # its ledger for good
            reply = await self._attempt(plain, model, retried, repeats)
            if isinstance(reply, str):  # lost or silent before it began: sent on
                retried, plain = reply, replace(plain, waited=time.monotonic() - arrived)
                continue
            head, rest, began = reply
            self._actors[head.actor] = head.node
            if head.status == 421 and plain.node is not None:
                if misdirected < 2:
                    misdirected += 1  # another replica took a call meant for one node (Serve swaps them): again
                    continue
                raise ApiError(502, f"node {plain.node} has no replica that takes requests now (lost, or not "
                                    f"placed yet)", "server_error", "node_died")
            # a refusal before anything ran (507: never fits there; 429: its queue is full) is tried
            # elsewhere; a 503 may come after the engine had it (its worker died): repeatable ones only;
            # a request for one node is that node's answer
            if head.status not in (RETRIED if repeats else NOTHING_RAN) or model is None or began \
                    or plain.node is not None:
                return await relay(head, rest, model, retried, self._lost_under_stream)
            repeated = await refusals.add(head, rest)  # the request router had no other node left
            alive = set(await asyncio.to_thread(node_ids))  # (Ray's GCS asked: not in the event loop)
            if repeated or alive - self._lost.now() <= refusals.nodes():
                return await refusals.answer(alive & self._lost.now() - refusals.nodes(), retried)
            plain = replace(plain, exclude=plain.exclude | {head.node}, waited=time.monotonic() - arrived)

    def _issue(self) -> int:
        """The next attempt's ticket (ledger.py), in flight from now."""
        self._issued += 1
        self._in_flight[self._issued] = None
        return self._issued

    async def _attempt(self, plain: NodeRequest, model: str | None, retried: str | None,
                       repeats: bool) -> tuple[Head, Any, bool] | str:
        """One attempt of ``plain``, read up to its Head: the Head, the rest of the reply
        (its body whole, or the stream of its chunks) and whether it began (Started seen,
        or the ledger says claimed); or, where it is to be sent on (its node lost or silent
        before it began), the nodes lost under it for its header.  Its ticket, if any, is
        settled whatever comes."""
        replies = self.nodes.options(stream=True).handle.remote(plain)
        began, at = False, None  # Started seen (or the ledger says claimed); the node that took it
        headed = False
        try:
            first = await next_item(replies, ACCEPT_TIMEOUT)
            if isinstance(first, Accepted):
                at = first.node
                self._actors[first.actor] = first.node
                first = await next_item(replies)
            while isinstance(first, Started):
                began = True
                first = await next_item(replies)
            headed = True
        except asyncio.CancelledError:  # the client left: the node stops the request
            replies.cancel()
            raise
        except Silent:  # no replica took it in time, or the one that did stopped answering
            replies.cancel()
            began = began or await self._given_up(plain)
            return self._after_silence(plain, model, began, retried, repeats, at)
        except StopAsyncIteration:  # the node's reply ended before it began
            raise ApiError(502, f"the node serving '{model or plain.path}' ended its reply before it began",
                           "server_error", "node_died") from None
        except (RayError, RayServeException) as e:
            replies.cancel()  # a node only unreachable for a while stops it too
            began = began or await self._given_up(plain)
            return await self._after_failure(plain, model, e, began, retried, repeats, at)
        finally:
            if plain.ticket is not None:  # nothing asks about its claim any more; one never made is refused
                self._in_flight.pop(plain.ticket, None)
                if not headed:
                    plain.ledger.abandon.remote(plain.ticket, self._low())
                plain.ledger.settle.remote(plain.ticket, self._low())
        head, rest = first if isinstance(first, tuple) else (first, replies)
        return head, rest, began

    async def _after_failure(self, plain: NodeRequest, model: str | None, e: BaseException, began: bool,
                             retried: str | None, repeats: bool, at: str | None) -> str:
        """A call that failed (``e``) before its Head: 500 where the node's app failed it,
        503 where its node is only unreachable for now (it stays in), else its node is lost
        and the request's fate is ``_sent_on``'s."""
        kind = failover.kind_of(e)
        if kind == failover.UNSURE:  # unreachable: lost if its node does not answer a ping
            kind = await self._confirmed(e, at)
        if kind == failover.APP:  # the node's app failed the request: no node was lost
            cause = getattr(e, "cause", None) or e
            raise ApiError(500, f"the node serving '{model or plain.path}' failed the request: "
                                f"{type(cause).__name__}: {cause}", "server_error") from None
        if kind == failover.TRANSIENT:  # not a loss: the node stays in, the client tries again
            raise ApiError(503, f"{node_named(at)} serving '{model or plain.path}' is unavailable for "
                                f"now ({type(e).__name__}): {fate(began, repeats, at)}", "server_error",
                           "node_unavailable", headers={"Retry-After": "5"}) from None
        return await self._sent_on(plain, model, e, began, retried, repeats, at)

    async def _confirmed(self, e: BaseException, at: str | None) -> str:
        """LOST where the node of a call that found its replica unreachable (``at``, or the
        one its actor's replies named) does not answer a ping now; TRANSIENT where it does."""
        node = at or self._actors.get(getattr(e, "actor_id", None) or "")
        before = self._lost.now()
        lost = await self._find_lost(time.monotonic())
        if (node in lost) if node is not None else bool(lost - before):
            return failover.LOST
        return failover.TRANSIENT

    def _low(self) -> int:
        """The lowest ticket still in flight (tickets are issued in order), else the next."""
        return next(iter(self._in_flight), self._issued + 1)

    async def _given_up(self, plain: NodeRequest) -> bool:
        """The attempt ``plain`` given up in its own ledger: True where its node had claimed
        it (it may have run there), or the ledger does not say; False where no node had
        (none will now).  No ticket: False (a request that is not sent on, or a read)."""
        if plain.ticket is None:
            return False
        try:
            return bool(await asyncio.wait_for(plain.ledger.abandon.remote(plain.ticket, self._low()), ASK_TIMEOUT))
        except (asyncio.TimeoutError, RayError):
            return True

    def _after_silence(self, plain: NodeRequest, model: str | None, began: bool, retried: str | None,
                       repeats: bool, at: str | None) -> str:
        """A call with no item for its deadline: no replica took it (``at`` None), or the
        node that did (``at``, held out now) stopped answering.  Sent on (the nodes for its
        header) where it had not begun and may be repeated, once; else 504, saying whether
        it may have run there."""
        if at is not None:
            self._lost.add({at})
        for_model = model is not None and plain.node is None
        if failover.after_loss(began, retried is not None, for_model, repeats) == failover.RETRY:
            _LOG.warning("%s did not answer a request for '%s' in time: sent on", node_named(at), model)
            return at or "unknown"
        what = model or plain.path
        if at is None:
            raise ApiError(504, f"no node took the request for '{what}' within {ACCEPT_TIMEOUT:g} s: its "
                                f"replica does not answer, or has more requests than it takes at once "
                                f"({fate(began, repeats, at)})", "server_error", "node_timeout")
        raise ApiError(504, f"{node_named(at)} serving '{what}' stopped answering ({fate(began, repeats, at)})",
                       "server_error", "node_timeout")

    def _lost_under_stream(self, e: BaseException, node: str) -> None:
        """A stream's node failed after its status: left out where it is lost (unreachable:
        the nodes are pinged, and left out if they do not answer)."""
        kind = failover.LOST if isinstance(e, Silent) else failover.kind_of(e)
        if kind == failover.LOST:
            self._lost.add({node})
        elif kind == failover.UNSURE:
            asyncio.ensure_future(self._find_lost(time.monotonic()))

    async def _sent_on(self, plain: NodeRequest, model: str | None, e: BaseException, began: bool,
                       retried: str | None, repeats: bool, at: str | None) -> str:
        """A call lost with its node (``e``; ``at``: the node that took it, if it said so):
        the node left out, and the request's fate (failover.after_loss): 502 node_died,
        naming the node and whether the work may have run there, or the nodes lost under
        it for its header when it is to be sent on (``unknown`` where none was named: the
        router picks again)."""
        failed_at, before = time.monotonic(), self._lost.now()
        named = self._lose(getattr(e, "actor_id", None))
        if at is not None and not named:
            self._lost.add({at})
            named = frozenset({at})
        named = named or await self._find_lost(failed_at) - before
        at = at or (next(iter(named)) if len(named) == 1 else None)
        for_model = model is not None and plain.node is None  # a question for one node is not sent on
        if failover.after_loss(began, retried is not None, for_model, repeats) == failover.FAIL:
            raise ApiError(502, lost_message(model or plain.path, e, began, retried, repeats, at), "server_error",
                           "node_died")
        lost = ",".join(sorted(named)) or "unknown"
        _LOG.warning("a node was lost before it answered a request for '%s' (lost: %s): sent on", model, lost)
        return lost

    def _lose(self, actor: str | None) -> frozenset[str]:
        """A failed call's replica (``actor``): its node, left out at once, where a reply of
        that replica has named it; empty where none has (the nodes are then asked)."""
        node = self._actors.get(actor or "")
        if node is None:
            return frozenset()
        self._lost.add({node})
        return frozenset({node})

    async def _find_lost(self, failed_at: float) -> frozenset[str]:
        """The nodes lost now, for a call that failed at ``failed_at``: every node not left
        out yet is asked, in a round begun after that (one round at a time, however many
        requests failed at once); a node whose replica does not answer within PING_TIMEOUT
        is left out (failover.LostNodes)."""
        while True:
            began, probing = self._probing
            if probing is not None and began >= failed_at:
                try:
                    await asyncio.shield(probing)
                except Exception as e:  # noqa: BLE001 - the round failed (the cluster's state unreadable)
                    _LOG.warning("the nodes could not be asked: %s: %s", type(e).__name__, e)
                return self._lost.now()
            if probing is None or probing.done():
                self._probing = (time.monotonic(), asyncio.ensure_future(self._probe()))
            else:  # a round begun before this failure may have found that node alive: the next one
                await asyncio.wait({probing})

    async def _probe(self) -> None:
        gone = set()
        for node in await asyncio.to_thread(node_ids):  # one after the other: see _ask_all
            if node in self._lost.now():
                continue
            for _ in range(PINGS):
                try:
                    answer = await asyncio.wait_for(
                        self.nodes.ping.remote(NodeRequest("GET", "/ping", node=node)), PING_TIMEOUT)
                except (asyncio.TimeoutError, RayError, RayServeException):
                    gone.add(node)  # no answer
                    break
                if answer == node:
                    break
            else:  # another node's answer each time: it has no replica now (not a call Serve swapped)
                gone.add(node)
        self._lost.add(gone)

    async def _ask_all(self, plain: NodeRequest) -> dict[str, Any]:
        """``plain`` on every node: {node: its JSON answer}; a node that cannot answer
        gives its error instead.  One node after the other: calls made while one request
        is handled share its request id, and Serve's router matches a chosen replica to
        a waiting call by that id, so two such calls routed at once could swap nodes."""
        async def one(node: str) -> Any:
            for _ in range(2):  # 421: another replica took it (Serve gave it a request routed at once); again
                replies = self.nodes.options(stream=True).handle.remote(replace(plain, node=node))
                head = await replies.__anext__()
                while isinstance(head, (Accepted, Started, Beat)):  # a management question's reply: its Head next
                    head = await replies.__anext__()
                data = b"".join([c async for c in chunks_of(replies)])
                if head.status != 421:
                    break
            if head.status == 200:
                try:
                    return json.loads(data)
                except ValueError:
                    pass
            return {"error": data.decode(errors="replace")}

        answers: dict[str, Any] = {}
        lost = self._lost.now()
        for node in await asyncio.to_thread(node_ids):  # one held out is asked too (briefly): its models stay visible
            try:
                answers[node] = await asyncio.wait_for(one(node), PING_TIMEOUT if node in lost else ASK_TIMEOUT)
            except (asyncio.TimeoutError, RayError, RayServeException) as e:
                answers[node] = {"error": f"node did not answer: {type(e).__name__}"}
                if isinstance(e, asyncio.TimeoutError) and node not in lost:
                    self._lost.add({node})  # silent (a hold over, not back): held again, asked briefly
            if node in lost:
                answers[node] = {**answers[node], "held": True}
        return answers

    async def _cluster_view(self, plain: NodeRequest) -> Response:
        if plain.path == "/devices":
            return JSONResponse(cluster.merge_devices(await self._ask_all(plain)))
        if plain.path == "/events":
            per_node = await self._ask_all(plain)
            return JSONResponse({"data": [{**e, "node": n} for n, r in sorted(per_node.items())
                                          for e in r.get("data", [])]})
        merged = cluster.merge_models(await self._ask_all(replace(plain, path="/models")))
        return JSONResponse(merged if plain.path == "/models" else cluster.openai_models(merged))

    async def _unload(self, plain: NodeRequest) -> Response:
        model = json_object(plain.body).get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "'model' is required", param="model")
        per_node = await self._ask_all(NodeRequest("GET", "/models"))
        where = [n for n, r in per_node.items() for e in r.get("data", [])
                 if (e["id"] == model or model in e.get("aliases", ())) and e["status"]["value"] == "loaded"]
        results = [await self._respond(replace(plain, node=n), model) for n in where]
        return JSONResponse({"success": any(r.status_code == 200 for r in results), "nodes": sorted(where)})

    async def _slot_action(self, plain: NodeRequest, model: str) -> Response:
        """POST /slots/{id}: one node's engine (its slot files are there), the one where the
        model is loaded; never sent to another (a save lost on one node is not another's)."""
        per_node = await self._ask_all(NodeRequest("GET", "/models"))
        where = sorted(n for n, r in per_node.items() for e in r.get("data", [])
                       if (e["id"] == model or model in e.get("aliases", ())) and e["status"]["value"] == "loaded")
        if not where:  # loaded nowhere: the node the model goes to (as any request for it), never another after
            return await self._respond(replace(plain, model=model), model, repeats=False)
        if len(where) > 1:
            raise ApiError(409, f"a slot action acts on one node's engine: model '{model}' is loaded on nodes "
                                f"{', '.join(where)}; name one with ?node=", code="node_required", param="node")
        return await self._respond(replace(plain, node=where[0], model=model), None)


def _new_ledger():
    """A Ledger actor on this node (the ingress's): it lives and dies with the ingress."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(Ledger).options(num_cpus=0, scheduling_strategy=here).remote()


def node_ids() -> list[str]:
    """The alive nodes that carry a replica's resource."""
    return [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(NODE_RESOURCE)]
