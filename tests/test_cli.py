import json
import subprocess
import sys

import pytest

from pyllmrouter.cli import main


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyllmrouter.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_probe_json_per_device(tiny):
    out = _cli("probe", str(tiny["tiny-moe"]), "--ctx", "1024", "--parallel", "2", "--json", "--margin", "0")
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


@pytest.mark.parametrize("args, message", [
    (["probe", "/nonexistent/m.gguf"], "/nonexistent/m.gguf: file not found"),
    (["probe", "{model}", "--ctx", "-4"], "n_ctx=-4"),
])
def test_errors_exit_2_with_the_reason(tiny, args, message):
    args = [a.format(model=tiny["tiny-llama"]) for a in args]
    out = _cli(*args)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr
