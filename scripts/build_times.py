#!/usr/bin/env python3
"""Where a build's time went, from ninja's log: seconds of compiler per part.

    python scripts/build_times.py BUILD_DIR [BUILD_DIR ...] [--json FILE]

Each BUILD_DIR's .ninja_log (its last run of each output) is grouped into parts by the
output's path: ggml's CUDA kernels (flash attention, quantized matrix products, the rest),
ggml's CPU backend and base, libllama, libmtmd, llama.cpp's common and server sources,
this package's extension, links.  "CPU s" sums each step's own seconds (what a one-core
machine would spend); "wall s" is the span from the first step's start to the last one's
end; divide CPU s by the cores for a lower bound of the wall time elsewhere.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PARTS = [  # (part, test on the output path), first match wins
    ("link", lambda p: p.endswith((".so", ".a")) or ".so." in p or "/bin/" in p and "." not in p.rsplit("/", 1)[-1]),
    ("cuda: flash attention", lambda p: "ggml-cuda" in p and "fattn" in p),
    ("cuda: quantized matmul (mmq, mmvq, mmf)", lambda p: "ggml-cuda" in p and any(k in p for k in ("mmq", "mmvq", "mmf", "mmid"))),
    ("cuda: other kernels", lambda p: "ggml-cuda" in p),
    ("ggml cpu backend", lambda p: "ggml-cpu" in p),
    ("ggml base, rpc", lambda p: "ggml" in p),
    ("libllama", lambda p: (p.startswith("src/") or "/src/" in p) and "llama" in p and "tools/" not in p),
    ("libmtmd", lambda p: "mtmd" in p),
    ("llama.cpp common", lambda p: "common" in p),
    ("llama.cpp server", lambda p: "server" in p or "httplib" in p),
    ("this package's extension", lambda p: "_native" in p or "csrc" in p or "llama_internals" in p),
]


def read(log: Path) -> dict[str, tuple[int, int]]:
    """output -> (start ms, end ms) of its last build in the log."""
    out: dict[str, tuple[int, int]] = {}
    for line in log.read_text().splitlines():
        if line.startswith("#"):
            continue
        start, end, _mtime, path, *_ = line.split("\t")
        out[path] = (int(start), int(end))
    return out


def part_of(path: str) -> str:
    for name, test in PARTS:
        if test(path):
            return name
    return "other"


def main() -> int:
    args = sys.argv[1:]
    out_json = None
    if "--json" in args:
        i = args.index("--json")
        out_json = Path(args[i + 1])
        del args[i:i + 2]
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    report = {}
    for d in args:
        steps = read(Path(d) / ".ninja_log")
        parts: dict[str, list[float]] = {}
        for path, (start, end) in steps.items():
            parts.setdefault(part_of(path), []).append((end - start) / 1000)
        span = (max(e for _, e in steps.values()) - min(s for s, _ in steps.values())) / 1000 if steps else 0.0
        total = sum(sum(v) for v in parts.values())
        print(f"{d}: {len(steps)} steps, {total:.0f} CPU s, {span:.0f} wall s")
        rows = sorted(parts.items(), key=lambda kv: -sum(kv[1]))
        print(f"  {'part':42} {'steps':>5} {'CPU s':>8} {'share':>6} {'longest s':>9}")
        for name, secs in rows:
            print(f"  {name:42} {len(secs):5d} {sum(secs):8.0f} {sum(secs) / total:6.0%} {max(secs):9.1f}")
        report[d] = {"steps": len(steps), "cpu_s": total, "wall_s": span,
                     "parts": {n: {"steps": len(v), "cpu_s": sum(v), "longest_s": max(v)} for n, v in rows}}
    if out_json:
        out_json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
