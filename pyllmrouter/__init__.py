"""pyllmrouter: local GGUF models routed by exact per-device memory.

Importing this package loads no llama.cpp backend: the router process stays
free of any GPU context; workers, probes and the CLI import ``llama_cpp``
(then ``_native``) when they need it.
"""

from pyllmrouter.config import ModelConfig, RouterOptions
from pyllmrouter.errors import (LoadFailed, NeverFits, NotLoaded, QueueFull, QueueTimeout, RequestFailed,
                                RequestTimeout, RouterClosed, RouterError, RouterForked, UnknownModel, WorkerDied)
from pyllmrouter.memory import BufferUse, DeviceUse, MemoryEstimate, ModelFacts, ProbeError
from pyllmrouter.engine.hubprobe import probe_any as probe
from pyllmrouter.router.api import Router
from pyllmrouter.spec import ModelSpec, SpecError

__all__ = [
    "BufferUse",
    "DeviceUse",
    "LoadFailed",
    "MemoryEstimate",
    "ModelConfig",
    "ModelFacts",
    "ModelSpec",
    "NeverFits",
    "NotLoaded",
    "ProbeError",
    "QueueFull",
    "QueueTimeout",
    "RequestFailed",
    "RequestTimeout",
    "Router",
    "RouterClosed",
    "RouterForked",
    "RouterError",
    "RouterOptions",
    "SpecError",
    "UnknownModel",
    "WorkerDied",
    "probe",
]

__version__ = "0.1.0"
