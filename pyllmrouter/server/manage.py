"""llama-server's router management API, and ours, on the FastAPI app.

| endpoint                               | what                                                   |
| GET    /models[?reload=1]              | the live list (sources read again with reload=1)       |
| POST   /models {"model": "org/repo:Q"} | pull into llama.cpp's cache, then listed (source cache) |
| DELETE /models?model=                  | a cache model: download stopped, or removed and deleted |
| POST   /models/load, /models/unload    | llama-server router control                            |
| GET    /models/sse                     | state changes as server-sent events (sse.py)           |
| GET    /props                          | router properties (llama-server's and ours)            |
| GET    /v1/stream, POST /v1/streams/lookup, DELETE /v1/stream | resumable streams, at the   |
|                                        | engine of the model that serves the conversation       |
| GET    /devices, /events               | ours: devices and workers, recent events               |
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from pyllmrouter.errors import RouterError
from pyllmrouter.router.api import Router
from pyllmrouter.server.api_errors import ApiError, from_router_error
from pyllmrouter.server.sse import event_stream

__all__ = ["mount", "LOOKUP_IDS", "LOOKUP_BYTES"]

# POST /v1/streams/lookup: the most conversation ids one lookup takes (after duplicates go),
# and the most bytes of body (ids of up to the 256 characters a conversation id may have)
LOOKUP_IDS = 1024
LOOKUP_BYTES = LOOKUP_IDS * 260 + 1024


def _instances(name: str, models: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """A model's instances (its own and its extra ones, replicas = N): where, what, how busy."""
    return [{"id": n, "state": m["state"], "devices": m["devices"], "held": m["held"], "in_flight": m["leases"]}
            for n, m in models.items() if n == name or m.get("replica_of") == name]


def _model_entry(name: str, m: dict[str, Any], cfg, created: int,
                 instances: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"value": m["state"], "args": cfg.spec.to_args()}
    if m["reason"]:
        status.update(failed=True, exit_code=1, reason=m["reason"])
    if m["pending"]:
        status["pending"] = m["pending"]  # removed or changed: finishing its requests
    inputs = ["text", "image"] if m["projector"] else ["text"]
    return {
        "id": name, "aliases": m["aliases"], "tags": [], "object": "model", "owned_by": "pyllmrouter",
        "created": created, "status": status,
        "architecture": {"input_modalities": inputs, "output_modalities": ["text"]},
        "source": m["source"], "can_remove": m["source"] == "cache",
        "path": cfg.spec.path,
        "memory": {"requirement": m["requirement"], "components": m["components"], "devices": m["devices"],
                   "held": m["held"], "parts": m["parts"],
                   "live": m["live"], "fit": m["fit"], "kept": m["kept"]},
        "context": m["context"],
        "in_flight": m["leases"], "loads": m["loads"], "persistent": m["persistent"], "ttl": m["ttl"],
        "idle_seconds": m["idle_seconds"], "waiting": m["waiting"],
        "replicas": cfg.replicas, "instances": instances or [],
        # seconds before the ttl unloads it (idle and loaded only)
        "ttl_left": max(0.0, round(m["ttl"] - m["idle_seconds"], 1))
        if m["ttl"] and m["idle_seconds"] is not None and m["state"] == "loaded" else None,
    }


def _download_entry(name: str, d: dict[str, Any], created: int) -> dict[str, Any]:
    status: dict[str, Any] = {"value": d["status"]}
    if d["error"]:
        status.update(failed=True, reason=d["error"])
    return {"id": name, "aliases": [], "tags": [], "object": "model", "owned_by": "pyllmrouter", "created": created,
            "status": status, "source": "cache", "can_remove": True, "progress": d["progress"]}


def _build_info() -> str:
    """llama.cpp's build, asked in a short-lived process (the router loads no llama.cpp)."""
    proc = subprocess.run([sys.executable, "-c", "from pyllmrouter.engine.backend import native; "
                                                 "print(native().build_info())"],
                          capture_output=True, text=True, timeout=120)
    return proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout.strip() else "unknown"


def mount(app: FastAPI, router: Router, forward: Callable[..., Awaitable[Response]],
          body: Callable[[Request], Awaitable[dict]], settings: dict[str, Any] | None = None) -> None:
    """The management routes on ``app``; ``forward(request, model, raw, query=...)`` sends a
    request to a model's engine, ``body(request)`` reads a JSON object; ``settings``: what
    llama.cpp's parser made of the router's llama-server arguments."""
    management = _Management(router, forward, body, settings)
    streams = _ResumableStreams(router, forward, body)
    for method, path, endpoint in (
            ("GET", "/models", management.models),
            ("POST", "/models", management.pull),
            ("DELETE", "/models", management.delete),
            ("POST", "/models/load", management.load),
            ("POST", "/models/unload", management.unload),
            ("GET", "/models/sse", management.models_sse),
            ("GET", "/props", management.props),
            ("GET", "/devices", management.devices),
            ("GET", "/events", management.events),
            ("GET", "/v1/stream", streams.stream_get),
            ("POST", "/v1/streams/lookup", streams.streams_lookup),
            ("DELETE", "/v1/stream", streams.stream_delete)):
        app.add_api_route(path, endpoint, methods=[method])


async def _call(fn, *args, **kw):
    """``fn(*args, **kw)`` off the event loop; a RouterError it raises is its HTTP error."""
    try:
        return await asyncio.to_thread(fn, *args, **kw)
    except RouterError as e:
        raise from_router_error(e) from None


class _Management:
    """The model-management routes, one method each: the live model list, pulls into and
    removals from llama.cpp's cache, loads and unloads, state changes, the router's
    properties, its devices and its recent events.  A route's method (here and in
    _ResumableStreams) has no docstring and no return annotation: FastAPI would publish
    the one in its OpenAPI schema and take the other for a response model."""

    def __init__(self, router: Router, forward: Callable[..., Awaitable[Response]],
                 body: Callable[[Request], Awaitable[dict]], settings: dict[str, Any] | None) -> None:
        self.router, self.forward, self.body, self.settings = router, forward, body, settings
        self.created = int(time.time())  # every listed model's "created"
        self._build: str | None = None  # llama.cpp's build, asked at the first GET /props

    async def _model_arg(self, request: Request) -> str:
        name = (await self.body(request)).get("model")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "'model' is required", param="model")
        return name

    async def _in_cache(self, fn, name: str) -> dict:
        """A pull into (or a removal from) llama.cpp's cache; a name it cannot take is a 400."""
        try:
            await _call(fn, name)
        except ValueError as e:
            raise ApiError(400, str(e), param="model") from None
        return {"success": True}

    async def models(self, request: Request):
        router = self.router
        if request.query_params.get("reload"):
            try:
                await _call(router.reload)
            except ValueError as e:  # a bad preset: nothing changed
                raise ApiError(400, f"the model list was not read again: {e}", code="bad_preset") from None
        st = router.status()
        configs = {c.name: c for c in router.models()}
        data = [_model_entry(n, m, configs[n], self.created, _instances(n, st["models"]))
                for n, m in st["models"].items()
                if n in configs and not configs[n].hidden]  # hidden: a preset deduplicates it
        data += [_download_entry(n, d, self.created) for n, d in st["downloads"].items() if n not in configs]
        return {"object": "list", "data": data, "devices": st["devices"]}

    async def pull(self, request: Request):
        return await self._in_cache(self.router.pull, await self._model_arg(request))

    async def delete(self, request: Request):
        name = request.query_params.get("model")
        if not name:
            raise ApiError(400, "model must be a non-empty string (?model=)", param="model")
        return await self._in_cache(self.router.delete, name)

    async def load(self, request: Request):
        await _call(self.router.load, await self._model_arg(request))
        return {"success": True}

    async def unload(self, request: Request):
        name = await self._model_arg(request)
        done = await _call(self.router.unload, name)
        return {"success": bool(done)}

    async def models_sse(self):
        return StreamingResponse(event_stream(self.router.scheduler.bus), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    async def props(self, request: Request):
        name = request.query_params.get("model")
        if name is not None:
            return await self.forward(request, name, b"")
        if self._build is None:
            self._build = await asyncio.to_thread(_build_info)
        st, options = self.router.status(), self.router.options
        return {
            # llama-server's router (tools/server/server-models.cpp)
            "role": "router", "max_instances": options.max_models, "models_autoload": options.autoload,
            "model_alias": "llama-server", "model_path": "none",
            "default_generation_settings": {"params": {}, "n_ctx": 0}, "ui_settings": {}, "build_info": self._build,
            "cors_proxy_enabled": bool((self.settings or {}).get("ui_mcp_proxy")),
            # ours
            "models": len(st["models"]), "max_models": options.max_models, "autoload": options.autoload,
            "margin_bytes": options.margin,
        }

    async def devices(self):
        st = self.router.status()
        return {"devices": st["devices"], "workers": st["workers"]}

    async def events(self):
        evs = self.router.scheduler.bus.recent()
        t0 = evs[0].t if evs else 0.0
        return {"data": [{"seq": e.seq, "t": round(e.t - t0, 3), "event": e.event, "model": e.model, "devices": e.devices,
                          **({"data": e.data} if e.data else {})} for e in evs]}


class _ResumableStreams:
    """The resumable-stream routes, one method each: a conversation's stream is asked of
    (or deleted at) the engine of the model that serves the conversation."""

    def __init__(self, router: Router, forward: Callable[..., Awaitable[Response]],
                 body: Callable[[Request], Awaitable[dict]]) -> None:
        self.router, self.forward, self.body = router, forward, body

    def _owner(self, conv_id: str, models: dict[str, Any]) -> tuple[str | None, ApiError | None]:
        """The conversation's model, if it can answer for its stream now; else the error
        (``models``: one status snapshot's, however many ids a request asks about)."""
        name = self.router.conversations.owner(conv_id)
        if name is None:
            return None, ApiError(404, "Stream not found or expired", "not_found_error", "not_found")
        m = models.get(name)
        if m is None:
            return None, ApiError(404, f"the model {name!r} that served conversation {conv_id!r} was removed: "
                                       f"its stream is gone", "not_found_error", "not_found")
        if m["state"] == "loading":
            return None, ApiError(503, "Stream owner model is loading, retry later", "unavailable_error",
                                  "unavailable", headers={"Retry-After": "1"})
        if m["state"] != "loaded":
            return None, ApiError(404, f"the model {name!r} that served conversation {conv_id!r} was unloaded: "
                                       f"its stream is gone", "not_found_error", "not_found")
        return name, None

    async def _models_now(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.router.status)  # off the event loop

    async def stream_get(self, request: Request):
        conv_id = request.query_params.get("conv_id", "")
        if not conv_id:
            raise ApiError(400, "Missing conversation id in path", param="conv_id")
        name, err = self._owner(conv_id, (await self._models_now())["models"])
        if err is not None:
            raise err
        return await self.forward(request, name, b"", autoload=False)

    async def streams_lookup(self, request: Request):
        raw = await request.body()
        if len(raw) > LOOKUP_BYTES:  # read no further: a body this size holds no useful lookup
            raise ApiError(400, f"a lookup takes at most {LOOKUP_IDS} conversation ids ({LOOKUP_BYTES} bytes of "
                                f"body); this one has {len(raw)} bytes", param="conversation_ids")
        ids = (await self.body(request)).get("conversation_ids")
        unique = list(dict.fromkeys(c for c in (ids if isinstance(ids, list) else []) if isinstance(c, str) and c))
        if len(unique) > LOOKUP_IDS:
            raise ApiError(400, f"a lookup takes at most {LOOKUP_IDS} conversation ids (duplicates counted once); "
                                f"this one has {len(unique)}", param="conversation_ids")
        models = (await self._models_now())["models"] if unique else {}
        per_model: dict[str, list[str]] = {}
        for cid in unique:
            name, err = self._owner(cid, models)
            if err is None:
                per_model.setdefault(name, []).append(cid)
        found: list[Any] = []
        for name, mine in per_model.items():
            raw = json.dumps({"conversation_ids": mine}).encode()
            reply = await self.forward(request, name, raw, autoload=False)
            try:
                entries = json.loads(reply.body)
            except (ValueError, AttributeError):
                continue
            found += [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []
        return found

    async def stream_delete(self, request: Request):
        conv_id = request.query_params.get("conv_id", "")
        if not conv_id:
            raise ApiError(400, "Missing conversation id in path", param="conv_id")
        name, err = self._owner(conv_id, (await self._models_now())["models"])
        if err is None:
            await self.forward(request, name, b"", autoload=False)
        self.router.conversations.forget(conv_id)
        return Response(status_code=204, media_type="application/json")
