"""What Ollama's routes (server/ollama.py) ask of a model's engine, through the router:

    a request relayed to its model (Router.arelay), its keep_alive set as it takes the model
        (Scheduler.keep_alive), the time it waited for the model counted (load_duration)
    a prompt the engine refuses for its length: cut to fit and sent again (truncate): a chat's
        oldest turns dropped (counted by /chat/completions/input_tokens), a prompt or input cut
        by /tokenize, /detokenize
    num_ctx past the slot's context: the model's config replaced with a -c that gives it
        (Router.replace_model), loaded by its probed bytes
    no prompt: the model loaded, or with keep_alive 0 unloaded

Errors are OllamaError (the routes answer them in Ollama's shape); ``router_error`` and
``engine_error`` say the router's and the engine's in it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from typing import Any

from fastapi import Request

from pyllmrouter.errors import NeverFits, RouterError, UnknownModel
from pyllmrouter.router.api import Router
from pyllmrouter.router.exchange import Ask
from pyllmrouter.server import ollama_wire as wire
from pyllmrouter.server.api_errors import from_router_error
from pyllmrouter.server.body import departed
from pyllmrouter.server.forwarded import forwarded_of
from pyllmrouter.server.ollama_wire import OllamaError

__all__ = ["OllamaEngine", "engine_error", "router_error"]

_LOG = logging.getLogger("pyllmrouter.ollama")
TRIES = 3  # sends of a prompt cut to fit, the engine counting each (a cut text may tokenize longer)


def router_error(e: Exception) -> OllamaError:
    """A router error as Ollama says it (an unknown model: its 404)."""
    err = from_router_error(e)
    if isinstance(e, UnknownModel):
        return OllamaError(404, f"model '{e.args[0] if e.args else ''}' not found")
    return OllamaError(err.status, err.message)


def engine_error(status: int, body: bytes) -> OllamaError:
    """An engine's error reply (OpenAI's shape, llama-server's, or text) as Ollama's."""
    try:
        data = json.loads(body)
        message = data["error"]["message"] if isinstance(data.get("error"), dict) else data.get("error")
    except (ValueError, KeyError, TypeError, AttributeError):
        message = body.decode(errors="replace")
    return OllamaError(status, str(message or f"HTTP {status}"))


class OllamaEngine:
    """The engine's side of Ollama's requests: relays, token counts, cuts to fit, loads."""

    def __init__(self, router: Router):
        self.router = router

    async def take(self, request: Request, model: str, path: str, body: dict[str, Any],
                   keep: float | None) -> tuple[Any, Any, int]:
        """The engine's reply to ``body`` at ``path``, its stream, and the nanoseconds the
        request waited for its model (Ollama's load_duration: a load, where it needed one); the
        model's idle time set as the request takes it (a cluster's node: as ``forward``
        relays, server/forwarded.py)."""
        asked, took = time.perf_counter(), []
        def leased(_instance: str) -> None:
            took.append(time.perf_counter())
            self.router.scheduler.keep_alive(model, keep)
        relayed = forwarded_of(request.scope)
        try:
            reply, chunks = await self.router.arelay(Ask(
                model, "POST", path, json.dumps(body).encode(), {}, {"content-type": "application/json"},
                gone=lambda: departed(request.receive), leased=leased, raise_for_status=False,
                waited=relayed.waited if relayed is not None else 0.0,
                running=relayed.running if relayed is not None else None))
        except RouterError as e:
            raise router_error(e) from None
        return reply, chunks, int(((took[0] if took else asked) - asked) * 1e9)

    async def engine_json(self, request: Request, model: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """A counting or tokenizer endpoint's answer (an error status: the engine's error)."""
        reply, _, _ = await self.take(request, model, path, body, None)
        if reply.status >= 400:
            raise engine_error(reply.status, reply.body)
        return json.loads(reply.body)

    async def tokens(self, request: Request, model: str, text: str, special: bool) -> list[int]:
        out = await self.engine_json(request, model, "/tokenize", {"content": text, "add_special": special})
        return [t if isinstance(t, int) else t["id"] for t in out["tokens"]]

    async def detokenize(self, request: Request, model: str, ids: list[int]) -> str:
        return (await self.engine_json(request, model, "/detokenize", {"tokens": ids}))["content"]

    async def counted(self, request: Request, model: str, body: dict[str, Any]) -> int:
        """The tokens of a chat request's prompt: its model's template and tokenizer, as the
        engine will make it."""
        out = await self.engine_json(request, model, "/chat/completions/input_tokens", body)
        return int(out["input_tokens"])

    async def load_only(self, model: str, keep: float | None) -> str:
        """No prompt: Ollama's load; with keep_alive 0, its unload: now where it is idle, else
        once its requests end (its idle time is 0: the reaper's next round after them)."""
        router = self.router
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
            raise router_error(e) from None
        return "load"

    def context_of(self, model: str) -> dict[str, Any] | None:
        return (self.router.status()["models"].get(model) or {}).get("context")

    async def give_context(self, model: str, num_ctx: int | None) -> None:
        """``num_ctx`` given where the model's slots hold less: the model reloaded with the
        context that gives each slot ``num_ctx`` (as far as its training context), admitted
        by its probed bytes as any load, and kept so for later requests, as Ollama keeps it.
        Where no state of the router fits it, the model keeps its config and the error names
        the bytes."""
        router = self.router
        if num_ctx is None:
            return
        if self.context_of(model) is None:  # never probed: its load says how its context is shared
            await asyncio.to_thread(router.load, model)
        context = self.context_of(model) or {}
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

    async def fit_turns(self, request: Request, model: str, body: dict[str, Any], n_ctx: int) -> dict[str, Any]:
        """``body`` with its oldest turns dropped until its prompt holds fewer than ``n_ctx``
        tokens (the fewest dropped; its system messages kept), as Ollama's chat truncates."""
        messages = body["messages"]
        starts = wire.turn_starts(messages)
        def cut(i: int) -> dict[str, Any]:
            return {**body, "messages": wire.kept_turns(messages, starts[i])}
        if not starts or await self.counted(request, model, cut(len(starts) - 1)) >= n_ctx:
            raise OllamaError(400, f"{wire.TOO_LONG}: the system messages and the newest turn alone take "
                                   f"{n_ctx} tokens or more, the context a request gets")
        lo, hi = 0, len(starts) - 1  # the first start that fits is in [lo, hi]; hi fits
        while lo < hi:
            mid = (lo + hi) // 2
            if await self.counted(request, model, cut(mid)) < n_ctx:
                hi = mid
            else:
                lo = mid + 1
        return cut(lo)

    async def cut_text(self, request: Request, model: str, text: str, drop: int, keep: int) -> str:
        """``text`` without ``drop`` of its tokens after its first ``keep`` (the cut text
        tokenized again: where the two sides merge into more tokens, more are dropped)."""
        ids = await self.tokens(request, model, text, False)
        target = len(ids) - drop
        for _ in range(TRIES):
            if drop >= len(ids) - min(keep, len(ids)):
                raise OllamaError(400, f"{wire.TOO_LONG}: the prompt cannot be cut to fit")
            text = await self.detokenize(request, model, wire.cut_prompt(ids, drop, keep))
            n = len(await self.tokens(request, model, text, False))
            if n <= target:
                return text
            drop += n - target
        raise OllamaError(400, f"{wire.TOO_LONG}: the prompt's cut still tokenizes past {target} tokens")

    async def shortened(self, request: Request, model: str, path: str, body: dict[str, Any],
                        over: tuple[int, int], data: dict[str, Any]) -> dict[str, Any]:
        """``body`` cut to fit the ``over[1]`` tokens the engine takes (it counted ``over[0]``):
        a chat's oldest turns dropped; a generate's prompt cut after its first num_keep tokens
        (none where it is templated), as Ollama's runner cuts it."""
        n_tokens, n_ctx = over
        if data.get("messages") is not None:
            return await self.fit_turns(request, model, body, n_ctx)
        drop = n_tokens - n_ctx + 1
        if path == "/completion":
            keep = int(((data.get("options") or {}).get("num_keep")) or 0)
            return {**body, "prompt": await self.cut_text(request, model, body["prompt"], drop, keep)}
        last = body.get("messages", [{}])[-1]
        if path != "/v1/chat/completions" or not isinstance(last.get("content"), str):
            raise OllamaError(400, f"{wire.TOO_LONG} ({n_tokens} tokens, the context a request gets is {n_ctx})")
        cut = {**last, "content": await self.cut_text(request, model, last["content"], drop, 0)}
        return {**body, "messages": [*body["messages"][:-1], cut]}

    async def fitted(self, request: Request, model: str, path: str, body: dict[str, Any], keep: float | None,
                     data: dict[str, Any]) -> tuple[Any, Any, int]:
        """The engine's reply to ``body``; one refused for its length cut to fit and sent again
        (``truncate``, Ollama's default), else Ollama's 400."""
        truncate, load_ns = wire.truncating(data), 0
        for _ in range(TRIES):
            reply, chunks, waited = await self.take(request, model, path, body, keep)
            load_ns += waited
            over = wire.exceeded(reply.status, reply.body) if reply.status >= 400 else None
            if over is None:
                return reply, chunks, load_ns
            if chunks is not None:
                chunks.abandon()
            if not truncate:
                raise OllamaError(400, f"{wire.TOO_LONG} ({over[0]} tokens, the context a request gets is "
                                       f"{over[1]})")
            body = await self.shortened(request, model, path, body, over, data)
        raise OllamaError(400, f"{wire.TOO_LONG}: still too long after {TRIES} cuts")

    async def embedded(self, request: Request, model: str, body: dict[str, Any], keep: float | None,
                       data: dict[str, Any]) -> tuple[Any, int]:
        """The engine's embeddings of ``body``; inputs refused for their length cut to fit and
        sent again (``truncate``, Ollama's default), else Ollama's 400."""
        load_ns = 0
        for _ in range(TRIES):
            reply, _, waited = await self.take(request, model, "/v1/embeddings", body, keep)
            load_ns += waited
            over = wire.exceeded(reply.status, reply.body)
            if over is None:
                return reply, load_ns
            if not wire.truncating(data):
                raise OllamaError(400, f"{wire.TOO_LONG} (an input of {over[0]} tokens, the most the model "
                                       f"takes is {over[1]})")
            body = {**body, "input": await self.cut_inputs(request, model, body["input"], over[1])}
        raise OllamaError(400, f"{wire.TOO_LONG}: still too long after {TRIES} cuts")

    async def cut_inputs(self, request: Request, model: str, given: str | list[str],
                         limit: int) -> str | list[str]:
        """Each input longer than ``limit`` tokens (its special ones counted) cut to its first
        ones, as Ollama's embed truncates."""
        async def cut(text: str) -> str:
            whole = await self.tokens(request, model, text, True)
            if len(whole) <= limit:
                return text
            ids = await self.tokens(request, model, text, False)
            room = limit - (len(whole) - len(ids))
            if room <= 0:
                raise OllamaError(400, f"{wire.TOO_LONG}: the model's special tokens alone fill {limit} tokens")
            return await self.detokenize(request, model, ids[:room])
        if isinstance(given, str):
            return await cut(given)
        return [await cut(t) for t in given]
