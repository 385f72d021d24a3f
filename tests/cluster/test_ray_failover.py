"""A node lost under load on a real local Ray cluster (a head and three nodes of one
emulated 64 MiB device each): its raylet and every process under it SIGKILLed with
requests in every state on it, then a node started again in its place.

Models (bytes by the probe): a, b ~6 MiB (one slot each); big, big2, big3 ~51 MiB
(one per node, beside a and b).  Placement is best fit, so a, b and big share the
first node they are asked of.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray")

from pyllmrouter.ray import answer, failover  # noqa: E402
from pyllmrouter.tools.raynodes import kill_node, process_tree  # noqa: E402
from raylocal import deployed  # noqa: E402

pytestmark = [pytest.mark.slow]  # a Ray cluster, Serve and worker processes

NODE_MIB = 64  # each node's one emulated device
MODELS = {"a": ("tiny-llama", 2048), "b": ("tiny-moe", 2048), "big": ("tiny-llama", 32768),
          "big2": ("tiny-moe", 32768), "big3": ("tiny-llama", 32769)}


@pytest.fixture(scope="module")
def ray_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ray-failover")


@pytest.fixture(scope="module")
def cluster(tiny, ray_dir):
    # no heartbeat: a worker stopped on purpose (a machine that hangs before it dies) stays
    # stopped until its node is killed, however slow the machine running the test
    with deployed(ray_dir, tiny, MODELS, [NODE_MIB] * 3,
                  queue_timeout=120, serve_args=("--heartbeat", "0")) as (c, port, nodes, start_node, _):
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=180)
        _wait_measured(client, {n.node_id for n in nodes})
        yield c, client, nodes, start_node


def _wait_measured(client: httpx.Client, nodes: set[str], timeout: float = 180) -> None:
    """Until every node in ``nodes`` answers /models with every model measured, and the
    request router has read their statistics since (a period is 1 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        view = client.get("/models").json()
        if set(view["nodes"]) >= nodes and view["data"] and all(
                all(e.get("memory", {}).get("requirement") for n, e in m["nodes"].items() if n in nodes)
                and set(m["nodes"]) >= nodes for m in view["data"]):
            time.sleep(2.0)
            return
        time.sleep(0.5)
    raise AssertionError(f"the nodes did not measure their models in {timeout} s: {view}")


def _state(client: httpx.Client, node: str, model: str) -> str:
    view = client.get("/models", params={"node": node}).json()
    assert "data" in view, view
    return next(m["status"]["value"] for m in view["data"] if m["id"] == model)


def _in_flight(client: httpx.Client, node: str, model: str) -> int:
    view = client.get("/models", params={"node": node}).json()
    assert "data" in view, view
    return next(m["in_flight"] for m in view["data"] if m["id"] == model)


def _waiting(client: httpx.Client, node: str, model: str) -> int:
    view = client.get("/models", params={"node": node}).json()
    assert "data" in view, view
    return next(m["waiting"]["requests"] for m in view["data"] if m["id"] == model)


def _where(client: httpx.Client) -> dict[str, list[str]]:
    return {m["id"]: m["loaded_on"] for m in client.get("/models").json()["data"]}


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_a_node_killed_under_load_loses_nothing_that_had_not_begun(cluster):
    """On the killed node: a stream under way (it ends with an error event), a whole
    request running (502, it ran there), requests waiting for a's one slot behind the
    stream (whole and streamed) and a load in progress (big: the node's worker is stopped first,
    so the load cannot end before the kill).  Those that had not begun are
    answered by another node, sent on once, and the first within 10 s of the kill."""
    c, client, nodes, _ = cluster
    r = client.post("/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200
    x = r.headers["x-pyllmrouter-node"]
    r = client.post("/v1/completions", json={"model": "b", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-pyllmrouter-node"] == x  # best fit: beside a
    victim = next(n for n in nodes if n.node_id == x)
    killed = 0
    try:
        results: dict[str, tuple] = {}

        def send(key: str, body: dict, started: threading.Event | None = None, path: str = "/v1/completions") -> None:
            try:
                with client.stream("POST", path, json=body) as r:
                    chunks = r.iter_raw()
                    first = next(chunks, b"")
                    if started is not None:
                        started.set()
                    data = first + b"".join(chunks)
                    results[key] = (r.status_code, dict(r.headers), data.decode(errors="replace"), time.monotonic())
            except httpx.HTTPError as e:
                results[key] = (0, {}, repr(e), time.monotonic())

        long = {"prompt": "hi", "max_tokens": 6000, "ignore_eos": True}
        streaming = threading.Event()
        threads = [threading.Thread(target=send, args=("stream", {"model": "a", "stream": True, **long}, streaming))]
        threads[0].start()
        assert streaming.wait(60)
        threads.append(threading.Thread(target=send, args=("running", {"model": "b", **long})))
        threads[-1].start()
        deadline = time.monotonic() + 30
        while _in_flight(client, x, "b") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        # x's worker stopped (a machine that hangs before it dies): the load of big that
        # comes next stays under way, and nothing on x answers any more
        worker = next(w["pid"] for w in client.get("/devices", params={"node": x}).json()["workers"]
                      if w["devices"] == ["GPU0"])
        os.kill(worker, signal.SIGSTOP)
        for i in range(3):  # behind the stream in a's one slot
            threads.append(threading.Thread(target=send, args=(f"queued{i}", {"model": "a", "prompt": "hi",
                                                                               "max_tokens": 4})))
        threads.append(threading.Thread(target=send, args=("queued-stream", {"model": "a", "prompt": "hi",
                                                                              "max_tokens": 4, "stream": True})))
        threads.append(threading.Thread(target=send, args=("load", {"model": "big", "prompt": "hi", "max_tokens": 4})))
        for t in threads[2:]:
            t.start()
        deadline = time.monotonic() + 30
        # the four behind the stream wait for a's slot at x's router (a request that may be sent on
        # never waits in an engine's queue, where it would take its slot unseen)
        while (_waiting(client, x, "a") < 4 or _state(client, x, "big") != "loading") and time.monotonic() < deadline:
            time.sleep(0.005)
        assert _state(client, x, "big") == "loading" and _in_flight(client, x, "a") == 1 and _waiting(client, x, "a") == 4
        # a load asked of x as well (it joins the one under way there): not repeatable, never sent on
        threads.append(threading.Thread(target=send, args=("explicit-load", {"model": "big"}, None, "/models/load")))
        threads[-1].start()
        time.sleep(1.0)
        killed_at = time.monotonic()
        killed = kill_node(victim)
        assert killed > 1
        for t in threads:
            t.join(120)
    finally:  # a failure before the kill: the node goes all the same, so the next tests find the
        if not killed:  # world they would have found (no worker left stopped, one node fewer)
            kill_node(victim)
        c.remove_node(victim, allow_graceful=False)

    status, _, text, _ = results["stream"]
    assert status == 200 and "died" in text and _events(text)[-1]["error"]["code"] == 502, text[-300:]
    status, _, text, _ = results["running"]
    assert status == 502 and json.loads(text)["error"]["code"] == "node_died" and "running" in text, text
    status, _, text, _ = results["explicit-load"]
    assert status == 502 and json.loads(text)["error"]["code"] == "node_died", text
    assert x in text and "may have run" in text, text  # the node named, and what the client may assume
    moved = [k for k in results if k.startswith("queued") or k == "load"]
    for key in moved:
        status, headers, text, _ = results[key]
        assert status == 200, (key, text)
        assert headers["x-pyllmrouter-retried"] == x and headers["x-pyllmrouter-node"] != x, (key, headers)
        assert not any("error" in e for e in _events(text)), (key, text)
    assert min(results[k][3] for k in moved) - killed_at < 10
    where = _where(client)
    assert x not in {n for on in where.values() for n in on}
    assert where["big"] and where["a"]


def test_a_slot_action_goes_to_the_one_node_where_its_model_is_loaded(cluster):
    """Its model named by ?model= (no JSON body), as a node's app reads it; never another node."""
    _, client, _, _ = cluster
    r = client.post("/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 2})
    where = r.headers["x-pyllmrouter-node"]
    saved = client.post("/slots/0", params={"action": "erase", "model": "a"})
    assert saved.headers.get("x-pyllmrouter-node") == where, saved.text
    assert saved.status_code != 400 or "model" not in saved.text, saved.text
    # loaded nowhere: it goes where the model goes (and loads it there), as any request for it
    assert client.post("/models/unload", json={"model": "b"}).status_code == 200 and not _where(client)["b"]
    nowhere = client.post("/slots/0", params={"action": "erase", "model": "b"})
    # (llama.cpp's answer: 501 without --slot-save-path; the node is what this test is about)
    assert nowhere.status_code not in (400, 409) and \
        _where(client)["b"] == [nowhere.headers["x-pyllmrouter-node"]], nowhere.text


def test_a_request_that_may_have_run_is_not_tried_on_another_node_after_a_503(cluster):
    """A conversation's request waiting for a's one slot behind a stream; the node's worker
    dies under both: the turn is that node's to answer (a conversation's request is never
    sent on), and no other node runs it."""
    _, client, _, _ = cluster
    r = client.post("/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 2})
    x = r.headers["x-pyllmrouter-node"]
    results: dict = {}

    def send(key: str, body: dict, headers: dict) -> None:
        with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            results[key] = (r.status_code, dict(r.headers), b"".join(r.iter_raw()))

    long = threading.Thread(target=send, args=("stream", {"model": "a", "prompt": "hi", "max_tokens": 6000,
                                                          "ignore_eos": True, "stream": True}, {}))
    long.start()
    deadline = time.monotonic() + 30
    while _in_flight(client, x, "a") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    turn = threading.Thread(target=send, args=("turn", {"model": "a", "prompt": "hi", "max_tokens": 4},
                                               {"x-conversation-id": "c-503"}))
    turn.start()
    while _in_flight(client, x, "a") + _waiting(client, x, "a") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _in_flight(client, x, "a") == 1 and _waiting(client, x, "a") == 1  # the turn waits for a's slot
    worker = next(w["pid"] for w in client.get("/devices", params={"node": x}).json()["workers"]
                  if w["devices"] == ["GPU0"])
    os.kill(worker, signal.SIGKILL)
    turn.join(60)
    long.join(60)
    status, headers, _ = results["turn"]
    # it waited for the slot at x's router (it never reached the engine): x answers it (a new worker
    # loads a), or says why it cannot; no other node runs it
    assert status in (200, 503) and headers["x-pyllmrouter-node"] == x and "x-pyllmrouter-retried" not in headers, \
        (status, headers)


def test_a_replica_is_silent_after_two_readings_missed_at_their_longest():
    assert failover.silent_after(1.0) == 2 * (1.0 + 5.0)  # Serve gives a reading up after 5 s
    assert failover.silent_after(10.0) == 2 * (10.0 + 10.0)


def test_a_lost_node_is_left_out_for_its_hold_then_tried_again():
    now = [100.0]
    lost = failover.LostNodes(lambda: now[0], hold=30)
    lost.add({"x"})
    now[0] += 29
    lost.add({"y"})
    assert lost.now() == {"x", "y"}
    now[0] += 2
    assert lost.now() == {"y"}  # x's hold is over: a paused node is tried again


@pytest.mark.parametrize("began,retried,for_model,repeats,then", [
    (False, False, True, True, failover.RETRY),   # nothing sent yet: to another node
    (False, True, True, True, failover.FAIL),     # lost a second time: not sent on twice
    (True, False, True, True, failover.FAIL),     # it ran there (Started: it held a slot)
    (False, False, False, True, failover.FAIL),   # a question for one named node
    (False, False, True, False, failover.FAIL),   # a load, a slot action...: never twice
])
def test_only_a_repeatable_request_that_had_not_begun_is_sent_on_and_only_once(began, retried, for_model, repeats,
                                                                              then):
    assert failover.after_loss(began, retried, for_model, repeats) == then


def test_only_a_dead_actor_or_node_is_a_loss():
    from ray import exceptions as rx
    from ray.serve import exceptions as sx

    assert failover.kind_of(rx.ActorDiedError()) == failover.LOST
    assert failover.kind_of(rx.NodeDiedError("gone")) == failover.LOST
    assert failover.kind_of(rx.WorkerCrashedError()) == failover.LOST
    # unavailable for now, its memory or object store short, Serve refusing: the node stays in
    assert failover.kind_of(rx.ActorUnavailableError("busy", b"a" * 16)) == failover.UNSURE  # pinged
    assert failover.kind_of(rx.OutOfMemoryError("oom")) == failover.TRANSIENT
    assert failover.kind_of(rx.ObjectLostError("0" * 56, "owner", "call site")) == failover.TRANSIENT
    assert failover.kind_of(rx.GetTimeoutError()) == failover.TRANSIENT
    assert failover.kind_of(sx.BackPressureError(num_queued_requests=1, max_queued_requests=1)) == failover.TRANSIENT
    assert failover.kind_of(sx.DeploymentUnavailableError("d")) == failover.TRANSIENT
    assert failover.kind_of(rx.RayTaskError("f", "tb", ValueError("x"))) == failover.APP


def test_a_held_node_stays_in_the_clusters_list_marked():
    from pyllmrouter.ray import cluster as merged

    entry = {"id": "m", "object": "model", "owned_by": "x", "aliases": [], "status": {"value": "loaded"}}
    view = merged.merge_models({"n1": {"data": [entry], "held": True}, "n2": {"error": "node did not answer"}})
    assert view["nodes"]["n1"]["held"] and not view["nodes"]["n2"]["held"]
    assert view["data"][0]["loaded_on"] == ["n1"] and view["data"][0]["status"]["value"] == "loaded"


def test_a_node_started_again_rejoins_and_takes_back_what_the_others_evicted(cluster):
    """A node started as the lost one was (ray start): its replica is placed, measures
    its models, and the model the two nodes left had to evict for another (three big
    ones, room for two) is loaded there, in its free memory, with no request for it and
    no redeploy (ingress.RE_PLACE_PERIOD)."""
    c, client, nodes, start_node = cluster
    alive = [n for n in nodes if n in c.worker_nodes]  # the killed one was removed from the cluster's list
    assert len(alive) == 2
    for model in ("big", "big2"):  # one on each node left: neither can take another big one
        assert client.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2}).status_code == 200
    where = _where(client)
    assert sorted(where["big"] + where["big2"]) == sorted(n.node_id for n in alive)
    r = client.post("/v1/completions", json={"model": "big3", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200
    (evicted,) = [m for m in ("big", "big2") if not _where(client)[m]]  # pushed out for big3
    back = start_node(NODE_MIB)
    _wait_measured(client, {back.node_id})
    deadline = time.monotonic() + 60
    while _where(client)[evicted] != [back.node_id] and time.monotonic() < deadline:
        time.sleep(0.5)
    where = _where(client)
    assert where[evicted] == [back.node_id], where
    assert len({where[m][0] for m in ("big", "big2", "big3")}) == 3  # one a node: nothing pushes another out
    r = client.post("/v1/completions", json={"model": evicted, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-pyllmrouter-node"] == back.node_id


def test_a_replica_that_stops_answering_its_statistics_is_left_out(cluster):
    """A node's replica stopped (SIGSTOP: it neither answers nor fails): once its
    statistics have not changed for failover.silent_after seconds (a reading a second),
    a request for the model it holds goes to another node."""
    silent = failover.silent_after(1.0)

    _, client, _, _ = cluster
    r = client.post("/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200
    y = r.headers["x-pyllmrouter-node"]
    worker = client.get("/devices", params={"node": y}).json()["workers"][0]["pid"]
    with open(f"/proc/{worker}/stat") as f:
        replica = int(f.read().rsplit(")", 1)[1].split()[1])  # the worker's parent: the node's replica
    os.kill(replica, signal.SIGSTOP)
    try:
        time.sleep(silent + 1)
        r = client.post("/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.headers["x-pyllmrouter-node"] != y, (r.headers, r.text)
    finally:
        os.kill(replica, signal.SIGCONT)


def _ran(ray_dir, rid: str) -> dict[str, set[str]]:
    """{"started": nodes, "answered": nodes} of request ``rid``, from the replicas' run logs."""
    out: dict[str, set[str]] = {"started": set(), "answered": set()}
    for f in (ray_dir / "runs").glob("*.log"):
        for line in f.read_text().splitlines():
            r, what, node = line.split("\t")
            if r == rid:
                out["started" if what == "started" else "answered"].add(node)
    return out


def test_a_silent_node_runs_nothing_it_had_not_claimed(cluster, ray_dir):
    """A node's replica and workers stopped (a host that hangs: no reset, and Ray says
    nothing for a minute) with a whole request running there and one waiting for the
    same slot.  Within answer.SILENT seconds: the running one is a 504 that says it was
    running there, the waiting one is answered by another node.  When the node resumes,
    its claim of the waiting one is refused by the ledger: each ran on one node."""
    _, client, _, _ = cluster
    # big: a context long enough for a generation that outlasts the setup (a's ends in 0.4 s)
    assert client.post("/models/unload", json={"model": "big"}).status_code == 200  # loaded on one node only:
    r = client.post("/v1/completions", json={"model": "big", "prompt": "hi", "max_tokens": 2})
    x = r.headers["x-pyllmrouter-node"]  # where both requests go
    assert _where(client)["big"] == [x]
    results: dict = {}

    def send(rid: str, body: dict) -> None:
        r = client.post("/v1/completions", json=body, headers={"x-request-id": rid}, timeout=120)
        results[rid] = (r.status_code, dict(r.headers), r.text, time.monotonic())

    worker = next(w["pid"] for w in client.get("/devices", params={"node": x}).json()["workers"]
                  if w["devices"] == ["GPU0"] and w["alive"] and not w["stopping"])
    with open(f"/proc/{worker}/stat") as f:
        replica = int(f.read().rsplit(")", 1)[1].split()[1])  # the worker's parent: the node's replica
    running = threading.Thread(target=send, args=("silent-running", {"model": "big", "prompt": "hi",
                                                                      "max_tokens": 30000, "ignore_eos": True}))
    running.start()
    deadline = time.monotonic() + 30
    while _in_flight(client, x, "big") < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    waiting = threading.Thread(target=send, args=("silent-waiting", {"model": "big", "prompt": "hi",
                                                                      "max_tokens": 2}))
    waiting.start()
    while _waiting(client, x, "big") < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _in_flight(client, x, "big") == 1 and _waiting(client, x, "big") == 1
    tree = process_tree(replica)
    stopped_at = time.monotonic()
    for pid in tree:
        os.kill(pid, signal.SIGSTOP)
    try:
        running.join(60)
        waiting.join(60)
    finally:
        for pid in tree:
            os.kill(pid, signal.SIGCONT)
    status, headers, text, at = results["silent-running"]
    assert status == 504 and "stopped answering" in text and "running there" in text, (status, text)
    assert at - stopped_at < answer.SILENT + 5
    status, headers, text, at = results["silent-waiting"]
    assert status == 200 and headers["x-pyllmrouter-node"] != x and headers["x-pyllmrouter-retried"] == x, \
        (status, headers, text)
    time.sleep(5)  # the node resumed: what it still had of the two ends there
    assert _ran(ray_dir, "silent-running")["started"] == {x}
    waited = _ran(ray_dir, "silent-waiting")
    assert waited["started"] == {headers["x-pyllmrouter-node"]} and waited["answered"] <= waited["started"], waited
    assert _in_flight(client, x, "big") == 0 and _waiting(client, x, "big") == 0
