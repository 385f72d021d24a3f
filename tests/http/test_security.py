"""Clients cannot write into the router's memory: slot actions as llama-server allows them
(refused unless the user set a slot save path, and then only there), every byte of the
kept-state store the router's own and counted, and nothing left in /dev/shm."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import httpx
import pytest

from pyllmrouter import ModelConfig, ModelSpec, Router
from pyllmrouter.devices import EmulatedInventory
from pyllmrouter.router.services.downloads import CANCEL_GRACE, Downloads
from pyllmrouter.router.services.sources import Sources
from pyllmrouter.router.services.events import EventBus
from pyllmrouter.tools.loopback import free_port, llama_tool, start_serve, wait_healthy

from test_live import serving, wait_for

pytestmark = pytest.mark.slow  # real workers and servers
SHARE_PROBE_CACHE = True
LONG = "tell me a long story about the sea and the ships " * 8
SHM = Path("/dev/shm")


def _two(tiny, **kw) -> Router:
    models = [ModelConfig("a", ModelSpec(tiny["tiny-llama"], ("-np", "1", *kw.pop("args", ())), n_ctx=1024)),
              ModelConfig("b", ModelSpec(tiny["tiny-moe"], ("-np", "1"), n_ctx=512))]
    return Router(models, inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0, max_models=1,
                  kv_keep_ram=64 << 20, **kw)


def test_a_clients_slot_action_is_refused_as_llama_server_refuses_it(tiny):
    save = {"filename": "client1.bin"}
    port = free_port()
    peer = subprocess.Popen([str(llama_tool("llama-server")), "-m", str(tiny["tiny-llama"]), "-np", "1", "-c", "1024",
                             "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", peer)
        theirs = httpx.post(f"http://127.0.0.1:{port}/slots/0?action=save", json=save, timeout=30)
    finally:
        peer.terminate()
        peer.wait(10)
    with _two(tiny) as r, serving(r) as base:
        r.chat("a", [{"role": "user", "content": LONG}], max_tokens=2)
        r.chat("b", [{"role": "user", "content": "hi"}], max_tokens=2)  # a evicted: its state kept
        keep = r.scheduler.keep.ram_dir
        files = sorted(p.name for p in keep.rglob("*"))
        held, kept = r.status()["devices"]["CPU"]["held"], r.status()["models"]["a"]["kept"]
        assert kept["files"] == 1 and kept["ram"] > 0
        for i in range(50):  # a client tries to fill the store (with distinct names)
            ours = httpx.post(f"{base}/slots/0?action=save", json={"model": "b", "filename": f"client{i}.bin"},
                              timeout=30)
            assert (ours.status_code, ours.json()) == (theirs.status_code, theirs.json())
        assert "does not support slots action" in ours.json()["error"]["message"]
        # a state the router kept is offered to no client (b's engine, a's kept file name)
        restore = httpx.post(f"{base}/slots/0?action=restore", json={"model": "b", "filename": "slot0.bin"}, timeout=30)
        assert restore.status_code == theirs.status_code
        assert sorted(p.name for p in keep.rglob("*")) == files  # only what the router wrote
        assert r.status()["models"]["a"]["kept"] == kept  # and every byte of it counted
        assert r.status()["devices"]["CPU"]["held"] == held


def test_with_a_slot_save_path_a_client_saves_and_restores_there_only(tiny, tmp_path):
    mine = tmp_path / "slots"
    mine.mkdir()
    with _two(tiny, args=("--slot-save-path", str(mine) + "/")) as r, serving(r) as base:
        r.chat("a", [{"role": "user", "content": LONG}], max_tokens=2)
        saved = httpx.post(f"{base}/slots/0?action=save", json={"model": "a", "filename": "client1.bin"}, timeout=30)
        assert saved.status_code == 200 and saved.json()["n_saved"] > 0 and (mine / "client1.bin").is_file()
        restored = httpx.post(f"{base}/slots/0?action=restore", json={"model": "a", "filename": "client1.bin"},
                              timeout=30)
        assert restored.status_code == 200 and restored.json()["n_restored"] == saved.json()["n_saved"]
        r.chat("b", [{"role": "user", "content": "hi"}], max_tokens=2)  # a evicted: the router keeps its state
        kept = [p for p in r.scheduler.keep.ram_dir.rglob("*.bin")]
        assert kept and all(mine not in p.parents for p in kept)  # in its own store, not the user's directory
        assert sorted(p.name for p in mine.iterdir()) == ["client1.bin"]
        # the router's own restore still works: a's conversation comes back from its kept state
        reply = r.chat("a", [{"role": "user", "content": LONG}], max_tokens=2)
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 100


def _ours() -> set[Path]:
    return set(SHM.glob("pyllmrouter-kv-*")) if SHM.is_dir() else set()


def _owned_by(d: Path, pid: int) -> bool:
    try:
        return (d / ".owner").read_text().strip() == str(pid)
    except OSError:  # another router's, gone meanwhile
        return False


def _serve_with_a_kept_state(tiny, tmp_path, name: str) -> tuple[subprocess.Popen, Path]:
    preset = tmp_path / f"{name}.ini"
    preset.write_text(f"[a]\nmodel = {tiny['tiny-llama']}\nc = 1024\nnp = 1\n")
    before = _ours()
    proc, base = start_serve(["--models-preset", str(preset), "--emulate-devices", "GPU0=1GiB",
                              "--models-memory-margin", "0", "--kv-keep-ram", "64", "--no-models-cache"])
    body = {"model": "a", "messages": [{"role": "user", "content": LONG}], "max_tokens": 2}
    assert httpx.post(base + "/v1/chat/completions", json=body, timeout=120).status_code == 200
    assert httpx.post(base + "/models/unload", json={"model": "a"}, timeout=120).json()["success"]
    (mine,) = [d for d in _ours() - before if _owned_by(d, proc.pid)]  # start_serve's process is the router
    assert list(mine.rglob("*.bin"))  # the kept state, in host RAM
    return proc, mine


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm here")
def test_nothing_is_left_in_dev_shm_after_sigterm_or_sigkill(tiny, tmp_path):
    proc, mine = _serve_with_a_kept_state(tiny, tmp_path, "term")
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    assert not mine.exists()  # a clean exit takes its directory along
    proc, mine = _serve_with_a_kept_state(tiny, tmp_path, "kill")
    proc.send_signal(signal.SIGKILL)
    proc.wait(60)
    assert mine.exists()  # a killed router leaves it...
    live, other = _serve_with_a_kept_state(tiny, tmp_path, "next")  # ...and the next start reclaims it
    try:
        assert not mine.exists() and other.exists()
        # a live router's directory is never touched: another start leaves it alone
        third, third_dir = _serve_with_a_kept_state(tiny, tmp_path, "third")
        assert other.exists() and third_dir.exists()
        third.terminate()
        third.wait(60)
    finally:
        live.terminate()
        live.wait(60)
    assert not other.exists() and not third_dir.exists()
    assert not _ours() & {mine, other, third_dir}


def test_no_client_route_loads_a_path_or_writes_a_file(tiny, tmp_path):
    """The routes a client reaches, each asked to load a file or write one: refused, or it
    touches only what the user configured."""
    with _two(tiny) as r, serving(r) as base:
        r.chat("a", [{"role": "user", "content": "hi"}], max_tokens=2)
        target = tmp_path / "written.bin"
        tries = [
            ("POST", "/lora-adapters?model=a", [{"id": 0, "scale": 1.0, "path": str(target)}]),
            ("POST", "/props", {"model": "a", "slot_save_path": str(tmp_path)}),
            ("POST", "/models/load", {"model": str(tiny["tiny-moe"])}),  # a path is no model name
            ("POST", "/slots/0?action=save", {"model": "a", "filename": "../../escape.bin"}),
        ]
        answers = [httpx.request(m, base + p, json=b, timeout=30).status_code for m, p, b in tries]
        assert answers[2] == 404 and answers[3] >= 400
        assert not target.exists() and not list(tmp_path.rglob("*.bin"))
        assert json.loads(httpx.get(base + "/models", timeout=30).text)["data"][0]["id"] in ("a", "b")
        assert os.path.basename(str(tiny["tiny-moe"])) not in {m.name for m in r.models()}


def test_pulls_at_once_are_bounded(tiny, monkeypatch):
    """A client that asks for many pulls starts at most a few download processes at once
    (then 429, Retry-After); a cancelled one is not listed as failed."""
    stuck = socket.socket()  # a hub that takes connections and never answers: downloads hang
    stuck.bind(("127.0.0.1", 0))
    stuck.listen(64)
    monkeypatch.setenv("MODEL_ENDPOINT", f"http://127.0.0.1:{stuck.getsockname()[1]}/")
    try:
        with _two(tiny, sources=Sources(cache=True)) as r, serving(r) as base, \
                httpx.Client(base_url=base, timeout=60) as http:
            answers = [http.post("/models", json={"model": f"test/m{i}:Q8_0"}) for i in range(12)]
            codes = [a.status_code for a in answers]
            assert codes[:4] == [200] * 4 and set(codes[4:]) == {429}
            assert answers[-1].headers["retry-after"] and "downloads" in answers[-1].json()["error"]["message"]
            assert len(r.status()["downloads"]) == 4
            for i in range(4):  # cancelled: gone from the list, not listed as failed
                assert http.delete("/models", params={"model": f"test/m{i}:Q8_0"}).status_code == 200
            assert wait_for(lambda: not r.status()["downloads"], what="the cancelled downloads gone")
            # a transfer that never moves never asks whether it is cancelled: killed after the grace,
            # its slot then free
            assert wait_for(lambda: http.post("/models", json={"model": "test/again:Q8_0"}).status_code == 200,
                            timeout=3 * CANCEL_GRACE, what="a slot free again")
    finally:
        stuck.close()


def test_the_failed_pulls_listed_are_bounded(monkeypatch):
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))
    port = refused.getsockname()[1]
    refused.close()  # nothing listens there: each download fails at once
    monkeypatch.setenv("MODEL_ENDPOINT", f"http://127.0.0.1:{port}/")
    ended: list[str] = []
    downloads = Downloads(EventBus(), lambda name, path, error: ended.append(name), max_failed=2)
    for i in range(3):  # not a repository's name: llama.cpp's downloader refuses it (a failure)
        downloads.start(f"bad-name-{i}")
        wait_for(lambda: len(ended) == i + 1, what=f"download {i} to fail")
    assert list(downloads.status()) == ["bad-name-1", "bad-name-2"]  # the newest failures
    assert all(d["status"] == "failed" and d["error"] for d in downloads.status().values())


def test_a_pull_whose_listing_fails_still_frees_its_slot(monkeypatch):
    """The call that lists a pulled model (a reload: a bad preset, a failed cache listing)
    may raise: the download's slot is free all the same, so later pulls are not 429."""
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))
    port = refused.getsockname()[1]
    refused.close()
    monkeypatch.setenv("MODEL_ENDPOINT", f"http://127.0.0.1:{port}/")
    ended: list[str] = []

    def listing_fails(name, path, error):
        ended.append(name)
        raise ValueError("the preset is bad now")

    downloads = Downloads(EventBus(), listing_fails, max_active=1)
    for i in range(3):
        downloads.start(f"bad-name-{i}")  # Busy if an earlier one still held the only slot
        wait_for(lambda: downloads.status().get(f"bad-name-{i}", {}).get("status") == "failed",
                 what=f"download {i} ended")
    assert len(ended) == 3


def test_a_cancelled_pull_leaves_no_partial_file(tiny, tmp_path, monkeypatch):
    """DELETE /models while a pull runs cancels it as llama.cpp cancels: its downloader stops
    and deletes the .downloadInProgress file, which nothing would list or delete later."""
    from pyllmrouter.tools.hub import LocalHub

    big = tmp_path / "big.gguf"
    big.write_bytes(Path(tiny["tiny-llama"]).read_bytes() + bytes(24 << 20))
    cache = Path(os.environ["LLAMA_CACHE"])
    with LocalHub({"test/big": {"big-Q8_0.gguf": big}}, rate=4 << 20) as endpoint:  # about 6 s
        monkeypatch.setenv("MODEL_ENDPOINT", endpoint)
        with _two(tiny, sources=Sources(cache=True)) as r, serving(r) as base, \
                httpx.Client(base_url=base, timeout=60) as http:
            assert http.post("/models", json={"model": "test/big:Q8_0"}).status_code == 200
            partial = wait_for(lambda: list(cache.rglob("*.downloadInProgress")), what="the transfer under way")
            assert http.delete("/models", params={"model": "test/big:Q8_0"}).json() == {"success": True}
            wait_for(lambda: not any(p.exists() for p in partial), timeout=CANCEL_GRACE, what="the partial file gone")
            assert "test/big:Q8_0" not in r.status()["downloads"]  # cancelled, not failed
