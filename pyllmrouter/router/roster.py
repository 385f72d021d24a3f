"""The scheduler's list half: which records exist, and how they come and go.

    add / remove / replace / reconcile(configs) ──▶ the live list (registry.py):
        a removed or changed model takes no new request, finishes what it has, unloads,
        and goes (or makes room for its new config, which its waiters follow); a config
        changed only in how its requests are scheduled (priority, max-queue, replicas)
        is tuned in place: nothing unloads, nothing queued is lost
    settle(rec)  a retiring model's next step (registry.step) each time its state or
                 leases change; an extra instance that unloaded goes from the list
    grow(rec)    one more instance of a model whose requests wait (replicas.py):
                 a Record NAME#k, loaded by a lease of its own (jobs.replicate)

Roster belongs to one Scheduler and works on its state under the scheduler's own lock
(every method is called with it held), as Jobs does; it owns nothing of its own.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Iterable

from pyllmrouter.config import ModelConfig
from pyllmrouter.router import replicas
from pyllmrouter.router.records import Fate, Record
from pyllmrouter.router.registry import Changes, Registry, Step, diff, step
from pyllmrouter.router.state import State

if TYPE_CHECKING:
    from pyllmrouter.router.scheduler import Scheduler

__all__ = ["Roster"]


class Roster:
    def __init__(self, scheduler: "Scheduler", registry: Registry):
        self._s = scheduler
        self._registry = registry

    def add(self, cfg: ModelConfig) -> None:
        self._registry.add(cfg)
        self._s._event("added", cfg.name, source=cfg.source)

    def reconcile(self, configs: Iterable[ModelConfig]) -> Changes:
        """The sources' new list: each change checked first, so a bad list changes nothing
        (ValueError); models added through the API stay."""
        changes = diff(self._registry.configs(), list(configs))
        self._check(changes)
        for cfg in changes.add:
            self.add(cfg)
        for name in changes.remove:
            self.retire(self._registry.get(name), None)
        for cfg in changes.replace:
            self.retire(self._registry.get(cfg.name), cfg)
        for cfg in changes.tune:
            self._tune(self._registry.get(cfg.name), cfg)
        return changes

    def _check(self, changes: Changes) -> None:
        """ValueError if the changes would clash (names, aliases, devices)."""
        probe = Registry(self._s._devices)
        keep = {n: c for n, c in self._registry.configs().items() if n not in changes.remove}
        keep.update({c.name: c for c in (*changes.replace, *changes.tune)})
        for cfg in [*keep.values(), *changes.add]:
            probe.add(cfg)

    def _tune(self, rec: Record, cfg: ModelConfig) -> None:
        """A new priority, max-queue or replica count, in place: the model stays loaded and
        its waiting requests stay (a lower max-queue refuses new ones only); extra
        instances past a lower count finish and go."""
        if rec.fate is not None:  # retiring already: the new config is what comes after
            return self.retire(rec, cfg)
        rec.config = cfg
        for k, extra in enumerate(self._registry.instances(rec)[1:], start=2):
            extra.config = dataclasses.replace(extra.config, priority=cfg.priority, max_queue=cfg.max_queue)
            if k > cfg.replicas and extra.fate is None:
                extra.fate = Fate.REMOVE
                self._s.end_follows(extra)
                self.settle(extra)
        self._s._event("tune", rec.name, priority=cfg.priority, max_queue=cfg.max_queue, replicas=cfg.replicas)

    def retire(self, rec: Record, replacement: ModelConfig | None) -> None:
        for extra in self._registry.instances(rec)[1:]:  # its extra instances finish and go too
            if extra.fate is None:
                extra.fate = Fate.REMOVE
                self._s.end_follows(extra)
                self.settle(extra)
        self._registry.retire(rec, replacement)
        self._s.end_follows(rec)
        self._s._event("remove" if replacement is None else "change", rec.name)
        self.settle(rec)
        self._s._cond.notify_all()

    def settle(self, rec: Record) -> None:
        """A retiring model's next step (registry.step): unload once idle, go once unloaded;
        an extra instance goes once unloaded, whatever unloaded it."""
        s = self._s
        if rec.primary is not None and rec.state is State.UNLOADED and rec.leases == 0 \
                and not any(t.rec is rec for t in s._queue):
            self._registry.drop(rec)
            s._event("replica-stop", rec.primary.name, instance=rec.name)
            s._cond.notify_all()
            return
        action = step(rec.state, rec.leases, rec.fate is not None)
        if action is Step.UNLOAD:
            s._begin_unload(rec)
        elif action is Step.FINISH:
            if s.keep is not None and rec.fate is Fate.REMOVE:
                s.keep.forget(rec.name)  # its kept states can serve no one
            new = self._registry.finish(rec)
            s._event("model_remove" if new is None else "replaced", rec.name)
            s._cond.notify_all()

    def grow(self, rec: Record) -> None:
        """One more instance of ``rec``'s model where its requests wait and it may."""
        s = self._s
        if rec.config.replicas <= 1 or rec.fate is not None or s._closed:
            return
        instances = self._registry.instances(rec)
        running = [replicas.Instance(r.name, r.leases, s._slots(r), r.primary is None)
                   for r in instances if r.state is State.LOADED]
        loading = sum(1 for r in instances if r.primary is not None and r.state is not State.LOADED)
        used = {r.device_set for r in instances if r.device_set}
        free_sets = [ds for ds in s._candidates(rec) if ds not in used]
        if not replicas.wants_more(rec.config.replicas, running, loading, len(free_sets)):
            return
        taken = {r.name for r in instances}
        k = next(k for k in range(2, rec.config.replicas + 2) if replicas.replica_name(rec.name, k) not in taken)
        cfg = dataclasses.replace(rec.config, name=replicas.replica_name(rec.name, k), aliases=(), devices=None,
                                  source="replica", hidden=True, load_on_startup=False, persistent=False, replicas=1)
        extra = self._registry.add_replica(cfg, rec)
        s._event("replica-start", rec.name, instance=extra.name)
        s._jobs.spawn(s._jobs.replicate, extra)
