"""The admission invariant and the scheduler's edges, one test per defect a review found:
two loads admitted on the same free bytes; reloads that rename, move aliases or come
late; an extra instance left behind; the scheduler's lock behind file work; kept states
offered to a changed configuration; a model that fits only without its worker; a spill
that frees nothing, again and again; a load that kills its worker; a part of a state
file left by a death; autoload off and a request that waited through an unload.

Through the Python API or HTTP with real workers where a user meets them; through the
simulated world (tests/admission/simworld.py) where a real process cannot be stopped at the
moment that matters (a load half-allocated, a death mid-save)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from pyllmrouter import ModelConfig, ModelSpec, Router, probe
from pyllmrouter.config import RouterOptions
from pyllmrouter.devices import EmulatedInventory, HOST
from pyllmrouter.errors import LoadFailed, NeverFits, NotLoaded, QueueTimeout
from pyllmrouter.router.policy.state import State
from pyllmrouter.router.policy.admission import SETTLING
from pyllmrouter.router.scheduler import Scheduler
from pyllmrouter.router.workers.costs import WorkerCosts
from pyllmrouter.router.workers.keep import identity
import simworld
from simworld import SimModel, SimWorld
from test_edges import Stream, chat, state
from test_live import serving, wait_for

HI = [{"role": "user", "content": "hi"}]


# -- item 1: never two loads on the same free bytes ---------------------------------------


class Metered(EmulatedInventory):
    """An emulated GPU0 whose free memory shows, as a GPU's does, what another program holds
    and what the router's models have allocated (all of it once a load is done, none before:
    the moment a second admission can be fooled)."""

    def __init__(self, size: int, other: int):
        super().__init__({"GPU0": size})
        self.other = other
        self.book = None

    def free(self) -> dict[str, int]:
        out = super().free()
        loaded = sum(r.need.get("GPU0", 0) for r in self.book.records() if r.state is State.LOADED) if self.book else 0
        out["GPU0"] -= self.other + loaded
        return out


def test_two_loads_asked_at_once_are_never_admitted_on_the_same_free_bytes(tiny):
    """GPU0 holds another program's bytes and room for one model: two models asked at once
    (each load takes a second) load in turn, never side by side (before: the first's
    reservation, not yet allocated, was taken for the other program's, and both were
    admitted: the device overcommitted by half a model, as the seed incident's cudaMalloc
    failure)."""
    spec = ModelSpec(tiny["tiny-llama"], ("-c", "256"))
    need = probe(spec).total
    other = need
    inventory = Metered(other + need + need // 2, other)
    over = []
    with Router([ModelConfig("a", spec), ModelConfig("b", spec)], inventory=inventory, margin=0,
                debug_fake_timing=1.0) as r:
        inventory.book = r.scheduler.book

        def check(ev) -> bool:  # at each admission, under the Book's lock
            if ev is not None and ev.event == "load-start":
                held = r.scheduler.book.held().get("GPU0", 0)
                if other + held > inventory.devices()[1].total:
                    over.append((ev.model, other + held - inventory.devices()[1].total))
            return True

        r.scheduler.bus.listen(check)
        loads = [threading.Thread(target=r.load, args=(name, 60)) for name in ("a", "b")]
        for t in loads:
            t.start()
        for t in loads:
            t.join(90)
        assert over == [], f"admitted past the device: {over}"
        events = [(what, name) for _, what, name, _ in r.scheduler.events]
        assert sum(1 for what, _ in events if what == "load") == 2
        assert ("evict", "a") in events or ("evict", "b") in events, events  # in turn
        assert r.status()["devices"]["GPU0"]["free"] >= 0


def sim(tmp: Path, models: dict[str, tuple[SimModel, tuple[str, ...] | None, int]],
        others: dict[str, int] | None = None, host: int = 1200, costs: dict[str, int] | None = None,
        **options) -> tuple[Scheduler, SimWorld]:
    """A Scheduler over the simulated world (two GPUs of 1000 bytes, a worker's context 60 on
    each GPU of its set and 40 on the host, a margin of 20): models as name -> (bytes, pinned
    devices, replicas), their files in ``tmp``."""
    paths = {}
    for name, (model, _, _) in models.items():
        path = tmp / f"{name}.gguf"
        path.write_bytes(b"GGUF" + bytes(60))
        paths[name] = str(path)
    world = SimWorld({"G0": 1000, "G1": 1000}, host, 60, 40, {paths[n]: m for n, (m, _, _) in models.items()}, 20)
    for d, n in (others or {}).items():
        world.other_program(d, n)
    opts = RouterOptions(**{"margin": 20, "queue_timeout": 5, "turn": 0.4, "worker_idle_timeout": -1,
                            "heartbeat": 0, "kv_keep_ram": 200, **options})
    configs = [ModelConfig(n, ModelSpec(paths[n]), devices=devs, replicas=k) for n, (_, devs, k) in models.items()]
    sched = Scheduler(configs, world.devices, opts, launch=world.launch, costs=WorkerCosts(world.devices, None, costs or COSTS))
    if sched.keep is not None:
        world.ram_dir = sched.keep.ram_dir
        sched.keep.page, sched.keep.sidecar = simworld.PAGE, simworld.SIDECAR  # the world's file system
    world.book_view = lambda: (sched.book.held(), 20)
    world.book_lock = sched.book.locked
    return sched, world


COSTS = {"sim": 80, "host/sim": 50, "host/cpu": 50}  # a worker's estimate before one ran (truth: 60 and 40)


def until(predicate, what: str, timeout: float = 10.0):
    return wait_for(predicate, timeout, what)


class Asking:
    """A lease asked for in a thread of its own: its lease, or its error."""

    def __init__(self, sched: Scheduler, name: str, timeout: float = 5.0, **kw):
        self.lease, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(sched, name, timeout, kw), daemon=True)
        self.thread.start()

    def _run(self, sched, name, timeout, kw):
        try:
            self.lease = sched.lease(name, timeout, **kw)
        except Exception as e:  # noqa: BLE001 - the test reads it
            self.error = e

    def done(self, timeout: float = 10.0):
        self.thread.join(timeout)
        assert not self.thread.is_alive()
        return self


def load_now(sched: Scheduler, world: SimWorld, name: str):
    """``name`` leased, its simulated load allocated and ended."""
    asking = Asking(sched, name)
    until(lambda: any(x.msg.name == name for x in world.loads) or asking.lease or asking.error, f"{name}'s load")
    for load in [x for x in world.loads if x.msg.name == name]:
        with sched.book.locked():
            world.finish_load(load)
    return asking.done().lease


def served(sched: Scheduler, world: SimWorld, name: str, timeout: float = 10.0):
    """``name`` leased, every unload and load in the world carried out meanwhile (evictions
    for it included); its lease, or the error it met raised."""
    asking = Asking(sched, name, timeout)
    deadline = time.monotonic() + timeout
    while asking.thread.is_alive() and time.monotonic() < deadline:
        for u in list(world.unloads):
            world.finish_unload(u, False)
        for load in list(world.loads):
            with sched.book.locked():
                world.finish_load(load)
        time.sleep(0.01)
    asking.done()
    if asking.error is not None:
        raise asking.error
    return asking.lease


def test_a_reading_of_free_memory_taken_before_a_load_settled_is_taken_again(tmp_path):
    """A request reads free memory while a load has allocated 70 % of its bytes; the load
    ends (its bytes now counted as ours) before the request decides: it reads again, and
    the model that fits only in what the load had not allocated yet is not admitted beside
    it (a stale reading would count the 210 bytes allocated since as room)."""
    sched, world = sim(tmp_path, {"a": (SimModel(300), ("G0",), 1), "big": (SimModel(460), ("G0",), 1)}, {"G0": 200})
    try:
        sched.measure("big")  # measured already: its request's first reading decides
        first = Asking(sched, "a")
        until(lambda: world.loads, "a's load")
        with sched.book.locked():
            world.step_load(world.loads[0], 0.7)
        world.freeze_next_reading()
        second = Asking(sched, "big", 2.0)
        time.sleep(0.3)  # big's request holds a reading taken now
        with sched.book.locked():
            world.finish_load(world.loads[0])
        first.done()
        world.thaw()
        second.done()
        assert isinstance(second.error, QueueTimeout), second.error  # a stays busy: big never fits beside it
        # never admitted (its load's own check, on a fresh reading, would have caught it after
        # the fact: the device already promised past its size)
        assert [ev.model for ev in sched.bus.recent() if ev.event == "load-start"] == ["a"]
        assert world.unexplained == []
    finally:
        world.thaw()
        sched.close()


def test_bytes_in_flight_never_cost_a_resident_its_place(tmp_path):
    """A load under way (70 % allocated) and an unload under way: a model that fits beside
    everything once they settle waits for them, and nothing is drained or evicted for bytes
    in flight (the safe count double-counts what they allocated or have not freed yet: as a
    reason to wait it is harmless, as a reason to drain a busy model it was not)."""
    sched, world = sim(tmp_path, {"l": (SimModel(400), ("G0",), 1), "b": (SimModel(300), ("G0",), 1),
                                  "s": (SimModel(200), ("G0",), 1), "z": (SimModel(500), ("G1",), 1),
                                  "x": (SimModel(100), ("G1",), 1)})
    try:
        for name in ("s", "x"):
            sched.measure(name)
        busy = load_now(sched, world, "b")
        loading = Asking(sched, "l", 10)
        until(lambda: any(x.msg.name == "l" for x in world.loads), "l's load")
        with sched.book.locked():
            world.step_load(next(x for x in world.loads if x.msg.name == "l"), 0.7)
        small = Asking(sched, "s", 10)
        until(lambda: any(t.rec.name == "s" and t.why for t in sched.book.tickets()), "s deciding")
        time.sleep(0.6)  # past the turn a drain would give b
        assert [t.why for t in sched.book.tickets() if t.rec.name == "s"] == [SETTLING]
        assert sched.book.named("b").drain is None
        another = sched.try_lease("b")  # b still takes requests
        assert another is not None
        sched.release(another)
        with sched.book.locked():
            world.finish_load(next(x for x in world.loads if x.msg.name == "l"))
        until(lambda: any(x.msg.name == "s" for x in world.loads), "s's load, once l settled")
        with sched.book.locked():
            world.finish_load(next(x for x in world.loads if x.msg.name == "s"))
        for lease in (busy, loading.done().lease, small.done().lease):
            sched.release(lease)
        # an unload under way on G1: x, which fits beside what z frees, waits for it, evicting nothing
        sched.release(load_now(sched, world, "z"))
        unloading = threading.Thread(target=sched.unload, args=("z", 5))
        unloading.start()
        until(lambda: world.unloads, "z's unload")
        beside = Asking(sched, "x", 10)
        time.sleep(0.3)
        assert [t.why for t in sched.book.tickets() if t.rec.name == "x"] == [SETTLING]
        world.finish_unload(world.unloads[0], False)
        unloading.join(10)
        until(lambda: any(x.msg.name == "x" for x in world.loads), "x's load")
        with sched.book.locked():
            world.finish_load(world.loads[0])
        sched.release(beside.done().lease)
        assert [ev.model for ev in sched.bus.recent() if ev.event in ("evict", "evicted")] == []
    finally:
        sched.close()


def test_two_loads_that_start_workers_on_one_device_count_both(tmp_path):
    """a (900, pinned to G0) and b (pinned to G0+G1) asked at once, neither set's worker
    running: each load is placed with the worker it starts, and that worker's bytes are held
    from the admission until it runs, so the second admission sees the first's coming worker
    (before: both admitted, G0 held 1030 of 980, and a's load failed short of memory)."""
    sched, world = sim(tmp_path, {"a": (SimModel(900), ("G0",), 1), "b": (SimModel(20), ("G0", "G1"), 1)},
                       debug_fake_timing=0.5)
    over = []

    def check(ev) -> bool:
        try:
            sched.check_invariant()
        except AssertionError as e:
            over.append(str(e))
        return True

    sched.bus.listen(check)
    try:
        sched.measure("a")
        sched.measure("b")
        for w in sched.book.workers.running():  # the probes started both sets' workers: stopped
            with sched.book.locked():
                sched.jobs.stop_worker(w, "idle")
        until(lambda: not sched.book.workers.all(), "workers gone")
        a, b = Asking(sched, "a", 3), Asking(sched, "b", 3)
        until(lambda: world.loads, "a load")
        time.sleep(1.0)
        assert len(world.loads) == 1, [x.msg.name for x in world.loads]  # one at a time: no room for both
        for load in list(world.loads):
            with sched.book.locked():
                world.finish_load(load)
        a.done()
        b.done()
        assert over == [] and world.unexplained == []
        assert [x.lease is not None for x in (a, b)].count(True) == 1  # the other waits for room
        for lease in (a.lease, b.lease):
            if lease is not None:
                sched.release(lease)
    finally:
        sched.close()


def test_a_workers_overhead_is_measured_only_while_nothing_loads_or_unloads_on_it(tmp_path):
    """The worker's own bytes are what its process holds less its models'; measured while
    another load on it had allocated 70 %, they would count that load as the worker's own,
    and a model that fits would be refused as never fitting (before: NeverFits, remembered for
    the set's next worker)."""
    sched, world = sim(tmp_path, {"x": (SimModel(100), ("G0",), 1), "y": (SimModel(400), ("G0",), 1),
                                  "q": (SimModel(800), ("G0",), 1)})
    try:
        for name in ("x", "y", "q"):
            sched.measure(name)
        x, y = Asking(sched, "x"), Asking(sched, "y")
        until(lambda: len(world.loads) == 2, "both loads")
        load_y = next(load for load in world.loads if load.msg.name == "y")
        with sched.book.locked():
            world.step_load(load_y, 0.7)
            world.finish_load(next(load for load in world.loads if load.msg.name == "x"))
        x.done()
        time.sleep(0.3)
        worker = sched.book.workers.get(frozenset({"G0"}))
        assert worker.overhead.get("G0") == 60, worker.overhead
        world.fail_load(load_y)
        y.done()
        sched.release(x.lease)
        q = Asking(sched, "q", 3)
        until(lambda: world.loads or q.error, "q's load (x evicted for it)")
        assert q.error is None, q.error
        until(lambda: world.unloads or world.loads, "x's unload")
        for u in list(world.unloads):
            world.finish_unload(u, False)
        until(lambda: world.loads, "q's load")
        with sched.book.locked():
            world.finish_load(world.loads[0])
        sched.release(q.done().lease)
    finally:
        sched.close()


def test_a_probe_starts_its_worker_only_where_the_worker_fits(tmp_path):
    """A pinned model's probe starts its set's worker (the load will be there): where a busy
    model leaves no room for it, the probe waits; where an idle one does, that one is evicted
    first (before: the worker started anyway, G0 held 1000 of 980, or failed to start and the
    model failed to load)."""
    sched, world = sim(tmp_path, {"x": (SimModel(880), ("G0",), 1), "b": (SimModel(100), ("G0", "G1"), 1)})
    try:
        busy = load_now(sched, world, "x")  # G0: 880 + its worker's 60, of 980
        b = Asking(sched, "b", 1.0)
        b.done()
        assert isinstance(b.error, QueueTimeout) and "room for its worker" in str(b.error)
        assert sched.book.workers.get(frozenset({"G0", "G1"})) is None
        sched.check_invariant()
        sched.release(busy)
        b = Asking(sched, "b", 5)  # x idle now: evicted for the worker, then b measured and loaded
        until(lambda: world.unloads, "x's unload")
        world.finish_unload(world.unloads[0], False)
        until(lambda: world.loads, "b's load")
        with sched.book.locked():
            world.finish_load(world.loads[0])
        sched.release(b.done().lease)
        assert world.unexplained == []
    finally:
        sched.close()


def test_measuring_ahead_starts_a_worker_only_where_it_fits(tmp_path):
    """``measure`` (a replica measures every model as it starts) probes a model only where the
    workers the probe starts fit now: beside the busy x, G0 has room for neither b's set's
    worker nor a short-lived one, so nothing starts (before: the set's worker started
    whatever the room, G0 held 1000 of 980; then a short-lived one, counted nowhere); a
    request for b, once x is idle, evicts x for them."""
    sched, world = sim(tmp_path, {"x": (SimModel(880), ("G0",), 1), "b": (SimModel(100), ("G0", "G1"), 1)})
    try:
        busy = load_now(sched, world, "x")
        started = len(world.workers)
        sched.measure("b")
        time.sleep(0.2)
        assert sched.book.named("b").requirements is None and len(world.workers) == started
        sched.check_invariant()
        sched.release(busy)
        sched.release(served(sched, world, "b"))
        assert sched.book.named("b").requirements is not None and not world.unexplained
    finally:
        sched.close()


def test_a_workers_reservation_is_each_jobs_own(tmp_path):
    """Two jobs counting on one coming worker each give back only their own token, and a
    token from before the worker ran touches no reservation made since (before: a probe that
    ended late dropped a later load's reservation, and another model was admitted into it)."""
    sched, world = sim(tmp_path, {"a": (SimModel(100), ("G0",), 1)})
    try:
        workers, ds = sched.book.workers, frozenset({"G0"})
        with sched.book.locked():
            first, second = workers.reserve(ds, {"G0": 60}), workers.reserve(ds, {"G0": 60})
        assert workers.starting() == [{"G0": 60}]
        workers.unreserve(first)
        assert workers.starting() == [{"G0": 60}]  # the second still counts on it
        workers.ensure(ds)  # the worker runs: its own bytes in the reservation's place
        assert workers.starting() == []
        worker = workers.get(ds)
        world.crash(worker, mid_save=False)
        with sched.book.locked():
            later = workers.reserve(ds, {"G0": 60})
        workers.unreserve(second)  # late, from before the worker ran: no effect
        assert workers.starting() == [{"G0": 60}]
        workers.unreserve(later)
        assert workers.starting() == []
    finally:
        sched.close()


def test_a_waiter_that_asked_by_alias_follows_the_alias_when_its_model_is_removed(tmp_path):
    """A request for ``x`` (a's alias) waits for a's load; a reload removes a and gives ``x``
    to b: the waiter follows ``x`` to b (before: ModelRemoved, though ``x`` named b)."""
    import dataclasses

    sched, world = sim(tmp_path, {"a": (SimModel(100), ("G0",), 1), "b": (SimModel(100), ("G1",), 1)})
    try:
        a = dataclasses.replace(sched.configs()["a"], aliases=("x",), source="preset")
        b = dataclasses.replace(sched.configs()["b"], source="preset")
        sched.reconcile([a, b])
        waiter = Asking(sched, "x", 5)
        until(lambda: world.loads, "a's load")
        sched.reconcile([dataclasses.replace(b, aliases=("x",))])
        until(lambda: any(x.msg.name == "b" for x in world.loads), "b's load, for the waiter")
        for load in list(world.loads):
            with sched.book.locked():
                world.finish_load(load)
        assert waiter.done().lease.name == "b"
        sched.release(waiter.lease)
    finally:
        sched.close()


def test_states_an_unload_saves_never_take_host_memory_the_host_has_not_got(tmp_path):
    """The RAM reserved for an unload's states is what is left of --kv-keep-ram and of the
    host's room (before: the whole budget left, past the host's size)."""
    sched, world = sim(tmp_path, {"a": (SimModel(100, host=100), ("G0",), 1),
                                  "b": (SimModel(100, host=80), ("G1",), 1)}, host=300)
    try:
        sched.release(load_now(sched, world, "a"))
        sched.release(load_now(sched, world, "b"))
        unloading = threading.Thread(target=sched.unload, args=("a", 5))
        unloading.start()
        until(lambda: world.unloads, "a's unload")
        sched.check_invariant()
        assert world.unloads[0].msg.budget <= sched.book.capacity(HOST) - sched.book.held()[HOST] + 60
        world.finish_unload(world.unloads[0], True)
        unloading.join(10)
        sched.check_invariant()
    finally:
        sched.close()


def test_an_alias_never_takes_an_extra_instances_name(tmp_path):
    """A model whose alias is the name of a live extra instance (``m#2``) is refused: that
    name is the instance's (a resumable stream's owner, an unload of it)."""
    sched, world = sim(tmp_path, {"m": (SimModel(300), None, 2)})
    try:
        first = load_now(sched, world, "m")
        second = Asking(sched, "m")
        until(lambda: any(x.msg.name == "m#2" for x in world.loads), "m#2's load")
        with pytest.raises(ValueError, match="instance"):
            sched.add_model(ModelConfig("w", ModelSpec(sched.book.named("m").config.spec.path), aliases=("m#2",)))
        for load in list(world.loads):
            with sched.book.locked():
                world.finish_load(load)
        for lease in (first, second.done().lease):
            sched.release(lease)
    finally:
        sched.close()


# -- items 2, 3, 4: reloads ---------------------------------------------------------------


def test_a_rename_of_a_model_not_loaded_lists_the_new_one(tiny, tmp_path):
    """``[old]`` reloaded as ``[new] alias=old``: new is listed at once, and old names it
    (before: reload said removed: ['old'], then no model at all, and new was unknown)."""
    preset = tmp_path / "models.ini"
    preset.write_text(f"[old]\nmodel = {tiny['tiny-llama']}\nc = 256\n")
    with Router.from_preset(preset, inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0) as r:
        preset.write_text(f"[new]\nmodel = {tiny['tiny-llama']}\nc = 256\nalias = old\n")
        changes = r.reload()
        assert changes["added"] == ["new"] and changes["removed"] == ["old"]
        assert [m.name for m in r.models()] == ["new"]
        assert r.scheduler.canonical("old") == "new"
        assert r.complete("old", "hi", max_tokens=2)["choices"]
        assert state(r, "new") == "loaded"


@pytest.mark.parametrize("before, after", [
    ("[a]\n{m}[b]\n{m}", "[b]\n{m}alias = a\n"),  # a removed, its name an alias of b's
    ("[a]\n{m}alias = x\n[b]\n{m}alias = y\n", "[a]\n{m}alias = y\n[b]\n{m}alias = x\n"),  # aliases swapped
    ("[a]\n{m}alias = x\n", "[a]\n{m}c = 512\n[c]\n{m}alias = x\n"),  # an alias moved from a changed model to a new one
    ("[a]\n{m}alias = old\n", "[a]\n{m}[old]\n{m}"),  # an alias dropped, and a model of that name added
])
def test_reloads_that_move_names_and_aliases_apply_whole(tiny, tmp_path, before, after):
    """Each was refused for ever (``alias ... is used twice``): the new list is valid, and it
    applies at once, each alias naming its new model."""
    preset = tmp_path / "models.ini"
    m = f"model = {tiny['tiny-llama']}\n"
    preset.write_text(before.format(m=m))
    with Router.from_preset(preset, inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0) as r:
        r.load(r.models()[0].name)  # one of them loaded: it finishes as a retiring model would
        preset.write_text(after.format(m=m))
        r.reload()
        wanted = {c.name: c for c in r.scheduler.book.configs().values()}
        for section in after.format(m=m).split("[")[1:]:
            name = section.split("]")[0]
            aliases = [line.split("=")[1].strip() for line in section.splitlines() if line.startswith("alias")]
            assert name in wanted
            assert list(wanted[name].aliases) == aliases
            for a in aliases:
                assert r.scheduler.canonical(a) == name
        assert r.reload()["added"] == []  # read again: nothing left to do


@pytest.mark.slow
def test_a_later_reload_is_never_undone_by_an_earlier_one(tiny, story, tmp_path):
    """``old`` busy; a reload renames it (``[new] alias=old``), the next drops ``new``; once
    ``old``'s request ends, ``new`` stays out (before: the first reload's list, held back for
    the name, was applied again when ``old`` went, and ``new`` came back)."""
    preset = tmp_path / "models.ini"
    a = f"[a]\nmodel = {tiny['tiny-llama']}\nc = 256\n"
    preset.write_text(a + f"[old]\nmodel = {story}\nnp = 1\nc = 2048\ncontext-shift = true\n")
    with Router.from_preset(preset, inventory=EmulatedInventory({"GPU0": 8 << 30}), margin=0) as r, \
            serving(r) as base:
        busy = Stream(base, "old")
        assert busy.started.wait(60)
        preset.write_text(a + f"[new]\nmodel = {story}\nnp = 1\nc = 2048\ncontext-shift = true\nalias = old\n")
        r.reload()
        assert {m.name for m in r.models()} == {"a", "new"}  # at once, while old finishes
        preset.write_text(a)
        r.reload()
        busy.close()
        wait_for(lambda: "old" not in r.status()["models"], 60, "old gone")
        time.sleep(0.5)
        assert {m.name for m in r.models()} == {"a"}
        assert chat(base, "new").status_code == 404


@pytest.mark.slow
def test_the_model_lists_follow_the_list_while_a_renamed_model_finishes(tiny, story, tmp_path):
    """``old`` busy, reloaded as ``[new] alias=old``, and two models' aliases swapped: every
    model list and lookup says what routing does (before: /v1/models listed the removed
    ``old`` beside ``new``, /v1/models/old described it, and a swapped alias showed on both
    models)."""
    preset = tmp_path / "models.ini"
    t = f"model = {tiny['tiny-llama']}\nc = 256\n"
    preset.write_text(f"[old]\nmodel = {story}\nnp = 1\nc = 2048\ncontext-shift = true\n[a]\n{t}alias = x\n[b]\n{t}alias = y\n")
    with Router.from_preset(preset, inventory=EmulatedInventory({"GPU0": 8 << 30}), margin=0) as r, \
            serving(r) as base:
        busy = Stream(base, "old")
        assert busy.started.wait(60)
        preset.write_text(f"[new]\nmodel = {story}\nnp = 1\nc = 2048\ncontext-shift = true\nalias = old\n[a]\n{t}alias = y\n[b]\n{t}alias = x\n")
        r.reload()
        try:
            listed = {m["id"] for m in httpx.get(base + "/v1/models", timeout=30).json()["data"]}
            assert listed == {"new", "a", "b"}
            assert httpx.get(base + "/v1/models/old", timeout=30).json()["id"] == "new"
            assert httpx.get(base + "/v1/models/x", timeout=30).json()["id"] == "b"
            aliases = {m["id"]: m["aliases"] for m in httpx.get(base + "/models", timeout=30).json()["data"]}
            assert aliases == {"new": ["old"], "a": ["y"], "b": ["x"]}
        finally:
            busy.close()


# -- item 5: an extra instance nobody waits for -------------------------------------------


def test_an_extra_instance_a_client_named_goes_when_it_leaves_and_the_model_grows_again(tmp_path):
    """A client names ``m#2`` while it unloads, and gives up after it has unloaded (it cannot
    load back: G0 is full): ``m#2`` goes, and later requests for ``m`` grow it again (before:
    the unloaded ``m#2`` stayed, counted as loading, and no extra instance was ever added)."""
    sched, world = sim(tmp_path, {"m": (SimModel(300), None, 2)}, {"G0": 100})
    try:
        first = load_now(sched, world, "m")  # on G1: the most room
        second = Asking(sched, "m")
        until(lambda: any(x.msg.name == "m#2" for x in world.loads), "m#2's load")
        with sched.book.locked():
            world.finish_load(next(x for x in world.loads if x.msg.name == "m#2"))
        until(lambda: state_of(sched, "m#2") == "loaded", "m#2 loaded")
        second.done()
        sched.release(first)
        sched.release(second.lease)
        unloading = threading.Thread(target=sched.unload, args=("m#2", 5))
        unloading.start()
        until(lambda: world.unloads, "m#2's unload")
        named = Asking(sched, "m#2", 1.0)
        until(lambda: [t.rec.name for t in sched.book.tickets()] == ["m#2"], "the request for m#2 waiting")
        world.other_program("G0", 600)  # m#2 cannot come back on G0
        world.finish_unload(world.unloads[0], False)
        unloading.join(10)
        assert isinstance(named.done().error, QueueTimeout)
        until(lambda: sched.book.named("m#2") is None, "m#2 gone")
        world.other_program("G0", -600)
        mark = sched.bus.recent()[-1].seq
        held = [load_now(sched, world, "m")]
        again = Asking(sched, "m")
        until(lambda: any(ev.event == "replica-start" and ev.seq > mark for ev in sched.bus.recent()), "m grown again")
        until(lambda: any(x.msg.name.startswith("m#") for x in world.loads), "the new instance's load")
        for load in list(world.loads):
            with sched.book.locked():
                world.finish_load(load)
        held.append(again.done().lease)
        for lease in held:
            sched.release(lease)
    finally:
        sched.close()


# -- item 6: the scheduler's lock is never behind file work -------------------------------


def test_removing_a_model_never_holds_the_schedulers_lock_over_kept_state_files(tiny, monkeypatch):
    """Removing a model drops its kept states; that file work (slow here: the store busy
    copying) runs off the scheduler's lock, and a request's lease is not held behind it
    (before: try_lease, on the event loop, waited the copy out)."""
    from pyllmrouter.router.workers.keep import KeepStore

    forget = KeepStore.forget
    monkeypatch.setattr(KeepStore, "forget", lambda self, model: (time.sleep(2), forget(self, model)))
    spec = ModelSpec(tiny["tiny-llama"], ("-c", "256"))
    with Router([ModelConfig("a", spec), ModelConfig("b", spec)], inventory=EmulatedInventory({"GPU0": 1 << 30}),
                margin=0, kv_keep_ram=1 << 20) as r:
        r.load("a")
        removing = threading.Thread(target=r.remove_model, args=("b",))
        removing.start()
        time.sleep(0.3)
        began = time.monotonic()
        lease = r.scheduler.try_lease("a")
        waited = time.monotonic() - began
        r.scheduler.release(lease)
        removing.join(10)
        assert waited < 0.5, f"a lease waited {waited:.2f} s behind the kept states' file work"
        assert "b" not in {m.name for m in r.models()}


# -- item 7: a kept state's identity --------------------------------------------------------


def test_a_kept_states_identity_is_every_file_and_setting_of_its_load(tiny, projector, tmp_path, monkeypatch):
    """A state is offered only to the load that wrote it: a projector, a draft or an adapter
    the arguments name, another shard of a split model, or llama.cpp's LLAMA_ARG_*
    environment, changed, is another configuration (before: only the main file counted,
    and states on disk survive restarts)."""
    proj = tmp_path / "mmproj.gguf"
    proj.write_bytes(Path(projector).read_bytes())
    spec = ModelSpec(tiny["tiny-llama"], ("--mmproj", str(proj)))
    first = identity("m", spec)
    assert first is not None and identity("m", spec) == first
    os.utime(proj, ns=(time.time_ns(), time.time_ns() + 10**9))  # the projector rewritten
    assert identity("m", spec) != first
    second = identity("m", spec)
    monkeypatch.setenv("LLAMA_ARG_CTX_SIZE", "2048")
    assert identity("m", spec) != second
    monkeypatch.delenv("LLAMA_ARG_CTX_SIZE")
    assert identity("m", spec) == second
    shards = [tmp_path / f"split-0000{i}-of-00002.gguf" for i in (1, 2)]
    for s in shards:
        s.write_bytes(b"GGUF" + bytes(60))
    split = ModelSpec(str(shards[0]))
    before = identity("m", split)
    os.utime(shards[1], ns=(time.time_ns(), time.time_ns() + 10**9))
    assert identity("m", split) != before
    # a draft split in shards: its second shard counts too
    drafted = ModelSpec(tiny["tiny-llama"], ("-md", str(shards[0])))
    before = identity("m", drafted)
    os.utime(shards[1], ns=(time.time_ns(), time.time_ns() + 2 * 10**9))
    assert identity("m", drafted) != before
    # a file llama.cpp's environment names (LLAMA_ARG_MMPROJ): its contents count, not only its path
    monkeypatch.setenv("LLAMA_ARG_MMPROJ", str(proj))
    before = identity("m", ModelSpec(tiny["tiny-llama"]))
    os.utime(proj, ns=(time.time_ns(), time.time_ns() + 3 * 10**9))
    assert identity("m", ModelSpec(tiny["tiny-llama"])) != before


# -- item 8: a model that fits only without its worker ---------------------------------------


def test_a_model_that_fits_the_device_but_not_beside_its_worker_never_fits_at_once(tiny):
    """GPU0 holds the model's bytes but not with the context its worker holds there: NeverFits
    at once, naming the worker's bytes (before: it waited for the queue timeout, "waiting
    for busy models")."""
    spec = ModelSpec(tiny["tiny-llama"], ("-c", "256"))
    need = probe(spec).total
    overhead = 64 << 20
    inventory = EmulatedInventory({"GPU0": need + overhead // 2}, worker_overhead=overhead)
    with Router([ModelConfig("a", spec)], inventory=inventory, margin=0, queue_timeout=30) as r:
        began = time.monotonic()
        with pytest.raises(NeverFits, match="its worker's own"):
            r.complete("a", "hi", max_tokens=2)
        assert time.monotonic() - began < 10


# -- item 9: a spill that frees nothing -------------------------------------------------------


def test_ram_reserved_for_states_being_saved_is_never_spilled_for_room(tmp_path):
    """An unload is saving its states (their RAM reserved) while a load wants host memory:
    the reservation is the unload's, not kept states a spill can free, so the load waits
    for it (before: each admission round "evicted" it, spilled nothing and asked again)."""
    sched, world = sim(tmp_path, {"a": (SimModel(100), ("G0",), 1), "b": (SimModel(100, host=150), ("G0",), 1)},
                       {HOST: 100}, host=300)
    try:
        sched.release(load_now(sched, world, "a"))
        unloading = threading.Thread(target=sched.unload, args=("a", 5))
        unloading.start()
        until(lambda: world.unloads, "a's unload")
        b = Asking(sched, "b", 1.0)
        b.done()
        spills = [ev for ev in sched.bus.recent() if ev.event == "spill"]
        assert spills == [], f"{len(spills)} spills while a's states were being saved"
        assert isinstance(b.error, QueueTimeout)
        world.finish_unload(world.unloads[0], True)
        unloading.join(10)
    finally:
        sched.close()


# -- item 10: a load that kills its worker ---------------------------------------------------


def test_a_load_that_kills_its_worker_twice_fails_its_waiters_with_the_reason(tiny):
    """The worker of each load attempt dies before the load ends (here: killed when the load
    is admitted, or as its worker starts, as a file that crashes llama.cpp would kill it):
    one retry, then the request fails with the reason (before: its waiters started a worker
    after another until their queue timeout, and no load failure was counted)."""
    spec = ModelSpec(tiny["tiny-llama"], ("-c", "256"))
    with Router([ModelConfig("a", spec)], inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0,
                queue_timeout=60) as r:
        book = r.scheduler.book

        def kill(ev) -> bool:
            rec = book.named("a")
            if ev is None or rec is None or rec.state is not State.LOADING:
                return True
            worker = book.workers.get(rec.device_set) if ev.event == "load-start" else None
            pid = worker.pid if worker is not None else ev.data.get("pid") if ev.event == "worker-started" else None
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
            return True

        r.scheduler.bus.listen(kill)
        began = time.monotonic()
        with pytest.raises(LoadFailed, match="died during the load"):
            r.complete("a", "hi", max_tokens=2)
        assert time.monotonic() - began < 30
        counters = r.status()["counters"]
        assert counters["worker_deaths"] == 2 and counters["load_failures"] == 1, counters
        outcomes = [w for _, w, n, _ in r.scheduler.events if n == "a" and w in ("load-retry", "load-failed", "load")]
        assert outcomes == ["load-retry", "load-failed"], outcomes


# -- item 11: leftovers -------------------------------------------------------------------------


def test_a_worker_that_dies_mid_save_leaves_no_part_of_a_state_file(tmp_path):
    """A worker dies while it writes an unload's slot state: the part it wrote goes with the
    unload's reservation (before: it stayed in the RAM directory, outside --kv-keep-ram's
    count, until the router closed)."""
    sched, world = sim(tmp_path, {"a": (SimModel(100), None, 1)})
    try:
        sched.release(load_now(sched, world, "a"))
        unloading = threading.Thread(target=sched.unload, args=("a", 5))
        unloading.start()
        until(lambda: world.unloads, "a's unload")
        world.crash(next(w for w in world.workers if w.alive and w.pending), mid_save=True)
        unloading.join(10)
        until(lambda: state_of(sched, "a") == "unloaded", "a unloaded")

        def left() -> list:
            return [p for p in sched.keep.ram_dir.rglob("*") if p.is_file() and p.name != ".owner"]
        until(lambda: not left(), "the part written gone")  # the unload's job ends after the state does
        assert sched.keep.held_ram() == 0
    finally:
        sched.close()


def state_of(sched: Scheduler, name: str) -> str:
    return sched.book.named(name).state.value


@pytest.mark.slow
def test_with_autoload_off_a_request_that_waited_through_an_unload_does_not_load(tiny, story):
    """autoload off: a request that arrives while the model is loaded but its unload waits for
    a stream gets NotLoaded once the unload is done (before: it loaded the model again)."""
    with Router([ModelConfig("a", ModelSpec(story, ("-np", "1", "-c", "2048", "--context-shift")))],
                inventory=EmulatedInventory({"GPU0": 8 << 30}), margin=0, autoload=False) as r, serving(r) as base:
        r.load("a")
        busy = Stream(base, "a")
        assert busy.started.wait(60)
        unloading = threading.Thread(target=r.unload, args=("a", 60))
        unloading.start()
        wait_for(lambda: r.scheduler.book.named("a").unload_asked, 10, "the unload to wait for the stream")
        result = {}

        def ask():
            try:
                r.complete("a", "hi", max_tokens=2)
                result["outcome"] = "answered"
            except NotLoaded:
                result["outcome"] = "NotLoaded"

        waiting = threading.Thread(target=ask)
        waiting.start()
        time.sleep(0.5)
        busy.close()
        unloading.join(60)
        waiting.join(60)
        assert result == {"outcome": "NotLoaded"}
        assert state(r, "a") == "unloaded"
        assert [w for _, w, n, _ in r.scheduler.events if n == "a"].count("load") == 1


# -- a worker's own bytes: counted before it starts, freed with its last model ----------------


def test_a_new_device_sets_first_worker_is_admitted_with_its_own_bytes(tmp_path):
    """GPU0 holds an idle model and little else; a model of a new device set (GPU0 and GPU1)
    comes, whose worker opens a context on both: its worker is admitted on its estimate,
    evicting the idle model for it, never started where the device has no room for it
    (before: its probe started the worker whatever room GPU0 had, and the start failed, or
    GPU0 went past what the router counted)."""
    sched, world = sim(tmp_path, {"a": (SimModel(500), ("G0",), 1), "b": (SimModel(200), ("G0", "G1"), 1)},
                       {"G0": 400})
    try:
        sched.release(load_now(sched, world, "a"))  # G0: 400 other + 60 a's worker + 500 a = 960 of 1000
        b = served(sched, world, "b")
        assert b is not None, "b was not served"
        events = [(ev.event, ev.model) for ev in sched.bus.recent()]
        assert ("evicted", "a") in events, events
        assert not world.unexplained, world.unexplained
        assert not any("could not start" in str(ev.data) for ev in sched.bus.recent())
        sched.check_invariant()
        sched.release(b)
    finally:
        sched.close()


def test_an_idle_models_worker_is_freed_with_it_for_a_host_model(tmp_path):
    """P is idle on GPU0, its worker holding host memory; D, pinned to the host, fits once P
    and its worker are gone: P is evicted and its worker stopped, and D is served (before:
    eviction saw only P's own host bytes, and D waited for busy models nobody had)."""
    sched, world = sim(tmp_path, {"p": (SimModel(300), ("G0",), 1), "d": (SimModel(100), ("CPU",), 1)},
                       {HOST: 100}, host=308)
    try:
        sched.release(load_now(sched, world, "p"))  # host: 100 other + 40 p's worker + 8 p
        d = served(sched, world, "d")  # 108 + its worker's 50 (estimated) do not fit beside p's worker
        assert d is not None, "d was not served"
        events = [(ev.event, ev.model) for ev in sched.bus.recent()]
        assert ("evicted", "p") in events and any(e == "worker-stopping" for e, _ in events), events
        assert not world.unexplained, world.unexplained
        sched.check_invariant()
        sched.release(d)
    finally:
        sched.close()



def test_a_request_that_meets_a_dead_worker_waits_for_the_reload(tmp_path):
    """The worker's process has ended and a request comes before the router has seen it (its
    reader reads the EOF a few ms later): the request waits and is served by the model
    loaded again, as one that came 10 ms later is (before: handed the dead worker, it
    failed with WorkerDied)."""
    sched, world = sim(tmp_path, {"a": (SimModel(100), ("G0",), 1)})
    try:
        sched.release(load_now(sched, world, "a"))
        worker = world.workers[0]
        worker.vanish()  # ended; the router not told yet
        asking = Asking(sched, "a")
        time.sleep(0.3)
        assert asking.lease is None and asking.error is None, "handed a worker that had ended"
        worker.die()  # the router told
        until(lambda: world.loads, "a's load again")
        with sched.book.locked():
            world.finish_load(world.loads[0])
        lease = asking.done().lease
        assert lease is not None and lease.worker is not worker, asking.error
        sched.release(lease)
    finally:
        sched.close()


def test_a_request_behind_a_newcomer_never_keeps_an_empty_worker_from_it(tmp_path):
    """c (on G0+G1) needs the room of a, b and their workers; a and b are evicted for it and
    asked for again while it waits: those later requests do not keep the empty workers of G0
    and G1 from c, which would wait out its timeout with nothing busy (before: QueueTimeout
    for c, then for a and b)."""
    sched, world = sim(tmp_path, {"a": (SimModel(600), ("G0",), 1), "b": (SimModel(600), ("G1",), 1),
                                  "c": (SimModel(1760), ("G0", "G1"), 1)})
    try:
        sched.release(load_now(sched, world, "a"))
        sched.release(load_now(sched, world, "b"))
        c = Asking(sched, "c", 5)
        until(lambda: len(world.unloads) == 2, "a's and b's unloads")
        again = [Asking(sched, "a", 8), Asking(sched, "b", 8)]
        time.sleep(0.2)  # they wait behind c
        for u in list(world.unloads):
            world.finish_unload(u, False)
        deadline = time.monotonic() + 6
        while c.thread.is_alive() and time.monotonic() < deadline:
            for load in [x for x in world.loads if x.msg.name == "c"]:
                with sched.book.locked():
                    world.finish_load(load)
            time.sleep(0.01)
        c.done()
        assert c.lease is not None, c.error
        assert not world.unexplained, world.unexplained
        sched.release(c.lease)
        for a in again:
            a.thread.join(10)
            if a.lease is not None:
                sched.release(a.lease)
    finally:
        sched.close()


def test_a_guessed_worker_cost_never_makes_a_model_never_fit(tmp_path):
    """No worker of the host's kind has run yet, and the default for one is more than the host
    can hold: the model is served (its worker started, its cost learned), the guess given at
    most the room the model leaves (before: NeverFits, "its worker's own ... bytes", for
    ever, since no worker ever started to say what it costs)."""
    sched, world = sim(tmp_path, {"d": (SimModel(100), ("CPU",), 1)}, host=300, costs={"host/cpu": 500})
    try:
        d = served(sched, world, "d")
        assert d is not None
        assert sched.book.workers.costs.learned() == {"host/cpu": world.host_overhead}
        assert not world.unexplained, world.unexplained
        sched.check_invariant()
        sched.release(d)
    finally:
        sched.close()
