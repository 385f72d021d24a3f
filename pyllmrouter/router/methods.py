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

Replies are llama-server's JSON as dicts (replies.py types them); a stream is ``Events``
(``AsyncEvents`` for the awaited forms) of its events' JSON: an iterator that is also a
context manager, whose end (read, closed, left by ``with``, its task cancelled, dropped)
stops the generation and frees the slot:

    with router.chat(model, messages, stream=True) as events:
        for event in events: ...
    async with router.achat(model, messages, stream=True) as events:
        async for event in events: ...
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import json
import threading
import time
from typing import (Any, Awaitable, Callable, Generator, Generic, Iterator, Literal, Mapping,
                    Sequence, TypeVar, overload)

from pyllmrouter.errors import RequestFailed, RequestTimeout
from pyllmrouter.protocol import HttpReply
from pyllmrouter.replies import ChatCompletion, ChatCompletionChunk, Completion, Embeddings, Message
from pyllmrouter.router.exchange import Ask, Exchange, checked_seconds, remaining
from pyllmrouter.router.options import check
from pyllmrouter.router.services.streams import Stream
from pyllmrouter.router.workers.conduit import Served

__all__ = ["Methods", "Events", "AsyncEvents"]

E = TypeVar("E")



def _post(model: str, path: str, timeout: Any, wait: Any, autoload: bool | None) -> Ask:
    return Ask(model, "POST", path, timeout=timeout, wait=wait, autoload=autoload)


def _checked_stream(where: str, stream: Any) -> bool:
    if not isinstance(stream, bool):
        raise TypeError(f"{where}(): stream must be True or False, not {type(stream).__name__} {stream!r}")
    return stream


def _checked_messages(where: str, messages: Any) -> list[Any]:
    example = "[{'role': 'user', 'content': 'hi'}]"
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, (list, tuple)):
        hint = "; for a plain prompt, complete(model, prompt)" if isinstance(messages, str) else ""
        raise TypeError(f"{where}(): messages must be a list of messages such as {example}, "
                        f"not {type(messages).__name__}{hint}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"{where}(): messages[{i}] must be a dict such as {{'role': 'user', 'content': 'hi'}}, "
                            f"not {type(m).__name__} {m!r}")
    return list(messages)


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


class Events(Generic[E]):
    """A stream's events (llama-server's ``data:`` JSON), as they come.  Its end stops the
    generation and frees the model's slot: read to the end, ``close()``, left by ``with``,
    an error raised while reading it, or the object dropped.  A stream left with ``break``
    outside a ``with`` goes on until it is closed or collected."""

    def __init__(self, model: str, stream: Stream):
        self._model, self._stream = model, stream
        self._buffer = bytearray()
        self._ready: collections.deque[Any] = collections.deque()
        self._closed = False

    def __iter__(self) -> "Events[E]":
        return self

    def __next__(self) -> E:
        if self._closed:
            raise StopIteration
        while not self._ready:
            try:
                chunk = next(self._stream)
                self._buffer += chunk
                self._ready.extend(_sse(self._model, self._buffer))
            except StopIteration:
                raise
            except BaseException:
                self._stream.abandon()
                raise
        return self._ready.popleft()

    def close(self) -> None:
        """Stop the generation; return once the worker has ended the request (its engine
        frees the slot at its next step).  Nothing more is read after it."""
        self._closed = True
        self._ready.clear()
        self._stream.close()

    def __enter__(self) -> "Events[E]":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncEvents(Generic[E]):
    """``Events`` for a coroutine: ``async for`` it directly (the request starts at its
    first event), or await it first (the request started, its status checked), or
    ``async with`` it.  Its end stops the generation: read to the end, ``aclose()``, left
    by ``async with``, the reading task cancelled, an error, or the object dropped."""

    def __init__(self, model: str, opening: Callable[[], Awaitable["tuple[HttpReply, Stream | None]"]],
                 deadline: float | None, timeout: float | None):
        self._model, self._opening = model, opening
        self._deadline, self._timeout = deadline, timeout
        self._stream: Stream | None = None
        self._buffer = bytearray()
        self._ready: collections.deque[Any] = collections.deque()
        self._closed = False

    async def _open(self) -> Stream | None:
        """The stream, its request sent first if need be; None once closed (nothing sent)."""
        if self._closed:
            return None
        if self._stream is None:
            reply, stream = await self._opening()
            if stream is None:  # llama-server answered whole (an error is raised before this)
                raise RequestFailed(self._model, f"HTTP {reply.status}", "the reply was not a stream")
            self._stream = stream
        return self._stream

    def __await__(self) -> Generator[Any, None, "AsyncEvents[E]"]:
        return self._started().__await__()

    async def _started(self) -> "AsyncEvents[E]":
        await self._open()
        return self

    def __aiter__(self) -> "AsyncEvents[E]":
        return self

    async def __anext__(self) -> E:
        stream = await self._open()
        if stream is None:
            raise StopAsyncIteration
        while not self._ready:
            try:
                chunks = await asyncio.wait_for(stream.anext_batch(), remaining(self._deadline))
            except asyncio.TimeoutError:
                stream.abandon()
                raise RequestTimeout(self._model, self._timeout) from None
            except BaseException:
                stream.abandon()
                raise
            if not chunks:
                raise StopAsyncIteration
            for chunk in chunks:
                self._buffer += chunk
                try:
                    self._ready.extend(_sse(self._model, self._buffer))
                except BaseException:
                    stream.abandon()
                    raise
        return self._ready.popleft()

    async def aclose(self) -> None:
        """Stop the generation; return once the worker has ended the request (its engine
        frees the slot at its next step).  Nothing more is read, nor sent, after it."""
        self._closed = True
        self._ready.clear()
        if self._stream is not None:
            await self._stream.aclose()

    async def __aenter__(self) -> "AsyncEvents[E]":
        await self._open()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def __del__(self) -> None:
        if self._stream is not None:
            self._stream.abandon()


class Methods:
    """The request methods of ``pyllmrouter.Router``: any llama-server request (``call``,
    ``acall``), chat, completions, embeddings, tokenize and detokenize, each plain or
    awaited, whole or streamed.  Each request is an ``Ask`` whose whole life one
    ``Exchange`` owns (router/exchange.py); ``exchange`` makes it (the router's)."""

    def __init__(self, exchange: Callable[[Ask], Exchange]):
        self._exchange_of = exchange

    def call(self, model: str, method: str, path: str, body: bytes | Mapping[str, Any] = b"",
             query: dict[str, str] | None = None, timeout: float | None = None, autoload: bool | None = None,
             headers: dict[str, str] | None = None, *, wait: float | None = None,
             raise_for_status: bool = True) -> "tuple[HttpReply, Stream | None]":
        """Any llama-server request for one model (``method`` GET, POST or DELETE, ``path``
        as llama-server serves it, ``body`` bytes or a dict sent as JSON, ``headers`` as its
        client sent them): llama.cpp's reply, and for a stream the Stream of its body's
        chunks (bytes).  The model is loaded first if it must be.  An error status raises
        RequestFailed (``raise_for_status=False``: the reply is returned as it is).
        ``timeout``: seconds the whole request may take, the stream read to its end
        included (then RequestTimeout, the request stopped); ``wait``: seconds it may wait
        for its model (default: the router's queue_timeout; then QueueTimeout)."""
        return self._exchange_of(Ask(model, method, path, body, query, headers, timeout=timeout, wait=wait,
                                     autoload=autoload, raise_for_status=raise_for_status)).run()

    async def acall(self, model: str, method: str, path: str, body: bytes | Mapping[str, Any] = b"",
                    query: dict[str, str] | None = None, timeout: float | None = None,
                    autoload: bool | None = None, headers: dict[str, str] | None = None, *,
                    wait: float | None = None, raise_for_status: bool = True) -> "tuple[HttpReply, Stream | None]":
        """``call`` awaited in the running event loop.  A model that can take the request now
        is leased in the loop (no thread hop before the worker has it); otherwise the lease
        is waited for in a thread.  Cancelling the awaiting task withdraws a wait for the
        model (no lease, no load, no eviction) and stops a request in flight.  ``timeout``
        bounds the first reply (a stream's reader bounds the rest); ``wait`` and
        ``raise_for_status`` as in ``call``."""
        return await self.arelay(Ask(model, method, path, body, query, headers, timeout=timeout, wait=wait,
                                     autoload=autoload, raise_for_status=raise_for_status))

    async def arelay(self, ask: Ask) -> "Served | tuple[HttpReply, Stream | None]":
        """One request, sent as ``ask`` says (router/exchange.py, ``Ask``): the HTTP server's
        requests (relayed, or with ``ask.hand`` answered by the worker on the client's
        connection itself: then Served, once it has), a conversation's turn, a cluster node's
        claimed run, and ``acall``: (reply, stream), or Served."""
        return await self._exchange_of(ask).arun()

    def serve_now(self, ask: Ask) -> "asyncio.Future | None":
        """A native request (``ask.hand``) where nothing need wait, in the event loop without a
        coroutine: handed over at once where the model can take it now and its worker the
        connection (the future of the worker's answer, the lease released when it comes);
        None where not (nothing taken, nothing sent).  ``ask.hand.follow``: the next
        requests like this one that the worker may read itself on the connection
        (server/connection.py, ``Handover.follow``), under this lease, never past the turn of
        a model being drained for a waiter (``Scheduler.end_follows``); ``ask.hand.progress``
        gets the answers listed meanwhile, the answer the rest."""
        return self._exchange_of(ask).run_now()

    # -- chat ---------------------------------------------------------------------------------

    @overload
    def chat(self, model: str, messages: Sequence[Message | Mapping[str, Any]], *, stream: Literal[False] = False,
             timeout: float | None = None, wait: float | None = None, autoload: bool | None = None,
             extra_body: Mapping[str, Any] | None = None, **options: Any) -> ChatCompletion: ...

    @overload
    def chat(self, model: str, messages: Sequence[Message | Mapping[str, Any]], *, stream: Literal[True],
             timeout: float | None = None, wait: float | None = None, autoload: bool | None = None,
             extra_body: Mapping[str, Any] | None = None, **options: Any) -> Events[ChatCompletionChunk]: ...

    @overload
    def chat(self, model: str, messages: Sequence[Message | Mapping[str, Any]], *, stream: bool,
             timeout: float | None = None, wait: float | None = None, autoload: bool | None = None,
             extra_body: Mapping[str, Any] | None = None,
             **options: Any) -> ChatCompletion | Events[ChatCompletionChunk]: ...

    def chat(self, model, messages, *, stream=False, timeout=None, wait=None, autoload=None, extra_body=None,
             **options):
        """An OpenAI chat completion as llama-server answers it (``POST /v1/chat/completions``):
        its JSON, or with ``stream=True`` its events (``Events``: iterate it inside ``with``).
        ``options`` are llama-server's request keys (``max_tokens``, ``temperature``,
        ``tools``...): an unknown one is a TypeError at once; ``extra_body`` sends keys
        unchecked.  ``timeout``: seconds the whole request may take (then RequestTimeout,
        the request stopped); ``wait``: seconds it may wait for the model (then
        QueueTimeout)."""
        fixed = {"messages": _checked_messages("chat", messages)}
        return self._openai("chat", _post(model, "/v1/chat/completions", timeout, wait, autoload),
                            fixed, options, extra_body, stream)

    @overload
    def achat(self, model: str, messages: Sequence[Message | Mapping[str, Any]], *,
              stream: Literal[False] = False, timeout: float | None = None, wait: float | None = None,
              autoload: bool | None = None, extra_body: Mapping[str, Any] | None = None,
              **options: Any) -> Awaitable[ChatCompletion]: ...

    @overload
    def achat(self, model: str, messages: Sequence[Message | Mapping[str, Any]], *, stream: Literal[True],
              timeout: float | None = None, wait: float | None = None, autoload: bool | None = None,
              extra_body: Mapping[str, Any] | None = None, **options: Any) -> AsyncEvents[ChatCompletionChunk]: ...

    @overload
    def achat(self, model: str, messages: Sequence[Message | Mapping[str, Any]], *, stream: bool,
              timeout: float | None = None, wait: float | None = None, autoload: bool | None = None,
              extra_body: Mapping[str, Any] | None = None,
              **options: Any) -> Awaitable[ChatCompletion] | AsyncEvents[ChatCompletionChunk]: ...

    def achat(self, model, messages, *, stream=False, timeout=None, wait=None, autoload=None, extra_body=None,
              **options):
        """``chat`` in the running event loop: awaited for a reply, or with ``stream=True``
        its events (``AsyncEvents``: ``async for`` it, inside ``async with``)."""
        fixed = {"messages": _checked_messages("achat", messages)}
        return self._aopenai("achat", _post(model, "/v1/chat/completions", timeout, wait, autoload),
                             fixed, options, extra_body, stream)

    # -- completions ------------------------------------------------------------------------------

    @overload
    def complete(self, model: str, prompt: str | list[int], *, stream: Literal[False] = False,
                 timeout: float | None = None, wait: float | None = None, autoload: bool | None = None,
                 extra_body: Mapping[str, Any] | None = None, **options: Any) -> Completion: ...

    @overload
    def complete(self, model: str, prompt: str | list[int], *, stream: Literal[True], timeout: float | None = None,
                 wait: float | None = None, autoload: bool | None = None,
                 extra_body: Mapping[str, Any] | None = None, **options: Any) -> Events[Completion]: ...

    @overload
    def complete(self, model: str, prompt: str | list[int], *, stream: bool, timeout: float | None = None,
                 wait: float | None = None, autoload: bool | None = None,
                 extra_body: Mapping[str, Any] | None = None, **options: Any) -> Completion | Events[Completion]: ...

    def complete(self, model, prompt, *, stream=False, timeout=None, wait=None, autoload=None, extra_body=None,
                 **options):
        """An OpenAI completion of ``prompt`` (text or token ids, ``POST /v1/completions``):
        its JSON, or with ``stream=True`` its events (``Events``).  Options, ``timeout`` and
        ``wait`` as for ``chat``."""
        return self._openai("complete", _post(model, "/v1/completions", timeout, wait, autoload),
                            {"prompt": prompt}, options, extra_body, stream)

    @overload
    def acomplete(self, model: str, prompt: str | list[int], *, stream: Literal[False] = False,
                  timeout: float | None = None, wait: float | None = None, autoload: bool | None = None,
                  extra_body: Mapping[str, Any] | None = None, **options: Any) -> Awaitable[Completion]: ...

    @overload
    def acomplete(self, model: str, prompt: str | list[int], *, stream: Literal[True],
                  timeout: float | None = None, wait: float | None = None, autoload: bool | None = None,
                  extra_body: Mapping[str, Any] | None = None, **options: Any) -> AsyncEvents[Completion]: ...

    @overload
    def acomplete(self, model: str, prompt: str | list[int], *, stream: bool,
                  timeout: float | None = None, wait: float | None = None, autoload: bool | None = None,
                  extra_body: Mapping[str, Any] | None = None,
                  **options: Any) -> Awaitable[Completion] | AsyncEvents[Completion]: ...

    def acomplete(self, model, prompt, *, stream=False, timeout=None, wait=None, autoload=None,
                  extra_body=None, **options):
        """``complete`` in the running event loop (``AsyncEvents`` with ``stream=True``)."""
        return self._aopenai("acomplete", _post(model, "/v1/completions", timeout, wait, autoload),
                             {"prompt": prompt}, options, extra_body, stream)

    # -- embeddings ---------------------------------------------------------------------------------

    def embed(self, model: str, input: str | list[str], *, timeout: float | None = None, wait: float | None = None,
              autoload: bool | None = None, extra_body: Mapping[str, Any] | None = None, **options: Any) -> Embeddings:
        """OpenAI embeddings of ``input`` (``POST /v1/embeddings``).  The model must be served
        as an embedding model with a pooling, as llama-server's OpenAI endpoint requires
        (``ModelSpec(path, ("--embedding", "--pooling", "mean"))``, or a model whose file
        says its pooling)."""
        return self._openai("embed", _post(model, "/v1/embeddings", timeout, wait, autoload),
                            {"input": input}, options, extra_body, False)

    def aembed(self, model: str, input: str | list[str], *, timeout: float | None = None,
               wait: float | None = None, autoload: bool | None = None,
               extra_body: Mapping[str, Any] | None = None, **options: Any) -> Awaitable[Embeddings]:
        """``embed`` awaited in the running event loop."""
        return self._aopenai("aembed", _post(model, "/v1/embeddings", timeout, wait, autoload),
                             {"input": input}, options, extra_body, False)

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

    def _asked(self, where: str, ask: Ask, fixed: dict[str, Any], options: Mapping[str, Any],
               extra: Mapping[str, Any] | None, stream: Any) -> Ask:
        """``ask`` with its body (llama-server's keys, checked; ``extra``, unchecked) and its
        timeout and wait in seconds: its mistakes raised here, before anything is sent."""
        check(where, options)
        stream = _checked_stream(where, stream)
        timeout, wait = checked_seconds("timeout", ask.timeout), checked_seconds("wait", ask.wait, zero=True)
        body = {**options, **fixed, "model": ask.model, **({"stream": True} if stream else {}), **(extra or {})}
        return dataclasses.replace(ask, body=body, timeout=timeout, wait=wait)

    def _openai(self, where: str, ask: Ask, fixed: dict[str, Any], options: Mapping[str, Any],
                extra: Mapping[str, Any] | None, stream: Any):
        ask = self._asked(where, ask, fixed, options, extra, stream)
        reply, chunks = self._exchange_of(ask).run()
        return Events(ask.model, chunks) if chunks is not None else json.loads(reply.body)

    def _aopenai(self, where: str, ask: Ask, fixed: dict[str, Any], options: Mapping[str, Any],
                 extra: Mapping[str, Any] | None, stream: Any):
        ask = self._asked(where, ask, fixed, options, extra, stream)
        opening = functools.partial(self.arelay, ask)
        if stream:
            deadline = None if ask.timeout is None else time.monotonic() + ask.timeout
            return AsyncEvents(ask.model, opening, deadline, ask.timeout)
        return self._awhole(opening)

    async def _awhole(self, opening: Callable[[], Awaitable["tuple[HttpReply, Stream | None]"]]) -> Any:
        reply, _ = await opening()
        return json.loads(reply.body)
