"""The scheduler's status: every model, device and worker as plain values, read under
the scheduler's lock (free memory and the keep store's report read before it is taken).

    status(s) ──▶ {"models": {name: Record.report + parts, idle, waiting},
                   "devices": {name: total, free, capacity, held, available, overhead,
                               kept, external, margin},
                   "workers": [...], "counters", "queue", "kept"}
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from pyllmrouter.devices import HOST
from pyllmrouter.router import parts

if TYPE_CHECKING:
    from pyllmrouter.router.scheduler import Scheduler

__all__ = ["status"]


def status(s: "Scheduler") -> dict[str, Any]:
    free = s.inventory.free()
    kept = s._keep.report() if s._keep is not None else {"enabled": False, "models": {}}
    with s._cond:
        available = s._available(free)
        held = s._held()
        models, now = {}, time.monotonic()
        for r in s._registry.records():
            models[r.name] = m = r.report(kept["models"].get(r.name))
            pools = r.components.get(r.device_set, {}) if m["held"] else {}
            m["parts"] = parts.split(m["held"], parts.by_device(
                pools, lambda p, ds=r.device_set: s.inventory.to_inventory(ds, p)))
            m["idle_seconds"] = round(now - r.last_used, 1) if r.last_used and not r.leases else None
            waiting = [t for t in s._queue if t.rec is r]
            m["waiting"] = {"requests": len(waiting), "why": waiting[0].why if waiting else None,
                            "short": dict(waiting[0].short) if waiting else {}}
        overhead: dict[str, int] = {}
        for w in s.workers.all():
            for d, n in w.overhead.items():
                overhead[d] = overhead.get(d, 0) + n
        kept_ram = s._keep.held_ram() if s._keep is not None else 0
        devices = {
            n: {"kind": d.kind, "total": d.total, "free": free.get(n), "capacity": s._capacity(n),
                "held": held.get(n, 0), "available": available.get(n),
                # the parts of held that are no model's, and what is not ours to give
                "overhead": overhead.get(n, 0), "kept": kept_ram if n == HOST else 0,
                "external": max(0, d.total - free.get(n, d.total) - held.get(n, 0)),
                "margin": s.options.margin}
            for n, d in s._devices.items()
        }
        idle = s.workers.idle(time.monotonic())
        workers = [{"devices": sorted(w.devices), "pid": w.pid, "alive": w.alive, "overhead": dict(w.overhead),
                    "idle_seconds": round(idle[w], 1) if w in idle else None,
                    "stopping": s.workers.get(w.devices) is not w}
                   for w in s.workers.all()]
        return {"models": models, "devices": devices, "workers": workers, "counters": dict(s.counters),
                "queue": len(s._queue), "kept": {k: v for k, v in kept.items() if k != "models"}}
