"""The scheduler's rules users ask for, through HTTP: bounded queues, priorities, load
progress, device settings that cannot work refused at start, a second chance after a load
runs short of memory."""

from __future__ import annotations

import asyncio
import resource
import subprocess
import sys
import threading
import time

import httpx
import pytest

from pyllmrouter import ModelConfig, ModelSpec, Router, probe
from pyllmrouter.devices import EmulatedInventory
from pyllmrouter.router.exchange import Ask
from pyllmrouter.errors import LoadFailed
from pyllmrouter.tools import tinymodels
from test_live import serving, sse_events, wait_for

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "a story"}]


class Streams:
    """Streamed chat requests held open, each in a thread of its own, until ``stop`` (no
    max_tokens: llama.cpp's default, no limit; on a model that shifts its context, a stream
    never ends by itself, however fast the machine generates)."""

    def __init__(self, base: str, headers: dict[str, str] | None = None):
        self.base, self.stop, self.threads, self.codes = base, threading.Event(), [], []
        self.headers = headers or {}

    def open(self, model: str, started: threading.Event | None = None) -> None:
        def run():
            try:
                with httpx.stream("POST", self.base + "/v1/chat/completions", timeout=120, headers=self.headers,
                                  json={"model": model, "messages": CHAT, "stream": True}) as r:
                    self.codes.append(r.status_code)
                    for _ in r.iter_lines():
                        if started is not None:
                            started.set()
                        if self.stop.is_set():
                            return
            except httpx.HTTPError:
                pass

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


def test_device_settings_that_cannot_work_are_refused_at_start(tiny, tmp_path):
    with pytest.raises(ValueError, match=r"GPU0 \(64 MiB\).*margin of 1024 MiB"):
        Router([ModelConfig("a", ModelSpec(tiny["tiny-llama"]))], inventory=EmulatedInventory({"GPU0": 64 << 20}))
    preset = tmp_path / "p.ini"
    preset.write_text(f"[a]\nmodel = {tiny['tiny-llama']}\n")
    out = subprocess.run([sys.executable, "-m", "pyllmrouter.cli", "serve", "--models-preset", str(preset),
                          "--no-models-cache", "--emulate-devices", "GPU0=64MiB", "--port", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "GPU0 (64 MiB)" in out.stderr and "--models-memory-margin" in out.stderr


def test_a_models_queue_and_the_routers_are_bounded(story, tiny):
    """Past a model's max-queue (requests waiting for its slots), 429; past the router's
    --max-queue (all models together), 503; both with Retry-After and the limit named.
    Nothing waiting is dropped: the waiting requests are answered once the slot frees."""
    # the streams go on past their context (shifted), so none ends while the limits are tried
    models = [ModelConfig("story", ModelSpec(story, ("-np", "1", "-c", "4096", "--context-shift")), max_queue=2),
              ModelConfig("other", ModelSpec(story, ("-np", "1", "-c", "4096", "--temp", "0.5", "--context-shift")))]
    with Router(models, inventory=EmulatedInventory({"GPU0": 4 << 30}), margin=0, max_queue=3) as r, \
            serving(r) as base:
        streams, first = Streams(base), threading.Event()
        try:
            streams.open("story", first)
            assert first.wait(60)
            streams.open("story")
            streams.open("story")  # two wait for the one slot
            wait_for(lambda: r.status()["models"]["story"]["leases"] == 3, what="two requests waiting")
            refused = httpx.post(base + "/v1/chat/completions", json={"model": "story", "messages": CHAT}, timeout=30)
            assert refused.status_code == 429 and refused.headers["retry-after"]
            assert "max-queue = 2" in refused.json()["error"]["message"]
            other = threading.Event()
            streams.open("other", other)
            assert other.wait(60)  # its slot: not waiting
            streams.open("other")  # the router's third waiting request
            wait_for(lambda: r.status()["models"]["other"]["leases"] == 2, what="the third waiting request")
            try:
                refused = httpx.post(base + "/v1/chat/completions", json={"model": "other", "messages": CHAT},
                                     timeout=30)
            except httpx.ReadTimeout:  # taken to wait: say what the router counted
                st = r.status()
                raise AssertionError(f"not refused: {[(n, m['leases'], m['state']) for n, m in st['models'].items()]}"
                                     f", queue {st.get('queue')}") from None
            assert refused.status_code == 503 and refused.headers["retry-after"]
            assert "--max-queue 3" in refused.json()["error"]["message"]
        finally:
            streams.close()
        assert streams.codes.count(200) == 5  # every request that waited was answered


def test_a_reload_that_lowers_a_queue_limit_loses_nothing_queued(story, tmp_path):
    """A preset read again with a lower max-queue: the model stays loaded (a scheduling
    setting is changed in place), the requests already waiting are all answered, and the
    next one past the new limit is refused, naming it."""
    preset = tmp_path / "q.ini"
    write = lambda limit: preset.write_text(  # noqa: E731
        f"[*]\nmemory-margin = 0\n[story]\nmodel = {story}\nnp = 1\nc = 4096\ncontext-shift = true\nmax-queue = {limit}\n")
    write(4)
    with Router.from_preset(preset, inventory=EmulatedInventory({"GPU0": 4 << 30})) as r, serving(r) as base:
        streams, first = Streams(base), threading.Event()
        try:
            streams.open("story", first)
            assert first.wait(60)
            for _ in range(3):
                streams.open("story")
            wait_for(lambda: r.status()["models"]["story"]["leases"] == 4, what="three requests waiting")
            write(1)
            assert r.reload() == {"added": [], "removed": [], "changed": ["story"]}
            st = r.status()["models"]["story"]
            assert (st["state"], st["loads"], st["leases"]) == ("loaded", 1, 4)  # nothing unloaded or dropped
            refused = httpx.post(base + "/v1/chat/completions", json={"model": "story", "messages": CHAT}, timeout=30)
            assert refused.status_code == 429 and "max-queue = 1" in refused.json()["error"]["message"]
        finally:
            streams.close()
        assert streams.codes == [200] * 4  # every request queued before the reload was answered
        assert r.status()["models"]["story"]["loads"] == 1


def _loads_after_two_waiters(story, priority_c: int = 0, waited_c: float = 0.0) -> tuple[list, list]:
    """Three models that fit one at a time: while a is busy, a request for b comes, then one
    for c (its preset ``priority``, and the seconds it ``waited`` on a lost node, as a
    cluster's ingress sends it on); a's turn then ends.  (the loads in order, the answers)"""
    spec = ModelSpec(story, ("-np", "1", "-c", "2048", "--context-shift"))  # its streams last until stopped
    one = probe(spec).total
    models = [ModelConfig("a", spec), ModelConfig("b", spec.replace(args=(*spec.args, "--temp", "0.7"))),
              ModelConfig("c", spec.replace(args=(*spec.args, "--temp", "0.9")), priority=priority_c)]
    with Router(models, inventory=EmulatedInventory({"GPU0": one + one // 2}), margin=0, turn=0.5) as r, \
            serving(r) as base:
        streams, first = Streams(base), threading.Event()
        answers: list = []

        def ask(model, waited):
            async def call():
                reply, _ = await r.arelay(Ask(model, "POST", "/v1/chat/completions",
                                              {"messages": CHAT, "max_tokens": 4}, waited=waited))
                return reply.status
            answers.append((model, asyncio.run(call())))

        try:
            streams.open("a", first)
            assert first.wait(60)
            threads = []
            for model, waited in (("b", 0.0), ("c", waited_c)):
                threads.append(threading.Thread(target=ask, args=(model, waited)))
                threads[-1].start()
                wait_for(lambda: r.status()["models"][model]["waiting"]["requests"] == 1, what=f"{model} waiting")
        finally:
            streams.close()  # a's turn ends
        for t in threads:
            t.join(120)
        return [name for _, what, name, _ in r.scheduler.events if what == "load"], sorted(answers)


def test_a_higher_priority_is_admitted_first(story):
    """c (priority 5) loads before b (priority 0), though it came later."""
    loads, answers = _loads_after_two_waiters(story, priority_c=5)
    assert loads == ["a", "c", "b"], loads
    assert answers == [("b", 200), ("c", 200)]


def test_a_request_that_waited_on_a_lost_node_keeps_its_place_in_line(story):
    """c, which had waited 30 s on a node that was lost, counts as the earlier: it loads
    before b, though it came later here."""
    loads, answers = _loads_after_two_waiters(story, waited_c=30.0)
    assert loads == ["a", "c", "b"], loads
    assert answers == [("b", 200), ("c", 200)]


def test_first_come_first_loaded_among_equals(story):
    """Neither priority nor a wait elsewhere: b, which came first, loads first."""
    loads, _ = _loads_after_two_waiters(story)
    assert loads == ["a", "b", "c"], loads


def test_models_sse_says_how_far_a_load_has_come(tiny):
    events: list = []
    model = ModelConfig("a", ModelSpec(tiny["tiny-llama"], ("-c", "256")))
    with Router([model], inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0) as r, serving(r) as base:
        stop = threading.Event()
        sse_events(base, stop, events)
        time.sleep(0.3)
        r.load("a")
        wait_for(lambda: any(e["data"].get("status") == "loaded" for e in events if e["event"] == "status_change"),
                 what="the load's end")
        stop.set()
    progress = [e["data"]["progress"] for e in events
                if e["event"] == "status_change" and e["data"].get("status") == "loading" and "progress" in e["data"]]
    assert progress and progress[-1]["current"] == "text_model" and progress[-1]["value"] == 1.0
    assert all(0.0 <= p["value"] <= 1.0 for p in progress)


class Crowded(EmulatedInventory):
    """Emulated devices where another program may take memory: ``other`` bytes of GPU0
    are in use outside the router once set."""

    other = 0

    def free(self):
        out = super().free()
        out["GPU0"] -= self.other
        return out


def _vm_size(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def test_a_load_short_of_memory_gets_a_second_chance(tmp_path):
    """A load that fails for want of memory (llama.cpp's allocation error: here the worker's
    address space is capped, as a device another program filled would be) reads the free
    memory again, evicts the idle model that makes room, and retries once: it loads.  Short
    twice, the error names the device, the bytes and the other programs' use."""
    wide = tinymodels.Shape("llama", n_embd=1024, n_layer=4, n_head=8, n_head_kv=8, n_ff=4096)
    a = ModelSpec(tinymodels.write_llama(tmp_path / "a.gguf", wide), ("-c", "256", "-lm", "none"))
    b = ModelSpec(tinymodels.write_llama(tmp_path / "b.gguf", wide, seed=1), ("-c", "256", "-lm", "none"))
    need = probe(a).total
    inventory = Crowded({"GPU0": 4 * need})
    with Router([ModelConfig("a", a), ModelConfig("b", b)], inventory=inventory, margin=0) as r:
        r.load("b")
        worker = r.status()["workers"][0]["pid"]
        cap = _vm_size(worker) + need * 3 // 4  # room for what b frees, not for a beside b
        resource.prlimit(worker, resource.RLIMIT_AS, (cap, resource.RLIM_INFINITY))

        crowding = [True]

        def what_nvml_would_show(ev) -> bool:
            """Another program took 2.5x a model's bytes of GPU0 (the reason the load ran short):
            the free memory read again shows it beside b; once b goes, its bytes are free again."""
            if ev is not None and crowding[0]:
                if ev.event == "load-retry":
                    inventory.other = int(3.5 * need)  # the other program's 2.5, and b's 1
                elif ev.event == "evict" and ev.model == "b":
                    inventory.other = int(2.5 * need)
            return True

        r.scheduler.bus.listen(what_nvml_would_show)
        r.complete("a", "hi", max_tokens=2)
        seen = [(what, name) for _, what, name, _ in r.scheduler.events]
        assert seen[-3:] == [("load-retry", "a"), ("evict", "b"), ("load", "a")], seen
        r.unload("a")
        wait_for(lambda: r.status()["models"]["a"]["state"] == "unloaded", what="a unloaded")
        crowding[0], inventory.other = False, 0  # short again, and nothing to evict: twice short
        resource.prlimit(worker, resource.RLIMIT_AS, (_vm_size(worker) + need // 4, resource.RLIM_INFINITY))
        with pytest.raises(LoadFailed, match=r"GPU0: needs .* MiB, .* MiB free, .* MiB held by other programs"):
            r.complete("a", "hi", max_tokens=2)
        assert [w for _, w, n, _ in r.scheduler.events if n == "a"][-2:] == ["load-retry", "load-failed"]


class CountingInventory(EmulatedInventory):
    """Emulated devices that count the readings of their free memory."""

    def __init__(self, sizes: dict[str, int]):
        super().__init__(sizes)
        self.readings = 0

    def free(self) -> dict[str, int]:
        self.readings += 1
        return super().free()


def test_a_models_later_waiters_leave_its_admission_to_the_first(tiny):
    """Requests for a model that waits for its load wait behind the first of them: however
    many wait, a wake-up reads free memory and decides admission once for the model, not once
    per request (at overload every release woke hundreds of waiters that each read
    /proc/meminfo and weighed every device: the router took more CPU than the engine)."""
    inventory = CountingInventory({"GPU0": 1 << 40})
    path = tiny["tiny-llama"]
    router = Router([ModelConfig("a", ModelSpec(path)), ModelConfig("b", ModelSpec(path))],
                    inventory=inventory, max_models=1)
    try:
        held = router.scheduler.lease("a", 60)  # a busy: b cannot load while it is held
        leases, waiters = [], []
        for _ in range(20):
            t = threading.Thread(target=lambda: leases.append(router.scheduler.lease("b", 60)), daemon=True)
            t.start()
            waiters.append(t)
        book = router.scheduler.book
        wait_for(lambda: len(book.tickets()) == 20, 30)
        time.sleep(0.5)
        before = inventory.readings
        wakes = 40
        for _ in range(wakes):
            book.notify()
            time.sleep(0.01)
        readings = inventory.readings - before
        whys = [t.why for t in book.tickets()]
        assert readings <= 2 * wakes, f"{readings} readings of free memory for {wakes} wake-ups of 20 waiters"
        assert whys.count("queued behind earlier requests for the same devices") == 19, whys
        router.scheduler.release(held)
        for t in waiters:
            t.join(60)
        assert len(leases) == 20  # every waiter was served once a was free
        for lease in leases:
            router.scheduler.release(lease)
    finally:
        router.close()
