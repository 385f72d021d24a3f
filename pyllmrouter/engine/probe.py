"""The probe, run where llama.cpp may be loaded (a worker, the CLI).

    probe(spec) ─┬─ cache hit? ──> MemoryEstimate (from JSON, memory.py)
                 └─ checks the file (exists, GGUF magic)
                    spec.to_args() ──> _native.server_params: what llama-server makes of them
                                   ──> _native.probe_server: llama.cpp's parser, the
                    engine's own llama params (common_model_params_to_llama,
                    common_context_params_to_llama), no_alloc model + context
                    ──> MemoryEstimate (with those params) ──> cache

The arguments are the ones the worker gives the model's engine, so the probe
measures the very structs the engine loads with.
"""

from __future__ import annotations

import os
from typing import Any

from pyllmrouter.config import MiB
from pyllmrouter.engine.backend import forward_log, native
from pyllmrouter.memory import (BufferUse, MemoryEstimate, ModelFacts, ProbeError, cache_path, cache_read,
                                cache_write, check_file)
from pyllmrouter.spec import ModelSpec

__all__ = ["probe", "live_breakdown"]


# -- probing ----------------------------------------------------------------

def _rows(raw: list[dict[str, Any]]) -> tuple[BufferUse, ...]:
    return tuple(BufferUse(**r) for r in raw)


def probe(spec: ModelSpec | str, *, use_cache: bool = True, refresh: bool = False) -> MemoryEstimate:
    """Bytes that loading ``spec`` allocates, per buffer type and device, exactly.

    Reads only the GGUF metadata (tensor data is never touched). Runs in the
    calling process with the devices it can see: a masked process sees only
    its devices.  ``refresh`` probes again and rewrites the cache entry;
    ``use_cache=False`` neither reads nor writes it.  (A model on a hub:
    engine/hubprobe.py's ``probe``, which ``pyllmrouter.probe`` is.)
    """
    if not isinstance(spec, ModelSpec):
        spec = ModelSpec(spec)
    stats = check_file(spec.path)
    key_path = cache_path(spec, stats, os.environ)
    if use_cache and not refresh:
        hit = cache_read(key_path)
        if hit is not None:
            return hit

    nat = native()  # imports llama_cpp: only on a cache miss
    args = spec.to_args()
    try:
        params = nat.server_params(args)
        if params["cache_ram"] < 0:
            raise ValueError("--cache-ram -1 (no limit) cannot be admitted: give the prompt cache's cap in MiB")
        raw = nat.probe_server(args)
    except nat.LlamaError as e:  # "FILE: reason", FILE the one at fault: the model, projector, draft or adapter
        reason = str(e)
        files = (spec.path, params["mmproj"], params["draft"], *params["lora"])
        at_fault = next((p for p in files if p and reason.startswith(p + ": ")), spec.path)
        raise ProbeError(at_fault, reason.removeprefix(at_fault + ": ")) from None
    except ValueError as e:  # llama.cpp's parser refused an argument
        reason = str(e)
        if "invalid device" in reason:
            reason += "; devices here: " + ", ".join(d["name"] for d in nat.devices())
        raise ProbeError(spec.path, reason) from None
    forward_log(raw["log"])
    facts = dict(raw["facts"])
    facts["devices"] = tuple(facts["devices"])
    buffers = _rows(raw["rows"])
    if params["cache_ram"] > 0:  # llama-server's host prompt cache, counted at its cap
        buffers += (BufferUse("prompt_cache", "CPU", True, cache=params["cache_ram"] * MiB),)
    est = MemoryEstimate(
        spec=spec,
        facts=ModelFacts(file_size=sum(st.st_size for st in stats), **facts),
        buffers=buffers,
        n_ctx=raw["n_ctx"],
        n_seq_max=raw["n_seq_max"],
        params=params,
    )
    if use_cache:
        cache_write(key_path, est)
    return est


def live_breakdown(engine: Any) -> tuple[BufferUse, ...]:
    """The buffer rows of a loaded engine's llama_context (``loader.load``; without the
    output buffer)."""
    return _rows(engine.breakdown())
