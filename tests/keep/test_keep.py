"""Prompt states kept across eviction: the store's budgets (pure file work), and a
conversation that survives its model's eviction (real workers, real slot saves)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pyllmrouter import ModelSpec
from pyllmrouter.config import ModelConfig
from pyllmrouter.devices import EmulatedInventory
from pyllmrouter.engine.loader import load, request
from pyllmrouter.engine.slots import restore_all, save_all
from pyllmrouter.router.api import Router
from pyllmrouter.router.workers.keep import KeepStore, identity
from pyllmrouter.tools import tinymodels


def saved(store: KeepStore, ident: str, name: str, size: int) -> tuple[str, int, int]:
    """A slot file of ``size`` bytes as an engine would have written it."""
    (store.dir_for(ident) / name).write_bytes(b"x" * size)
    return (name, size // 10, size)


# -- the store ------------------------------------------------------------------

def test_ram_over_budget_goes_to_disk_least_recently_saved_first_and_disk_keeps_its_cap(tmp_path):
    store = KeepStore(ram_budget=250, disk_dir=tmp_path / "disk", disk_budget=250, ram_dir=tmp_path / "ram",
                      page=1, sidecar=0)
    for i, ident in enumerate(["m1", "m2", "m3"]):
        store.add(ident, [saved(store, ident, "slot0.bin", 100)])
    # m1 was saved first: it went to disk; RAM holds 200 of its 250
    assert store.held_ram() == 200
    assert store.status() == {"m1": {"ram": 0, "disk": 100, "files": 1}, "m2": {"ram": 100, "disk": 0, "files": 1},
                              "m3": {"ram": 100, "disk": 0, "files": 1}}
    assert (tmp_path / "disk" / "m1" / "slot0.bin").stat().st_size == 100
    for ident in ["m4", "m5"]:
        store.add(ident, [saved(store, ident, "slot0.bin", 100)])
    # RAM 200 (m4, m5), disk at most 250: m1, m2, m3 went there, the oldest (m1) dropped
    assert store.held_ram() == 200 and sum(s["disk"] for s in store.status().values()) == 200
    assert "m1" not in store.status() and store.counters["dropped"] == 1
    assert not (tmp_path / "disk" / "m1" / "slot0.bin").exists()


def test_kept_states_are_the_users_alone(tmp_path):
    """A kept state holds a conversation's tokens: its directories are 0700 and its files
    0600, in RAM and on disk, whatever the engine's umask made them."""
    os.umask(old := os.umask(0o022))
    try:
        store = KeepStore(ram_budget=100, disk_dir=tmp_path / "disk", disk_budget=1000, ram_dir=tmp_path / "ram", page=1, sidecar=0)
        store.add("m1", [saved(store, "m1", "slot0.bin", 100)])
        store.add("m2", [saved(store, "m2", "slot0.bin", 100)])  # m1 goes to disk
    finally:
        os.umask(old)
    mode = lambda p: p.stat().st_mode & 0o777  # noqa: E731
    for place, ident in ((tmp_path / "disk", "m1"), (tmp_path / "ram", "m2")):
        assert mode(place / ident) == 0o700, place
        assert {mode(f) for f in (place / ident).iterdir()} == {0o600}, place
    assert mode(tmp_path / "disk") == 0o700


def test_a_planted_owner_file_neither_hangs_a_starting_router_nor_is_trusted(tmp_path):
    """reclaim (a router starting) meets what another local user may have planted in the
    shared RAM folder: a FIFO as a directory's owner file (an open would wait for a
    writer forever), a link, another user's directory.  It returns at once and removes
    none of them."""
    import stat
    import threading

    from pyllmrouter.router.workers.keep import reclaim

    fifo = tmp_path / "pyllmrouter-kv-fifo"
    fifo.mkdir()
    os.mkfifo(fifo / ".owner")
    link = tmp_path / "pyllmrouter-kv-link"
    link.mkdir()
    (tmp_path / "elsewhere").write_text("not an owner file")
    os.symlink(tmp_path / "elsewhere", link / ".owner")
    linked_dir = tmp_path / "pyllmrouter-kv-linked"
    os.symlink(tmp_path / "elsewhere-dir", linked_dir)
    (tmp_path / "elsewhere-dir").mkdir()
    theirs = tmp_path / "pyllmrouter-kv-theirs"
    theirs.mkdir()
    if os.getuid() == 0:
        os.chown(theirs, 12345, 12345)
    gone: list = []
    t = threading.Thread(target=lambda: gone.extend(reclaim(tmp_path)), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "reclaim waited on a FIFO"
    assert gone == [] and stat.S_ISFIFO(os.lstat(fifo / ".owner").st_mode)
    assert (link / ".owner").is_symlink() and (tmp_path / "elsewhere-dir").is_dir() and theirs.is_dir()


def test_without_a_disk_directory_what_overflows_is_dropped(tmp_path):
    store = KeepStore(ram_budget=150, ram_dir=tmp_path / "ram", page=1, sidecar=0)
    store.add("a", [saved(store, "a", "slot0.bin", 100)])
    store.add("b", [saved(store, "b", "slot0.bin", 100)])
    assert store.status() == {"b": {"ram": 100, "disk": 0, "files": 1}} and store.counters["dropped"] == 1
    assert not (tmp_path / "ram" / "a" / "slot0.bin").exists()


def test_prepare_offers_states_where_they_lie_and_consumed_deletes_them(tmp_path):
    """A load restores the states from RAM and from disk as they lie: none moves back into
    RAM (which would pass its budget), and after a load that fails they are where they were."""
    store = KeepStore(ram_budget=100, disk_dir=tmp_path / "disk", disk_budget=1000, ram_dir=tmp_path / "ram", page=1, sidecar=0)
    store.add("a", [saved(store, "a", "slot0.bin", 80), saved(store, "a", "slot1.bin", 80)])  # one to disk
    assert store.status()["a"] == {"ram": 80, "disk": 80, "files": 2}
    names = store.prepare("a")
    assert sorted(Path(n).parent.parent.name for n in names) == ["disk", "ram"]
    assert [Path(n).name for n in names] == ["slot0.bin", "slot1.bin"] and all(Path(n).exists() for n in names)
    assert store.status()["a"] == {"ram": 80, "disk": 80, "files": 2} and store.held_ram() == 80
    store.consumed("a", names, {"slot0.bin": 8}, {"slot1.bin": "invalid slot save file"})
    assert store.status() == {} and store.held_ram() == 0
    assert store.counters["restores"] == 1 and store.counters["restored_tokens"] == 8
    assert store.counters["discarded"] == 1
    assert not any((tmp_path / "ram" / "a").iterdir())


def test_the_ram_figure_is_read_without_waiting_for_the_stores_file_work(tmp_path):
    """The scheduler reads held_ram under its own lock: it must not wait while the store
    moves or checks files under the store's."""
    import threading

    store = KeepStore(ram_budget=1000, ram_dir=tmp_path / "ram", page=1, sidecar=0)
    store.add("a", [saved(store, "a", "slot0.bin", 100)])
    got = []
    with store._lock:  # the store busy with file work
        reader = threading.Thread(target=lambda: got.append(store.held_ram()))
        reader.start()
        reader.join(2)
    assert got == [100]


def test_a_damaged_state_is_never_offered(tmp_path):
    store = KeepStore(ram_budget=1000, ram_dir=tmp_path / "ram", page=1, sidecar=0)
    store.add("a", [saved(store, "a", "slot0.bin", 100), saved(store, "a", "slot1.bin", 100)])
    flipped = tmp_path / "ram" / "a" / "slot0.bin"
    flipped.write_bytes(b"y" + flipped.read_bytes()[1:])  # same size, other bytes
    truncated = tmp_path / "ram" / "a" / "slot1.bin"
    truncated.write_bytes(truncated.read_bytes()[:50])
    assert store.prepare("a") == []
    assert store.counters["discarded"] == 2 and not flipped.exists() and not truncated.exists()


def test_states_on_disk_are_offered_again_after_a_restart(tmp_path):
    store = KeepStore(ram_budget=10, disk_dir=tmp_path / "disk", disk_budget=1000, ram_dir=tmp_path / "ram", page=1, sidecar=0)
    store.add("a", [saved(store, "a", "slot0.bin", 100)])  # over the RAM budget: to disk
    store.close()
    again = KeepStore(ram_budget=10, disk_dir=tmp_path / "disk", disk_budget=1000, ram_dir=tmp_path / "ram2", page=1, sidecar=0)
    assert again.status() == {"a": {"ram": 0, "disk": 100, "files": 1}}
    assert again.prepare("a") == [str(tmp_path / "disk" / "a" / "slot0.bin")]  # offered where it lies


def test_identity_follows_the_name_the_file_and_every_argument(tiny, tmp_path):
    spec = ModelSpec(tiny["tiny-llama"], n_ctx=512)
    assert identity("m", spec) == identity("m", ModelSpec(tiny["tiny-llama"], n_ctx=512))
    assert identity("m", spec) != identity("m", spec.replace(n_ctx=1024))
    assert identity("m", spec) != identity("m", spec.with_args("-ctk", "q8_0"))
    # arguments that change what the KV holds without changing its size: another state
    assert identity("m", spec) != identity("m", spec.with_args("--rope-freq-base", "20000"))
    assert identity("m", spec) != identity("other", spec)  # two models over one file never share files
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(Path(tiny["tiny-llama"]).read_bytes())
    assert identity("m", spec) != identity("m", spec.replace(path=str(copy)))  # another file, same bytes
    assert identity("m", spec.replace(path=str(tmp_path / "gone.gguf"))) is None


# -- the engine's own slot actions ------------------------------------------------

LONG = "tell me a long story about the sea and the ships " * 8


def test_llama_cpp_refuses_a_state_that_does_not_fit_the_slot(tiny, tmp_path):
    spec = ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=1024)
    engine = load(spec)  # no --slot-save-path: the router's own calls need none
    try:
        request(engine, "/v1/completions", {"prompt": LONG, "max_tokens": 2})
        (kept,) = save_all(engine, str(tmp_path))
    finally:
        engine.close()
    assert kept[0] == "slot0.bin" and kept[1] > 128 and kept[2] == os.path.getsize(tmp_path / "slot0.bin")
    small = load(spec.replace(n_ctx=128))
    try:
        restored, refused = restore_all(small, [str(tmp_path / "slot0.bin")])
    finally:
        small.close()
    assert restored == {} and "slot0.bin" in refused


# -- through the router ------------------------------------------------------------

def conversation(router: Router, evict: bool) -> tuple[list[str], list[int]]:
    """Two turns with model a; between them (if ``evict``) model b takes a's place."""
    messages = [{"role": "user", "content": LONG}]
    answers, cached = [], []
    for turn in range(2):
        reply = router.chat("a", messages, max_tokens=8, temperature=0)
        answers.append(reply["choices"][0]["message"]["content"])
        cached.append(reply["usage"]["prompt_tokens_details"]["cached_tokens"])
        messages += [{"role": "assistant", "content": answers[-1]}, {"role": "user", "content": "and then?"}]
        if evict and turn == 0:
            router.chat("b", [{"role": "user", "content": "hi"}], max_tokens=2)
    return answers, cached


def two_models(tiny, **options) -> Router:
    models = [ModelConfig("a", ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=1024)),
              ModelConfig("b", ModelSpec(tiny["tiny-moe"], ("-np", "1"), n_ctx=512))]
    return Router(models, inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0, max_models=1, **options)


@pytest.mark.slow
def test_an_evicted_model_resumes_its_conversation_as_if_it_never_left(tiny):
    with two_models(tiny, kv_keep_ram=0) as r:  # never evicted: the reference
        reference, _ = conversation(r, evict=False)
    with two_models(tiny, kv_keep_ram=0) as r:  # evicted, nothing kept
        answers, cached = conversation(r, evict=True)
        assert answers == reference and cached[1] == 0
    with two_models(tiny, kv_keep_ram=64 << 20) as r:  # evicted, its state kept
        answers, cached = conversation(r, evict=True)
        assert answers == reference
        assert cached[1] > 300  # the first turn's prompt came back from the kept state
        events = [(what, name) for _, what, name, _ in r.scheduler.events]
        assert events == [("load", "a"), ("evict", "a"), ("load", "b"), ("evict", "b"), ("load", "a")]
        status = r.status()
        assert status["kept"]["counters"]["restores"] == 1 and status["models"]["a"]["kept"]["files"] == 0
        assert status["models"]["b"]["kept"]["ram"] > 0  # b's state waits in RAM for b
        assert status["kept"]["counters"]["hits"] == 0  # counted when a leaves again
        r.chat("b", [{"role": "user", "content": "hi"}], max_tokens=2)
        assert r.status()["kept"]["counters"]["hits"] == 1  # the restored state served the second turn


@pytest.mark.slow
def test_a_truncated_state_is_discarded_and_the_model_answers(tiny):
    with two_models(tiny, kv_keep_ram=64 << 20) as r:
        r.chat("a", [{"role": "user", "content": LONG}], max_tokens=2)
        r.chat("b", [{"role": "user", "content": "hi"}], max_tokens=2)  # a's state is saved
        (kept,) = r.scheduler.keep.ram_dir.rglob("*.bin")  # a's: b is still loaded
        data = kept.read_bytes()
        kept.write_bytes(data[: len(data) // 2])
        reply = r.chat("a", [{"role": "user", "content": LONG}], max_tokens=2)
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert r.status()["kept"]["counters"]["discarded"] == 1 and not kept.exists()
        r.chat("b", [{"role": "user", "content": "hi"}], max_tokens=2)
        assert r.status()["kept"]["counters"]["hits"] == 0  # nothing was restored, so nothing hit


@pytest.mark.slow
def test_a_state_never_restores_into_another_configuration(tiny):
    path = tiny["tiny-llama"]
    models = [ModelConfig("a", ModelSpec(path, ("-np", "1"), n_ctx=1024)),
              ModelConfig("a-long", ModelSpec(path, ("-np", "1"), n_ctx=2048))]
    with Router(models, inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0, max_models=1,
                kv_keep_ram=64 << 20) as r:
        r.chat("a", [{"role": "user", "content": LONG}], max_tokens=2)
        reply = r.chat("a-long", [{"role": "user", "content": LONG}], max_tokens=2)  # evicts a
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # a's state is not a-long's
        assert r.status()["models"]["a"]["kept"]["files"] == 1  # still kept, for a
        assert r.status()["kept"]["counters"]["restores"] == 0


WIDE = tinymodels.Shape("llama", n_embd=512, n_layer=4, n_head=8, n_head_kv=8, n_ff=1024, n_ctx_train=4096)


@pytest.mark.slow
def test_kept_states_give_host_memory_back_before_any_model_is_evicted(tmp_path):
    """Host memory with room for the bigger model and a little: loading it evicts the first,
    whose ~20 MB state fits the host memory left and is kept in RAM; the bigger model then
    needs that memory, and the state leaves RAM for the disk directory (a spill) before any
    model would be evicted; the first, back, restores it from disk."""
    from pyllmrouter import probe

    a = ModelSpec(tinymodels.write_llama(tmp_path / "a.gguf", WIDE), ("-np", "1"), n_ctx=4096)
    b = ModelSpec(str(tinymodels.write_llama(tmp_path / "b.gguf", WIDE, seed=1)), ("-np", "1"), n_ctx=8192)
    words = "the sea ship sail wind storm harbour light night star " * 60  # ~2500 tokens
    models = [ModelConfig("a", a, devices=("CPU",)), ModelConfig("b", b, devices=("CPU",))]
    with Router(models, inventory=EmulatedInventory({}, host=1 << 40), margin=0, kv_keep_ram=0) as r:
        r.load("a")
        worker = r.status()["workers"][0]["overhead"]["CPU"]  # the worker's own memory, counted as held
    host = worker + probe(b).total + (8 << 20)
    assert probe(b).total - probe(a).total > 24 << 20  # room for a's state beside a, not beside b
    with Router(models, inventory=EmulatedInventory({}, host=host), margin=0, kv_keep_ram=256 << 20,
                kv_keep_dir=str(tmp_path / "kept"), kv_keep_disk=256 << 20, queue_timeout=20) as r:
        r.chat("a", [{"role": "user", "content": words}], max_tokens=2)
        assert r.chat("b", [{"role": "user", "content": "hi"}], max_tokens=2)["choices"]
        events = [(what, name) for _, what, name, _ in r.scheduler.events]
        assert events[-3:] == [("evict", "a"), ("spill", "(kept prompt states)"), ("load", "b")], events
        assert r.status()["models"]["a"]["kept"]["disk"] > 16 << 20 and r.scheduler.keep.held_ram() == 0
        r.scheduler.check_invariant()
        reply = r.chat("a", [{"role": "user", "content": words}], max_tokens=2)
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 2000  # restored from disk


@pytest.mark.slow
def test_kept_states_never_take_host_memory_the_device_has_not_got(tmp_path):
    """Two models in host memory with room for one and 8 MB: loading the second evicts the
    first, whose ~20 MB state does not fit the 8 MB of host memory left: it is saved straight
    to the disk directory (before: into RAM, 12 MB past the host's size, then spilled); the
    second loads, and the first, back, restores it from disk."""
    from pyllmrouter import probe

    a = ModelSpec(tinymodels.write_llama(tmp_path / "a.gguf", WIDE), ("-np", "1"), n_ctx=4096)
    b = a.replace(path=str(tinymodels.write_llama(tmp_path / "b.gguf", WIDE, seed=1)))  # as big as a
    words = "the sea ship sail wind storm harbour light night star " * 60  # ~2500 tokens
    models = [ModelConfig("a", a, devices=("CPU",)), ModelConfig("b", b, devices=("CPU",))]
    with Router(models, inventory=EmulatedInventory({}, host=1 << 40), margin=0, kv_keep_ram=0) as r:
        r.load("a")
        worker = r.status()["workers"][0]["overhead"]["CPU"]  # the worker's own memory, counted as held
    host = worker + max(probe(a).total, probe(b).total) + (8 << 20)
    with Router(models, inventory=EmulatedInventory({}, host=host), margin=0, kv_keep_ram=256 << 20,
                kv_keep_dir=str(tmp_path / "kept"), kv_keep_disk=256 << 20, queue_timeout=20) as r:
        r.chat("a", [{"role": "user", "content": words}], max_tokens=2)
        assert r.chat("b", [{"role": "user", "content": "hi"}], max_tokens=2)["choices"]
        events = [(what, name) for _, what, name, _ in r.scheduler.events]
        assert events[-2:] == [("evict", "a"), ("load", "b")] and ("spill", "(kept prompt states)") not in events
        assert r.status()["models"]["a"]["kept"]["disk"] > 16 << 20 and r.scheduler.keep.held_ram() == 0
        r.scheduler.check_invariant()
        reply = r.chat("a", [{"role": "user", "content": words}], max_tokens=2)
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 2000  # restored from disk


def test_kept_states_count_what_the_file_system_charges_them():
    """A state in RAM counts as its tmpfs charges it: the file's pages and its sidecar's (before:
    its bytes alone, 10 where the RAM directory holds two pages)."""
    store = KeepStore(1 << 20)
    try:
        ident = "0123456789abcdef"
        d = store.dir_for(ident, "m")
        (d / "slot0.bin").write_bytes(b"s" * 10)
        store.add(ident, [("slot0.bin", 3, 10)])
        charged = sum(os.lstat(p).st_blocks * 512 for p in d.iterdir())
        assert store.kept_ram() >= charged > 10 and store.held_ram() >= charged
        assert store.kept_ram() == store.charged(10)
        for reserved in (0, 5000, 8192, 12289, 1 << 20):  # what an engine may write is charged within its reservation
            assert store.charged(store.writable(reserved, 1)) <= reserved or store.writable(reserved, 1) == 0
    finally:
        store.close()
