"""The live list's changes: which records exist, and how they come and go.

    add / retire / reconcile(configs) ──▶ the live list (registry.py, through the Book):
        a removed or changed model takes no new request, finishes what it has, unloads,
        and goes (or makes room for its new config, which its waiters follow); a config
        changed only in how its requests are scheduled (priority, max-queue, replicas) or
        in its aliases is tuned in place: nothing unloads, nothing queued is lost
    settle(rec)  a retiring model's next step (registry.step) each time its state or
                 leases change; an extra instance that unloaded goes from the list
    grow(rec)    one more instance of a model whose requests wait (replicas.py):
                 a Record NAME#k, loaded by a lease of its own (``load_instance``)

Roster decides; the Book holds the list and every record, and changes them through its
methods (the caller holds the Book's lock, or each method takes it).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

from pyllmrouter.config import ModelConfig
from pyllmrouter.router.book import Book
from pyllmrouter.router.jobs import Jobs
from pyllmrouter.router.policy import replicas
from pyllmrouter.router.policy.state import State, holds_memory
from pyllmrouter.router.records import Fate, Record
from pyllmrouter.router.registry import API, Changes, Step, diff, step

__all__ = ["Roster"]


class Roster:
    def __init__(self, book: Book, jobs: Jobs, load_instance: Callable[[Record], None]):
        """``load_instance(rec)``: load an extra instance by a lease of its own (the scheduler's)."""
        self._book = book
        self._jobs = jobs
        self._load_instance = load_instance

    def add(self, cfg: ModelConfig, listed: bool = False) -> None:
        """A new model, servable at once (ValueError: its name or an alias is taken;
        ``listed``: it comes with a whole list validated already)."""
        self._book.add(cfg, listed)
        self._book.event("added", cfg.name, source=cfg.source)

    def reconcile(self, configs: Iterable[ModelConfig]) -> Changes:
        """The sources' new list: checked whole first (names and aliases used once, devices
        known), so a bad list changes nothing (ValueError); models added through the API
        stay.  Then every change is made at once: removed and changed models finish their
        requests and go (a changed one's waiters follow its new config), new ones join, and
        the aliases are the new list's from now on, whatever model held them before (a name a
        leaving model still holds as its own is an alias of the new list at once).  A name
        the list gives back while its model, removed, still finishes its requests, brings
        that model back.  The Book's lock held."""
        book = self._book
        wanted = list(configs)
        current = book.configs()
        changes = diff(current, wanted)
        names = {c.name for c in wanted}
        kept = [c for n, c in current.items() if n not in names and c.source == API]
        book.validate([*wanted, *kept])
        for name in changes.remove:
            self.retire(book.named(name), None)
        for cfg in changes.replace:
            self.retire(book.named(cfg.name), cfg)
        for cfg in changes.tune:
            self.tune(book.named(cfg.name), cfg)
        for cfg in changes.add:  # (the list as a whole is valid: its steps need not be)
            leaving = book.named(cfg.name)  # removed, still finishing: listed again
            if leaving is not None:
                book.revive(leaving, cfg)
                book.event("added", cfg.name, source=cfg.source)
                self.settle(leaving)
            else:
                self.add(cfg, listed=True)
        return changes

    def tune(self, rec: Record, cfg: ModelConfig) -> None:
        """A new priority, max-queue, replica count or aliases, in place: the model stays
        loaded and its waiting requests stay (a lower max-queue refuses new ones only); extra
        instances past a lower count finish and go."""
        book = self._book
        if rec.fate is not None:  # retiring already: the new config is what comes after
            return self.retire(rec, cfg)
        book.tune(rec, cfg)
        for k, extra in enumerate(book.instances(rec)[1:], start=2):
            book.tune(extra, dataclasses.replace(extra.config, priority=cfg.priority, max_queue=cfg.max_queue))
            if k > cfg.replicas and extra.fate is None:
                book.set_fate(extra, Fate.REMOVE)
                book.end_follows(extra)
                self.settle(extra)
        book.event("tune", rec.name, priority=cfg.priority, max_queue=cfg.max_queue, replicas=cfg.replicas,
                   aliases=list(cfg.aliases))

    def retire(self, rec: Record, replacement: ModelConfig | None) -> None:
        book = self._book
        for extra in book.instances(rec)[1:]:  # its extra instances finish and go too
            if extra.fate is None:
                book.set_fate(extra, Fate.REMOVE)
                book.end_follows(extra)
                self.settle(extra)
        book.set_retiring(rec, replacement)
        book.end_follows(rec)
        book.event("remove" if replacement is None else "change", rec.name)
        self.settle(rec)

    def settle(self, rec: Record) -> None:
        """A retiring model's next step (registry.step): unload once idle, go once unloaded;
        an extra instance goes once unloaded, whatever unloaded it."""
        book = self._book
        with book.locked():
            if rec.primary is not None and rec.state is State.UNLOADED and rec.leases == 0 \
                    and not any(t.rec is rec for t in book.tickets()):
                book.drop(rec)
                book.event("replica-stop", rec.primary.name, instance=rec.name)
                return
            action = step(rec.state, rec.leases, rec.fate is not None)
            if action is Step.UNLOAD:
                self._jobs.unload_now(rec)
            elif action is Step.TAKE_OUT:
                if book.keep is not None and rec.fate is Fate.REMOVE:
                    # its kept states can serve no one: they go, file work off the Book's lock
                    self._jobs.spawn(book.keep.forget, rec.name)
                new = book.take_out(rec)
                book.event("model_remove" if new is None else "replaced", rec.name)

    def grow(self, rec: Record, arriving: int = 0) -> None:
        """One more instance of ``rec``'s model where its requests wait and it may
        (``arriving``: requests about to take a lease, counted as in flight).  Where the
        model's own instance is unloaded (evicted, or its worker died) while an extra one
        serves, that one loads again first, on any device set its others leave free."""
        book = self._book
        with book.locked():
            if rec.config.replicas <= 1 or rec.fate is not None or book.closed:
                return
            instances = book.instances(rec)
            running = [replicas.Instance(r.name, r.leases, r.slots(), r.primary is None)
                       for r in instances if r.state is State.LOADED]
            # an instance with no memory (UNLOADED) holds no device set: its old one is free; an
            # extra one UNLOADED is on its way (it goes once nobody waits for it: Scheduler.lease)
            loading = sum(1 for r in instances if r.state is State.LOADING
                          or (r.primary is not None and r.state is State.UNLOADED))
            used = {r.device_set for r in instances if r.device_set and holds_memory(r.state)}
            free_sets = [ds for ds in book.candidates(rec) if ds not in used]
            if not replicas.wants_more(rec.config.replicas, running, loading, len(free_sets), arriving):
                return
            if rec.state is State.UNLOADED:
                book.event("replica-start", rec.name, instance=rec.name)
                extra = rec  # the model's own instance, back
            else:
                cfg = dataclasses.replace(rec.config, name=replicas.free_name(rec.name, lambda n: book.named(n) is not None or book.get(n) is not None),
                                          aliases=(), devices=None, source="replica", hidden=True,
                                          load_on_startup=False, persistent=False, replicas=1)
                extra = book.add_replica(cfg, rec)
                book.event("replica-start", rec.name, instance=extra.name)
        self._load_instance(extra)
