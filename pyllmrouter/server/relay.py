"""A model's reply written by the router itself (the relay: ``--no-native``, TLS, a body too
big to hand over, a multipart form, a GET), as llama-server's HTTP layer writes it.

    Router.arelay(Ask) ──(HttpReply, Stream | None)──▶ relay() ──▶ Response | RelayedStream
        the reply's status, headers and content type unchanged; a stream chunk by chunk as
        the engine yields it, its generation stopped when the client leaves; a stream that
        fails under way left unfinished (the connection closes without its last chunk)

A write that makes no progress for the write timeout (llama-server's ``--timeout``, read
by llama.cpp's parser: ``settings["timeout_write"]``) ends the response as a departed
client's: a client that stops reading holds no lease, so no unload, drain or shutdown waits
on it longer than that (uvicorn closes the connection).
"""

from __future__ import annotations

import asyncio
from typing import Callable

from fastapi.responses import Response, StreamingResponse

from pyllmrouter.errors import RouterError
from pyllmrouter.protocol import HttpReply
from pyllmrouter.router.services.streams import Stream
from pyllmrouter.server.connection import CUT
from pyllmrouter.server.api_errors import from_router_error

__all__ = ["relay", "RelayedStream"]


class _Stalled(Exception):
    """The client took nothing of the response for the write timeout."""


class _Cut(Exception):
    """The stream failed under way (its worker died, its model went): the response may not
    end as a whole one would."""


def _bounded(send, timeout: float | None):
    """``send`` that gives up (``_Stalled``) where the client takes nothing for ``timeout``
    seconds (uvicorn's send waits while the transport's buffer is full)."""
    if not timeout:
        return send

    async def sending(message):
        try:
            await asyncio.wait_for(send(message), timeout)
        except asyncio.TimeoutError:
            raise _Stalled() from None
    return sending


class RelayedStream(StreamingResponse):
    """A streamed reply whose writes are bounded by ``timeout`` (None: unbounded): a client
    that stops reading ends it, its generation stopped and its lease released (the body's
    own end), and uvicorn closes the connection (the response is left incomplete).  A
    stream that fails under way is cut the same way: the connection closes without the
    last chunk, so no client takes it for a whole answer (server/connection.py, CUT)."""

    def __init__(self, chunks, status_code: int, headers: dict[str, str], timeout: float | None):
        super().__init__(chunks, status_code=status_code, headers=headers)
        self.timeout = timeout
        self._cut: Callable[[], None] | None = None

    async def __call__(self, scope, receive, send) -> None:
        self._cut = scope.get("extensions", {}).get(CUT)
        await super().__call__(scope, receive, send)

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(_bounded(send, self.timeout))
        except _Stalled:
            await self.body_iterator.aclose()
        except _Cut:
            if self._cut is None:  # not our HTTP protocol: uvicorn closes a response left unfinished
                raise
            self._cut()


class _Whole(Response):
    """A whole reply, its write bounded as a stream's is."""

    def __init__(self, body: bytes, status_code: int, headers: dict[str, str], timeout: float | None):
        super().__init__(body, status_code=status_code, headers=headers)
        self.timeout = timeout

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, _bounded(send, self.timeout))
        except _Stalled:
            pass


def relay(reply: HttpReply, stream: Stream | None, ended: Callable[[str], None],
          timeout: float | None = None) -> Response:
    """llama.cpp's reply as the HTTP response (its content type as it is: Starlette would
    add a charset to a media_type); a stream chunk by chunk, cancelled if the client
    leaves or takes nothing for ``timeout`` seconds.  ``ended(status)`` once the response
    is done."""
    headers = {**{k: v for k, v in reply.headers.items() if k.lower() != "content-type"},
               "content-type": reply.content_type}
    if stream is None:
        ended(str(reply.status))
        return _Whole(reply.body, reply.status, headers, timeout)

    async def body_chunks():
        code = str(reply.status)
        try:
            while chunks := await stream.anext_batch():
                yield b"".join(chunks)
        except RouterError as e:
            code = str(from_router_error(e).status)
            raise _Cut() from e
        finally:
            stream.abandon()  # a client that left stops generation
            ended(code)

    return RelayedStream(body_chunks(), reply.status, headers, timeout)
