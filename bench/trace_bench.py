#!/usr/bin/env python3
"""The workload users run: a real request trace over several models on one memory budget,
ours against llama-server's router, side by side in one run.

    scripts/build_llama_tools.sh llama-server    # once
    python bench/trace_bench.py [--window 30] [--rates 0.25,0.5,0.75,1] [--seeds 1] [--budget 0.45]
                                [--systems ...] [--out FILE] [--png FILE]

The trace: the Azure LLM inference trace 2023 (bench/traces/, CC-BY 4.0, attribution in
its README), its code and conversation services, ``--window`` seconds from ``--offset``,
arrivals as they came (open loop: each request is sent at its time, answered or not),
scaled by each ``--rates`` multiplier (2 serves the same requests in half the time).
Requests go to six generated llamas of different sizes: code traffic to two of them,
conversation traffic to four, by a Zipf popularity (``--zipf``, seeded) within each group;
each conversation request continues one of its model's conversations (its history is the
prompt's start, as a chat client sends it), so kept prompt states have something to keep.
Token counts are scaled to a 2-core machine (``--prompt-div``, ``--gen-div``): a prompt of
ContextTokens / 64 tokens (8 to 512), ContextTokens' distribution kept; GeneratedTokens / 16
tokens generated (1 to 48, ``ignore_eos``), streamed.  At 1x the window (30 s, 462
requests from 10 minutes into the hour) overloads the machine for every system.

The budget is one emulated device of ``--budget`` times the models' bytes together (as
probed).  With ``--gpu`` it is the machine's first GPU, capped at that budget
(``--device-budget CUDA0=``), and the models are GB-size (``GPU_MODELS``: a load costs
seconds there, as real ones do).  Systems, each started afresh for each rate:

  - ours                          pyllmrouter serve on that device (exact bytes);
  - ours, states not kept         --kv-keep-ram 0;
  - ours, counted                 byte admission replaced by a count: a device with no
                                  limit and --models-max K;
  - llama-server router, max K    --models-max K, the largest K whose largest models fit
                                  the budget (it never overcommits);
  - llama-server router, max K+1  one more: it overcommits (the seconds its loaded models'
                                  bytes pass the budget are reported: a GPU would OOM there).

(Replicas are off by default, so "ours" is ours without them; bench/replica_bench.py
measures what a second instance buys one hot model.)

Per system and rate: SLO attainment at several TTFT thresholds, p50/p90/p99 TTFT and
end-to-end latency, loads, evictions, failed requests, the peak bytes held against the
budget and the seconds over it, and the CPU seconds of the router's own process (its
workers or children apart: on 2 cores the router competes with the engines); then, per system, its goodput: the highest rate at which
90 % of requests get their first token within ``--slo`` seconds (interpolated between
rates), and the ratio ours / llama-server router (max K).  Writes JSON (default
bench/results/trace_bench.json) and a PNG (attainment against rate per system; TTFT and
bytes held over time at one rate).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

import aiohttp
import httpx
from _load import save

from pyllmrouter import ModelSpec, probe
from pyllmrouter.tables import render
from pyllmrouter.tools import tinymodels
from pyllmrouter.tools.loopback import free_port, llama_tool, start_serve, wait_healthy

TRACES = Path(__file__).parent / "traces"
# six llamas, 26 to 132 MiB as F16 weights: (name, service, shape)
MODELS = [
    ("code-s", "code", replace(tinymodels.LLAMA_100M, n_embd=384, n_layer=4, n_head=6, n_head_kv=2, n_ff=1024)),
    ("code-l", "code", replace(tinymodels.LLAMA_100M, n_embd=640, n_layer=6, n_head=10, n_head_kv=2, n_ff=1792)),
    ("chat-s", "conv", replace(tinymodels.LLAMA_100M, n_embd=384, n_layer=4, n_head=6, n_head_kv=2, n_ff=1024)),
    ("chat-m", "conv", replace(tinymodels.LLAMA_100M, n_embd=512, n_layer=6, n_head=8, n_head_kv=2, n_ff=1536)),
    ("chat-l", "conv", replace(tinymodels.LLAMA_100M, n_embd=768, n_layer=6, n_head=12, n_head_kv=4, n_ff=2048)),
    ("chat-xl", "conv", replace(tinymodels.LLAMA_100M, n_embd=768, n_layer=8, n_head=12, n_head_kv=4, n_ff=2560)),
]
# --gpu: six llamas of 0.45 to 3.8 GiB, 9.8 together (Q4_0, a 32000-token vocabulary), whose
# loads cost what real ones do on a GPU (seconds, not the CPU runs' 50-200 ms): their weights
# are a sparse file's zeros (tinymodels.write_shape), which llama.cpp loads and runs as any
# others (the text is noise; the bytes, the copies and the kernels are real)
GPU_MODELS = [
    ("code-s", "code", tinymodels.Shape("llama", n_embd=2048, n_layer=16, n_head=16, n_head_kv=4, n_ff=5632,
                                        n_ctx_train=8192, n_vocab=32000)),
    ("code-l", "code", tinymodels.Shape("llama", n_embd=3072, n_layer=28, n_head=24, n_head_kv=8, n_ff=8192,
                                        n_ctx_train=8192, n_vocab=32000)),
    ("chat-s", "conv", tinymodels.Shape("llama", n_embd=2048, n_layer=22, n_head=16, n_head_kv=4, n_ff=5632,
                                        n_ctx_train=8192, n_vocab=32000)),
    ("chat-m", "conv", tinymodels.Shape("llama", n_embd=2560, n_layer=32, n_head=20, n_head_kv=4, n_ff=6912,
                                        n_ctx_train=8192, n_vocab=32000)),
    ("chat-l", "conv", tinymodels.Shape("llama", n_embd=3584, n_layer=28, n_head=28, n_head_kv=4, n_ff=10240,
                                        n_ctx_train=8192, n_vocab=32000)),
    ("chat-xl", "conv", tinymodels.SHAPE_7B),
]
ARGS = ("-c", "4096", "-np", "2")  # every model, every system: 2 slots of 2048 tokens
WORDS = ("the sea ship sail wind storm harbour light night star rope deck crew captain wave shore "
         "def return class import value list index loop print file open read write true false").split()
THRESHOLDS = (0.5, 1.0, 2.0, 5.0)
# --systems keys, and the names the tables use
SYSTEMS = {"ours": "ours", "ours-nokeep": "ours, states not kept", "ours-count": "ours, counted",
           "router-k": "llama-server router, max K", "router-k1": "llama-server router, max K+1"}


@dataclass
class Request:
    t: float  # seconds after the window's start, at rate 1
    model: str
    prompt: str
    tokens: int


@dataclass
class Outcome:
    sent: float
    ttft: float | None = None
    e2e: float | None = None
    status: int = 0
    error: str = ""


@dataclass
class Run:
    system: str
    rate: float
    seed: int
    outcomes: list[Outcome] = field(default_factory=list)
    memory: list[tuple[float, int]] = field(default_factory=list)  # (seconds, bytes held)
    loads: int = 0
    evictions: int = 0
    deaths: int = 0  # worker processes that died (ours: the heartbeat's kills included)
    router_cpu: float = 0.0  # CPU seconds of the router process itself (its workers or children not counted)


def read_trace(name: str, offset: float, window: float) -> list[tuple[float, int, int]]:
    """(seconds from the window's start, context tokens, generated tokens) of the trace's
    requests in [offset, offset + window)."""
    out, start = [], None
    with open(TRACES / f"azure_llm_2023_{name}.csv") as f:
        for row in csv.DictReader(f):
            t = datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp()
            start = t if start is None else start
            if offset <= t - start < offset + window:
                out.append((t - start - offset, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    return out


def zipf_pick(rnd: random.Random, n: int, s: float) -> int:
    weights = [1 / (k + 1) ** s for k in range(n)]
    return rnd.choices(range(n), weights)[0]


def workload(args, seed: int, models: list) -> list[Request]:
    """The window's requests, mapped to models and scaled to the machine (the same for the
    same seed, whatever the system)."""
    rnd = random.Random(seed)
    groups = {svc: [name for name, s, _ in models if s == svc] for svc in ("code", "conv")}
    for svc in groups:
        rnd.shuffle(groups[svc])  # which model is the popular one: the seed's
    conversations: dict[str, list[str]] = {}
    out = []
    for svc in ("code", "conv"):
        for t, ctx, gen in read_trace(svc, args.offset, args.window):
            model = groups[svc][zipf_pick(rnd, len(groups[svc]), args.zipf)]
            n_prompt = max(8, min(512, ctx // args.prompt_div))
            new = " ".join(rnd.choice(WORDS) for _ in range(max(4, n_prompt // 4)))
            if svc == "conv":  # a conversation's next turn: its history, then the new message
                convs = conversations.setdefault(model, [])
                k = zipf_pick(rnd, 8, 1.0)
                while len(convs) <= k:
                    convs.append("")
                history = convs[k]
                prompt = (history + " " + new).strip()[-4 * 512:]
                convs[k] = prompt
            else:
                prompt = new
            out.append(Request(t, model, prompt, max(1, min(48, gen // args.gen_div))))
    return sorted(out, key=lambda r: r.t)


async def one(session: aiohttp.ClientSession, base: str, req: Request, start: float, timeout: float) -> Outcome:
    o = Outcome(sent=time.monotonic() - start)
    body = {"model": req.model, "messages": [{"role": "user", "content": req.prompt}], "max_tokens": req.tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.monotonic()
    try:
        async with session.post(base + "/v1/chat/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            o.status = r.status
            if r.status != 200:
                o.error = (await r.text())[:200]
                return o
            async for line in r.content:
                if o.ttft is None and line.startswith(b"data: ") and b'"content":"' in line:
                    o.ttft = time.monotonic() - t0
            o.e2e = time.monotonic() - t0
            if o.ttft is None:
                o.ttft = o.e2e
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        o.error = type(e).__name__
    return o


async def replay(base: str, requests: list[Request], rate: float, timeout: float) -> list[Outcome]:
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as session:
        start = time.monotonic()
        tasks = []
        for req in requests:
            delay = req.t / rate - (time.monotonic() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(session, base, req, start, timeout)))
        return list(await asyncio.gather(*tasks))


class Poller:
    """Bytes held against the budget over time, and loads and evictions, read every 0.25 s:
    ours from its /devices and /metrics, llama-server's router from its /models (the probed
    bytes of the models it has loaded or is loading)."""

    def __init__(self, base: str, ours: bool, sizes: dict[str, int]):
        self.base, self.ours, self.sizes = base, ours, sizes
        self.memory: list[tuple[float, int]] = []
        self.loads = self.evictions = self.deaths = 0
        self._loaded: set[str] = set()
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=10) as c:
            while not self._stop.wait(0.25):
                try:
                    if self.ours:
                        devices = c.get("/devices").json()["devices"]
                        held = sum(d["held"] for n, d in devices.items() if n != "CPU")
                    else:
                        data = c.get("/models").json()["data"]
                        live = {m["id"] for m in data if m["status"]["value"] in ("loaded", "loading")}
                        self.loads += len(live - self._loaded)
                        self.evictions += len(self._loaded - live)
                        self._loaded = live
                        held = sum(self.sizes[m] for m in live if m in self.sizes)
                except (httpx.HTTPError, KeyError, ValueError):
                    continue
                self.memory.append((time.monotonic() - self._t0, held))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.events = []
        if self.ours:
            self.events = httpx.get(self.base + "/events", timeout=10).json()["data"]
            text = httpx.get(self.base + "/metrics", timeout=10).text
            for line in text.splitlines():
                if line.startswith("pyllmrouter_loads_total "):
                    self.loads = int(float(line.split()[1]))
                elif line.startswith("pyllmrouter_evictions_total "):
                    self.evictions = int(float(line.split()[1]))
                elif line.startswith("pyllmrouter_worker_deaths_total "):
                    self.deaths = int(float(line.split()[1]))


def start_system(system: str, preset: Path, budget: int, k: int, tmp: Path, args) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYLLMROUTER_CACHE": str(tmp / "cache")}
    if system.startswith("ours"):
        mib = max(1, budget // 2**20)
        extra = ["--kv-keep-ram", "0"] if system == "ours, states not kept" else []
        if system == "ours, counted":
            extra = ["--models-max", str(k)]
        if args.gpu:  # the real GPU, capped at the budget (a count: the whole GPU)
            flags = [] if system == "ours, counted" else ["--device-budget", f"CUDA0={mib}MiB"]
        else:
            flags = ["--emulate-devices", f"GPU0={mib}MiB" if system != "ours, counted" else "GPU0=1TiB"]
        return start_serve(["--models-preset", str(preset), "--no-models-cache", "--models-memory-margin", "0",
                            *flags, *extra, *args.ours_args.split()], env=env)
    port = free_port()
    kk = k if system.endswith("max K") else k + 1
    proc = subprocess.Popen([args.llama_server, "--models-preset", str(preset), "--models-max", str(kk),
                             "--port", str(port), "--host", "127.0.0.1", "--no-webui"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, proc)
    return proc, base


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds a live process has used (its children not counted)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


def summary(run: Run, budget: int) -> dict:
    ok = [o for o in run.outcomes if o.status == 200 and o.e2e is not None]
    n = len(run.outcomes)
    ttft = [o.ttft for o in ok]
    over = 0.0
    for (t0, b0), (t1, _) in zip(run.memory, run.memory[1:]):
        if b0 > budget:
            over += t1 - t0
    return {"system": run.system, "rate": run.rate, "seed": run.seed, "requests": n, "failed": n - len(ok),
            "attainment": {str(s): sum(1 for x in ttft if x <= s) / n if n else 0.0 for s in THRESHOLDS},
            "ttft_p50": pct(ttft, 50), "ttft_p90": pct(ttft, 90), "ttft_p99": pct(ttft, 99),
            "e2e_p50": pct([o.e2e for o in ok], 50), "e2e_p99": pct([o.e2e for o in ok], 99),
            "loads": run.loads, "evictions": run.evictions, "worker_deaths": run.deaths,
            "router_cpu_s": round(run.router_cpu, 2),
            "peak_bytes": max((b for _, b in run.memory), default=0), "seconds_over_budget": round(over, 2)}


def goodput(points: list[tuple[float, float]], target: float = 0.9) -> float:
    """The highest rate whose attainment is at least ``target``, interpolated between the
    last rate that reaches it and the first that does not (0: not even the lowest)."""
    points = sorted(points)
    best = 0.0
    for (r0, a0), (r1, a1) in zip([(0.0, 1.0), *points], points):
        if a1 >= target:
            best = r1
            continue
        if a0 >= target:
            best = r0 + (r1 - r0) * (a0 - target) / (a0 - a1) if a0 != a1 else r0
        break
    return best


def plot(summaries: list[dict], runs: list[Run], png: Path, slo: float, rate_shown: float, budget: int) -> None:
    import matplotlib  # noqa: PLC0415 - the bench's own need
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for system in SYSTEMS.values():
        pts = sorted((s["rate"], s["attainment"][str(slo)]) for s in summaries if s["system"] == system
                     and s["seed"] == summaries[0]["seed"])
        if pts:
            axes[0].plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=system)
    axes[0].axhline(90, color="grey", lw=0.8, ls="--")
    axes[0].set(xlabel="request rate (x the trace's)", ylabel=f"% of requests with TTFT <= {slo:g} s",
                title="SLO attainment against rate")
    axes[0].legend(fontsize=8)
    for run in runs:
        if run.rate != rate_shown or run.seed != runs[0].seed:
            continue
        pts = sorted((o.sent, o.ttft) for o in run.outcomes if o.ttft is not None)
        axes[1].plot([p[0] for p in pts], [p[1] for p in pts], lw=0.8, label=run.system)
        axes[2].plot([t for t, _ in run.memory], [b / 2**20 for _, b in run.memory], lw=0.9, label=run.system)
    axes[1].set(xlabel="seconds (arrival)", ylabel="TTFT s", yscale="log", title=f"TTFT over time at {rate_shown:g}x")
    axes[2].axhline(budget / 2**20, color="red", lw=1, ls="--", label="budget")
    axes[2].set(xlabel="seconds", ylabel="MiB held", title=f"memory held at {rate_shown:g}x")
    axes[1].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window", type=float, default=30.0, help="seconds of the trace")
    ap.add_argument("--offset", type=float, default=600.0, help="where the window starts, seconds into the trace")
    ap.add_argument("--rates", default="0.25,0.5,0.75,1")
    ap.add_argument("--seeds", default="1")
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--budget", type=float, default=0.45, help="the device: this fraction of the models' bytes")
    ap.add_argument("--prompt-div", type=int, default=64)
    ap.add_argument("--gen-div", type=int, default=16)
    ap.add_argument("--ours-args", default="", help="more arguments for every ours system (tuning runs)")
    ap.add_argument("--slo", type=float, default=2.0)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a request may take before it counts as failed")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    ap.add_argument("--gpu", action="store_true",
                    help="on the machine's GPU (CUDA0), capped at the budget, with GB-size models (GPU_MODELS)")
    ap.add_argument("--llama-server", default=str(llama_tool("llama-server")))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "trace_bench.json")
    ap.add_argument("--png", type=Path, default=Path(__file__).parent / "results" / "trace_bench.png")
    ap.add_argument("--events", type=Path, default=None, help="write ours' last run's /events here (tuning)")
    args = ap.parse_args()
    keys = [s for s in args.systems.split(",") if s]
    unknown = set(keys) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)} (known: {', '.join(SYSTEMS)})")
    systems = [SYSTEMS[k2] for k2 in keys]
    rates = [float(r) for r in args.rates.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    runs: list[Run] = []
    summaries: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        models = GPU_MODELS if args.gpu else MODELS
        if args.gpu:
            paths = {name: tinymodels.write_shape(tmp / f"{name}.gguf", shape, "Q4_0") for name, _, shape in models}
        else:
            paths = {name: tinymodels.write_llama(tmp / f"{name}.gguf", shape, seed=i)
                     for i, (name, _, shape) in enumerate(models)}
        sizes = {name: probe(ModelSpec(str(p), ARGS)).total for name, p in paths.items()}
        budget = int(args.budget * sum(sizes.values()))
        ordered = sorted(sizes.values(), reverse=True)
        k = max(1, max(n for n in range(1, len(ordered) + 1) if sum(ordered[:n]) <= budget))
        preset = tmp / "models.ini"
        preset.write_text("".join(f"[{n}]\nmodel = {p}\nc = {ARGS[1]}\nnp = {ARGS[3]}\n" for n, p in paths.items()))
        print(f"models: {', '.join(f'{n} {b / 2**20:.0f} MiB' for n, b in sizes.items())}; "
              f"budget {budget / 2**20:.0f} MiB ({args.budget:.0%} of {sum(sizes.values()) / 2**20:.0f}); "
              f"K = {k}", flush=True)
        for seed in seeds:
            requests = workload(args, seed, models)
            print(f"seed {seed}: {len(requests)} requests in {args.window:g} s of the trace", flush=True)
            for rate in rates:
                for system in systems:
                    proc, base = start_system(system, preset, budget, k, tmp, args)
                    try:
                        poller = Poller(base, system.startswith("ours"), sizes)
                        outcomes = asyncio.run(replay(base, requests, rate, args.timeout))
                        poller.stop()
                        router_cpu = cpu_seconds(proc.pid)
                    finally:
                        stop(proc)
                    run = Run(system, rate, seed, outcomes, poller.memory, poller.loads, poller.evictions,
                              poller.deaths, router_cpu)
                    runs.append(run)
                    if args.events:
                        args.events.write_text(json.dumps(poller.events))
                    s = summary(run, budget)
                    summaries.append(s)
                    print(f"  {rate:g}x {system}: TTFT<={args.slo:g}s {s['attainment'][str(args.slo)]:.0%}, "
                          f"p50 {s['ttft_p50'] or 0:.2f} s, p99 {s['ttft_p99'] or 0:.2f} s, failed {s['failed']}, "
                          f"loads {s['loads']}, worker deaths {s['worker_deaths']}, over budget {s['seconds_over_budget']} s, "
                          f"router CPU {s['router_cpu_s']} s",
                          flush=True)
    rows = [[f"{s['rate']:g}x", s["system"], str(s["seed"]),
             *[f"{100 * s['attainment'][str(t)]:.0f}%" for t in THRESHOLDS],
             *[f"{s[q]:.2f}" if s[q] is not None else "-" for q in ("ttft_p50", "ttft_p90", "ttft_p99", "e2e_p50",
                                                                      "e2e_p99")],
             str(s["loads"]), str(s["evictions"]), str(s["failed"]),
             f"{s['peak_bytes'] / budget:.2f}", f"{s['seconds_over_budget']:g}", f"{s['router_cpu_s']:g}"]
            for s in summaries]
    print(render(["rate", "system", "seed", *[f"TTFT<={t:g}s" for t in THRESHOLDS], "TTFT p50", "p90", "p99",
                  "E2E p50", "p99", "loads", "evictions", "failed", "peak/budget", "s over budget",
                  "router CPU s"], rows))
    good = {}
    for seed in seeds:
        for system in systems:
            pts = [(s["rate"], s["attainment"][str(args.slo)]) for s in summaries
                   if s["system"] == system and s["seed"] == seed]
            good.setdefault(system, {})[seed] = goodput(pts)
    ref = "llama-server router, max K"
    print(f"\ngoodput (the highest rate with 90 % of requests' TTFT <= {args.slo:g} s), per seed:")
    grows = []
    for system, per in good.items():
        ratios = [per[s] / good[ref][s] for s in per if ref in good and good[ref].get(s)]
        grows.append([system, " ".join(f"{per[s]:.2f}" for s in seeds),
                      " ".join(f"{r:.2f}" for r in ratios) if ratios else "-"])
    print(render(["system", "goodput (x the trace's rate) per seed", f"ours / {ref} per seed"], grows))
    save(args.out, {"bench": "trace", "args": {k2: (str(v) if isinstance(v, Path) else v) for k2, v in vars(args).items()},
                    "sizes": sizes, "budget": budget, "k": k, "summaries": summaries, "goodput": good,
                    "memory": {f"{r.system}@{r.rate}@{r.seed}": r.memory for r in runs},
                    "ttft": {f"{r.system}@{r.rate}@{r.seed}": [(o.sent, o.ttft) for o in r.outcomes] for r in runs}})
    try:
        plot(summaries, runs, args.png, args.slo, rates[len(rates) // 2], budget)
        print(f"wrote {args.png}")
    except ImportError:
        print("matplotlib is not installed: no picture (pip install matplotlib)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
