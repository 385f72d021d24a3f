"""The native data path: a model's response written by its worker on the client's own
connection (router/workers/conduit.py, csrc/conduit.h), against ``pyllmrouter serve``, spoken to
byte by byte where HTTP's framing is what is tested (keep-alive, pipelining)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from pyllmrouter.router.workers.conduit import MAX_MESSAGE
from pyllmrouter.tools import scripted
from pyllmrouter.tools.loopback import start_serve
from test_live import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base(tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("handover")
    story = scripted.write_scripted(d / "story.gguf", scripted.THINK_TEMPLATE, scripted.STORY_SCRIPT, loop=True)
    preset = d / "models.ini"
    preset.write_text(f"[m]\nmodel = {tiny['tiny-llama']}\nc = 1024\nnp = 2\n\n[story]\nmodel = {story}\nc = 4096\n")
    proc, url = start_serve(["--models-preset", str(preset), "--no-models-cache", "--models-memory-margin", "0",
                             "--emulate-devices", "GPU0=4GiB"])
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def request(method: str, path: str, body: dict | bytes | None = None, headers: dict | None = None) -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else b""
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    for k, v in {**({"Content-Type": "application/json"} if data else {}), **(headers or {})}.items():
        head += f"{k}: {v}\r\n"
    return (head + f"Content-Length: {len(data)}\r\n\r\n").encode() + data


class Reader:
    """Responses read off one connection, as an HTTP/1.1 client frames them."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, b""

    def _fill(self) -> None:
        more = self.sock.recv(65536)
        if not more:
            raise EOFError("the server closed the connection")
        self.buf += more

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def response(self) -> tuple[int, dict[str, str], bytes]:
        status = int(self._line().split()[1])
        headers = {}
        while line := self._line():
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while size := int(self._line(), 16):
                body += self._take(size)
                self._take(2)
            self._take(2)
        else:
            body = self._take(int(headers.get("content-length", 0)))
        return status, headers, body


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=60)


def metric(base: str, name: str, model: str | None = None, headers: dict | None = None) -> float:
    """A series of the router's /metrics (a name, with its labels where it has them), or of a
    model's llama-server counters (``model``)."""
    text = httpx.get(base + "/metrics" + (f"?model={model}" if model else ""), headers=headers, timeout=30).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def written(base: str) -> dict[str, float]:
    """The router's count of model responses by who wrote them (/metrics): native, relayed."""
    return {path: metric(base, f'pyllmrouter_responses_total{{path="{path}"}}') for path in ("native", "relayed")}


def test_one_connection_carries_native_and_router_answers_in_turn(base):
    """Keep-alive across the hand-over: a model's answers (written by its worker) and the
    router's own (written by the router) alternate on one connection, framed right."""
    before = written(base)
    with connect(base) as sock:
        r = Reader(sock)
        for i in range(3):
            sock.sendall(request("POST", "/v1/completions",
                                 {"model": "m", "prompt": "hi", "max_tokens": 3, "ignore_eos": True}))
            status, headers, body = r.response()
            assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 3
            sock.sendall(request("GET", "/v1/models"))
            status, _, body = r.response()
            assert status == 200 and json.loads(body)["data"]
            sock.sendall(request("POST", "/v1/completions",
                                 {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True}))
            status, headers, body = r.response()
            assert status == 200 and headers["content-type"].startswith("text/event-stream")
            assert body.rstrip().endswith(b"data: [DONE]")
    after = written(base)  # every model answer went out from its worker, none through the router
    assert after["native"] - before["native"] == 6 and after["relayed"] == before["relayed"]


def test_pipelined_requests_are_answered_in_order(base):
    with connect(base) as sock:
        r = Reader(sock)
        sock.sendall(request("POST", "/tokenize", {"model": "m", "content": "a"}) +
                     request("POST", "/tokenize", {"model": "m", "content": "a b c d"}))
        first, second = r.response(), r.response()
        assert first[0] == second[0] == 200
        assert len(json.loads(first[2])["tokens"]) < len(json.loads(second[2])["tokens"])


def test_bodies_that_come_chunked_or_after_100_continue_are_answered_too(base):
    """A body uvicorn does not read ahead whole (chunked, or sent once the server says 100
    Continue) goes through the app's task; a plain one is offered whole first: all three
    are answered on the same connection, in turn."""
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2, "ignore_eos": True}).encode()
    with connect(base) as sock:
        r = Reader(sock)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n" + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
        status, _, data = r.response()
        assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 2
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Expect: 100-continue\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode())
        assert r._line().startswith(b"HTTP/1.1 100") and r._line() == b""
        sock.sendall(body)
        status, _, data = r.response()
        assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 2
        sock.sendall(request("POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}))
        assert r.response()[0] == 200


def test_a_body_too_big_to_hand_over_is_relayed(base):
    content = "word " * (MAX_MESSAGE // 4)  # over one datagram
    before = written(base)
    r = httpx.post(base + "/tokenize", json={"model": "m", "content": content}, timeout=120)
    assert r.status_code == 200 and len(r.json()["tokens"]) > 10_000
    after = written(base)
    assert after["relayed"] - before["relayed"] == 1 and after["native"] == before["native"]


def test_a_browser_answer_written_by_the_worker_carries_the_cors_header(base):
    r = httpx.post(base + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2},
                   headers={"Origin": "http://localhost:5173"}, timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:5173"


def test_a_worker_killed_under_a_native_stream_ends_it_and_the_next_request_is_served(base):
    """The client's stream ends (no hang) when its worker dies; the router takes the next
    request on a new worker."""
    seen = threading.Event()
    ended: list = []

    def read():
        try:
            with httpx.stream("POST", base + "/v1/chat/completions", timeout=60,
                              json={"model": "story", "messages": [{"role": "user", "content": "a story"}],
                                    "max_tokens": 100000, "stream": True}) as r:
                for _ in r.iter_lines():
                    seen.set()
        except httpx.HTTPError as e:
            ended.append(type(e).__name__)
        else:
            ended.append("closed")

    t = threading.Thread(target=read)
    t.start()
    assert seen.wait(60)
    workers = httpx.get(base + "/devices", timeout=30).json()["workers"]
    for w in workers:
        os.kill(w["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    t.join(30)
    assert not t.is_alive() and ended, "the stream hung after its worker died"
    assert time.monotonic() - t0 < 10
    r = httpx.post(base + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}, timeout=120)
    assert r.status_code == 200


def test_a_worker_that_dies_before_it_writes_leaves_the_client_a_503(base):
    """A request handed to a worker that is stopped (it cannot read it), then killed: nothing
    was written on the connection, so the router answers it as a relay would (503 and
    Retry-After), not with a dropped connection; the connection then takes the next request."""
    assert httpx.post(base + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2},
                      timeout=120).status_code == 200  # m loaded, its worker running
    pid = next(w["pid"] for w in httpx.get(base + "/devices", timeout=30).json()["workers"] if w["alive"])
    sock = connect(base)
    try:
        os.kill(pid, signal.SIGSTOP)
        sock.sendall(request("POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}))
        time.sleep(0.5)  # handed over, unread
        os.kill(pid, signal.SIGKILL)
        status, headers, body = Reader(sock).response()
        assert status == 503 and headers.get("retry-after"), body
        assert b"worker" in body
        sock.sendall(request("POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}))
        again = Reader(sock).response()
        assert again[0] == 200, again  # a new worker, the same connection
    finally:
        sock.close()


def test_no_native_relays_every_answer(tiny):
    """``serve --no-native``: every model answer goes out through the router process."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        preset = Path(d) / "models.ini"
        preset.write_text(f"[m]\nmodel = {tiny['tiny-llama']}\nc = 512\n")
        proc, url = start_serve(["--models-preset", str(preset), "--no-models-cache", "--models-memory-margin", "0",
                                 "--emulate-devices", "GPU0=4GiB", "--no-native"])
        try:
            for stream in (False, True):
                r = httpx.post(url + "/v1/completions", timeout=120,
                               json={"model": "m", "prompt": "hi", "max_tokens": 3, "stream": stream})
                assert r.status_code == 200
            assert written(url) == {"native": 0.0, "relayed": 2.0}
        finally:
            proc.terminate()
            proc.wait(30)


def test_requests_past_the_slots_wait_in_the_worker_and_a_client_that_leaves_meanwhile_costs_nothing(tiny, tmp_path):
    """One slot, one endless stream in it: a second stream is deferred in llama.cpp's queue
    (a slot's worth, ready for the slot), a third waits in the worker, not there too
    (llama.cpp's waiting threads are woken by every token); a request that takes no slot is
    answered meanwhile;
    the waiting client that leaves ends its request within seconds, before the slot frees
    (the router's lease back); the second stream runs once the first ends."""
    story = scripted.write_scripted(tmp_path / "story.gguf", scripted.THINK_TEMPLATE, scripted.STORY_SCRIPT,
                                    loop=True)
    preset = tmp_path / "models.ini"
    preset.write_text(f"[one]\nmodel = {story}\nc = 4096\nnp = 1\ncontext-shift = true\nmetrics = true\n"
                      "load-on-startup = true\n")  # the endless stream lasts until stopped
    proc, url = start_serve(["--models-preset", str(preset), "--no-models-cache", "--models-memory-margin", "0",
                             "--emulate-devices", "GPU0=4GiB"])
    chat = {"model": "one", "messages": [{"role": "user", "content": "a story"}], "stream": True}
    try:
        first = connect(url)
        first.sendall(request("POST", "/v1/chat/completions", chat))  # no max_tokens: until it is closed
        assert first.recv(1 << 16).startswith(b"HTTP/1.1 200")  # in the slot, streaming
        # read as it comes (a client that stopped reading would leave the gate once the worker
        # holds max_pending of its stream: conduit.h), until the socket is shut below
        def read_all() -> None:
            try:
                while first.recv(1 << 16):
                    pass
            except OSError:  # the test's own shutdown below may meet the server's reset
                pass

        reader = threading.Thread(target=read_all, daemon=True)
        reader.start()
        second_out: list = []
        second = threading.Thread(target=lambda: second_out.append(httpx.post(
            url + "/v1/chat/completions", json={**chat, "max_tokens": 5}, timeout=120)))
        second.start()
        wait_for(lambda: metric(url, "pyllmrouter_model_requests_in_flight") == 2, 30)
        wait_for(lambda: metric(url, "llamacpp:requests_deferred", "one") == 1, 30)  # llama.cpp's queue
        leaving = connect(url)
        leaving.sendall(request("POST", "/v1/chat/completions", {**chat, "max_tokens": 5}))
        wait_for(lambda: metric(url, "pyllmrouter_model_requests_in_flight") == 3, 30)
        time.sleep(0.5)  # long enough for llama.cpp to have it, were it let in
        assert metric(url, "llamacpp:requests_processing", "one") == 1
        assert metric(url, "llamacpp:requests_deferred", "one") == 1  # the third waits in the worker
        r = httpx.post(url + "/tokenize", json={"model": "one", "content": "a b c"}, timeout=30)
        assert r.status_code == 200 and r.json()["tokens"]  # no slot needed: not behind the stream
        leaving.close()
        wait_for(lambda: metric(url, "pyllmrouter_model_requests_in_flight") == 2, 30)
        assert second.is_alive() and not second_out  # the slot is still the first stream's
        first.shutdown(socket.SHUT_RDWR)  # the first stream ends: the second takes the slot
        reader.join(30)
        first.close()
        second.join(120)
        assert second_out and second_out[0].status_code == 200
        done = [line for line in second_out[0].text.splitlines() if line.startswith("data: ")]
        assert done[-1] == "data: [DONE]"
        wait_for(lambda: metric(url, "pyllmrouter_model_requests_in_flight") == 0, 30)
    finally:
        proc.terminate()
        proc.wait(30)
