"""A streamed completion as server-sent events, written straight to the ASGI ``send``.

    Stream.anext_batch() ──chunks of one decode step──▶ one body write
    stream ended ──last chunks + usage chunk + [DONE] + end of body──▶ one write
    failed before its first chunk ──▶ an error response with its own status (no stream)
    receive() says http.disconnect ──▶ Stream.cancel() (the worker frees the slot)

Starlette's StreamingResponse would write [DONE] and the end of the chunked
body separately from the last chunks and keep a task group per response; here
the end of a stream goes out with its last chunks.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from starlette.responses import Response

from ..errors import RouterError
from ..router import Stream
from .errors import error_response, from_router_error
from .fanout import MergedStream

__all__ = ["EventStream"]

_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


def _event(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class EventStream(Response):
    """The SSE response of one streamed request; a client that leaves cancels generation.

    With ``include_usage`` (OpenAI's ``stream_options``) a last chunk with no
    choices carries the token counts; the finish chunk carries them too (as
    llama-server's does).
    """

    def __init__(self, stream: Stream | MergedStream, model: str, include_usage: bool,
                 on_end: Callable[[str], None]):
        self.stream, self.model, self.include_usage, self.on_end = stream, model, include_usage, on_end
        self.status_code, self.background = 200, None
        self._last: dict[str, Any] | None = None  # the last chunk sent (names the usage chunk)

    async def __call__(self, scope, receive, send) -> None:
        watch = asyncio.ensure_future(self._watch(receive))
        try:
            try:  # a request the model refuses (e.g. a prompt longer than its context) gets its status
                first = await self.stream.anext_batch()
            except RouterError as e:
                err = from_router_error(e)
                self.on_end(str(err.status))
                await error_response(err)(scope, receive, send)
                return
            await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
            body, more = self._events(first)
            while True:
                await send({"type": "http.response.body", "body": body.encode(), "more_body": more})
                if not more:
                    return
                body, more = await self._next()
        except OSError:
            pass  # the client is gone (servers of ASGI 2.4 raise on send)
        finally:
            watch.cancel()
            self.stream.abandon()  # no-op once finished; stops generation if the client left

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.stream.cancel()

    async def _next(self) -> tuple[str, bool]:
        """The events of the chunks here now, and whether more will follow."""
        try:
            chunks = await self.stream.anext_batch()
        except RouterError as e:
            err = from_router_error(e)
            return _event({"error": {"message": err.message, "type": err.type}}), False
        return self._events(chunks)

    def _events(self, chunks: list[dict[str, Any]]) -> tuple[str, bool]:
        for chunk in chunks:
            chunk["model"] = self.model
        body = "".join(_event(chunk) for chunk in chunks)
        self._last = chunks[-1] if chunks else self._last
        if chunks and not self.stream.done:
            return body, True
        if self.include_usage and self._last is not None:
            last = self._last
            body += _event({"id": last.get("id"), "object": last.get("object"), "created": last.get("created"),
                            "model": self.model, "choices": [], "usage": self.stream.usage})
        self.on_end("200")
        return body + "data: [DONE]\n\n", False
