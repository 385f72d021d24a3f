"""The scheduler's background half: probes, fits, loads, unloads, spills and worker stops,
each on a thread of its own, doing its I/O outside the Book's lock and reporting back
through the Book's methods.

    probe(rec)  ──▶ requirements per candidate device set (measure.py) ──▶ Book.probed
    fit(rec, ds, spec, grant) ──▶ a fit for that grant (or "no fit") ──▶ Book.fitted
    load(rec)   ──▶ the device set's worker ──▶ LoadModel ──▶ Book.loaded | load_failed
    unload_now(rec) ──▶ UNLOADING ──▶ UnloadModel (slot states kept) ──▶ Book.unloaded
    spill()     ──▶ kept prompt states leave RAM
    stop_worker(w) ──▶ retired at once, its process ended in the background
    replicate(rec) ──▶ an extra instance loaded by a lease of its own
    start_early() ──▶ the first model's worker, before any request (Router's start)

After a job changes a model, ``settle(rec)`` (the roster's: a retiring model's next
step) runs, as after any change.  Jobs owns nothing but its threads.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any, Callable

from pyllmrouter.config import RouterOptions
from pyllmrouter.devices import HOST, Inventory
from pyllmrouter.errors import RouterError, WorkerDied
from pyllmrouter.protocol import ErrorKind, Failed, LoadModel, Loaded, Progress, Unloaded, UnloadModel
from pyllmrouter.router.book import Book
from pyllmrouter.router.policy import placement
from pyllmrouter.router.policy.state import State
from pyllmrouter.router.records import Record
from pyllmrouter.router.workers.keep import identity
from pyllmrouter.router.workers.measure import Measurer, worker_spec
from pyllmrouter.router.workers.handle import WorkerHandle
from pyllmrouter.spec import ModelSpec

__all__ = ["Jobs"]

_LOG = logging.getLogger(__name__)

# llama.cpp's words for a device that could not hold what a load allocates
_OUT_OF_MEMORY = re.compile(r"out of memory|failed to allocate|unable to allocate|cudaMalloc failed|"
                            r"cannot allocate|alloc_buffer.*failed", re.I)


class Jobs:
    def __init__(self, book: Book, measure: Measurer, inventory: Inventory, options: RouterOptions,
                 settle: Callable[[Record], None], reap: Callable[[], Any]):
        """``settle(rec)``: a model's next step after a change (the roster's); ``reap()``:
        stop the workers empty past their idle timeout (the scheduler's)."""
        self._book = book
        self._measure = measure
        self._inventory = inventory
        self._options = options
        self._settle = settle
        self._reap = reap
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def spawn(self, fn, *args) -> None:
        """``fn(*args)`` in a thread of its own, listed for ``join`` once it has started (a
        join, close's, never meets a thread not started yet)."""
        t = threading.Thread(target=fn, args=args, daemon=True)
        with self._lock:
            t.start()
            self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def join(self, timeout: float) -> None:
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout)

    def _short_of(self, rec: Record, free: dict[str, int]) -> str:
        """Per device of the load: what it needed there, what is free now, and what other
        programs hold (the device's use beyond the router's own), as plain words (lock held)."""
        external = self._book.external(free)
        out = []
        for device, need in sorted(rec.need.items()):
            if device not in self._book.devices or device not in free:
                continue
            out.append(f"{device}: needs {need / 2**20:.1f} MiB, {free[device] / 2**20:.1f} MiB free, "
                       f"{external[device] / 2**20:.1f} MiB held by other programs")
        return "; ".join(out) or "no device reading"

    def spill(self) -> None:
        """Host memory is wanted: kept prompt states leave RAM (file work, outside the lock)."""
        try:
            self._book.keep.spill()
        finally:
            self._book.spill(False)

    def probe(self, rec: Record, token: int | None = None) -> None:
        """``rec`` measured on each device set it may load on (``token``: the workers it starts
        reserved for it, given back once the probe ends; a probe on the model's only set
        starts that set's worker, which the load will use)."""
        book = self._book
        reqs: dict[frozenset[str], dict[str, int]] = {}
        parts: dict[frozenset[str], dict[str, dict]] = {}
        params: dict[frozenset[str], dict[str, Any]] = {}
        error = None
        candidates = book.candidates(rec)
        try:
            for ds in candidates:
                spec = worker_spec(rec.config.spec, ds, self._inventory.to_local(ds))
                reqs[ds], parts[ds], params[ds] = self._measure.requirement(spec, ds, only=len(candidates) == 1)
                if self._options.max_models:
                    reqs[ds][placement.COUNT] = 1
        except Exception as e:  # noqa: BLE001 - reported to every waiting request
            error = e
        finally:
            if token is not None:  # the worker reserved for it (a no-op once it runs)
                book.workers.unreserve(token)
        with book.locked():
            if error is None:
                book.probed(rec, reqs, parts, params)
            else:
                book.measuring(rec, probing=False)
                book.failed(rec, f"cannot measure memory: {error}")

    def fit(self, rec: Record, ds: frozenset[str], spec: ModelSpec, grant: dict[str, int],
            token: int | None = None) -> None:
        """Fit ``spec`` into ``grant`` and remember the result for that grant (``token``: the
        set's worker reserved for it)."""
        book = self._book
        fitted, error = None, None
        try:
            fitted = self._measure.fit(spec, ds, grant)
        except Exception as e:  # noqa: BLE001 - reported to every waiting request
            error = e
        finally:
            book.workers.unreserve(token)  # the worker reserved for it (a no-op once it runs)
        with book.locked():
            if fitted is not None:
                book.fitted(rec, ds, fitted)
            else:
                book.measuring(rec, fitting=False)
                book.failed(rec, f"cannot fit: {error}")

    def start_early(self) -> None:
        """The worker the first listed model will load in, started now in the background (an
        app goes on to its first request meanwhile), where that model has one device set
        to go to and empty workers are kept (``worker_idle_timeout`` not 0), and where it
        fits now beside what the devices hold (else the first request's admission starts it,
        evicting for it).  Its bytes are reserved until it runs, as for a load's; a worker
        that fails to start is logged, and the first request starts one again and says why."""
        book = self._book
        records = [r for r in book.records() if r.primary is None]
        if not records or self._options.worker_idle_timeout == 0:
            return
        candidates = book.candidates(records[0])
        if len(candidates) != 1:
            return
        mark, free = book.mark(), self._inventory.free()
        with book.locked():
            if book.closed or book.workers.get(candidates[0]) is not None or book.mark() != mark:
                return
            need, starts = book.workers.overhead_of(candidates[0])
            if not starts or placement.shortfall(need, book.available(free)):
                return
            token = book.workers.reserve(candidates[0], need)
        self.spawn(self._start_worker, candidates[0], token)

    def _start_worker(self, device_set: frozenset[str], token: int | None) -> None:
        book = self._book
        try:
            worker = book.workers.ensure(device_set)
        except WorkerDied as e:
            _LOG.warning("the worker of %s did not start early: %s", "+".join(sorted(device_set)), e)
            return
        finally:
            book.workers.unreserve(token)
        with book.locked():  # the router closed meanwhile: its close() did not see this worker
            stray = book.closed and book.workers.forget(worker)
        if stray:
            worker.stop()

    def refresh_overhead(self, worker: WorkerHandle) -> None:
        """A worker's own cost on its GPUs: what the device reports for the process
        (context, cuBLAS workspace, pools) minus the probed bytes of its models."""
        since = self._book.moves
        usage = self._inventory.process_usage(worker.pid) if worker.pid else {}
        if usage:
            self._book.set_overhead(worker, usage, since)

    def load(self, rec: Record, attempt: int, device_set: frozenset[str] | None = None,
             token: int | None = None) -> None:
        """Load attempt ``attempt`` of ``rec`` on ``device_set`` (its admission's): what it finds
        is applied only while the model is still in that attempt (a worker that died under it
        may have let a new one start); ``token``: the worker it starts, reserved for it."""
        book, options = self._book, self._options
        worker = None
        try:
            if options.debug_fake_timing > 0:
                time.sleep(options.debug_fake_timing)
            device_set = device_set or rec.device_set
            try:
                worker = book.workers.ensure(device_set)
            finally:
                book.workers.unreserve(token)  # (a no-op once the worker runs)
            if not self._still_fits(rec, attempt):
                return
            answer = self._load_in(worker, rec, attempt)
            if answer is None:
                return
            reply, ident = answer
        except Exception as e:  # noqa: BLE001
            reply, ident = Failed(0, ErrorKind.WORKER_DIED if isinstance(e, WorkerDied) else ErrorKind.INTERNAL,
                                  f"{type(e).__name__}: {e}"), None
        self._load_answered(rec, attempt, worker, reply, ident)

    def _load_in(self, worker: WorkerHandle, rec: Record, attempt: int) -> tuple[Loaded | Failed, str | None] | None:
        """Load ``rec`` in ``worker``, its kept prompt states restored where the store has
        some: (the worker's answer, the states' identity), or None where the load timed out
        (handled)."""
        book, options = self._book, self._options
        cfg = rec.config
        spec = rec.load_spec or worker_spec(cfg.spec, rec.device_set, self._inventory.to_local(rec.device_set))
        ident, keep_dir, restore = None, None, []
        if book.keep is not None and (ident := identity(cfg.name, spec)) is not None:
            keep_dir, restore = str(book.keep.dir_for(ident, cfg.name)), book.keep.prepare(ident)
        alias = rec.primary.name if rec.primary is not None else None  # an extra instance answers as its model
        pending = worker.call(lambda rid: LoadModel(rid, cfg.name, spec, keep_dir, tuple(restore),
                                                      options.stream_interval, alias))
        deadline = time.monotonic() + options.load_timeout
        try:
            while isinstance(reply := pending.get(max(0.0, deadline - time.monotonic())), Progress):
                book.bus.publish("load-progress", rec.name, "+".join(sorted(rec.device_set or ())),
                                 progress=reply.value)
        except TimeoutError:
            self._load_timed_out(rec, worker, attempt)
            return None
        if isinstance(reply, Loaded) and restore:  # the states are in the KV now, or refused
            book.keep.consumed(ident, restore, reply.restored, reply.refused)
        return reply, ident

    def _load_answered(self, rec: Record, attempt: int, worker: WorkerHandle | None, reply: Loaded | Failed,
                       ident: str | None) -> None:
        """Apply a load's answer to ``rec``, while it is still in that attempt: loaded, failed,
        or (memory short for the first time) planned again on a fresh reading."""
        book = self._book
        short = _OUT_OF_MEMORY.search(reply.message) is not None if isinstance(reply, Failed) else False
        free = self._inventory.free() if short else {}  # what the devices have now (I/O: before the lock)
        died = isinstance(reply, Failed) and reply.kind is ErrorKind.WORKER_DIED
        if died and worker is not None:
            worker.wait_dead(5)  # the router has seen the death (Book.worker_died), whichever way it came
        with book.locked():
            if not book.loading(rec, attempt):  # the worker died meanwhile and said so (maybe a new load began)
                if isinstance(reply, Loaded) and worker is not None and worker.alive:  # an engine nobody counts: it goes
                    self.spawn(self._unload_stale, worker, rec.name)
                return
            if died:  # its worker could not start, or died unseen: as a death under the load
                book.died_loading(rec, f"the worker died during the load: {reply.message}")
                self._settle(rec)
                return
            detail = self._short_of(rec, free) if short else ""
            if short and not rec.second_chance:
                # a device had less than was counted (another program took some since it was
                # read): its waiters stay, and admission runs again on a fresh reading of the
                # free memory, evicting idle models where that makes room, as for any load
                book.load_retry(rec, reply.message, detail)
                self._settle(rec)
                return
            if short:  # twice: say where memory was short, by how much, and who else holds it
                reply = Failed(reply.req_id, reply.kind, f"{reply.message} ({detail})")
            if isinstance(reply, Loaded):
                book.loaded(rec, worker, reply.pools, ident, reply.seconds)
                for sibling in book.instances(rec.primary or rec):  # the requests spread over one more
                    if sibling is not rec:
                        book.end_follows(sibling)
            else:
                book.load_failed(rec, reply.message)
            self._settle(rec)
        if isinstance(reply, Loaded):
            self.refresh_overhead(worker)

    def _still_fits(self, rec: Record, attempt: int) -> bool:
        """Whether load ``attempt`` of ``rec`` still fits, its worker's measured overhead
        counted now (False: it is over, or back to UNLOADED to be planned again)."""
        book = self._book
        while True:
            mark = book.mark()
            free = self._inventory.free()
            with book.locked():
                if not book.loading(rec, attempt):  # ended meanwhile (its worker died)
                    return False
                if book.mark() != mark:  # bytes settled since the reading: read again
                    continue
                available = book.available(free)
                mine = {d: available.get(d, 0) + n for d, n in rec.need.items()}
                if placement.shortfall(rec.need, mine):
                    book.move(rec, State.UNLOADED)
                    self._settle(rec)
                    return False
                return True

    def replicate(self, rec: Record, lease: Callable[[], Any], release: Callable[[Any], None]) -> None:
        """An instance of a model whose requests wait (an extra one, or its own back): loaded
        where admission finds room within a turn (it drains nothing: see Scheduler._admit),
        else given up (an extra one dropped).  ``lease()`` takes the instance's loader lease,
        ``release`` gives it back (the scheduler's)."""
        book = self._book
        try:
            release(lease())
        except RouterError as e:
            with book.locked():
                book.bus.publish("replica-not-loaded", rec.primary.name if rec.primary else rec.name, "",
                                 instance=rec.name, reason=str(e))
                if rec.state is State.UNLOADED:
                    book.drop(rec)

    def _unload_stale(self, worker: WorkerHandle, name: str) -> None:
        try:
            worker.call(lambda rid: UnloadModel(rid, name, False)).get(self._options.load_timeout)
        except Exception:  # noqa: BLE001 - a worker gone has freed it anyway
            pass

    def _load_timed_out(self, rec: Record, worker: WorkerHandle, attempt: int) -> None:
        """The worker is still loading after the load timeout: the load fails for its
        waiters, and is cancelled in the worker (UnloadModel: the engine is freed once
        its load lands); its bytes stay held (UNLOADING) until the worker says so, or
        ends."""
        book = self._book
        with book.locked():
            if not book.loading(rec, attempt):  # the worker died meanwhile and said so
                return
            book.load_cancelled(rec, worker, f"the load did not end within {self._options.load_timeout:g} s "
                                             f"(cancelled in the worker)")
        self.unload(rec)

    def unload_now(self, rec: Record, evicted: bool = False) -> None:
        """``rec`` (LOADED) unloads: UNLOADING now, its worker told in the background."""
        self._book.begin_unload(rec, evicted)
        self.spawn(self.unload, rec)

    def unload(self, rec: Record) -> None:
        book, options = self._book, self._options
        with book.locked():
            worker, ident = rec.worker, rec.identity
        store = book.keep if ident is not None else None
        if worker is not None and worker.alive:
            # the RAM the states may take, within what host memory has now, held from now on;
            # where host memory is short of their budget, they go to the disk directory instead
            token, budget, place, directory = None, 0, "ram", None
            if store is not None:
                wanted = min(store.ram_left(), self._states_bound(rec))
                token, budget = self._reserve_states(store)
                if budget < wanted and store.disk_dir is not None:
                    store.release(token)
                    token, budget, place = None, store.disk_left(), "disk"
                    directory = str(store.disk_dir_for(ident, rec.name))
            if place == "ram" and store is not None:  # their sizes: what their pages and sidecars leave
                budget = store.writable(budget, self._slots(rec))
            keep = budget > 0
            try:
                reply = worker.call(lambda rid: UnloadModel(rid, rec.name, keep, budget, directory)) \
                    .get(options.load_timeout)
                if keep and isinstance(reply, Unloaded):
                    store.add(ident, list(reply.kept), token, place)  # I/O: outside the lock
                    store.hit(reply.hits)
                    token, place = None, None
            except TimeoutError:  # a worker that cannot unload is hung: its end frees the memory
                worker.kill()
                worker.wait_dead(options.load_timeout)
            except Exception:  # noqa: BLE001 - a dead worker has freed the memory anyway
                pass
            finally:
                if token is not None or place == "disk":  # not saved: the reservation back, and what a
                    store.release(token, ident, place)   # death mid-save left
        with book.locked():
            book.unloaded(rec)
            self._settle(rec)
            book.notify()
        if options.worker_idle_timeout == 0:
            self._reap()  # its worker may be empty now: it goes at once

    def _slots(self, rec: Record) -> int:
        with self._book.locked():
            return int((rec.context() or {}).get("slots") or 1)

    def _states_bound(self, rec: Record) -> int:
        """The most an unload's slot states can take: the model's KV cache, and per slot its
        tokens at most the context (engine/slots.py bounds each slot so)."""
        with self._book.locked():
            parts = rec.components.get(rec.device_set, {}) if rec.device_set else {}
            context = rec.context() or {}
        kv = sum(p.get("kv", 0) for p in parts.values())
        slots = int(context.get("slots") or 1)
        return kv + slots * (8 * int(context.get("n_ctx") or 0) + 4096)

    def _reserve_states(self, store) -> tuple[int, int]:
        """The RAM an unload's states may take: what is left of their budget and of the host's
        room now (admission's figure), reserved under the Book's lock."""
        book = self._book
        while True:
            mark = book.mark()
            free = self._inventory.free()
            with book.locked():
                if book.mark() == mark:  # no byte settled since the reading
                    return store.reserve(book.available(free).get(HOST, 0))

    def stop_worker(self, worker: WorkerHandle, reason: str, **data: Any) -> None:
        """An empty worker goes (the Book's lock held): retired now, its process ended in the
        background; its bytes stay held until then."""
        self._book.stop_worker(worker, reason, **data)
        self.spawn(self._end_worker, worker)

    def _end_worker(self, worker: WorkerHandle) -> None:
        worker.stop()
        self._book.worker_stopped(worker)
