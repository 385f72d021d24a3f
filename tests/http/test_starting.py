"""serve's port from its first moment (server/starting.py): /health answered while the app
is built, every other request held unread and answered by the app once it is up."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

from pyllmrouter.server.run import listen
from pyllmrouter.server.starting import Starting
from pyllmrouter.tools.loopback import free_port

REQUEST = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
           b"Content-Length: 13\r\n\r\n{\"model\":\"a\"}")


def _answer(conn: socket.socket) -> bytes:
    out = b""
    while chunk := conn.recv(65536):
        out += chunk
    return out


def test_health_is_answered_and_every_other_request_is_held_unread():
    port = free_port()
    sockets = listen("127.0.0.1", port)
    starting = Starting(sockets).start()
    try:
        answers = []
        for target in (b"/health", b"/v1/health?x=1"):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
                c.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                answers.append(_answer(c))  # read to the end: the connection is closed after it
        posted = socket.create_connection(("127.0.0.1", port), timeout=10)
        posted.sendall(REQUEST)
        silent = socket.create_connection(("127.0.0.1", port), timeout=10)  # nothing sent yet
        held = starting.stop()
        # what the app's server finds: the connections held, and any still in the listen queue
        sockets[0].settimeout(0.5)
        pending = list(held)
        while len(pending) < 2:
            pending.append(sockets[0].accept()[0])
        silent.sendall(b"GET /health HTTP/1.1\r\n\r\n")  # sent after the hand-over: the app's to read
        got = sorted(c.recv(65536) for c in pending)
        for c in (*pending, posted, silent, *sockets):
            c.close()
    except BaseException:
        starting.stop()
        raise
    for a in answers:
        head, body = a.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200 ") and b"Connection: close" in head and json.loads(body) == {"status": "ok"}
    assert got == sorted([REQUEST, b"GET /health HTTP/1.1\r\n\r\n"])  # every byte still there, none read


def test_a_request_sent_as_serve_starts_is_answered_by_the_app(tiny, tmp_path):
    """A completion sent the moment the port takes connections, and a /health after it: the
    health answered 200, the completion (held while the app was built) answered by the
    model, as any later one."""
    preset = tmp_path / "models.ini"
    preset.write_text(f"[a]\nmodel = {tiny['tiny-llama']}\nctx-size = 512\n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pyllmrouter.cli", "serve", "--models-preset", str(preset),
                             "--emulate-devices", "GPU0=1GiB", "--models-memory-margin", "0", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                posted = socket.create_connection(("127.0.0.1", port), timeout=60)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "serve never listened"
                time.sleep(0.002)
        body = json.dumps({"model": "a", "prompt": "hi", "max_tokens": 2}).encode()
        posted.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        with socket.create_connection(("127.0.0.1", port), timeout=60) as h:
            h.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            health = _answer(h)
        completion = _answer(posted)
        posted.close()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert health.startswith(b"HTTP/1.1 200 "), health
    head, text = completion.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200 "), completion
    assert json.loads(text)["usage"]["completion_tokens"] == 2
    assert proc.returncode == 0, err.decode()[-2000:]
