"""The HTTP server: every llama-server endpoint of a model, llama-server's router API, and ours.

    client ──HTTP──▶ guard (API key, body limit) ──▶ per-model request: the model named by the
                     body's "model" (POST, taken by the guard past FastAPI's routing) or
                     ?model= (GET), as llama-server's router picks it
                       ──▶ Router.arelay(model, method, path, body) ──▶ the model's engine
                       ◀── llama.cpp's status, headers and body, written unchanged; a stream
                           chunk by chunk as the engine yields it; a client that leaves cancels

| endpoint                          | what                                              |
| GET  /health                      | liveness (no API key needed)                      |
| GET  /, /ui/*                     | the page (server/page.py; no key: it asks for it) |
| GET  /v1/models[/{id}]            | OpenAI model list, one model                      |
| POST (endpoints.ENGINE_POST)      | llama-server's handler of the model: OpenAI chat, |
|                                   | completions, responses, embeddings; Anthropic     |
|                                   | messages; rerank, tokenize, infill, slots...      |
| GET  /props, /slots, /lora-adapters, /metrics ?model= | the same, for one model       |
| GET  /props?model=                | the model's properties                            |
| GET  /metrics                     | Prometheus                                        |
| the router's management API       | server/manage.py: the live model list, pulls,     |
|                                   | /models/sse, router /props, resumable streams,    |
|                                   | devices and events                                |
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, Awaitable, Callable
from urllib.parse import parse_qsl

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pyllmrouter.endpoints import ENGINE_GET, LABELLED, is_engine_post
from pyllmrouter.errors import RouterError, UnknownModel, WorkerDied
from pyllmrouter.router.api import Router
from pyllmrouter.server import manage, ollama, page
from pyllmrouter.server.api_errors import ApiError, error_response, from_router_error
from pyllmrouter.router.services.tools import Services
from pyllmrouter.server.body import (BODY_METHODS, departed, engine_body, json_object, json_value, model_in,
                                    read_or_refuse, replay)
from pyllmrouter.router.workers.conduit import Connection, Served
from pyllmrouter.server.browser import LOCAL_ORIGINS, Gate, Blocked
from pyllmrouter.server.connection import HANDOVER, Handover, HttpProtocol
from pyllmrouter.server.forwarded import forwarded_of
from pyllmrouter.server.cors import Cors
from pyllmrouter.server.relay import relay
from pyllmrouter.server.metrics import Metrics

__all__ = ["create_app", "guard_error", "HTTP_PROTOCOL", "DEFAULT_HEADERS"]

# uvicorn's protocol for every server of this app: its httptools protocol (the fastest it has),
# whose connections a request can hand over to a worker (server/connection.py)
HTTP_PROTOCOL = HttpProtocol
# the default headers of every answer (uvicorn.Config's headers), as a worker writes them on
# the native path (csrc/conduit.cpp, stamp): llama-server's Server; uvicorn adds Date
DEFAULT_HEADERS = [("Server", "llama.cpp")]
CORS_HEADERS = "pyllmrouter.cors"  # scope extension: the CORS headers a response gets

MAX_CONVERSATION_ID = 256  # characters of an X-Conversation-Id (a UUID has 36)
_DISABLED = json.dumps({"error": {"message": "this feature is disabled", "type": "feature_disabled"}}).encode()
PUBLIC = frozenset({"/health", "/v1/health"})  # llama-server's: no API key asked
# request headers that stay here: the connection's own, and the router's secrets
_NOT_FORWARDED = frozenset({"host", "content-length", "connection", "transfer-encoding", "authorization", "x-api-key",
                            "cookie", "keep-alive", "upgrade", "te", "trailer", "proxy-authorization"})
def create_app(router: Router, *, api_key: str | None = None, max_body: int = 8 << 20,
               close_router: bool = True, max_threads: int = 1024, settings: dict[str, Any] | None = None,
               services: Services | None = None, allowed_hosts: frozenset[str] | None = None,
               native: bool = True, follow_ms: int = 0) -> "_Guard":
    """``settings``: what llama.cpp's parser made of the router's llama-server arguments
    (router/services.settings: CORS, more API keys); ``services``: llama-server's /tools
    and /cors-proxy (None: llama-server's 403, the features are off); ``allowed_hosts``:
    the Host names accepted beside the local ones (None: no Host check, see browser.py);
    ``native``: a worker answers a model's request on the client's connection itself where it
    can (router/workers/conduit.py); False: every response is relayed through this process;
    ``follow_ms``: how often such a worker, reading the connection's next requests like the
    last itself, tells the router of its answers (0: it never reads them)."""
    keys = tuple(k for k in ([api_key] if api_key else []) + list((settings or {}).get("api_keys", ())) if k)
    # pages of the local origins only, unless --cors-origins says otherwise ('*': llama-server's default)
    origins = settings["cors_origins"] if settings and settings.get("cors_origins_explicit") else LOCAL_ORIGINS
    cors = Cors({**settings, "cors_origins": origins}) if settings else None
    gate = Gate(origins, allowed_hosts)
    write_timeout = (settings or {}).get("timeout_write") or None  # llama-server's --timeout: a relay's writes
    metrics = Metrics(router.status, LABELLED, router.scheduler.canonical)
    router.scheduler.on_wait = lambda model, s: metrics.queue_wait.labels(model).observe(s)

    @asynccontextmanager
    async def lifespan(_app):
        # a request for a model that cannot take it at once waits for its lease in a
        # thread: the default pool (cpu count + 4) would make the fifth such wait queue
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="router-call"))
        yield
        if services is not None:
            await asyncio.to_thread(services.close)
        if close_router:  # after uvicorn has drained requests in flight
            await asyncio.to_thread(router.close)

    app = FastAPI(title="pyllmrouter", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _api_error(_req, e: ApiError):
        return error_response(e)

    async def body(request: Request) -> dict[str, Any]:
        return json_object(await request.body())  # the guard has read it, within the limit

    def autoload_param(request: Request) -> bool | None:
        return _autoload(request.query_params.get("autoload"))

    async def forward(request: Request, model: str, raw: bytes, autoload: bool | None = None,
                      gone: Callable[[], Awaitable[Any]] | None = None,
                      files: dict[str, tuple[str, str, bytes]] | None = None,
                      leased: Callable[[str], None] | None = None, prefer: str | None = None) -> Response:
        """The request to ``model``'s engine, with its client's headers; its reply unchanged.
        ``gone``: what withdraws the request before it reaches the engine (default: the
        client's disconnect)."""
        t0 = time.perf_counter()
        endpoint, query, headers = _for_engine(request)
        relayed = forwarded_of(request.scope)
        try:
            reply, stream = await router.arelay(model, request.method, endpoint, raw, query,
                                               autoload=autoload_param(request) if autoload is None else autoload,
                                               gone=gone or (lambda: _disconnected(request)), headers=headers,
                                               files=files, leased=leased, prefer=prefer, raise_for_status=False,
                                               waited=relayed.waited if relayed is not None else 0.0,
                                               running=relayed.running if relayed is not None else None)
        except RouterError as e:
            err = from_router_error(e)
            metrics.observe(model, endpoint, str(err.status), time.perf_counter() - t0)
            raise err from None
        metrics.relayed.inc()
        return relay(reply, stream, lambda code: metrics.observe(model, endpoint, code, time.perf_counter() - t0),
                     write_timeout)

    async def service(request: Request) -> Response:
        """/tools and /cors-proxy: llama-server's services, or its 403 when they are off."""
        if services is None:  # server.cpp's res_403, without starting a process to say it
            return Response(_DISABLED, 403, media_type="application/json")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        try:
            reply, stream = await services.acall(request.method, request.url.path, await request.body(),
                                                 dict(request.query_params), headers,
                                                 gone=lambda: _disconnected(request))
        except (RouterError, RuntimeError) as e:
            raise from_router_error(e) from None
        return relay(reply, stream, lambda code: None, write_timeout)

    for path in ("/tools", "/cors-proxy"):
        app.add_api_route(path, service, methods=["GET", "POST"], include_in_schema=False)

    async def engine_post(scope, receive, send, headers: dict[str, str], raw: bytes) -> None:
        """A POST to one of a model's llama-server endpoints, in plain ASGI: the hot path
        takes no routing, dependency solving or request object (the guard has checked key
        and length, and gives the headers by lower-case name and the body it read)."""
        query = _query(scope)
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
            listed = router.scheduler.canonical(model) if conv_id else None
            handover = scope.get("extensions", {}).get(HANDOVER)
            if listed is not None:  # its stream survives the connection: GET /v1/stream finds it at this model
                response = await session(Request(scope, replay(raw, receive)), model, listed, conv_id, raw, files)
            elif native and handover is not None and not files and handover.usable:
                response = await hand_over(scope, receive, model, raw, headers, query, handover)
                if response is None:
                    return  # the worker answered on the connection itself
            else:  # a model nobody lists remembers nothing: the request's 404 is all it gets
                response = await forward(Request(scope, replay(raw, receive)), model, raw, files=files)
        except ApiError as e:
            response = error_response(e)
        await response(scope, receive, send)

    async def hand_over(scope, receive, model: str, raw: bytes, headers: dict[str, str], query: dict[str, str],
                        handover: Handover) -> Response | None:
        """The request answered by its model's worker on the client's connection (None once it
        has: the native data path, router/workers/conduit.py), or relayed where the worker cannot take
        the connection now (the response to write)."""
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
            out = await router.aserve(model, "POST", endpoint, raw, _engine_query(query), _engine_headers(headers),
                                      connection, autoload=_autoload(query.get("autoload")),
                                      gone=lambda: departed(receive))
        except asyncio.CancelledError:
            if began:
                handed_back(model, endpoint, t0, handover, None, None)
            raise
        except RouterError as e:
            if not began:
                err = from_router_error(e)
                metrics.observe(model, endpoint, str(err.status), time.perf_counter() - t0)
                raise err from None
            err = handed_back(model, endpoint, t0, handover, None, e)
            if err is not None:
                raise err from None
            return None
        if isinstance(out, Served):
            handed_back(model, endpoint, t0, handover, out, None)
            return None
        reply, stream = out
        metrics.relayed.inc()
        return relay(reply, stream, lambda code: metrics.observe(model, endpoint, code, time.perf_counter() - t0),
                     write_timeout)

    def take(scope, headers: dict[str, str], raw: bytes, handover: Handover,
             answer: Callable[[Callable], None]) -> bool:
        """``engine_post`` and ``hand_over`` where nothing need wait, without a coroutine or
        a task (server/connection.py): a JSON body naming its model, no conversation id, a
        model that can take the request now and a worker that takes the connection: handed
        over (True).  Anything else is the task's (False: nothing was done).  The worker's
        answer completes the request in a callback; a worker that died before it wrote has
        ``answer`` write the error a relay would give."""
        if not native or not handover.usable or "x-conversation-id" in headers or \
                headers.get("content-type", "").lower().startswith("multipart/form-data"):
            return False
        try:
            data = json_value(raw)
        except ApiError:
            return False  # the task answers the 400
        query = _query(scope)
        model = model_in(data, query)
        if not model:
            return False
        endpoint = scope["path"]
        named = data.get("model") if isinstance(data, dict) else None
        kept = {k: v for k, v in headers.items() if k in _NOT_FORWARDED}  # the engine's copy has the rest
        follow = handover.follow(kept, named if isinstance(named, str) else "", max_body, follow_ms)
        t0 = time.perf_counter()
        lead, first = 0.0, True  # the router's part of the first request's time; that one not counted yet

        def count(answers: tuple[tuple[int, int, float], ...]) -> None:
            """The answers a worker following the connection lists (as it goes, then as it gives
            the connection back): each timed and logged; the first is the one handed over."""
            nonlocal first
            for i, (status, written, seconds) in enumerate(answers):
                metrics.observe(model, endpoint, str(status or 502), seconds + (lead if first and i == 0 else 0.0))
                handover.logged(status, written)
            metrics.native.inc(len(answers))
            metrics.followed.inc(len(answers) - (1 if first else 0))
            first = False

        served = router.serve_now(model, "POST", endpoint, raw, _engine_query(query), _engine_headers(headers),
                                  Connection(handover.keep_alive, (), handover.begin, handover.undo),
                                  follow, count if follow is not None else None)
        if served is None:
            return False
        lead = time.perf_counter() - t0

        def done(fut: asyncio.Future) -> None:
            failed = None if fut.cancelled() else fut.exception()
            out = fut.result() if not fut.cancelled() and failed is None else None
            err = handed_back(model, endpoint, t0, handover, out, failed, count)
            if err is not None:
                answer(error_response(err))
        served.add_done_callback(done)
        return True

    def handed_back(model: str, endpoint: str, t0: float, handover: Handover, out: Served | None,
                    failed: BaseException | None, count: Callable[[tuple], None] | None = None) -> ApiError | None:
        """The end of a request handed over to a worker (``hand_over``, ``take``): its answer
        counted (by ``count`` where the worker read the next requests itself and lists the
        answers) and the connection the router's again (None); or, for a worker
        that died before it wrote a byte, the connection taken back unused and the error a
        relay gives, for the caller to write.  Anything else (no answer, or one cut short):
        502, and the connection closes, since the worker may have written part of a response."""
        if out is not None:
            if out.answers is not None and count is not None:
                count(out.answers)
            else:
                metrics.observe(model, endpoint, str(out.status or 502), time.perf_counter() - t0)
                metrics.native.inc()
                handover.logged(out.status, out.bytes)
            handover.finish(out.keep)
            return None
        if isinstance(failed, WorkerDied) and handover.untouched():
            handover.undo()
            err = from_router_error(failed)
            metrics.observe(model, endpoint, str(err.status), time.perf_counter() - t0)
            return err
        metrics.observe(model, endpoint, "502", time.perf_counter() - t0)
        handover.finish(False)
        return None

    async def session(request: Request, model: str, listed: str, conv_id: str, raw: bytes,
                      files: dict[str, tuple[str, str, bytes]]) -> Response:
        """A request of a resumable stream, as llama-server's router takes it: its model (by
        its listed name) is remembered before the wait for a load, a client that drops
        meanwhile does not withdraw it (its stream is still wanted: a page reload), a stop
        does (DELETE /v1/stream), answered with llama-server's error."""
        loop = asyncio.get_running_loop()
        stopped = loop.create_future()

        def stop() -> None:
            loop.call_soon_threadsafe(lambda: stopped.done() or stopped.set_result(None))

        last = router.conversations.owner(conv_id)  # the instance that served it last: its prompt is cached there
        ticket = router.conversations.remember(conv_id, listed)
        off = router.conversations.on_end(conv_id, ticket, stop)
        try:
            return await forward(request, model, raw, gone=lambda: asyncio.shield(stopped), files=files,
                                 leased=lambda instance: router.conversations.served_by(conv_id, ticket, instance),
                                 prefer=last)
        except ApiError as e:
            if e.status == 499 and stopped.done():
                raise ApiError(400, "request cancelled by a stop while the model was loading") from None
            raise
        finally:
            off()

    @app.get("/health")
    @app.get("/v1/health")
    async def health():
        return {"status": "ok"}

    def _openai_model(name: str, m: dict[str, Any]) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "pyllmrouter",
                "status": {"value": m["state"]}}

    @app.get("/v1/models")
    async def v1_models():
        # the listed models (not a removed one still finishing its requests, an extra instance,
        # or a cache model a preset deduplicates)
        listed = {c.name for c in router.models() if not c.hidden}
        return {"object": "list", "data": [_openai_model(n, m) for n, m in router.status()["models"].items()
                                           if n in listed]}

    @app.get("/v1/models/{name:path}")
    async def v1_model(name: str):
        try:  # looked up as a request's name is (an alias of the list, a hidden model, an instance)
            found = router.scheduler.resolve(name).name
        except UnknownModel as e:
            raise from_router_error(e) from None
        st = router.status()["models"]
        if found not in st:
            raise from_router_error(UnknownModel(name, list(router.scheduler.configs())))
        return _openai_model(found, st[found])

    async def engine_get(request: Request) -> Response:
        name = request.query_params.get("model")
        if not name:
            raise ApiError(400, "'?model=' is required: which model's " + request.url.path, param="model")
        return await forward(request, name, b"")

    for path in ENGINE_GET:
        app.add_api_route(path, engine_get, methods=["GET"], include_in_schema=False)

    manage.mount(app, router, forward, body, settings)
    ollama_posts = ollama.mount(app, router)
    page.mount(app)

    @app.get("/metrics")
    async def prometheus(request: Request):
        if request.query_params.get("model"):
            return await engine_get(request)  # llama-server's own counters (needs --metrics)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return _Guard(app, keys, max_body, engine_post, cors, gate, take, ollama_posts)


def _for_engine(request: Request) -> tuple[str, dict[str, str], dict[str, str]]:
    """(path, query, headers) of a request as its model's engine gets it: the router's own
    query parameters and the headers that stay here left out."""
    return (request.scope["path"], _engine_query(dict(request.query_params.items())),
            _engine_headers(dict(request.headers.items())))


def _engine_query(query: dict[str, str]) -> dict[str, str]:
    """A request's query parameters as its model's engine gets them: the router's own left out."""
    return {k: v for k, v in query.items() if k not in ("model", "autoload")}


def _engine_headers(headers: dict[str, str]) -> dict[str, str]:
    """A request's headers (by lower-case name) as its model's engine gets them: those that
    stay here left out."""
    return {k: v for k, v in headers.items() if k not in _NOT_FORWARDED}


def _header_dict(scope) -> dict[str, str]:
    """A request's headers by lower-case name (the last of a name given twice)."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def _query(scope) -> dict[str, str]:
    """A request's query parameters, as Starlette reads them (latin-1, blank values kept, the
    last of a name given twice)."""
    raw = scope.get("query_string", b"")
    return dict(parse_qsl(raw.decode("latin-1"), keep_blank_values=True)) if raw else {}


def _autoload(value: str | None) -> bool | None:
    """?autoload= as llama-server's router reads it (absent: None, the router's default)."""
    return None if value is None else value.lower() in ("1", "true", "yes", "on")


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed its connection (the body is read by then)."""
    await departed(request.receive)


def has_valid_key(headers: dict[str, str], keys: tuple[str, ...]) -> bool:
    """Whether the request carries one of ``keys`` (Bearer token or X-Api-Key)."""
    if not keys:
        return False
    given = headers.get("x-api-key", "")
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        given = auth[7:].strip()
    return any(hmac.compare_digest(given.encode(), k.encode()) for k in keys)


def guard_error(path: str, headers: dict[str, str], api_keys: str | tuple[str, ...] | None,
                max_body: int) -> ApiError | None:
    """The API key and body-size checks of a request (headers by lower-case name; any of
    ``api_keys`` opens it, none: no key asked): the error to answer, or None."""
    keys = (api_keys,) if isinstance(api_keys, str) else tuple(api_keys or ())
    if keys and path not in PUBLIC and not page.is_public(path) and not has_valid_key(headers, keys):
        return ApiError(401, "invalid or missing API key", "authentication_error", "invalid_api_key")
    length = headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_body:
        return ApiError(413, f"request body of {length} bytes exceeds the limit of {max_body}", code="body_too_large")
    return None


class _Guard:
    """The server's ASGI app: CORS, the API key and the body (read whole, counted as it
    comes, refused at the limit) in plain ASGI, in front of the FastAPI app (``app``).  A POST to a model's llama-server endpoint then goes straight
    to ``engine_post``, past FastAPI's and Starlette's middleware, whose wrappers of
    ``send`` would run for every streamed chunk; everything else, lifespan included, is
    the FastAPI app's."""

    def __init__(self, app, api_keys: tuple[str, ...], max_body: int, engine_post, cors: Cors | None = None,
                 gate: Gate | None = None, take=None,
                 posts: dict[str, Callable[[Request], Awaitable[Response]]] | None = None):
        self.app, self.api_keys, self.max_body, self.engine_post = app, api_keys, max_body, engine_post
        self.cors = cors
        self.gate = gate or Gate(LOCAL_ORIGINS, None)
        self._take = take
        self._posts = posts or {}  # more POSTs taken past FastAPI (Ollama's chat, generate, embed)

    def take_whole(self, scope, body: bytes, handover: Handover, answer: Callable[[Callable], None]) -> bool:
        """The hot path without a task (server/connection.py): a POST to a model's endpoint,
        its body whole, from a program (no Origin: no CORS, no origin rules), that passes the
        Host, key and length checks, offered to ``take``.  False: the ASGI app takes it as
        any request (and answers whatever these checks refused)."""
        if self._take is None or scope["method"] != "POST" or not is_engine_post(scope["path"]):
            return False
        headers = _header_dict(scope)
        if "origin" in headers or self.gate.host(headers.get("host")) is not None \
                or guard_error(scope["path"], headers, self.api_keys, self.max_body) is not None:
            return False  # its Content-Length is its body's: the length checked is the body's
        return self._take(scope, headers, body, handover, answer)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = _header_dict(scope)
        host, origin, path = headers.get("host"), headers.get("origin"), scope["path"]
        refused = self.gate.host(host)  # before anything else: DNS rebinding
        if refused is None and self.cors is not None:
            if scope["method"] == "OPTIONS":  # a preflight: answered before the key is asked
                await send({"type": "http.response.start", "status": 200,  # raw: header names as spelled
                            "headers": [(b"content-type", b"text/html"), (b"content-length", b"0"),
                                        *self.cors.headers_for(origin, True)]})
                return await send({"type": "http.response.body", "body": b""})
            if origin is not None:  # a browser's request: the CORS header on its response
                extra = self.cors.headers_for(origin, False)
                send = _with_headers(send, extra)
                if extra:  # and on a response a worker writes itself (the native data path)
                    scope.setdefault("extensions", {})[CORS_HEADERS] = extra
        if refused is None and path not in PUBLIC:
            refused = self.gate.origin(origin, host, lambda: has_valid_key(headers, self.api_keys))
        if refused is None:
            refused = self.gate.body(scope["method"], path, origin, headers.get("content-type", ""),
                                     headers.get("content-length", "0") != "0" or "transfer-encoding" in headers)
        if refused is not None:
            return await _error_for(path, _blocked(refused))(scope, receive, send)
        err = guard_error(path, headers, self.api_keys, self.max_body)
        if err is not None:
            return await _error_for(path, err)(scope, receive, send)
        if scope["method"] in BODY_METHODS:  # counted as it comes (chunked too), refused at the limit
            raw = await read_or_refuse(scope, receive, send, self.max_body)
            if raw is None:
                return  # answered (413), or the client left before its body had come
            if scope["method"] == "POST" and is_engine_post(scope["path"]):
                return await self.engine_post(scope, receive, send, headers, raw)
            if scope["method"] == "POST" and path in self._posts:
                receive = replay(raw, receive)
                response = await self._posts[path](Request(scope, receive))
                return await response(scope, receive, send)
            receive = replay(raw, receive)
        return await self.app(scope, receive, send)


def _error_for(path: str, e: ApiError) -> Response:
    """A refusal in the shape the path's clients read: Ollama's under /api/, else OpenAI's."""
    return ollama.error(e.status, e.message) if path.startswith("/api/") else error_response(e)


def _blocked(r: Blocked) -> ApiError:
    return ApiError(r.status, r.message, "permission_error" if r.status == 403 else "invalid_request_error", r.code)


def _with_headers(send, extra: list[tuple[bytes, bytes]]):
    """``send`` that adds ``extra`` headers to the response's start."""
    if not extra:
        return send

    async def sending(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)
    return sending
