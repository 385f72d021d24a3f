"""The HTTP protocol the server runs: uvicorn's httptools protocol (llhttp, in C: the fastest
uvicorn has), whose connections a request can hand over to a worker.

    HttpProtocol ──scope["extensions"][HANDOVER]──▶ Handover(fd, keep_alive)
        begin()    the router stops reading the connection and will write nothing on it
                   (uvicorn marks the response started: its error paths close, never write)
        undo()     not handed over after all: the app answers as usual
        finish(k)  the worker has answered on it: the request is complete, and the
                   connection reads the client's next request (keep-alive) or closes

A request handed over is one uvicorn never writes a byte of: the worker writes the
whole response to the socket (router/conduit.py, csrc/conduit.h), and ``finish`` ends
uvicorn's request cycle as its own ``send`` would after the last body chunk (the
pipelined requests it holds start, or the keep-alive timer runs).  Header names are
written as the app or the worker spells them; HTTP compares them without regard to case.
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["HttpProtocol", "Handover", "HANDOVER"]

HANDOVER = "pyllmrouter.handover"  # the ASGI scope extension's name


class Handover:
    def __init__(self, protocol: HttpToolsProtocol, cycle):
        self._protocol, self._cycle = protocol, cycle
        sock = protocol.transport.get_extra_info("socket")
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
        self._cycle.response_started = True
        self._protocol.flow.pause_reading()

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


class HttpProtocol(HttpToolsProtocol):
    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.scope is self.scope and self.scope.get("method") == "POST":
            self.scope.setdefault("extensions", {})[HANDOVER] = Handover(self, self.cycle)
