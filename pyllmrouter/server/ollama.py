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
import dataclasses
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
from pyllmrouter.errors import NeverFits, RouterError, UnknownModel
from pyllmrouter.router.api import Router
from pyllmrouter.router.exchange import Ask
from pyllmrouter.server import ollama_pull, ollama_wire as wire
from pyllmrouter.server.body import departed
from pyllmrouter.server.api_errors import ApiError, from_router_error
from pyllmrouter.server.ollama_wire import OllamaError
from pyllmrouter.server.forwarded import forwarded_of

__all__ = ["error", "mount"]

_LOG = logging.getLogger("pyllmrouter.ollama")
NDJSON = "application/x-ndjson"
TRIES = 3  # sends of a prompt cut to fit, the engine counting each (a cut text may tokenize longer)
NEVER = 253402300799.0  # 9999-12-31T23:59:59Z: a model kept for ever expires then


def error(status: int, message: str) -> JSONResponse:
    """Ollama's error shape."""
    return JSONResponse({"error": message}, status_code=status)


def _router_error(e: Exception) -> OllamaError:
    err = from_router_error(e)
    if isinstance(e, UnknownModel):
        return OllamaError(404, f"model '{e.args[0] if e.args else ''}' not found")
    return OllamaError(err.status, err.message)


def _engine_error(status: int, body: bytes) -> OllamaError:
    try:
        data = json.loads(body)
        message = data["error"]["message"] if isinstance(data.get("error"), dict) else data.get("error")
    except (ValueError, KeyError, TypeError, AttributeError):
        message = body.decode(errors="replace")
    return OllamaError(status, str(message or f"HTTP {status}"))


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
    headers_cache: dict[tuple[str, int, int], tuple[dict[str, Any], int]] = {}  # this event loop's only

    def handled(fn: Callable[..., Any]) -> Callable[..., Any]:
        async def run(request: Request) -> Response:
            try:
                return await fn(request)
            except OllamaError as e:
                return error(e.status, e.message)
            except ApiError as e:
                return error(e.status, e.message)
            except RouterError as e:
                e2 = _router_error(e)
                return error(e2.status, e2.message)
            except Exception as e:  # noqa: BLE001 - a bug: said in Ollama's shape, logged, the server goes on
                _LOG.exception("%s %s", request.method, request.url.path)
                return error(500, f"internal error: {type(e).__name__}: {e}")
        run.__name__ = fn.__name__
        return run

    async def read(request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            data = json.loads(raw or b"{}")
        except (ValueError, RecursionError) as e:
            raise OllamaError(400, f"invalid JSON: {e}") from None
        if not isinstance(data, dict):
            raise OllamaError(400, "the request body must be a JSON object")
        return data

    def resolve(data: dict[str, Any], missing: Any = OllamaError) -> Any:
        """The listed model a request names (as given, then without ":latest"); none:
        404, or ``missing`` where it is not OllamaError."""
        name = data.get("model") or data.get("name")
        if not isinstance(name, str) or not name:
            raise OllamaError(400, "model is required")
        for candidate in wire.listed_candidates(name):
            listed = router.scheduler.canonical(candidate)
            if listed is not None:
                return listed
        if missing is OllamaError:
            raise OllamaError(404, f"model '{name}' not found")
        return missing

    async def header(path: str) -> tuple[dict[str, Any], int]:
        st = os.stat(path)
        key = (path, st.st_size, st.st_mtime_ns)
        if key not in headers_cache:
            headers_cache[key] = await asyncio.to_thread(gguf_header.metadata, path)
        return headers_cache[key]


    async def describe(name: str) -> dict[str, Any]:
        cfg = router.scheduler.configs()[name]
        path = cfg.spec.path
        kv, parameters = await header(path)
        st = os.stat(path)
        # an id of the file as it is (no need to read gigabytes): its path, size and time
        digest = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()
        return {"name": wire.ollama_name(name), "model": wire.ollama_name(name),
                "modified_at": wire.timestamp(st.st_mtime), "size": st.st_size, "digest": digest,
                "details": wire.details(kv, parameters)}

    async def take(request: Request, model: str, path: str, body: dict[str, Any],
                   keep: float | None) -> tuple[Any, Any, int]:
        """The engine's reply to ``body`` at ``path``, its stream, and the nanoseconds the
        request waited for its model (Ollama's load_duration: a load, where it needed one); the
        model's idle time set as the request takes it (a cluster's node: as ``forward``
        relays, server/forwarded.py)."""
        asked, took = time.perf_counter(), []
        def leased(_instance: str) -> None:
            took.append(time.perf_counter())
            router.scheduler.keep_alive(model, keep)
        relayed = forwarded_of(request.scope)
        try:
            reply, chunks = await router.arelay(Ask(
                model, "POST", path, json.dumps(body).encode(), {}, {"content-type": "application/json"},
                gone=lambda: departed(request.receive), leased=leased, raise_for_status=False,
                waited=relayed.waited if relayed is not None else 0.0,
                running=relayed.running if relayed is not None else None))
        except RouterError as e:
            raise _router_error(e) from None
        return reply, chunks, int(((took[0] if took else asked) - asked) * 1e9)

    async def engine_json(request: Request, model: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """A counting or tokenizer endpoint's answer (an error status: the engine's error)."""
        reply, _, _ = await take(request, model, path, body, None)
        if reply.status >= 400:
            raise _engine_error(reply.status, reply.body)
        return json.loads(reply.body)

    async def tokens(request: Request, model: str, text: str, special: bool) -> list[int]:
        out = await engine_json(request, model, "/tokenize", {"content": text, "add_special": special})
        return [t if isinstance(t, int) else t["id"] for t in out["tokens"]]

    async def detokenize(request: Request, model: str, ids: list[int]) -> str:
        return (await engine_json(request, model, "/detokenize", {"tokens": ids}))["content"]

    async def counted(request: Request, model: str, body: dict[str, Any]) -> int:
        """The tokens of a chat request's prompt: its model's template and tokenizer, as the
        engine will make it."""
        out = await engine_json(request, model, "/chat/completions/input_tokens", body)
        return int(out["input_tokens"])

    async def load_only(model: str, keep: float | None) -> str:
        """No prompt: Ollama's load; with keep_alive 0, its unload: now where it is idle, else
        once its requests end (its idle time is 0: the reaper's next round after them)."""
        try:
            if keep == 0:
                router.scheduler.keep_alive(model, 0)
                m = router.status()["models"].get(model) or {}
                if m.get("state") == "loaded" and not m.get("leases"):
                    await asyncio.to_thread(router.unload, model)
                return "unload"
            await asyncio.to_thread(router.load, model)
            router.scheduler.keep_alive(model, keep)
        except RouterError as e:
            raise _router_error(e) from None
        return "load"

    async def refuse_unable(model: str, data: dict[str, Any], kind: str) -> None:
        """What the model cannot do (its GGUF header and projector say), refused as Ollama
        refuses it: an embedding model's chat, thinking, images."""
        try:
            kv, _ = await header(router.scheduler.configs()[model].spec.path)
        except (OSError, ValueError, KeyError):
            return  # its load says what is wrong
        projector = bool((router.status()["models"].get(model) or {}).get("projector"))
        refused = wire.refusal(model, wire.capabilities(kv, projector), data, kind)
        if refused is not None:
            raise refused

    def warnings(ignored: list[str]) -> dict[str, str]:
        return {"x-pyllmrouter-ignored-options": ", ".join(ignored)} if ignored else {}

    def context_of(model: str) -> dict[str, Any] | None:
        return (router.status()["models"].get(model) or {}).get("context")

    async def give_context(model: str, num_ctx: int | None) -> None:
        """``num_ctx`` given where the model's slots hold less: the model reloaded with the
        context that gives each slot ``num_ctx`` (as far as its training context), admitted
        by its probed bytes as any load, and kept so for later requests, as Ollama keeps it.
        Where no state of the router fits it, the model keeps its config and the error names
        the bytes."""
        if num_ctx is None:
            return
        if context_of(model) is None:  # never probed: its load says how its context is shared
            await asyncio.to_thread(router.load, model)
        context = context_of(model) or {}
        want = wire.context_asked(num_ctx, context)
        if want is None:
            return
        old = router.scheduler.configs()[model]
        total = wire.total_context(context, want)
        new = dataclasses.replace(old, spec=old.spec.replace(n_ctx=total))
        _LOG.info("model %s: num_ctx %d asks for %d tokens a slot (-c %d): reloading", model, num_ctx, want, total)
        await asyncio.to_thread(router.replace_model, new)
        try:
            await asyncio.to_thread(router.load, model)
        except NeverFits as e:
            await asyncio.to_thread(router.replace_model, old)
            raise OllamaError(507, f"num_ctx {num_ctx} cannot be given: model '{model}' with {want} tokens a slot "
                                   f"(-c {total}) {str(e).split(': ', 1)[-1]}") from None
        except RouterError:
            await asyncio.to_thread(router.replace_model, old)
            raise

    async def fit_turns(request: Request, model: str, body: dict[str, Any], n_ctx: int) -> dict[str, Any]:
        """``body`` with its oldest turns dropped until its prompt holds fewer than ``n_ctx``
        tokens (the fewest dropped; its system messages kept), as Ollama's chat truncates."""
        messages = body["messages"]
        starts = wire.turn_starts(messages)
        def cut(i: int) -> dict[str, Any]:
            return {**body, "messages": wire.kept_turns(messages, starts[i])}
        if not starts or await counted(request, model, cut(len(starts) - 1)) >= n_ctx:
            raise OllamaError(400, f"{wire.TOO_LONG}: the system messages and the newest turn alone take "
                                   f"{n_ctx} tokens or more, the context a request gets")
        lo, hi = 0, len(starts) - 1  # the first start that fits is in [lo, hi]; hi fits
        while lo < hi:
            mid = (lo + hi) // 2
            if await counted(request, model, cut(mid)) < n_ctx:
                hi = mid
            else:
                lo = mid + 1
        return cut(lo)

    async def cut_text(request: Request, model: str, text: str, drop: int, keep: int) -> str:
        """``text`` without ``drop`` of its tokens after its first ``keep`` (the cut text
        tokenized again: where the two sides merge into more tokens, more are dropped)."""
        ids = await tokens(request, model, text, False)
        target = len(ids) - drop
        for _ in range(TRIES):
            if drop >= len(ids) - min(keep, len(ids)):
                raise OllamaError(400, f"{wire.TOO_LONG}: the prompt cannot be cut to fit")
            text = await detokenize(request, model, wire.cut_prompt(ids, drop, keep))
            n = len(await tokens(request, model, text, False))
            if n <= target:
                return text
            drop += n - target
        raise OllamaError(400, f"{wire.TOO_LONG}: the prompt's cut still tokenizes past {target} tokens")

    async def shortened(request: Request, model: str, path: str, body: dict[str, Any],
                        over: tuple[int, int], data: dict[str, Any]) -> dict[str, Any]:
        """``body`` cut to fit the ``over[1]`` tokens the engine takes (it counted ``over[0]``):
        a chat's oldest turns dropped; a generate's prompt cut after its first num_keep tokens
        (none where it is templated), as Ollama's runner cuts it."""
        n_tokens, n_ctx = over
        if data.get("messages") is not None:
            return await fit_turns(request, model, body, n_ctx)
        drop = n_tokens - n_ctx + 1
        if path == "/completion":
            keep = int(((data.get("options") or {}).get("num_keep")) or 0)
            return {**body, "prompt": await cut_text(request, model, body["prompt"], drop, keep)}
        last = body.get("messages", [{}])[-1]
        if path != "/v1/chat/completions" or not isinstance(last.get("content"), str):
            raise OllamaError(400, f"{wire.TOO_LONG} ({n_tokens} tokens, the context a request gets is {n_ctx})")
        cut = {**last, "content": await cut_text(request, model, last["content"], drop, 0)}
        return {**body, "messages": [*body["messages"][:-1], cut]}

    async def fitted(request: Request, model: str, path: str, body: dict[str, Any], keep: float | None,
                     data: dict[str, Any]) -> tuple[Any, Any, int]:
        """The engine's reply to ``body``; one refused for its length cut to fit and sent again
        (``truncate``, Ollama's default), else Ollama's 400."""
        truncate, load_ns = wire.truncating(data), 0
        for _ in range(TRIES):
            reply, chunks, waited = await take(request, model, path, body, keep)
            load_ns += waited
            over = wire.exceeded(reply.status, reply.body) if reply.status >= 400 else None
            if over is None:
                return reply, chunks, load_ns
            if chunks is not None:
                chunks.abandon()
            if not truncate:
                raise OllamaError(400, f"{wire.TOO_LONG} ({over[0]} tokens, the context a request gets is "
                                       f"{over[1]})")
            body = await shortened(request, model, path, body, over, data)
        raise OllamaError(400, f"{wire.TOO_LONG}: still too long after {TRIES} cuts")

    async def infer(request: Request, kind: str) -> Response:
        t0, created = time.perf_counter(), time.time()
        data = await read(request)
        model = resolve(data)
        keep = wire.keep_alive_seconds(data.get("keep_alive"))
        stream = wire.streamed(data)
        wire.truncating(data)  # checked, whether or not it is needed
        await refuse_unable(model, data, kind)
        build = wire.chat_request if kind == "chat" else wire.generate_request
        path, body, ignored, num_ctx = build(data, model, stream)  # checked, whether or not it is sent
        if endpoints.load_only(f"/api/{kind}", data):
            reason = await load_only(model, keep)
            out: dict[str, Any] = {"model": data.get("model") or model, "created_at": wire.timestamp(created)}
            out.update({"message": {"role": "assistant", "content": ""}} if kind == "chat" else {"response": ""})
            out.update(done=True, done_reason=reason)
            return JSONResponse(out)
        extra = warnings(ignored)
        reloaded = time.perf_counter()
        await give_context(model, num_ctx)
        reloaded = time.perf_counter() - reloaded
        reply, chunks, load_ns = await fitted(request, model, path, body, keep, data)
        translator = wire.Translator(kind, path, data.get("model") or model, time.time, load_ns + int(reloaded * 1e9))
        if reply.status >= 400:
            if chunks is not None:
                chunks.abandon()
            raise _engine_error(reply.status, reply.body)
        if chunks is None:
            try:
                whole = json.loads(reply.body)
            except ValueError:
                raise OllamaError(502, "the engine's reply is not JSON") from None
            return JSONResponse(translator.whole(whole, int((time.perf_counter() - t0) * 1e9)), headers=extra)
        return StreamingResponse(_ndjson(chunks, translator, t0), media_type=NDJSON, headers=extra)

    async def embed(request: Request, legacy: bool) -> Response:
        t0 = time.perf_counter()
        data = await read(request)
        model = resolve(data)
        keep = wire.keep_alive_seconds(data.get("keep_alive"))
        dimensions = data.get("dimensions")
        if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)
                                       or dimensions < 1):
            raise OllamaError(400, f"dimensions must be a positive integer, not {dimensions!r}")
        body = wire.embed_request(data, model, legacy)
        wire.truncating(data)  # checked, whether or not it is needed
        if body["input"] in ("", []):  # nothing to embed: the model loaded, as Ollama does
            await load_only(model, keep)
            return JSONResponse({"embedding": []} if legacy else {"model": data.get("model") or model,
                                                                    "embeddings": []})
        reply, load_ns = await embedded(request, model, body, keep, data)
        if reply.status == 501:  # llama.cpp's "start it with --embeddings": this router's word for it
            raise OllamaError(400, f"{_engine_error(reply.status, reply.body).message} (model '{model}' is "
                                   f"not served for embeddings: embedding = true in its preset)")
        if reply.status >= 400:
            raise _engine_error(reply.status, reply.body)
        answer = json.loads(reply.body)
        vectors = [wire.normalize(d["embedding"], dimensions)
                   for d in sorted(answer.get("data") or [], key=lambda d: d.get("index", 0))]
        if legacy:
            return JSONResponse({"embedding": vectors[0] if vectors else []})
        total = int((time.perf_counter() - t0) * 1e9)
        return JSONResponse({"model": data.get("model") or model, "embeddings": vectors, "total_duration": total,
                             "load_duration": load_ns,
                             "prompt_eval_count": int((answer.get("usage") or {}).get("prompt_tokens") or 0)})

    async def embedded(request: Request, model: str, body: dict[str, Any], keep: float | None,
                       data: dict[str, Any]) -> tuple[Any, int]:
        """The engine's embeddings of ``body``; inputs refused for their length cut to fit and
        sent again (``truncate``, Ollama's default), else Ollama's 400."""
        load_ns = 0
        for _ in range(TRIES):
            reply, _, waited = await take(request, model, "/v1/embeddings", body, keep)
            load_ns += waited
            over = wire.exceeded(reply.status, reply.body)
            if over is None:
                return reply, load_ns
            if not wire.truncating(data):
                raise OllamaError(400, f"{wire.TOO_LONG} (an input of {over[0]} tokens, the most the model "
                                       f"takes is {over[1]})")
            body = {**body, "input": await cut_inputs(request, model, body["input"], over[1])}
        raise OllamaError(400, f"{wire.TOO_LONG}: still too long after {TRIES} cuts")

    async def cut_inputs(request: Request, model: str, given: str | list[str], limit: int) -> str | list[str]:
        """Each input longer than ``limit`` tokens (its special ones counted) cut to its first
        ones, as Ollama's embed truncates."""
        async def cut(text: str) -> str:
            whole = await tokens(request, model, text, True)
            if len(whole) <= limit:
                return text
            ids = await tokens(request, model, text, False)
            room = limit - (len(whole) - len(ids))
            if room <= 0:
                raise OllamaError(400, f"{wire.TOO_LONG}: the model's special tokens alone fill {limit} tokens")
            return await detokenize(request, model, ids[:room])
        if isinstance(given, str):
            return await cut(given)
        return [await cut(t) for t in given]

    @app.get("/api/version")
    async def version():
        return {"version": wire.VERSION}

    @app.get("/api/tags")
    @handled
    async def tags(request: Request):
        names = [c.name for c in router.models() if not c.hidden]
        models = []
        for name in names:
            try:
                models.append(await describe(name))
            except (OSError, ValueError, KeyError):
                continue  # a file gone or unreadable: its load says why
        return JSONResponse({"models": models})

    @app.post("/api/show")
    @handled
    async def show(request: Request):
        data = await read(request)
        name = resolve(data)
        cfg = router.scheduler.configs()[name]
        try:
            kv, parameters = await header(cfg.spec.path)
        except (OSError, ValueError) as e:
            raise OllamaError(500, f"model '{name}': {e}") from None
        verbose = data.get("verbose", False)
        if not isinstance(verbose, bool):
            raise OllamaError(400, f"verbose must be true or false, not {verbose!r}")
        m = router.status()["models"].get(name) or {}
        st = os.stat(cfg.spec.path)
        arrays = await asyncio.to_thread(_arrays, cfg.spec.path) if verbose else None
        return JSONResponse({
            "modelfile": f"# pyllmrouter: model {name}\nFROM {cfg.spec.path}\n",
            "parameters": wire.parameters(cfg.spec.to_args()), "template": kv.get("tokenizer.chat_template") or "",
            "license": kv.get("general.license") or "", "details": wire.details(kv, parameters),
            "model_info": wire.model_info(kv, parameters, wire.slot_context(m.get("context")), arrays),
            "capabilities": wire.capabilities(kv, bool(m.get("projector"))),
            "modified_at": wire.timestamp(st.st_mtime)})

    @app.get("/api/ps")
    @handled
    async def ps(request: Request):
        st = router.status()
        kinds = {n: d["kind"] for n, d in st["devices"].items()}
        now = time.time()
        configs = {c.name: c for c in router.models() if not c.hidden}
        out = []
        for name, m in st["models"].items():
            if name not in configs or m["state"] not in ("loaded", "loading"):
                continue
            try:
                entry = await describe(name)
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

    @app.post("/api/pull")
    @handled
    async def pull(request: Request):
        data = await read(request)
        name = data.get("model") or data.get("name")
        if not isinstance(name, str) or not name:
            raise OllamaError(400, "model is required")
        listed = resolve({"model": name}, missing=None)
        if listed is None:
            try:
                await asyncio.to_thread(router.pull, name)
            except ValueError as e:
                raise OllamaError(400, str(e)) from None
        progress = ollama_pull.progress(router, listed or name)
        if data.get("stream", True) is False:
            last: dict[str, Any] = {}
            async for last in progress:
                pass
            return error(500, last["error"]) if "error" in last else JSONResponse(last)
        return StreamingResponse((wire.lines([o]) async for o in progress), media_type=NDJSON)

    @app.delete("/api/delete")
    @handled
    async def delete(request: Request):
        data = await read(request)
        name = resolve(data)
        try:
            await asyncio.to_thread(router.delete, name)
        except ValueError as e:
            raise OllamaError(400, str(e)) from None
        return Response(status_code=200)

    for path, what in (("/api/create", ("creates no model: name a GGUF file in the model list (a preset, or "
                                         "POST /models to pull one)")),
                       ("/api/copy", "copies no model: give the model an alias in the preset"),
                       ("/api/push", "pushes no model to a registry"),
                       ("/api/blobs/{digest}", "takes no blobs: name a GGUF file in the model list")):
        def refuse(what: str = what):
            async def refused(request: Request):
                return error(501, f"pyllmrouter {what}")
            return refused
        app.add_api_route(path, refuse(), methods=["POST", "HEAD"] if "blobs" in path else ["POST"],
                          include_in_schema=False)

    @app.api_route("/api/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "HEAD", "PATCH"],
                   include_in_schema=False)
    async def unknown(rest: str):  # registered last: what no route above answers
        return error(404, f"404 page not found: /api/{rest} (or not with this method)")

    async def chat(request: Request) -> Response:
        return await infer(request, "chat")

    async def generate(request: Request) -> Response:
        return await infer(request, "generate")

    async def embed_new(request: Request) -> Response:
        return await embed(request, legacy=False)

    async def embed_legacy(request: Request) -> Response:
        return await embed(request, legacy=True)

    return {"/api/chat": handled(chat), "/api/generate": handled(generate), "/api/embed": handled(embed_new),
            "/api/embeddings": handled(embed_legacy)}


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
        yield wire.lines([{"error": _router_error(e).message}])
    finally:
        chunks.abandon()  # a client that left stops generation


def _arrays(path: str) -> dict[str, list]:
    """A GGUF file's array values by key (the vocabulary, its merges...): Ollama's
    /api/show with ``verbose``."""
    from gguf import GGUFReader, GGUFValueType  # the router's own dependency, loaded when asked

    return {name: field.contents() for name, field in GGUFReader(path).fields.items()
            if field.types and field.types[0] == GGUFValueType.ARRAY}
