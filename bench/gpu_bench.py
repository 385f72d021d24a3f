#!/usr/bin/env python3
"""On an NVIDIA GPU: probe time vs real load time, and the residual a load costs
beyond the probed bytes (CUDA context, cuBLAS workspace, memory pools).

    scripts/setup.sh --test --cuda 90 && .venv/bin/python bench/gpu_bench.py

Each model is loaded fully offloaded in a fresh process; the residual is the
process's NVML-reported use minus the probed CUDA0 bytes.  Writes JSON
(default bench/results/gpu_bench.json); without a GPU it says so and writes
{"skipped": reason}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from pyllmrouter.tools import tinymodels
from pyllmrouter.tables import mib, render

SMALL = tinymodels.Shape("llama", n_embd=1024, n_layer=8, n_head=16, n_head_kv=4, n_ff=2816)

CHILD = """
import json, os, subprocess, time
from pyllmrouter import ModelSpec, probe
from pyllmrouter.engine.loader import load, request
spec = ModelSpec({path!r}, n_ctx={n_ctx}, n_gpu_layers=-1)
t0 = time.perf_counter(); est = probe(spec, use_cache=False); probe_s = time.perf_counter() - t0
t0 = time.perf_counter(); llm = load(spec); request(llm, "/v1/completions", {{"prompt": "hi", "max_tokens": 2}}); load_s = time.perf_counter() - t0
out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                     capture_output=True, text=True).stdout
used = sum(int(l.split(",")[1]) for l in out.splitlines() if int(l.split(",")[0]) == os.getpid()) << 20
probed = est.per_device().get("CUDA0", 0)
print(json.dumps({{"probe_s": probe_s, "load_s": load_s, "probed": probed, "used": used}}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gpu_bench.json")
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if not shutil.which("nvidia-smi"):
        reason = "no NVIDIA GPU here (nvidia-smi not found)"
        print(reason)
        args.out.write_text(json.dumps({"bench": "gpu", "skipped": reason}))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = tinymodels.write_tiny_set(Path(tmp) / "models")["tiny-llama"]
        small = tinymodels.write_llama(Path(tmp) / "small.gguf", SMALL)
        big = tinymodels.write_shape(Path(tmp) / "shape-7b.gguf", tinymodels.SHAPE_7B)
        for name, path, n_ctx in (("tiny", tiny, 4096), ("small 100M", small, 4096), ("7B shape Q4_0", big, 4096)):
            proc = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD.format(path=str(path), n_ctx=n_ctx))],
                                  capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
            if proc.returncode != 0:
                raise SystemExit(proc.stderr[-2000:])
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append({"model": name, **r, "residual": r["used"] - r["probed"]})
    print(render(["model", "probe ms", "load s", "probed CUDA0 MiB", "process MiB", "residual MiB"],
                 [[r["model"], f"{r['probe_s'] * 1e3:.1f}", f"{r['load_s']:.2f}", mib(r["probed"]), mib(r["used"]),
                   mib(r["residual"])] for r in rows]))
    args.out.write_text(json.dumps({"bench": "gpu", "rows": rows}, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
