#!/usr/bin/env python3
"""Time to first token after a swap: two models that cannot be co-resident, each in a
long conversation, served in alternation.  Side by side in one run:

  - pyllmrouter with its prompt states kept across eviction (--kv-keep-ram);
  - pyllmrouter with keeping off (--kv-keep-ram 0);
  - llama-server's router mode (--models-max 1), built from the pinned source.

    scripts/build_llama_tools.sh llama-server    # once
    python bench/swap_bench.py [--prompt-words 920] [--swaps 3] [--rounds 3] [--out FILE]

Both models are generated ~100M-parameter llamas (the same shape, different
weights) with one slot and a context that holds the conversation.  Each turn
adds a short user message to the model's conversation and streams 8 tokens
(temperature 0); the first message is ~4k tokens; every turn after a model's first comes right after the other
model took its place, so its time to first token includes the swap: the load,
and re-reading the conversation (or restoring it).  Prints a table and writes
JSON (default bench/results/swap_bench.json): per server the p50 and each
turn's time to first token and prompt tokens taken from cache, the ratios, and
the bytes ours kept.  The servers take turns in each of ``--rounds`` rounds (the
order rotates); a ratio is the geometric mean of the rounds' p50 ratios with its
95 % interval (paired rounds: the same minutes of a noisy machine).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path

import httpx
from _load import ratio_interval, save, stream_sse

from pyllmrouter.tables import render
from pyllmrouter.tools import tinymodels
from pyllmrouter.tools.loopback import free_port, llama_tool, start_serve, wait_healthy

SHAPE = replace(tinymodels.LLAMA_100M, n_ctx_train=16384)
WORDS = "the sea ship sail wind storm harbour light night star rope deck crew captain wave shore".split()
SERVERS = ("ours, kept", "ours, not kept", "llama-server router")


def turn(client: httpx.Client, model: str, messages: list[dict]) -> tuple[float, str, dict]:
    """(time to first token, the answer, usage) of one streamed chat turn."""
    body = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    ttft, pieces, usage = stream_sse(client, "/v1/chat/completions", body,
                                     lambda e: (e["choices"][0].get("delta") or {}).get("content")
                                     if e.get("choices") else None)
    return ttft, "".join(pieces), usage or {}


def run(base: str, words: int, swaps: int) -> list[dict]:
    rnd = random.Random(7)
    conversations = {m: [{"role": "user", "content": " ".join(rnd.choice(WORDS) for _ in range(words))}]
                     for m in ("a", "b")}
    out = []
    with httpx.Client(base_url=base, timeout=900) as c:
        for i in range(2 * (swaps + 1)):
            model = "ab"[i % 2]
            messages = conversations[model]
            ttft, answer, usage = turn(c, model, messages)
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"and then, {i}?"}]
            out.append({"model": model, "turn": i // 2, "ttft_s": ttft, "prompt_tokens": usage.get("prompt_tokens"),
                        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")})
    return out


def serve(name: str, preset: Path, tmp: str, llama_server: str) -> tuple[subprocess.Popen, str]:
    """One of SERVERS started on ``preset``: (its process, its base URL)."""
    if name.startswith("ours"):
        keep = "1024" if name == "ours, kept" else "0"
        return start_serve(["--models-preset", str(preset), "--models-max", "1", "--emulate-devices", "GPU0=1TiB",
                            "--kv-keep-ram", keep], env={**os.environ, "PYLLMROUTER_CACHE": str(Path(tmp) / "cache")})
    port = free_port()
    proc = subprocess.Popen([llama_server, "--models-preset", str(preset), "--models-max", "1",
                             "--port", str(port), "--host", "127.0.0.1", "--no-webui"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, proc)
    return proc, base


def one_round(k: int, preset: Path, tmp: str, args) -> tuple[dict[str, list[dict]], dict]:
    """Every server once, in an order rotated by ``k``: (each one's turns, what ours kept)."""
    results, kept = {}, {}
    for name in SERVERS[k % len(SERVERS):] + SERVERS[:k % len(SERVERS)]:
        proc, base = serve(name, preset, tmp, args.llama_server)
        try:
            results[name] = run(base, args.prompt_words, args.swaps)
            if name == "ours, kept":
                listing = httpx.get(f"{base}/models", timeout=30).json()["data"]
                kept = {m["id"]: m["memory"]["kept"] for m in listing}
        finally:
            proc.terminate()
            proc.wait(60)
    return results, kept


def after_swap(turns: list[dict]) -> list[float]:
    return [r["ttft_s"] for r in turns if r["turn"] > 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-words", type=int, default=920, help="words of each conversation's first message")
    ap.add_argument("--swaps", type=int, default=3, help="turns per model after its first")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each server once per round")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--llama-server", default=str(llama_tool("llama-server")))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "swap_bench.json")
    args = ap.parse_args()
    if not Path(args.llama_server).exists():
        raise SystemExit(f"{args.llama_server} not found: run scripts/build_llama_tools.sh llama-server first")
    rounds, kept = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        models = {m: tinymodels.write_llama(Path(tmp) / f"{m}.gguf", SHAPE, seed=i) for i, m in enumerate("ab")}
        preset = Path(tmp) / "swap.ini"
        preset.write_text("".join(f"[{m}]\nmodel = {p}\nc = {args.ctx}\nnp = 1\n" for m, p in models.items()))
        for k in range(args.rounds):
            results, kept = one_round(k, preset, tmp, args)
            rounds.append(results)
    every = {name: [t for r in rounds for t in after_swap(r[name])] for name in SERVERS}
    p50 = {name: statistics.median(xs) for name, xs in every.items()}
    per_round = {name: [statistics.median(after_swap(r[name])) for r in rounds] for name in SERVERS}
    rows = []
    for name in SERVERS:
        vs_peer = ratio_interval(per_round["llama-server router"], per_round[name])
        vs_off = ratio_interval(per_round["ours, not kept"], per_round[name])
        rows.append([name, f"{p50[name]:.3f}", " ".join(f"{x:.2f}" for x in per_round[name]),
                     f"{vs_peer[0]:.2f} [{vs_peer[1]:.2f}, {vs_peer[2]:.2f}]",
                     f"{vs_off[0]:.2f} [{vs_off[1]:.2f}, {vs_off[2]:.2f}]",
                     " ".join(str(r["cached_tokens"]) for r in rounds[-1][name] if r["turn"] > 0),
                     str(rounds[-1][name][0]["prompt_tokens"])])
    print(render(["server", "TTFT after swap p50 s", "each round's p50 s", "x faster than llama-server router [95 %]",
                  "x faster than ours not kept [95 %]", "cached tokens (last round)", "first prompt tokens"], rows))
    print(f"\nkept at the end (bytes in RAM / on disk, files): {json.dumps(kept)}")
    save(args.out, {"bench": "swap", "prompt_words": args.prompt_words, "swaps": args.swaps, "rounds": args.rounds,
                    "ctx": args.ctx, "runs": rounds, "ttft_after_swap_p50_s": p50, "per_round_p50_s": per_round,
                    "kept": kept})


if __name__ == "__main__":
    main()
