"""Every answer on the connection it belongs to, in the order of its requests: the native
path (a worker writing the answer on the client's connection and reading its next requests
itself) against the relay (``serve --no-native``, the router reading every request and
writing every answer), under pipelining, split segments, stalled readers, clients that
leave, and the router's ends of a worker's follows.  Spoken to byte by byte."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest
import uvicorn

from pyllmrouter import ModelConfig, ModelSpec, Router
from pyllmrouter.devices import EmulatedInventory
from pyllmrouter.server.app import HTTP_PROTOCOL, create_app
from pyllmrouter.tools import scripted, wire
from pyllmrouter.tools.loopback import free_port, serving, start_serve
from test_handover import Reader, connect, metric, request
from test_live import wait_for

pytestmark = pytest.mark.slow

FUZZ_SEED, FUZZ_CASES = 54, 300  # the suite's short run (bench/wire_fuzz.py runs long ones)


def _preset(tiny, d, extra: str = "") -> str:
    story = scripted.write_scripted(d / "story.gguf", scripted.THINK_TEMPLATE, scripted.STORY_SCRIPT, loop=True)
    preset = d / "models.ini"
    preset.write_text(f"[{wire.MODEL}]\nmodel = {story}\nc = 4096\nnp = 2\nload-on-startup = true\n{extra}\n"
                      f"[m]\nmodel = {tiny['tiny-llama']}\nc = 1024\nnp = 2\nload-on-startup = true\n")
    return str(preset)


def _serve(preset: str, *extra: str, env: dict | None = None):
    # a short graceful shutdown: after a long fuzz the relay's server has been seen to wait its whole
    # default (30 s) for something unfinished at exit (not found yet), past the fixture's wait
    return start_serve(["--models-preset", preset, "--no-models-cache", "--models-memory-margin", "0",
                        "--emulate-devices", "GPU0=4GiB", "--shutdown-timeout", "5", *extra], env=env)


@pytest.fixture(scope="module")
def servers(tiny, tmp_path_factory):
    """The same models behind ``serve`` as users run it (native, following) and behind
    ``serve --no-native`` (the reference: the router reads and writes everything)."""
    preset = _preset(tiny, tmp_path_factory.mktemp("wire"))
    common = ["--models-preset", preset, "--no-models-cache", "--models-memory-margin", "0",
              "--emulate-devices", "GPU0=4GiB"]
    with serving(common, {"native": (), "relay": ("--no-native",)}) as urls:
        for url in urls.values():
            for model in (wire.MODEL, "m"):
                assert httpx.post(url + "/tokenize", json={"model": model, "content": "warm"},
                                  timeout=120).status_code == 200
        yield urls


def tokens(response) -> int:
    status, _, body = response
    assert status == 200, body
    return len(json.loads(body)["tokens"])


def words(n: int) -> bytes:
    return request("POST", "/tokenize", {"model": "m", "content": " ".join(["word"] * n)})


def test_pipelined_requests_are_answered_in_order_when_more_come_on_the_first_answer(servers):
    """Two requests in one segment, a third sent when the first answer arrives (before, the
    worker followed the connection while the router held the second: [5, 15, 10]-like
    counts); then kept two deep for eight."""
    for url in servers.values():
        with connect(url) as sock:
            r = Reader(sock)
            sock.sendall(words(1) + words(2))
            got = [tokens(r.response())]
            sock.sendall(words(3))
            got += [tokens(r.response()), tokens(r.response())]
            assert got == sorted(got) and len(set(got)) == 3, got
        with connect(url) as sock:
            r = Reader(sock)
            sock.sendall(words(1) + words(2))
            got = []
            for n in range(3, 11):
                got.append(tokens(r.response()))
                sock.sendall(words(n))
            got += [tokens(r.response()), tokens(r.response())]
            assert got == sorted(got) and len(set(got)) == 10, got


def test_bytes_past_a_request_that_the_router_has_read_are_never_the_workers(servers):
    """A request and the start of another in one segment (``GET /health`` and a header left
    open), then a whole POST: by the router's parser, that POST is the value of ``X-Pad``
    (the GET's header), so the answers are the first POST's and the GET's, on both paths
    (before, the worker answered the POST it read off the socket)."""
    answers = {}
    for name, url in servers.items():
        with connect(url) as sock:
            r = Reader(sock)
            sock.sendall(words(2) + b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: ")
            first = r.response()
            sock.sendall(words(4))
            second = r.response()
            answers[name] = [(first[0], json.loads(first[2])), (second[0], json.loads(second[2]))]
    assert answers["native"] == answers["relay"]
    assert answers["native"][1] == (200, {"status": "ok"})


def test_a_header_value_that_is_not_ascii_is_never_followed(servers):
    """``caf\\xe9`` (latin-1) then ``café`` (UTF-8): the router reads them as different
    values, so the worker may not take the second as like the first (before, it did, from
    the values' JSON round trip); both are answered, by the router's reading."""
    url = servers["native"]
    before = metric(url, "pyllmrouter_followed_requests_total")
    with connect(url) as sock:
        r = Reader(sock)
        body = json.dumps({"model": "m", "content": "a b"}).encode()
        for value in (b"caf\xe9", "café".encode(), b"caf\xe9", b"caf\xe9"):
            sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"X-Note: " + value + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            assert tokens(r.response()) > 0
    time.sleep(1.5)  # the worker's progress report, were any followed
    assert metric(url, "pyllmrouter_followed_requests_total") == before


def _events(url: str, body: dict) -> tuple[list, list]:
    """A stream's events normalised (as the fuzz compares them), and its progress reports whole."""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_bytes())
    progress = [json.loads(line[6:]).get("prompt_progress") for line in raw.split(b"\n")
                if line.startswith(b"data: {")]
    return wire.normalise(raw), [p for p in progress if p]


@pytest.mark.parametrize("progress", [True, False])
def test_each_event_of_a_stream_is_sent_once(servers, progress):
    """The stream's first event included (before, the native path wrote the handler's first
    chunk with the head, then again as next() gave it: with ``return_progress``, the
    first ``prompt_progress`` came twice, which llama.cpp's own ``test_return_progress``
    fails on)."""
    body = {"model": wire.MODEL, "messages": [{"role": "user", "content": "a story " * 40}], "max_tokens": 4,
            "stream": True, "return_progress": progress, "cache_prompt": False}
    (native, reports), (relay, _) = _events(servers["native"], body), _events(servers["relay"], body)
    assert native == relay
    if progress:
        seen = [json.dumps({k: v for k, v in p.items() if k != "time_ms"}, sort_keys=True) for p in reports]
        assert seen and len(seen) == len(set(seen)), seen


@contextlib.contextmanager
def _in_process(router, loop: str):
    """``router``'s app as serve runs it, on uvicorn's ``loop`` ("asyncio" or "uvloop")."""
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(router), host="127.0.0.1", port=port, log_level="critical",
                                        http=HTTP_PROTOCOL, proxy_headers=False, loop=loop))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    wait_for(lambda: srv.started, 30, "the server")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        t.join(30)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_client_gone_while_its_model_was_leased_never_gets_its_answer_on_another_connection(tiny, loop):
    """The descriptor handed to the worker is the connection's at the hand-over, not at the
    request's arrival: a client that leaves while its request waits (here, the debug delay
    after the lease, llama-server's LLAMA_SERVER_DEBUG_FAKE_TIMING), and new connections
    that get its number, receive nothing they did not ask for (before, on asyncio's loop,
    one of them got what the worker wrote for the first client; on uvloop's, whose socket
    object forgets a closed descriptor, the hand-over raised instead)."""
    spec = ModelSpec(tiny["tiny-llama"], ("-c", "1024", "-np", "2"))
    with Router([ModelConfig("m", spec)], inventory=EmulatedInventory({"GPU0": 4 << 30}), margin=0,
                debug_fake_timing=1.0) as router, _in_process(router, loop) as url:
        router.load("m")
        with connect(url) as sock:
            sock.sendall(words(2))
            own = tokens(Reader(sock).response())  # what a connection's own request gets
        for _ in range(2):
            gone = connect(url)
            gone.sendall(words(7))
            time.sleep(0.2)  # leased, waiting
            gone.close()
            time.sleep(0.2)  # the server has seen it leave and closed its socket: its number is free
            others = [connect(url) for _ in range(3)]
            time.sleep(1.5)  # the hand-over is past
            for sock in others:
                sock.settimeout(0.5)
                try:
                    got = sock.recv(65536)
                except (socket.timeout, TimeoutError):
                    got = b""
                assert got == b"", f"a connection got an answer it never asked for: {got[:80]!r}"
            for sock in others:  # and each still gets its own
                sock.settimeout(30)
                sock.sendall(words(2))
                assert tokens(Reader(sock).response()) == own
                sock.close()
        # the departed clients' leases released (and the last answer's, once its worker's done
        # message is in: the client may read the answer before the router hears of it)
        wait_for(lambda: router.status()["models"]["m"]["leases"] == 0, 10, "every lease released")


def _stalled(url: str, model: str) -> socket.socket:
    """A client that asks for a long stream of large events and never reads it."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, before the handshake
    sock.connect((host, int(port)))
    sock.sendall(request("POST", "/v1/chat/completions", {  # about 6 KiB an event: 9 MB, past the kernel's buffers
        "model": model, "messages": [{"role": "user", "content": "a story"}], "max_tokens": 1500, "stream": True,
        "logprobs": True, "top_logprobs": 100}))
    return sock


def test_clients_that_stop_reading_hold_no_slot_and_no_unload_past_the_write_timeout(tiny, tmp_path):
    """One slot (the gate lets twice that into llama.cpp): two clients that never read a
    stream of large events, larger than the kernel's buffers.  A third request is answered
    once their generations end, as llama-server answers it (before: never, as the gate
    stayed theirs until every chunk was written), and an unload is held no longer than
    llama-server's ``--timeout`` (3 s here: a write that makes no progress that long ends
    the request as a departed client's)."""
    preset = tmp_path / "models.ini"
    story = scripted.write_scripted(tmp_path / "story.gguf", scripted.THINK_TEMPLATE, scripted.STORY_SCRIPT, loop=True)
    preset.write_text(f"[one]\nmodel = {story}\nc = 4096\nnp = 1\ntimeout = 3\nload-on-startup = true\n")
    proc, url = _serve(str(preset))
    stalled = []
    try:
        assert httpx.post(url + "/tokenize", json={"model": "one", "content": "warm"}, timeout=120).status_code == 200
        stalled = [_stalled(url, "one") for _ in range(2)]
        time.sleep(1)  # the first under way, its buffers full
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/completions", json={"model": "one", "prompt": "hi", "max_tokens": 4}, timeout=20)
        answered = time.monotonic() - t0  # the second stream's generation comes first (its turn in llama.cpp)
        assert r.status_code == 200 and answered < 10, answered
        t0 = time.monotonic()
        r = httpx.post(url + "/models/unload", json={"model": "one"}, timeout=120)
        unloaded = time.monotonic() - t0
        assert r.status_code == 200 and r.json().get("success") is True, r.text
        assert unloaded < 3 + 6, unloaded
        print(f"third request answered in {answered:.2f} s, unload in {unloaded:.2f} s")
    finally:
        for sock in stalled:
            sock.close()
        proc.terminate()
        proc.wait(30)


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_an_end_covers_every_lease_before_it_whatever_order_the_datagrams_come_in(tiny):
    """The worker's end of a model's follows, on a real engine and channel: an end that
    reaches the worker before the hand-over of a lease taken before it still ends that
    lease's follow (its epoch is older), the sooner of two ends stands whatever their order,
    and a lease taken after the ends is followed (before, an end only covered the hand-overs
    that reached the worker before it)."""
    out = _run(f"""
        import asyncio, json, socket, threading, time
        from pyllmrouter import ModelSpec
        from pyllmrouter.engine.backend import native
        from pyllmrouter.engine.loader import load
        from pyllmrouter.router.workers.conduit import Conduit, channel

        engine = load(ModelSpec({str(tiny["tiny-llama"])!r}, ("-np", "1"), n_ctx=512))
        ours, theirs = channel()
        worker = native().Conduit(theirs.detach())
        worker.attach("m", engine)
        router = Conduit(ours, "w")
        listener = socket.create_server(("127.0.0.1", 0))
        body = json.dumps({{"model": "m", "content": "a b c"}}).encode()
        req = (b"POST /tokenize HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/json\\r\\n"
               b"Content-Length: %d\\r\\n\\r\\n" % len(body)) + body

        def header(epoch):
            return {{"model": "m", "method": "POST", "path": "/tokenize", "query": {{}}, "query_string": "",
                    "headers": {{"content-type": "application/json"}}, "extra": [], "keep_alive": True,
                    "follow": None if epoch is None else {{
                        "line": "POST /tokenize HTTP/1.1", "named": "m", "ms": 1000, "headers": {{"host": "x"}},
                        "max_body": 65536, "idle_ms": 3000, "epoch": epoch}}}}

        def client(sock, n):  # sends the next request as each answer comes
            got = b""
            for i in range(n):
                while got.count(b"\\r\\n\\r\\n") <= i or not got.rstrip().endswith(b"}}"):
                    got += sock.recv(65536)
                if i + 1 < n:
                    sock.sendall(req)

        async def served(epoch):
            c = socket.create_connection(listener.getsockname())
            s, _ = listener.accept()
            s.setblocking(False)
            t = threading.Thread(target=client, args=(c, 2), daemon=True)
            t.start()
            fut = router.hand(header(epoch), body, s.fileno())
            done = await asyncio.wait_for(fut, 30)
            time.sleep(0.1)
            left = s.recv(65536, socket.MSG_PEEK | socket.MSG_DONTWAIT) if done.answers and len(done.answers) == 1 else b""
            c.close(); s.close()
            return len(done.answers or ()), left.startswith(b"POST")

        async def main():
            out = {{}}
            out["bind"] = await served(None)  # binds the loop: ends go out from now on
            router.end_follows("m", 2, time.monotonic())  # the sooner end, first
            router.end_follows("m", 1, time.monotonic() + 60)
            await asyncio.sleep(0.2)  # both at the worker before the next hand-overs
            out["before_0"] = await served(0)
            out["before_1"] = await served(1)
            out["after"] = await served(2)
            return out

        print(json.dumps(asyncio.run(main())), flush=True)
        worker.close()
        import os; os._exit(0)
    """)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["before_0"] == [1, True], result  # not followed: the second request left for the router
    assert result["before_1"] == [1, True], result
    assert result["after"] == [2, False], result  # followed: the worker answered both


def test_an_end_the_channel_has_no_room_for_is_sent_once_it_has():
    """A worker that stops reading its channel for a while: the router's end waits for room
    and goes then (before, it was dropped, and the follows it was for went on)."""
    import asyncio

    from pyllmrouter.router.workers.conduit import Conduit, channel

    ours, theirs = channel()
    router = Conduit(ours, "w")
    spare = socket.socket()

    async def main() -> list[dict]:
        router.hand({"model": "m"}, b"x" * 1000, spare.fileno())  # binds the loop
        while router.hand({"model": "m"}, b"x" * 60000, spare.fileno()) is not None:
            pass  # until the channel is full
        router.end_follows("m", 7, time.monotonic())
        await asyncio.sleep(0.1)
        ends = []
        theirs.setblocking(False)
        deadline = time.monotonic() + 10
        while not ends and time.monotonic() < deadline:
            try:
                msg, fds, _, _ = socket.recv_fds(theirs, 300000, 4)
            except BlockingIOError:
                await asyncio.sleep(0.01)
                continue
            for fd in fds:
                os.close(fd)
            if msg.startswith(b'{"end"'):
                ends.append(json.loads(msg))
        return ends

    ends = asyncio.run(main())
    router.close()
    spare.close()
    assert ends and ends[0]["end"] == "m" and ends[0]["epoch"] == 7, ends


def test_the_wire_fuzz_finds_the_native_path_answering_as_the_relay(servers):
    """A short seeded run of the differential fuzz (pyllmrouter/tools/wire.py; the long run is
    bench/wire_fuzz.py): every case's answers the same on both paths to any correct client
    (statuses, header fields, bodies, their number and order, how the connection ended),
    cases of every kind run, and /health answering fast meanwhile."""
    failures, slowest, kinds = [], 0.0, collections.Counter()
    for i, case in enumerate(wire.cases(FUZZ_SEED, FUZZ_CASES)):
        kinds[case.kind] += 1
        diff = wire.compare(wire.play(servers["native"], case), wire.play(servers["relay"], case), case)
        if diff:
            failures.append(f"case {i} ({case.kind}: {case.text}): {diff}")
        for url in servers.values():
            t0 = time.monotonic()
            assert httpx.get(url + "/health", timeout=10).status_code == 200
            slowest = max(slowest, time.monotonic() - t0)
    assert not failures, "\n".join(failures)
    assert set(kinds) == set(wire.CLASSES), kinds
    assert slowest < 2.0, slowest
