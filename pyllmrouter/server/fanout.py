"""Several choices in one OpenAI request: prompts × ``n``, each its own router request.

    {"prompt": [p0, p1], "n": 2} ──split──▶ p0, p0, p1, p1 ──▶ Router.arequest each
                                              (the model's slots serve them together)
    replies ──merge──────────────────▶ one reply, choice i = prompt i // n, copy i % n
    streams ──MergedStream───────────▶ one stream: every choice's first chunks
                                       together (or the refusal), then chunks as
                                       they come, each with its choice index

A copy with a seed gets seed + its copy number (otherwise n copies would be one
answer n times).  ``split`` and ``merge`` are pure.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..openai_params import is_tokens
from .errors import ApiError

__all__ = ["MAX_CHOICES", "MergedStream", "merge", "split"]

MAX_CHOICES = 64  # prompts × n in one request


def split(method: str, params: dict[str, Any], n: Any) -> list[dict[str, Any]]:
    """The requests one request stands for, in choice order (one: itself)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ApiError(400, f"'n' must be a positive integer, not {n!r}", param="n")
    prompts = [params.get("prompt")]
    p = prompts[0]
    if method == "complete" and isinstance(p, list) and len(p) > 1 and not is_tokens(p):
        prompts = p  # OpenAI's batch of prompts: strings or token lists (a flat token list is one prompt)
    if len(prompts) * n > MAX_CHOICES:
        raise ApiError(400, f"{len(prompts)} prompts × n={n} choices exceed the limit of {MAX_CHOICES} per request",
                       param="n" if n > 1 else "prompt")
    out = []
    for p in prompts:
        for copy in range(n):
            one = dict(params, prompt=p) if method == "complete" else dict(params)
            if copy and isinstance(one.get("seed"), int) and not isinstance(one["seed"], bool):
                one["seed"] += copy
            out.append(one)
    return out


def merge(replies: list[dict[str, Any]]) -> dict[str, Any]:
    """One reply of several: their choices in order, renumbered; their usage summed."""
    choices = [{**c, "index": i} for i, r in enumerate(replies) for c in r["choices"]]
    out = {**replies[0], "choices": choices}
    usage = _total([r.get("usage") for r in replies])
    if usage is not None:
        out["usage"] = usage
    return out


def _total(usages: list[Any]) -> dict[str, int] | None:
    """The token counts of all choices, if each has them."""
    if not all(isinstance(u, dict) for u in usages):
        return None
    return {k: sum(u.get(k, 0) for u in usages) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


class MergedStream:
    """Streams of one request's choices read as one (what EventStream reads): chunks in
    the order they arrive, each choice renumbered and under the first chunk's id."""

    def __init__(self, streams: list[Any]):
        self.streams = streams
        self._next: dict[int, asyncio.Future] = {}  # choice -> its pending anext_batch
        self._ended: set[int] = set()
        self._id: str | None = None
        self._started = False

    @property
    def done(self) -> bool:
        return len(self._ended) == len(self.streams)

    @property
    def usage(self) -> dict[str, int] | None:
        return _total([s.usage for s in self.streams])

    async def anext_batch(self) -> list[dict[str, Any]]:
        """The chunks of whichever choices have some ([] once all have ended).  The first
        call waits for every choice's first chunks, so that a choice the model refuses
        (a prompt longer than the context) refuses the request before it streams."""
        if not self._started:
            self._started = True
            firsts = await asyncio.gather(*(s.anext_batch() for s in self.streams), return_exceptions=True)
            failed = next((f for f in firsts if isinstance(f, BaseException)), None)
            if failed is not None:
                raise failed
            return [c for i, chunks in enumerate(firsts) for c in self._take(i, chunks)]
        while not self.done:
            for i, s in enumerate(self.streams):
                if i not in self._ended and i not in self._next:
                    self._next[i] = asyncio.ensure_future(s.anext_batch())
            ready, _ = await asyncio.wait(self._next.values(), return_when=asyncio.FIRST_COMPLETED)
            out = []
            for i, fut in list(self._next.items()):
                if fut not in ready:
                    continue
                del self._next[i]
                out.extend(self._take(i, fut.result()))  # a failure ends it (EventStream abandons the rest)
            if out:
                return out
        return []

    def _take(self, i: int, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Choice ``i``'s chunks under the merged id and its index; notes whether it ended."""
        if not chunks or self.streams[i].done:
            self._ended.add(i)
        for chunk in chunks:
            self._id = self._id or chunk.get("id")
            chunk["id"] = self._id
            for choice in chunk.get("choices", []):
                choice["index"] = i
        return chunks

    def cancel(self) -> None:
        for s in self.streams:
            s.cancel()

    def abandon(self) -> None:
        for fut in self._next.values():
            fut.cancel()
        self._next.clear()
        for s in self.streams:
            s.abandon()
