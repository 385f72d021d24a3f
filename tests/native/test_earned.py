"""Every byte to its own client, and no answer it did not earn: on the native path (a worker
writing on the client's connection) as on the relay (``serve --no-native``).

- Nothing a worker writes goes before a byte the router still owes that client (an earlier
  answer's tail in the event loop's buffer, for a client that reads slowly).
- A request stopped before its reply was whole (its client gone, an unload, a close) is
  never written as a success: a client gone gets nothing more (a half-close is a client
  gone, as llama-server's own connection check reads it; an answer finished before its end
  was seen may still go), a client still there an error status, a stream under way is left
  unfinished (the connection closes without its last chunk).
- Native answers carry the header fields the relay's do (Date, and Server as llama-server
  sends it)."""

from __future__ import annotations

import dataclasses
import email.utils
import json
import socket
import threading
import time

import httpx
import pytest

from pyllmrouter import ModelSpec
from pyllmrouter.engine import loader
from pyllmrouter.engine.backend import native
from pyllmrouter.engine.hosting import EngineHost
from pyllmrouter.protocol import Batch, Call, Chunk, Failed, Result
from pyllmrouter.tools import scripted, tinymodels, wire
from pyllmrouter.tools.loopback import serving
from test_handover import request

pytestmark = pytest.mark.slow

PATHS = ("native", "relay")
LONG = 12000  # tokens of a request that holds the one slot for seconds (about 7 s)
HOLD = 3000  # tokens of one that holds it while another queues behind it


@pytest.fixture(scope="module")
def both(tiny, tmp_path_factory):
    """``one`` (a tiny llama trained for a long context, one slot: a request of ``LONG`` tokens
    takes seconds) and ``story`` (the scripted model)
    behind ``serve`` and ``serve --no-native``."""
    d = tmp_path_factory.mktemp("earned")
    story = scripted.write_scripted(d / "story.gguf", scripted.THINK_TEMPLATE, scripted.STORY_SCRIPT, loop=True)
    preset = d / "models.ini"
    long = tinymodels.write_llama(d / "long.gguf", dataclasses.replace(tinymodels.LLAMA, n_ctx_train=32768))
    preset.write_text(f"[one]\nmodel = {long}\nc = 32768\nnp = 1\n"
                      f"load-on-startup = true\n\n[{wire.MODEL}]\nmodel = {story}\nc = 4096\nnp = 2\n"
                      f"load-on-startup = true\n")
    common = ["--models-preset", str(preset), "--no-models-cache", "--models-memory-margin", "0",
              "--emulate-devices", "GPU0=4GiB"]
    with serving(common, {"native": (), "relay": ("--no-native",)}) as urls:
        yield urls


def _load(url: str, model: str) -> None:
    r = httpx.post(url + "/models/load", json={"model": model}, timeout=120)
    assert r.status_code == 200, r.text
    assert httpx.post(url + "/tokenize", json={"model": model, "content": "warm"}, timeout=120).status_code == 200


def _connect(url: str, rcvbuf: int | None = None) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(60)
    sock.connect((host, int(port)))
    return sock


def _read_all(sock: socket.socket, pause: float = 0.0, piece: int = 65536) -> bytes:
    got = b""
    while True:
        if pause:
            time.sleep(pause)
        more = sock.recv(piece)
        if not more:
            return got
        got += more


def _hold(url: str) -> threading.Thread:
    """A request that holds ``one``'s slot for a while (read by a client that stays)."""
    def run():
        httpx.post(url + "/completion", json={"model": "one", "prompt": "hi", "n_predict": HOLD, "ignore_eos": True},
                   timeout=120)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("path", PATHS)
def test_an_answer_the_router_still_owes_is_never_overtaken_by_a_workers(both, path):
    """A client with a small receive buffer pipelines a request whose answer is megabytes
    (relayed: a request pipelined behind it) and a small /tokenize, then stalls: the first answer's
    tail waits in the router's buffer.  The second, last in the pipeline, is handed to its
    worker only once that buffer is empty (else relayed): both answers come whole and in
    order (before: the small answer came at byte 2,810,001 of the large one)."""
    url = both[path]
    _load(url, wire.MODEL)
    small = {"model": wire.MODEL, "content": "small"}
    sock = _connect(url, rcvbuf=4096)
    try:
        sock.sendall(wire.large_request() + request("POST", "/tokenize", small))
        time.sleep(1.0)  # stalled: the router's buffers fill
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)  # then read at speed
        reader = wire.ResponseReader(sock, slow=False)
        first, second = reader.response(time.monotonic() + 60), reader.response(time.monotonic() + 60)
    finally:
        sock.close()
    assert isinstance(first, tuple) and first[0] == 200, str(first)[:300]
    assert len(first[2]) > wire.LARGE  # more than the kernel's buffers hold
    assert json.loads(first[2])["prompt"].count("x") == wire.LARGE
    assert isinstance(second, tuple) and second[0] == 200 and json.loads(second[2])["tokens"], str(second)[:300]


HALF_CLOSED = {
    "short": ("/tokenize", {"model": "one", "content": "hello"}, False),
    "completion": ("/completion", {"model": "one", "prompt": "hi", "n_predict": 4}, False),
    "long": ("/completion", {"model": "one", "prompt": "hi", "n_predict": LONG, "ignore_eos": True}, False),
    "stream": ("/completion", {"model": "one", "prompt": "hi", "n_predict": 64, "stream": True}, False),
    "queued": ("/completion", {"model": "one", "prompt": "hi", "n_predict": 4}, True),
    "queued stream": ("/v1/chat/completions", {"model": "one", "messages": [{"role": "user", "content": "hi"}],
                                               "max_tokens": 4, "stream": True}, True),
}


def _unearned(raw: bytes) -> str | None:
    """Why what a client read is an answer its request did not earn (None: nothing, a whole
    answer with a body, or a stream left unfinished): a success with no body, or a stream
    framed as whole without its events."""
    if not raw:
        return None
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    chunked = b"transfer-encoding: chunked" in head.lower()
    if chunked and body.endswith(b"0\r\n\r\n") and b"data: " not in body:
        return f"an empty stream framed as whole: {raw[:300]!r}"
    if not chunked and status < 300 and not body:
        return f"a success with no body: {raw[:300]!r}"
    return None


@pytest.mark.parametrize("kind", HALF_CLOSED)
def test_a_half_closed_client_is_gone_and_gets_no_answer_it_did_not_earn(both, kind):
    """A request sent, then the client's side shut (SHUT_WR): the client is gone, on both
    paths alike (llama-server's connection check reads the end of its stream so, and so does
    the relay): its work stops, and it gets nothing, or an answer finished before its end
    was seen, or a stream left unfinished; never one it did not earn.  Before: natively a
    stream got ``200 ... 0\r\n\r\n`` (an empty stream framed as whole).  Nothing of it
    generates on after (a short request on the one slot is answered at once)."""
    path, body, queued = HALF_CLOSED[kind]
    for name in PATHS:
        url = both[name]
        _load(url, "one")
        holder = _hold(url) if queued else None
        if holder is not None:
            time.sleep(0.3)
        sock = _connect(url)
        try:
            sock.sendall(request("POST", path, body))
            sock.shutdown(socket.SHUT_WR)
            got = _read_all(sock)
        finally:
            sock.close()
        assert _unearned(got) is None, (name, _unearned(got))
        if holder is not None:
            holder.join(60)
        # llama.cpp looks at a whole reply's should_stop once a second (HTTP_POLLING_SECONDS);
        # LONG's generation, left on, would hold the slot for seconds more
        t0 = time.monotonic()
        r = httpx.post(url + "/completion", json={"model": "one", "prompt": "hi", "n_predict": 2}, timeout=60)
        assert r.status_code == 200 and time.monotonic() - t0 < 3.0, (name, time.monotonic() - t0)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_request_an_unload_stops_ends_as_a_failure_not_as_a_whole_reply(tmp_path, stream):
    """A worker's engine closed (an unload, a close) under a request in flight: a whole
    request ends as llama-server's 503 for a model not ready, the one the native path writes
    (csrc/conduit.cpp), a stream as a failure (the relay leaves it unfinished); never as the
    reply llama.cpp's handler leaves when its wait is stopped (before: ``Result`` of a ``200``
    with no body, and a stream's normal end)."""
    long = tinymodels.write_llama(tmp_path / "long.gguf", dataclasses.replace(tinymodels.LLAMA, n_ctx_train=32768))
    engine = loader.load(ModelSpec(str(long), args=("-np", "1"), n_ctx=32768))
    sent: list = []
    host = EngineHost("one", engine, native(), sent.append)
    body = {"prompt": "hi", "n_predict": LONG, "ignore_eos": True, "stream": stream}
    host.call(Call(1, "one", "POST", "/completion", json.dumps(body).encode()))
    time.sleep(0.5)  # under way
    host.close()
    flat = [m for msg in sent for m in (msg.messages if isinstance(msg, Batch) else [msg])]
    final = [m for m in flat if isinstance(m, (Result, Failed))]
    assert len(final) == 1, final
    if stream:  # its head went out first; its end is a failure
        assert any(isinstance(m, Chunk) for m in flat) and isinstance(final[0], Failed), final
        assert "unloading" in final[0].message, final[0]
    else:  # llama-server's answer for a model not ready, as the native path writes it
        reply = final[0].value
        assert isinstance(final[0], Result) and reply.status == 503, final
        assert json.loads(reply.body)["error"]["message"] == "Loading model" and reply.headers["Retry-After"] == "1"


@pytest.mark.parametrize("endpoint", ["/tokenize", "/completion", "/completion stream", "/nowhere"])
def test_native_answers_carry_the_relays_date_and_server(both, endpoint):
    """Each answer's Date (IMF-fixdate, now) and Server (llama-server's ``llama.cpp``), on
    both paths: before, native answers had neither and relayed ones said ``uvicorn``."""
    seen = {}
    for name in PATHS:
        url = both[name]
        _load(url, wire.MODEL)
        stream = endpoint.endswith("stream")
        path = endpoint.split()[0]
        body = {"model": wire.MODEL, "content": "hi", "prompt": "hi", "n_predict": 2, "stream": stream}
        sock = _connect(url)
        try:
            sock.sendall(request("POST", path, body))
            answer = wire.ResponseReader(sock, slow=False).response(time.monotonic() + 30)
        finally:
            sock.close()
        assert isinstance(answer, tuple), answer
        fields = dict(answer[1])
        sent = email.utils.parsedate_to_datetime(fields["date"]).timestamp()
        assert abs(sent - time.time()) < 5 and fields["date"].endswith(" GMT"), fields
        assert fields["server"] == "llama.cpp", fields
        seen[name] = (answer[0], sorted(k for k in fields if k != "content-length"))
    assert seen["native"] == seen["relay"], seen
