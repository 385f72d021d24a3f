"""The HTTP server on loopback, driven by the real openai client and raw HTTP."""

from __future__ import annotations

import base64
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from pyllmrouter import ModelSpec, probe
from pyllmrouter.config import ModelConfig
from pyllmrouter.devices import EmulatedInventory
from pyllmrouter.tools.loopback import free_port, wait_healthy
from pyllmrouter.router.api import Router
from test_live import serving

pytestmark = pytest.mark.slow  # a real server and worker processes

KEY = "s3cret"
HI = [{"role": "user", "content": "hi"}]


SHARE_PROBE_CACHE = True


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory, module_cache):
    broken = tmp_path_factory.mktemp("bad") / "broken.gguf"
    data = tiny["tiny-llama"].read_bytes()
    broken.write_bytes(data)  # whole while the router checks it, cut short below: its load fails
    # a serves one request at a time through llama_cpp's streaming (slow enough to stay busy)
    a, b = ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=2048), ModelSpec(tiny["tiny-moe"], n_ctx=512)
    gpu0 = max(probe(a).total, probe(b).total) + 1
    models = [
        ModelConfig("a", a, aliases=("alpha",), devices=("GPU0",)),
        ModelConfig("b", b, devices=("GPU0",)),
        ModelConfig("e", ModelSpec(tiny["tiny-bert"], ("--embedding",), n_ctx=256), devices=("GPU1",)),
        ModelConfig("broken", ModelSpec(broken, n_ctx=512), devices=("GPU1",)),
        ModelConfig("huge", ModelSpec(tiny["tiny-llama"], n_ctx=1 << 20), devices=("GPU1",)),
    ]
    router = Router(models, inventory=EmulatedInventory({"GPU0": gpu0, "GPU1": 1 << 30}), margin=0,
                    queue_timeout=4.0, turn=0.2)
    broken.write_bytes(data[: len(data) // 3])
    with serving(router, api_key=KEY, max_body=64 * 1024) as base:
        yield base, router


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server[0], headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def test_openai_chat_completion_and_embedding(client):
    out = client.chat.completions.create(model="a", messages=HI, max_tokens=4, temperature=0)
    assert out.model == "a" and out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens >= 1
    text = client.completions.create(model="alpha", prompt="hello", max_tokens=4)  # alias
    assert text.choices[0].text is not None
    emb = client.embeddings.create(model="e", input=["hello world", "the model"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == 64


def test_openai_streaming(client):
    chunks = list(client.chat.completions.create(model="a", messages=HI, max_tokens=6, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
    # greedy: the same tokens every run (sampled ones can end on a partial UTF-8 character,
    # which llama.cpp holds back until the final event)
    pieces = list(client.completions.create(model="a", prompt="x", max_tokens=6, stream=True, temperature=0))
    assert len(pieces) >= 2


def test_streamed_usage_matches_the_unstreamed_request(client):
    kw = dict(model="b", prompt="the usage of", max_tokens=7, temperature=0)  # b: the batched path
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.usage is not None  # llama-server's usage chunk
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    finish = next(c for c in reversed(chunks) if c.choices and c.choices[0].finish_reason)
    assert finish.choices[0].finish_reason == whole.choices[0].finish_reason
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_a_client_that_leaves_a_stream_stops_generation_and_frees_the_model(server, http):
    url, router = server
    # a's one slot of 2048 tokens: a generation long enough that stopping it shows
    body = dict(model="a", prompt="go", max_tokens=2000, temperature=0, logit_bias={"2": -100, "4": -100})
    http.post("/models/load", json={"model": "a"}).raise_for_status()
    t0 = time.perf_counter()
    assert http.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 2000
    whole = time.perf_counter() - t0  # generating all 2000 tokens, the model loaded
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert router.status()["models"]["a"]["leases"] == 1
    t0 = time.perf_counter()  # the connection is closed: the slot and the lease are freed
    while router.status()["models"]["a"]["leases"] and time.perf_counter() - t0 < whole:
        time.sleep(0.005)
    assert router.status()["models"]["a"]["leases"] == 0
    assert time.perf_counter() - t0 < whole / 4, (time.perf_counter() - t0, whole)


def test_model_lists(client, http):
    ids = {m.id for m in client.models.list()}
    assert ids == {"a", "b", "e", "broken", "huge"}
    data = http.get("/models").json()["data"]
    entry = next(m for m in data if m["id"] == "e")
    assert entry["status"]["value"] in ("unloaded", "loading", "loaded")
    assert entry["aliases"] == [] and next(m for m in data if m["id"] == "a")["aliases"] == ["alpha"]


def test_load_unload_and_per_model_memory(http):
    assert http.post("/models/load", json={"model": "e"}).json() == {"success": True}
    entry = next(m for m in http.get("/models").json()["data"] if m["id"] == "e")
    assert entry["status"]["value"] == "loaded" and entry["memory"]["devices"] == ["GPU1"]
    assert entry["memory"]["requirement"]["GPU1"]["GPU1"] > 0
    parts = entry["memory"]["components"]["GPU1"]["CPU"]  # named, per pool the worker sees
    assert sum(parts.values()) == entry["memory"]["requirement"]["GPU1"]["GPU1"] and parts["weights"] > 0
    assert entry["memory"]["fit"] is None  # loaded as given
    devices = http.get("/devices").json()
    assert devices["devices"]["GPU1"]["held"] >= entry["memory"]["requirement"]["GPU1"]["GPU1"]
    assert http.post("/models/unload", json={"model": "e"}).json() == {"success": True}
    entry = next(m for m in http.get("/models").json()["data"] if m["id"] == "e")
    assert entry["status"]["value"] == "unloaded"


def test_props_health_metrics(http, server):
    assert httpx.get(server[0] + "/health").json() == {"status": "ok"}  # no key needed
    assert http.get("/props").json()["role"] == "router"
    props = http.get("/props", params={"model": "a"}).json()  # llama-server's, from a's engine
    assert props["default_generation_settings"]["n_ctx"] == 2048 and props["model_alias"] == "a"
    assert props["model_path"].endswith("tiny-llama.gguf")
    http.post("/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 2})
    text = http.get("/metrics").text
    assert "pyllmrouter_loads_total" in text and 'pyllmrouter_device_capacity_bytes{device="GPU0"}' in text
    assert 'pyllmrouter_request_seconds_count{endpoint="/v1/completions",model="a",status="200"}' in text
    assert "pyllmrouter_queue_wait_seconds_count" in text
    slots = http.get("/slots", params={"model": "a"}).json()  # per-model GET endpoints
    assert len(slots) == 1 and slots[0]["n_ctx"] == 2048
    assert http.get("/slots").status_code == 400  # which model's?


def test_auth(server):
    base = server[0]
    assert httpx.get(base + "/v1/models").status_code == 401
    assert httpx.get(base + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(base + "/v1/models", headers={"X-Api-Key": KEY}).status_code == 200
    bad = openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


@pytest.mark.parametrize("body, status, fragment", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "'model' is required"),  # an array names no model (?model= may)
    (json.dumps({"messages": HI}).encode(), 400, "'model' is required"),
    (json.dumps({"model": "a", "messages": "hi"}).encode(), 400, "'messages'"),  # llama.cpp's checks
    (json.dumps({"model": "a", "messages": HI, "n": 0}).encode(), 400, "'n'"),
    (json.dumps({"model": "zzz", "messages": HI}).encode(), 404, "unknown model 'zzz'"),
])
def test_bad_requests_get_openai_errors(http, body, status, fragment):
    r = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status
    assert fragment in r.json()["error"]["message"]


@pytest.mark.parametrize("model", ["a", "b"])  # one slot, and several
def test_a_stream_refused_before_its_first_chunk_gets_an_error_status(client, model):
    with pytest.raises(openai.BadRequestError, match="exceeds the available context size"):
        list(client.completions.create(model=model, prompt="hello " * 3000, max_tokens=2, stream=True))
    assert list(client.completions.create(model=model, prompt="x", max_tokens=2, stream=True))


def test_text_parts_of_a_message_read_as_its_text(client):
    kw = dict(model="b", max_tokens=6, temperature=0)
    plain = client.chat.completions.create(messages=[{"role": "user", "content": "hi there"}], **kw)
    parts = client.chat.completions.create(messages=[{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}], **kw)
    joined = client.chat.completions.create(messages=[{"role": "user", "content": "hi\nthere"}], **kw)
    assert parts.choices[0].message.content == joined.choices[0].message.content
    assert parts.usage.prompt_tokens == joined.usage.prompt_tokens != plain.usage.prompt_tokens
    with pytest.raises(openai.APIStatusError, match="image input is not supported"):  # no projector
        client.chat.completions.create(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}], **kw)


def test_embeddings_as_floats_or_base64(client, http):
    body = {"model": "e", "input": ["a b", "c"]}
    floats = [d["embedding"] for d in http.post("/v1/embeddings", json=body).json()["data"]]
    packed = [d["embedding"] for d in
              http.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()["data"]]
    assert all(isinstance(p, str) for p in packed)
    unpacked = [list(struct.unpack(f"<{len(f)}f", base64.b64decode(p))) for f, p in zip(floats, packed)]
    assert unpacked == [pytest.approx(f, rel=1e-6) for f in floats]
    got = client.embeddings.create(model="e", input=["a b", "c"])  # the openai client asks for base64 itself
    assert [d.embedding for d in got.data] == [pytest.approx(f, rel=1e-6) for f in floats]
    r = http.post("/v1/embeddings", json={**body, "encoding_format": "int8"})
    assert r.status_code == 400 and "float or base64" in r.json()["error"]["message"]


def test_one_model_by_id_or_alias(client):
    assert client.models.retrieve("alpha").id == "a"
    assert client.models.retrieve("b").id == "b"
    with pytest.raises(openai.NotFoundError, match="unknown model 'nope'"):
        client.models.retrieve("nope")


def test_wrong_endpoint_for_the_model_is_llama_servers_error(client):
    with pytest.raises(openai.APIStatusError, match="does not support logits"):  # as llama-server answers
        client.completions.create(model="e", prompt="x")


def test_unknown_model_through_openai(client):
    with pytest.raises(openai.NotFoundError, match="unknown model"):
        client.chat.completions.create(model="nope", messages=HI)


def test_body_limit(http):
    r = http.post("/v1/completions", json={"model": "a", "prompt": "x" * 100_000})
    assert r.status_code == 413


def test_model_that_never_fits_is_507_with_figures(http):
    r = http.post("/v1/completions", json={"model": "huge", "prompt": "x"})
    assert r.status_code == 507
    err = r.json()["error"]
    assert err["device"] == "GPU1" and err["needed_bytes"] > err["capacity_bytes"]


def test_corrupt_model_is_500_and_harms_nothing(http):
    http.post("/models/load", json={"model": "e"})
    r = http.post("/v1/completions", json={"model": "broken", "prompt": "x"})
    assert r.status_code == 500 and "not within the file bounds" in r.json()["error"]["message"]
    entry = next(m for m in http.get("/models").json()["data"] if m["id"] == "e")
    assert entry["status"]["value"] == "loaded"


def test_autoload_off_per_request(http):
    http.post("/models/unload", json={"model": "b"})
    r = http.post("/v1/completions?autoload=false", json={"model": "b", "prompt": "x"})
    assert r.status_code == 400 and "autoload is off" in r.json()["error"]["message"]


def test_queue_timeout_is_503_with_retry_after(server, http, client):
    # a holds GPU0 with a stream in flight whose end nobody has read; b (also GPU0)
    # cannot be admitted in time
    body = json.dumps({"model": "a", "prompt": "hello", "max_tokens": 8, "stream": True}).encode()
    _, stream = server[1].call("a", "POST", "/v1/completions", body)
    r = http.post("/v1/completions", json={"model": "b", "prompt": "x"})
    assert r.status_code == 503 and r.headers["Retry-After"]
    stream.close()
    deadline = time.monotonic() + 20
    while server[1].status()["models"]["a"]["leases"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server[1].status()["models"]["a"]["leases"] == 0  # the client left: generation stopped


def test_concurrent_clients_on_models_that_evict_each_other(client, server):
    results, errors = [], []

    def go(model):
        try:
            if model == "e":
                results.append(client.embeddings.create(model=model, input="x"))
            else:
                results.append(client.completions.create(model=model, prompt="x", max_tokens=3))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=go, args=(m,)) for m in ("a", "b", "e") for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    # a and b share GPU0 one at a time, in turns within the queue timeout
    assert not errors and len(results) == 6
    server[1].scheduler.check_invariant()


def test_serve_cli_drains_on_sigterm_and_leaves_no_process(tiny, tmp_path):
    preset = tmp_path / "p.ini"
    preset.write_text(f"[m]\nmodel = {tiny['tiny-llama']}\nc = 1024\n")
    port = free_port()
    env = dict(os.environ, LLAMA_API_KEY="k", LLAMA_ARG_MODELS_MAX="1", LLAMA_ARG_PORT=str(port))
    proc = subprocess.Popen([sys.executable, "-m", "pyllmrouter.cli", "serve", "--models-preset", str(preset),
                             "--emulate-devices", "GPU0=1GiB", "--models-memory-margin", "0"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"  # the port comes from LLAMA_ARG_PORT
    try:
        wait_healthy(base, proc)
        h = {"X-Api-Key": "k"}
        assert httpx.get(base + "/props", headers=h).json()["max_models"] == 1  # from LLAMA_ARG_MODELS_MAX
        lines = []
        watcher = httpx.stream("GET", base + "/models/sse", headers=h, timeout=60)  # as the page listens
        events = watcher.__enter__()
        with httpx.stream("POST", base + "/v1/completions", headers=h, timeout=60,
                          json={"model": "m", "prompt": "hello", "max_tokens": 200, "stream": True}) as r:
            it = r.iter_lines()
            lines.append(next(it))
            pids = [w["pid"] for w in httpx.get(base + "/devices", headers=h).json()["workers"]]
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            lines += list(it)
        lines = [line for line in lines if line]
        assert len(lines) > 2 and lines[-1] == "data: [DONE]"  # the request in flight finished
        list(events.iter_lines())  # the event stream ends too: it does not hold the shutdown
        watcher.__exit__(None, None, None)
        assert proc.wait(60) == 0
        assert time.monotonic() - t0 < 15  # not the 30 s drain limit
        time.sleep(0.5)
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_client_that_leaves_while_its_model_waits_changes_nothing(server, http):
    """a and b cannot share GPU0: a client asks for b while a is busy and disconnects
    before a's request ends; then nothing is evicted, nothing loaded."""
    url, router = server
    http.post("/models/load", json={"model": "a"}).raise_for_status()
    body = json.dumps({"model": "a", "prompt": "hello", "max_tokens": 4, "stream": True}).encode()
    _, stream = router.call("a", "POST", "/v1/completions", body)  # a stays busy until closed
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=1.0) as c:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            c.post("/v1/completions", json={"model": "b", "prompt": "x", "max_tokens": 2})
    time.sleep(0.3)
    seen = len(router.scheduler.events)
    stream.close()
    time.sleep(1.0)
    st = router.status()["models"]
    assert st["a"]["state"] == "loaded" and st["b"]["state"] == "unloaded" and st["a"]["leases"] == 0
    assert [(what, name) for _, what, name, _ in list(router.scheduler.events)[seen:]] == []


def test_serve_listens_on_every_address_of_host(tiny, tmp_path, monkeypatch):
    """--host 127.0.0.1,::1 listens on both, as llama-server does (the command line wins
    over LLAMA_ARG_HOST); an address that cannot be had stops serve, naming it."""
    import socket

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe6:
            probe6.bind(("::1", 0))
    except OSError:
        pytest.skip("IPv6 loopback is unavailable")
    from pyllmrouter.tools.loopback import start_serve

    preset = tmp_path / "p.ini"
    preset.write_text(f"[a]\nmodel = {tiny['tiny-llama']}\nc = 256\n")
    monkeypatch.setenv("LLAMA_ARG_HOST", "192.0.2.1")  # not this machine's: the command line must win
    proc, base = start_serve(["--models-preset", str(preset), "--no-models-cache", "--host", "127.0.0.1,::1",
                              "--emulate-devices", "GPU0=1GiB", "--models-memory-margin", "0"])
    try:
        port = base.rsplit(":", 1)[1]
        for host in ("127.0.0.1", "[::1]"):
            r = httpx.post(f"http://{host}:{port}/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 2},
                           timeout=60)
            assert r.status_code == 200, (host, r.text)
    finally:
        proc.terminate()
        proc.wait(30)
    out = subprocess.run([sys.executable, "-m", "pyllmrouter.cli", "serve", "--models-preset", str(preset),
                          "--no-models-cache", "--host", "127.0.0.1,192.0.2.1", "--port", str(free_port())],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "192.0.2.1" in out.stderr
