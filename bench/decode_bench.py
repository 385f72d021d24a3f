#!/usr/bin/env python3
"""llama_decode alone: the engine's libllama (llama-cpp-python's shared libraries)
vs llama.cpp's own llama-batched-bench (static build), side by side.

    scripts/build_llama_tools.sh llama-batched-bench    # once: llama.cpp of the pinned sdist
    python bench/decode_bench.py [--parallel 1,8] [--prompt 40] [--tokens 64] [--rounds 5] [--out FILE]

Both do exactly what llama-batched-bench does, on the same generated model file
with the same context, KV layout, threads and batch sizes: ``parallel``
sequences, each with its own prompt of random tokens decoded in one batch
(prompt processing, PP), then ``tokens`` steps of one llama_decode carrying one
token of every sequence (text generation, TG), with no sampling, text or
serving around it.  Ours runs in this process through llama_cpp's ctypes
bindings on a context the loader built (the worker's path); theirs is one
llama-batched-bench process per round.  The order alternates by round.

So this measures the compute both servers share: the concurrency bench's
llama-server gap, if this shows none, is the time around llama_decode.
Reports tokens/s for PP and TG per level (the rounds' median) and the ratio
ours/theirs as the geometric mean of the paired rounds with a 95 % confidence
interval.  Writes JSON (default bench/results/decode_bench.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from concurrency_bench import SHAPE, ratio_interval

from pyllmrouter import tinymodels
from pyllmrouter.probe import cache_dir
from pyllmrouter.tables import render


class OurDecode:
    """One context for ``parallel`` sequences, loaded as the worker loads models."""

    def __init__(self, model: Path, parallel: int, ctx: int, threads: int, kv_unified: bool):
        import llama_cpp.llama_cpp as lc  # noqa: PLC0415

        from pyllmrouter.loader import load  # noqa: PLC0415
        from pyllmrouter.spec import ModelSpec  # noqa: PLC0415

        self.lc, self.parallel = lc, parallel
        self.llm = load(ModelSpec(path=str(model), n_ctx=ctx, n_seq_max=parallel, n_threads=threads,
                                  n_threads_batch=threads, kv_unified=kv_unified))
        self.ctx = self.llm._ctx.ctx  # noqa: SLF001
        self.n_batch = self.llm.context_params.n_batch
        self.batch = lc.llama_batch_init(self.n_batch, 0, 1)
        self.rnd = random.Random(0)
        self.n_vocab = self.llm.n_vocab()

    def _decode(self, items: list[tuple[int, int, bool]]) -> None:
        """(position, sequence, logits?) with random tokens, in batches of n_batch."""
        b = self.batch
        for start in range(0, len(items), self.n_batch):
            part = items[start:start + self.n_batch]
            for n, (pos, seq, logits) in enumerate(part):
                b.token[n], b.pos[n], b.n_seq_id[n] = self.rnd.randrange(self.n_vocab), pos, 1
                b.seq_id[n][0], b.logits[n] = seq, logits
            b.n_tokens = len(part)
            if self.lc.llama_decode(self.ctx, b) != 0:
                raise RuntimeError("llama_decode failed")

    def run(self, prompt: int, tokens: int) -> dict[str, float]:
        """One pass like llama-batched-bench's: PP, then TG; tokens/s of each."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), False)
        t0 = time.perf_counter()
        self._decode([(i, s, i == prompt - 1) for s in range(self.parallel) for i in range(prompt)])
        t1 = time.perf_counter()
        for i in range(tokens):
            self._decode([(prompt + i, s, True) for s in range(self.parallel)])
        t2 = time.perf_counter()
        return {"pp_tok_s": self.parallel * prompt / (t1 - t0), "tg_tok_s": self.parallel * tokens / (t2 - t1)}

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.llm.close()


def their_decode(binary: str, model: Path, parallel: int, prompt: int, tokens: int, ctx: int, threads: int,
                 kv_unified: bool) -> dict[str, float]:
    cmd = [binary, "-m", str(model), "-c", str(ctx), "-npp", str(prompt), "-ntg", str(tokens), "-npl", str(parallel),
           "-t", str(threads), "-tb", str(threads), "-kvu" if kv_unified else "-no-kvu", "--output-format", "jsonl"]
    for _attempt in range(3):  # now and then it exits 0 without the result line: run it again
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows = [json.loads(line[line.index("{"):]) for line in out.stdout.splitlines() if '"speed_tg"' in line]
        if rows:
            return {"pp_tok_s": rows[0]["speed_pp"], "tg_tok_s": rows[0]["speed_tg"]}
    raise RuntimeError(f"llama-batched-bench printed no result: {out.stdout[-500:]!r} {out.stderr[-500:]!r}")


def _columns(figures: dict, fmt: str) -> list[str]:
    """ours, theirs, ratio [95 % CI] of one figure, for the table."""
    low, high = figures["ratio_ci95"]
    return [format(figures["ours"], fmt), format(figures["theirs"], fmt),
            f"{figures['ratio_gmean']:.2f} [{low:.2f}, {high:.2f}]"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parallel", default="1,8")
    ap.add_argument("--prompt", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--kv-unified", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--batched-bench", default=str(cache_dir() / "llama.cpp-build" / "bin" / "llama-batched-bench"))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "decode_bench.json")
    args = ap.parse_args()
    if not Path(args.batched_bench).exists():
        raise SystemExit(f"{args.batched_bench} not found: run scripts/build_llama_tools.sh llama-batched-bench first")
    levels = [int(x) for x in args.parallel.split(",")]
    runs: dict[str, dict[int, list[dict[str, float]]]] = {"pyllmrouter": {}, "llama-batched-bench": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model = tinymodels.write_llama(Path(tmp) / "bench-llama.gguf", SHAPE)
        for parallel in levels:
            ours = OurDecode(model, parallel, args.ctx, args.threads, args.kv_unified)
            ours.run(args.prompt, 4)  # warm-up, as llama-batched-bench does its own
            mine, theirs = runs["pyllmrouter"].setdefault(parallel, []), runs["llama-batched-bench"].setdefault(parallel, [])
            try:
                for rnd in range(args.rounds):
                    pair = [lambda: mine.append(ours.run(args.prompt, args.tokens)),
                            lambda: theirs.append(their_decode(args.batched_bench, model, parallel, args.prompt,
                                                               args.tokens, args.ctx, args.threads, args.kv_unified))]
                    for run in (pair if rnd % 2 == 0 else pair[::-1]):
                        run()
            finally:
                ours.close()
    rows, results = [], {}
    for parallel in levels:
        mine, theirs = runs["pyllmrouter"][parallel], runs["llama-batched-bench"][parallel]
        level = {"parallel": parallel}
        for key in ("pp_tok_s", "tg_tok_s"):
            ratio, low, high = ratio_interval([r[key] for r in mine], [r[key] for r in theirs])
            level[key] = {"ours": statistics.median(r[key] for r in mine),
                          "theirs": statistics.median(r[key] for r in theirs), "ratio_gmean": ratio,
                          "ratio_ci95": [low, high]}
        results[parallel] = level
        rows.append([parallel, *_columns(level["tg_tok_s"], ".1f"), *_columns(level["pp_tok_s"], ".0f")])
    print(f"\nllama_decode alone ({args.prompt}-token prompts, {args.tokens} steps, {args.threads} threads, "
          f"{'unified' if args.kv_unified else 'per-sequence'} KV, {args.rounds} rounds; tok/s are the rounds' medians)")
    print(render(["parallel", "ours TG tok/s", "batched-bench TG tok/s", "TG ratio [95% CI]",
                  "ours PP tok/s", "batched-bench PP tok/s", "PP ratio [95% CI]"], rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"bench": "decode", "prompt": args.prompt, "tokens": args.tokens,
                                    "ctx": args.ctx, "threads": args.threads, "kv_unified": args.kv_unified,
                                    "rounds": args.rounds, "results": results, "runs": runs}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
