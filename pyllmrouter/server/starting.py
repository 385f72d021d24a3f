"""The port, answered from serve's first moment: while the router and the app are built
(llama.cpp asked for its settings, the models read, the server's modules imported), a
thread accepts on the listening sockets.

    client ──GET /health──▶ Starting: 200 {"status": "ok"} at once (llama-server's router
                            answers it as soon as it listens), the connection closed
    client ──anything else──▶ Starting: accepted, not read (its bytes only peeked at), held
    Starting.stop() ──held connections──▶ the app's server takes them as its own
                                          (server/run.py), and answers them there

So a client that polls /health sees the server up within tens of milliseconds, and a
request sent meanwhile is answered by the app as if it had come a moment later: nothing
is refused, nothing is answered twice, no byte of a held request is consumed here.
"""

from __future__ import annotations

import json
import selectors
import socket
import threading

from pyllmrouter.endpoints import HEALTH

__all__ = ["Starting", "HEALTHY"]

HEALTHY = {"status": "ok"}  # /health's answer, here and in the app
MAX_HEAD = 16 << 10  # bytes of a connection's first read looked at
_OK = json.dumps(HEALTHY).encode()
_ANSWER = (b"HTTP/1.1 200 OK\r\nServer: llama.cpp\r\nContent-Type: application/json\r\n"
           b"Content-Length: " + str(len(_OK)).encode() + b"\r\nConnection: close\r\n\r\n" + _OK)


def is_health(head: bytes) -> bool:
    """Whether a request head (its bytes up to the blank line) is a GET of /health."""
    line = head.split(b"\r\n", 1)[0].split(b" ")
    if len(line) != 3 or line[0] != b"GET":
        return False
    return line[1].split(b"?", 1)[0].decode("latin-1") in HEALTH


class Starting:
    """Answers /health on ``sockets`` (listening) until ``stop()``, which gives back every
    other connection accepted meanwhile, unread."""

    def __init__(self, sockets: list[socket.socket]):
        self._sockets = sockets
        self._wake_r, self._wake_w = socket.socketpair()
        self._held: list[socket.socket] = []  # the thread's until it has ended, then stop()'s
        self._thread = threading.Thread(target=self._run, name="starting", daemon=True)

    def start(self) -> "Starting":
        self._thread.start()
        return self

    def stop(self) -> list[socket.socket]:
        """The thread ended; the connections it accepted and did not answer, to be served
        by the app."""
        if self._thread.is_alive():
            self._wake_w.send(b"x")
            self._thread.join()
        self._wake_r.close()
        self._wake_w.close()
        return self._held

    def _run(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._wake_r, selectors.EVENT_READ)
            for s in self._sockets:
                sel.register(s, selectors.EVENT_READ)
            reading: list[socket.socket] = []  # accepted, nothing read from them yet
            while True:
                for key, _ in sel.select():
                    sock = key.fileobj
                    if sock is self._wake_r:
                        self._held.extend(reading)  # nothing sent yet: the app waits for it
                        return
                    if sock in self._sockets:
                        self._accept(sock, sel, reading)
                    else:  # its first bytes: answered or held, no longer read here
                        sel.unregister(sock)
                        reading.remove(sock)
                        self._look(sock)

    @staticmethod
    def _accept(listener: socket.socket, sel: selectors.BaseSelector, reading: list[socket.socket]) -> None:
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        reading.append(conn)
        sel.register(conn, selectors.EVENT_READ)

    def _look(self, conn: socket.socket) -> None:
        """The connection's first bytes peeked at: a whole head of GET /health answered and
        the connection closed; anything else (a head not whole yet included) held."""
        try:
            seen = conn.recv(MAX_HEAD, socket.MSG_PEEK)
        except OSError:
            conn.close()
            return
        if not seen:  # the client left before it asked anything
            conn.close()
            return
        end = seen.find(b"\r\n\r\n")
        if end >= 0 and is_health(seen[:end]):
            conn.recv(end + 4)  # the head, and nothing of what may follow it
            try:
                conn.sendall(_ANSWER)
            except OSError:
                pass  # the client has gone: nobody to answer
            conn.close()
            return
        self._held.append(conn)
