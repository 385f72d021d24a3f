"""A hub repository's fit table: every quant x context x KV cache type, from the headers alone.

    table(opts, grants) ──▶ the repository's quants (its file list: hubfiles.quants)
                        ──▶ per quant, stand-ins of its files (hubprobe.standing)
                        ──▶ per context and KV cache type: the probe's exact bytes per device
                            ──▶ fits whole (every device within its grant)
                             └─▶ else the fit (engine/fit.py): fits with layers or experts in
                                 host memory, or never

Run where probes run (the CLI): ``pyllmrouter fit -hf org/repo --table``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Sequence

from pyllmrouter import hubfiles
from pyllmrouter.engine.hubprobe import HubOptions, standing
from pyllmrouter.memory import HOST, ProbeError
from pyllmrouter.spec import ModelSpec
from pyllmrouter.tables import MiB, mib, render

__all__ = ["Cell", "contexts", "table", "cmd_table"]


@dataclass(frozen=True)
class Cell:
    quant: str
    file: str
    size: int  # the model's files, bytes (every part)
    n_ctx: int
    cache_type: str
    per_device: dict[str, int]  # the whole load's exact bytes per pool
    verdict: str  # "fits", "fits moved" (layers or experts in host memory), "never"
    detail: str = ""  # the fit's layers and experts, or why it never fits


def contexts(train: int) -> list[int]:
    """Powers of four from 1024 below the trained context, and the trained context."""
    out = [c for c in (1024 << (2 * k) for k in range(12)) if c < train]
    return out + [train] if train > 0 else out or [4096]


def _verdict(spec: ModelSpec, per_device: dict[str, int], grants: dict[str, int],
             devices: list[str] | None) -> tuple[str, str]:
    from pyllmrouter.engine.fit import FitError, fit_here  # noqa: PLC0415

    over = {d: n - grants.get(d, 0) for d, n in per_device.items() if n > grants.get(d, 0)}
    if not over:
        return "fits", ""
    try:
        plan = fit_here(spec, grants, devices)
    except FitError as e:
        return "never", str(e)
    layers = ", ".join(f"{d} {n}" for d, n in plan.layers.items() if d != HOST)
    return "fits moved", (f"layers: {layers or 'none'}; experts of {plan.experts_on_host} layers in host memory"
                          + "".join(f"; the {p} in host memory" for p in plan.to_host))


def _cells(opts: HubOptions, quant: str, files: list[hubfiles.HubFile], grants: dict[str, int],
           devices: list[str] | None, ctxs: Sequence[int] | None, types: Sequence[str]) -> list[Cell]:
    from pyllmrouter.engine.probe import probe  # noqa: PLC0415

    out = []
    with standing(opts, listing={opts.repo.split(":")[0]: files}) as (spec, plan, _):
        size = sum(f.size for f in plan.model)
        train = probe(spec, use_cache=False).facts.n_ctx_train if ctxs is None else 0
        for n_ctx in (ctxs or contexts(train)):
            for kv in types or ("",):
                s = spec.replace(args=(*spec.args, "-c", str(n_ctx), *(("-ctk", kv, "-ctv", kv) if kv else ())))
                est = probe(s, use_cache=False)
                verdict, detail = _verdict(s, est.per_device(), grants, devices)
                out.append(Cell(quant, plan.model[0].path, size, n_ctx, kv or est.params.get("type_k", ""),
                                est.per_device(), verdict, detail))
    return out


def table(opts: HubOptions, grants: dict[str, int], devices: list[str] | None = None,
          ctxs: Sequence[int] | None = None, types: Sequence[str] = ()) -> list[Cell]:
    """Every quant of ``opts.repo`` x ``ctxs`` x ``types`` against ``grants`` (see the module)."""
    repo, _ = hubfiles.split_repo_tag(opts.repo)
    try:
        files = hubfiles.list_files(repo, opts.token, hubfiles.endpoint())
    except hubfiles.HubError as e:
        raise ProbeError(repo, str(e)) from None
    found = hubfiles.quants(files)
    if not found:
        ggufs = ", ".join(f.path for f in files if f.path.endswith(".gguf")) or "none"
        raise ProbeError(repo, f"no quant of a GGUF model in the repository (its GGUF files: {ggufs})")
    cells = []
    for quant, primary in found:
        q = dataclasses.replace(opts, repo=repo, file=primary.path)
        cells += _cells(q, quant, files, grants, devices, ctxs, types)
    return cells


def cmd_table(a: argparse.Namespace, opts: HubOptions, grants: dict[str, int], devices: list[str] | None,
              pools: list[str]) -> int:
    """``pyllmrouter fit -hf org/repo --table``: the table, human or --json."""
    ctxs = [int(c) for c in a.contexts.split(",")] if a.contexts else None
    types = [t.strip() for t in a.cache_types.split(",")] if a.cache_types else []
    t0 = time.perf_counter()
    cells = table(opts, grants, devices, ctxs, types)
    seconds = time.perf_counter() - t0
    if a.json:
        print(json.dumps({"repo": opts.repo, "grants": grants, "seconds": seconds,
                          "rows": [dataclasses.asdict(c) for c in cells]}, indent=2))
        return 0
    rows = [[c.quant, f"{c.size / MiB:.1f}", c.n_ctx, c.cache_type, *(mib(c.per_device.get(p, 0)) for p in pools),
             mib(sum(c.per_device.values())), c.verdict + (f" ({c.detail})" if c.verdict == "fits moved" else "")]
            for c in cells]
    print(render(["quant", "file MiB", "context", "KV", *(f"{p} MiB" for p in pools), "total MiB", "fits"], rows))
    print(f"grants: {', '.join(f'{p} {mib(g)} MiB' for p, g in grants.items())}; {len(cells)} cells in "
          f"{seconds:.2f} s, from the files' headers")
    return 0
