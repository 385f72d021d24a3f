"""The scheduler's status: every model, device and worker as plain values, read through
the Book's methods under its lock (free memory and the keep store's report read before
it is taken).

    status(book, inventory) ──▶ {"models": {name: Record.report + parts, idle, waiting},
                                 "devices": {name: total, free, capacity, held, available,
                                             overhead, kept, external, margin},
                                 "workers": [...], "counters", "queue", "kept"}
"""

from __future__ import annotations

import time
from typing import Any

from pyllmrouter.devices import HOST, Inventory
from pyllmrouter.router.book import Book
from pyllmrouter.router.policy import parts

__all__ = ["status"]


def status(book: Book, inventory: Inventory) -> dict[str, Any]:
    free = inventory.free()
    kept = book.keep.report() if book.keep is not None else {"enabled": False, "models": {}}
    with book.locked():
        available = book.available(free)
        external = book.external(free)
        held = book.held()
        tickets = book.tickets()
        models, now = {}, time.monotonic()
        for r in book.records():
            models[r.name] = m = r.report(kept["models"].get(r.name))
            pools = r.components.get(r.device_set, {}) if m["held"] else {}
            m["parts"] = parts.split(m["held"], parts.by_device(
                pools, lambda p, ds=r.device_set: inventory.to_inventory(ds, p)))
            m["idle_seconds"] = round(now - r.last_used, 1) if r.last_used and not r.leases else None
            waiting = [t for t in tickets if t.rec is r]
            m["waiting"] = {"requests": len(waiting), "why": waiting[0].why if waiting else None,
                            "short": dict(waiting[0].short) if waiting else {}}
        workers = book.workers
        overhead: dict[str, int] = {}
        for w in workers.all():
            for d, n in w.overhead.items():
                overhead[d] = overhead.get(d, 0) + n
        kept_ram = book.keep.held_ram() if book.keep is not None else 0
        devices = {
            n: {"kind": d.kind, "total": d.total, "free": free.get(n), "capacity": book.capacity(n),
                "held": held.get(n, 0), "available": available.get(n),
                # the parts of held that are no model's, and what is not ours to give
                "overhead": overhead.get(n, 0), "kept": kept_ram if n == HOST else 0,
                "external": external[n],
                "margin": book.options.margin}
            for n, d in book.devices.items()
        }
        idle = workers.idle(time.monotonic())
        out_workers = [{"devices": sorted(w.devices), "pid": w.pid, "alive": w.alive, "overhead": dict(w.overhead),
                        "idle_seconds": round(idle[w], 1) if w in idle else None,
                        "stopping": workers.get(w.devices) is not w}
                       for w in workers.all()]
        return {"models": models, "devices": devices, "workers": out_workers, "counters": book.counters(),
                "queue": len(tickets), "kept": {k: v for k, v in kept.items() if k != "models"}}
