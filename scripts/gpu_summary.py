#!/usr/bin/env python3
"""The tables of a scripts/gpu_check.sh run, from what it wrote in its output folder.

    python scripts/gpu_summary.py DIR

junit.xml (pytest -m gpu): each test and its outcome; gpu_bench.json: probe against
load, the residual; concurrency-*.json: ours against llama-server and its router mode;
http.json: short non-streamed requests, ours against the same peers; trace.json: the
request trace over GB-size models on a budget of the GPU, ours against llama-server's
router at its safe and overcommitting --models-max; replicas.json: one hot model with
replicas = 1 and 2.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pyllmrouter.tables import mib, render  # noqa: E402


def tests(path: Path) -> str:
    if not path.exists():
        return "tests: no junit.xml (the step did not run)"
    rows = []
    for case in ET.parse(path).iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = child.tag.upper() + ": " + (child.get("message") or "").splitlines()[0][:100] \
                    if child.get("message") else child.tag.upper()
            elif child.tag == "skipped":
                outcome = "skipped: " + (child.get("message") or "")[:100]
        rows.append([case.get("name"), f"{float(case.get('time', 0)):.1f}", outcome])
    return "pytest -m gpu\n" + render(["test", "s", "outcome"], rows)


def gpu_bench(path: Path) -> str:
    if not path.exists():
        return "gpu_bench: no result"
    data = json.loads(path.read_text())
    if "skipped" in data:
        return f"gpu_bench: skipped ({data['skipped']})"
    return "gpu_bench: probe against load, fully offloaded\n" + render(
        ["model", "probe ms", "load s", "probed CUDA0 MiB", "process MiB", "residual MiB"],
        [[r["model"], f"{r['probe_s'] * 1e3:.1f}", f"{r['load_s']:.2f}", mib(r["probed"]), mib(r["used"]),
          mib(r["residual"])] for r in data["rows"]])


def concurrency(path: Path) -> str:
    data = json.loads(path.read_text())
    rows = []
    for ours in data["results"]["pyllmrouter"]:
        for peer, vs in ours.get("vs", {}).items():
            g, lo, hi = vs["tok_s_ratio"]
            t = vs["ttft_p50_ratio"]
            theirs = next(r for r in data["results"][peer] if r["clients"] == ours["clients"])
            rows.append([ours["clients"], peer, f"{ours['tok_s']:.0f}", f"{theirs['tok_s']:.0f}",
                         f"{g:.2f} [{lo:.2f}, {hi:.2f}]", f"{t[0]:.2f} [{t[1]:.2f}, {t[2]:.2f}]",
                         f"{ours['other_cpu_s_per_1k_tokens']:.2f} / {theirs['other_cpu_s_per_1k_tokens']:.2f}"])
    where = "GPU" if data.get("gpu") else "CPU"
    return (f"concurrency, model {data['model']} on the {where}, {data['rounds']} rounds, -np {data['parallel']}\n"
            + render(["clients", "peer", "ours tok/s", "peer tok/s", "tok/s ratio [95% CI]", "TTFT p50 ratio",
                      "CPU s/1k tok outside decode, ours / peer"], rows))


def http(path: Path) -> str:
    if not path.exists():
        return "http: no result"
    data = json.loads(path.read_text())
    rows = []
    for row in data["rows"]:
        g, lo, hi = row["our_http_req_s_ratio"]
        cpu = row.get("router_cpu_us")
        rows.append([row["clients"], row["path"], f"{row['p50_ms']:.2f}", f"{row['req_s']:.0f}",
                     f"{g:.2f} [{lo:.2f}, {hi:.2f}]", "-" if cpu is None else f"{cpu:.0f}", row["errors"]])
    where = "GPU" if data.get("gpu") else "CPU"
    return (f"http (non-streamed), model {data['model']} on the {where}\n"
            + render(["clients", "path", "p50 ms", "req/s", "our req/s / this [95% CI]",
                      "router process CPU us/request", "failed"], rows))


def trace(path: Path) -> str:
    if not path.exists():
        return "trace: no result"
    data = json.loads(path.read_text())
    rows = [[f"{s['rate']:g}x", s["system"], f"{100 * s['attainment'][str(data['args']['slo'])]:.0f}%",
             "-" if s["ttft_p50"] is None else f"{s['ttft_p50']:.2f}",
             "-" if s["ttft_p99"] is None else f"{s['ttft_p99']:.2f}", s["loads"], s["evictions"], s["failed"],
             f"{s['peak_bytes'] / data['budget']:.2f}", f"{s['seconds_over_budget']:g}"]
            for s in data["summaries"]]
    ref = "llama-server router, max K"
    good = data["goodput"]
    ratios = [f"{system}: {per[seed] / good[ref][seed]:.2f}" for system, per in good.items()
              for seed in per if system != ref and ref in good and good[ref].get(seed)]
    return (f"trace on the {'GPU' if data['args'].get('gpu') else 'CPU'}: budget {mib(data['budget'])} MiB, "
            f"K = {data['k']}; goodput / {ref}: {'; '.join(ratios) or '-'}\n"
            + render(["rate", "system", f"TTFT<={data['args']['slo']:g}s", "TTFT p50 s", "p99 s", "loads",
                      "evictions", "failed", "peak/budget", "s over budget"], rows))


def replicas(path: Path) -> str:
    data = json.loads(path.read_text())
    rows = []
    for n, runs in sorted(data["runs"].items()):
        rows.append([n, f"{sum(r['req_s'] for r in runs) / len(runs):.2f}",
                     f"{sorted(r['p50_s'] for r in runs)[len(runs) // 2] * 1e3:.0f}",
                     f"{max(r['p99_s'] for r in runs) * 1e3:.0f}", runs[-1]["loads"], runs[-1]["evictions"],
                     sum(r["errors"] for r in runs)])
    g, lo, hi = data["ratio"]
    where = "GPUs" if data.get("gpu") else "emulated devices"
    return (f"replicas, {data['clients']} clients on {where}: requests/s with 2 over 1: {g:.2f} [{lo:.2f}, {hi:.2f}]\n"
            + render(["replicas", "req/s", "p50 ms", "p99 ms (max)", "loads", "evictions", "failed"], rows))


def main() -> None:
    out = Path(sys.argv[1])
    parts = [tests(out / "junit.xml"), gpu_bench(out / "gpu_bench.json")]
    parts += [concurrency(p) for p in sorted(out.glob("concurrency-*.json"))]
    parts.append(http(out / "http.json"))
    parts.append(trace(out / "trace.json"))
    if (out / "replicas.json").exists():
        parts.append(replicas(out / "replicas.json"))
    print("\n\n".join(parts))


if __name__ == "__main__":
    main()
