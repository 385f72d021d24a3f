import json
import subprocess
import sys

import pytest

from pyllmrouter.cli import main


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyllmrouter.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_probe_json_per_device(tiny):
    out = _cli("probe", str(tiny["tiny-moe"]), "--ctx-size", "1024", "--parallel", "2", "--json", "--margin", "0")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["n_ctx"] == 1024 and d["n_seq_max"] == 2
    assert d["facts"]["n_expert"] == 4
    cpu = d["devices"][-1]
    assert cpu["device"] == "CPU" and cpu["total"] == cpu["weights"] + cpu["kv"] + cpu["compute"] + cpu["output"]
    assert d["fits"]["CPU"] is True and d["free"]["CPU"] > cpu["total"]


def test_probe_table(tiny, capsys):
    assert main(["probe", str(tiny["tiny-llama"]), "-c", "512", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]) == 0
    out = capsys.readouterr().out
    assert "weights MiB" in out and "fits (margin 1024 MiB)" in out
    assert "n_ctx 512" in out


def test_devices_json():
    out = _cli("devices", "--json")
    assert out.returncode == 0
    assert any(d["type"] == "cpu" for d in json.loads(out.stdout))


def test_probe_takes_any_llama_server_command_line(tiny, draft, tmp_path, monkeypatch):
    """llama-server's own options, aliases and LLAMA_ARG_* variables, through llama.cpp's parser:
    the same bytes as the same settings spelled otherwise."""
    model = str(tiny["tiny-llama"])
    spelled = [
        ["probe", model, "-c", "1024", "-np", "2", "-md", str(draft), "--json"],
        ["probe", "-m", model, "--ctx-size", "1024", "--parallel", "2", "--model-draft", str(draft), "--json"],
        ["probe", "--json", "--spec-draft-model", str(draft), "-m", model, "--parallel", "2"],  # -c from the environment
    ]
    env_ctx = {"LLAMA_ARG_CTX_SIZE": "1024"}
    outs = []
    for i, args in enumerate(spelled):
        out = subprocess.run([sys.executable, "-m", "pyllmrouter.cli", *args], capture_output=True, text=True,
                             timeout=120, env={**__import__("os").environ, **(env_ctx if i == 2 else {})})
        assert out.returncode == 0, out.stderr
        outs.append(json.loads(out.stdout))
    assert [o["n_ctx"] for o in outs] == [1024] * 3 and len({json.dumps(o["devices"]) for o in outs}) == 1
    assert outs[0]["devices"][-1]["draft"] > 0
    # what only llama-server had: --swa-full, --ctx-checkpoints, --fit-ctx are accepted
    assert main(["probe", model, "--swa-full", "--ctx-checkpoints", "0", "--fit-ctx", "1024", "--no-cache"]) == 0


@pytest.mark.parametrize("args, message", [
    (["probe", "/nonexistent/m.gguf"], "/nonexistent/m.gguf: file not found"),
    (["probe", "{model}", "--ctx-size", "lots"], "argument -c = 'lots'"),
    (["probe", "{model}", "--warp-speed", "9"], "invalid argument: --warp-speed"),
    (["probe", "-c", "512"], "no model"),
])
def test_errors_exit_2_with_the_reason(tiny, args, message):
    args = [a.format(model=tiny["tiny-llama"]) for a in args]
    out = _cli(*args)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_the_demo_replays_the_seed_incident_readably():
    """The README's first command: readable answers, and the seed incident as it should end:
    the idle model on the full GPU evicted, the busy one and the other GPU's spared."""
    out = subprocess.run([sys.executable, "-m", "pyllmrouter.cli", "demo", "--keep", "0"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "Hello there!" in text and "The user says hello" in text  # reasoning and answer
    assert 'tool call get_weather({"city": "Paris"})' in text
    assert "Once upon a time, the router knew every byte of its GPUs." in text
    assert "chat   evicted from GPU0 for coder" in text
    assert "Evicted: chat; spared: story, embed" in text
    assert "can never fit" in text and "unknown model 'nope'" in text
    assert "/ in a browser" in text


@pytest.mark.slow
def test_ps_and_devices_url_show_a_running_server(tiny, tmp_path):
    from pyllmrouter.remote import get, post
    from pyllmrouter.tables import mib
    from pyllmrouter.tools.loopback import start_serve

    preset = tmp_path / "m.ini"
    preset.write_text(f"version = 1\n[*]\nmemory-margin = 0\nc = 512\n[a]\nmodel = {tiny['tiny-llama']}\n"
                      f"[b]\nmodel = {tiny['tiny-moe']}\n")
    proc, base = start_serve(["--models-preset", str(preset), "--api-key", "k", "--emulate-devices", "GPU0=1GiB"])
    try:
        post(base, "/models/load", {"model": "a"}, "k")
        held = next(m for m in get(base, "/models", "k")["data"] if m["id"] == "a")["memory"]["held"]

        def run(*args):
            return subprocess.run([sys.executable, "-m", "pyllmrouter.cli", *args], capture_output=True, text=True,
                                  timeout=120)

        out = run("ps", "--url", base, "--api-key", "k")
        assert out.returncode == 0, out.stderr
        row = next(line.split() for line in out.stdout.splitlines() if line.startswith("a "))
        assert row[:4] == ["a", "loaded", "GPU0", mib(held["GPU0"])]
        assert "\nb " not in out.stdout  # holds nothing: listed with --all only
        assert "\nb " in run("ps", "--url", base, "--api-key", "k", "--all").stdout
        dev = run("devices", "--url", base, "--api-key", "k")
        gpu0 = next(line.split() for line in dev.stdout.splitlines() if line.startswith("GPU0"))
        devices = get(base, "/devices", "k")["devices"]["GPU0"]
        assert gpu0[2:4] == [mib(devices["total"]), mib(devices["held"] - devices["overhead"])]
        bad = run("ps", "--url", base, "--api-key", "nope")
        assert bad.returncode == 2 and "401 invalid or missing API key" in bad.stderr
    finally:
        proc.terminate()
        proc.wait(30)
