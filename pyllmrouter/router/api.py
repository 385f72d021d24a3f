"""The Python API: ``Router`` sends llama-server requests to models over the scheduler.

    app ──call/acall(model, method, path, body)──▶ Router ──lease──▶ Scheduler (admission, eviction)
        chat/complete/embed: OpenAI bodies          │                   │ background: probe, load, unload
                                                    └──Call──▶ WorkerHandle ──pipe──▶ worker: the
                                                    ◀──Result(HttpReply) | Chunk(head) Chunk(bytes)*
                                                       Result | Failed──┘      model's llama.cpp engine

    with Router([ModelConfig("chat", ModelSpec("chat.gguf"))]) as router:
        router.chat("chat", [{"role": "user", "content": "hi"}])   # llama-server's JSON
        for chunk in router.complete("chat", "Once", stream=True): ...
        reply, stream = router.call("chat", "POST", "/tokenize", b'{"content": "hi"}')
        router.status()   # per model state and per device requirement, used and free

Every call ends with a result or an exception (UnknownModel, NeverFits,
QueueTimeout, LoadFailed, WorkerDied, RequestFailed); a worker killed mid
request fails that request at once and the next request starts a new worker.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from typing import Any, Iterable

from pyllmrouter.config import ModelConfig, RouterOptions
from pyllmrouter.devices import Inventory, SystemInventory
from pyllmrouter.engine_args import check_specs
from pyllmrouter.router import home
from pyllmrouter.router.registry import API
from pyllmrouter.errors import RouterError, UnknownModel
from pyllmrouter.router.exchange import Ask, Exchange
from pyllmrouter.router.services.conversations import Conversations
from pyllmrouter.router.services import pullcheck
from pyllmrouter.router.services.downloads import Downloads
from pyllmrouter.router.services.sources import Sources
from pyllmrouter.replies import Status
from pyllmrouter.router.scheduler import Scheduler
from pyllmrouter.router.methods import Methods

__all__ = ["Router"]

_LOG = logging.getLogger(__name__)


class Router(Methods):
    """Several GGUF models served by llama.cpp's own engine, each loaded when it is asked
    for, in worker processes, where its exact bytes fit (idle models evicted, least recently
    used first).

        with Router([ModelConfig("chat", ModelSpec("chat.gguf", ("-c", "8192")))]) as router:
            router.chat("chat", [{"role": "user", "content": "hi"}], max_tokens=64)
            with router.chat("chat", messages, stream=True) as events:
                for event in events: ...

    Requests: chat, complete, embed, tokenize, detokenize (and their awaited forms achat,
    acomplete...), call/acall for any llama-server endpoint.  When a caller stops waiting
    (``timeout=``, a cancelled task, a stream closed or dropped, ``close()``) the request's
    generation stops and its slot is free.  Models: load, unload, status, models,
    add_model, remove_model, replace_model, reload, pull, delete.  ``close()`` (or ``with``)
    stops every worker.  A Router is the process's that built it: in a fork's child its
    methods raise RouterForked (build one there), and its close() does nothing."""

    def __init__(self, models: Iterable[ModelConfig], *, inventory: Inventory | None = None,
                 options: RouterOptions | None = None, sources: Sources | None = None, watch: float = 0.0,
                 **option_overrides: Any):
        """``sources``: where ``reload()`` reads the model list again (a preset, a models
        directory, llama.cpp's cache); ``watch``: read them again within this many seconds
        of a change (0: only on ``reload()``)."""
        super().__init__(self._exchange)
        self._pid = os.getpid()  # its workers, threads and pipes are this process's (home.py)
        options = options or RouterOptions()
        if option_overrides:
            unknown = set(option_overrides) - set(options.__dict__)
            if unknown:
                raise TypeError(f"Router() got unexpected options {sorted(unknown)} (RouterOptions has "
                                f"{', '.join(sorted(options.__dict__))})")
            options = RouterOptions(**{**options.__dict__, **option_overrides})
        self.options = options
        models = list(models)
        _check_own(models, "Router(models=...)")
        self._sched = Scheduler(models, inventory or SystemInventory(), options)
        self._sched.jobs.start_early()  # the first model's worker starts while the app goes on
        self._sources = sources or Sources()
        self._reloading = threading.Lock()  # one reading of the sources at a time
        self._downloads = Downloads(self._sched.bus, self._downloaded)
        self.conversations = Conversations()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="ttl-reaper", daemon=True)
        self._reaper.start()
        if watch > 0 and self._sources:
            threading.Thread(target=self._watch, args=(watch,), name="source-watcher", daemon=True).start()
        for rec in self._sched.records():
            if rec.config.load_on_startup:
                threading.Thread(target=self._load_quietly, args=(rec.name,), daemon=True).start()

    @classmethod
    def from_preset(cls, path, **kw: Any) -> "Router":
        """A router over the models of a llama-server preset INI file (``reload()`` reads it again)."""
        sources = Sources(preset=str(path))
        models, router = sources.read()
        return cls(models, sources=sources, **{**router, **kw})

    # -- lifecycle -------------------------------------------------------------

    def __enter__(self) -> "Router":
        home.here(self._pid)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop every worker; leaves no child process behind.  Requests in flight end with
        RouterClosed (their work stopped with their workers).  In a fork's child it does
        nothing: the workers and the kept states are the parent's."""
        if os.getpid() != self._pid:
            return
        self._stop.set()
        self._downloads.close()
        self._sched.close()
        self._reaper.join(5)

    def _reap(self) -> None:
        """Once a second: unload models idle past their ttl, stop workers empty past their idle
        timeout, and ping every worker; one that does not answer within ``options.heartbeat``
        seconds is killed and treated as dead."""
        while not self._stop.wait(1.0):
            self._sched.reap_idle()
            self._sched.reap_workers()
            if self.options.heartbeat > 0:
                self._heartbeat(self.options.heartbeat)

    def _heartbeat(self, bound: float) -> None:
        pings = [(w, w.ping()) for w in self._sched.workers.alive()]
        deadline = time.monotonic() + bound
        for worker, pending in pings:
            if pending is None:
                continue
            try:
                pending.get(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                if not self._stop.is_set():
                    worker.kill()

    def _load_quietly(self, name: str) -> None:
        try:
            self.load(name)
        except RouterError:
            pass  # the failure is recorded on the model (status shows it)

    # -- control ---------------------------------------------------------------

    def load(self, name: str, timeout: float | None = None) -> None:
        """Load ``name`` (evicting idle models if needed) and return once LOADED, within
        ``timeout`` seconds (default: queue_timeout; then QueueTimeout)."""
        home.here(self._pid)
        self._exchange(Ask(name, "", "")).load(timeout)

    def unload(self, name: str, wait: float | None = None) -> bool:
        """Unload ``name`` once its requests in flight end, waiting at most ``wait`` seconds
        (default: the model's stop_timeout); False if it was not loaded."""
        home.here(self._pid)
        if wait is None:
            wait = self._sched.resolve(name).config.stop_timeout
        return self._sched.unload(name, wait)

    def status(self) -> Status:
        """Every model (state, requests in flight, bytes held and probed per device set,
        kept prompt states...), every device (total, free, what models may hold, what ours
        hold, what other programs hold, the margin), every worker, the queue, the counters
        and the downloads, as plain values (``pyllmrouter.replies.Status``)."""
        home.here(self._pid)
        out = self._sched.status()
        out["downloads"] = self._downloads.status()
        return out

    def models(self) -> list[ModelConfig]:
        """Every listed model's config, as it will be (a changed model's new one)."""
        home.here(self._pid)
        return list(self._sched.configs().values())

    # -- the live model list ---------------------------------------------------------

    def add_model(self, cfg: ModelConfig) -> None:
        """Serve one more model (ValueError: its name or an alias is taken, or its file or
        arguments are refused, as ``Router()`` refuses them)."""
        home.here(self._pid)
        _check_own([cfg], "add_model()")
        self._sched.add_model(cfg)

    def remove_model(self, name: str) -> None:
        """``name`` takes no new request, finishes those in flight, unloads and goes."""
        home.here(self._pid)
        self._sched.remove_model(name)

    def replace_model(self, cfg: ModelConfig) -> None:
        """``cfg`` takes over its name once the model there has finished and unloaded
        (ValueError as for ``add_model``)."""
        home.here(self._pid)
        _check_own([cfg], "replace_model()")
        self._sched.replace_model(cfg)

    def reload(self) -> dict[str, list[str]]:
        """Read the sources again: new models added, changed ones replaced (once idle),
        removed ones removed (once idle); models added through the API stay.  A bad preset
        changes nothing (PresetError)."""
        home.here(self._pid)
        with self._reloading:
            models, _router_options = self._sources.read()  # router-wide options take a restart
            return self._sched.reconcile(models)

    def _watch(self, period: float) -> None:
        """The sources read again once they change; a reload that fails (a preset being
        edited, a name still held by a model finishing its requests) is tried again each
        period until it succeeds, its failure told once per change."""
        seen = self._sources.stamp()
        told = None  # the sources' stamp whose failure was told
        while not self._stop.wait(period):
            now = self._sources.stamp()
            if now == seen:
                continue
            try:
                self.reload()
            except (ValueError, RuntimeError) as e:
                if told != now:
                    self._sched.bus.publish("models_reload_failed", "*", reason=str(e))
                    told = now
                continue
            seen = now

    def pull(self, name: str) -> None:
        """Download ``org/repo[:tag]`` into llama.cpp's cache, in a short-lived process; it
        is listed (and servable) once it is there (ValueError: the name is taken)."""
        home.here(self._pid)
        if not self._sources.cache:
            raise ValueError(f"pulls are off: this router does not serve llama.cpp's cache of downloads "
                             f"(serve --models-cache, or Sources(cache=True)), so {name!r} would not be listed")
        if name in self._sched.configs():
            raise ValueError(f"model {name!r} already exists")
        self._downloads.room(name)  # a refusal for room first: no header read for it
        self._check_pull(name)
        self._downloads.start(name)

    def _check_pull(self, name: str) -> None:
        """NeverFits at once where the model's headers say it can never fit this router's
        devices (services/pullcheck.py); where they cannot be read, the download goes on and
        llama.cpp's downloader says why it fails (logged here)."""
        try:
            need = pullcheck.host_need(name, self.options.load_timeout)
        except (pullcheck.PullCheckError, subprocess.TimeoutExpired) as e:
            _LOG.warning("pull of %s: its headers were not read, the download goes on: %s", name, e)
            return
        book = self._sched.book
        refused = pullcheck.refusal(name, need, {d: book.capacity(d) for d in book.devices})
        if refused is not None:
            raise refused

    def _downloaded(self, name: str, path: str | None, error: str | None) -> None:
        if path and not self._stop.is_set():
            self.reload()  # the cache is a source: the pulled model is listed as llama.cpp lists it

    def delete(self, name: str) -> None:
        """Remove a model of llama.cpp's cache: its download stopped, or the model removed
        (once its requests have finished) and its files deleted.  UnknownModel, or
        ValueError for a model that is not from the cache."""
        home.here(self._pid)
        if self._downloads.cancel(name):
            return
        cfg = self._sched.configs().get(name)
        if cfg is None:
            if name in self._downloads.status():  # a failed download
                self._downloads.forget(name)
                return
            raise UnknownModel(name, list(self._sched.configs()))
        if cfg.source != "cache":
            raise ValueError(f"model {name!r} is not removable: it is not from llama.cpp's cache (source: {cfg.source})")
        self._sched.remove_model(name)
        deadline = time.monotonic() + cfg.stop_timeout + self.options.load_timeout
        while any(r.name == name for r in self._sched.records()) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._downloads.remove(name)

    @property
    def scheduler(self) -> Scheduler:
        return self._sched

    # -- requests (Methods: call, acall, arelay, serve_now, chat...) ---------------------------

    def _exchange(self, ask: Ask) -> Exchange:
        """The one owner of ``ask``'s life, from its lease to its release (every request of
        Methods is made one here)."""
        home.here(self._pid)
        return Exchange(self._sched, ask, self.options.queue_timeout, self.options.debug_fake_timing,
                        self._stop.is_set)


def _check_own(models: list[ModelConfig], where: str) -> None:
    """The app's own models, checked as llama-server would take them (the file a whole GGUF,
    the arguments llama.cpp's): a mistake fails here, not at the first request.  A model the
    sources list fails at its load, as llama-server's router lists it."""
    for i, m in enumerate(models):
        if not isinstance(m, ModelConfig):
            raise ValueError(f"{where}: item {i} is a {type(m).__name__} ({m!r}), not a ModelConfig: "
                             f"ModelConfig(name, ModelSpec(path, (llama-server arguments...)))")
    check_specs([(m.name, m.spec.path, m.spec.args) for m in models if m.source == API])
