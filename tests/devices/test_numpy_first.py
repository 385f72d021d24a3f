"""numpy imported before anything of llama.cpp, in every process: the extension, the in-process
probe, a worker's engine.

An app that imports numpy (or gguf, or pandas) before it probes loads numpy's own libraries
(OpenBLAS, libgfortran) before libllama and ggml.  On the CUDA build that order crashed the
process as the extension was created; `sitecustomize` here imports numpy at the start of
every interpreter these tests start, the router's workers included.  Run on every build (the
CPU one in CI); scripts/gpu_check.sh runs them on the CUDA build, where the crash was.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import httpx
import pytest

from pyllmrouter.tools.loopback import start_serve

pytestmark = pytest.mark.numpy_first
GPU = os.environ.get("PYLLMROUTER_TEST_DEVICE", "CUDA0" if subprocess.run(
    ["sh", "-c", "command -v nvidia-smi"], capture_output=True).returncode == 0 else "")


@pytest.fixture(scope="module")
def numpy_env(tmp_path_factory) -> dict[str, str]:
    """An environment whose interpreters import numpy before anything else (and say so)."""
    d = tmp_path_factory.mktemp("numpy-first")
    (d / "sitecustomize.py").write_text(
        "import os, sys\nimport numpy\n"
        "if 'llama_cpp' in sys.modules or 'pyllmrouter._native' in sys.modules:\n"
        "    raise SystemExit('sitecustomize ran after llama.cpp was loaded')\n"
        "open(os.path.join(os.path.dirname(__file__), 'pids'), 'a').write(f'{os.getpid()}\\n')\n")
    path = os.pathsep.join(filter(None, [str(d), os.environ.get("PYTHONPATH", "")]))
    return {**os.environ, "PYTHONPATH": path, "NUMPY_FIRST_DIR": str(d)}


def _run(code: str, env: dict[str, str]) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, f"exit {proc.returncode} (a signal if negative)\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_extension_loads_after_numpy_and_lists_the_devices(numpy_env):
    out = _run("""
        import json, sys
        assert "numpy" in sys.modules
        from pyllmrouter import _native
        print(json.dumps({"devices": [d["name"] for d in _native.devices()]}))
    """, numpy_env)
    assert out["devices"], "no ggml device listed"
    if GPU:
        assert GPU in out["devices"]


def test_an_in_process_probe_after_numpy_gives_the_bytes_of_one_without(numpy_env, tiny):
    code = f"""
        import json
        from pyllmrouter import ModelSpec, probe
        est = probe(ModelSpec({str(tiny["tiny-llama"])!r}, n_ctx=1024), use_cache=False)
        print(json.dumps({{"per_device": est.per_device()}}))
    """
    first = _run(code, numpy_env)
    plain = _run(code, {k: v for k, v in numpy_env.items() if k != "PYTHONPATH"})
    assert first == plain and first["per_device"]


def test_workers_whose_interpreters_import_numpy_first_serve(numpy_env, tiny):
    pids = os.path.join(numpy_env["NUMPY_FIRST_DIR"], "pids")
    open(pids, "w").close()
    extra = ["--device-budget", f"{GPU}=4GiB"] if GPU else []
    preset = os.path.join(numpy_env["NUMPY_FIRST_DIR"], "models.ini")
    with open(preset, "w") as f:
        f.write(f"[tiny]\nmodel = {tiny['tiny-llama']}\nc = 1024\n")
    proc, base = start_serve(["--models-preset", preset, "--shutdown-timeout", "5", *extra], env=numpy_env)
    try:
        r = httpx.post(base + "/v1/chat/completions", timeout=120,
                       json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        worker_pids = {int(p) for p in open(pids).read().split()} - {proc.pid}
        assert worker_pids, "no process but the router's imported numpy first: the worker did not start with it"
    finally:
        proc.terminate()
        proc.wait(30)
