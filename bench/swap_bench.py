#!/usr/bin/env python3
"""Time to first token after a swap: two models that cannot be co-resident, each in a
long conversation, served in alternation.  Side by side in one run:

  - pyllmrouter with its prompt states kept across eviction (--kv-keep-ram);
  - pyllmrouter with keeping off (--kv-keep-ram 0);
  - llama-server's router mode (--models-max 1), built from the pinned source.

    scripts/build_llama_tools.sh llama-server    # once
    python bench/swap_bench.py [--prompt-words 920] [--swaps 3] [--out FILE]

Both models are generated ~100M-parameter llamas (the same shape, different
weights) with one slot and a context that holds the conversation.  Each turn
adds a short user message to the model's conversation and streams 8 tokens
(temperature 0); the first message is ~4k tokens; every turn after a model's first comes right after the other
model took its place, so its time to first token includes the swap: the load,
and re-reading the conversation (or restoring it).  Prints a table and writes
JSON (default bench/results/swap_bench.json): per server the p50 and each
turn's time to first token and prompt tokens taken from cache, the ratios, and
the bytes ours kept.
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
from _load import save, stream_sse

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-words", type=int, default=920, help="words of each conversation's first message")
    ap.add_argument("--swaps", type=int, default=3, help="turns per model after its first")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--llama-server", default=str(llama_tool("llama-server")))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "swap_bench.json")
    args = ap.parse_args()
    if not Path(args.llama_server).exists():
        raise SystemExit(f"{args.llama_server} not found: run scripts/build_llama_tools.sh llama-server first")
    results, kept = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        models = {m: tinymodels.write_llama(Path(tmp) / f"{m}.gguf", SHAPE, seed=i) for i, m in enumerate("ab")}
        preset = Path(tmp) / "swap.ini"
        preset.write_text("".join(f"[{m}]\nmodel = {p}\nc = {args.ctx}\nnp = 1\n" for m, p in models.items()))
        for name in SERVERS:
            env = {"PYLLMROUTER_CACHE": str(Path(tmp) / "cache")}
            if name.startswith("ours"):
                keep = "1024" if name == "ours, kept" else "0"
                proc, base = start_serve(["--models-preset", str(preset), "--models-max", "1",
                                          "--emulate-devices", "GPU0=1TiB", "--kv-keep-ram", keep],
                                         env={**os.environ, **env})
            else:
                port = free_port()
                proc = subprocess.Popen([args.llama_server, "--models-preset", str(preset), "--models-max", "1",
                                         "--port", str(port), "--host", "127.0.0.1", "--no-webui"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                base = f"http://127.0.0.1:{port}"
                wait_healthy(base, proc)
            try:
                results[name] = run(base, args.prompt_words, args.swaps)
                if name == "ours, kept":
                    listing = httpx.get(f"{base}/models", timeout=30).json()["data"]
                    kept[name] = {m["id"]: m["memory"]["kept"] for m in listing}
            finally:
                proc.terminate()
                proc.wait(60)
    after = {name: [r["ttft_s"] for r in rs if r["turn"] > 0] for name, rs in results.items()}
    p50 = {name: statistics.median(xs) for name, xs in after.items()}
    rows = []
    for name in SERVERS:
        rs = [r for r in results[name] if r["turn"] > 0]
        rows.append([name, f"{p50[name]:.3f}", f"{p50['llama-server router'] / p50[name]:.2f}",
                     f"{p50['ours, not kept'] / p50[name]:.2f}",
                     " ".join(f"{r['ttft_s']:.2f}" for r in rs),
                     " ".join(str(r["cached_tokens"]) for r in rs),
                     str(results[name][0]["prompt_tokens"])])
    print(render(["server", "TTFT after swap p50 s", "x faster than llama-server router",
                  "x faster than ours not kept", "each swap's TTFT s", "cached tokens", "first prompt tokens"], rows))
    print(f"\nkept at the end (bytes in RAM / on disk, files): {json.dumps(kept.get('ours, kept', {}))}")
    save(args.out, {"bench": "swap", "prompt_words": args.prompt_words, "swaps": args.swaps,
                    "ctx": args.ctx, "runs": results, "ttft_after_swap_p50_s": p50,
                    "kept": kept})


if __name__ == "__main__":
    main()
