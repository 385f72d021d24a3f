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
import json
import math
import numbers
import threading
import time
from typing import (Any, Awaitable, Callable, Generator, Generic, Iterator, Literal, Mapping,
                    Sequence, TypeVar, overload)

from pyllmrouter.errors import RequestFailed, RequestTimeout
from pyllmrouter.protocol import HttpReply
from pyllmrouter.replies import ChatCompletion, ChatCompletionChunk, Completion, Embeddings, Message
from pyllmrouter.router.options import check
from pyllmrouter.router.services.streams import Stream

__all__ = ["Methods", "Events", "AsyncEvents", "body_of", "checked_seconds", "ok_or_raise", "remaining"]

E = TypeVar("E")

_POOLING_HINT = ("; an embedding model served for /v1/embeddings needs a pooling: start it with "
                 "ModelSpec(path, ('--embedding', '--pooling', 'mean')) (or cls, last, rank)")


def body_of(body: bytes | Mapping[str, Any]) -> bytes:
    """A request body: bytes as they are, a dict as JSON."""
    return body if isinstance(body, (bytes, bytearray)) else json.dumps(dict(body)).encode()


def remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def checked_seconds(name: str, value: Any, zero: bool = False) -> float | None:
    """``value`` as seconds (None, or more than a thread can wait: no bound): a TypeError for
    what is not a real number (numpy's included), a ValueError for a negative one, NaN, or 0
    where ``zero`` is not allowed."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy's bool is no Real
        raise TypeError(f"{name} must be a number of seconds (an int or a float) or None, "
                        f"not {type(value).__name__} {value!r}")
    try:
        seconds = float(value)
    except OverflowError:
        seconds = math.inf
    if math.isnan(seconds) or seconds < 0 or (seconds == 0 and not zero):
        raise ValueError(f"{name} must be {'0 or more' if zero else 'more than 0'} seconds, not {value!r}")
    return None if seconds > threading.TIMEOUT_MAX else seconds


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
    """The request methods of ``pyllmrouter.Router``: chat, completions, embeddings,
    tokenize and detokenize, each plain or awaited, whole or streamed (``Router`` gives the
    two they rest on, ``call`` and ``acall``)."""

    def call(self, model: str, method: str, path: str, body: bytes | Mapping[str, Any] = b"",
             query: dict[str, str] | None = None, timeout: float | None = None, autoload: bool | None = None,
             headers: dict[str, str] | None = None, *, wait: float | None = None,
             raise_for_status: bool = True) -> "tuple[HttpReply, Stream | None]":
        """Any llama-server request for one model (``Router.call``)."""
        raise NotImplementedError

    async def acall(self, model: str, method: str, path: str, body: bytes | Mapping[str, Any] = b"",
                    query: dict[str, str] | None = None, timeout: float | None = None,
                    autoload: bool | None = None, headers: dict[str, str] | None = None, *,
                    wait: float | None = None, raise_for_status: bool = True) -> "tuple[HttpReply, Stream | None]":
        """``call`` awaited (``Router.acall``)."""
        raise NotImplementedError

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
        return self._openai("chat", model, "/v1/chat/completions", fixed, options, extra_body, stream, timeout,
                            wait, autoload)

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
        return self._aopenai("achat", model, "/v1/chat/completions", fixed, options, extra_body, stream, timeout,
                             wait, autoload)

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
        return self._openai("complete", model, "/v1/completions", {"prompt": prompt}, options, extra_body, stream,
                            timeout, wait, autoload)

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
        return self._aopenai("acomplete", model, "/v1/completions", {"prompt": prompt}, options, extra_body,
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

    def aembed(self, model: str, input: str | list[str], *, timeout: float | None = None,
               wait: float | None = None, autoload: bool | None = None,
               extra_body: Mapping[str, Any] | None = None, **options: Any) -> Awaitable[Embeddings]:
        """``embed`` awaited in the running event loop."""
        return self._aopenai("aembed", model, "/v1/embeddings", {"input": input}, options, extra_body, False,
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

    def _body(self, where: str, model: str, fixed: dict[str, Any], options: Mapping[str, Any],
              extra: Mapping[str, Any] | None, stream: Any,
              timeout: Any, wait: Any) -> tuple[dict[str, Any], float | None, float | None]:
        """The request's body and its timeout and wait in seconds, its mistakes raised here,
        before anything is sent."""
        check(where, options)
        stream = _checked_stream(where, stream)
        timeout, wait = checked_seconds("timeout", timeout), checked_seconds("wait", wait, zero=True)
        body = {**options, **fixed, "model": model, **({"stream": True} if stream else {}), **(extra or {})}
        return body, timeout, wait

    def _openai(self, where: str, model: str, path: str, fixed: dict[str, Any], options: Mapping[str, Any],
                extra: Mapping[str, Any] | None, stream: bool, timeout: float | None, wait: float | None,
                autoload: bool | None):
        body, timeout, wait = self._body(where, model, fixed, options, extra, stream, timeout, wait)
        reply, chunks = self.call(model, "POST", path, body, timeout=timeout, wait=wait, autoload=autoload)
        return Events(model, chunks) if chunks is not None else json.loads(reply.body)

    def _aopenai(self, where: str, model: str, path: str, fixed: dict[str, Any],
                 options: Mapping[str, Any], extra: Mapping[str, Any] | None, stream: bool,
                 timeout: float | None, wait: float | None, autoload: bool | None):
        body, timeout, wait = self._body(where, model, fixed, options, extra, stream, timeout, wait)
        opening = lambda: self.acall(model, "POST", path, body, timeout=timeout, wait=wait,  # noqa: E731
                                     autoload=autoload)
        if stream:
            deadline = None if timeout is None else time.monotonic() + timeout
            return AsyncEvents(model, opening, deadline, timeout)
        return self._awhole(opening)

    async def _awhole(self, opening: Callable[[], Awaitable["tuple[HttpReply, Stream | None]"]]) -> Any:
        reply, _ = await opening()
        return json.loads(reply.body)
