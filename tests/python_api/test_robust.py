"""Nothing one worker, one client or one slow file move does freezes or poisons the
router: a stopped worker and a big body (the event loop never waits on a pipe), a load
that times out (cancelled in the worker, its bytes held until then), bodies counted as
they come, metric labels from the router's own list, status that never waits on the
kept-state store, kept states never crossing configurations, a lease released on every
path, bodies llama-server's router routes (an array, a multipart form), and a probe that
aborts in a process of its own."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from pyllmrouter import ModelConfig, ModelSpec, Router
from pyllmrouter.devices import EmulatedInventory
from pyllmrouter.router.exchange import Ask
from pyllmrouter.errors import LoadFailed, Withdrawn
from pyllmrouter.router.workers.keep import KeepStore
from pyllmrouter.router.workers.handle import Pending
from pyllmrouter.tools import tinymodels
from pyllmrouter.tools.loopback import free_port, llama_tool, start_serve, wait_healthy

from test_live import serving, wait_for

pytestmark = pytest.mark.slow  # real workers and servers
SHARE_PROBE_CACHE = True
LONG = "tell me a long story about the sea and the ships " * 8


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _preset(tmp_path: Path, tiny, **extra: str) -> Path:
    p = tmp_path / "models.ini"
    p.write_text(f"[a]\nmodel = {tiny['tiny-llama']}\nc = 1024\nnp = 1\n\n"
                 f"[b]\nmodel = {tiny['tiny-moe']}\nc = 512\nnp = 1\n"
                 + "".join(f"{k} = {v}\n" for k, v in extra.items()))
    return p


def _worker_pid(base: str) -> int:
    workers = httpx.get(base + "/devices", timeout=10).json()["workers"]
    return next(w["pid"] for w in workers if w["alive"] and w["devices"] == ["GPU0"])


def test_a_stopped_worker_and_a_big_body_freeze_nothing(tiny, tmp_path):
    proc, base = start_serve(["--models-preset", str(_preset(tmp_path, tiny)), "--no-models-cache",
                              "--emulate-devices", "GPU0=1GiB", "--models-memory-margin", "0", "--heartbeat", "3"])
    try:
        a = {"model": "a", "prompt": "hi", "max_tokens": 2}
        assert httpx.post(base + "/v1/completions", json=a, timeout=60).status_code == 200
        pid = _worker_pid(base)
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        big = {"model": "a", "prompt": "x" * (4 << 20), "max_tokens": 1}  # more than a pipe holds
        answers: list = []
        threading.Thread(target=lambda: answers.append(
            httpx.post(base + "/v1/completions", json=big, timeout=60).status_code), daemon=True).start()
        time.sleep(0.5)  # the body is on its way into the stopped worker's pipe
        for _ in range(3):
            t0 = time.monotonic()
            assert httpx.get(base + "/health", timeout=5).status_code == 200
            assert time.monotonic() - t0 < 1.0
        # the heartbeat kills it: within its 3 s (and a second of its period) plus 2 s
        wait_for(lambda: subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True,
                                        text=True).stdout.strip() in ("", "Z"), timeout=10, what="the worker killed")
        assert time.monotonic() - stopped < 3 + 2 + 1
        wait_for(lambda: answers, timeout=30, what="the big request's answer")
        assert answers[0] == 503  # its worker died under it: retry
        t0 = time.monotonic()
        assert httpx.post(base + "/v1/completions", json=a, timeout=60).status_code == 200  # a new worker
        assert time.monotonic() - t0 < 30 and _worker_pid(base) != pid
    finally:
        proc.terminate()
        proc.wait(60)


def test_a_load_that_times_out_is_cancelled_in_its_worker_and_held_until_then(tiny):
    models = [ModelConfig("a", ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=512)),
              ModelConfig("b", ModelSpec(tiny["tiny-moe"], ("-np", "1"), n_ctx=512))]
    with Router(models, inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0, load_timeout=2,
                heartbeat=0, kv_keep_ram=0) as r:
        r.load("a")
        r.scheduler.measure("b")
        wait_for(lambda: r.status()["models"]["b"]["requirement"], what="b measured")
        need_a = r.status()["models"]["a"]["held"]["GPU0"]
        need_b = r.status()["models"]["b"]["requirement"]["GPU0"]["GPU0"]
        pid = r.status()["workers"][0]["pid"]
        os.kill(pid, signal.SIGSTOP)  # the worker takes the LoadModel, and does nothing with it yet
        try:
            with pytest.raises(LoadFailed, match="did not end within 2 s"):
                r.load("b")
            st = r.status()
            assert st["models"]["b"]["state"] == "unloading"  # cancelled, not forgotten:
            assert st["devices"]["GPU0"]["held"] == need_a + need_b  # its bytes are still counted
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: r.status()["models"]["b"]["state"] == "unloaded", what="the cancelled load to end")
        assert r.status()["devices"]["GPU0"]["held"] == need_a
        r.load("b")  # the worker kept no engine of it: this load is not "already loaded"
        st = r.status()
        assert st["models"]["b"]["state"] == "loaded" and st["workers"][0]["pid"] == pid
        assert st["devices"]["GPU0"]["held"] == need_a + need_b
        assert r.chat("b", [{"role": "user", "content": "hi"}], max_tokens=2)["choices"]


def test_a_chunked_body_over_the_limit_is_refused_and_the_router_stays_small(tiny, tmp_path):
    proc, base = start_serve(["--models-preset", str(_preset(tmp_path, tiny)), "--no-models-cache",
                              "--emulate-devices", "GPU0=2GiB"])
    try:
        before = _rss_mib(proc.pid)

        def gigabyte():
            block = b"x" * (1 << 20)
            for _ in range(1024):
                yield block

        r = httpx.post(base + "/v1/completions", content=gigabyte(), headers={"content-type": "application/json"},
                       timeout=120)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        assert _rss_mib(proc.pid) - before < 32  # the router never held it
        r = httpx.post(base + "/models/load", content=gigabyte(), timeout=120)  # every route, not only a model's
        assert r.status_code == 413
        assert httpx.get(base + "/health", timeout=10).status_code == 200
    finally:
        proc.terminate()
        proc.wait(60)


def test_metric_labels_come_from_the_router_own_list(tiny):
    models = [ModelConfig("a", ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=512), aliases=("alias-a",))]
    with Router(models, inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0) as r, serving(r) as base, \
            httpx.Client(base_url=base, timeout=30) as http:
        http.post("/v1/completions", json={"model": "alias-a", "prompt": "hi", "max_tokens": 1})
        http.post("/v1/completions", json={"model": "nope-0", "prompt": "hi"})
        http.get("/slots/0", params={"model": "a"})
        http.post("/slots/0?action=erase", json={"model": "a"})
        before = http.get("/metrics").text.splitlines()
        for i in range(5000):
            assert http.post("/v1/completions", json={"model": f"nope-{i}", "prompt": "hi"}).status_code == 404
            if i % 10 == 0:
                http.post(f"/slots/{i}?action=erase", json={"model": "a"})
        after = http.get("/metrics").text.splitlines()
        series = lambda lines: {line.rsplit(" ", 1)[0] for line in lines if not line.startswith("#")}  # noqa: E731
        assert series(after) == series(before)  # counts moved; not one label more
        assert not any("nope-" in line for line in after) and not any('endpoint="/slots/1' in line for line in after)
        assert any('model="a"' in line and "pyllmrouter_request_seconds" in line for line in after)  # alias: a


def test_status_never_waits_on_a_slow_spill(tiny, tmp_path, monkeypatch):
    models = [ModelConfig("a", ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=1024)),
              ModelConfig("b", ModelSpec(tiny["tiny-moe"], ("-np", "1"), n_ctx=512))]
    with Router(models, inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0, max_models=1,
                kv_keep_ram=64 << 20, kv_keep_dir=str(tmp_path / "disk")) as r, serving(r) as base, \
            httpx.Client(base_url=base, timeout=30) as http:
        r.chat("a", [{"role": "user", "content": LONG}], max_tokens=2)
        r.chat("b", [{"role": "user", "content": "hi"}], max_tokens=2)  # a's state kept, in RAM
        assert r.status()["models"]["a"]["kept"]["ram"] > 0
        http.get("/props")  # its build info is asked once, of a short-lived process: not in the timing
        move = KeepStore._move

        def slow_move(store, k, directory):  # a disk that takes 3 s per file
            time.sleep(3)
            move(store, k, directory)

        monkeypatch.setattr(KeepStore, "_move", slow_move)
        spill = threading.Thread(target=r.scheduler.keep.spill)
        spill.start()
        time.sleep(0.2)  # the store's lock is held now, for 3 s
        try:
            for path in ("/health", "/v1/models", "/models", "/devices", "/props", "/metrics"):
                t0 = time.monotonic()
                assert http.get(path).status_code == 200
                assert time.monotonic() - t0 < 0.1, path
            assert spill.is_alive()  # all of it answered while the move was under way
        finally:
            spill.join(10)
        assert r.status()["models"]["a"]["kept"]["disk"] > 0


def test_two_sections_over_one_file_never_share_kept_states(tiny):
    file = tiny["tiny-llama"]
    models = [ModelConfig("a", ModelSpec(file, ("-np", "1", "--rope-freq-base", "10000"), n_ctx=1024)),
              ModelConfig("b", ModelSpec(file, ("-np", "1", "--rope-freq-base", "50000"), n_ctx=1024))]
    with Router(models, inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0, max_models=1,
                kv_keep_ram=64 << 20) as r:
        msgs = [{"role": "user", "content": LONG}]
        cached = lambda reply: reply["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)  # noqa: E731
        r.chat("a", msgs, max_tokens=2)
        first_b = r.chat("b", msgs, max_tokens=2)  # a evicted, its state kept: the same prompt, another rope
        assert cached(first_b) == 0  # nothing of a's came into b
        assert r.status()["models"]["a"]["kept"]["files"] == 1  # and b's load left a's file alone
        again_a = r.chat("a", msgs, max_tokens=2)  # b evicted; a's own state comes back
        assert cached(again_a) > 100
        again_b = r.chat("b", msgs, max_tokens=2)
        assert cached(again_b) > 100  # b's own, kept when a came back


def test_a_lease_is_released_when_the_cancel_cannot_be_sent(tiny, monkeypatch):
    models = [ModelConfig("a", ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=4096))]
    with Router(models, inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0) as r:
        r.load("a")

        def broken(self):
            raise OSError("the pipe is gone")

        monkeypatch.setattr(Pending, "cancel", broken)
        body = json.dumps({"model": "a", "prompt": "hi", "max_tokens": 3000, "ignore_eos": True}).encode()

        async def leave():
            with pytest.raises((Withdrawn, OSError)):
                await r.arelay(Ask("a", "POST", "/v1/completions", body, gone=lambda: asyncio.sleep(0.1)))

        asyncio.run(leave())
        wait_for(lambda: r.status()["models"]["a"]["leases"] == 0, timeout=60, what="the lease released")
        monkeypatch.undo()
        r.unload("a")  # not stuck busy: it can be unloaded (and evicted, and reach its ttl)
        assert r.status()["models"]["a"]["state"] == "unloaded"


def test_an_array_body_and_a_multipart_form_are_routed_as_llama_server_routes_them(tiny, tmp_path):
    """POST /lora-adapters takes a JSON array (the model: ?model=); /v1/audio/transcriptions
    a multipart form (the model: its field): both reach the model's engine, whose answer is
    llama-server's own for the same request."""
    port = free_port()
    peer = subprocess.Popen([str(llama_tool("llama-server")), "-m", str(tiny["tiny-llama"]), "-np", "1", "-c", "512",
                             "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    theirs = f"http://127.0.0.1:{port}"
    models = [ModelConfig("a", ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=512))]
    wav = b"RIFF" + b"\0" * 64
    try:
        wait_healthy(theirs, peer)
        with Router(models, inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0) as r, serving(r) as ours:
            a = httpx.post(theirs + "/lora-adapters", json=[], timeout=30)
            b = httpx.post(ours + "/lora-adapters?model=a", json=[], timeout=30)
            assert (b.status_code, b.json()) == (a.status_code, a.json())
            assert httpx.post(ours + "/lora-adapters", json=[], timeout=30).status_code == 400  # which model's?
            form = {"model": (None, "a"), "response_format": (None, "json"), "file": ("a.wav", wav, "audio/wav")}
            a = httpx.post(theirs + "/v1/audio/transcriptions", files=form, timeout=30)
            b = httpx.post(ours + "/v1/audio/transcriptions", files=form, timeout=30)
            assert (b.status_code, b.json()) == (a.status_code, a.json())  # the engine's answer (a text model)
            deep = b"[" * 100_000 + b"]" * 100_000
            nested = httpx.post(ours + "/v1/completions", content=deep, timeout=30)
            assert nested.status_code == 400 and nested.json()["error"]["code"] == "invalid_json"
    finally:
        peer.terminate()
        peer.wait(30)


def test_a_probe_that_aborts_takes_no_hosted_model_down(tiny, tmp_path):
    """A file that trips an assert in llama.cpp (here n_head not a multiple of n_head_kv)
    is measured in a short-lived process when its device set's worker hosts models."""
    import dataclasses

    bad = tinymodels.write_llama(tmp_path / "bad.gguf", dataclasses.replace(tinymodels.LLAMA, n_head_kv=3))
    models = [ModelConfig("a", ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=512)),
              ModelConfig("bad", ModelSpec(bad, ("-np", "1"), n_ctx=512))]
    with Router(models, inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0) as r:
        r.load("a")
        pid = r.status()["workers"][0]["pid"]
        with pytest.raises(LoadFailed, match="measure"):
            r.load("bad")
        st = r.status()
        assert st["models"]["a"]["state"] == "loaded" and [w["pid"] for w in st["workers"]] == [pid]
        assert r.chat("a", [{"role": "user", "content": "hi"}], max_tokens=2)["choices"]
