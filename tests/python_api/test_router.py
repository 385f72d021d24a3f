"""The router with real worker processes and real tiny models on emulated devices."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace

import pytest
from conftest import worker_pids

from pyllmrouter import ModelSpec, probe
from pyllmrouter.config import ModelConfig
from pyllmrouter.devices import EmulatedInventory
from pyllmrouter.errors import LoadFailed, NeverFits, QueueTimeout, UnknownModel, WorkerDied
from pyllmrouter.router.api import Router

pytestmark = pytest.mark.slow  # real worker processes

HI = [{"role": "user", "content": "hi"}]


SHARE_PROBE_CACHE = True


@pytest.fixture(scope="module")
def specs(tiny):
    return {
        "a": ModelSpec(tiny["tiny-llama"], n_ctx=512),
        "b": ModelSpec(tiny["tiny-moe"], n_ctx=512),
        "c": ModelSpec(tiny["tiny-llama"], n_ctx=256),
        "e": ModelSpec(tiny["tiny-bert"], ("--embedding",), n_ctx=256),
    }


@pytest.fixture(scope="module")
def need(specs):
    """Bytes each model needs on an emulated device (what the CPU probe measures)."""
    return {k: probe(s).total for k, s in specs.items()}


def make(specs, names, gpus, *, pins=None, **options):
    pins = pins or {}
    models = [ModelConfig(n, specs[n[0]], devices=pins.get(n)) for n in names]
    options.setdefault("margin", 0)
    return Router(models, inventory=EmulatedInventory(gpus), **options)


def held_stream(router, model):
    """Start a streaming request and keep it open: the model stays busy."""
    it = router.complete(model, "hello", max_tokens=8, stream=True, temperature=0.0)
    next(it)
    return it


def loads(router):
    return [(what, name) for _, what, name, _ in router.scheduler.events]


# -- the upstream router scenarios (llama-server test_router_*), in our words --

def test_concurrent_requests_to_two_models_with_room_for_one(specs):
    with make(specs, ["a", "b"], {"GPU0": 1 << 30}, max_models=1) as r:
        results, errors = [], []

        def go(m):
            try:
                results.append(r.chat(m, HI, max_tokens=4))
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=go, args=(m,)) for _ in range(3) for m in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and len(results) == 6
        # served in turns, not one load per request
        assert r.status()["counters"]["loads"] <= 3


def test_three_models_with_room_for_two(specs):
    with make(specs, ["a", "b", "c"], {"GPU0": 1 << 30}, max_models=2) as r:
        errors, n = [], []
        threads = [threading.Thread(target=lambda m=m: n.append(r.complete(m, "x", max_tokens=3)))
                   for m in ("a", "b", "c") for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(n) == 6 and not errors
        assert sum(v["state"] == "loaded" for v in r.status()["models"].values()) <= 2
        r.scheduler.check_invariant()


def test_alternating_requests(specs):
    with make(specs, ["a", "b"], {"GPU0": 1 << 30}, max_models=1) as r:
        for _ in range(3):
            assert r.chat("a", HI, max_tokens=3)["choices"]
            assert r.chat("b", HI, max_tokens=3)["choices"]
        assert loads(r).count(("evict", "a")) == 3 and loads(r).count(("evict", "b")) == 2


def test_many_concurrent_requests_share_one_load(specs):
    with make(specs, ["a"], {"GPU0": 1 << 30}) as r:
        out = []
        threads = [threading.Thread(target=lambda: out.append(r.complete("a", "x", max_tokens=3)))
                   for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(out) == 12
        assert r.status()["counters"]["loads"] == 1


# -- the two-GPU incident ----------------------------------------------------

def test_second_model_pinned_to_a_full_gpu_waits_then_evicts_and_never_oversubscribes(specs, need):
    gpu0 = max(need["a"], need["b"]) + min(need["a"], need["b"]) // 2  # one at a time
    pins = {"a": ("GPU0",), "b": ("GPU0",)}
    with make(specs, ["a", "b", "c"], {"GPU0": gpu0, "GPU1": 1 << 30}, pins=pins) as r:
        busy = held_stream(r, "a")
        with pytest.raises(QueueTimeout, match="'b'.*busy"):
            r.chat("b", HI, max_tokens=2, wait=1.0)
        assert r.status()["models"]["a"]["state"] == "loaded"  # busy: not evicted
        r.scheduler.check_invariant()
        list(busy)  # the request in flight finishes
        assert r.chat("b", HI, max_tokens=2)["choices"]
        assert loads(r)[-2:] == [("evict", "a"), ("load", "b")]
        # an unpinned model goes to the idle GPU, no eviction
        r.chat("c", HI, max_tokens=2)
        st = r.status()["models"]
        assert st["c"]["devices"] == ["GPU1"] and st["b"]["state"] == "loaded"
        r.scheduler.check_invariant()


def test_fifo_order_between_waiting_loads(specs, need):
    pins = {n: ("GPU0",) for n in "abc"}
    with make(specs, ["a", "b", "c"], {"GPU0": max(need.values()) + 1}, pins=pins, turn=0.1) as r:
        busy = held_stream(r, "a")
        done = []

        def go(m):
            try:
                done.append(r.complete(m, "x", max_tokens=2)["choices"][0]["finish_reason"])
            except Exception as e:  # noqa: BLE001
                done.append(repr(e))

        def queued(n):
            deadline = time.monotonic() + 30
            while r.status()["queue"] < n and time.monotonic() < deadline:
                time.sleep(0.01)

        tb = threading.Thread(target=go, args=("b",))
        tb.start()
        queued(1)
        tc = threading.Thread(target=go, args=("c",))
        tc.start()
        queued(2)
        list(busy)
        tb.join(60)
        tc.join(60)
        assert done == ["length", "length"]
        order = [name for what, name in loads(r) if what == "load"]
        assert order == ["a", "b", "c"]


def test_waiter_that_times_out_leaves_without_side_effects(specs, need):
    pins = {"a": ("GPU0",), "b": ("GPU0",)}
    with make(specs, ["a", "b"], {"GPU0": max(need.values()) + 1}, pins=pins) as r:
        busy = held_stream(r, "a")
        with pytest.raises(QueueTimeout):
            r.complete("b", "x", wait=0.5)
        st = r.status()
        assert st["queue"] == 0 and st["models"]["b"]["state"] == "unloaded"
        assert loads(r) == [("load", "a")]
        list(busy)
        assert r.complete("a", "x", max_tokens=2)["choices"]


def test_persistent_model_is_never_evicted(specs, need):
    models = [ModelConfig("a", specs["a"], devices=("GPU0",), persistent=True),
              ModelConfig("b", specs["b"], devices=("GPU0",))]
    inv = EmulatedInventory({"GPU0": max(need.values()) + 1})
    with Router(models, inventory=inv, margin=0) as r:
        r.load("a")
        with pytest.raises(QueueTimeout):
            r.complete("b", "x", wait=0.8)
        assert r.status()["models"]["a"]["state"] == "loaded"


# -- failures ----------------------------------------------------------------

def test_worker_killed_mid_request_fails_it_and_spares_other_workers(specs):
    pins = {"a": ("GPU0",), "e": ("GPU1",)}
    with make(specs, ["a", "e"], {"GPU0": 1 << 30, "GPU1": 1 << 30}, pins=pins) as r:
        r.embed("e", "hello")
        # long enough to be running when the worker is killed: end of text biased away
        it = r.complete("a", "hello", max_tokens=500, logit_bias={2: -100, 4: -100}, stream=True)
        next(it)
        pid = next(w["pid"] for w in r.status()["workers"] if w["devices"] == ["GPU0"])
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerDied):
            for _ in it:
                pass
        assert time.monotonic() - t0 < 10
        st = r.status()
        assert st["models"]["a"]["state"] == "unloaded" and "died" in st["models"]["a"]["reason"]
        assert st["models"]["e"]["state"] == "loaded"
        assert r.embed("e", "again")["data"]
        assert r.complete("a", "x", max_tokens=2)["choices"]  # a new worker
        new_pid = next(w["pid"] for w in r.status()["workers"] if w["devices"] == ["GPU0"])
        assert new_pid != pid


def test_corrupt_model_file_is_a_clear_error_and_unloads_nothing(specs, tmp_path):
    """Refused when the router is made (its header read: no load), as llama-cpp-python's
    Llama refuses it; a file cut short after that fails its load, and nothing else moves."""
    bad = tmp_path / "broken.gguf"
    data = open(specs["a"].path, "rb").read()
    bad.write_bytes(data[: len(data) // 3])
    models = [ModelConfig("a", specs["a"], devices=("GPU0",)),
              ModelConfig("broken", ModelSpec(bad, n_ctx=512), devices=("GPU0",))]
    with pytest.raises(ValueError, match="model 'broken': .*broken.gguf is cut short"):
        Router(models, inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0)
    bad.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="model 'broken': .*broken.gguf is not a GGUF file: it starts with b'not '"):
        Router(models, inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0)
    bad.write_bytes(data)
    with Router(models, inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0, max_models=1) as r:
        r.load("a")
        bad.write_bytes(data[: len(data) // 3])  # cut short under the router
        with pytest.raises(LoadFailed, match="broken.gguf.*not within the file bounds"):
            r.complete("broken", "x")
        assert r.status()["models"]["a"]["state"] == "loaded"
        assert r.complete("a", "x", max_tokens=2)["choices"]
        with pytest.raises(ValueError, match="model 'more': .*cut short"):
            r.add_model(ModelConfig("more", ModelSpec(bad, n_ctx=512)))


def test_model_that_can_never_fit_fails_at_once_naming_the_device(specs, need):
    with make(specs, ["a"], {"GPU0": need["a"] // 2}, pins={"a": ("GPU0",)}) as r:
        t0 = time.monotonic()
        with pytest.raises(NeverFits, match=f"needs {need['a']} bytes .* on GPU0") as e:
            r.complete("a", "x", timeout=30)
        assert time.monotonic() - t0 < 10
        assert e.value.device == "GPU0" and e.value.need == need["a"] and e.value.capacity == need["a"] // 2


def test_unknown_model(specs):
    with make(specs, ["a"], {"GPU0": 1 << 30}) as r:
        with pytest.raises(UnknownModel, match="'zzz'.*known models: a"):
            r.complete("zzz", "x")


# -- lifecycle -----------------------------------------------------------------

def test_ttl_unloads_an_idle_model(specs):
    models = [ModelConfig("a", specs["a"], ttl=0.5)]
    with Router(models, inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0) as r:
        r.complete("a", "x", max_tokens=2)
        deadline = time.monotonic() + 10
        while r.status()["models"]["a"]["state"] != "unloaded" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert r.status()["models"]["a"]["state"] == "unloaded"


def test_load_on_startup(specs):
    models = [ModelConfig("a", specs["a"], load_on_startup=True)]
    with Router(models, inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0) as r:
        deadline = time.monotonic() + 30
        while r.status()["models"]["a"]["state"] != "loaded" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.status()["models"]["a"]["state"] == "loaded"


def test_cancelled_stream_frees_the_model(specs):
    with make(specs, ["a"], {"GPU0": 1 << 30}) as r:
        it = r.complete("a", "hello", max_tokens=400, stream=True)
        next(it)
        it.close()
        deadline = time.monotonic() + 10
        while r.status()["models"]["a"]["leases"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert r.status()["models"]["a"]["leases"] == 0
        assert r.complete("a", "x", max_tokens=2)["choices"]


def test_async_api(specs):
    import asyncio

    async def go(r):
        out = await r.achat("a", HI, max_tokens=3)
        chunks = [c async for c in await r.acomplete("a", "x", max_tokens=3, stream=True)]
        emb = await r.aembed("e", ["a", "b"])
        return out, chunks, emb

    with make(specs, ["a", "e"], {"GPU0": 1 << 30}) as r:
        out, chunks, emb = asyncio.run(go(r))
        assert out["choices"][0]["message"]["role"] == "assistant"
        assert chunks and len(emb["data"]) == 2


@pytest.mark.parametrize("cached", [False, True], ids=["first-measure", "probe-cached"])
def test_the_worker_that_measured_a_model_serves_it(tiny, tmp_path, monkeypatch, cached):
    """A model's first request measures it in its own worker (its only device set: the
    load will be there), then loads it there: one process started, not two (on a GPU, one
    backend initialisation).  Measured before (the probe cache has it), measuring starts
    that worker all the same, so a router that measures ahead has it up for the load."""
    monkeypatch.setenv("PYLLMROUTER_CACHE", str(tmp_path))  # nothing measured yet
    spec = ModelSpec(tiny["tiny-llama"], n_ctx=256)
    if cached:
        with Router([ModelConfig("a", spec)], inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0) as r:
            r.scheduler.measure("a")
        assert worker_pids() == []
    with Router([ModelConfig("a", spec)], inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0) as r:
        r.scheduler.measure("a")
        measured_by = worker_pids()
        assert len(measured_by) == 1 and [w["pid"] for w in r.status()["workers"]] == measured_by
        r.complete("a", "x", max_tokens=2)
        assert [w["pid"] for w in r.status()["workers"]] == measured_by
        assert worker_pids() == measured_by


def test_a_model_measured_for_several_device_sets_starts_no_worker(tiny, tmp_path, monkeypatch):
    """Two GPUs, a model pinned to neither: measured for each in short-lived workers, since
    the load goes to one and a kept worker would hold the other GPU's context for nothing."""
    monkeypatch.setenv("PYLLMROUTER_CACHE", str(tmp_path))
    spec = ModelSpec(tiny["tiny-llama"], n_ctx=256)
    with Router([ModelConfig("a", spec)], inventory=EmulatedInventory({"GPU0": 1 << 30, "GPU1": 1 << 30}),
                margin=0) as r:
        r.scheduler.measure("a")
        assert worker_pids() == [] and r.status()["workers"] == []


def test_close_leaves_no_process_and_router_never_loads_a_backend(tiny):
    code = textwrap.dedent(f"""
        import os, sys
        from pyllmrouter import ModelSpec
        from pyllmrouter.config import ModelConfig
        from pyllmrouter.devices import EmulatedInventory
        from pyllmrouter.router.api import Router
        r = Router([ModelConfig("a", ModelSpec({str(tiny["tiny-llama"])!r}, n_ctx=256))],
                   inventory=EmulatedInventory({{"GPU0": 1 << 30}}), margin=0)
        r.complete("a", "x", max_tokens=2)
        pids = [w["pid"] for w in r.status()["workers"]]
        maps = open("/proc/self/maps").read()
        print("libllama" in maps, "llama_cpp" in sys.modules, "libggml" in maps)
        r.close()
        alive = []
        for p in pids:
            try:
                os.kill(p, 0)
                alive.append(p)
            except ProcessLookupError:
                pass
        children = []
        for p in filter(str.isdigit, os.listdir("/proc")):
            try:
                if open(f"/proc/{{p}}/stat").read().rpartition(")")[2].split()[1] == str(os.getpid()):
                    children.append(p)
            except OSError:
                pass  # gone meanwhile
        print(len(pids), alive, children)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    backend, rest = out.stdout.splitlines()
    assert backend == "False False False"
    assert rest == "1 [] []"


def test_try_lease_takes_a_loaded_model_at_once_and_never_starts_a_load(specs):
    with make(specs, ["a"], {"GPU0": 1 << 30}) as r:
        assert r.scheduler.try_lease("a") is None
        time.sleep(0.2)
        assert r.status()["models"]["a"]["state"] == "unloaded" and not loads(r)
        r.load("a")
        rec = r.scheduler.try_lease("a")
        assert rec is not None and r.status()["models"]["a"]["leases"] == 1
        r.scheduler.release(rec)
        assert r.status()["models"]["a"]["leases"] == 0


def test_async_request_left_by_its_caller_stops_and_keeps_its_lease_until_the_worker_ends_it(specs, tmp_path,
                                                                                             monkeypatch):
    import asyncio

    from pyllmrouter.tools import tinymodels
    from pyllmrouter.router.workers.handle import Pending

    # llama-server's handler looks at its should_stop once a second while it waits for a
    # whole reply: a generation of seconds (a 4k-context model, one slot, one thread, each
    # request started cold) shows whether it stopped
    model = tinymodels.write_llama(tmp_path / "long.gguf", replace(tinymodels.LLAMA, n_ctx_train=4096))
    long = dict(max_tokens=4000, logit_bias={2: -100, 4: -100}, temperature=0.0, cache_prompt=False)
    specs = dict(specs, a=ModelSpec(model, ("-np", "1", "-t", "1"), n_ctx=4096))

    def leases(r):
        return r.status()["models"]["a"]["leases"]

    async def full(r):
        t0 = time.perf_counter()
        out = await r.acomplete("a", "hello", **long)
        return time.perf_counter() - t0, out["usage"]["completion_tokens"]

    async def left(r, whole):
        """Cancel the caller a quarter of the way; (leases right after, seconds until none)."""
        task = asyncio.create_task(r.acomplete("a", "hello", **long))
        while not leases(r):
            await asyncio.sleep(0.001)
        await asyncio.sleep(whole / 4)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        held, t0 = leases(r), time.perf_counter()
        while leases(r):
            await asyncio.sleep(0.001)
        return held, time.perf_counter() - t0

    with make(specs, ["a"], {"GPU0": 1 << 30}) as r:
        r.load("a")
        whole, n = asyncio.run(full(r))
        assert n == 4000
        held, freed_after = asyncio.run(left(r, whole))
        # the worker stopped generating: at its next look at should_stop (within a second),
        # well before the three quarters of the generation still ahead would have ended
        assert freed_after < 0.75 * whole - 0.25, (freed_after, whole)
        with monkeypatch.context() as m:  # a worker that does not stop at once
            m.setattr(Pending, "cancel", lambda self: None)
            held, freed_after = asyncio.run(left(r, whole))
        assert held == 1  # the model stays busy (not evictable) until the worker's reply
        assert r.complete("a", "x", max_tokens=2)["choices"]


def _busy_stream(router, model):
    """A streamed request whose end nobody reads: the model stays busy until it is closed."""
    body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 4, "stream": True}).encode()
    return router.call(model, "POST", "/v1/completions", body)[1]


def test_a_waiter_whose_caller_left_changes_nothing(specs):
    """llama-server's router tests' "waiter disconnect": with room for one model, a request
    for another model waits while the first is busy; its caller leaves; when the busy
    request ends, nothing is evicted and nothing is loaded."""
    import asyncio

    with make(specs, ["a", "b"], {"GPU0": 1 << 30}, max_models=1, turn=0.2) as r:
        r.load("a")
        stream = _busy_stream(r, "a")

        async def leave():
            task = asyncio.create_task(r.acomplete("b", "hi", max_tokens=2))
            await asyncio.sleep(1.0)  # waiting for a's memory (a is busy)
            assert r.status()["models"]["b"]["state"] == "unloaded"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            seen = len(r.scheduler.events)
            stream.close()  # a's request ends
            await asyncio.sleep(1.0)
            st = r.status()["models"]
            assert st["a"]["state"] == "loaded" and st["b"]["state"] == "unloaded"
            assert st["a"]["leases"] == st["b"]["leases"] == 0
            assert list(r.scheduler.events)[seen:] == []  # no eviction, no load

        asyncio.run(leave())
        assert r.complete("b", "hi", max_tokens=2)["choices"]  # b is served when asked again
        r.scheduler.check_invariant()


def test_a_worker_that_dies_between_lease_and_send_is_worker_died_not_a_crash(specs):
    """The race forced: the lease is taken, then its worker dies (and the router has seen
    it) before the request is sent. The request fails with WorkerDied (HTTP 503), and
    the next request starts a new worker."""
    import asyncio

    with make(specs, ["a"], {"GPU0": 1 << 30}) as r:
        r.load("a")
        take = r.scheduler.try_lease

        def lease_then_die(name, prefer=None, slot=False):
            lease = take(name, prefer, slot)
            os.kill(r.status()["workers"][0]["pid"], signal.SIGKILL)
            deadline = time.monotonic() + 10
            while r.status()["models"]["a"]["state"] == "loaded" and time.monotonic() < deadline:
                time.sleep(0.01)
            return lease

        r.scheduler.try_lease = lease_then_die
        with pytest.raises(WorkerDied):
            asyncio.run(r.acomplete("a", "hi", max_tokens=2))
        r.scheduler.try_lease = take
        assert r.status()["models"]["a"]["leases"] == 0
        assert r.complete("a", "hi", max_tokens=2)["choices"]


def test_a_hung_worker_is_killed_by_the_heartbeat_and_replaced(specs, tiny):
    """A worker busy decoding keeps answering its pings; one that stops answering
    (SIGSTOP: it hangs) is killed within the bound, its request in flight fails with
    WorkerDied, its model is unloaded, and the next request starts a new worker."""
    specs = dict(specs, a=ModelSpec(tiny["tiny-llama"], ("-np", "1", "-t", "1"), n_ctx=2048))
    long = dict(max_tokens=2000, logit_bias={"2": -100, "4": -100}, temperature=0.0)
    with make(specs, ["a"], {"GPU0": 1 << 30}, heartbeat=0.5) as r:
        r.load("a")
        pid = r.status()["workers"][0]["pid"]
        t0 = time.monotonic()
        for _ in range(3):  # decoding for seconds: pinged meanwhile (the reaper pings once a second)
            assert r.complete("a", "hello", **long)["usage"]["completion_tokens"] == 2000
        assert time.monotonic() - t0 > 1.0
        assert r.status()["workers"][0]["pid"] == pid  # and not taken for hung
        held = r.complete("a", "hello", stream=True, **long)
        next(held)
        os.kill(pid, signal.SIGSTOP)
        outcome = []

        def drain():
            try:
                for _ in held:
                    pass
                outcome.append("ended")
            except WorkerDied:
                outcome.append("died")

        t = threading.Thread(target=drain, daemon=True)
        t0 = time.monotonic()
        t.start()
        t.join(10)
        assert outcome == ["died"] and time.monotonic() - t0 < 5.0  # the bound plus a reaper tick
        assert r.status()["models"]["a"]["state"] == "unloaded"
        assert r.complete("a", "hi", max_tokens=2)["choices"]  # a new worker serves it
        assert r.status()["workers"][0]["pid"] != pid


def test_a_bug_inside_a_worker_is_an_internal_error_and_the_worker_goes_on(specs):
    """An unexpected exception in a worker (here: a query value that is not text reaches
    the engine's binding) crosses the pipe as ErrorKind.INTERNAL, a 500; the worker and
    its model serve the next request."""
    from pyllmrouter.errors import RequestFailed
    from pyllmrouter.server.api_errors import from_router_error

    with make(specs, ["a"], {"GPU0": 1 << 30}) as r:
        r.load("a")
        pid = r.status()["workers"][0]["pid"]
        with pytest.raises(RequestFailed) as e:
            r.call("a", "GET", "/slots", query={"id": 1})
        assert e.value.kind == "internal" and "TypeError" in e.value.message
        assert from_router_error(e.value).status == 500
        assert r.complete("a", "hi", max_tokens=2)["choices"]
        assert r.status()["workers"][0]["pid"] == pid


def test_a_lease_on_a_model_drained_for_a_waiter_says_when_its_turn_ends(specs):
    """What a lease lets a worker read on a connection after it (--follow-ms) must end with
    the turn of a model drained for a waiter: the lease carries that end; none without a
    drain."""
    import asyncio

    with make(specs, ["a", "b"], {"GPU0": 1 << 30}, max_models=1, turn=3.0) as r:
        r.load("a")
        lease = r.scheduler.try_lease("a")
        assert lease is not None and lease.until is None  # nobody waits for a's memory
        r.scheduler.release(lease)
        stream = _busy_stream(r, "a")

        async def wait_for_b():
            task = asyncio.create_task(r.acomplete("b", "hi", max_tokens=2))
            for _ in range(600):  # b waits for a's memory (once probed): a is drained, its turn running
                waiting = r.status()["models"]["b"].get("waiting") or {}
                if waiting.get("why") == "waiting for busy models to finish":
                    break
                await asyncio.sleep(0.05)
            t0 = time.monotonic()
            lease = r.scheduler.try_lease("a")  # a takes new requests for its turn
            try:
                assert lease is not None and lease.until is not None
                assert t0 < lease.until <= t0 + 3.0
            finally:
                r.scheduler.release(lease)
            stream.close()
            await task

        asyncio.run(wait_for_b())
        r.scheduler.check_invariant()


def test_a_job_spawned_while_the_router_closes_is_joined_only_once_started(specs, monkeypatch):
    """close() joins the background jobs while others may still spawn one (a removed model's
    last release forgets its kept states): a join that met a thread listed but not yet
    started raised RuntimeError.  Here a join runs just as a job's thread is about to start."""
    seen: list[BaseException] = []
    start = threading.Thread.start

    def late_start(thread):
        if thread.name.endswith("(marker)"):  # a thread's default name ends with its target's
            def join_now():
                try:
                    jobs.join(0)
                except BaseException as e:  # noqa: BLE001 - what the test looks for
                    seen.append(e)
            other = threading.Thread(target=join_now)
            start(other)
            other.join(0.2)  # it meets the job's thread (or waits for it to start)
        return start(thread)

    def marker() -> None:
        pass

    with make(specs, ["a"], {"GPU0": 1 << 30}) as r:
        jobs = r.scheduler.jobs
        monkeypatch.setattr(threading.Thread, "start", late_start)
        jobs.spawn(marker)
        monkeypatch.undo()
        jobs.join(5)
    assert seen == []
