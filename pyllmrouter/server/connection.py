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

A request handed over is one uvicorn never writes a byte of: the worker writes the
whole response to the socket (router/conduit.py, csrc/conduit.h), and ``finish`` ends
uvicorn's request cycle as its own ``send`` would after the last body chunk (the
pipelined requests it holds start, or the keep-alive timer runs).  Header names are
written as the app or the worker spells them; HTTP compares them without regard to case.
"""

from __future__ import annotations

import socket
import struct

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["HttpProtocol", "Handover", "HANDOVER"]

HANDOVER = "pyllmrouter.handover"  # the ASGI scope extension's name


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

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.socket = transport.get_extra_info("socket")

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.scope is self.scope and self.scope.get("method") == "POST":
            self.scope.setdefault("extensions", {})[HANDOVER] = Handover(self, self.cycle)
