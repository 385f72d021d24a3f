"""Pure: what a resident model's bytes on each device are made of.

    held  {device: bytes}                         what admission counts (exact)
    pools {device: {component: bytes}}            the probe's components, mapped per
                                                  component to inventory devices
        ──▶ parts {device: {component: bytes}}    each device's parts sum to held[device]

The probe's components are the model's unfitted, unshared measure: a fit (fewer
layers, experts on the host) changes the bytes, and emulated devices split what
the CPU runs evenly.  So each device's components are scaled to what it holds,
the rounding left to its largest part, and the sum is exactly ``held``: a bar
drawn from ``parts`` equals ``/devices``.  A device with bytes held and no
component gets them as ``other``.
"""

from __future__ import annotations

from typing import Mapping

__all__ = ["COMPONENTS", "by_device", "split"]

# the probe's components, in the order a device bar draws them
COMPONENTS = ("weights", "kv", "compute", "output", "cache", "projector", "draft", "lora", "checkpoints")


def by_device(components: Mapping[str, Mapping[str, int]], to_inventory) -> dict[str, dict[str, int]]:
    """``components`` per worker pool ({pool: {component: bytes}}) as {device: {component:
    bytes}}, each component mapped on its own by ``to_inventory({pool: bytes})``."""
    out: dict[str, dict[str, int]] = {}
    for name in COMPONENTS:
        pools = {pool: int(parts.get(name, 0)) for pool, parts in components.items()}
        if not any(pools.values()):
            continue
        for device, n in to_inventory(pools).items():
            if n:
                out.setdefault(device, {})[name] = out.get(device, {}).get(name, 0) + n
    return out


def split(held: Mapping[str, int], pools: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, int]]:
    """Per device of ``held``, its components scaled so that they sum to ``held[device]``."""
    out: dict[str, dict[str, int]] = {}
    for device, total in held.items():
        if total <= 0:
            continue
        parts = {k: v for k, v in pools.get(device, {}).items() if v > 0}
        measured = sum(parts.values())
        if measured == 0:
            out[device] = {"other": total}
            continue
        scaled = {k: v * total // measured for k, v in parts.items()}
        largest = max(scaled, key=lambda k: scaled[k])
        scaled[largest] += total - sum(scaled.values())
        out[device] = {k: v for k, v in scaled.items() if v}
    return out
