"""A worker that reads a connection's next requests itself (``--follow-ms``, csrc/conduit.h's
``Follow``): only those like the one the router let through (the same request line and
headers, Content-Length aside, a whole body naming the same model); anything else is the
router's, answered exactly as with ``--follow-ms 0``.  Spoken to byte by byte."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from pyllmrouter import ModelConfig, ModelSpec, Router
from pyllmrouter.devices import EmulatedInventory
from pyllmrouter.tools.loopback import free_port, serving as serve_variants, start_serve, wait_healthy
from test_handover import Reader, connect, metric as any_metric, request
from test_live import serving, wait_for

pytestmark = pytest.mark.slow

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
M = {"model": "m", "prompt": "hi", "max_tokens": 3, "ignore_eos": True}


# Clients in a process of their own (the router's threads never pause them), each on one
# connection that sends the next request as soon as the last is answered, until killed.
CLIENTS = r"""
import json, socket, sys, threading
port, body = int(sys.argv[1]), sys.argv[2].encode()
req = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" \
      b"Content-Length: %d\r\n\r\n" % len(body) + body

said = threading.Lock()

def more(sock):
    data = sock.recv(65536)
    if not data:
        sys.exit(0)  # the server closed the connection: this client is done
    return data

def run():
    sock, buf = socket.create_connection(("127.0.0.1", port)), b""
    while True:
        sock.sendall(req)
        while b"\r\n\r\n" not in buf:
            buf += more(sock)
        head, buf = buf.split(b"\r\n\r\n", 1)
        length = int(next(l.split(b":")[1] for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")))
        while len(buf) < length:
            buf += more(sock)
        buf = buf[length:]
        with said:  # a line each, whole (the threads share stdout)
            print(head.split(b" ")[1].decode(), flush=True)
for _ in range(int(sys.argv[3])):
    threading.Thread(target=run).start()
"""


def serve_args(preset) -> list[str]:
    return ["--models-preset", str(preset), "--no-models-cache", "--models-memory-margin", "0",
            "--emulate-devices", "GPU0=4GiB", "--api-key", KEY]


def serve(preset, *extra: str):
    return start_serve([*serve_args(preset), *extra])


@pytest.fixture(scope="module")
def servers(tiny, tmp_path_factory):
    """Two routers on the same models: one whose workers follow (told of the answers every
    100 ms), one whose router reads every request (--follow-ms 0)."""
    preset = tmp_path_factory.mktemp("follow") / "models.ini"
    preset.write_text(f"[m]\nmodel = {tiny['tiny-llama']}\nc = 1024\nnp = 2\nload-on-startup = true\n\n"
                      f"[n]\nmodel = {tiny['tiny-llama']}\nc = 1024\nnp = 1\nload-on-startup = true\n")
    with serve_variants(serve_args(preset), {"follow": ["--follow-ms", "100"], "router": ["--follow-ms", "0"]}) as urls:
        for url in urls.values():  # both models loaded before the first test
            for model in ("m", "n"):
                httpx.post(url + "/v1/completions", json={**M, "model": model}, headers=AUTH, timeout=120)
        yield urls


def metric(base: str, name: str) -> float:
    return any_metric(base, name, headers=AUTH)


def followed(base: str) -> float:
    return metric(base, "pyllmrouter_followed_requests_total")


def test_a_worker_reads_the_next_requests_like_the_last_itself_and_the_router_counts_each(servers):
    base = servers["follow"]
    native = metric(base, 'pyllmrouter_responses_total{path="native"}')
    timed = metric(base, 'pyllmrouter_request_seconds_count{endpoint="/v1/completions",model="m",status="200"}')
    before = followed(base)
    with connect(base) as sock:
        r = Reader(sock)
        for i in range(12):
            sock.sendall(request("POST", "/v1/completions", {**M, "max_tokens": 2 + i % 3}, AUTH))
            status, headers, body = r.response()
            assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2 + i % 3
    # every one counted (the worker's answers listed when it gives the connection back)
    assert metric(base, 'pyllmrouter_responses_total{path="native"}') - native == 12
    assert metric(base, 'pyllmrouter_request_seconds_count{endpoint="/v1/completions",model="m",status="200"}') \
        - timed == 12
    assert followed(base) > before  # and some were read by the worker itself


def test_a_follow_lasts_while_the_requests_keep_coming_and_the_router_counts_them_as_they_go(servers):
    """A follow has no window of its own: a connection whose requests keep coming alike is
    the worker's for many report periods (100 ms here), the router reading its first request
    only, and the router counts the answers as the worker lists them (progress), not only
    once it gives the connection back."""
    base = servers["follow"]
    native_series = 'pyllmrouter_responses_total{path="native"}'
    for _ in range(5):  # until a run had no pause of 20 ms between an answer and the next request
        native, before = metric(base, native_series), followed(base)
        midway: list[float] = []
        watcher = threading.Timer(0.4, lambda: midway.append(metric(base, native_series) - native))
        sent = 0
        with connect(base) as sock:
            r = Reader(sock)
            t0 = time.monotonic()
            watcher.start()
            while sent < 1000 and (sent < 20 or time.monotonic() - t0 < 0.8):
                sock.sendall(request("POST", "/v1/completions", M, AUTH))
                assert r.response()[0] == 200
                sent += 1
            watcher.join()
        for _ in range(100):  # the rest once the worker gives the connection back (the client gone)
            if metric(base, native_series) - native >= sent:
                break
            time.sleep(0.05)
        assert metric(base, native_series) - native == sent  # each counted once
        if sent - (followed(base) - before) == 1:  # the router read the first request only
            break
    else:
        pytest.fail("the worker never followed a connection throughout")
    assert midway and midway[0] >= 1, midway  # counted while the worker still had the connection


def test_each_answer_is_counted_once_whatever_the_report_period(tiny):
    """--follow-ms 1: the worker lists its answers after nearly every request (progress), the
    first one's too; done then lists the rest, none maybe, and nothing is counted twice."""
    spec = ModelSpec(tiny["tiny-llama"], ("-c", "1024"))
    native_series = 'pyllmrouter_responses_total{path="native"}'
    with Router([ModelConfig("m", spec)], inventory=EmulatedInventory({"GPU0": 4 << 30}), margin=0) as r, \
            serving(r, follow_ms=1) as base:
        r.load("m")
        before = metric(base, native_series)
        for per_connection in (1, 1, 3, 1, 2):
            with connect(base) as sock:
                reader = Reader(sock)
                for _ in range(per_connection):
                    sock.sendall(request("POST", "/v1/completions", {**M, "max_tokens": 8}))
                    assert reader.response()[0] == 200
        wait_for(lambda: metric(base, native_series) - before >= 8, timeout=10, what="the answers counted")
        time.sleep(0.3)  # a count twice would come by now
        assert metric(base, native_series) - before == 8


def test_a_model_whose_connections_never_pause_is_drained_for_another_models_waiter(tiny, tmp_path):
    """A follow ends with the turn of a model drained for a waiter (--turn), one that began
    during the turn too: clients that never pause on one model do not keep another model's
    request waiting past it: a connection followed when the drain begins (the drain's end
    reaches it), and one opened during the turn (its lease carries the turn's end)."""
    spec = ModelSpec(tiny["tiny-llama"], ("-c", "1024"))
    body = {"model": "m", "prompt": "hi", "max_tokens": 3, "ignore_eos": True}
    models = [ModelConfig("m", spec), ModelConfig("n", spec)]
    with Router(models, inventory=EmulatedInventory({"GPU0": 4 << 30}), margin=0, max_models=1, turn=3.0,
                queue_timeout=20.0) as r, serving(r, follow_ms=100) as base:
        r.load("m")
        outs = []

        def clients() -> subprocess.Popen:  # each its own file: two processes' lines would interleave
            outs.append(tmp_path / f"statuses-{len(outs)}")
            with open(outs[-1], "w") as out:
                return subprocess.Popen([sys.executable, "-c", CLIENTS, base.rsplit(":", 1)[1], json.dumps(body),
                                         "1"], stdout=out)
        replies: list = []
        first = clients()
        second = None
        try:
            wait_for(lambda: followed(base) > 0, what="a follow")
            t0 = time.monotonic()
            waiter = threading.Thread(target=lambda: replies.append(httpx.post(
                base + "/v1/completions", json={**body, "model": "n"}, timeout=60)))
            waiter.start()
            wait_for(lambda: (r.status()["models"]["n"].get("waiting") or {}).get("why")
                     == "waiting for busy models to finish", timeout=10, what="m drained for n")
            second = clients()  # leased during m's turn: its follow starts after the drain's end was sent
            wait_for(lambda: r.status()["models"]["m"]["leases"] == 2, timeout=10, what="the second connection")
            waiter.join(60)
            took = time.monotonic() - t0
        finally:
            for p in (first, second):
                if p is not None:
                    p.kill()
                    p.wait(30)
        statuses = [s for o in outs for s in o.read_text().split()]
    assert replies and replies[0].status_code == 200 and replies[0].json()["model"] == "n", replies
    assert took < 15, took  # the turn (3 s), an unload and a load; never the queue's timeout (20 s)
    assert statuses and set(statuses) == {"200"}, statuses


def test_a_model_removed_while_a_connection_follows_it_goes(tiny, tmp_path):
    """A model taken off the live list finishes what it has, then unloads and goes: a
    connection its worker follows is given back after its request in progress, and its
    next requests are the router's (the model is gone for them)."""
    spec = ModelSpec(tiny["tiny-llama"], ("-c", "1024"))
    body = {"model": "m", "prompt": "hi", "max_tokens": 3, "ignore_eos": True}
    with Router([ModelConfig("m", spec)], inventory=EmulatedInventory({"GPU0": 4 << 30}), margin=0) as r, \
            serving(r, follow_ms=100) as base, open(tmp_path / "statuses", "w+") as out:
        r.load("m")
        clients = subprocess.Popen([sys.executable, "-c", CLIENTS, base.rsplit(":", 1)[1], json.dumps(body), "1"],
                                   stdout=out)
        try:
            wait_for(lambda: followed(base) > 0, what="a follow")
            r.remove_model("m")
            wait_for(lambda: "m" not in r.status()["models"], timeout=15, what="the model gone")
        finally:
            clients.kill()
            clients.wait(30)
        out.seek(0)
        assert "200" in out.read().split()
        r.scheduler.check_invariant()


def test_a_server_shutting_down_takes_back_the_connections_its_workers_follow(tiny, tmp_path):
    """SIGTERM under a client that never pauses: the worker gives the connection back after
    the request it is answering, and the server closes it and exits, well inside
    --shutdown-timeout (30 s), every answer whole."""
    preset = tmp_path / "models.ini"
    preset.write_text(f"[m]\nmodel = {tiny['tiny-llama']}\nc = 1024\nload-on-startup = true\n")
    proc, base = serve(preset, "--follow-ms", "100", "--shutdown-timeout", "30")
    statuses: list[int] = []

    def client() -> None:
        with connect(base) as sock:
            r = Reader(sock)
            try:
                while True:
                    sock.sendall(request("POST", "/v1/completions", M, AUTH))
                    statuses.append(r.response()[0])
            except (EOFError, ConnectionError, socket.timeout):
                return  # closed by the server
    try:
        assert httpx.post(base + "/v1/completions", json=M, headers=AUTH, timeout=120).status_code == 200
        t = threading.Thread(target=client)
        t.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        took = time.monotonic() - t0
        t.join(60)
    finally:
        proc.kill()
        proc.wait(30)
    assert took < 10, took
    assert len(statuses) > 1 and set(statuses) == {200}, statuses


def outcome(base: str, variant: bytes) -> tuple:
    """A request like the last (taken by the worker where it follows), then ``variant`` on
    the same connection: what the client gets for it (status, the model that answered or the
    error said), or that the connection closed."""
    with connect(base) as sock:
        r = Reader(sock)
        sock.sendall(request("POST", "/v1/completions", M, AUTH))
        assert r.response()[0] == 200
        sock.sendall(request("POST", "/v1/completions", M, AUTH))  # the worker follows from here
        assert r.response()[0] == 200
        sock.sendall(variant)
        try:
            status, headers, body = r.response()
        except (EOFError, ConnectionError, socket.timeout):
            return ("closed",)
        data = json.loads(body) if headers.get("content-type", "").startswith("application/json") else {}
        said = data.get("model") or (data.get("error") or {}).get("message") if isinstance(data, dict) else None
        return status, said


VARIANTS = {
    "another model": request("POST", "/v1/completions", {**M, "model": "n"}, AUTH),
    "no key": request("POST", "/v1/completions", M),
    "a wrong key": request("POST", "/v1/completions", M, {"Authorization": "Bearer wrong"}),
    "another path": request("POST", "/v1/chat/completions",
                            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, AUTH),
    "the model by ?model=": request("POST", "/v1/completions?model=n", {"prompt": "hi", "max_tokens": 2}, AUTH),
    "not JSON": request("POST", "/v1/completions", b'{"model": "m", "prompt": ', AUTH),
    "a byte-order mark": request("POST", "/v1/completions", b"\xef\xbb\xbf" + json.dumps(M).encode(), AUTH),
    "nested too deeply": request("POST", "/v1/completions", b'{"model": "m", "x": ' + b"[" * 5000 + b"]" * 5000
                                 + b"}", AUTH),
    "an Origin": request("POST", "/v1/completions", M, {**AUTH, "Origin": "http://localhost:8000"}),
    "two Content-Lengths": request("POST", "/v1/completions", M, {**AUTH, "Content-Length": "%d"
                                                                   % len(json.dumps(M))}),
    "a folded header": request("POST", "/v1/completions", M, AUTH).replace(
        b"Content-Type: application/json\r\n", b"Content-Type: application/json\r\n \tcontinued\r\n"),
    "chunked": request("POST", "/v1/completions", b"", {**AUTH, "Content-Type": "application/json",
                                                         "Transfer-Encoding": "chunked"}).replace(
        b"Content-Length: 0\r\n", b"") + b"%x\r\n%s\r\n0\r\n\r\n" % (len(json.dumps(M)), json.dumps(M).encode()),
    "HTTP/1.0": request("POST", "/v1/completions", M, AUTH).replace(b" HTTP/1.1\r\n", b" HTTP/1.0\r\n", 1),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_request_unlike_the_last_is_answered_as_the_router_answers_it(servers, variant):
    """What the client gets for a request that is not like the last is what it gets from a
    router that reads every request itself: the worker leaves it to the router."""
    theirs = outcome(servers["router"], VARIANTS[variant])
    for _ in range(5):  # until the worker was following when it came (it waits 20 ms for a next request)
        followed_before = followed(servers["follow"])
        ours = outcome(servers["follow"], VARIANTS[variant])
        assert ours == theirs
        if followed(servers["follow"]) > followed_before:
            break
    else:
        pytest.fail("the worker never followed the connection")
    if variant in ("another model", "the model by ?model="):
        assert ours == (200, "n")


def test_a_model_unloaded_while_a_connection_follows_it_unloads_and_the_client_is_answered(servers):
    base = servers["follow"]
    stop, statuses = threading.Event(), []

    def client() -> None:
        with connect(base) as sock:
            r = Reader(sock)
            while not stop.is_set():
                sock.sendall(request("POST", "/v1/completions", {**M, "model": "n"}, AUTH))
                statuses.append(r.response()[0])
    t = threading.Thread(target=client)
    t.start()
    try:
        time.sleep(0.3)
        t0 = time.monotonic()
        reply = httpx.post(base + "/models/unload", json={"model": "n"}, headers=AUTH, timeout=60)
        took = time.monotonic() - t0
        time.sleep(0.3)
    finally:
        stop.set()
        t.join(60)
    assert reply.status_code == 200 and reply.json()["success"], reply.text
    assert took < 10, took
    # every request answered whole (200; a 503 of a model unloading, as llama-server's)
    assert statuses and set(statuses) <= {200, 503}, statuses


def test_the_access_log_has_a_line_for_each_answer_a_worker_wrote(tiny, tmp_path):
    """--access-log: uvicorn's line for every request, those a worker answered on the
    connection (and read itself) included, which never pass uvicorn's send."""
    preset = tmp_path / "models.ini"
    preset.write_text(f"[m]\nmodel = {tiny['tiny-llama']}\nc = 1024\nload-on-startup = true\n")
    port, log = free_port(), tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pyllmrouter.cli", "serve", "--models-preset", str(preset),
                                 "--emulate-devices", "GPU0=4GiB", "--access-log", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc)
        with connect(base) as sock:
            r = Reader(sock)
            for _ in range(5):
                sock.sendall(request("POST", "/v1/completions?x=1", M))
                assert r.response()[0] == 200
            sock.sendall(request("POST", "/v1/completions?x=1", {**M, "model": "nope"}))
            assert r.response()[0] == 404
        for _ in range(100):  # the worker gives the connection back once the client has gone
            if log.read_text().count('"POST /v1/completions?x=1 HTTP/1.1" ') >= 6:
                break
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(30)
    lines = [line for line in log.read_text().splitlines() if '"POST /v1/completions?x=1 HTTP/1.1"' in line]
    # uvicorn's own format for all ('127.0.0.1:PORT - "POST /v1/completions?x=1 HTTP/1.1" 200 OK')
    assert [line.split('HTTP/1.1" ', 1)[1] for line in lines] == ["200 OK"] * 5 + ["404 Not Found"], lines
