"""Ollama's API on the same server, answered by each model's llama.cpp engine through the router.

    client ──/api/chat, /api/generate──▶ the model (name:tag, :latest) resolved to a listed one
        ──ollama_wire.*_request──▶ Router.arelay(Ask(model, /v1/chat/completions | /completion | /infill))
        ◀── SSE events ──Translator──▶ NDJSON objects (stream: true, the default), or one object
        a prompt the engine refuses for its length: cut to fit and sent again (truncate): a chat's
        oldest turns dropped (counted by /chat/completions/input_tokens), a prompt or input cut
        by /tokenize, /detokenize; num_ctx past the slot's context: the model's config replaced
        with a -c that gives it (Router.replace_model), loaded by its probed bytes
        keep_alive: the model's idle time (Scheduler.keep_alive), set as the request takes it;
        no prompt: the model loaded (done_reason "load"), or with keep_alive 0 unloaded ("unload")
    /api/embed, /api/embeddings ──▶ /v1/embeddings
    /api/tags, /api/show, /api/ps: the list, each file's GGUF header (gguf_header.metadata), and
        the exact bytes each loaded model holds (size; size_vram: on GPUs), its expiry by its idle time
    /api/pull, /api/delete: llama.cpp's cache (Router.pull, Router.delete), with Ollama's progress lines
    /api/create, /api/copy, /api/push, /api/blobs: 501, saying why

The routes are OllamaApi's methods; what they ask of the engine (the relay, token counts, cuts
to fit, num_ctx, loads) is server/ollama_engine.py's OllamaEngine.

| endpoint                        | here                                                          |
| GET  /api/version               | the Ollama API mirrored (ollama_wire.VERSION)                  |
| GET  /api/tags, /api/ps         | listed models; loaded ones with their bytes                   |
| POST /api/show                  | details, model_info, template, capabilities                   |
| POST /api/chat, /api/generate   | streamed NDJSON or whole; format, options, tools, think, images |
| POST /api/embed, /api/embeddings| vectors                                                       |
| POST /api/pull, DELETE /api/delete | llama.cpp's cache (serve --models-cache)                   |

Errors are Ollama's ``{"error": "..."}``; the key, Host and Origin rules are the server's own.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pyllmrouter import endpoints, gguf_header
from pyllmrouter.errors import RouterError
from pyllmrouter.router.api import Router
from pyllmrouter.server import ollama_pull, ollama_wire as wire
from pyllmrouter.server.api_errors import ApiError
from pyllmrouter.server.ollama_engine import OllamaEngine, engine_error, router_error
from pyllmrouter.server.ollama_wire import OllamaError

__all__ = ["error", "mount"]

_LOG = logging.getLogger("pyllmrouter.ollama")
NDJSON = "application/x-ndjson"
NEVER = 253402300799.0  # 9999-12-31T23:59:59Z: a model kept for ever expires then
ANY_METHOD = ["GET", "POST", "PUT", "DELETE", "HEAD", "PATCH"]
# Ollama's routes that make or move models: 501, saying why
REFUSED = (("/api/create", ("creates no model: name a GGUF file in the model list (a preset, or "
                            "POST /models to pull one)")),
           ("/api/copy", "copies no model: give the model an alias in the preset"),
           ("/api/push", "pushes no model to a registry"),
           ("/api/blobs/{digest}", "takes no blobs: name a GGUF file in the model list"))


def error(status: int, message: str) -> JSONResponse:
    """Ollama's error shape."""
    return JSONResponse({"error": message}, status_code=status)


def _sse_events(buffer: bytearray) -> list[dict[str, Any]]:
    """The whole events at the front of ``buffer`` (taken out of it), each ``data:``'s JSON."""
    out = []
    while (end := buffer.find(b"\n\n")) >= 0:
        event = bytes(buffer[:end])
        del buffer[:end + 2]
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                data = line[5:].strip()
                if data and data != b"[DONE]":
                    out.append(json.loads(data))
    return out


def mount(app: FastAPI, router: Router) -> dict[str, Callable[[Request], Awaitable[Response]]]:
    """Ollama's routes on ``app``; returns its POSTs that run a model (chat, generate,
    embed), by path, for the server's guard to call past FastAPI's routing and middleware
    (server/app.py's ``_Guard``: a stream's every line would go through their wrappers)."""
    api = OllamaApi(router)
    app.get("/api/version")(api.version)
    app.get("/api/tags")(_handled(api.tags))
    app.post("/api/show")(_handled(api.show))
    app.get("/api/ps")(_handled(api.ps))
    app.post("/api/pull")(_handled(api.pull))
    app.delete("/api/delete")(_handled(api.delete))
    for path, what in REFUSED:
        app.add_api_route(path, _refusal(what), methods=["POST", "HEAD"] if "blobs" in path else ["POST"],
                          include_in_schema=False)
    # registered last: what no route above answers
    app.api_route("/api/{rest:path}", methods=ANY_METHOD, include_in_schema=False)(api.unknown)
    return {"/api/chat": _handled(api.chat), "/api/generate": _handled(api.generate),
            "/api/embed": _handled(api.embed_new), "/api/embeddings": _handled(api.embed_legacy)}


def _handled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its errors answered in Ollama's shape (a bug's too: logged, the server goes on)."""
    async def run(request: Request) -> Response:
        try:
            return await fn(request)
        except OllamaError as e:
            return error(e.status, e.message)
        except ApiError as e:
            return error(e.status, e.message)
        except RouterError as e:
            e2 = router_error(e)
            return error(e2.status, e2.message)
        except Exception as e:  # noqa: BLE001 - a bug: said in Ollama's shape, logged, the server goes on
            _LOG.exception("%s %s", request.method, request.url.path)
            return error(500, f"internal error: {type(e).__name__}: {e}")
    run.__name__ = fn.__name__
    return run


def _refusal(what: str) -> Callable[[Request], Awaitable[Response]]:
    async def refused(request: Request):
        return error(501, f"pyllmrouter {what}")
    return refused


async def _read(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        data = json.loads(raw or b"{}")
    except (ValueError, RecursionError) as e:
        raise OllamaError(400, f"invalid JSON: {e}") from None
    if not isinstance(data, dict):
        raise OllamaError(400, "the request body must be a JSON object")
    return data


def _warnings(ignored: list[str]) -> dict[str, str]:
    return {"x-pyllmrouter-ignored-options": ", ".join(ignored)} if ignored else {}


class OllamaApi:
    """Ollama's routes, one method each, over one router; the GGUF headers they read, cached
    by file (this event loop's only)."""

    def __init__(self, router: Router):
        self.router = router
        self.engine = OllamaEngine(router)
        self.headers: dict[tuple[str, int, int], tuple[dict[str, Any], int]] = {}

    def resolve(self, data: dict[str, Any], missing: Any = OllamaError) -> Any:
        """The listed model a request names (as given, then without ":latest"); none:
        404, or ``missing`` where it is not OllamaError."""
        name = data.get("model") or data.get("name")
        if not isinstance(name, str) or not name:
            raise OllamaError(400, "model is required")
        for candidate in wire.listed_candidates(name):
            listed = self.router.scheduler.canonical(candidate)
            if listed is not None:
                return listed
        if missing is OllamaError:
            raise OllamaError(404, f"model '{name}' not found")
        return missing

    async def header(self, path: str) -> tuple[dict[str, Any], int]:
        st = os.stat(path)
        key = (path, st.st_size, st.st_mtime_ns)
        if key not in self.headers:
            self.headers[key] = await asyncio.to_thread(gguf_header.metadata, path)
        return self.headers[key]

    async def describe(self, name: str) -> dict[str, Any]:
        cfg = self.router.scheduler.configs()[name]
        path = cfg.spec.path
        kv, parameters = await self.header(path)
        st = os.stat(path)
        # an id of the file as it is (no need to read gigabytes): its path, size and time
        digest = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()
        return {"name": wire.ollama_name(name), "model": wire.ollama_name(name),
                "modified_at": wire.timestamp(st.st_mtime), "size": st.st_size, "digest": digest,
                "details": wire.details(kv, parameters)}

    async def refuse_unable(self, model: str, data: dict[str, Any], kind: str) -> None:
        """What the model cannot do (its GGUF header and projector say), refused as Ollama
        refuses it: an embedding model's chat, thinking, images."""
        try:
            kv, _ = await self.header(self.router.scheduler.configs()[model].spec.path)
        except (OSError, ValueError, KeyError):
            return  # its load says what is wrong
        projector = bool((self.router.status()["models"].get(model) or {}).get("projector"))
        refused = wire.refusal(model, wire.capabilities(kv, projector), data, kind)
        if refused is not None:
            raise refused

    async def infer(self, request: Request, kind: str) -> Response:
        t0, created = time.perf_counter(), time.time()
        data = await _read(request)
        model = self.resolve(data)
        keep = wire.keep_alive_seconds(data.get("keep_alive"))
        stream = wire.streamed(data)
        wire.truncating(data)  # checked, whether or not it is needed
        await self.refuse_unable(model, data, kind)
        build = wire.chat_request if kind == "chat" else wire.generate_request
        path, body, ignored, num_ctx = build(data, model, stream)  # checked, whether or not it is sent
        if endpoints.load_only(f"/api/{kind}", data):
            reason = await self.engine.load_only(model, keep)
            out: dict[str, Any] = {"model": data.get("model") or model, "created_at": wire.timestamp(created)}
            out.update({"message": {"role": "assistant", "content": ""}} if kind == "chat" else {"response": ""})
            out.update(done=True, done_reason=reason)
            return JSONResponse(out)
        extra = _warnings(ignored)
        reloaded = time.perf_counter()
        await self.engine.give_context(model, num_ctx)
        reloaded = time.perf_counter() - reloaded
        reply, chunks, load_ns = await self.engine.fitted(request, model, path, body, keep, data)
        translator = wire.Translator(kind, path, data.get("model") or model, time.time, load_ns + int(reloaded * 1e9))
        if reply.status >= 400:
            if chunks is not None:
                chunks.abandon()
            raise engine_error(reply.status, reply.body)
        if chunks is None:
            try:
                whole = json.loads(reply.body)
            except ValueError:
                raise OllamaError(502, "the engine's reply is not JSON") from None
            return JSONResponse(translator.whole(whole, int((time.perf_counter() - t0) * 1e9)), headers=extra)
        return StreamingResponse(_ndjson(chunks, translator, t0), media_type=NDJSON, headers=extra)

    async def embed(self, request: Request, legacy: bool) -> Response:
        t0 = time.perf_counter()
        data = await _read(request)
        model = self.resolve(data)
        keep = wire.keep_alive_seconds(data.get("keep_alive"))
        dimensions = data.get("dimensions")
        if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)
                                       or dimensions < 1):
            raise OllamaError(400, f"dimensions must be a positive integer, not {dimensions!r}")
        body = wire.embed_request(data, model, legacy)
        wire.truncating(data)  # checked, whether or not it is needed
        if body["input"] in ("", []):  # nothing to embed: the model loaded, as Ollama does
            await self.engine.load_only(model, keep)
            return JSONResponse({"embedding": []} if legacy else {"model": data.get("model") or model,
                                                                    "embeddings": []})
        reply, load_ns = await self.engine.embedded(request, model, body, keep, data)
        if reply.status == 501:  # llama.cpp's "start it with --embeddings": this router's word for it
            raise OllamaError(400, f"{engine_error(reply.status, reply.body).message} (model '{model}' is "
                                   f"not served for embeddings: embedding = true in its preset)")
        if reply.status >= 400:
            raise engine_error(reply.status, reply.body)
        answer = json.loads(reply.body)
        vectors = [wire.normalize(d["embedding"], dimensions)
                   for d in sorted(answer.get("data") or [], key=lambda d: d.get("index", 0))]
        if legacy:
            return JSONResponse({"embedding": vectors[0] if vectors else []})
        total = int((time.perf_counter() - t0) * 1e9)
        return JSONResponse({"model": data.get("model") or model, "embeddings": vectors, "total_duration": total,
                             "load_duration": load_ns,
                             "prompt_eval_count": int((answer.get("usage") or {}).get("prompt_tokens") or 0)})

    async def chat(self, request: Request) -> Response:
        return await self.infer(request, "chat")

    async def generate(self, request: Request) -> Response:
        return await self.infer(request, "generate")

    async def embed_new(self, request: Request) -> Response:
        return await self.embed(request, legacy=False)

    async def embed_legacy(self, request: Request) -> Response:
        return await self.embed(request, legacy=True)

    async def version(self):
        return {"version": wire.VERSION}

    async def unknown(self, rest: str):
        return error(404, f"404 page not found: /api/{rest} (or not with this method)")

    async def tags(self, request: Request):
        names = [c.name for c in self.router.models() if not c.hidden]
        models = []
        for name in names:
            try:
                models.append(await self.describe(name))
            except (OSError, ValueError, KeyError):
                continue  # a file gone or unreadable: its load says why
        return JSONResponse({"models": models})

    async def show(self, request: Request):
        data = await _read(request)
        name = self.resolve(data)
        cfg = self.router.scheduler.configs()[name]
        try:
            kv, parameters = await self.header(cfg.spec.path)
        except (OSError, ValueError) as e:
            raise OllamaError(500, f"model '{name}': {e}") from None
        verbose = data.get("verbose", False)
        if not isinstance(verbose, bool):
            raise OllamaError(400, f"verbose must be true or false, not {verbose!r}")
        m = self.router.status()["models"].get(name) or {}
        st = os.stat(cfg.spec.path)
        arrays = await asyncio.to_thread(_arrays, cfg.spec.path) if verbose else None
        return JSONResponse({
            "modelfile": f"# pyllmrouter: model {name}\nFROM {cfg.spec.path}\n",
            "parameters": wire.parameters(cfg.spec.to_args()), "template": kv.get("tokenizer.chat_template") or "",
            "license": kv.get("general.license") or "", "details": wire.details(kv, parameters),
            "model_info": wire.model_info(kv, parameters, wire.slot_context(m.get("context")), arrays),
            "capabilities": wire.capabilities(kv, bool(m.get("projector"))),
            "modified_at": wire.timestamp(st.st_mtime)})

    async def ps(self, request: Request):
        st = self.router.status()
        kinds = {n: d["kind"] for n, d in st["devices"].items()}
        now = time.time()
        configs = {c.name: c for c in self.router.models() if not c.hidden}
        out = []
        for name, m in st["models"].items():
            if name not in configs or m["state"] not in ("loaded", "loading"):
                continue
            try:
                entry = await self.describe(name)
            except (OSError, ValueError, KeyError):
                continue
            ttl, idle = m["ttl"], m["idle_seconds"]
            # busy (or loading): its idle time has not begun
            expires = NEVER if ttl is None else now - (idle if idle is not None and m["state"] == "loaded" else 0) + ttl
            held = [n for i, other in st["models"].items() if i == name or other.get("replica_of") == name
                    for n in other["held"].items()]  # its extra instances' bytes too (replicas = N)
            entry.update(size=sum(n for _, n in held), size_vram=sum(n for d, n in held if kinds.get(d) != "cpu"),
                         expires_at=wire.timestamp(min(expires, NEVER)),
                         context_length=wire.slot_context(m.get("context")) or 0)
            out.append(entry)
        return JSONResponse({"models": out})

    async def pull(self, request: Request):
        data = await _read(request)
        name = data.get("model") or data.get("name")
        if not isinstance(name, str) or not name:
            raise OllamaError(400, "model is required")
        listed = self.resolve({"model": name}, missing=None)
        if listed is None:
            try:
                await asyncio.to_thread(self.router.pull, name)
            except ValueError as e:
                raise OllamaError(400, str(e)) from None
        progress = ollama_pull.progress(self.router, listed or name)
        if data.get("stream", True) is False:
            last: dict[str, Any] = {}
            async for last in progress:
                pass
            return error(500, last["error"]) if "error" in last else JSONResponse(last)
        return StreamingResponse((wire.lines([o]) async for o in progress), media_type=NDJSON)

    async def delete(self, request: Request):
        data = await _read(request)
        name = self.resolve(data)
        try:
            await asyncio.to_thread(self.router.delete, name)
        except ValueError as e:
            raise OllamaError(400, str(e)) from None
        return Response(status_code=200)


async def _ndjson(chunks, translator: wire.Translator, t0: float) -> AsyncIterator[bytes]:
    """The engine's SSE stream as Ollama's NDJSON; an error under way is Ollama's last line."""
    buffer = bytearray()
    try:
        while batch := await chunks.anext_batch():
            for chunk in batch:
                buffer += chunk
            objects = [o for event in _sse_events(buffer) for o in translator.feed(event)]
            if objects:
                yield wire.lines(objects)
        yield wire.lines(translator.end(int((time.perf_counter() - t0) * 1e9)))
    except OllamaError as e:
        yield wire.lines([{"error": e.message}])
    except RouterError as e:
        yield wire.lines([{"error": router_error(e).message}])
    finally:
        chunks.abandon()  # a client that left stops generation


def _arrays(path: str) -> dict[str, list]:
    """A GGUF file's array values by key (the vocabulary, its merges...): Ollama's
    /api/show with ``verbose``."""
    from gguf import GGUFReader, GGUFValueType  # the router's own dependency, loaded when asked

    return {name: field.contents() for name, field in GGUFReader(path).fields.items()
            if field.types and field.types[0] == GGUFValueType.ARRAY}
