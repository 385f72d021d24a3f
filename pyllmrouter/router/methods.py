"""The Python API's request methods, as an app developer calls them (mixed into ``Router``):
OpenAI-shaped chat, completions and embeddings, llama-server's tokenize and detokenize,
each plain or awaited, whole or streamed.

    router.chat(model, messages, stream=False, timeout=None, wait=None, extra_body=None, **options)
        options   llama-server's request keys (max_tokens, temperature, tools...): one it reads
                  nowhere is a TypeError at once, naming the nearest known one (options.py);
                  extra_body={...} sends keys unchecked, as the openai client's does
        timeout   seconds the whole request may take: not done by then, it is stopped (its
                  generation ended) and RequestTimeout (a TimeoutError) is raised
        wait      seconds it may wait for its model to load or make room (default: the
                  router's queue_timeout): past it, QueueTimeout
    a reply with an error status raises RequestFailed (its status and llama.cpp's message)

Replies are llama-server's JSON as dicts (replies.py types them); a stream is an iterator
(an async one, awaited) of its events' JSON.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator, Iterator, Literal, Mapping, Sequence, overload

from pyllmrouter.errors import RequestFailed, RequestTimeout
from pyllmrouter.protocol import HttpReply
from pyllmrouter.replies import ChatCompletion, ChatCompletionChunk, Completion, Embeddings, Message
from pyllmrouter.router.options import check
from pyllmrouter.router.services.streams import Stream

__all__ = ["Methods", "body_of", "ok_or_raise", "remaining"]

_POOLING_HINT = ("; an embedding model served for /v1/embeddings needs a pooling: start it with "
                 "ModelSpec(path, ('--embedding', '--pooling', 'mean')) (or cls, last, rank)")


def body_of(body: bytes | Mapping[str, Any]) -> bytes:
    """A request body: bytes as they are, a dict as JSON."""
    return body if isinstance(body, (bytes, bytearray)) else json.dumps(dict(body)).encode()


def remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def ok_or_raise(model: str, reply: HttpReply) -> HttpReply:
    """``reply``, or RequestFailed carrying its status and llama.cpp's message."""
    if reply.status < 400:
        return reply
    try:
        data = json.loads(reply.body)
    except ValueError:
        data = None
    err = data.get("error") if isinstance(data, dict) else None
    message = err.get("message") if isinstance(err, dict) else reply.body.decode(errors="replace")
    if "Pooling type 'none'" in message:
        message += _POOLING_HINT
    raise RequestFailed(model, f"HTTP {reply.status}", message, status=reply.status)


def _sse(model: str, buffer: bytearray) -> Iterator[dict[str, Any]]:
    """The complete ``data:`` events in ``buffer`` (consumed), as dicts; an ``error:`` event
    raises RequestFailed."""
    while (end := buffer.find(b"\n\n")) >= 0:
        event, buffer[:] = bytes(buffer[:end]), buffer[end + 2:]
        for line in event.split(b"\n"):
            if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
                yield json.loads(line[6:])
            elif line.startswith(b"error: "):
                err = json.loads(line[7:]).get("error", {})
                raise RequestFailed(model, "HTTP 500", err.get("message", "stream failed"))


def _events(model: str, stream: Stream) -> Iterator[dict[str, Any]]:
    buffer = bytearray()
    try:
        for chunk in stream:
            buffer += chunk
            yield from _sse(model, buffer)
    finally:
        stream.abandon()


async def _aevents(model: str, stream: Stream, deadline: float | None, timeout: float | None) -> AsyncIterator[dict]:
    buffer = bytearray()
    try:
        while True:
            try:
                chunks = await asyncio.wait_for(stream.anext_batch(), remaining(deadline))
            except asyncio.TimeoutError:
                raise RequestTimeout(model, timeout) from None
            if not chunks:
                return
            for chunk in chunks:
                buffer += chunk
                for event in _sse(model, buffer):
                    yield event
    finally:
        stream.abandon()


class Methods:
    """``Router``'s request methods (see the module's docstring), over the two its host
    gives: ``call`` and ``acall``."""

    def call(self, model: str, method: str, path: str, body: bytes | Mapping[str, Any] = b"",
             query: dict[str, str] | None = None, timeout: float | None = None, autoload: bool | None = None,
             headers: dict[str, str] | None = None, *, wait: float | None = None,
             raise_for_status: bool = True) -> "tuple[HttpReply, Stream | None]":
        """Any llama-server request for one model (the host's: ``Router.call``)."""
        raise NotImplementedError

    async def acall(self, model: str, method: str, path: str, body: bytes | Mapping[str, Any] = b"",
                    query: dict[str, str] | None = None, timeout: float | None = None,
                    autoload: bool | None = None, *args: Any, wait: float | None = None,
                    raise_for_status: bool = True, **kwargs: Any) -> "tuple[HttpReply, Stream | None]":
        """``call`` from a coroutine (the host's: ``Router.acall``)."""
        raise NotImplementedError

    # -- chat ---------------------------------------------------------------------------------

    @overload
    def chat(self, model: str, messages: Sequence[Message | Mapping[str, Any]], *, stream: Literal[False] = False,
             timeout: float | None = None, wait: float | None = None, autoload: bool | None = None,
             extra_body: Mapping[str, Any] | None = None, **options: Any) -> ChatCompletion: ...

    @overload
    def chat(self, model: str, messages: Sequence[Message | Mapping[str, Any]], *, stream: Literal[True],
             timeout: float | None = None, wait: float | None = None, autoload: bool | None = None,
             extra_body: Mapping[str, Any] | None = None, **options: Any) -> Iterator[ChatCompletionChunk]: ...

    def chat(self, model, messages, *, stream=False, timeout=None, wait=None, autoload=None, extra_body=None,
             **options):
        """An OpenAI chat completion as llama-server answers it (``POST /v1/chat/completions``):
        its JSON, or with ``stream=True`` an iterator of its events' JSON.  ``options`` are
        llama-server's request keys (``max_tokens``, ``temperature``, ``tools``...): an
        unknown one is a TypeError at once; ``extra_body`` sends keys unchecked.
        ``timeout``: seconds the whole request may take (then RequestTimeout, the request
        stopped); ``wait``: seconds it may wait for the model (then QueueTimeout)."""
        return self._openai("chat", model, "/v1/chat/completions", {"messages": list(messages)}, options,
                            extra_body, stream, timeout, wait, autoload)

    @overload
    async def achat(self, model: str, messages: Sequence[Message | Mapping[str, Any]], *,
                    stream: Literal[False] = False, timeout: float | None = None, wait: float | None = None,
                    autoload: bool | None = None, extra_body: Mapping[str, Any] | None = None,
                    **options: Any) -> ChatCompletion: ...

    @overload
    async def achat(self, model: str, messages: Sequence[Message | Mapping[str, Any]], *, stream: Literal[True],
                    timeout: float | None = None, wait: float | None = None, autoload: bool | None = None,
                    extra_body: Mapping[str, Any] | None = None,
                    **options: Any) -> AsyncIterator[ChatCompletionChunk]: ...

    async def achat(self, model, messages, *, stream=False, timeout=None, wait=None, autoload=None, extra_body=None,
                    **options):
        """``chat`` awaited in the running event loop (an async iterator of events with
        ``stream=True``)."""
        return await self._aopenai("achat", model, "/v1/chat/completions", {"messages": list(messages)}, options,
                                   extra_body, stream, timeout, wait, autoload)

    # -- completions ------------------------------------------------------------------------------

    @overload
    def complete(self, model: str, prompt: str | list[int], *, stream: Literal[False] = False,
                 timeout: float | None = None, wait: float | None = None, autoload: bool | None = None,
                 extra_body: Mapping[str, Any] | None = None, **options: Any) -> Completion: ...

    @overload
    def complete(self, model: str, prompt: str | list[int], *, stream: Literal[True], timeout: float | None = None,
                 wait: float | None = None, autoload: bool | None = None,
                 extra_body: Mapping[str, Any] | None = None, **options: Any) -> Iterator[Completion]: ...

    def complete(self, model, prompt, *, stream=False, timeout=None, wait=None, autoload=None, extra_body=None,
                 **options):
        """An OpenAI completion of ``prompt`` (text or token ids, ``POST /v1/completions``):
        its JSON, or with ``stream=True`` an iterator of its events' JSON.  Options,
        ``timeout`` and ``wait`` as for ``chat``."""
        return self._openai("complete", model, "/v1/completions", {"prompt": prompt}, options, extra_body, stream,
                            timeout, wait, autoload)

    @overload
    async def acomplete(self, model: str, prompt: str | list[int], *, stream: Literal[False] = False,
                        timeout: float | None = None, wait: float | None = None, autoload: bool | None = None,
                        extra_body: Mapping[str, Any] | None = None, **options: Any) -> Completion: ...

    @overload
    async def acomplete(self, model: str, prompt: str | list[int], *, stream: Literal[True],
                        timeout: float | None = None, wait: float | None = None, autoload: bool | None = None,
                        extra_body: Mapping[str, Any] | None = None, **options: Any) -> AsyncIterator[Completion]: ...

    async def acomplete(self, model, prompt, *, stream=False, timeout=None, wait=None, autoload=None,
                        extra_body=None, **options):
        """``complete`` awaited in the running event loop."""
        return await self._aopenai("acomplete", model, "/v1/completions", {"prompt": prompt}, options, extra_body,
                                   stream, timeout, wait, autoload)

    # -- embeddings ---------------------------------------------------------------------------------

    def embed(self, model: str, input: str | list[str], *, timeout: float | None = None, wait: float | None = None,
              autoload: bool | None = None, extra_body: Mapping[str, Any] | None = None, **options: Any) -> Embeddings:
        """OpenAI embeddings of ``input`` (``POST /v1/embeddings``).  The model must be served
        as an embedding model with a pooling, as llama-server's OpenAI endpoint requires
        (``ModelSpec(path, ("--embedding", "--pooling", "mean"))``, or a model whose file
        says its pooling)."""
        return self._openai("embed", model, "/v1/embeddings", {"input": input}, options, extra_body, False, timeout,
                            wait, autoload)

    async def aembed(self, model: str, input: str | list[str], *, timeout: float | None = None,
                     wait: float | None = None, autoload: bool | None = None,
                     extra_body: Mapping[str, Any] | None = None, **options: Any) -> Embeddings:
        """``embed`` awaited in the running event loop."""
        return await self._aopenai("aembed", model, "/v1/embeddings", {"input": input}, options, extra_body, False,
                                   timeout, wait, autoload)

    # -- tokens ---------------------------------------------------------------------------------------

    def tokenize(self, model: str, text: str, *, add_special: bool = False, timeout: float | None = None,
                 wait: float | None = None, autoload: bool | None = None) -> list[int]:
        """``text``'s token ids in ``model``'s vocabulary (llama-server's ``POST /tokenize``;
        ``add_special``: with the BOS and the like the model's template adds)."""
        reply, _ = self.call(model, "POST", "/tokenize", {"content": text, "add_special": add_special},
                             timeout=timeout, wait=wait, autoload=autoload)
        return json.loads(reply.body)["tokens"]

    async def atokenize(self, model: str, text: str, *, add_special: bool = False, timeout: float | None = None,
                        wait: float | None = None, autoload: bool | None = None) -> list[int]:
        """``tokenize`` awaited in the running event loop."""
        reply, _ = await self.acall(model, "POST", "/tokenize", {"content": text, "add_special": add_special},
                                    timeout=timeout, wait=wait, autoload=autoload)
        return json.loads(reply.body)["tokens"]

    def detokenize(self, model: str, tokens: Sequence[int], *, timeout: float | None = None,
                   wait: float | None = None, autoload: bool | None = None) -> str:
        """The text of ``tokens`` in ``model``'s vocabulary (llama-server's ``POST /detokenize``)."""
        reply, _ = self.call(model, "POST", "/detokenize", {"tokens": list(tokens)}, timeout=timeout, wait=wait,
                             autoload=autoload)
        return json.loads(reply.body)["content"]

    async def adetokenize(self, model: str, tokens: Sequence[int], *, timeout: float | None = None,
                          wait: float | None = None, autoload: bool | None = None) -> str:
        """``detokenize`` awaited in the running event loop."""
        reply, _ = await self.acall(model, "POST", "/detokenize", {"tokens": list(tokens)}, timeout=timeout,
                                    wait=wait, autoload=autoload)
        return json.loads(reply.body)["content"]

    # -- the shared part -------------------------------------------------------------------------------

    def _openai(self, where: str, model: str, path: str, fixed: dict[str, Any], options: Mapping[str, Any],
                extra: Mapping[str, Any] | None, stream: bool, timeout: float | None, wait: float | None,
                autoload: bool | None):
        check(where, options)
        body = {**options, **fixed, "model": model, **({"stream": True} if stream else {}), **(extra or {})}
        reply, chunks = self.call(model, "POST", path, body, timeout=timeout, wait=wait, autoload=autoload)
        return _events(model, chunks) if chunks is not None else json.loads(reply.body)

    async def _aopenai(self, where: str, model: str, path: str, fixed: dict[str, Any],
                       options: Mapping[str, Any], extra: Mapping[str, Any] | None, stream: bool,
                       timeout: float | None, wait: float | None, autoload: bool | None):
        check(where, options)
        body = {**options, **fixed, "model": model, **({"stream": True} if stream else {}), **(extra or {})}
        deadline = None if timeout is None else time.monotonic() + timeout
        reply, chunks = await self.acall(model, "POST", path, body, timeout=timeout, wait=wait, autoload=autoload)
        return _aevents(model, chunks, deadline, timeout) if chunks is not None else json.loads(reply.body)
