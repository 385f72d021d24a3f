"""``pyllmrouter demo``: the whole mission offline, in well under a minute.

Generates tiny real GGUF models, measures them exactly, starts ``pyllmrouter
serve`` (a separate process, as in production) on two emulated GPUs sized so
that they cannot hold everything, drives a scripted workload over HTTP and
prints what happened: where each model went, what was evicted and why, and
the bytes per device.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from pyllmrouter.tools import tinymodels
from pyllmrouter.tools.loopback import start_serve
from pyllmrouter.memory import cache_dir
from pyllmrouter.engine.probe import probe
from pyllmrouter.spec import ModelSpec
from pyllmrouter.tables import mib, render

__all__ = ["run_demo"]


class _Client:
    def __init__(self, base: str):
        self.base = base

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())


def _preset(directory: Path, paths: dict[str, Path]) -> Path:
    text = f"""version = 1
[*]
c = 2048
memory-margin = 0

[chat]
model = {paths['tiny-llama']}
alias = assistant

[coder]
model = {paths['tiny-moe']}
device = GPU0

[embed]
model = {paths['tiny-bert']}
embedding = true
c = 512

[huge]
model = {paths['tiny-llama']}
c = 262144
"""
    path = directory / "demo.ini"
    path.write_text(text)
    return path


def run_demo() -> int:
    paths = tinymodels.write_tiny_set(cache_dir() / "models")
    sizes = {name: probe(ModelSpec(paths[f], args)).total
             for name, f, args in [("chat", "tiny-llama", ("-c", "2048")), ("coder", "tiny-moe", ("-c", "2048")),
                                   ("embed", "tiny-bert", ("--embedding", "-c", "512"))]}
    # GPU0 holds the coder or the chat model, not both; GPU1 holds chat + embed
    gpu0 = max(sizes["chat"], sizes["coder"]) + min(sizes["chat"], sizes["coder"]) // 2
    gpu1 = sizes["chat"] + sizes["embed"] + sizes["embed"] // 2
    with tempfile.TemporaryDirectory() as tmp:
        preset = _preset(Path(tmp), paths)
        proc, base = start_serve(["--models-preset", str(preset), "--emulate-devices", f"GPU0={gpu0},GPU1={gpu1}",
                                  "--turn", "0.5"])
        try:
            client = _Client(base)
            print(f"pyllmrouter serve on {base}, emulated GPU0 {mib(gpu0)} MiB, GPU1 {mib(gpu1)} MiB\n")
            steps = _workload(client)
            status = client.call("GET", "/models")[1]
            devices = client.call("GET", "/devices")[1]
            events = client.call("GET", "/events")[1]["data"]
            metrics = urllib.request.urlopen(f"{client.base}/metrics", timeout=30).read().decode()
        finally:
            proc.terminate()
            proc.wait(30)
    print(render(["step", "request", "HTTP", "ms", "result"], steps))
    print("\nWhat the router did:\n")
    print(render(["t s", "event", "model", "devices"], [[e["t"], e["event"], e["model"], e["devices"]] for e in events]))
    print("\nModels (requirement probed per device before loading):\n")
    print(render(["model", "state", "on", "needs MiB", "loads"],
                 [[m["id"], m["status"]["value"], ",".join(m["memory"]["devices"]) or "-",
                   " ".join(f"{ds}:{mib(sum(v.values()))}" for ds, v in m["memory"]["requirement"].items()),
                   m["loads"]] for m in status["data"]]))
    print("\nDevices:\n")
    print(render(["device", "capacity MiB", "held MiB", "available MiB"],
                 [[n, mib(d["capacity"]), mib(d["held"]), mib(d["available"])]
                  for n, d in devices["devices"].items() if n != "CPU"]))
    ev = [line for line in metrics.splitlines() if line.startswith(("pyllmrouter_loads_total",
                                                                    "pyllmrouter_evictions_total"))]
    print("\n" + "\n".join(ev))
    return 0


def _workload(client: _Client) -> list[list]:
    steps: list[list] = []

    def step(label: str, method: str, path: str, body: dict | None = None) -> None:
        t0 = time.perf_counter()
        code, data = client.call(method, path, body)
        ms = (time.perf_counter() - t0) * 1000
        if code == 200 and "choices" in data:
            result = "ok: " + repr((data["choices"][0].get("message") or {}).get("content",
                                                                                   data["choices"][0].get("text")))[:30]
        elif code == 200 and "data" in data:
            result = f"ok: {len(data['data'][0]['embedding'])}-dim embedding"
        elif code == 200:
            result = "ok"
        else:
            result = data["error"]["message"][:120]
        steps.append([len(steps) + 1, label, code, f"{ms:.0f}", result])

    hi = [{"role": "user", "content": "hello"}]
    step("chat (unpinned)", "POST", "/v1/chat/completions", {"model": "chat", "messages": hi, "max_tokens": 8})
    step("embed (unpinned)", "POST", "/v1/embeddings", {"model": "embed", "input": "hello world"})
    step("coder (pinned GPU0)", "POST", "/v1/completions", {"model": "coder", "prompt": "def", "max_tokens": 8})
    step("alias 'assistant'", "POST", "/v1/chat/completions", {"model": "assistant", "messages": hi,
                                                               "max_tokens": 8})
    errors: list[str] = []

    def client_loop(model: str) -> None:
        for _ in range(3):
            code, data = client.call("POST", "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 4})
            if code != 200:
                errors.append(f"{model}: {code}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(m,)) for m in ("chat", "coder") for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    steps.append([len(steps) + 1, "6 clients x 3 requests, chat+coder", 200 if not errors else 500,
                  f"{(time.perf_counter() - t0) * 1000:.0f}", "ok: 18/18" if not errors else ", ".join(errors)])
    step("huge (262144 ctx)", "POST", "/v1/completions", {"model": "huge", "prompt": "x"})
    step("unknown model", "POST", "/v1/completions", {"model": "nope", "prompt": "x"})
    step("unload coder", "POST", "/models/unload", {"model": "coder"})
    return steps


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(run_demo())
