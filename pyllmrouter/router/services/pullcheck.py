"""A pull checked before its download: a hub model that can never fit is refused at once.

    host_need(name) ──▶ python -m pyllmrouter.engine.hubprobe -hf NAME (a short-lived process
                        with no device: the probe of its files' headers, every buffer in host
                        memory; nothing downloaded)
                    ◀── {"total", "per_device", "bytes_read", "size", "files"} | {"error"}
    refusal(name, need, capacity) ──▶ NeverFits where the bytes exceed what every device of
                        the router can hold together

With every part in host memory a model needs the least it can: offloading a layer moves
its weights and KV cache to a device and adds a compute buffer there, it frees nothing.
So a model whose host-only bytes exceed the sum of the router's capacities (each device's
and the host's) fits no placement; one below may still not fit, and is left to admission.
The router process never loads llama.cpp: the probe runs in the child.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Mapping

from pyllmrouter.errors import NeverFits

__all__ = ["PullCheckError", "host_need", "refusal"]

_MiB = 1 << 20
HUB_TIMEOUT = 5.0  # seconds the hub may take to answer one of the check's requests
# the child must not open a GPU context: it measures host memory only
_NO_GPU = {"CUDA_VISIBLE_DEVICES": "-1", "HIP_VISIBLE_DEVICES": "-1", "ROCR_VISIBLE_DEVICES": "-1",
           "GGML_VK_VISIBLE_DEVICES": "-1"}


class PullCheckError(RuntimeError):
    """The headers could not be read or probed: the message says why."""


def host_need(name: str, timeout: float = 120.0, hub_timeout: float = HUB_TIMEOUT) -> dict[str, Any]:
    """What the headers of hub model ``name`` ("org/repo[:quant]") say it needs, every buffer
    in host memory (see the module); ``hub_timeout``: seconds the hub may take to answer
    one request (a hub that does not answer leaves the pull to the downloader, soon)."""
    proc = subprocess.run([sys.executable, "-m", "pyllmrouter.engine.hubprobe", "--timeout", str(hub_timeout),
                           "-hf", name],
                          capture_output=True, text=True, env={**os.environ, **_NO_GPU}, timeout=timeout)
    try:
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise PullCheckError(f"{name}: reading its headers failed (exit {proc.returncode}): "
                             f"{proc.stderr.strip()[-500:]}") from None
    if "error" in out:
        raise PullCheckError(out["error"])
    return out


def refusal(name: str, need: Mapping[str, Any], capacity: Mapping[str, int]) -> NeverFits | None:
    """NeverFits where ``need`` (host_need's) exceeds the sum of ``capacity`` (per device:
    what it can hold for models); None: it may fit."""
    total, room = int(need["total"]), sum(max(0, c) for c in capacity.values())
    if total <= room:
        return None
    rooms = ", ".join(f"{d} {c / _MiB:.0f} MiB" for d, c in capacity.items())
    return NeverFits(name, "all devices", total, room,
                     f"its files' headers say it needs {total} bytes ({total / _MiB:.0f} MiB) with every part in "
                     f"host memory, the least it can, and this router's devices can hold {room} bytes "
                     f"({room / _MiB:.0f} MiB) in all ({rooms}); nothing was downloaded (read "
                     f"{need.get('bytes_read', 0)} of its {need.get('size', 0)} bytes)")
