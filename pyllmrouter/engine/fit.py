"""Fit a model into per-device grants: layers per device, MoE experts in host memory.

    fit(spec, devices, grants, probe, params)   devices fastest first (ggml names as
        │                                        the probing process sees them)
        ├─ probe the spec as given: fits? ──▶ done (one probe)
        ├─ a context left to llama.cpp (no -c): shrunk as llama.cpp's own fit shrinks it
        │  (common_fit_params, step 2: probed at --fit-ctx too, the context interpolated
        │  between the two to what the grants hold, aligned to 256 per stream), one
        │  probe to verify: fits? ──▶ done
        ├─ the projector, then the draft model, to host memory (one probe each):
        │  fits? ──▶ done; what moved is in the plan (``to_host``)
        ├─ costs measured once: per-layer weights and expert weights from the GGUF
        │  header, KV per layer and compute per device from that first probe
        ├─ plan: the output and the last layers on the last device, earlier blocks on
        │  earlier devices, each filled to its grant; for MoE, the experts of the
        │  first k layers in host memory, k as small as fits
        └─ verify with one probe; a device still over its grant gives up one layer
           (MoE: one more layer of experts to the host) and is probed again

llama.cpp places ``n_gpu_layers`` offloaded units (the last layers, then the
output as one more unit) over the devices in proportion to ``tensor_split``;
with integer proportions each device gets exactly its count, so the plan is
expressed as ``n_gpu_layers = sum(counts)`` and ``tensor_split = counts``.
``probe`` returns bytes per pool ({"RPC0": ..., "CPU": ...}); the pool "CPU"
is host memory and its grant is ``grants.get("CPU")`` (no limit if absent).
``params`` is what llama-server makes of the spec's arguments
(``_native.server_params``): whether its context was left to the fit, the
projector and draft it loads, and so on.  A model on the host alone can only be
fitted by its context.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Callable, Mapping, Sequence

from pyllmrouter.spec import ModelSpec

__all__ = ["FitError", "FitPlan", "ModelTensors", "fit", "fit_here"]

HOST = "CPU"
_LAYER = re.compile(r"^blk\.(\d+)\.")
_EXPERTS = re.compile(r"\.ffn_(up|down|gate|gate_up)_(ch|)exps")


class FitError(ValueError):
    pass


@dataclass(frozen=True)
class FitPlan:
    spec: ModelSpec  # what to load: probed as is
    per_device: dict[str, int]  # probed bytes per pool of that spec
    layers: dict[str, int]  # offloaded units per device (the output counts as one)
    experts_on_host: int  # MoE: layers whose experts stay in host memory
    probes: int
    grants: dict[str, int] = field(default_factory=dict)
    to_host: tuple[str, ...] = ()  # parts moved to host memory before any layer: "projector", "draft"
    n_ctx: int | None = None  # the context chosen, where the fit chose it (a context left to llama.cpp)

    def to_dict(self) -> dict:
        return {"spec": self.spec.to_dict(), "per_device": self.per_device, "layers": self.layers,
                "experts_on_host": self.experts_on_host, "probes": self.probes, "grants": self.grants,
                "to_host": list(self.to_host), "n_ctx": self.n_ctx}


def _over(per_device: Mapping[str, int], grants: Mapping[str, int]) -> dict[str, int]:
    return {d: n - grants[d] for d, n in per_device.items() if d in grants and n > grants[d]}


def _totals(measured: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    return {d: u["total"] for d, u in measured.items()}


@dataclass(frozen=True)
class ModelTensors:
    """What the GGUF header says of a model's layers: (name, bytes) of every tensor, and
    the block count (``<arch>.block_count``)."""

    sizes: Sequence[tuple[str, int]]
    n_layer: int

    @cached_property
    def moe(self) -> bool:
        """Whether the model has expert tensors (a mixture of experts)."""
        return any(_EXPERTS.search(n) for n, _ in self.sizes)


@dataclass
class _Costs:
    n_layer: int
    dense: list[int]  # per layer: weights that are not experts, plus KV
    experts: list[int]  # per layer: expert weights
    output: int  # the output unit: output.weight and norm
    compute: dict[str, int]

    def units(self, k: int) -> list[int]:
        """Bytes per offloadable unit (layers, then the output) with the experts of the
        first ``k`` layers in host memory."""
        return [self.dense[i] + (self.experts[i] if i >= k else 0) for i in range(self.n_layer)] + [self.output]


def _costs(tensors: ModelTensors, first: Mapping[str, Mapping[str, int]], devices: Sequence[str]) -> _Costs:
    n_layer = tensors.n_layer
    dense, experts = [0] * n_layer, [0] * n_layer
    output = 0
    for name, size in tensors.sizes:
        m = _LAYER.match(name)
        if m and int(m.group(1)) < n_layer:
            (experts if _EXPERTS.search(name) else dense)[int(m.group(1))] += size
        elif name.startswith("output"):
            output += size
    kv = sum(v.get("kv", 0) for v in first.values())
    for i in range(n_layer):
        dense[i] += kv // max(1, n_layer)
    worst = max((first.get(d, {}).get("compute", 0) for d in devices), default=0)
    compute = {d: first.get(d, {}).get("compute", 0) or worst for d in devices}
    return _Costs(n_layer, dense, experts, output, compute)


@dataclass(frozen=True)
class _Layout:
    """What the layer plans of one fit share: the spec they start from, the devices
    (fastest first), the costs measured once, and whether experts may go to the host
    (MoE).  A plan is ``counts`` (offloaded units per device) and ``k`` (layers whose
    experts stay in host memory)."""

    spec: ModelSpec
    devices: Sequence[str]
    costs: _Costs
    moe: bool

    def fill(self, room: Mapping[str, int], k: int) -> dict[str, int]:
        """Units per device, filling from the last device (output, last layers) backwards."""
        c = self.costs
        units = c.units(k)
        counts = {d: 0 for d in self.devices}
        u = len(units) - 1
        for d in reversed(self.devices):
            free = room[d] - c.compute[d]
            while u >= 0 and units[u] <= free:
                free -= units[u]
                counts[d] += 1
                u -= 1
        return counts

    def placed(self, counts: Mapping[str, int], k: int) -> dict[str, int]:
        """Estimated bytes per device of a plan: its compute buffer and its units (``fill``'s order)."""
        units = self.costs.units(k)
        out, u = {}, len(units) - 1
        for d in reversed(self.devices):
            n = counts.get(d, 0)
            out[d] = self.costs.compute[d] + sum(units[max(0, u - n + 1):u + 1])
            u -= n
        return out

    def spec_for(self, counts: Mapping[str, int], k: int) -> ModelSpec:
        """The spec of a plan."""
        total = sum(counts.values())
        split = tuple(float(counts[d]) for d in self.devices)
        changes: dict = dict(n_gpu_layers=total, tensor_split=split if total else None)
        if self.moe:
            changes.update(n_cpu_moe=k)
        return self.spec.replace(**changes)

    def fewest_on_host(self, room: Mapping[str, int]) -> int:
        """MoE: the smallest k whose estimated plan still offloads every unit (the layer
        count where even no k's does)."""
        n_layer = self.costs.n_layer
        if sum(self.fill(room, n_layer).values()) != n_layer + 1:
            return n_layer
        lo, hi = 0, n_layer
        while lo < hi:
            mid = (lo + hi) // 2
            if sum(self.fill(room, mid).values()) == n_layer + 1:
                hi = mid
            else:
                lo = mid + 1
        return lo


def _pools_used(totals: Mapping[str, int], pools: Sequence[str]) -> int:
    return sum(totals.get(d, 0) for d in pools)


def _context(v: "_Verifier", spec: ModelSpec, params: Mapping, devices: Sequence[str],
             first: Mapping[str, Mapping[str, int]], tensors: ModelTensors) -> ModelSpec | None:
    """llama.cpp's step 2 (common_fit_params): a context left to llama.cpp, shrunk toward
    --fit-ctx in proportion to what the grants lack, aligned to 256 cells per stream (None:
    the context is not the fit's to change)."""
    if not params.get("ctx_auto") or params.get("fit_ctx", -1) < 0:
        return None
    streams = max(1, int(params.get("n_streams", 1)))
    n_max = int(params["n_ctx"])
    n_min = min(int(params["fit_ctx"]) * streams, 2**32 - 1)
    if n_max <= n_min:
        return None
    pools = list(devices) or [HOST]  # the devices, or the host where there are none
    used = _pools_used(_totals(first), pools)
    target = sum(v.grants.get(d, 0) for d in pools)
    if len(pools) > 1:  # whole layers (MoE: tensors) per device waste some room: llama.cpp's allowance
        ngl, n_layer = int(params.get("n_gpu_layers", -1)), tensors.n_layer
        per_layer = sum(first.get(d, {}).get("weights", 0) for d in pools) // max(1, min(ngl, n_layer) if ngl >= 0
                                                                                     else n_layer)
        target -= (len(pools) + 1) * per_layer // (6 if tensors.moe else 2)
    smallest = spec.replace(n_ctx=n_min)
    used_min = _pools_used(v.check(smallest)[0], pools)
    if target <= used_min or used <= used_min:
        return smallest
    n_ctx = n_min + (n_max - n_min) * (target - used_min) // (used - used_min)
    align = 256 * streams
    return spec.replace(n_ctx=max(n_ctx - n_ctx % align, n_min))


class _Verifier:
    """Probes a candidate spec against the grants, and counts the probes."""

    def __init__(self, probe: Callable[[ModelSpec], Mapping[str, Mapping[str, int]]], grants: Mapping[str, int],
                 max_probes: int):
        self.probe, self.grants, self.max_probes, self.count = probe, dict(grants), max_probes, 0

    @property
    def exhausted(self) -> bool:
        return self.count >= self.max_probes

    def measure(self, spec: ModelSpec) -> Mapping[str, Mapping[str, int]]:
        self.count += 1
        return self.probe(spec)

    def check(self, spec: ModelSpec) -> tuple[dict[str, int], dict[str, int]]:
        """(bytes per pool, bytes over the grant per pool) of ``spec``."""
        totals = _totals(self.measure(spec))
        return totals, _over(totals, self.grants)


@dataclass(frozen=True)
class _Start:
    """Where the layer plan starts: the spec with its context and the parts already moved
    to host memory, and that spec's probe."""

    spec: ModelSpec
    first: Mapping[str, Mapping[str, int]]
    to_host: tuple[str, ...]
    n_ctx: int | None


def fit(spec: ModelSpec, devices: Sequence[str], grants: Mapping[str, int],
        probe: Callable[[ModelSpec], Mapping[str, Mapping[str, int]]], tensors: ModelTensors, max_probes: int = 12,
        buffer_types: Mapping[str, str] | None = None, params: Mapping | None = None) -> FitPlan:
    """The spec that fits ``grants`` with the most bytes on ``devices``.

    ``probe(spec)`` returns {pool: {"weights", "kv", "compute", "output", "total"}}.
    ``tensors``: the model's tensors and block count, from its GGUF header.
    With ``buffer_types`` (device -> its buffer type name), what room a device has
    left after whole layers is filled with single tensors of host-resident layers.
    ``params``: llama-server's reading of the spec (``_native.server_params``).
    """
    v = _Verifier(probe, grants, max_probes)
    start = _without_layers(v, spec, devices, tensors, params or {})
    if isinstance(start, FitPlan):
        return start
    return _with_layers(v, start, devices, tensors, buffer_types)


def _without_layers(v: _Verifier, spec: ModelSpec, devices: Sequence[str], tensors: ModelTensors,
                    params: Mapping) -> FitPlan | _Start:
    """The steps before any layer moves, each verified by a probe: the spec as given, its
    context (where llama.cpp's was to choose it), the projector then the draft to host
    memory.  The plan where one fits; else where the layer plan starts."""
    grants = v.grants
    first = v.measure(spec)
    totals = _totals(first)
    experts = spec.n_cpu_moe or 0
    if not _over(totals, grants):
        return FitPlan(spec, totals, {}, experts, v.count, grants)
    n_ctx = None
    shrunk = _context(v, spec, params, devices, first, tensors)
    if shrunk is not None:  # the context first, as llama.cpp's fit: then layers, with the smaller context
        spec, n_ctx = shrunk, shrunk.n_ctx
        first = v.measure(spec)
        totals = _totals(first)
        if not _over(totals, grants):
            return FitPlan(spec, totals, {}, experts, v.count, grants, n_ctx=n_ctx)
    if not devices:
        raise FitError(f"needs {totals.get(HOST, 0)} bytes of host memory"
                       f"{f' at its smallest context ({n_ctx})' if n_ctx else ''}, more than the "
                       f"{grants.get(HOST, 0)} granted, and there is no device to move layers to")
    to_host: list[str] = []
    for part, offloaded, change in (("projector", bool(params.get("mmproj")) and params.get("mmproj_offload", True),
                                     {"mmproj_offload": False}),
                                    ("draft", bool(params.get("draft")) and params.get("draft_n_gpu_layers", -1) != 0,
                                     {"draft_n_gpu_layers": 0})):
        if offloaded and any(d in _over(totals, grants) for d in devices):  # before any layer moves
            spec = spec.replace(**change)
            first = v.measure(spec)
            totals = _totals(first)
            to_host.append(part)
            if not _over(totals, grants):
                return FitPlan(spec, totals, {}, experts, v.count, grants, tuple(to_host), n_ctx)
    return _Start(spec, first, tuple(to_host), n_ctx)


def _with_layers(v: _Verifier, start: _Start, devices: Sequence[str], tensors: ModelTensors,
                 buffer_types: Mapping[str, str] | None) -> FitPlan:
    """The layer plan: costs measured once (the GGUF header, ``start``'s probe), the output
    and the last layers on the last device, earlier blocks on earlier devices, each filled
    to its grant (MoE: the experts of as few first layers as fit in host memory); then
    verified by probes, grown where measured room holds more, topped up with single tensors."""
    lay = _Layout(start.spec, devices, _costs(tensors, start.first, devices), tensors.moe)
    room = {d: v.grants.get(d, 0) for d in devices}
    k = lay.fewest_on_host(room) if lay.moe else 0
    counts = lay.fill(room, k)
    quick = _with_extras(v, lay, counts, k, tensors, buffer_types) if lay.moe else None
    if quick is not None:  # room the estimate left unused takes more expert tensors, if one fits
        return replace(_top_up(v, quick, devices, tensors, buffer_types), probes=v.count,
                       to_host=start.to_host, n_ctx=start.n_ctx)
    k, candidate, totals = _verify(v, lay, counts, k)
    candidate, totals = _grow(v, lay, counts, k, candidate, totals)
    plan = FitPlan(candidate, totals, {d: n for d, n in counts.items() if n}, k if lay.moe else 0, v.count, v.grants,
                   start.to_host, start.n_ctx)
    plan = _top_up(v, plan, devices, tensors, buffer_types)
    return replace(plan, probes=v.count)


def _verify(v: _Verifier, lay: _Layout, counts: dict[str, int], k: int) -> tuple[int, ModelSpec, dict[str, int]]:
    """Probe the estimated plan; a device still over its grant gives up one layer (MoE: one
    more layer of experts to the host) and the plan is probed again.  Updates ``counts`` to
    the plan that fits: (its k, its spec, its bytes per pool)."""
    devices, n_layer = lay.devices, lay.costs.n_layer
    while True:
        candidate = lay.spec_for(counts, k)
        totals, over = v.check(candidate)
        if not over:
            return k, candidate, totals
        if HOST in over and not any(d in over for d in devices):
            raise FitError(f"needs {totals[HOST]} bytes of host memory with {sum(counts.values())} of "
                           f"{n_layer + 1} layers on {', '.join(devices)}, more than the {v.grants[HOST]} granted")
        if v.exhausted:
            raise FitError(f"no fit within {v.max_probes} probes: still over on {', '.join(sorted(over))}")
        if lay.moe and k < n_layer and any(d in over for d in devices):
            k += 1  # one more layer's experts to the host
            continue
        shrink = [d for d in devices if d in over and counts[d] > 0]
        if not shrink:
            raise FitError(f"cannot fit: {', '.join(f'{d} over by {n} bytes' for d, n in over.items())}")
        for d in shrink:
            counts[d] -= 1


def _with_extras(v: _Verifier, lay: _Layout, counts: dict[str, int], k: int, tensors: ModelTensors,
                 buffer_types: Mapping[str, str] | None) -> FitPlan | None:
    """The estimated plan with the room it leaves filled by single host tensors, verified
    at once (one probe where the estimate holds; a device over its grant gives back
    tensors for its excess and is probed again).  None: verify layer by layer instead."""
    if not buffer_types:
        return None
    base = lay.spec_for(counts, k)
    est = lay.placed(counts, k)
    plan = FitPlan(base, est, {d: n for d, n in counts.items() if n}, k if lay.moe else 0, 0, v.grants)
    extra = _pick_extras(plan, lay.devices, tensors, buffer_types, v.grants)
    if not extra:
        return None
    for _attempt in range(2):
        candidate = base.replace(tensor_overrides=tuple((p, b) for p, b, _d, _n in extra) + tuple(base.tensor_overrides))
        totals, over = v.check(candidate)
        if not over:
            return replace(plan, spec=candidate, per_device=totals, probes=v.count)
        if HOST in over or any(not any(e[2] == d for e in extra) for d in over):
            return None  # whole layers were estimated too large: the layer-by-layer path
        _give_back(extra, over)
        if not extra:
            return None
    return None


def _give_back(extra: list[tuple[str, str, str, int]], over: Mapping[str, int]) -> None:
    """Drop the last-added tensors of each over device until its excess is covered."""
    for d, excess in over.items():
        while excess > 0 and any(e[2] == d for e in extra):
            i = max(i for i, e in enumerate(extra) if e[2] == d)
            excess -= extra.pop(i)[3]


def _grow(v: _Verifier, lay: _Layout, counts: dict[str, int], k: int, spec_now: ModelSpec,
          totals_now: dict[str, int]) -> tuple[ModelSpec, dict[str, int]]:
    """The plan was estimated from the first probe's compute buffers; where the measured
    room still holds a whole layer, add it (one probe for all devices; what overflows goes
    back). Updates ``counts`` to what was kept."""
    units = lay.costs.units(k)
    grown = dict(counts)
    next_unit = len(units) - 1 - sum(grown.values())
    for d in reversed(lay.devices):
        room = v.grants.get(d, 0) - totals_now.get(d, 0)
        while next_unit >= 0 and units[next_unit] <= room:
            room -= units[next_unit]
            grown[d] += 1
            next_unit -= 1
    while grown != counts and not v.exhausted:
        candidate = lay.spec_for(grown, k)
        totals, over = v.check(candidate)
        if not over:
            counts.update(grown)
            return candidate, totals
        back = [d for d in over if grown.get(d, 0) > counts.get(d, 0)]
        if not back:
            break  # over where nothing was added (compute buffers elsewhere grew): keep the verified plan
        for d in back:
            grown[d] -= 1
    return spec_now, totals_now


def _host_tensors(plan: FitPlan, tensors: ModelTensors) -> list[tuple[int, str, int]]:
    """(layer, name, bytes) of the expert tensors that the plan leaves in host memory,
    nearest the offloaded layers first.  (Other tensors of a host layer are not worth
    moving alone: the layer's graph then crosses devices, and the compute buffers grow
    by more than the tensor.)"""
    s, n_layer = plan.spec, tensors.n_layer
    ngl = n_layer + 1 if s.n_gpu_layers is None or s.n_gpu_layers < 0 else s.n_gpu_layers
    first_offloaded = max(0, n_layer + 1 - ngl)
    moved = {pattern for pattern, _buft in s.tensor_overrides}  # already placed one by one
    out = []
    for name, size in tensors.sizes:
        m = _LAYER.match(name)
        if not m:
            continue
        i = int(m.group(1))
        on_host = i < first_offloaded or i < (s.n_cpu_moe or 0)
        if on_host and size > 0 and _EXPERTS.search(name) and "^" + re.escape(name) + "$" not in moved:
            out.append((i, name, size))
    return sorted(out, key=lambda t: (-t[0], -t[2]))


def _pick_extras(plan: FitPlan, devices: Sequence[str], tensors: ModelTensors, buffer_types: Mapping[str, str],
                 grants: Mapping[str, int]) -> list[tuple[str, str, str, int]]:
    """(pattern, buffer type, device, bytes) of host tensors that fit the room the plan
    leaves, nearest the offloaded layers first, into the device with the most room."""
    room = {d: grants[d] - plan.per_device.get(d, 0) for d in devices if d in grants}
    extra = []
    for _layer, name, size in _host_tensors(plan, tensors):
        d = max(room, key=room.get) if room else None
        if d is None or room[d] < size:
            continue
        room[d] -= size
        extra.append(("^" + re.escape(name) + "$", buffer_types[d], d, size))
    return extra


def _top_up(v: _Verifier, plan: FitPlan, devices: Sequence[str], tensors: ModelTensors,
            buffer_types: Mapping[str, str] | None) -> FitPlan:
    """Room left on a device after whole layers takes single tensors from the host."""
    if not buffer_types:
        return plan
    extra = _pick_extras(plan, devices, tensors, buffer_types, v.grants)
    while extra and not v.exhausted:
        overrides = tuple((p, b) for p, b, _d, _n in extra) + tuple(plan.spec.tensor_overrides)
        candidate = plan.spec.replace(tensor_overrides=overrides)
        totals, over = v.check(candidate)
        if not over:
            return replace(plan, spec=candidate, per_device=totals)
        if HOST in over:
            break
        _give_back(extra, over)
    return plan


def fit_here(spec: ModelSpec, grants: Mapping[str, int], devices: Sequence[str] | None = None) -> FitPlan:
    """``fit`` with probes in this process, over the devices it sees (fastest first:
    as ggml lists them, or as given); with none, over the host alone (the context)."""
    from pyllmrouter.engine.backend import native  # noqa: PLC0415
    from pyllmrouter.memory import ProbeError
    from pyllmrouter.engine.probe import probe  # noqa: PLC0415

    nat = native()
    devs = list(devices) if devices is not None else [d["name"] for d in nat.devices() if d["type"] != "cpu"]
    unknown = [d for d in grants if d != HOST and d not in devs]
    if unknown:
        raise FitError(f"grants name devices this process does not see: {', '.join(unknown)}")
    meta = nat.metadata(spec.path)
    n_layer = meta.get(f"{meta.get('general.architecture')}.block_count")
    if not isinstance(n_layer, int):
        raise ProbeError(spec.path, "no <arch>.block_count in the GGUF header")
    try:
        params = nat.server_params(spec.to_args())
    except ValueError as e:
        raise ProbeError(spec.path, str(e)) from None

    def run(s: ModelSpec) -> dict[str, dict[str, int]]:
        return {d.device: {"weights": d.weights, "kv": d.kv, "compute": d.compute, "output": d.output,
                           "total": d.total} for d in probe(s).devices}

    tensors = ModelTensors(nat.tensor_sizes(spec.path), n_layer)
    return fit(spec, devs, {d: g for d, g in grants.items()}, run, tensors,
               buffer_types={d: nat.device_buffer_type(d) for d in devs}, params=params)
