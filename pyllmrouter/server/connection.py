"""The HTTP protocol the server runs: uvicorn's httptools protocol (llhttp, in C: the fastest
uvicorn has), whose connections a request can hand over to a worker.

    HttpProtocol ──scope["extensions"][HANDOVER]──▶ Handover(keep_alive)
        begin()    the connection's descriptor, proven this request's own at that moment (its
                   transport open), and the router stops reading it and will write nothing on
                   it (uvicorn marks the response started: its error paths close, never
                   write); None where the client has gone (its number may be another's now)
        undo()     not handed over after all: the app answers as usual
        (usable: a plain TCP connection the router owes no byte: nothing of an earlier answer
                   still in the event loop's buffer)
        untouched() nothing written since begin (TCP's own counters): a worker that died
                   before writing leaves a connection the app may still answer (a 503)
        finish(k)  the worker has answered on it: the request is complete, and the
                   connection reads the client's next request (keep-alive) or closes
        logged(s)  the access log's line for an answer the worker wrote (--access-log)
        follow(...) what the worker may read itself on it meanwhile: the next requests
                   like this one (the same request line and headers, the same model); none
                   where the router's parser has read a byte past this request

A request handed over is one uvicorn never writes a byte of: the worker writes the
whole response to the socket (router/workers/conduit.py, csrc/conduit.h), and ``finish`` ends
uvicorn's request cycle as its own ``send`` would after the last body chunk (the
pipelined requests it holds start, or the keep-alive timer runs).  Header names are
written as the app or the worker spells them; HTTP compares them without regard to case.

The hot path takes no task: a POST whose body is small enough to come whole (a
Content-Length up to uvicorn's read-ahead limit, no 100-continue) waits for it before its
ASGI task is made, and is then offered to the app's ``take_whole(scope, body, handover,
answer)`` once the parser has read all that came with it (after ``feed_data``, never inside
llhttp's ``on_message_complete``): a request pipelined behind it in the same segment is then
known (its first byte began a message), and no worker reads a byte the router has read.  True: the app has handed it over in that call (no coroutine, no task: the
worker answers, and ``finish`` completes the cycle); False: the task runs as it would
have, the body there already.  ``answer(app)`` runs an ASGI app on the request later (a
task): the app's way to answer it after all (a worker that died before it wrote).
"""

from __future__ import annotations

import functools
import socket
import struct

from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

__all__ = ["HttpProtocol", "Handover", "HANDOVER", "CUT"]

HANDOVER = "pyllmrouter.handover"  # the ASGI scope extension's name
CUT = "pyllmrouter.cut"  # another: cut() ends a response unfinished (what was sent goes, then the close)
FOLLOW_IDLE_MS = 20  # a worker reading a connection's next request waits this long for it


class Handover:
    def __init__(self, protocol: "HttpProtocol", cycle):
        self._protocol, self._cycle = protocol, cycle
        self._sock = protocol.socket
        self._sent: tuple[int, int] | None = None
        self._begun = protocol.messages_begun  # this request's own message: a later one begins past it

    @property
    def keep_alive(self) -> bool:
        return bool(self._cycle.keep_alive)

    @property
    def usable(self) -> bool:
        """A plain TCP connection this request may hand over: open, not TLS, not one that
        holds a pipelined request after this one, and one the router owes no byte: every
        byte of the answers before this one has left the event loop's buffer for the
        socket (what the worker writes goes after what the socket holds, never before what
        the loop still holds).  The router writes nothing on it once this request's cycle
        has begun, so a connection usable now is usable at ``begin``."""
        p = self._protocol
        return (self._sock is not None and not p.transport.is_closing() and p.scheme == "http"
                and not p.pipeline and p.cycle is self._cycle and p.transport.get_write_buffer_size() == 0)

    @property
    def alone(self) -> bool:
        """The router's parser has read no byte past this request (none of a next one)."""
        return self._protocol.messages_begun == self._begun

    def begin(self) -> int | None:
        """The connection's descriptor for the worker, the router off it; None where the
        client has gone.  A descriptor is a number the kernel gives the next connection
        once it is closed: it is this request's own only while its transport is open (the
        transport closes before its socket does, both in this loop), so it is read here,
        at the hand-over, not when the request came (a model's load may come between)."""
        p = self._protocol
        if p.transport.is_closing() or self._cycle.disconnected or self._sock is None:
            return None
        fd = self._sock.fileno()
        if fd < 0:
            return None
        self._sent = _sent_mark(self._sock)  # before the worker can write a byte
        self._cycle.response_started = True
        p.flow.pause_reading()
        return fd

    def untouched(self) -> bool:
        """Nothing was written on the connection since ``begin`` (TCP's count of data
        segments sent is the same, and nothing waits in its send queue): a worker that died
        before it wrote leaves a connection the router may still answer (False where the
        kernel cannot say: not TCP, or too old)."""
        now = _sent_mark(self._sock)
        return self._sent is not None and now is not None and now[0] == self._sent[0] and now[1] == 0

    def undo(self) -> None:
        self._cycle.response_started = False
        self._protocol.flow.resume_reading()

    def follow(self, headers: dict[str, str], named: str, max_body: int, ms: int) -> dict | None:
        """What the worker may read itself on this connection after this request (csrc/conduit.h,
        ``Conduit::Follow``): requests with this one's request line and headers, Content-Length
        aside, whose body names ``named``, each within ``FOLLOW_IDLE_MS`` of the last answer,
        its answers listed every ``ms``; None where it may not: not HTTP/1.1 kept alive,
        ``ms`` 0, bytes past this request read by the router already (a pipelined request:
        the worker would answer what comes after it first), or a request line or header
        value that is not ASCII (the worker compares the next request's raw bytes; the router
        read these as latin-1, and they reach the worker as UTF-8).  ``headers``: those (by
        lower-case name) the hand-over's copy for the engine leaves out; the worker compares
        the next request's with the two together."""
        scope = self._cycle.scope
        if ms <= 0 or not self.keep_alive or scope.get("http_version") != "1.1" or not self.alone:
            return None
        target = scope.get("raw_path", b"") + (b"?" + scope["query_string"] if scope.get("query_string") else b"")
        if not target.isascii() or not all(v.isascii() for _, v in scope["headers"]):
            return None
        return {"line": f"{scope['method']} {target.decode('ascii')} HTTP/1.1", "named": named, "ms": ms,
                "headers": {k: v for k, v in headers.items() if k != "content-length"},
                "max_body": min(max_body, HIGH_WATER_LIMIT), "idle_ms": FOLLOW_IDLE_MS}

    def logged(self, status: int, written: int) -> None:
        """The access log's line for an answer the worker wrote, as uvicorn writes its own
        (where ``--access-log`` is on; none where it wrote nothing, as uvicorn logs a response
        as it starts): the worker's answers never pass uvicorn's ``send``."""
        p = self._protocol
        if p.access_log and written > 0:
            scope = self._cycle.scope
            p.access_logger.info('%s - "%s %s HTTP/%s" %d', get_client_addr(scope), scope["method"],
                                 get_path_with_query_string(scope), scope["http_version"], status)

    def finish(self, keep: bool) -> None:
        cycle = self._cycle
        cycle.response_complete = True
        cycle.message_event.set()
        if not (keep and cycle.keep_alive):
            cycle.transport.close()
        cycle.on_response()  # uvicorn's: the pipeline, the keep-alive timer, reading again


_TCP_INFO_LEN = 160  # struct tcp_info up to tcpi_data_segs_out (Linux 4.6)


def _sent_mark(sock) -> tuple[int, int] | None:
    """(data segments sent, bytes not yet sent) of a TCP socket (linux/tcp.h, struct
    tcp_info: tcpi_notsent_bytes at 144, tcpi_data_segs_out at 156); None where unknown."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    except (OSError, AttributeError):
        return None
    if len(info) < _TCP_INFO_LEN:
        return None
    return struct.unpack_from("=I", info, 156)[0], struct.unpack_from("=I", info, 144)[0]


class HttpProtocol(HttpToolsProtocol):
    socket = None  # the connection's socket, once made (asked of the transport once, not per request)
    messages_begun = 0  # requests whose first byte the parser has read, on this connection
    _held = None  # (cycle, app): a request whose task waits until its body has come whole
    _whole = None  # (cycle, app): that request, its body come, to offer once the parser has read all there is
    _refusal = None  # the 400 for bytes the parser could not read, once the answers before them are out

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.socket = transport.get_extra_info("socket")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        whole, self._whole = self._whole, None
        if whole is not None:  # the parser has read every byte that came: offered now
            self._offer(*whole)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.messages_begun += 1

    def send_400_response(self, msg: str) -> None:
        """Bytes the parser cannot read: uvicorn writes its 400 and closes at once, before
        (or in the middle of) the answers still due to the requests read whole before them.
        Here the 400 waits for those answers, in order; a request cut off by the bad bytes
        (its body still coming) gets none of its own."""
        cycle = self.cycle
        if cycle is not None and self.pipeline and self.pipeline[0][0] is cycle and cycle.more_body:
            self.pipeline.popleft()  # the pipelined request the bad bytes are part of: its 400 stands for it
        waiting = self.pipeline or (cycle is not None and not cycle.response_complete and not cycle.more_body
                                    and not self.transport.is_closing())
        if not waiting:
            super().send_400_response(msg)
            return
        self._refusal = msg
        self.flow.pause_reading()  # nothing after the bad bytes is read

    def on_response_complete(self) -> None:
        super().on_response_complete()  # the next pipelined request starts, or the keep-alive timer
        if self._refusal is not None and not self.pipeline and self.cycle.response_complete \
                and not self.transport.is_closing():
            msg, self._refusal = self._refusal, None
            super().send_400_response(msg)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.scope is self.scope:
            extensions = self.scope.setdefault("extensions", {})
            extensions[CUT] = functools.partial(_cut, self.cycle)
            if self.scope.get("method") == "POST":
                extensions[HANDOVER] = Handover(self, self.cycle)

    def _start_asgi_task(self, cycle, app) -> None:
        # a body still to come (more_body: its message is not complete) is waited for
        if cycle.more_body and self._held is None and _whole_soon(cycle, self.expect_100_continue) \
                and getattr(app, "take_whole", None) is not None:
            self._held = (cycle, app)  # offered whole first (on_message_complete)
            return
        super()._start_asgi_task(cycle, app)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        held, self._held = self._held, None
        if held is not None:  # offered once feed_data returns, with what came after it known
            self._whole = held

    def _offer(self, cycle, app) -> None:
        if self.transport.is_closing():  # the parser refused what followed (a 400), or the client left
            self._start_task(cycle, app)
            return
        handover = cycle.scope.get("extensions", {}).get(HANDOVER)
        try:
            taken = handover is not None and app.take_whole(cycle.scope, cycle.body, handover,
                                                            lambda answer: self._start_task(cycle, answer))
        except Exception:  # a fault of the hot path: nothing was handed over, the task answers
            self.logger.exception("the request could not be handed over")
            taken = False
        if not taken:
            self._start_task(cycle, app)

    def _start_task(self, cycle, app) -> None:
        super()._start_asgi_task(cycle, app)


def _cut(cycle) -> None:
    """A response ended unfinished: what was sent goes, then the connection closes (no
    end of the body: a client sees the answer incomplete).  Its cycle is over (uvicorn
    neither logs a response left unfinished nor starts the next pipelined request)."""
    cycle.response_complete = True
    cycle.keep_alive = False
    cycle.transport.close()


def _whole_soon(cycle, expect_100_continue: bool) -> bool:
    """A POST whose body comes whole without the app reading it: a Content-Length that
    uvicorn reads ahead (no pause for the app), and no 100-continue for the app to send."""
    if expect_100_continue or cycle.scope.get("method") != "POST":
        return False
    length = next((v for k, v in cycle.scope["headers"] if k == b"content-length"), None)
    chunked = any(k == b"transfer-encoding" for k, _ in cycle.scope["headers"])
    return length is not None and not chunked and length.isdigit() and int(length) <= HIGH_WATER_LIMIT
