"""A simulated world for the scheduler's model-based test: devices whose free memory moves as a
GPU's does, and worker processes that allocate on them.  The scheduler, its Book, jobs, roster,
registry and kept-state store are the real ones; only what this machine lacks is simulated.

    SimWorld.devices   the Inventory: free = total - other programs - what the simulated
                       workers hold - the kept states' files in RAM (a tmpfs is host memory);
                       each thread's last reading is remembered (what a decision saw); what a
                       process holds on each GPU, as NVML tells it
    SimWorld.launch    the Scheduler's ``launch``: SimWorker handles
    SimWorker          a worker process: its overhead allocated when it starts (a GPU context,
                       its process on the host), short of room its start fails; the router
                       learns it only from the worker (its Ready, and what the device says
                       the process holds), as from a real one; a probe's short-lived worker
                       allocates the same.  Ping, Probe and Fit answered at once (a model
                       marked ``fits`` is fitted by keeping a part of its GPU bytes: the
                       largest that fits the grant); LoadModel and UnloadModel wait for the
                       test, which moves them on:
                         step_load    the load allocates part of what is left (a real load
                                      allocates as it goes); short of room it fails as
                                      llama.cpp does ("cudaMalloc failed: out of memory")
                         finish_load  the rest allocated, Loaded (a model marked crashy kills
                                      its worker instead)
                         fail_load    the load fails (a bad tensor)
                         finish_unload the model's bytes freed, a slot state saved where the
                                      router asked and its budget allows, Unloaded (``lag``:
                                      its bytes freed only later, ``frees_land``, as a
                                      device's reading can lag an unload's reply)
                         crash        the process dies: everything it held freed at once, the
                                      router told, its calls failed (mid-save: a part of a file
                                      left in the kept-state directory, as a real death leaves)
    other programs     come and go on any device (only where the device has room: a real
                       device has no more to give them)

Every allocation that fails is checked against the router's books: where the router's held
bytes, the other programs' and the margin fit the device, the failure is unexplained (the
router admitted what the device could not hold) and recorded.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pyllmrouter.devices import HOST, Device
from pyllmrouter.errors import WorkerDied
from pyllmrouter.memory import BufferUse, MemoryEstimate, ModelFacts
from pyllmrouter.protocol import (Call, Cancel, ErrorKind, Failed, Fit, HttpReply, Loaded, LoadModel, Ping, Probe,
                                  Result, Unloaded, UnloadModel)
from pyllmrouter.router.workers.handle import Pending
from pyllmrouter.spec import ModelSpec

__all__ = ["SimWorld", "SimModel", "SimWorker"]

STATE_BYTES = 24  # a saved slot state's size (the router's RAM budget for states is a few of these)
# the world's file system for kept states: it charges a file its bytes (a page of one byte),
# and a state's .meta is never over SIDECAR bytes (the router counts both: KeepStore.charged)
PAGE, SIDECAR = 1, 64


@dataclass(frozen=True)
class SimModel:
    """A model file's true bytes: on each GPU of its device set (split evenly) and on the host."""

    gpu: int
    host: int = 8
    bad: bool = False  # its probe fails (a corrupt file)
    crashy: bool = False  # its load kills its worker
    fits: bool = False  # llama-server's fit is on for it: a part of its GPU bytes can go (SHARE)


SHARE = "--sim-share"  # a fitted spec's argument: the percent of its GPU bytes kept


@dataclass
class SimLoad:
    worker: "SimWorker"
    msg: LoadModel
    pending: Pending
    need: dict[str, int]
    allocated: dict[str, int] = field(default_factory=dict)


@dataclass
class SimUnload:
    worker: "SimWorker"
    msg: UnloadModel
    pending: Pending


class SimWorld:
    def __init__(self, gpus: dict[str, int], host: int, overhead: int, host_overhead: int,
                 models: dict[str, SimModel], margin: int):
        self.lock = threading.RLock()
        self.total = {HOST: host, **gpus}
        self.gpus = list(gpus)
        self.other = {d: 0 for d in self.total}
        self.overhead = overhead  # per GPU of a worker's set
        self.host_overhead = host_overhead
        self.models = dict(models)  # spec path -> its true bytes
        self.margin = margin
        self.ours: dict[int, dict[str, int]] = {}  # pid -> bytes held per device
        self.workers: list[SimWorker] = []
        self.loads: list[SimLoad] = []
        self.unloads: list[SimUnload] = []
        self.readings: dict[int, dict[str, int]] = {}  # thread id -> other programs at its last reading
        self.ram_dir: Path | None = None  # the kept states' RAM directory (host memory)
        self.activity = 0  # bumped by every call, reply and change (the test waits for it to settle)
        self.unexplained: list[str] = []  # allocations that failed where the books said there was room
        self.book_view: Callable[[], tuple[dict[str, int], int]] | None = None  # () -> (held, margin)
        self.book_lock: Callable[[], Any] | None = None  # the Book's lock (a worker's start is checked under it)
        self.lagging: dict[int, dict[str, int]] = {}  # pid -> bytes an unload said it freed, not freed yet
        self._pids = itertools.count(1000)
        self._ids = itertools.count(1)
        self._gate: threading.Event | None = None  # armed: the next reading is held back
        self._frozen: threading.Event | None = None  # what a held-back reading waits for
        self._held_back: dict[int, float] = {}  # thread id -> seconds its readings were held back
        self._holding: dict[int, float] = {}  # thread id -> since when its reading is held back
        self.devices = _Inventory(self)

    # -- memory ---------------------------------------------------------------------------

    def _kept_bytes(self) -> int:
        if self.ram_dir is None:
            return 0
        total = 0
        for root, _, files in os.walk(self.ram_dir):
            for f in files:
                try:
                    total += os.lstat(os.path.join(root, f)).st_size
                except OSError:
                    pass
        return total

    def used(self) -> dict[str, int]:
        """Bytes in use per device: other programs, workers, kept states."""
        with self.lock:
            out = dict(self.other)
            for held in self.ours.values():
                for d, n in held.items():
                    out[d] += n
            out[HOST] += self._kept_bytes()
            return out

    def alloc(self, pid: int, bytes_: dict[str, int], what: str, explain: bool = False) -> bool:
        """Allocate for process ``pid``, all or nothing; False where a device has no room
        (``explain``: the caller holds the Book's lock, so the failure is checked against
        its books; lock order: the Book's, then the world's)."""
        with self.lock:
            used = self.used()
            short = [d for d, n in bytes_.items() if n and used[d] + n > self.total[d]]
            if short:
                if explain:
                    self._explain(short, what)
                return False
            held = self.ours.setdefault(pid, {})
            for d, n in bytes_.items():
                held[d] = held.get(d, 0) + n
            self.activity += 1
            return True

    def _explain(self, short: list[str], what: str) -> None:
        """An allocation failed: unexplained if the router's books had room for it."""
        if self.book_view is None:
            return
        held, margin = self.book_view()
        lag = self._lag()
        for d in short:
            if self.other[d] + lag.get(d, 0) + held.get(d, 0) + margin <= self.total[d]:
                self.unexplained.append(f"{what} on {d}: other {self.other[d]}, held {held.get(d, 0)}, margin "
                                        f"{margin}, total {self.total[d]}, in use {self.used()[d]}")

    def _lag(self) -> dict[str, int]:
        """Bytes unloads said they freed that the devices still hold (no longer the router's)."""
        out: dict[str, int] = {}
        for held in self.lagging.values():
            for d, n in held.items():
                out[d] = out.get(d, 0) + n
        return out

    def frees_land(self) -> None:
        """What unloads freed late is freed now."""
        with self.lock:
            for pid, held in self.lagging.items():
                self.release(pid, held)
            self.lagging = {}

    def release(self, pid: int, bytes_: dict[str, int]) -> None:
        with self.lock:
            held = self.ours.get(pid, {})
            for d, n in bytes_.items():
                held[d] = held.get(d, 0) - n
            self.activity += 1

    def other_program(self, device: str, delta: int) -> None:
        """Another program takes (delta > 0: as much as the device has) or gives back bytes."""
        with self.lock:
            room = self.total[device] - self.used()[device]
            self.other[device] = max(0, self.other[device] + min(delta, room))
            self.activity += 1

    def reading(self) -> dict[str, int]:
        with self.lock:
            free = {d: self.total[d] - n for d, n in self.used().items()}
            lag = self._lag()  # not the router's any more: as another program's, to the reading
            self.readings[threading.get_ident()] = {d: n + lag.get(d, 0) for d, n in self.other.items()}
            gate, self._gate = self._gate, None
        if gate is not None:  # this reading is held back while the world moves on
            me = threading.get_ident()
            with self.lock:
                self._holding[me] = time.monotonic()
            gate.wait(10)
            with self.lock:
                self._held_back[me] = self._held_back.get(me, 0.0) + time.monotonic() - self._holding.pop(me)
        return free

    def held_back(self, thread: threading.Thread | None) -> float:
        """Seconds ``thread``'s readings of free memory were held back (a wait the world made),
        the one under way included."""
        if thread is None:
            return 0.0
        with self.lock:
            now = self._holding.get(thread.ident)
            return self._held_back.get(thread.ident, 0.0) + (time.monotonic() - now if now is not None else 0.0)

    def model_of(self, load: SimLoad) -> SimModel:
        return self.models[load.msg.spec.path]

    def freeze_next_reading(self) -> None:
        """The next reading of free memory (whoever takes it) is held back until ``thaw``."""
        with self.lock:
            if self._frozen is None:
                self._frozen = self._gate = threading.Event()

    def thaw(self) -> None:
        with self.lock:
            gate, self._frozen, self._gate = self._frozen, None, None
        if gate is not None:
            gate.set()

    def seen_by(self, thread: int) -> dict[str, int]:
        """The other programs' bytes (and frees not landed yet) at ``thread``'s last reading."""
        with self.lock:
            return dict(self.readings.get(thread, self.other))

    def worker_cost(self, devices: frozenset[str]) -> dict[str, int]:
        """What a worker of ``devices`` truly holds before any model."""
        return {HOST: self.host_overhead, **{d: self.overhead for d in devices if d != HOST}}

    # -- processes ------------------------------------------------------------------------

    def launch(self, name: str, devices: frozenset[str], env: dict, on_death) -> "SimWorker":
        return SimWorker(self, name, devices, on_death)

    def new_pid(self) -> int:
        return next(self._pids)

    def estimate(self, spec: ModelSpec, device_set: frozenset[str]) -> MemoryEstimate:
        model = self.models[spec.path]
        args = list(spec.args)
        kept = int(args.pop(args.index(SHARE) + 1)) if SHARE in args else 100  # a fit's share of its GPU bytes
        args = [a for a in args if a != SHARE]
        gpu = model.gpu * kept // 100
        gpus = sorted(d for d in device_set if d != HOST) or [HOST]
        share, rest = divmod(gpu + 16 * len(args), len(gpus))
        buffers = [BufferUse(f"SIM_{d}", d, d == HOST, model=share + (rest if i == 0 else 0))
                   for i, d in enumerate(gpus)]
        buffers.append(BufferUse("CPU", HOST, True, model=model.host + model.gpu - gpu))
        facts = ModelFacts("llama", "sim", 2, 512, 64, 2, 0, 32, 1000, model.gpu, model.gpu)
        params = {"n_parallel": 1, "fit": model.fits, "ctx_auto": model.fits, "n_ctx": 512}
        return MemoryEstimate(spec, facts, tuple(buffers), 512, 1, params)

    def fit(self, msg: Fit, worker: "SimWorker") -> Any:
        """The largest share of the model's GPU bytes whose bytes fit the grant (the worker's
        host grant is what its GPUs may take: Measurer.fit), or no fit."""
        for kept in (75, 50, 25):
            spec = msg.spec.replace(args=(*msg.spec.args, SHARE, str(kept)))
            est = self.estimate(spec, worker.devices)
            gpus = sum(n for d, n in est.per_device().items() if d != HOST)
            if gpus <= msg.grants.get(HOST, 0):
                return Result(msg.req_id, {"spec": spec.to_dict(), "per_device": est.per_device(), "layers": {},
                                           "experts_on_host": 0, "to_host": [], "n_ctx": 512})
        return Failed(msg.req_id, ErrorKind.NO_FIT, f"no fit into {msg.grants} (simulated)")

    def receive(self, worker: "SimWorker", msg: Any, pending: Pending) -> None:
        with self.lock:
            self.activity += 1
            if isinstance(msg, Ping):
                self.reply(worker, pending, Result(msg.req_id, None))
            elif isinstance(msg, Probe):
                if self.models[msg.spec.path].bad:
                    self.reply(worker, pending, Failed(msg.req_id, ErrorKind.PROBE_FAILED, "not a GGUF file"))
                else:
                    self.reply(worker, pending, Result(msg.req_id, self.estimate(msg.spec, worker.devices).to_dict()))
            elif isinstance(msg, LoadModel):
                need = self.estimate(msg.spec, worker.devices).per_device()
                self.loads.append(SimLoad(worker, msg, pending, need))
            elif isinstance(msg, UnloadModel):
                load = next((x for x in self.loads if x.worker is worker and x.msg.name == msg.name), None)
                if load is not None:  # a load cancelled: it ends, then the unload
                    self._end_load(load, Failed(load.msg.req_id, ErrorKind.LOAD_FAILED, "cancelled"))
                    self.reply(worker, pending, Unloaded(msg.req_id, msg.name))
                else:
                    self.unloads.append(SimUnload(worker, msg, pending))
            elif isinstance(msg, Fit):
                if self.models[msg.spec.path].fits:
                    self.reply(worker, pending, self.fit(msg, worker))
                else:
                    self.reply(worker, pending, Failed(msg.req_id, ErrorKind.NO_FIT, "no fit (simulated)"))
            elif isinstance(msg, Call):
                self.reply(worker, pending, Result(msg.req_id, HttpReply(200, "application/json", {}, b"{}")))

    def reply(self, worker: "SimWorker", pending: Pending, msg: Any) -> None:
        with self.lock:
            worker.pending.pop(pending.req_id, None)
            self.activity += 1
        pending.put(msg)

    def _end_load(self, load: SimLoad, reply: Any) -> None:
        self.loads.remove(load)
        if not isinstance(reply, Loaded):
            self.release(load.worker.pid, load.allocated)
        self.reply(load.worker, load.pending, reply)

    def step_load(self, load: SimLoad, fraction: float) -> None:
        """The load allocates ``fraction`` of what it has left."""
        with self.lock:
            part = {d: int((n - load.allocated.get(d, 0)) * fraction) for d, n in load.need.items()}
            if self.alloc(load.worker.pid, part, f"load of {load.msg.name}", explain=True):
                for d, n in part.items():
                    load.allocated[d] = load.allocated.get(d, 0) + n
            else:
                self._end_load(load, Failed(load.msg.req_id, ErrorKind.LOAD_FAILED,
                                            "ggml_backend_cuda_buffer_type_alloc_buffer: cudaMalloc failed: out of memory"))

    def finish_load(self, load: SimLoad) -> None:
        """(The Book's lock held, as for step_load; a crashy model's worker dies: call it
        without, the router is told at once.)"""
        if self.models[load.msg.spec.path].crashy:
            load.worker.die()
            return
        with self.lock:
            self.step_load(load, 1.0)
            if load not in self.loads:
                return  # short of room: failed
            load.worker.models[load.msg.name] = dict(load.need)
            restored = {os.path.basename(p): 7 for p in load.msg.restore}
            self._end_load(load, Loaded(load.msg.req_id, load.msg.name, dict(load.need), 0.01, restored))

    def fail_load(self, load: SimLoad) -> None:
        with self.lock:
            self._end_load(load, Failed(load.msg.req_id, ErrorKind.LOAD_FAILED, "bad tensor data (simulated)"))

    def finish_unload(self, unload: SimUnload, save: bool, lag: bool = False) -> None:
        with self.lock:
            self.unloads.remove(unload)
            msg, worker = unload.msg, unload.worker
            freed = worker.models.pop(msg.name, {})
            if lag:  # freed after the reply: the device shows them a while longer
                late = self.lagging.setdefault(worker.pid, {})
                for d, n in freed.items():
                    late[d] = late.get(d, 0) + n
            else:
                self.release(worker.pid, freed)
            kept = ()
            if save and msg.keep and (msg.budget or 0) >= STATE_BYTES:
                keep_dir = Path(msg.directory) if msg.directory else self._keep_dir(worker, msg.name)
                if keep_dir is not None and keep_dir.is_dir():
                    (keep_dir / "slot0.bin").write_bytes(b"s" * STATE_BYTES)
                    kept = (("slot0.bin", 7, STATE_BYTES),)
            self.reply(worker, unload.pending, Unloaded(msg.req_id, msg.name, kept))

    def _keep_dir(self, worker: "SimWorker", name: str) -> Path | None:
        return Path(worker.keep_dirs[name]) if worker.keep_dirs.get(name) else None

    def crash(self, worker: "SimWorker", mid_save: bool) -> None:
        """The worker dies; ``mid_save``: while it writes an unload's slot state (a part of the
        file is left)."""
        with self.lock:
            if mid_save:
                for u in self.unloads:
                    keep_dir = (Path(u.msg.directory) if u.msg.directory else self._keep_dir(worker, u.msg.name)) \
                        if u.worker is worker and u.msg.keep else None
                    if keep_dir is not None and keep_dir.is_dir():
                        (keep_dir / "slot0.bin").write_bytes(b"s" * (STATE_BYTES // 2))
        worker.die()

    def forget(self, worker: "SimWorker") -> list:
        """A dead worker's calls in the world (its loads and unloads) end."""
        with self.lock:
            self.loads = [x for x in self.loads if x.worker is not worker]
            self.unloads = [x for x in self.unloads if x.worker is not worker]
            self.ours.pop(worker.pid, None)
            self.lagging.pop(worker.pid, None)
            self.activity += 1


class SimWorker:
    """A simulated worker process: WorkerHandle's surface (router/workers/handle.py)."""

    def __init__(self, world: SimWorld, name: str, devices: frozenset[str], on_death):
        self.world = world
        self.name = name
        self.devices = devices
        self.on_death = on_death
        self.pid: int | None = None
        self.overhead: dict[str, int] = {}
        self.alive = False
        self.gone = False  # ended, the router not told yet (vanish)
        self.death = ""
        self.conduit = None
        self.pending: dict[int, Pending] = {}
        self.models: dict[str, dict[str, int]] = {}  # loaded models' bytes
        self.keep_dirs: dict[str, str] = {}  # model -> where the router saves its slots
        self._ids = itertools.count(1)

    def start(self, timeout: float = 120.0) -> None:
        world = self.world
        self.pid = world.new_pid()
        cost = world.worker_cost(self.devices)  # a probe's short-lived worker's too
        with world.book_lock() if world.book_lock is not None else contextlib.nullcontext():
            if not world.alloc(self.pid, cost, f"worker {self.name} start", explain=world.book_lock is not None):
                raise WorkerDied(f"worker {self.name} could not start: out of memory")
        self.overhead = {HOST: world.host_overhead}  # what its Ready says: its process
        self.alive = True
        with world.lock:
            world.workers.append(self)
            world.activity += 1

    def send(self, msg: Any) -> None:
        if not self.alive:
            raise WorkerDied(f"worker {self.name} is not running")
        if isinstance(msg, Cancel):
            return

    def call(self, make) -> Pending:
        req_id = next(self._ids)
        msg = make(req_id)
        pending = Pending(req_id, self, ping=isinstance(msg, Ping))
        with self.world.lock:
            if not self.alive:
                raise WorkerDied(f"worker {self.name} is not running")
            self.pending[req_id] = pending
            if isinstance(msg, LoadModel):
                self.keep_dirs[msg.name] = msg.keep_dir or ""
        self.world.receive(self, msg, pending)
        return pending

    def in_flight(self) -> int:
        with self.world.lock:
            return sum(1 for p in self.pending.values() if not p.ping)

    def ping(self) -> Pending | None:
        try:
            return self.call(Ping)
        except WorkerDied:
            return None

    def die(self) -> None:
        """The process ends: everything it held is freed, the router told, its calls failed."""
        with self.world.lock:
            if not self.alive:
                return
            self.alive = False
            self.death = " (exit code -9): killed (simulated)"
            orphans, self.pending = list(self.pending.values()), {}
            self.world.forget(self)
        self.on_death(self)
        for p in orphans:
            p.put(Failed(p.req_id, ErrorKind.WORKER_DIED, f"worker {self.name} (pid {self.pid}) exited with code -9"))

    def kill(self) -> None:
        self.die()

    def vanish(self) -> None:
        """The process ends, the router not told yet (``die`` tells it, as a reader's EOF)."""
        self.gone = True

    def exited(self) -> bool:
        return self.gone or not self.alive

    def wait_dead(self, timeout: float) -> bool:
        return not self.alive

    def stop(self, timeout: float = 10.0) -> None:
        with self.world.lock:
            was = self.alive
            self.alive = False
            orphans, self.pending = list(self.pending.values()), {}
            if was:
                self.world.forget(self)
        for p in orphans:
            p.put(Failed(p.req_id, ErrorKind.WORKER_DIED, f"worker {self.name} (pid {self.pid}) exited with code 0"))


class _Inventory:
    """The simulated devices, as the scheduler's Inventory."""

    def __init__(self, world: SimWorld):
        self._world = world

    def devices(self) -> list[Device]:
        w = self._world
        return [Device(HOST, "cpu", w.total[HOST])] + [Device(g, "sim", w.total[g], i) for i, g in enumerate(w.gpus)]

    def free(self) -> dict[str, int]:
        return self._world.reading()

    def mask_env(self, device_set: frozenset[str]) -> dict[str, str]:
        return {}

    def to_inventory(self, device_set: frozenset[str], pools) -> dict[str, int]:
        return dict(pools)

    def process_usage(self, pid: int) -> dict[str, int]:
        """What a process holds on each GPU, as NVML tells it (its context and its models')."""
        w = self._world
        with w.lock:
            return {d: n for d, n in w.ours.get(pid, {}).items() if d != HOST and n}

    def worker_overhead(self, device_set: frozenset[str]) -> dict[str, int]:
        return {}  # not known before a worker runs: measured (process_usage), as a real GPU's

    def to_local(self, device_set: frozenset[str]) -> dict[str, str]:
        return {}
