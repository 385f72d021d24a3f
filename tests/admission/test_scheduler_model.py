"""A model-based test of the scheduler: hypothesis drives the real Scheduler (its Book, jobs,
roster, registry and kept-state store) through a simulated world (tests/admission/simworld.py) of two
GPUs and a host whose free memory moves as real devices' does: loads that allocate as they
go, other programs that come and go, workers that die during a load, an unload or a save,
readings of free memory that come late, clients that ask, hold, leave and give up, reloads
that add, remove, change, rename and alias models, kept states, a model with replicas, a
model that loads fitted, a corrupt file and a file whose load kills its worker; workers whose
cost the router learns only by starting one (its estimate before: a safe default), whose
start fails short of room, probes' short-lived workers that allocate, and unloads whose
bytes are freed after their reply.

After every step, once the world is still:
  - the admission invariant held at every admission of the step (checked as it happened,
    under the Book's lock, by a listener whose own error is a finding): on every device,
    the other programs' bytes of the reading the decision used + every byte the router
    holds (whole reservations of loads under way, unloading models, workers, kept states)
    + what the worker the load starts truly costs beyond what is held for it + the margin
    <= total; and held <= capacity (tests/admission/test_scheduler_check.py breaks the rule on
    purpose and sees this check fail);
  - no allocation failed where the router's books said there was room;
  - no lease leaked (the records' leases are the clients'), no record leaked (an extra
    instance nobody loads, a retiring model that has unloaded);
  - the list is the last reload's (every name listed, every alias naming its model);
  - every waiting client is within its timeout.
At the end every client has its answer (a lease, or a typed error) within its timeout.

``HYPOTHESIS_PROFILE=wide SCHEDULER_EXAMPLES=400`` runs it longer (README).
"""

from __future__ import annotations

import collections
import json
import os
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pyllmrouter import ModelConfig, ModelSpec
from pyllmrouter.config import RouterOptions
from pyllmrouter.devices import HOST
from pyllmrouter.errors import RouterError
from pyllmrouter.router.policy.placement import COUNT
from pyllmrouter.router.policy.state import State
from pyllmrouter.router.scheduler import Scheduler
from pyllmrouter.router.workers.costs import WorkerCosts
import simworld
from simworld import SimModel, SimWorld

GPUS = {"G0": 1000, "G1": 1000}
HOST_BYTES = 1200
MARGIN = 20
OVERHEAD, HOST_OVERHEAD = 60, 40
# what the router takes a worker to cost until it has started one (above the truth, as a safe
# default is): per GPU, and on the host for a worker of GPUs or of the host alone
DEFAULTS = {"sim": 80, "host/sim": 50, "host/cpu": 50}
# the models' files: bytes on their GPUs (split evenly over a set of two) and 8 on the host
FILES = {"p0": SimModel(300), "p1": SimModel(420), "p2": SimModel(550), "p3": SimModel(250),
         "p4": SimModel(700), "p5": SimModel(900, fits=True), "bad": SimModel(100, bad=True),
         "crashy": SimModel(200, crashy=True)}
# name -> (file, pinned devices, replicas)
MODELS = {"m0": ("p0", None, 1), "m1": ("p1", None, 2), "m2": ("p2", None, 1), "m3": ("p3", ("G0",), 1),
          "m4": ("p4", ("G0", "G1"), 1), "m5": ("p5", None, 1), "bad": ("bad", None, 1), "crashy": ("crashy", None, 1),
          "old": ("p0", None, 1)}
ALIASES = ("x", "y", "old")
# what clients ask for: the models most often, and aliases, a corrupt file, a crashing load,
# an extra instance's name and a name nobody has
ASKED = ("m0", "m1", "m2", "m3", "m4") * 3 + ("m5", "bad", "crashy", "old", "x", "y", "m1#2", "nope")
OTHERS = {HOST: 100, "G0": 200, "G1": 100}  # other programs at the start (a desktop, a browser)
SLACK = 1.5  # seconds past its timeout a waiter may take to end (its 0.25 s wake-ups, two slow cores)
STATS = os.environ.get("SCHEDULER_STATS")  # a file to append each sequence's counts to
EXAMPLES = int(os.environ.get("SCHEDULER_EXAMPLES", "400" if os.environ.get("HYPOTHESIS_PROFILE") == "wide" else "12"))


@dataclass
class Client:
    name: str
    timeout: float
    gone: threading.Event
    start: float
    thread: threading.Thread | None = None
    end: float | None = None
    outcome: str | None = None
    lease: object = None
    released: bool = False


@dataclass
class Pool:
    paths: dict[str, str] = field(default_factory=dict)

    def config(self, name: str, variant: int, aliases: tuple[str, ...]) -> ModelConfig:
        file, devices, replicas = MODELS[name]
        args = ("-c", "1024") if variant else ()
        return ModelConfig(name, ModelSpec(self.paths[file], args), aliases=aliases, devices=devices,
                           replicas=replicas, source="preset")


class SchedulerMachine(RuleBasedStateMachine):
    @initialize()
    def start(self):
        self._tmp = tempfile.TemporaryDirectory(prefix="simworld-")
        self.tmp = Path(self._tmp.name)
        self.pool = Pool()
        files = {}
        for file, model in FILES.items():
            path = self.tmp / f"{file}.gguf"
            path.write_bytes(b"GGUF" + bytes(60))  # a file to stat (kept states' identity); the world knows its bytes
            self.pool.paths[file] = str(path)
            files[str(path)] = model
        self.world = SimWorld(GPUS, HOST_BYTES, OVERHEAD, HOST_OVERHEAD, files, MARGIN)
        for device, n in OTHERS.items():
            self.world.other_program(device, n)
        options = RouterOptions(margin=MARGIN, queue_timeout=5, turn=0.4, load_timeout=600, worker_idle_timeout=0.2,
                                heartbeat=0, kv_keep_ram=200)
        names = ("m0", "m1", "m2", "m3", "m4", "m5", "bad", "crashy")
        self.expected = {n: self.pool.config(n, 0, ()) for n in names}
        costs = WorkerCosts(self.world.devices, None, DEFAULTS)  # learned here only by starting workers
        self.sched = Scheduler(list(self.expected.values()), self.world.devices, options, launch=self.world.launch,
                               costs=costs)
        self.book = self.sched.book
        self.world.ram_dir = self.sched.keep.ram_dir
        self.sched.keep.page, self.sched.keep.sidecar = simworld.PAGE, simworld.SIDECAR  # the world's file system
        self.world.book_view = lambda: (self.book.held(), MARGIN)
        self.world.book_lock = self.book.locked
        self.clients: list[Client] = []
        self.broken: list[str] = []  # what the checks made under the Book's lock found
        self.checked = 0  # admissions checked
        self.book.bus.listen(self._on_event)
        self.unloading: list[threading.Thread] = []
        self.steps, self.reloaded = 0, 0  # steps so far, and at the last reload (reloads come now and then)

    # -- the checks made as things happen ---------------------------------------------------

    def _on_event(self, ev) -> bool:
        """At each admission (its Book's lock held, in the deciding thread): the invariant.
        Its own failure is a finding too (the bus would drop it and log it)."""
        if ev is None or ev.event != "load-start":
            return True
        try:
            self._check_admission(ev.model)
        except Exception:  # noqa: BLE001 - a check that cannot run is a finding, never silence
            self.broken.append(f"the admission check of {ev.model} failed: {traceback.format_exc()}")
        return True

    def _coming(self, device_set: frozenset[str]) -> dict[str, int]:
        """What the worker a load on ``device_set`` starts truly costs beyond what the router
        holds for it now (nothing where it runs: its bytes are measured or estimated high)."""
        workers = self.book.workers
        if workers.get(device_set) is not None:
            return {}
        truth = self.world.worker_cost(device_set)
        reserved, starts = workers.overhead_of(device_set)
        held = {} if starts else reserved  # reserved already (a probe's, a fit's): held
        return {d: max(0, n - held.get(d, 0)) for d, n in truth.items()}

    def _check_admission(self, model: str) -> None:
        rec = self.book.named(model)
        others = self.world.seen_by(threading.get_ident())
        held = self.book.held()
        coming = self._coming(rec.device_set)
        self.checked += 1
        for d in (set(rec.need) | set(coming)) - {COUNT}:  # the devices the admission gives bytes of
            total = self.world.total[d]
            used = others[d] + held.get(d, 0) + coming.get(d, 0) + MARGIN
            if used > total:
                self.broken.append(f"{model} admitted on {rec.device_set}: {d} other {others[d]} + held "
                                   f"{held.get(d, 0)} + coming worker {coming.get(d, 0)} + margin = {used} > {total}")

    # -- settling ---------------------------------------------------------------------------

    def _signature(self):
        book = self.book
        with book.locked():
            records = tuple((r.name, r.state, r.leases, r.fate) for r in book.records())
            tickets = len(book.tickets())
        recent = book.bus.recent()
        return (self.world.activity, recent[-1].seq if recent else 0, records, tickets, threading.active_count(),
                sum(1 for c in self.clients if c.end is None))

    def settle(self, limit: float = 3.0) -> None:
        """Until the world and the router are still: every thread waits (for a reply, a
        load, a timeout) and nothing changed for a few polls."""
        deadline = time.monotonic() + limit
        last, stable = None, 0
        while time.monotonic() < deadline and stable < 3:
            sig = self._signature()
            stable = stable + 1 if sig == last else 0
            last = sig
            time.sleep(0.004)

    # -- clients ----------------------------------------------------------------------------

    def _ask(self, client: Client) -> None:
        try:
            client.lease = self.sched.lease(client.name, client.timeout, gone=client.gone)
            client.outcome = "leased"
        except RouterError as e:
            client.outcome = type(e).__name__
        except Exception as e:  # noqa: BLE001 - anything untyped is a finding
            client.outcome = f"untyped {type(e).__name__}: {e}"
        finally:
            client.end = time.monotonic()

    @rule(names=st.lists(st.sampled_from(ASKED), min_size=1, max_size=3),
          timeout=st.sampled_from([0.3, 1.0, 2.5]))
    def request(self, names, timeout):
        if sum(1 for c in self.clients if c.end is None) >= 10:
            return self.settle()
        for name in names:
            client = Client(name, timeout, threading.Event(), time.monotonic())
            client.thread = threading.Thread(target=self._ask, args=(client,), daemon=True)
            self.clients.append(client)
            client.thread.start()
        self.settle()

    @rule(name=st.sampled_from(("m0", "m1", "m2", "m3", "m4")))
    def one_more_request(self, name):
        self.request([name], 2.5)  # (does nothing past 10 waiting clients)

    def _held(self) -> list[Client]:
        return [c for c in self.clients if c.lease is not None and not c.released]

    @rule(i=st.integers(0, 50))
    def release(self, i):
        held = self._held()
        if not held:
            return self.settle()
        client = held[i % len(held)]
        client.released = True
        self.sched.release(client.lease)
        self.settle()

    @rule(i=st.integers(0, 50))
    def leave(self, i):
        waiting = [c for c in self.clients if c.end is None]
        if not waiting:
            return self.settle()
        self.sched.withdraw(waiting[i % len(waiting)].gone)
        self.settle()

    # -- the world ----------------------------------------------------------------------------

    @rule(i=st.integers(0, 50), fraction=st.sampled_from([0.3, 0.7]))
    def load_allocates(self, i, fraction):
        with self.book.locked():
            if self.world.loads:
                self.world.step_load(self.world.loads[i % len(self.world.loads)], fraction)
        self.settle()

    @rule(i=st.integers(0, 50))
    def load_ends(self, i):
        if not self.world.loads:
            return self.settle()
        load = self.world.loads[i % len(self.world.loads)]
        if self.world.model_of(load).crashy:
            self.world.finish_load(load)  # its worker dies: the router is told at once (no lock held)
        else:
            with self.book.locked():
                self.world.finish_load(load)
        self.settle()

    @rule(i=st.integers(0, 50))
    def another_load_ends(self, i):
        self.load_ends(i)

    @rule(i=st.integers(0, 50))
    def another_release(self, i):
        self.release(i)

    @rule(i=st.integers(0, 50))
    def load_fails(self, i):
        if self.world.loads:
            self.world.fail_load(self.world.loads[i % len(self.world.loads)])
        self.settle()

    @rule(i=st.integers(0, 50), save=st.booleans(), lag=st.booleans())
    def unload_ends(self, i, save, lag):
        if self.world.unloads:
            self.world.finish_unload(self.world.unloads[i % len(self.world.unloads)], save, lag)
        self.settle()

    @rule()
    def late_frees_land(self):
        self.world.frees_land()
        self.settle()

    @rule(i=st.integers(0, 50), mid_save=st.booleans())
    def worker_dies(self, i, mid_save):
        alive = [w for w in self.world.workers if w.alive]
        if alive:
            self.world.crash(alive[i % len(alive)], mid_save)
        self.settle()

    @rule()
    def idle_workers_stop(self):
        """Workers empty for 0.2 s stop (the router's reaper): a set's next worker starts anew."""
        self.sched.reap_workers()
        self.settle()

    @rule(device=st.sampled_from([HOST, *GPUS]), delta=st.sampled_from([-400, -150, 150, 400]))
    def other_program(self, device, delta):
        self.world.other_program(device, delta)
        self.settle()

    @rule()
    def a_reading_comes_late(self):
        self.world.freeze_next_reading()

    @rule()
    def late_readings_arrive(self):
        self.world.thaw()
        self.settle()

    @rule(seconds=st.sampled_from([0.1, 0.5]))
    def time_passes(self, seconds):
        time.sleep(seconds)
        self.settle()

    # -- the list and the operator ------------------------------------------------------------

    @precondition(lambda self: self.steps - self.reloaded >= 8)
    @rule(dropped=st.sets(st.sampled_from(sorted(MODELS)), max_size=3),
          variants=st.sets(st.sampled_from(sorted(MODELS)), max_size=2),
          aliases=st.dictionaries(st.sampled_from(ALIASES), st.sampled_from(sorted(MODELS)), max_size=3))
    def reload(self, dropped, variants, aliases):
        names = set(MODELS) - dropped if "old" in dropped or len(dropped) > 1 else set(MODELS) - dropped - {"old"}
        configs = [self.pool.config(n, n in variants, tuple(sorted(a for a, m in aliases.items() if m == n)))
                   for n in sorted(names)]
        before = self.sched.configs()
        try:
            self.sched.reconcile(configs)
        except ValueError:
            # a list that cannot stand (an alias that is a name) changes nothing
            assert any(a in names and aliases[a] in names for a in aliases), configs
            assert self.sched.configs() == before
        else:
            self.expected = {c.name: c for c in configs}
        self.reloaded = self.steps
        self.settle()

    @rule(name=st.sampled_from(sorted(MODELS)))
    def unload(self, name):
        def run():
            try:
                self.sched.unload(name, 0.5)
            except RouterError:
                pass
        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.unloading.append(t)
        self.settle()

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def a_step_is_counted(self):
        """(An invariant runs once after every step, whatever the threads did: reloads come
        every few steps by this count, the same on every replay of a sequence.)"""
        self.steps += 1

    @invariant()
    def admission_held(self):
        assert not self.broken, self.broken
        assert not self.world.unexplained, self.world.unexplained
        held = self.sched.check_invariant()
        assert all(n >= 0 for d, n in held.items() if d != COUNT), held

    def _leases(self) -> tuple[int, int]:
        """(leases the records count, leases the clients hold on records still listed): a
        model whose worker died under its requests may go while they hold their leases."""
        with self.book.locked():
            records = self.book.records()
            counted = sum(r.leases for r in records)
            held = sum(1 for c in self._held() if any(c.lease.record is r for r in records))
        return counted, held

    @invariant()
    def no_lease_leaks(self):
        for _ in range(3):  # a lease taken as the world went still is stored a moment later
            counted, held = self._leases()
            if counted == held:
                return
            self.settle()
        assert counted == held, (counted, [(c.name, c.outcome) for c in self._held()])

    @invariant()
    def no_record_leaks(self):
        with self.book.locked():
            waited = {id(t.rec) for t in self.book.tickets()}
            for r in self.book.records():
                idle = r.state is State.UNLOADED and r.leases == 0
                assert not (idle and r.primary is not None and id(r) not in waited), f"extra instance {r.name} left"
                assert not (idle and r.fate is not None), f"{r.name} retiring ({r.fate}) but unloaded and still there"

    @invariant()
    def the_list_is_the_last_reloads(self):
        assert self.sched.configs() == self.expected
        for name, cfg in self.expected.items():
            assert self.sched.canonical(name) == name
            for a in cfg.aliases:
                assert self.sched.canonical(a) == name, (a, name)

    @invariant()
    def waiters_end_in_time(self):
        now = time.monotonic()
        for c in self.clients:
            allowed = c.timeout + self.world.held_back(c.thread) + SLACK
            assert (c.end or now) - c.start <= allowed, f"{c.name} waited {(c.end or now) - c.start:.2f} s > {allowed}"
            assert c.outcome is None or not c.outcome.startswith("untyped"), c.outcome

    def teardown(self):
        world, sched = self.world, self.sched
        world.thaw()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            for c in self._held():
                c.released = True
                sched.release(c.lease)
            for load in list(world.loads):
                if world.model_of(load).crashy:
                    world.fail_load(load)
                else:
                    with self.book.locked():
                        world.finish_load(load)
            for u in list(world.unloads):
                world.finish_unload(u, True)
            self.settle(1.0)
            if all(c.end is not None for c in self.clients) and not self._held() and not world.loads \
                    and not self.book.tickets():  # an instance's own load waits its turn at most
                break
        for t in self.unloading:
            t.join(5)
        for c in self.clients:
            allowed = c.timeout + world.held_back(c.thread) + SLACK
            assert c.end is not None and c.end - c.start <= allowed, (c.name, c.outcome, c.end and c.end - c.start)
        with self.book.locked():
            assert not self.book.tickets()
            assert sum(r.leases for r in self.book.records()) == 0
        assert not world.unexplained, world.unexplained
        if STATS:  # what this sequence exercised, one JSON line (the README's wide run reports it)
            seen = collections.Counter(ev.event for ev in self.book.bus.recent())
            with open(STATS, "a") as f:
                f.write(json.dumps({"steps": self.steps, "clients": len(self.clients), "admissions": self.checked,
                                    "outcomes": collections.Counter(c.outcome for c in self.clients),
                                    "events": seen, "failed": collections.Counter(
                                        str(ev.data.get("reason", ""))[:80] for ev in self.book.bus.recent()
                                        if ev.event == "load-failed")}) + "\n")
        sched.close()
        self._tmp.cleanup()


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=EXAMPLES, stateful_step_count=50, deadline=None)
