"""A model's request as the server takes it: its path chosen in one place, its metrics recorded
and the request ended once.

    _Guard ──POST to an engine route──▶ Dispatch.engine_post ──choose──▶
        session: a resumable stream's turn (X-Conversation-Id of a listed model): relayed,
                 its model remembered, a stop withdrawing it (router/services/conversations.py)
        native:  answered by the model's worker on the client's connection itself
                 (Router.arelay with Ask.hand; server/connection.py's Handover), relayed where it cannot be
        relayed: Router.arelay ──(reply, stream)──▶ server/relay.py writes it
    server/connection.py ──a whole POST, nothing to wait for──▶ Dispatch.take: the native path
        without a task (Router.serve_now), or False: the task's (engine_post)
    GET engine routes, the management API ──▶ Dispatch.forward (relayed)

Every request's end goes through ``Dispatch._end``: one observation of its status and time.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable
from urllib.parse import parse_qsl

from fastapi import Request
from fastapi.responses import Response

from pyllmrouter.errors import RouterError, WorkerDied
from pyllmrouter.router.api import Router
from pyllmrouter.router.exchange import Ask, Hand
from pyllmrouter.router.workers.conduit import Connection, Served
from pyllmrouter.server.api_errors import ApiError, error_response, from_router_error
from pyllmrouter.server.body import departed, engine_body, json_value, model_in, replay
from pyllmrouter.server.connection import HANDOVER, Handover
from pyllmrouter.server.forwarded import forwarded_of
from pyllmrouter.server.metrics import Metrics
from pyllmrouter.server.relay import relay

__all__ = ["Dispatch", "CORS_HEADERS", "MAX_CONVERSATION_ID", "NOT_FORWARDED", "query_of", "autoload_of"]

CORS_HEADERS = "pyllmrouter.cors"  # scope extension: the CORS headers a response gets
MAX_CONVERSATION_ID = 256  # characters of an X-Conversation-Id (a UUID has 36)
# request headers that stay here: the connection's own, and the router's secrets
NOT_FORWARDED = frozenset({"host", "content-length", "connection", "transfer-encoding", "authorization", "x-api-key",
                           "cookie", "keep-alive", "upgrade", "te", "trailer", "proxy-authorization"})

SESSION, NATIVE, RELAYED = "session", "native", "relayed"  # the paths a model's request takes


class Dispatch:
    """The paths of a model's request (native, relayed, session), chosen in ``_path``; each
    request's status and time observed once, in ``_end``."""

    def __init__(self, router: Router, metrics: Metrics, *, native: bool, follow_ms: int, max_body: int,
                 write_timeout: float | None):
        """``native``: a worker answers a model's request on the client's connection itself
        where it can; ``follow_ms``: how often such a worker, reading the connection's next
        requests like the last itself, tells the router of its answers (0: never);
        ``write_timeout``: a relay's writes (llama-server's --timeout)."""
        self._router = router
        self._metrics = metrics
        self._native = native
        self._follow_ms = follow_ms
        self._max_body = max_body
        self._write_timeout = write_timeout

    # -- the choice --------------------------------------------------------------------------

    def _path(self, listed: str | None, files: bool, handover: Handover | None) -> str:
        """The path of a request: a session where its conversation's model is listed, native
        where this server hands connections over and this one can be (no files: a multipart
        body is relayed), else relayed (a model nobody lists remembers nothing: the request's
        404 is all it gets)."""
        if listed is not None:
            return SESSION
        if self._native and handover is not None and not files and handover.usable:
            return NATIVE
        return RELAYED

    def _end(self, model: str, endpoint: str, status: Any, seconds: float) -> None:
        """A request's end: its status and the seconds it took observed."""
        self._metrics.observe(model, endpoint, str(status), seconds)

    async def engine_post(self, scope, receive, send, headers: dict[str, str], raw: bytes) -> None:
        """A POST to one of a model's llama-server endpoints, in plain ASGI: the hot path
        takes no routing, dependency solving or request object (the guard has checked key
        and length, and gives the headers by lower-case name and the body it read)."""
        query = query_of(scope)
        try:
            raw, files, data = engine_body(headers.get("content-type", ""), raw)
            model = model_in(data, query)
            if not model:
                raise ApiError(400, "'model' is required (a model id from GET /v1/models), in the body or as "
                                    "?model=", param="model")
            conv_id = headers.get("x-conversation-id")
            if conv_id and len(conv_id) > MAX_CONVERSATION_ID:
                raise ApiError(400, f"X-Conversation-Id is {len(conv_id)} characters long, more than the "
                                    f"{MAX_CONVERSATION_ID} a conversation id may have", param="X-Conversation-Id")
            # a session's stream survives the connection: GET /v1/stream finds it at this model
            listed = self._router.scheduler.canonical(model) if conv_id else None
            handover = scope.get("extensions", {}).get(HANDOVER)
            path = self._path(listed, bool(files), handover)
            if path == SESSION:
                response = await self._session(Request(scope, replay(raw, receive)), model, listed, conv_id, raw,
                                               files)
            elif path == NATIVE:
                response = await self._hand_over(scope, receive, model, raw, headers, query, handover)
                if response is None:
                    return  # the worker answered on the connection itself
            else:
                response = await self.forward(Request(scope, replay(raw, receive)), model, raw, files=files)
        except ApiError as e:
            response = error_response(e)
        await response(scope, receive, send)

    def take(self, scope, headers: dict[str, str], raw: bytes, handover: Handover,
             answer: Callable[[Callable], None]) -> bool:
        """``engine_post``'s native path where nothing need wait, without a coroutine or a
        task (server/connection.py): a JSON body naming its model, no conversation id, a
        model that can take the request now and a worker that takes the connection: handed
        over (True).  Anything else is the task's (False: nothing was done).  The worker's
        answer completes the request in a callback; a worker that died before it wrote has
        ``answer`` write the error a relay would give."""
        if "x-conversation-id" in headers or self._path(
                None, headers.get("content-type", "").lower().startswith("multipart/form-data"), handover) != NATIVE:
            return False
        try:
            data = json_value(raw)
        except ApiError:
            return False  # the task answers the 400
        query = query_of(scope)
        model = model_in(data, query)
        if not model:
            return False
        endpoint = scope["path"]
        named = data.get("model") if isinstance(data, dict) else None
        kept = {k: v for k, v in headers.items() if k in NOT_FORWARDED}  # the engine's copy has the rest
        follow = handover.follow(kept, named if isinstance(named, str) else "", self._max_body, self._follow_ms)
        t0 = time.perf_counter()
        lead, first = 0.0, True  # the router's part of the first request's time; that one not counted yet

        def count(answers: tuple[tuple[int, int, float], ...]) -> None:
            """The answers a worker following the connection lists (as it goes, then as it gives
            the connection back): each timed and logged; the first is the one handed over."""
            nonlocal first
            for i, (status, written, seconds) in enumerate(answers):
                self._end(model, endpoint, status or 502, seconds + (lead if first and i == 0 else 0.0))
                handover.logged(status, written)
            self._metrics.native.inc(len(answers))
            self._metrics.followed.inc(len(answers) - (1 if first else 0))
            first = False

        connection = Connection(handover.keep_alive, (), handover.begin, handover.undo)
        served = self._router.serve_now(Ask(model, "POST", endpoint, raw, engine_query(query), engine_headers(headers),
                                            hand=Hand(connection, "", follow, count if follow is not None else None)))
        if served is None:
            return False
        lead = time.perf_counter() - t0

        def done(fut: asyncio.Future) -> None:
            failed = None if fut.cancelled() else fut.exception()
            out = fut.result() if not fut.cancelled() and failed is None else None
            err = self._handed_back(model, endpoint, t0, handover, out, failed, count)
            if err is not None:
                answer(error_response(err))
        served.add_done_callback(done)
        return True

    # -- relayed ------------------------------------------------------------------------------

    async def forward(self, request: Request, model: str, raw: bytes, autoload: bool | None = None,
                      gone: Callable[[], Awaitable[Any]] | None = None,
                      files: dict[str, tuple[str, str, bytes]] | None = None,
                      leased: Callable[[str], None] | None = None, prefer: str | None = None) -> Response:
        """The request to ``model``'s engine, with its client's headers; its reply unchanged.
        ``gone``: what withdraws the request before it reaches the engine (default: the
        client's disconnect)."""
        t0 = time.perf_counter()
        endpoint, query, headers = for_engine(request)
        relayed = forwarded_of(request.scope)
        ask = Ask(model, request.method, endpoint, raw, query, headers, files,
                  autoload=autoload_of(request.query_params.get("autoload")) if autoload is None else autoload,
                  raise_for_status=False, gone=gone or (lambda: departed(request.receive)), leased=leased,
                  prefer=prefer, waited=relayed.waited if relayed is not None else 0.0,
                  running=relayed.running if relayed is not None else None)
        try:
            reply, stream = await self._router.arelay(ask)
        except RouterError as e:
            err = from_router_error(e)
            self._end(model, endpoint, err.status, time.perf_counter() - t0)
            raise err from None
        return self._relayed(model, endpoint, t0, reply, stream)

    def _relayed(self, model: str, endpoint: str, t0: float, reply: Any, stream: Any) -> Response:
        """The response of a relayed reply, its end observed once it is written."""
        self._metrics.relayed.inc()
        return relay(reply, stream, lambda code: self._end(model, endpoint, code, time.perf_counter() - t0),
                     self._write_timeout)

    # -- native -------------------------------------------------------------------------------

    async def _hand_over(self, scope, receive, model: str, raw: bytes, headers: dict[str, str],
                         query: dict[str, str], handover: Handover) -> Response | None:
        """The request answered by its model's worker on the client's connection (None once it
        has: the native data path, router/workers/conduit.py), or relayed where the worker
        cannot take the connection now (the response to write)."""
        t0 = time.perf_counter()
        endpoint = scope["path"]
        began = False  # the connection is the worker's (until undone)

        def begin() -> int | None:
            nonlocal began
            fd = handover.begin()
            began = fd is not None
            return fd

        def undo() -> None:
            nonlocal began
            began = False
            handover.undo()

        extra = tuple((k.decode("latin-1"), v.decode("latin-1"))
                      for k, v in scope.get("extensions", {}).get(CORS_HEADERS, ()))
        connection = Connection(handover.keep_alive, extra, begin, undo)
        try:
            out = await self._router.arelay(Ask(model, "POST", endpoint, raw, engine_query(query),
                                                engine_headers(headers), autoload=autoload_of(query.get("autoload")),
                                                raise_for_status=False, gone=lambda: departed(receive),
                                                hand=Hand(connection)))
        except asyncio.CancelledError:
            if began:
                self._handed_back(model, endpoint, t0, handover, None, None)
            raise
        except RouterError as e:
            if not began:
                err = from_router_error(e)
                self._end(model, endpoint, err.status, time.perf_counter() - t0)
                raise err from None
            err = self._handed_back(model, endpoint, t0, handover, None, e)
            if err is not None:
                raise err from None
            return None
        if isinstance(out, Served):
            self._handed_back(model, endpoint, t0, handover, out, None)
            return None
        reply, stream = out
        return self._relayed(model, endpoint, t0, reply, stream)

    def _handed_back(self, model: str, endpoint: str, t0: float, handover: Handover, out: Served | None,
                     failed: BaseException | None, count: Callable[[tuple], None] | None = None) -> ApiError | None:
        """The end of a request handed over to a worker (``_hand_over``, ``take``): its answer
        counted (by ``count`` where the worker read the next requests itself and lists the
        answers) and the connection the router's again (None); or, for a worker
        that died before it wrote a byte, the connection taken back unused and the error a
        relay gives, for the caller to write.  Anything else (no answer, or one cut short):
        502, and the connection closes, since the worker may have written part of a response."""
        if out is not None:
            if out.answers is not None and count is not None:
                count(out.answers)
            else:
                self._end(model, endpoint, out.status or 502, time.perf_counter() - t0)
                self._metrics.native.inc()
                handover.logged(out.status, out.bytes)
            handover.finish(out.keep)
            return None
        if isinstance(failed, WorkerDied) and handover.untouched():
            handover.undo()
            err = from_router_error(failed)
            self._end(model, endpoint, err.status, time.perf_counter() - t0)
            return err
        self._end(model, endpoint, 502, time.perf_counter() - t0)
        handover.finish(False)
        return None

    # -- session ------------------------------------------------------------------------------

    async def _session(self, request: Request, model: str, listed: str, conv_id: str, raw: bytes,
                       files: dict[str, tuple[str, str, bytes]]) -> Response:
        """A request of a resumable stream, as llama-server's router takes it: its model (by
        its listed name) is remembered before the wait for a load, a client that drops
        meanwhile does not withdraw it (its stream is still wanted: a page reload), a stop
        does (DELETE /v1/stream), answered with llama-server's error."""
        loop = asyncio.get_running_loop()
        stopped = loop.create_future()

        def stop() -> None:
            loop.call_soon_threadsafe(lambda: stopped.done() or stopped.set_result(None))

        conversations = self._router.conversations
        last = conversations.owner(conv_id)  # the instance that served it last: its prompt is cached there
        ticket = conversations.remember(conv_id, listed)
        off = conversations.on_end(conv_id, ticket, stop)
        try:
            return await self.forward(request, model, raw, gone=lambda: asyncio.shield(stopped), files=files,
                                      leased=lambda instance: conversations.served_by(conv_id, ticket, instance),
                                      prefer=last)
        except ApiError as e:
            if e.status == 499 and stopped.done():
                raise ApiError(400, "request cancelled by a stop while the model was loading") from None
            raise
        finally:
            off()


def for_engine(request: Request) -> tuple[str, dict[str, str], dict[str, str]]:
    """(path, query, headers) of a request as its model's engine gets it: the router's own
    query parameters and the headers that stay here left out."""
    return (request.scope["path"], engine_query(dict(request.query_params.items())),
            engine_headers(dict(request.headers.items())))


def engine_query(query: dict[str, str]) -> dict[str, str]:
    """A request's query parameters as its model's engine gets them: the router's own left out."""
    return {k: v for k, v in query.items() if k not in ("model", "autoload")}


def engine_headers(headers: dict[str, str]) -> dict[str, str]:
    """A request's headers (by lower-case name) as its model's engine gets them: those that
    stay here left out."""
    return {k: v for k, v in headers.items() if k not in NOT_FORWARDED}


def query_of(scope) -> dict[str, str]:
    """A request's query parameters, as Starlette reads them (latin-1, blank values kept, the
    last of a name given twice)."""
    raw = scope.get("query_string", b"")
    return dict(parse_qsl(raw.decode("latin-1"), keep_blank_values=True)) if raw else {}


def autoload_of(value: str | None) -> bool | None:
    """?autoload= as llama-server's router reads it (absent: None, the router's default)."""
    return None if value is None else value.lower() in ("1", "true", "yes", "on")
