"""All of llama-server's router mode: a live model list (reload, watch, pull, delete, the
cache), /models/sse, resumable streams and the router's /props, through HTTP and the
openai client; and the live list's transitions, property-tested."""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from hypothesis import given, strategies as st

from pyllmrouter import ModelConfig, ModelSpec, Router, probe
from pyllmrouter.devices import EmulatedInventory
from pyllmrouter.errors import ModelRemoved, UnknownModel
from pyllmrouter.router.registry import API, Step, diff, step
from pyllmrouter.router.services.sources import Sources
from pyllmrouter.router.policy.state import State
from pyllmrouter.server.app import HTTP_PROTOCOL, create_app
from pyllmrouter.tools.hub import LocalHub
from pyllmrouter.tools.loopback import free_port, start_serve

SHARE_PROBE_CACHE = True
HI = [{"role": "user", "content": "hi"}]


@contextmanager
def serving(router: Router, **app_options):
    """``router``'s HTTP app (``create_app(router, **app_options)``) on a free port, as serve runs it."""
    app = create_app(router, **app_options)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", http=HTTP_PROTOCOL,
                                        proxy_headers=False))  # serve's: the app itself, not a middleware's wrap
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    while not srv.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        t.join(30)


def wait_for(predicate, timeout: float = 60.0, what="a condition"):
    """``predicate()``'s first true value within ``timeout``; else AssertionError naming
    ``what`` (a string, or a callable that says what was seen then)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")


# -- the live list's rules, pure ------------------------------------------------------

STATES = st.sampled_from(list(State))


@given(STATES, st.integers(0, 3), st.booleans())
def test_a_retiring_model_is_never_unloaded_busy_and_goes_only_once_unloaded(state, leases, retiring):
    action = step(state, leases, retiring)
    if not retiring:
        assert action is Step.NONE
    if action is Step.UNLOAD:
        assert state is State.LOADED and leases == 0  # its requests in flight have finished
    if action is Step.TAKE_OUT:
        assert state is State.UNLOADED  # it holds nothing any more
    if retiring and state is State.LOADED and leases == 0:
        assert action is Step.UNLOAD  # an idle model does not linger


NAMES = st.sampled_from(["a", "b", "c", "d", "e"])


@given(st.dictionaries(NAMES, st.tuples(st.integers(0, 2), st.sampled_from(["preset", "cache", API]))),
       st.dictionaries(NAMES, st.integers(0, 2)))
def test_reconciling_gives_the_sources_list_and_keeps_what_the_api_added(current, new):
    cfg = lambda n, v, src: ModelConfig(n, ModelSpec(f"{n}.gguf", n_ctx=v * 512), source=src)  # noqa: E731
    now = {n: cfg(n, v, src) for n, (v, src) in current.items()}
    listed = [cfg(n, v, "preset") for n, v in new.items()]
    changes = diff(now, listed)
    after = {n: c for n, c in now.items() if n not in changes.remove}
    after.update({c.name: c for c in changes.replace})
    after.update({c.name: c for c in changes.add})
    assert {n: c for n, c in after.items() if n in new} == {c.name: c for c in listed}
    assert {n for n in after if n not in new} == {n for n, c in now.items() if c.source == API and n not in new}
    assert not (set(changes.remove) & {c.name for c in changes.replace + changes.add})
    assert all(now[c.name] != c for c in changes.replace)  # an unchanged model is left alone


# -- through the Python API -----------------------------------------------------------


@pytest.fixture(scope="module")
def sizes(tiny):
    return {k: probe(ModelSpec(tiny[k], ("-np", "1"), n_ctx=512)).total for k in ("tiny-llama", "tiny-moe")}


@pytest.mark.slow
def test_a_removed_model_finishes_its_requests_then_goes(tiny, sizes):
    a = ModelConfig("a", ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=512))
    with Router([a], inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0, queue_timeout=5) as r:
        r.load("a")
        held = r.status()["devices"]["GPU0"]["held"]
        stream = r.complete("a", "tell me a story", max_tokens=40, temperature=0, stream=True)
        first = next(stream)
        r.remove_model("a")
        with pytest.raises(UnknownModel):  # no new request: the name is gone for newcomers
            r.complete("a", "x", max_tokens=1)
        assert r.status()["models"]["a"]["pending"] == "remove"
        rest = list(stream)  # the request in flight finishes
        assert first["choices"] and rest[-1]["choices"][0]["finish_reason"] in ("length", "stop")
        wait_for(lambda: "a" not in r.status()["models"], what="the model to go")
        assert r.status()["devices"]["GPU0"]["held"] == held - sizes["tiny-llama"]
        events = [(e.event, e.model) for e in r.scheduler.bus.recent()]
        assert ("remove", "a") in events and ("model_remove", "a") in events


@pytest.mark.slow
def test_a_waiter_for_a_removed_model_gets_a_clear_error(tiny, sizes):
    # b waits for GPU0, which busy a holds; b is removed meanwhile
    a = ModelConfig("a", ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=512))
    b = ModelConfig("b", ModelSpec(tiny["tiny-moe"], ("-np", "1"), n_ctx=512))
    room = max(sizes.values()) + min(sizes.values()) // 2
    with Router([a, b], inventory=EmulatedInventory({"GPU0": room}), margin=0, queue_timeout=20, turn=30) as r:
        r.load("a")
        stream = r.complete("a", "tell me a story", max_tokens=60, stream=True)
        next(stream)
        errors = []
        waiter = threading.Thread(target=lambda: errors.append(_error(lambda: r.complete("b", "x", max_tokens=1))))
        waiter.start()
        wait_for(lambda: r.status()["queue"] == 1, what="b to wait")
        # why it waits, on the bus (and /models/sse): the short device, and by how much
        waiting = wait_for(lambda: [e for e in r.scheduler.bus.recent() if e.event == "waiting" and e.model == "b"],
                           what="the waiting event")
        assert waiting[0].data["short"]["GPU0"] > 0 and "busy" in waiting[0].data["why"]
        r.remove_model("b")
        waiter.join(10)
        assert len(errors) == 1 and isinstance(errors[0], ModelRemoved) and "'b' was removed" in str(errors[0])
        stream.close()
        assert r.status()["models"]["a"]["state"] == "loaded"  # nothing else was unloaded


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    return None


@pytest.mark.slow
def test_a_changed_model_serves_requests_that_came_meanwhile_with_its_new_config(tiny):
    old = ModelConfig("m", ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=512))
    new = ModelConfig("m", ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=1024))
    with Router([old], inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0, queue_timeout=30) as r:
        r.load("m")
        stream = r.complete("m", "tell me a story", max_tokens=30, stream=True)
        next(stream)
        r.replace_model(new)
        result = []
        waiter = threading.Thread(target=lambda: result.append(r.call("m", "GET", "/props")[0]))
        waiter.start()
        time.sleep(0.3)
        assert not result  # it waits for the new config while the old one finishes
        list(stream)
        waiter.join(30)
        assert json.loads(result[0].body)["default_generation_settings"]["n_ctx"] == 1024
        assert r.models()[0] == new


# -- through HTTP ---------------------------------------------------------------------


@pytest.mark.slow
def test_reload_adds_changes_and_removes_what_the_preset_says(tiny, tmp_path):
    preset = tmp_path / "models.ini"
    preset.write_text(f"[a]\nmodel = {tiny['tiny-llama']}\nc = 512\nnp = 1\n")
    sources = Sources(preset=str(preset))
    models, _ = sources.read()
    with Router(models, inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0, sources=sources) as r:
        with serving(r) as base, httpx.Client(base_url=base, timeout=120) as http:
            client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
            assert client.chat.completions.create(model="a", messages=HI, max_tokens=2).choices
            preset.write_text(f"[a]\nmodel = {tiny['tiny-llama']}\nc = 1024\nnp = 1\n"
                              f"[b]\nmodel = {tiny['tiny-moe']}\nc = 512\n")
            listed = {m["id"]: m for m in http.get("/models", params={"reload": 1}).json()["data"]}
            assert set(listed) == {"a", "b"} and listed["b"]["source"] == "preset"
            assert client.completions.create(model="b", prompt="hi", max_tokens=2).choices
            wait_for(lambda: http.get("/props", params={"model": "a"}).json()["default_generation_settings"]["n_ctx"]
                     == 1024, what="a's new context")
            # a bad preset changes nothing, and says why
            preset.write_text("[a]\nmodel = x.gguf\nwarp-speed = 9\n")
            bad = http.get("/models", params={"reload": 1})
            assert bad.status_code == 400 and "warp-speed" in bad.json()["error"]["message"]
            assert {m["id"] for m in http.get("/models").json()["data"]} == {"a", "b"}
            preset.write_text(f"[b]\nmodel = {tiny['tiny-moe']}\nc = 512\n")
            http.get("/models", params={"reload": 1})
            wait_for(lambda: {m["id"] for m in http.get("/models").json()["data"]} == {"b"}, what="a to go")
            gone = http.post("/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 1})
            assert gone.status_code == 404


@pytest.mark.slow
def test_watch_reads_the_preset_when_it_changes(tiny, tmp_path):
    preset = tmp_path / "models.ini"
    preset.write_text(f"[a]\nmodel = {tiny['tiny-llama']}\nc = 512\n")
    proc, base = start_serve(["--models-preset", str(preset), "--emulate-devices", "GPU0=1GiB", "--watch",
                              "--models-memory-margin", "0"])
    try:
        preset.write_text(f"[a]\nmodel = {tiny['tiny-llama']}\nc = 512\n[fresh]\nmodel = {tiny['tiny-moe']}\n")
        wait_for(lambda: "fresh" in {m["id"] for m in httpx.get(base + "/models").json()["data"]}, 15,
                 "the watcher to add the model")
        out = httpx.post(base + "/v1/completions", json={"model": "fresh", "prompt": "hi", "max_tokens": 2}, timeout=120)
        assert out.status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture()
def hub(tiny, projector, monkeypatch):
    repos = {"test/tiny": {"tiny-Q8_0.gguf": tiny["tiny-llama"], "mmproj-tiny-f16.gguf": projector},
             "test/moe": {"moe-Q4_K_M.gguf": tiny["tiny-moe"]}}
    with LocalHub(repos) as endpoint:
        monkeypatch.setenv("MODEL_ENDPOINT", endpoint)
        yield endpoint


def sse_events(base: str, stop: threading.Event, into: list) -> threading.Thread:
    """A thread that reads /models/sse into ``into`` (each event's JSON) until ``stop`` is set."""
    def run():
        with httpx.stream("GET", base + "/models/sse", timeout=None) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    into.append(json.loads(line[6:]))
                if stop.is_set():
                    return
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.slow
def test_pull_lists_serves_and_deletes_a_model_of_llama_cpps_cache(tiny, hub):
    a = ModelConfig("a", ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=512))  # added through the API
    cache = Path(os.environ["LLAMA_CACHE"])
    with Router([a], inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0,
                sources=Sources(cache=True)) as r, serving(r) as base, httpx.Client(base_url=base, timeout=120) as http:
        events: list = []
        stop = threading.Event()
        sse_events(base, stop, events)
        r.load("a")
        assert http.post("/models", json={"model": "test/tiny:Q8_0"}).json() == {"success": True}
        listed = wait_for(lambda: {m["id"]: m for m in http.get("/models").json()["data"]}.get("test/tiny:Q8_0"),
                          what="the pulled model")
        wait_for(lambda: http.get("/models").json()["data"][-1]["status"]["value"] != "downloading" and
                 any(m["id"] == "test/tiny:Q8_0" and m["source"] == "cache"
                     for m in http.get("/models").json()["data"]), what="the download to finish")
        out = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0).chat.completions.create(
            model="test/tiny:Q8_0", messages=HI, max_tokens=2)
        assert out.choices
        listed = {m["id"]: m for m in http.get("/models").json()["data"]}["test/tiny:Q8_0"]
        # the repository's projector came with it (llama.cpp's downloader), and is measured with it
        assert listed["can_remove"] and listed["architecture"]["input_modalities"] == ["text", "image"]
        assert listed["memory"]["components"]["GPU0"]["CPU"]["projector"] > 0
        assert (cache / "models--test--tiny").is_dir()
        # a repository the hub does not have: llama.cpp's downloader finds no file and says so
        # in its log only, so the pull finishes and lists nothing, as in llama-server's router
        assert http.post("/models", json={"model": "test/absent:Q8_0"}).status_code == 200
        wait_for(lambda: ("download_finished", "test/absent:Q8_0") in [(e["event"], e["model"]) for e in events],
                 what="the empty download")
        assert "test/absent:Q8_0" not in {m["id"] for m in http.get("/models").json()["data"]}
        # a name llama.cpp refuses fails, listed with its reason; and unloads nothing
        assert http.post("/models", json={"model": "not-a-repository"}).status_code == 200
        failed = wait_for(lambda: next((m for m in http.get("/models").json()["data"]
                                        if m["id"] == "not-a-repository" and m["status"]["value"] == "failed"), None),
                          what="the failed download")
        assert "invalid HF repo format" in failed["status"]["reason"]
        assert r.status()["models"]["a"]["state"] == "loaded"
        # the pull of a name that exists is refused
        assert http.post("/models", json={"model": "a"}).status_code == 400
        # delete: a model not from the cache cannot be; the cache model is removed, files and all
        assert http.delete("/models", params={"model": "a"}).status_code == 400
        assert http.delete("/models", params={"model": "test/tiny:Q8_0"}).json() == {"success": True}
        assert "test/tiny:Q8_0" not in {m["id"] for m in http.get("/models").json()["data"]}
        assert not any((cache / "models--test--tiny").rglob("tiny-Q8_0.gguf"))  # the tag's files (llama.cpp's rule)
        stop.set()
        kinds = [(e["event"], e["model"]) for e in events]
        assert ("download_progress", "test/tiny:Q8_0") in kinds and ("download_finished", "test/tiny:Q8_0") in kinds
        assert ("download_failed", "not-a-repository") in kinds and ("model_remove", "test/tiny:Q8_0") in kinds
        assert {"model": "a", "event": "status_change", "data": {"status": "loaded", "devices": "GPU0"}} in events


@pytest.mark.slow
def test_models_sse_says_loads_evictions_and_waits_and_drops_clients_that_leave(tiny, sizes):
    a = ModelConfig("a", ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=512))
    b = ModelConfig("b", ModelSpec(tiny["tiny-moe"], ("-np", "1"), n_ctx=512))
    room = max(sizes.values()) + min(sizes.values()) // 2
    with Router([a, b], inventory=EmulatedInventory({"GPU0": room}), margin=0) as r, serving(r) as base:
        events: list = []
        stop = threading.Event()
        reader = sse_events(base, stop, events)
        wait_for(lambda: r.scheduler.bus.listeners() == 1, what="the SSE client")
        r.load("a")
        r.load("b")  # a is idle: evicted for b
        wait_for(lambda: {"model": "b", "event": "status_change", "data": {"status": "loaded", "devices": "GPU0"}}
                 in events, what="b's load, told to the client")
        evicted = next(e for e in events if e["event"] == "evicted")
        assert evicted["model"] == "a" and evicted["data"]["newcomer"] == "b"
        assert set(evicted["data"]["short"]) == {"GPU0"} and evicted["data"]["bytes"]["GPU0"] == sizes["tiny-llama"]
        statuses = [(e["model"], e["data"]["status"]) for e in events  # a load's progress ticks aside
                    if e["event"] == "status_change" and "progress" not in e["data"]]
        assert statuses[:5] == [("a", "loading"), ("a", "loaded"), ("a", "unloaded"), ("b", "loading"), ("b", "loaded")]
        stop.set()
        r.unload("b")  # an event after the client left: its write fails, and it is dropped
        wait_for(lambda: r.scheduler.bus.listeners() == 0, what="the client to be dropped")
        reader.join(10)


@pytest.mark.slow
def test_a_resumable_stream_answers_after_the_client_came_back(tiny):
    m = ModelConfig("m", ModelSpec(tiny["tiny-llama"], ("-np", "2"), n_ctx=1024))
    with Router([m], inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0) as r, serving(r) as base:
        conv = "conv-1234"
        body = {"model": "m", "messages": HI, "max_tokens": 48, "temperature": 0, "stream": True}
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers={"X-Conversation-Id": conv},
                          timeout=60) as first:
            head = next(first.iter_lines())  # one chunk, then the client goes
        assert head.startswith("data: ")
        with httpx.Client(base_url=base, timeout=60) as http:
            found = wait_for(lambda: http.post("/v1/streams/lookup", json={"conversation_ids": [conv, "nope"]}).json(),
                             what="the session")
            assert [e.get("conversation_id", e.get("conv_id")) for e in found] == [conv]
            replay = http.get("/v1/stream", params={"conv_id": conv, "from": 0})
            assert replay.status_code == 200
            chunks = [line for line in replay.text.splitlines() if line.startswith("data: ")]
            assert chunks[0] == head and chunks[-1] == "data: [DONE]"  # from the start to the end
            assert http.delete("/v1/stream", params={"conv_id": conv}).status_code == 204
            assert http.get("/v1/stream", params={"conv_id": conv}).status_code == 404
            # a conversation whose model was unloaded meanwhile: a clear error
            conv2 = "conv-5678"
            http.post("/v1/chat/completions", json={**body, "stream": False}, headers={"X-Conversation-Id": conv2})
            r.unload("m")
            gone = http.get("/v1/stream", params={"conv_id": conv2})
            assert gone.status_code == 404 and "was unloaded" in gone.json()["error"]["message"]


@pytest.mark.slow
def test_router_props_carry_llama_servers_fields_and_ours(tiny):
    m = ModelConfig("m", ModelSpec(tiny["tiny-llama"], n_ctx=512))
    with Router([m], inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0, max_models=2) as r, \
            serving(r) as base:
        props = httpx.get(base + "/props", timeout=60).json()
    assert props["role"] == "router" and props["max_instances"] == 2 and props["models_autoload"] is True
    assert props["model_alias"] == "llama-server" and props["model_path"] == "none"
    assert props["default_generation_settings"] == {"params": {}, "n_ctx": 0} and props["ui_settings"] == {}
    assert props["build_info"].startswith("b") and props["margin_bytes"] == 0 and props["models"] == 1


@pytest.mark.slow
def test_a_preset_with_dedup_cache_models_hides_the_cache_entries_it_uses(tiny, hub, tmp_path):
    """dedup-cache-models (llama-server's preset key, per model or in [*]): the cache models
    whose files a preset model and its draft use are not listed, and still serve."""
    import subprocess
    import sys

    for repo in ("test/tiny:Q8_0", "test/moe:Q4_K_M"):  # into llama.cpp's cache, by its downloader
        subprocess.run([sys.executable, "-m", "pyllmrouter.engine.download", repo], check=True, capture_output=True)
    preset = tmp_path / "dedup.ini"
    section = "[model-dedup]\nhf-repo = test/tiny:Q8_0\nc = 256\n"
    preset.write_text(section + "dedup-cache-models = 1\n")
    sources = Sources(preset=str(preset), cache=True)
    with Router(sources.read()[0], inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0,
                sources=sources) as r, serving(r) as base, httpx.Client(base_url=base, timeout=120) as http:
        ids = lambda: [m["id"] for m in http.get("/models").json()["data"]]  # noqa: E731
        assert "model-dedup" in ids() and "test/tiny:Q8_0" not in ids() and "test/moe:Q4_K_M" in ids()
        assert "test/tiny:Q8_0" not in [m["id"] for m in http.get("/v1/models").json()["data"]]
        r_ = http.post("/tokenize", json={"model": "test/tiny:Q8_0", "content": "hello"})
        assert r_.status_code == 200 and r_.json()["tokens"]  # hidden, not gone
        preset.write_text(section)
        assert "test/tiny:Q8_0" in [m["id"] for m in http.get("/models", params={"reload": 1}).json()["data"]]
        preset.write_text("[*]\ndedup-cache-models = 1\n\n" + section)
        assert "test/tiny:Q8_0" not in [m["id"] for m in http.get("/models", params={"reload": 1}).json()["data"]]
