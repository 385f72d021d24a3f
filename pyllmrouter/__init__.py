"""pyllmrouter: local GGUF models routed by exact per-device memory.

Importing this package loads no llama.cpp backend: the router process stays
free of any GPU context; workers, probes and the CLI import ``llama_cpp``
(then ``_native``) when they need it.  The names below are imported when first
used (PEP 562): ``import pyllmrouter`` itself imports nothing else, so a worker
or a short-lived checking process that imports ``pyllmrouter.engine...`` pays
for what it uses only.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # typing itself is not imported for it
if TYPE_CHECKING:
    from typing import Any

    from pyllmrouter.config import ModelConfig, RouterOptions
    from pyllmrouter.engine.hubprobe import probe
    from pyllmrouter.errors import (LoadFailed, NeverFits, NotLoaded, QueueFull, QueueTimeout, RequestFailed,
                                    RequestTimeout, RouterClosed, RouterError, RouterForked, UnknownModel,
                                    WorkerDied)
    from pyllmrouter.memory import BufferUse, DeviceUse, MemoryEstimate, ModelFacts, ProbeError
    from pyllmrouter.router.api import Router
    from pyllmrouter.spec import ModelSpec, SpecError

# name -> the module that defines it
_WHERE = {
    "ModelConfig": "pyllmrouter.config", "RouterOptions": "pyllmrouter.config",
    **{name: "pyllmrouter.errors" for name in (
        "LoadFailed", "NeverFits", "NotLoaded", "QueueFull", "QueueTimeout", "RequestFailed", "RequestTimeout",
        "RouterClosed", "RouterError", "RouterForked", "UnknownModel", "WorkerDied")},
    **{name: "pyllmrouter.memory" for name in ("BufferUse", "DeviceUse", "MemoryEstimate", "ModelFacts",
                                               "ProbeError")},
    "probe": "pyllmrouter.engine.hubprobe",  # a file, or a hub model from its headers
    "Router": "pyllmrouter.router.api",
    "ModelSpec": "pyllmrouter.spec", "SpecError": "pyllmrouter.spec",
}

__all__ = sorted(_WHERE)

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'pyllmrouter' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value  # once: later lookups find it here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
