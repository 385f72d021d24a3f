#!/usr/bin/env python3
"""Our fit against llama.cpp's own (common_fit_params), on real rpc-server devices.

    scripts/build_llama_tools.sh ggml-rpc-server      # once
    python bench/fit_bench.py [--out FILE]

Sparse files with the layout of a 7B dense and a 30B-A3B MoE model, fitted
into per-device grants over 2 and 3 rpc-servers on loopback.  llama.cpp's fit
is given the same grants as margins (free memory minus the grant); its result
is probed like ours.  Reports bytes placed on the devices and wall time;
writes JSON (default bench/results/fit_bench.json).  common_fit_params is
called from the wheel's libllama-common with the signature of the pinned
common/fit.h (vendor/pin.json).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import tempfile
import time
from pathlib import Path

from pyllmrouter import ModelSpec, probe
from pyllmrouter.tools import tinymodels
from pyllmrouter.engine.backend import native
from pyllmrouter.config import GiB
from pyllmrouter.engine.fit import fit_here
from pyllmrouter.tools.loopback import RpcServers
from pyllmrouter.tables import mib, render

from _llama_params import _BuftOverride, build


FIT_SYMBOL = ("_Z17common_fit_paramsPKcP18llama_model_paramsP20llama_context_paramsPfP32llama_model_tensor_"
              "buft_overridePmjPK22common_fit_extra_model14ggml_log_level")


def common_fit(spec: ModelSpec, grants: dict[str, int], devices: list[str]) -> tuple[ModelSpec, float]:
    nat = native()
    site = Path(importlib.util.find_spec("llama_cpp").origin).parent.parent
    lib = ctypes.CDLL(str(site / "lib" / "libllama-common.so"))
    fn = getattr(lib, FIT_SYMBOL)
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_int]
    p = build(spec)
    free = {d["name"]: d["free"] for d in nat.devices()}
    n_dev = nat.max_devices()
    split = (ctypes.c_float * n_dev)()
    overrides = (_BuftOverride * nat.max_tensor_buft_overrides())()
    margins = (ctypes.c_size_t * n_dev)(*[max(0, free[d] - grants[d]) for d in devices])
    t0 = time.perf_counter()
    status = fn(spec.path.encode(), ctypes.addressof(p.model), ctypes.addressof(p.context), ctypes.addressof(split),
                ctypes.addressof(overrides), ctypes.addressof(margins), 0, None, 4)
    seconds = time.perf_counter() - t0
    if status != 0:
        raise RuntimeError(f"common_fit_params returned {status}")
    ngl = p.model.n_gpu_layers
    pairs = []
    for o in overrides:
        if not o.pattern:
            break
        pairs.append((o.pattern.decode(), nat.buffer_type_name(o.buft)))
    fitted = spec.replace(n_gpu_layers=ngl, tensor_split=tuple(split[i] for i in range(len(devices))) or None,
                          tensor_overrides=tuple(pairs))
    return fitted, seconds


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
            for name, path, grants in cases:
                devs = [d for d in devices if d in grants]
                spec = ModelSpec(path, n_ctx=4096, devices=tuple(devs))
                probe(spec)  # both fits start from a warm process and an empty probe cache below
                os.environ["PYLLMROUTER_CACHE"] = str(Path(tmp) / f"cache-{len(rows)}")
                t0 = time.perf_counter()
                plan = fit_here(spec, {**grants, "CPU": 1 << 50}, devs)
                ours_s = time.perf_counter() - t0
                theirs_spec, theirs_s = common_fit(spec, grants, devs)
                ours_b, theirs_b = on_devices(plan.spec, devs), on_devices(theirs_spec, devs)
                rows.append({
                    "case": name, "grants": grants,
                    "ours": {"bytes": ours_b, "seconds": ours_s, "probes": plan.probes,
                             "n_gpu_layers": plan.spec.n_gpu_layers, "tensor_split": plan.spec.tensor_split,
                             "experts_on_host": plan.experts_on_host,
                             "over": {d: b - grants[d] for d, b in ours_b.items() if b > grants[d]}},
                    "llama.cpp": {"bytes": theirs_b, "seconds": theirs_s, "n_gpu_layers": theirs_spec.n_gpu_layers,
                                  "tensor_split": theirs_spec.tensor_split,
                                  "overrides": len(theirs_spec.tensor_overrides),
                                  "over": {d: b - grants[d] for d, b in theirs_b.items() if b > grants[d]}},
                })
    print(render(["case", "ours on devices MiB", "llama.cpp on devices MiB", "ours/theirs bytes", "ours ms",
                  "llama.cpp ms", "time ratio", "ours probes"],
                 [[r["case"], mib(sum(r["ours"]["bytes"].values())), mib(sum(r["llama.cpp"]["bytes"].values())),
                   f"{sum(r['ours']['bytes'].values()) / max(1, sum(r['llama.cpp']['bytes'].values())):.3f}",
                   f"{r['ours']['seconds'] * 1e3:.0f}", f"{r['llama.cpp']['seconds'] * 1e3:.0f}",
                   f"{r['ours']['seconds'] / r['llama.cpp']['seconds']:.3f}", r["ours"]["probes"]] for r in rows]))
    for r in rows:
        for who in ("ours", "llama.cpp"):
            if r[who]["over"]:
                print(f"  {r['case']}: {who} exceeds a grant: {r[who]['over']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"bench": "fit", "rows": rows}, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
