"""The HTTP server: every llama-server endpoint of a model, llama-server's router API, and ours.

    client ──HTTP──▶ guard (API key, body limit) ──▶ per-model request: the model named by the
                     body's "model" (POST, taken by the guard past FastAPI's routing) or
                     ?model= (GET), as llama-server's router picks it
                       ──▶ server/dispatch.py: its path chosen (native, relayed, session) ──▶
                           the model's engine
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
import dataclasses
import hmac
import json
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pyllmrouter.endpoints import ENGINE_GET, HEALTH, LABELLED, is_engine_post
from pyllmrouter.errors import RouterError, UnknownModel
from pyllmrouter.router.api import Router
from pyllmrouter.server import manage, ollama, page
from pyllmrouter.server.api_errors import ApiError, error_response, from_router_error
from pyllmrouter.router.services.tools import Services
from pyllmrouter.server.body import BODY_METHODS, departed, json_object, read_or_refuse, replay
from pyllmrouter.server.dispatch import CORS_HEADERS, NOT_FORWARDED, Dispatch
from pyllmrouter.server.browser import LOCAL_ORIGINS, Gate, Blocked
from pyllmrouter.server.connection import Handover, HttpProtocol
from pyllmrouter.server.cors import Cors
from pyllmrouter.server.relay import relay
from pyllmrouter.server.starting import HEALTHY
from pyllmrouter.server.metrics import Metrics

__all__ = ["AppOptions", "create_app", "guard_error", "HTTP_PROTOCOL", "DEFAULT_HEADERS"]

# uvicorn's protocol for every server of this app: its httptools protocol (the fastest it has),
# whose connections a request can hand over to a worker (server/connection.py)
HTTP_PROTOCOL = HttpProtocol
# the default headers of every answer (uvicorn.Config's headers), as a worker writes them on
# the native path (csrc/conduit.cpp, stamp): llama-server's Server; uvicorn adds Date
DEFAULT_HEADERS = [("Server", "llama.cpp")]
_DISABLED = json.dumps({"error": {"message": "this feature is disabled", "type": "feature_disabled"}}).encode()
@dataclass(frozen=True)
class AppOptions:
    """The HTTP app's options (``pyllmrouter serve``'s flags).  ``settings``: what llama.cpp's
    parser made of the router's llama-server arguments (router/services.settings: CORS,
    more API keys); ``services``: llama-server's /tools and /cors-proxy (None: llama-server's
    403, the features are off); ``allowed_hosts``: the Host names accepted beside the local
    ones (None: no Host check, see browser.py); ``native``: a worker answers a model's
    request on the client's connection itself where it can (router/workers/conduit.py);
    False: every response is relayed through this process; ``follow_ms``: how often such a
    worker, reading the connection's next requests like the last itself, tells the router
    of its answers (0: it never reads them); ``close_router``: the app's end closes the
    router; ``max_threads``: the threads that wait for leases."""

    api_key: str | None = None
    max_body: int = 8 << 20
    close_router: bool = True
    max_threads: int = 1024
    settings: dict[str, Any] | None = None
    services: Services | None = None
    allowed_hosts: frozenset[str] | None = None
    native: bool = True
    follow_ms: int = 0


def create_app(router: Router, options: AppOptions | None = None, **overrides: Any) -> "_Guard":
    """The app serving ``router`` (``options``, any of them given by name in ``overrides``)."""
    o = dataclasses.replace(options or AppOptions(), **overrides)
    settings = o.settings or {}
    keys = tuple(k for k in ([o.api_key] if o.api_key else []) + list(settings.get("api_keys", ())) if k)
    # pages of the local origins only, unless --cors-origins says otherwise ('*': llama-server's default)
    origins = settings["cors_origins"] if settings.get("cors_origins_explicit") else LOCAL_ORIGINS
    cors = Cors({**settings, "cors_origins": origins}) if o.settings else None
    write_timeout = settings.get("timeout_write") or None  # llama-server's --timeout: a relay's writes
    metrics = Metrics(router.status, LABELLED, router.scheduler.canonical)
    router.scheduler.on_wait = lambda model, s: metrics.queue_wait.labels(model).observe(s)
    dispatch = Dispatch(router, metrics, native=o.native, follow_ms=o.follow_ms, max_body=o.max_body,
                        write_timeout=write_timeout)
    app = FastAPI(title="pyllmrouter", lifespan=_lifespan(router, o))
    app.add_exception_handler(ApiError, _api_error)
    _mount_services(app, o.services, write_timeout)
    engine_get = _mount_models(app, router, dispatch)
    manage.mount(app, router, dispatch.forward, _body, o.settings)
    ollama_posts = ollama.mount(app, router)
    page.mount(app)

    @app.get("/metrics")
    async def prometheus(request: Request):
        if request.query_params.get("model"):
            return await engine_get(request)  # llama-server's own counters (needs --metrics)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return _Guard(app, keys, o.max_body, dispatch.engine_post, cors, Gate(origins, o.allowed_hosts), dispatch.take,
                  ollama_posts)


def _lifespan(router: Router, o: AppOptions):
    @asynccontextmanager
    async def lifespan(_app):
        # a request for a model that cannot take it at once waits for its lease in a
        # thread: the default pool (cpu count + 4) would make the fifth such wait queue
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(max_workers=o.max_threads, thread_name_prefix="router-call"))
        yield
        if o.services is not None:
            await asyncio.to_thread(o.services.close)
        if o.close_router:  # after uvicorn has drained requests in flight
            await asyncio.to_thread(router.close)
    return lifespan


async def _api_error(_req, e: ApiError):
    return error_response(e)


async def _body(request: Request) -> dict[str, Any]:
    return json_object(await request.body())  # the guard has read it, within the limit


def _mount_services(app: FastAPI, services: Services | None, write_timeout: float | None) -> None:
    """/tools and /cors-proxy: llama-server's services, or its 403 when they are off."""
    async def service(request: Request) -> Response:
        if services is None:  # server.cpp's res_403, without starting a process to say it
            return Response(_DISABLED, 403, media_type="application/json")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in NOT_FORWARDED}
        try:
            reply, stream = await services.acall(request.method, request.url.path, await request.body(),
                                                 dict(request.query_params), headers,
                                                 gone=lambda: _disconnected(request))
        except (RouterError, RuntimeError) as e:
            raise from_router_error(e) from None
        return relay(reply, stream, lambda code: None, write_timeout)

    for path in ("/tools", "/cors-proxy"):
        app.add_api_route(path, service, methods=["GET", "POST"], include_in_schema=False)


def _openai_model(name: str, m: dict[str, Any]) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "pyllmrouter",
            "status": {"value": m["state"]}}


def _mount_models(app: FastAPI, router: Router,
                  dispatch: Dispatch) -> Callable[[Request], Awaitable[Response]]:
    """/health, the OpenAI model list and a model's GET routes (?model=); the handler of those."""
    async def health():
        return dict(HEALTHY)

    for path in sorted(HEALTH):
        app.add_api_route(path, health, methods=["GET"])

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
        return await dispatch.forward(request, name, b"")

    for path in ENGINE_GET:
        app.add_api_route(path, engine_get, methods=["GET"], include_in_schema=False)
    return engine_get


def _header_dict(scope) -> dict[str, str]:
    """A request's headers by lower-case name (the last of a name given twice)."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


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
    if keys and path not in HEALTH and not page.is_public(path) and not has_valid_key(headers, keys):
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
        if refused is None and path not in HEALTH:
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
