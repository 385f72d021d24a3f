"""The scheduler's features at their edges: instances whose names are still held, queue
limits and instance loads, a model's own instance back after an eviction, reloads that
bring a model back, load attempts that answer late, kept states within their RAM and in a
directory nobody else may touch.  Through HTTP where a user meets them (in-process
servers, so the router's own state can be read beside the answers)."""

from __future__ import annotations

import json
import os
import pwd
import threading
import time

import httpx
import pytest

from pyllmrouter import ModelConfig, ModelSpec, Router, probe
from pyllmrouter.devices import EmulatedInventory
from pyllmrouter.router.workers.keep import KeepStore
from test_live import serving, wait_for

CHAT = [{"role": "user", "content": "a story"}]


class Stream:
    """One endless streamed chat, read in a thread of its own until ``close``."""

    def __init__(self, base: str, model: str):
        self.started, self.stop, self.status = threading.Event(), threading.Event(), None
        self.thread = threading.Thread(target=self._run, args=(base, model), daemon=True)
        self.thread.start()

    def _run(self, base: str, model: str) -> None:
        try:
            with httpx.stream("POST", base + "/v1/chat/completions", timeout=120,
                              json={"model": model, "messages": CHAT, "max_tokens": 100000, "stream": True}) as r:
                self.status = r.status_code
                for _ in r.iter_lines():
                    self.started.set()
                    if self.stop.is_set():
                        return
        except httpx.HTTPError:
            pass
        finally:
            self.started.set()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)


def chat(base: str, model: str, tokens: int = 8) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", timeout=120,
                      json={"model": model, "messages": CHAT, "max_tokens": tokens})


def state(router: Router, name: str) -> str | None:
    return router.status()["models"].get(name, {}).get("state")


def instances(router: Router, model: str) -> dict[str, dict]:
    return {n: m for n, m in router.status()["models"].items() if n == model or m.get("replica_of") == model}


def grows_behind_a_stream(r: Router, base: str) -> None:
    """One stream in ``m``'s one slot, a second waiting for it: ``m#2`` loads, and no extra
    instance was given up on the way."""
    first = Stream(base, "m")
    assert first.started.wait(60)
    second = Stream(base, "m")  # waits for the slot: an extra instance is asked for
    try:
        wait_for(lambda: state(r, "m#2") == "loaded", 60,
                 lambda: f"the second instance: {instances(r, 'm')}, events {r.scheduler.bus.recent()[-12:]}")
    finally:
        first.close()
        second.close()
    assert not [e for e in r.scheduler.bus.recent() if e.event == "replica-not-loaded"]


def one_instance_per_gpu(story, gpus: int = 3) -> tuple[ModelSpec, EmulatedInventory]:
    spec = ModelSpec(story, ("-np", "1", "-c", "2048", "--context-shift"))  # its streams last until stopped
    one = probe(spec).total
    return spec, EmulatedInventory({f"GPU{i}": one + one // 2 for i in range(gpus)})


pytestmark = pytest.mark.slow


def test_an_instance_name_still_held_by_an_old_instance_is_not_taken_again(story, tmp_path):
    """A reload changes ``m`` while its extra instance ``m#2`` still serves: the new ``m``
    grows under load, and its extra instance gets a free name (before: ``m#2`` again, a
    ValueError, a 500 for the request and two leases leaked each time, so ``m`` could never
    be unloaded)."""
    _, inventory = one_instance_per_gpu(story)
    preset = tmp_path / "models.ini"
    preset.write_text(f"[m]\nmodel = {story}\nnp = 1\nc = 2048\ncontext-shift = true\nreplicas = 2\n")
    with Router.from_preset(preset, inventory=inventory, margin=0) as r, serving(r) as base:
        first, second = Stream(base, "m"), Stream(base, "m")
        wait_for(lambda: state(r, "m#2") == "loaded", 120, "the second instance")
        third = Stream(base, "m")  # on m#2, the instance with the fewest in flight
        wait_for(lambda: instances(r, "m")["m#2"]["leases"] == 1, 60, "a request on m#2")
        first.close()
        second.close()
        preset.write_text(f"[m]\nmodel = {story}\nnp = 1\nc = 1024\ncontext-shift = true\nreplicas = 2\n")  # m changes
        assert httpx.get(base + "/models?reload=1", timeout=60).status_code == 200
        wait_for(lambda: r.status()["models"]["m"].get("pending") is None, 60, "the new m")
        assert "m#2" in r.status()["models"]  # the old extra instance still serves
        codes = []
        clients = [threading.Thread(target=lambda: codes.append(chat(base, "m", 40).status_code)) for _ in range(3)]
        for c in clients:
            c.start()
        for c in clients:
            c.join(120)
        assert codes == [200, 200, 200]
        third.close()
        wait_for(lambda: all(m["leases"] == 0 for m in instances(r, "m").values()), 60, "every lease back")
        assert httpx.post(base + "/models/unload", json={"model": "m"}, timeout=120).json()["success"] is True


def test_a_full_queue_does_not_stop_the_instance_it_asks_for(story):
    """``max-queue = 1``: the request that fills the queue asks for a second instance, whose
    load is no request (before: refused by the same limit, "'m#2' has 1 requests waiting",
    so none ever loaded when it was needed)."""
    spec, inventory = one_instance_per_gpu(story, 2)
    with Router([ModelConfig("m", spec, replicas=2, max_queue=1)], inventory=inventory, margin=0) as r, \
            serving(r) as base:
        grows_behind_a_stream(r, base)  # the second stream fills the queue


def test_an_extra_instance_whose_load_outlasts_a_turn_still_loads(story):
    """An extra instance's load is asked to find room within a turn (it drains nothing);
    once admitted, it waits for a new worker's start and its load, as any load (before:
    given up a turn after it was asked, its load under way, so on a slow machine no extra
    instance ever served)."""
    spec, inventory = one_instance_per_gpu(story, 2)
    with Router([ModelConfig("m", spec, replicas=2)], inventory=inventory, margin=0, turn=0.2) as r, \
            serving(r) as base:
        grows_behind_a_stream(r, base)


def test_a_model_whose_own_instance_went_loads_it_again_where_it_was(story):
    """The model's own instance unloaded (an eviction, an unload, a dead worker) while an
    extra one serves: requests that wait there bring it back, on the device it left
    (before: that device counted as the model's still, no instance could go there, and
    every request queued on the one extra instance)."""
    spec, inventory = one_instance_per_gpu(story, 2)
    with Router([ModelConfig("m", spec, replicas=2)], inventory=inventory, margin=0) as r, serving(r) as base:
        first, second = Stream(base, "m"), Stream(base, "m")
        wait_for(lambda: state(r, "m#2") == "loaded", 120, "the second instance")
        third = Stream(base, "m")
        wait_for(lambda: instances(r, "m")["m#2"]["leases"] >= 1, 60, "a request on m#2")
        first.close()
        second.close()
        wait_for(lambda: instances(r, "m")["m"]["leases"] == 0, 60, "m idle")
        assert r.unload("m", 60)
        assert state(r, "m") == "unloaded" and state(r, "m#2") == "loaded"
        more = [Stream(base, "m") for _ in range(2)]  # they wait on m#2's one slot
        try:
            wait_for(lambda: state(r, "m") == "loaded", 60, "m back")
        finally:
            for s in [third, *more]:
                s.close()
        devices = {n: tuple(m["devices"]) for n, m in instances(r, "m").items() if m["state"] == "loaded"}
        assert len(set(devices.values())) == len(devices) == 2  # each on a device of its own


def test_a_reload_that_lists_a_removed_model_again_keeps_it(tiny, story, tmp_path):
    """A model removed by a reload while it serves, then listed again by the next reload,
    with a new model beside it: the reload applies whole, the model stays (before: the new
    model was added, the reload failed on the name, and once the request ended the model
    was gone: "unknown model")."""
    preset = tmp_path / "models.ini"
    a = f"[a]\nmodel = {tiny['tiny-llama']}\nc = 512\n"
    b = f"[b]\nmodel = {story}\nnp = 1\nc = 2048\ncontext-shift = true\n"
    preset.write_text(a + b)
    with Router.from_preset(preset, inventory=EmulatedInventory({"GPU0": 8 << 30}), margin=0) as r, \
            serving(r) as base:
        busy = Stream(base, "b")
        assert busy.started.wait(60)
        preset.write_text(a)
        assert httpx.get(base + "/models?reload=1", timeout=60).status_code == 200
        assert r.status()["models"]["b"]["pending"] == "remove"
        preset.write_text(a + b + f"[c]\nmodel = {tiny['tiny-llama']}\nc = 256\n")
        reloaded = httpx.get(base + "/models?reload=1", timeout=60)
        assert reloaded.status_code == 200, reloaded.text
        busy.close()
        time.sleep(2)  # b's request ended: had it stayed removed, it would be gone now
        listed = {m["id"] for m in httpx.get(base + "/models", timeout=30).json()["data"]}
        assert {"a", "b", "c"} <= listed
        assert chat(base, "b").status_code == 200


def test_a_model_renamed_while_it_serves_is_listed_at_once_and_its_old_name_names_it(tiny, story, tmp_path):
    """A reload renames a busy model (``old`` goes, ``new`` comes with ``old`` as its alias):
    the reload applies whole and at once, ``new`` is listed and ``old`` names it while the
    old model finishes its request (before: the reload raised half-way, the alias still
    ``old``'s; then ``new`` waited for ``old`` to go)."""
    preset = tmp_path / "models.ini"
    preset.write_text(f"[old]\nmodel = {story}\nnp = 1\nc = 2048\ncontext-shift = true\n")
    with Router.from_preset(preset, inventory=EmulatedInventory({"GPU0": 8 << 30}), margin=0) as r, \
            serving(r) as base:
        busy = Stream(base, "old")
        assert busy.started.wait(60)
        preset.write_text(f"[new]\nmodel = {story}\nnp = 1\nc = 2048\ncontext-shift = true\nalias = old\n")
        reloaded = httpx.get(base + "/models?reload=1", timeout=60)
        assert reloaded.status_code == 200, reloaded.text
        assert [c.name for c in r.models()] == ["new"]
        assert r.scheduler.canonical("old") == "new"
        assert chat(base, "old").status_code == 200  # new answers, beside old's last request
        assert state(r, "old") == "loaded"
        busy.close()
        wait_for(lambda: "old" not in r.status()["models"], 60, "old gone")
        assert chat(base, "old").status_code == 200


def test_a_load_attempt_that_comes_late_changes_nothing_of_the_next(tiny):
    """A load whose worker died while it began: a new attempt starts; the first attempt's
    job, running late, leaves the model alone, and the second loads it (before: any job
    found the model LOADING and acted on it, its late failure ending the new attempt)."""
    from pyllmrouter.router.policy.state import State

    with Router([ModelConfig("m", ModelSpec(tiny["tiny-llama"], ("-c", "512")))],
                inventory=EmulatedInventory({"GPU0": 4 << 30}), margin=0) as r:
        book, jobs = r.scheduler.book, r.scheduler.jobs
        rec = book.get("m")
        need = probe(rec.config.spec).devices[-1].total
        with book.locked():
            first = book.start_load(rec, frozenset({"GPU0"}), {"GPU0": need}, None, None)
            book.move(rec, State.UNLOADED, "worker process 1 died")  # its worker died
            second = book.start_load(rec, frozenset({"GPU0"}), {"GPU0": need}, None, None)
        jobs.load(rec, first)  # late: the model is in its second attempt
        assert state(r, "m") == "loading" and rec.loads == 0
        jobs.load(rec, second)
        assert state(r, "m") == "loaded" and rec.loads == 1
        assert httpx is not None and r.chat("m", CHAT, max_tokens=2)["choices"]


def test_kept_states_never_take_more_ram_than_their_budget(tiny, tmp_path):
    """An unload saves only the slots whose state fits what is left of the RAM budget (its
    size known before it is written), the reservation counted from the start; a load
    restores states where they lie, moving none back into RAM (before: every busy slot was
    written into RAM and counted only after, and a load moved disk states back)."""
    from pyllmrouter.engine.loader import load
    from pyllmrouter.engine.slots import save_all

    engine = load(ModelSpec(tiny["tiny-llama"], ("-c", "1024", "-np", "2")))
    try:
        for slot in range(2):
            engine.handle("POST", "/completion", {}, {}, json.dumps({
                "prompt": "word " * (10 + 50 * slot), "n_predict": 1, "id_slot": slot}).encode())
        sizes = [engine.slot_state_size(s) for s in range(2)]
        assert 0 < sizes[0] < sizes[1]
        d = tmp_path / "ram"
        d.mkdir(mode=0o700)
        budget = sizes[0] + 8 * engine.n_ctx + 4096  # room for the small one only
        kept = save_all(engine, str(d), budget)
        assert [k[0] for k in kept] == ["slot0.bin"] and sum(k[2] for k in kept) <= budget
        assert sorted(p.name for p in d.iterdir()) == ["slot0.bin"]
    finally:
        engine.close()
    store = KeepStore(1 << 20, tmp_path / "disk", 1 << 30, ram_dir=tmp_path / "ram2")
    token, free = store.reserve()
    assert free == 1 << 20 and store.held_ram() == 1 << 20  # counted at once
    store.release(token)
    assert store.held_ram() == 0
    store.close()


def _nobody() -> tuple[int, int]:
    p = pwd.getpwnam("nobody")
    return p.pw_uid, p.pw_gid


@pytest.mark.skipif(os.getuid() != 0, reason="making files of another user needs root")
def test_a_kept_state_directory_another_user_holds_is_refused(tmp_path, tiny):
    """``--kv-keep-dir`` made first by another local user (``nobody``, mode 0777): refused
    at start, the message naming it, its owner and its mode (before: used, and a state that
    user planted was offered for restore)."""
    uid, gid = _nobody()
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    os.chown(d, uid, gid)
    with pytest.raises(ValueError, match=r"belongs to nobody with mode 0777"):
        KeepStore(1 << 20, d, 1 << 30, ram_dir=tmp_path / "ram")
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    os.chmod(mine, 0o777)  # ours, but others may write it
    with pytest.raises(ValueError, match=r"with mode 0777"):
        KeepStore(1 << 20, mine, 1 << 30, ram_dir=tmp_path / "ram")
    import subprocess
    import sys

    preset = tmp_path / "p.ini"
    preset.write_text(f"[a]\nmodel = {tiny['tiny-llama']}\n")
    out = subprocess.run([sys.executable, "-m", "pyllmrouter.cli", "serve", "--models-preset", str(preset),
                          "--no-models-cache", "--emulate-devices", "GPU0=4GiB", "--kv-keep-dir", str(d),
                          "--port", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and str(d) in out.stderr and "nobody" in out.stderr


@pytest.mark.skipif(os.getuid() != 0, reason="making files of another user needs root")
def test_links_and_files_another_user_plants_are_neither_followed_nor_indexed(tmp_path):
    """In our own directory: a state another user (``nobody``) planted, with a sidecar that
    matches, is not indexed; a link planted where a spill writes is replaced, its target (a
    file of root's) untouched (before: indexed and offered; followed by shutil.move)."""
    uid, gid = _nobody()
    disk = tmp_path / "disk"
    disk.mkdir(mode=0o700)
    planted = disk / "abc"
    planted.mkdir(mode=0o700)
    (planted / "slot0.bin").write_bytes(b"x" * 100)
    (planted / "slot0.meta").write_text(json.dumps({"tokens": 1, "size": 100, "crc": 0}))
    for p in (planted / "slot0.bin", planted / "slot0.meta"):
        os.chown(p, uid, gid)
    store = KeepStore(1 << 20, disk, 1 << 30, ram_dir=tmp_path / "ram")
    assert store.status() == {}  # not indexed
    store.close()
    # a state saved in RAM (a tmpfs: another file system), spilled to disk where a link of
    # another user's waits at its name
    store = KeepStore(1 << 20, disk, 1 << 30)
    ident = "i" * 24
    (store.dir_for(ident) / "slot0.bin").write_bytes(b"y" * 1000)
    victim = tmp_path / "root-owned"
    victim.write_bytes(b"precious")
    (disk / ident).mkdir(mode=0o700)
    os.symlink(victim, disk / ident / "slot0.bin")
    os.lchown(disk / ident / "slot0.bin", uid, gid)
    store.add(ident, [("slot0.bin", 5, 1000)])
    store.spill()
    assert victim.read_bytes() == b"precious"
    assert not (disk / ident / "slot0.bin").is_symlink() and (disk / ident / "slot0.bin").read_bytes() == b"y" * 1000
    store.close()


def test_an_instance_s_kept_states_go_with_its_model(tmp_path):
    """Forgetting ``m`` forgets ``m#2``'s states too (before: only those named ``m``)."""
    store = KeepStore(1 << 20, None, 0, ram_dir=tmp_path / "ram")
    for ident, model in (("a" * 24, "m"), ("b" * 24, "m#2"), ("c" * 24, "mm")):
        (store.dir_for(ident, model) / "slot0.bin").write_bytes(b"z" * 10)
        store.add(ident, [("slot0.bin", 1, 10)])
    store.forget("m")
    assert set(store.report()["models"]) == {"mm"}
    store.close()
