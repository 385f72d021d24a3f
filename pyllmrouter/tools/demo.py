"""``pyllmrouter demo``: the mission offline, in well under a minute.

Writes models whose answers read well (scripted.py: a thinking chat model, a tool
caller, a storyteller whose story goes on) and a tiny embedding model, measures
them exactly, starts ``pyllmrouter serve`` (a process of its own, as in production)
on two emulated GPUs, and replays the seed incident over HTTP:

    GPU0 holds chat (idle) and story (busy, streaming); GPU1 holds embed and has room.
    coder, pinned to GPU0, arrives.  Summed over the GPUs, free memory says "fits":
    a router that counts so loads it on GPU0 and the load dies (cudaMalloc failed).
    Ours measures GPU0 alone, evicts the least recently used idle model there (chat),
    spares the busy one (story) and the other GPU's (embed), and loads coder.

Then it prints what the router did, the models as ``pyllmrouter ps`` lists them,
the devices, and the page's address, kept up for ``keep`` seconds.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from pyllmrouter.engine.probe import probe
from pyllmrouter.memory import cache_dir
from pyllmrouter.remote import RemoteError, devices_table, get, ps_table, request
from pyllmrouter.spec import ModelSpec
from pyllmrouter.tables import mib, render
from pyllmrouter.tools import scripted, tinymodels
from pyllmrouter.tools.loopback import start_serve

__all__ = ["run_demo"]

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
CTX, STORY_CTX = 2048, 8192


def _models(directory: Path) -> dict[str, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    out = {"chat": directory / "demo-think.gguf", "coder": directory / "demo-tools.gguf",
           "story": directory / "demo-story.gguf"}
    if not out["chat"].exists():
        scripted.write_scripted(out["chat"], scripted.THINK_TEMPLATE, scripted.THINK_SCRIPT)
    if not out["coder"].exists():
        scripted.write_scripted(out["coder"], scripted.TOOL_TEMPLATE, scripted.TOOL_SCRIPT)
    if not out["story"].exists():
        scripted.write_scripted(out["story"], scripted.THINK_TEMPLATE, scripted.STORY_SCRIPT, loop=True)
    out["embed"] = tinymodels.write_tiny_set(directory)["tiny-bert"]
    return out


def _preset(directory: Path, paths: dict[str, Path]) -> Path:
    path = directory / "demo.ini"
    path.write_text(f"""version = 1
[*]
c = {CTX}
memory-margin = 0

[chat]
model = {paths['chat']}
alias = assistant
device = GPU0

[story]
model = {paths['story']}
c = {STORY_CTX}
device = GPU0

[coder]
model = {paths['coder']}
device = GPU0

[embed]
model = {paths['embed']}
embedding = true
c = 512

[huge]
model = {paths['chat']}
c = 4194304
""")
    return path


def _sizes(paths: dict[str, Path]) -> dict[str, int]:
    args = {"chat": ("-c", str(CTX)), "coder": ("-c", str(CTX)), "story": ("-c", str(STORY_CTX)),
            "embed": ("--embedding", "-c", "512")}
    return {name: probe(ModelSpec(str(paths[name]), a)).total for name, a in args.items()}


def run_demo(keep: float = 60.0) -> int:
    paths = _models(cache_dir() / "models")
    need = _sizes(paths)
    gpu0 = need["chat"] + need["story"] + need["coder"] // 2  # chat and story; coder only in their place
    gpu1 = 16 * (need["embed"] + need["coder"])  # room to spare
    with tempfile.TemporaryDirectory() as tmp:
        preset = _preset(Path(tmp), paths)
        proc, base = start_serve(["--models-preset", str(preset), "--emulate-devices", f"GPU0={gpu0},GPU1={gpu1}"])
        try:
            print(f"pyllmrouter serve on {base}: emulated GPU0 {mib(gpu0)} MiB, GPU1 {mib(gpu1)} MiB\n")
            steps = _workload(base, need, gpu0, gpu1)
            print(render(["step", "request", "HTTP", "ms", "answer"], steps))
            _report(base)
            print(f"\nThe page: open {base}/ in a browser (devices, models, events, chat).")
            if keep:
                print(f"Serving for {keep:.0f} s more (pyllmrouter demo --keep SECONDS; Ctrl-C ends it).")
                try:
                    time.sleep(keep)
                except KeyboardInterrupt:
                    pass
        finally:
            proc.terminate()
            proc.wait(30)
    return 0


def _say(code: int, data: dict) -> str:
    if code != 200:
        return (data.get("error") or {}).get("message", str(data))[:110]
    if "data" in data:
        return f"{len(data['data'][0]['embedding'])}-dim embedding"
    msg = data["choices"][0]["message"]
    if msg.get("tool_calls"):
        f = msg["tool_calls"][0]["function"]
        return f"tool call {f['name']}({f['arguments']})"
    thought = (msg.get("reasoning_content") or "").strip()
    return (f"[thinks: {thought}] " if thought else "") + (msg.get("content") or "")


def _workload(base: str, need: dict[str, int], gpu0: int, gpu1: int) -> list[list]:
    steps: list[list] = []

    def step(label: str, path: str, body: dict) -> None:
        t0 = time.perf_counter()
        code, data = request(base, "POST", path, body)
        steps.append([len(steps) + 1, label, code, f"{(time.perf_counter() - t0) * 1000:.0f}", _say(code, data)])

    hi = [{"role": "user", "content": "hello"}]
    step("chat 'hello' (alias assistant, GPU0)", "/v1/chat/completions", {"model": "assistant", "messages": hi})
    step("embed 'hello world' (unpinned)", "/v1/embeddings", {"model": "embed", "input": "hello world"})

    # story streams on GPU0 (busy) while coder, pinned to GPU0 too, arrives
    first, told = threading.Event(), []

    def tell() -> None:
        body = {"model": "story", "messages": [{"role": "user", "content": "a story"}], "stream": True,
                "max_tokens": 2000}
        req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            for line in r:
                if line.startswith(b"data: {"):
                    told.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
                    first.set()
        first.set()

    teller = threading.Thread(target=tell)
    t0 = time.perf_counter()
    teller.start()
    first.wait(120)
    dev = get(base, "/devices")["devices"]
    free0, free1 = dev["GPU0"]["available"], dev["GPU1"]["available"]
    print("The seed incident: GPU0 holds chat (idle) and story (busy, streaming); coder, pinned to GPU0, "
          f"needs {mib(need['coder'])} MiB.\n  GPUs summed: {mib(free0)} + {mib(free1)} = {mib(free0 + free1)} MiB "
          f"free >= {mib(need['coder'])}: a router that sums would load it on GPU0, where {mib(free0)} MiB are free,"
          f"\n  and the load would die (cudaMalloc failed). Ours counts GPU0 alone:\n")
    step("coder with a tool (pinned GPU0)", "/v1/chat/completions",
         {"model": "coder", "messages": [{"role": "user", "content": "weather in Paris?"}], "tools": [WEATHER]})
    teller.join()
    steps.append([len(steps) + 1, "story, streamed meanwhile (GPU0)", 200,
                  f"{(time.perf_counter() - t0) * 1000:.0f}", f"{len(told)} chunks: " + "".join(told)[:60] + "..."])
    step("huge (context 4194304)", "/v1/chat/completions", {"model": "huge", "messages": hi})
    step("unknown model", "/v1/chat/completions", {"model": "nope", "messages": hi})
    return steps


def _report(base: str) -> None:
    events = get(base, "/events")["data"]
    shown = {"load", "evicted", "unloaded", "load-failed"}
    print("\nWhat the router did:\n")
    rows = []
    for e in events:
        if e["event"] not in shown:
            continue
        d = e.get("data") or {}
        what = {"load": f"loaded on {e['devices']}",
                "evicted": f"evicted from {', '.join(d.get('short') or d.get('bytes') or {})} for {d.get('newcomer')}"
                           f" ({', '.join(f'{k} {mib(v)} MiB' for k, v in (d.get('bytes') or {}).items())})",
                "unloaded": "unloaded", "load-failed": f"refused: {d.get('reason', '')[:70]}"}[e["event"]]
        rows.append([f"{e['t']:.2f}", e["model"], what])
    print(render(["t s", "model", "what"], rows))
    models = get(base, "/models")
    evicted = [e["model"] for e in events if e["event"] == "evicted"]
    spared = [m["id"] for m in models["data"] if m["status"]["value"] == "loaded" and m["id"] != "coder"]
    print(f"\nEvicted: {', '.join(evicted) or 'none'}; spared: {', '.join(spared) or 'none'} "
          "(busy, or on the other GPU).")
    print("\nModels (pyllmrouter ps --all):\n")
    print(render(*ps_table(models, everything=True)))
    print("\nDevices (pyllmrouter devices --url):\n")
    print(render(*devices_table(get(base, "/devices"))))


if __name__ == "__main__":
    try:
        raise SystemExit(run_demo())
    except RemoteError as e:
        raise SystemExit(f"pyllmrouter demo: {e}")
