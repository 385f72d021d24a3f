"""The HTTP server: OpenAI endpoints, llama-server's router API, and our own.

    client ──HTTP──▶ middleware (API key, body limit) ──▶ route ──▶ Router.arequest (leased in
                                                           │          the loop when the model can
                                                           │          take it, else in a thread)
                                                           └─ SSE (sse.py): chunks awaited in the
                                                              event loop, one write per decode step;
                                                              a client that leaves cancels

| endpoint                          | what                                              |
| GET  /health                      | liveness (no API key needed)                      |
| GET  /v1/models[/{id}]            | OpenAI model list, one model                      |
| POST /v1/chat/completions         | OpenAI chat, SSE with "stream": true              |
| POST /v1/completions              | OpenAI completions (several prompts, n choices)   |
| POST /v1/embeddings               | OpenAI embeddings (float or base64)               |
| GET  /models                      | llama-server router list: status, memory per device |
| POST /models/load, /models/unload | llama-server router control                       |
| GET  /props[?model=]              | router or model properties                        |
| GET  /devices                     | devices: capacity, held, free, available, workers |
| GET  /events                      | recent loads, evictions, unloads, failures        |
| GET  /metrics                     | Prometheus                                        |
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..errors import RouterError, UnknownModel
from ..router import Router
from .errors import ApiError, error_response, from_router_error
from .fanout import MergedStream, merge, split
from .metrics import Metrics
from .sse import EventStream

__all__ = ["create_app"]

PUBLIC = frozenset({"/health"})
# OpenAI fields forwarded to llama_cpp, per endpoint; others are ignored
_SAMPLING = {"temperature", "top_p", "top_k", "min_p", "stop", "seed", "max_tokens", "presence_penalty",
             "frequency_penalty", "repeat_penalty", "logit_bias", "logprobs", "typical_p", "mirostat_mode",
             "mirostat_tau", "mirostat_eta", "tfs_z"}
ALLOWED = {
    "chat": _SAMPLING | {"messages", "response_format", "tools", "tool_choice", "top_logprobs", "functions",
                         "function_call"},
    "complete": _SAMPLING | {"prompt", "suffix", "echo", "response_format"},
    "embed": {"input"},
}


def _to_base64(result: dict[str, Any]) -> None:
    """OpenAI's ``encoding_format: base64``: each vector as little-endian float32 bytes."""
    for item in result.get("data", []):
        vec = item.get("embedding")
        if isinstance(vec, list) and all(isinstance(x, (int, float)) for x in vec):
            item["embedding"] = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()


def _model_entry(name: str, m: dict[str, Any], cfg) -> dict[str, Any]:
    status: dict[str, Any] = {"value": m["state"]}
    if m["reason"]:
        status.update(failed=True, reason=m["reason"])
    return {
        "id": name, "object": "model", "owned_by": "pyllmrouter", "aliases": m["aliases"],
        "path": cfg.spec.path, "status": status,
        "memory": {"requirement": m["requirement"], "devices": m["devices"], "live": m["live"],
                   "fit": m["fit"]},
        "in_flight": m["leases"], "loads": m["loads"], "persistent": m["persistent"], "ttl": m["ttl"],
    }


def create_app(router: Router, *, api_key: str | None = None, max_body: int = 8 << 20,
               close_router: bool = True, max_threads: int = 1024) -> FastAPI:
    metrics = Metrics(router.status)
    router.scheduler.on_wait = lambda model, s: metrics.queue_wait.labels(model).observe(s)
    configs = {c.name: c for c in router.models()}

    @asynccontextmanager
    async def lifespan(_app):
        # a request for a model that cannot take it at once waits for its lease in a
        # thread: the default pool (cpu count + 4) would make the fifth such wait queue
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="router-call"))
        yield
        if close_router:  # after uvicorn has drained requests in flight
            await asyncio.to_thread(router.close)

    app = FastAPI(title="pyllmrouter", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _api_error(_req, e: ApiError):
        return error_response(e)

    app.add_middleware(_Guard, api_key=api_key, max_body=max_body)

    async def body(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if len(raw) > max_body:
            raise ApiError(413, f"request body exceeds the limit of {max_body} bytes", code="body_too_large")
        try:
            data = json.loads(raw or b"{}")
        except ValueError as e:
            raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object", code="invalid_json")
        return data

    def autoload_param(request: Request) -> bool | None:
        v = request.query_params.get("autoload")
        return None if v is None else v.lower() in ("1", "true", "yes", "on")

    async def call(fn, *args, **kw):
        try:
            return await asyncio.to_thread(fn, *args, **kw)
        except RouterError as e:
            raise from_router_error(e) from None

    async def run(model: str, method: str, subs: list[dict[str, Any]], stream: bool, autoload: bool | None):
        """One router request, or one per choice (several prompts, n > 1) merged into one reply."""
        if len(subs) == 1:
            return await router.arequest(model, method, subs[0], stream, autoload=autoload)
        if not stream:
            replies = await asyncio.gather(*(router.arequest(model, method, p, False, autoload=autoload)
                                             for p in subs), return_exceptions=True)
            failed = next((r for r in replies if isinstance(r, BaseException)), None)
            if failed is not None:
                raise failed
            return merge(replies)
        streams = []
        try:
            for p in subs:
                streams.append(await router.arequest(model, method, p, True, autoload=autoload))
        except BaseException:
            for st in streams:
                st.abandon()
            raise
        return MergedStream(streams)

    async def serve(request: Request, method: str, endpoint: str):
        t0 = time.perf_counter()
        data = await body(request)
        model = data.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "'model' is required (a model id from GET /v1/models)", param="model")
        if "max_completion_tokens" in data and "max_tokens" not in data:
            data["max_tokens"] = data["max_completion_tokens"]
        params = {k: v for k, v in data.items() if k in ALLOWED[method]}  # checked by the router
        stream = bool(data.get("stream")) and method != "embed"
        options = data.get("stream_options") or {}
        if not isinstance(options, dict):
            raise ApiError(400, "'stream_options' must be an object", param="stream_options")
        include_usage = stream and bool(options.get("include_usage"))
        encoding = data.get("encoding_format") or "float"
        if method == "embed" and encoding not in ("float", "base64"):
            raise ApiError(400, "'encoding_format' must be 'float' or 'base64'", param="encoding_format")
        subs = [params] if method == "embed" else split(method, params, data.get("n", 1))
        status = "200"
        try:
            result = await run(model, method, subs, stream, autoload_param(request))
        except RouterError as e:
            err = from_router_error(e)
            status = str(err.status)
            raise err from None
        finally:
            if not stream or status != "200":
                metrics.latency.labels(model, endpoint, status).observe(time.perf_counter() - t0)
        if not stream:
            result["model"] = model
            if method == "embed" and encoding == "base64":
                _to_base64(result)
            return JSONResponse(result)
        return EventStream(result, model, include_usage, lambda code: metrics.latency.labels(
            model, endpoint, code).observe(time.perf_counter() - t0))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat(request: Request):
        return await serve(request, "chat", "chat")

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: Request):
        return await serve(request, "complete", "completions")

    @app.post("/v1/embeddings")
    @app.post("/embeddings")
    async def embeddings(request: Request):
        return await serve(request, "embed", "embeddings")

    def _openai_model(name: str, m: dict[str, Any]) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "pyllmrouter",
                "status": {"value": m["state"]}}

    @app.get("/v1/models")
    async def v1_models():
        return {"object": "list", "data": [_openai_model(n, m) for n, m in router.status()["models"].items()]}

    @app.get("/v1/models/{name:path}")
    async def v1_model(name: str):
        st = router.status()["models"]
        found = next((n for n, m in st.items() if name == n or name in m["aliases"]), None)
        if found is None:
            raise from_router_error(UnknownModel(name, list(st)))
        return _openai_model(found, st[found])

    @app.get("/models")
    async def models():
        st = router.status()
        return {"object": "list", "data": [_model_entry(n, m, configs[n]) for n, m in st["models"].items()],
                "devices": st["devices"]}

    async def model_arg(request: Request) -> str:
        name = (await body(request)).get("model")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "'model' is required", param="model")
        return name

    @app.post("/models/load")
    async def load(request: Request):
        await call(router.load, await model_arg(request))
        return {"success": True}

    @app.post("/models/unload")
    async def unload(request: Request):
        name = await model_arg(request)
        rec = await call(router.scheduler.resolve, name)
        done = await call(router.unload, name, rec.config.stop_timeout)
        return {"success": bool(done)}

    @app.get("/props")
    async def props(request: Request):
        name = request.query_params.get("model")
        st = router.status()
        if name is None:
            return {"role": "router", "models": len(st["models"]), "max_models": router.options.max_models,
                    "autoload": router.options.autoload, "margin_bytes": router.options.margin}
        rec = await call(router.scheduler.resolve, name)
        m = st["models"][rec.name]
        return {"model": rec.name, "model_path": rec.config.spec.path, "spec": rec.config.spec.to_dict(),
                "status": m["state"], "memory": {"requirement": m["requirement"], "live": m["live"]}}

    @app.get("/devices")
    async def devices():
        st = router.status()
        return {"devices": st["devices"], "workers": st["workers"]}

    @app.get("/events")
    async def events():
        evs = list(router.scheduler.events)
        t0 = evs[0][0] if evs else 0.0
        return {"data": [{"t": round(t - t0, 3), "event": what, "model": name, "devices": where}
                         for t, what, name, where in evs]}

    @app.get("/metrics")
    async def prometheus():
        engines = await asyncio.to_thread(router.engine_stats)
        return Response(metrics.render(engines), media_type="text/plain; version=0.0.4")

    return app


class _Guard:
    """API key and body-size checks as plain ASGI middleware (FastAPI's function
    middleware would add a task and a memory stream to every streamed chunk)."""

    def __init__(self, app, api_key: str | None, max_body: int):
        self.app, self.api_key, self.max_body = app, api_key, max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key and scope["path"] not in PUBLIC:
            given = headers.get("x-api-key", "")
            auth = headers.get("authorization", "")
            if auth.lower().startswith("bearer "):
                given = auth[7:].strip()
            if not hmac.compare_digest(given.encode(), self.api_key.encode()):
                err = ApiError(401, "invalid or missing API key", "authentication_error", "invalid_api_key")
                return await error_response(err)(scope, receive, send)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            err = ApiError(413, f"request body of {length} bytes exceeds the limit of {self.max_body}",
                           code="body_too_large")
            return await error_response(err)(scope, receive, send)
        return await self.app(scope, receive, send)
