#!/usr/bin/env python3
"""The differential fuzz of the wire, long: seeded raw HTTP/1.1 byte streams on the native
path against the relay (pyllmrouter/tools/wire.py says what a case is and what "the same"
means; tests/native/test_wire.py runs a short run of it).

    python bench/wire_fuzz.py [--seed 1] [--cases 2000] [--out FILE]

``pyllmrouter serve`` (defaults: native, following) and ``pyllmrouter serve --no-native``
on the same models (a scripted chat model, whose greedy answers are fixed, and a tiny
llama); each case runs on both, one connection at a time, and what a client sees (statuses,
header fields, bodies, in order, and how the connection ended) is compared; ``GET /health``
is timed after each case.  Prints the cases and differences by kind, what differed (with
each case's seed and index, to replay it) and the slowest /health, and writes JSON (default bench/results/wire_fuzz.json).  Exit code 1 when any
case differed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from _load import save

from pyllmrouter.tables import render
from pyllmrouter.tools import scripted, tinymodels, wire
from pyllmrouter.tools.loopback import start_serve


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cases", type=int, default=2000)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "wire_fuzz.json")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        tiny = tinymodels.write_tiny_set(d)
        story = scripted.write_scripted(d / "story.gguf", scripted.THINK_TEMPLATE, scripted.STORY_SCRIPT, loop=True)
        preset = d / "models.ini"
        preset.write_text(f"[{wire.MODEL}]\nmodel = {story}\nc = 4096\nnp = 2\nload-on-startup = true\n\n"
                          f"[m]\nmodel = {tiny['tiny-llama']}\nc = 1024\nnp = 2\nload-on-startup = true\n")
        common = ["--models-preset", str(preset), "--no-models-cache", "--models-memory-margin", "0",
                  "--emulate-devices", "GPU0=4GiB"]
        procs, urls = [], {}
        try:
            for name, extra in (("native", []), ("relay", ["--no-native"])):
                proc, urls[name] = start_serve(common + extra)
                procs.append(proc)
            for url in urls.values():
                httpx.post(url + "/tokenize", json={"model": wire.MODEL, "content": "warm"}, timeout=120)
            found, slowest, t0, kinds = [], 0.0, time.monotonic(), {}
            for i, case in enumerate(wire.cases(a.seed, a.cases)):
                diff = wire.compare(wire.play(urls["native"], case), wire.play(urls["relay"], case), case)
                ran, differed = kinds.get(case.kind, (0, 0))
                kinds[case.kind] = (ran + 1, differed + bool(diff))
                if diff:
                    found.append({"index": i, "kind": case.kind, "case": case.text, "differs": diff[:2000]})
                    print(f"case {i} ({case.kind}: {case.text}): {diff[:300]}", flush=True)
                for url in urls.values():
                    h0 = time.monotonic()
                    httpx.get(url + "/health", timeout=30)
                    slowest = max(slowest, time.monotonic() - h0)
                if (i + 1) % 200 == 0:
                    print(f"{i + 1} cases, {len(found)} differed", flush=True)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    result = {"seed": a.seed, "cases": a.cases, "differed": len(found), "found": found,
              "by_kind": {k: {"cases": n, "differed": d} for k, (n, d) in sorted(kinds.items())},
              "slowest_health_s": round(slowest, 4), "seconds": round(time.monotonic() - t0, 1)}
    print(render(["kind of case", "cases", "differed"], [[k, n, d] for k, (n, d) in sorted(kinds.items())]))
    print(f"{a.cases} cases (seed {a.seed}): {len(found)} differed; slowest /health {slowest * 1000:.0f} ms; "
          f"{result['seconds']} s")
    save(a.out, result)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
