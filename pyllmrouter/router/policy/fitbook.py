"""The fits of one model: for a device set and a grant, the spec the router loads.

    lookup(ds, grant) ──▶ a fit made for this grant, or for a larger one whose bytes
                          also fit this one; a failure for a grant at least as large
                          (no fit can exist then); None: fit again
    add(ds, fitted)   ──▶ remembered (the last few per device set)

A grant is bytes per device (inventory names, the host included): what the model
may take there, i.e. what is free plus what the models the eviction policy may
remove hold (placement.grant).  The scheduler owns the instances (one per model)
and calls them under its lock; fitting itself runs in a masked worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from pyllmrouter import tables
from pyllmrouter.devices import HOST
from pyllmrouter.spec import ModelSpec

__all__ = ["Fitted", "Fits", "mib", "fit_over"]

KEEP = 8  # fits remembered per device set


@dataclass(frozen=True)
class Fitted:
    grant: Mapping[str, int]
    spec: ModelSpec | None = None  # what to load; None: no fit within this grant
    need: Mapping[str, int] = field(default_factory=dict)  # probed bytes of ``spec`` per device
    layers: Mapping[str, int] = field(default_factory=dict)
    experts_on_host: int = 0
    to_host: tuple[str, ...] = ()  # parts moved to host memory before any layer ("projector", "draft")
    error: str | None = None
    n_ctx: int | None = None  # the context the fit chose (a context left to llama.cpp), if it chose one

    @property
    def ok(self) -> bool:
        return self.spec is not None

    def to_dict(self) -> dict:
        return {"grant": dict(self.grant), "need": dict(self.need), "layers": dict(self.layers),
                "experts_on_host": self.experts_on_host, "to_host": list(self.to_host), "error": self.error,
                "n_ctx": self.n_ctx}


def mib(per_device: Mapping[str, int]) -> str:
    return ", ".join(f"{d} {tables.mib(n)} MiB" for d, n in sorted(per_device.items()))


def _within(small: Mapping[str, int], big: Mapping[str, int]) -> bool:
    return all(n <= big.get(d, 0) for d, n in small.items())


class Fits:
    def __init__(self) -> None:
        self._by_set: dict[frozenset[str], list[Fitted]] = {}

    def lookup(self, device_set: frozenset[str], grant: Mapping[str, int]) -> Fitted | None:
        for f in reversed(self._by_set.get(device_set, [])):
            if dict(f.grant) == dict(grant):
                return f
        for f in reversed(self._by_set.get(device_set, [])):
            if f.ok and _within(grant, f.grant) and _within(f.need, grant):
                return f  # made for more room, and takes no more than this grant
            if not f.ok and _within(grant, f.grant):
                return f  # nothing fitted into more room
        return None

    def add(self, device_set: frozenset[str], fitted: Fitted) -> None:
        kept = self._by_set.setdefault(device_set, [])
        kept.append(fitted)
        del kept[:-KEEP]


def fit_over(device_set: frozenset[str], local: dict[str, str], params: dict[str, Any]) -> tuple[str, ...]:
    """The devices a fit may share a model over: the set's real devices and the host
    (layers, experts, the context); where there are none (the host alone, emulated
    devices), the set itself, whose context alone can shrink; none where llama-server's
    fit is off for the model (--fit off)."""
    if not params.get("fit", True):
        return ()
    if local:
        return (*sorted(local), HOST)
    return tuple(sorted(device_set)) if params.get("ctx_auto") else ()
