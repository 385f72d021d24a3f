"""pyllmrouter: exact per-device memory for local GGUF models.

Importing this package loads no llama.cpp backend; the probe and loader import
``llama_cpp`` (then ``_native``) on first use.
"""

from .probe import BufferUse, DeviceUse, MemoryEstimate, ModelFacts, ProbeError, probe
from .spec import ModelSpec, SpecError

__all__ = [
    "BufferUse",
    "DeviceUse",
    "MemoryEstimate",
    "ModelFacts",
    "ModelSpec",
    "ProbeError",
    "SpecError",
    "probe",
]

__version__ = "0.1.0"
