"""What a worker process costs before any model, known before it starts.

    estimate(ds) ──▶ bytes per device a new worker of device set ``ds`` will hold: on each
                     GPU of its mask its context, on the host its process; as learned from
                     the workers started before (kept across restarts), else a safe default
    learn(ds, measured) ──▶ a started worker's measured bytes (the host's from its Ready,
                     a GPU's from what the device reports for its process) become the
                     estimate for the next worker of that kind

A worker's cost is known only once it runs; the first worker of a device set is admitted
on its estimate, which must never be below the truth, or a load beside it could be admitted
on bytes its context takes.  Costs are kept per *kind*, not per device set: every GPU of a
kind (``cuda``, ``emulated``...) costs one context, and the host process costs what the
backends it opens cost (``host/cuda`` for a worker of CUDA devices, ``host/cpu`` for a worker
of the host alone).  An emulated device's cost is configured (``Inventory.worker_overhead``)
and wins over both.  The learned table is a small JSON file in the cache directory, written
whenever a measurement changes it; a file that cannot be read or written is an empty table.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Mapping

from pyllmrouter.config import MiB
from pyllmrouter.devices import HOST, Inventory

__all__ = ["WorkerCosts", "DEFAULTS", "SLACK", "kind_of"]

_LOG = logging.getLogger(__name__)

# a safe default until one is measured: a CUDA context with cuBLAS's workspace and pools
# (hundreds of MB on a current GPU), and a worker's process with the backends imported
DEFAULTS: dict[str, int] = {"cuda": 1024 * MiB, "host/cuda": 1024 * MiB, "host/cpu": 512 * MiB,
                            "host/emulated": 512 * MiB, "host/rpc": 512 * MiB}

SLACK = 16  # a learned cost is estimated 1/16 higher: two starts of one program differ a little


def kind_of(device: str, device_set: frozenset[str], kinds: Mapping[str, str]) -> str:
    """The key a device's cost is kept under in a worker of ``device_set`` (``kinds``: device
    name -> kind): a GPU's kind, or the host's with the kinds of the set's other devices."""
    if device != HOST:
        return kinds.get(device, "unknown")
    others = sorted({kinds.get(d, "unknown") for d in device_set if d != HOST}) or ["cpu"]
    return "host/" + "+".join(others)


class WorkerCosts:
    def __init__(self, inventory: Inventory, path: Path | None = None, defaults: Mapping[str, int] | None = None):
        """``path``: where the learned table is kept (None: not kept); ``defaults``: per kind,
        the estimate until one is measured (a kind not there: 0, a device that holds nothing
        of a worker's, as an rpc-server's)."""
        self._inventory = inventory
        devices = inventory.devices()
        self._kinds = {d.name: d.kind for d in devices}
        self._totals = {d.name: d.total for d in devices}  # no cost is more than a device holds
        self._path = path
        self._defaults = dict(DEFAULTS if defaults is None else defaults)
        self._lock = threading.Lock()
        self._learned: dict[str, int] = _read(path)

    def estimate(self, device_set: frozenset[str]) -> dict[str, int]:
        """Bytes per device a new worker of ``device_set`` will hold before any model."""
        out = {}
        with self._lock:
            for d in {*device_set, HOST}:
                key = kind_of(d, device_set, self._kinds)
                learned = self._learned.get(key)
                n = self._defaults.get(key, 0) if learned is None else learned + learned // SLACK
                if n:
                    out[d] = min(n, self._totals.get(d, n))
        out.update(self._inventory.worker_overhead(device_set))  # configured: exact
        return out

    def guessed(self, device_set: frozenset[str]) -> bool:
        """Whether a part of the estimate is a default (no worker of that kind has run)."""
        configured = self._inventory.worker_overhead(device_set)
        with self._lock:
            return any(key not in self._learned and self._defaults.get(key, 0)
                       for d in {*device_set, HOST} if d not in configured
                       for key in (kind_of(d, device_set, self._kinds),))

    def learn(self, device_set: frozenset[str], measured: Mapping[str, int]) -> None:
        """A started worker's measured bytes per device (only those measured)."""
        configured = self._inventory.worker_overhead(device_set)
        with self._lock:
            changed = False
            for d, n in measured.items():
                if d in configured:
                    continue
                key = kind_of(d, device_set, self._kinds)
                changed |= self._learned.get(key) != n
                self._learned[key] = n
            table = dict(self._learned) if changed else None
        if table is not None and self._path is not None:
            _write(self._path, table)

    def learned(self) -> dict[str, int]:
        with self._lock:
            return dict(self._learned)


def _read(path: Path | None) -> dict[str, int]:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
        return {str(k): int(v) for k, v in data.items() if int(v) >= 0}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError, AttributeError) as e:
        _LOG.warning("cannot read the workers' costs in %s (%s): starting from the defaults", path, e)
        return {}


def _write(path: Path, table: dict[str, int]) -> None:
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".workers-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        _LOG.warning("cannot keep the workers' costs in %s: %s", path, e)
        if tmp is not None:
            with contextlib.suppress(OSError):  # (a part written: nothing to keep of it)
                os.unlink(tmp)
