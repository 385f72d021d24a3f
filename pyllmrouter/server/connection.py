"""The HTTP protocol the server runs: uvicorn's httptools protocol (llhttp, in C: the fastest
uvicorn has), whose connections a request can hand over to a worker.

    HttpProtocol ──scope["extensions"][HANDOVER]──▶ Handover(fd, keep_alive)
        begin()    the router stops reading the connection and will write nothing on it
                   (uvicorn marks the response started: its error paths close, never write)
        undo()     not handed over after all: the app answers as usual
        untouched() nothing written since begin (TCP's own counters): a worker that died
                   before writing leaves a connection the app may still answer (a 503)
        finish(k)  the worker has answered on it: the request is complete, and the
                   connection reads the client's next request (keep-alive) or closes
        logged(s)  the access log's line for an answer the worker wrote (--access-log)
        follow(...) what the worker may read itself on it meanwhile: the next requests
                   like this one (the same request line and headers, the same model)

A request handed over is one uvicorn never writes a byte of: the worker writes the
whole response to the socket (router/conduit.py, csrc/conduit.h), and ``finish`` ends
uvicorn's request cycle as its own ``send`` would after the last body chunk (the
pipelined requests it holds start, or the keep-alive timer runs).  Header names are
written as the app or the worker spells them; HTTP compares them without regard to case.

The hot path takes no task: a POST whose body is small enough to come whole (a
Content-Length up to uvicorn's read-ahead limit, no 100-continue) waits for it before its
ASGI task is made, and is then offered to the app's ``take_whole(scope, body, handover,
answer)``.  True: the app has handed it over in that call (no coroutine, no task: the
worker answers, and ``finish`` completes the cycle); False: the task runs as it would
have, the body there already.  ``answer(app)`` runs an ASGI app on the request later (a
task): the app's way to answer it after all (a worker that died before it wrote).
"""

from __future__ import annotations

import socket
import struct

from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

__all__ = ["HttpProtocol", "Handover", "HANDOVER"]

HANDOVER = "pyllmrouter.handover"  # the ASGI scope extension's name
FOLLOW_IDLE_MS = 20  # a worker reading a connection's next request waits this long for it


class Handover:
    def __init__(self, protocol: "HttpProtocol", cycle):
        self._protocol, self._cycle = protocol, cycle
        self._sock = sock = protocol.socket
        self._sent: tuple[int, int] | None = None
        self.fd: int = sock.fileno() if sock is not None else -1

    @property
    def keep_alive(self) -> bool:
        return bool(self._cycle.keep_alive)

    @property
    def usable(self) -> bool:
        """A plain TCP connection this request may hand over: open, not TLS, and not one
        that holds a pipelined request after this one."""
        p = self._protocol
        return (self.fd >= 0 and not p.transport.is_closing() and p.scheme == "http" and not p.pipeline
                and p.cycle is self._cycle)

    def begin(self) -> None:
        self._sent = _sent_mark(self._sock)  # before the worker can write a byte
        self._cycle.response_started = True
        self._protocol.flow.pause_reading()

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
        its answers listed every ``ms``; None where it may not (not HTTP/1.1 kept alive,
        ``ms`` 0).  ``headers``: those (by lower-case name) the hand-over's copy for the
        engine leaves out; the worker compares the next request's with the two together."""
        scope = self._cycle.scope
        if ms <= 0 or not self.keep_alive or scope.get("http_version") != "1.1":
            return None
        target = scope.get("raw_path", b"") + (b"?" + scope["query_string"] if scope.get("query_string") else b"")
        return {"line": f"{scope['method']} {target.decode('latin-1')} HTTP/1.1", "named": named, "ms": ms,
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
    _held = None  # (cycle, app): a request whose task waits until its body has come whole

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.socket = transport.get_extra_info("socket")

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.scope is self.scope and self.scope.get("method") == "POST":
            self.scope.setdefault("extensions", {})[HANDOVER] = Handover(self, self.cycle)

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
        if held is None:
            return
        cycle, app = held
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


def _whole_soon(cycle, expect_100_continue: bool) -> bool:
    """A POST whose body comes whole without the app reading it: a Content-Length that
    uvicorn reads ahead (no pause for the app), and no 100-continue for the app to send."""
    if expect_100_continue or cycle.scope.get("method") != "POST":
        return False
    length = next((v for k, v in cycle.scope["headers"] if k == b"content-length"), None)
    chunked = any(k == b"transfer-encoding" for k, _ in cycle.scope["headers"])
    return length is not None and not chunked and length.isdigit() and int(length) <= HIGH_WATER_LIMIT
