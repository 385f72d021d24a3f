"""pyllmrouter on a real local Ray cluster: a head and three nodes, each node with one
emulated device of a different size (its own PYLLMROUTER_EMULATE_DEVICES), the Serve
application deployed by ``pyllmrouter.ray.deploy``, real HTTP through the ingress.

Models (bytes as the probe measures them; the node sizes below are chosen around them):
a, b ~6 MiB; c, d ~15 MiB; big, big2 ~51 MiB (only the 80 MiB node holds one, not both);
huge ~195 MiB (no node holds it).  The node-removal test runs last but one: it takes a
node away; the last redeploys on a port in use.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import httpx
import pytest

ray = pytest.importorskip("ray")

from raylocal import deployed  # noqa: E402

pytestmark = [pytest.mark.slow]  # a Ray cluster, Serve and worker processes

SIZES = {"small": 24, "medium": 40, "big": 80}  # MiB of each node's one device
MODELS = {"a": ("tiny-llama", 2048), "b": ("tiny-moe", 2048), "c": ("tiny-llama", 8192),
          "d": ("tiny-moe", 8192), "big": ("tiny-llama", 32768), "big2": ("tiny-moe", 32768),
          "huge": ("tiny-llama", 131072)}


class Client:
    def __init__(self, base: str):
        self.base = base

    def call(self, method: str, path: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict, bytes]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data, {"content-type": "application/json"}, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def json(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict, dict]:
        status, headers, data = self.call(method, path, body)
        return status, headers, json.loads(data)

    def complete(self, model: str, max_tokens: int = 4) -> tuple[int, str | None, dict]:
        status, headers, body = self.json("POST", "/v1/completions",
                                          {"model": model, "prompt": "hi", "max_tokens": max_tokens})
        return status, headers.get("x-pyllmrouter-node"), body


@pytest.fixture(scope="module")
def cluster(tiny, tmp_path_factory):
    with deployed(tmp_path_factory.mktemp("ray"), tiny, MODELS, list(SIZES.values()),
                  queue_timeout=60) as (c, port, nodes, _, preset):
        client = Client(f"http://127.0.0.1:{port}")
        ids = {label: node.node_id for label, node in zip(SIZES, nodes)}
        _wait_measured(client, set(ids.values()))
        yield c, client, ids, dict(zip(SIZES, nodes)), preset


STATS_PERIOD = 1.0  # seconds: how often the request router reads each replica's statistics (deploy's default)


def _wait_measured(client: Client, nodes: set[str], timeout: float = 180) -> None:
    """Until every node answers /models with every model measured, and then until the
    request router has read every replica's statistics since (they are a period old at
    worst: a node that has just measured would otherwise still rank as unmeasured)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, _, view = client.json("GET", "/models")
        if status == 200 and set(view["nodes"]) >= nodes and view["data"] and all(
                all(e.get("memory", {}).get("requirement") for e in m["nodes"].values()) and set(m["nodes"]) >= nodes
                for m in view["data"]):
            time.sleep(2 * STATS_PERIOD)
            return
        time.sleep(0.5)
    raise AssertionError(f"the cluster did not measure its models in {timeout} s: {view}")


def _where(client: Client) -> dict[str, list[str]]:
    _, _, view = client.json("GET", "/models")
    return {m["id"]: m["loaded_on"] for m in view["data"]}


def test_models_are_placed_by_memory_and_no_node_is_oversubscribed(cluster):
    c, client, ids, _, _ = cluster
    for model in ("a", "b", "c", "d"):
        status, node, body = client.complete(model)
        assert status == 200, body  # at once: the router counts the load it routed (ranking.assume_routed)
    where = _where(client)
    # a, b fill the small node most tightly; c and d no longer fit there, the medium node is next
    assert where["a"] == where["b"] == [ids["small"]]
    assert where["c"] == where["d"] == [ids["medium"]]
    _, _, devices = client.json("GET", "/devices")
    for node, view in devices["nodes"].items():
        for dev in view["devices"].values():
            assert dev["held"] <= dev["capacity"], (node, dev)
    _, _, view = client.json("GET", "/models")
    assert all(e["loads"] <= 1 for m in view["data"] for e in m["nodes"].values())  # nothing loaded twice


def test_a_model_that_fits_only_on_the_big_node_goes_there(cluster):
    _, client, ids, _, _ = cluster
    status, node, body = client.complete("big")
    assert status == 200, body
    assert node == ids["big"] and _where(client)["big"] == [ids["big"]]


def test_a_model_that_fits_nowhere_gets_507_with_every_nodes_figures(cluster):
    _, client, ids, _, _ = cluster
    status, _, body = client.complete("huge")
    assert status == 507, body
    err = body["error"]
    assert err["code"] == "model_too_large" and "huge" in err["message"]
    assert set(err["nodes"]) == set(ids.values())
    for node, figures in err["nodes"].items():
        assert figures["needed_bytes"] > figures["capacity_bytes"] == SIZES[
            next(k for k, v in ids.items() if v == node)] << 20
    assert "huge" not in {m for m, on in _where(client).items() if on}


def test_bad_requests_get_clear_errors_and_the_openai_list_shows_every_model(cluster):
    _, client, _, _, _ = cluster
    status, _, body = client.complete("no-such-model")
    assert status == 404 and "no-such-model" in body["error"]["message"]
    req = urllib.request.Request(client.base + "/v1/completions", b"{not json", {"content-type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=30)
        raise AssertionError("bad JSON was accepted")
    except urllib.error.HTTPError as e:
        assert e.code == 400 and json.loads(e.read())["error"]["code"] == "invalid_json"
    status, _, listing = client.json("GET", "/v1/models")
    assert status == 200 and {m["id"] for m in listing["data"]} == set(MODELS)


def test_a_busy_model_is_never_evicted(cluster):
    """'big' streams on the big node; 'big2' fits only there, and only without 'big': it
    waits for the stream to end, then evicts the idle 'big'."""
    _, client, ids, _, _ = cluster
    status, node, body = client.complete("big")  # loaded (it may be already: tests share the cluster)
    assert status == 200 and node == ids["big"], body
    assert _where(client)["big"] == [ids["big"]]
    done: dict = {}

    def stream():
        status, _, data = client.call("POST", "/v1/completions", {"model": "big", "prompt": "hi", "max_tokens": 400,
                                                                  "stream": True, "ignore_eos": True})
        done["stream"] = (status, data.decode(), time.monotonic())

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(0.5)  # under way
    status, node, body = client.complete("big2")
    answered = time.monotonic()
    t.join(120)
    status_stream, text, ended = done["stream"]
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert status_stream == 200 and not any("error" in e for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length" and text.rstrip().endswith("data: [DONE]")
    assert status == 200 and node == ids["big"], body
    assert answered > ended  # it waited for the stream rather than evict a busy model
    where = _where(client)
    assert where["big2"] == [ids["big"]] and where["big"] == []  # then 'big', idle, gave way


def test_a_client_that_leaves_a_stream_stops_its_generation_on_the_node(cluster):
    """The ingress cancels the node's reply when its client leaves: the node's app sees
    the disconnect, the generation stops and the model's lease is freed, well before the
    whole generation would have ended."""
    _, client, ids, _, _ = cluster
    body = {"model": "d", "prompt": "hi", "max_tokens": 2000, "ignore_eos": True}
    t0 = time.monotonic()
    status, _, whole = client.json("POST", "/v1/completions", body)
    whole_s = time.monotonic() - t0
    assert status == 200 and whole["usage"]["completion_tokens"] == 2000, whole["usage"]

    def in_flight() -> int:  # on any node (on a loaded machine d may have been moved since)
        _, _, view = client.json("GET", "/models")
        return sum(n["in_flight"] for n in next(m for m in view["data"] if m["id"] == "d")["nodes"].values())

    req = urllib.request.Request(client.base + "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                                 {"content-type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.readline().startswith(b"data: ")
        assert in_flight() == 1
    t0 = time.monotonic()  # the connection is closed
    while in_flight() and time.monotonic() - t0 < whole_s:
        time.sleep(0.01)
    left = time.monotonic() - t0
    assert in_flight() == 0 and left < whole_s / 2, (left, whole_s)


def test_a_client_that_leaves_a_whole_request_stops_its_generation_on_the_node(cluster):
    """Not streamed: the ingress waits for the node's whole reply; a client that leaves
    meanwhile cancels it there, and the model's slot is idle within 2 s."""
    _, client, ids, _, _ = cluster
    body = {"model": "d", "prompt": "hi", "max_tokens": 6000, "ignore_eos": True}

    def in_flight() -> int:  # on any node (on a loaded machine d may have been moved since)
        _, _, view = client.json("GET", "/models")
        return sum(n["in_flight"] for n in next(m for m in view["data"] if m["id"] == "d")["nodes"].values())

    sock = socket.create_connection(("127.0.0.1", int(client.base.rsplit(":", 1)[1])))
    raw = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
    t0 = time.monotonic()
    while not in_flight() and time.monotonic() - t0 < 30:
        time.sleep(0.01)
    assert in_flight() == 1  # generating, the reply not begun
    sock.close()  # the client leaves
    t0 = time.monotonic()
    while in_flight() and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert in_flight() == 0 and time.monotonic() - t0 < 2


def test_a_body_over_the_limit_is_refused_at_the_ingress_chunked_too(cluster):
    _, client, _, _, _ = cluster

    def chunks():
        for _ in range(64):  # 64 MiB, no Content-Length
            yield b"x" * (1 << 20)

    r = httpx.post(client.base + "/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_a_removed_node_loses_its_models_and_the_next_request_loads_elsewhere(cluster):
    c, client, ids, nodes, _ = cluster
    if not _where(client)["c"]:  # placed on medium by the first test, unless unloaded since
        assert client.complete("c")[0] == 200
    assert _where(client)["c"] == [ids["medium"]]  # the tightest node it fits on
    ingress = [a["Address"]["NodeID"] for a in ray._private.state.actors().values()
               if a["ActorClassName"].endswith("Ingress") and a["State"] == "ALIVE"]
    assert ingress == [c.head_node.node_id]  # it holds the connections: the node taken away holds none
    result: dict = {}
    started = threading.Event()

    def stream():  # as long as c's context allows
        body = {"model": "c", "prompt": "hi", "max_tokens": 8000, "stream": True, "ignore_eos": True}
        req = urllib.request.Request(client.base + "/v1/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                first = r.readline()
                started.set()
                result["reply"] = r.status, first + r.read()
        except Exception as e:
            result["reply"] = 0, repr(e).encode()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)  # the stream is under way on the medium node
    c.remove_node(nodes["medium"])
    t.join(120)
    status, data = result["reply"]
    text = data.decode(errors="replace")
    assert status == 200 and "died" in text and '"code": 502' in text, text  # a clear error ends the stream
    deadline = time.monotonic() + 60
    while True:  # the next request: loaded on a node still there, and answered
        status, node, body = client.complete("c")
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert status == 200, body
    assert node in (ids["small"], ids["big"])


def test_a_port_in_use_is_named_and_the_deploy_fails(cluster, capsys):
    """The ingress listens itself: a port another program holds fails the deploy with the
    reason (Serve's own error names only the deployment)."""
    from pyllmrouter import cli

    c, _, _, _, preset = cluster
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        rc = cli.main(["ray", "--models-preset", str(preset), "--models-memory-margin", "0",
                       "--queue-timeout", "60", "--port", str(port), "--address", c.address])
    err = capsys.readouterr().err
    assert rc == 1 and f"cannot listen on 127.0.0.1:{port}: Address already in use" in err, err
