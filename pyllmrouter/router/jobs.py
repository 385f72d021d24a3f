"""The scheduler's background half: probes, fits, loads, unloads and spills, each on a
thread of its own, doing its I/O outside the scheduler's lock and reporting back under it.

    probe(rec)  ──▶ requirements per candidate device set (measure.py) ──▶ rec, notify
    fit(rec, ds, spec, grant) ──▶ a fit for that grant (or "no fit") ──▶ rec.fits, notify
    load(rec)   ──▶ the device set's worker ──▶ LoadModel ──▶ LOADED | UNLOADED (reason)
    unload(rec) ──▶ UnloadModel (slot states kept) ──▶ UNLOADED ──▶ settle (registry.step)
    spill()     ──▶ kept prompt states leave RAM

Jobs belongs to one Scheduler and works on its state (records, workers, the keep
store) under the scheduler's own lock, as the scheduler's methods do; it owns
nothing but its threads.
"""

from __future__ import annotations

import re
import threading
import time
from typing import TYPE_CHECKING, Any

from pyllmrouter.errors import RouterError, WorkerDied
from pyllmrouter.protocol import ErrorKind, Failed, LoadModel, Loaded, Progress, Unloaded, UnloadModel
from pyllmrouter.router import placement
from pyllmrouter.router.keep import identity
from pyllmrouter.router.measure import Measurer, worker_spec
from pyllmrouter.router.pool import WorkerHandle
from pyllmrouter.router.records import Record
from pyllmrouter.router.state import State
from pyllmrouter.spec import ModelSpec

if TYPE_CHECKING:
    from pyllmrouter.router.scheduler import Scheduler

__all__ = ["Jobs"]

# llama.cpp's words for a device that could not hold what a load allocates
_OUT_OF_MEMORY = re.compile(r"out of memory|failed to allocate|unable to allocate|cudaMalloc failed|"
                            r"cannot allocate|alloc_buffer.*failed", re.I)


def _short_of(s: "Scheduler", rec: Record, free: dict[str, int]) -> str:
    """Per device of the load: what it needed there, what is free now, and what other
    programs hold (the device's use beyond the router's own), as plain words (lock held)."""
    held = s._held()
    out = []
    for device, need in sorted(rec.need.items()):
        dev = s._devices.get(device)
        if dev is None or device not in free:
            continue
        other = max(0, dev.total - free[device] - held.get(device, 0))
        out.append(f"{device}: needs {need / 2**20:.1f} MiB, {free[device] / 2**20:.1f} MiB free, "
                   f"{other / 2**20:.1f} MiB held by other programs")
    return "; ".join(out) or "no device reading"


class Jobs:
    def __init__(self, scheduler: "Scheduler", measure: Measurer):
        self._s = scheduler
        self._measure = measure
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def spawn(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def join(self, timeout: float) -> None:
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout)

    def spill(self) -> None:
        """Host memory is wanted: kept prompt states leave RAM (file work, outside the lock)."""
        s = self._s
        try:
            s.keep.spill()
        finally:
            with s._cond:
                s._spilling = False
                s.bus.publish("spill", "(kept prompt states)", "CPU")
                s._cond.notify_all()

    def probe(self, rec: Record) -> None:
        s = self._s
        reqs: dict[frozenset[str], dict[str, int]] = {}
        parts: dict[frozenset[str], dict[str, dict]] = {}
        params: dict[frozenset[str], dict[str, Any]] = {}
        error = None
        try:
            candidates = s._candidates(rec)
            for ds in candidates:
                spec = worker_spec(rec.config.spec, ds, s.inventory.to_local(ds))
                reqs[ds], parts[ds], params[ds] = self._measure.requirement(spec, ds, only=len(candidates) == 1)
                if s.options.max_models:
                    reqs[ds][placement.COUNT] = 1
        except Exception as e:  # noqa: BLE001 - reported to every waiting request
            error = e
        with s._cond:
            rec.probing = False
            if error is None:
                rec.requirements, rec.components, rec.params = reqs, parts, params
            else:
                rec.error_epoch += 1
                rec.reason = f"cannot measure memory: {error}"
                s._event("load-failed", rec.name, reason=rec.reason)
            s._cond.notify_all()

    def fit(self, rec: Record, ds: frozenset[str], spec: ModelSpec, grant: dict[str, int]) -> None:
        """Fit ``spec`` into ``grant`` and remember the result for that grant."""
        s = self._s
        fitted, error = None, None
        try:
            fitted = self._measure.fit(spec, ds, grant)
        except Exception as e:  # noqa: BLE001 - reported to every waiting request
            error = e
        with s._cond:
            rec.fitting = False
            if fitted is not None:
                rec.fits.add(ds, fitted)
                s.bus.publish("fit" if fitted.ok else "no-fit", rec.name, "+".join(sorted(ds)),
                              n_ctx=fitted.n_ctx, layers=dict(fitted.layers), error=fitted.error)
            else:
                rec.error_epoch += 1
                rec.reason = f"cannot fit: {error}"
                s._event("load-failed", rec.name, reason=rec.reason)
            s._cond.notify_all()

    def refresh_overhead(self, worker: WorkerHandle) -> None:
        """A worker's own cost on its GPUs: what the device reports for the process
        (context, cuBLAS workspace, pools) minus the probed bytes of its models."""
        s = self._s
        usage = s.inventory.process_usage(worker.pid) if worker.pid else {}
        if not usage:
            return
        with s._cond:
            for device, used in usage.items():
                models = sum(r.need.get(device, 0) for r in s._registry.records()
                             if r.worker is worker and r.state is State.LOADED)
                worker.overhead[device] = max(0, used - models)

    def load(self, rec: Record) -> None:
        s = self._s
        worker = None
        try:
            if s.options.debug_fake_timing > 0:
                time.sleep(s.options.debug_fake_timing)
            worker = s.workers.ensure(rec.device_set)
            free = s.inventory.free()
            with s._cond:
                # the worker's measured overhead now counts: does the reservation still fit?
                available = s._available(free)
                mine = {d: available.get(d, 0) + n for d, n in rec.need.items()}
                if placement.shortfall(rec.need, mine):
                    s._move(rec, State.UNLOADED)
                    s._settle(rec)
                    s._cond.notify_all()
                    return
            cfg = rec.config
            spec = rec.load_spec or worker_spec(cfg.spec, rec.device_set, s.inventory.to_local(rec.device_set))
            ident, keep_dir, restore = None, None, []
            if s.keep is not None and (ident := identity(cfg.name, spec)) is not None:
                keep_dir, restore = str(s.keep.dir_for(ident, cfg.name)), s.keep.prepare(ident)
            alias = rec.primary.name if rec.primary is not None else None  # an extra instance answers as its model
            pending = worker.call(lambda rid: LoadModel(rid, cfg.name, spec, keep_dir, tuple(restore),
                                                          s.options.stream_interval, alias))
            deadline = time.monotonic() + s.options.load_timeout
            try:
                while isinstance(reply := pending.get(max(0.0, deadline - time.monotonic())), Progress):
                    s.bus.publish("load-progress", rec.name, "+".join(sorted(rec.device_set or ())),
                                  progress=reply.value)
            except TimeoutError:
                self._load_timed_out(rec, worker)
                return
            if isinstance(reply, Loaded) and restore:  # the states are in the KV now, or refused
                s.keep.consumed(ident, restore, reply.restored, reply.refused)
        except Exception as e:  # noqa: BLE001
            reply = Failed(0, ErrorKind.WORKER_DIED if isinstance(e, WorkerDied) else ErrorKind.INTERNAL,
                           f"{type(e).__name__}: {e}")
        short = _OUT_OF_MEMORY.search(reply.message) is not None if isinstance(reply, Failed) else False
        free = s.inventory.free() if short else {}  # what the devices have now (I/O: before the lock)
        with s._cond:
            if rec.state is not State.LOADING:  # the worker died meanwhile and said so
                return
            detail = _short_of(s, rec, free) if short else ""
            if short and not rec.second_chance:
                # a device had less than was counted (another program took some since it was
                # read): its waiters stay, and admission runs again on a fresh reading of the
                # free memory, evicting idle models where that makes room, as for any load
                rec.second_chance = True
                s._event("load-retry", rec.name, reason=reply.message, devices_now=detail)
                s._move(rec, State.UNLOADED, reply.message)
                s._settle(rec)
                s._cond.notify_all()
                return
            if short:  # twice: say where memory was short, by how much, and who else holds it
                reply = Failed(reply.req_id, reply.kind, f"{reply.message} ({detail})")
            rec.second_chance = False
            if isinstance(reply, Loaded):
                s._move(rec, State.LOADED)
                rec.worker, rec.live, rec.identity = worker, dict(reply.pools), ident
                rec.last_used = time.monotonic()
                rec.loads += 1
                s.counters["loads"] += 1
                s._event("load", rec.name, seconds=round(reply.seconds, 3))
                for sibling in s._registry.instances(rec.primary or rec):  # the requests spread over one more
                    if sibling is not rec:
                        s.end_follows(sibling)
                loaded = True
            else:
                loaded = False
                s._move(rec, State.UNLOADED, reply.message)
                rec.error_epoch += 1
                s.counters["load_failures"] += 1
                s._event("load-failed", rec.name, reason=reply.message)
            s._settle(rec)
            s._cond.notify_all()
        if loaded:
            self.refresh_overhead(worker)

    def replicate(self, rec: Record) -> None:
        """An extra instance of a model whose requests wait: loaded where admission finds room
        within a turn (it drains nothing: see Scheduler._admit), else given up (dropped)."""
        s = self._s
        try:
            s.release(s.lease(rec.name, s.options.turn, autoload=True))
        except RouterError as e:
            with s._cond:
                s.bus.publish("replica-not-loaded", rec.primary.name if rec.primary else rec.name, "",
                              instance=rec.name, reason=str(e))
                if rec.state is State.UNLOADED:
                    s._registry.drop(rec)
                s._cond.notify_all()

    def _load_timed_out(self, rec: Record, worker: WorkerHandle) -> None:
        """The worker is still loading after the load timeout: the load fails for its
        waiters, and is cancelled in the worker (UnloadModel: the engine is freed once
        its load lands); its bytes stay held (UNLOADING) until the worker says so, or
        ends."""
        s = self._s
        with s._cond:
            if rec.state is not State.LOADING:  # the worker died meanwhile and said so
                return
            s._move(rec, State.UNLOADING)
            rec.worker, rec.identity = worker, None
            rec.error_epoch += 1
            rec.reason = f"the load did not end within {s.options.load_timeout:g} s (cancelled in the worker)"
            s.counters["load_failures"] += 1
            s._event("load-failed", rec.name, reason=rec.reason)
            s._cond.notify_all()
        self.unload(rec)

    def unload(self, rec: Record) -> None:
        s = self._s
        with s._cond:
            worker, ident = rec.worker, rec.identity
        keep = s.keep is not None and ident is not None
        if worker is not None and worker.alive:
            try:
                reply = worker.call(lambda rid: UnloadModel(rid, rec.name, keep)).get(s.options.load_timeout)
                if keep and isinstance(reply, Unloaded):
                    s.keep.add(ident, list(reply.kept))  # I/O: outside the lock
                    s.keep.hit(reply.hits)
            except TimeoutError:  # a worker that cannot unload is hung: its end frees the memory
                worker.kill()
                worker.wait_dead(s.options.load_timeout)
            except Exception:  # noqa: BLE001 - a dead worker has freed the memory anyway
                pass
        with s._cond:
            if rec.state is State.UNLOADING:
                s._move(rec, State.UNLOADED)
                s._event("unloaded", rec.name)
            s._settle(rec)
            s._cond.notify_all()
        if s.options.worker_idle_timeout == 0:
            s.reap_workers()  # its worker may be empty now: it goes at once

    def stop_worker(self, worker: WorkerHandle) -> None:
        """A retired worker's process ends; then its bytes are no longer held."""
        s = self._s
        worker.stop()
        with s._cond:
            s.workers.stopped(worker)
            s.bus.publish("worker-stopped", "", "+".join(sorted(worker.devices)), pid=worker.pid)
            s._cond.notify_all()
