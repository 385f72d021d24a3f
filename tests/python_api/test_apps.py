"""A Router inside an application: a plain script, a module, ``python -c``: no
``if __name__ == "__main__"`` guard needed, since workers start from pyllmrouter's own
entry point and never import or run the application's main module."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"

pytestmark = pytest.mark.slow


def readme_example() -> str:
    """The README's first Python example that builds a Router, verbatim."""
    block = next((b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if "Router(" in b), None)
    assert block, "the README has no Python example that builds a Router"
    return block


@pytest.fixture
def app_dir(tiny, tmp_path) -> Path:
    """The files the README's example names, as tiny real models, in the app's folder."""
    for name, model in (("chat.gguf", "tiny-llama"), ("coder.gguf", "tiny-llama"), ("bge.gguf", "tiny-bert")):
        os.symlink(tiny[model], tmp_path / name)
    return tmp_path


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_readme_example_runs_as_a_plain_script(app_dir):
    (app_dir / "app.py").write_text(readme_example())
    out = run(["app.py"], app_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "bootstrapping phase" not in out.stderr


def test_a_module_run_with_dash_m_and_a_dash_c_program_need_no_guard(app_dir, tiny):
    """A module run as ``python -m`` (multiprocessing's spawn would import it again in the
    worker, by name) and ``python -c`` both serve, and the app's code runs once."""
    app = textwrap.dedent("""
        from pyllmrouter import ModelConfig, ModelSpec, Router
        print("app started", flush=True)
        with Router([ModelConfig("chat", ModelSpec("chat.gguf", ("-c", "256")))]) as router:
            reply = router.complete("chat", "Once upon", max_tokens=4, ignore_eos=True)  # a random model's EOS
            print("tokens", reply["usage"]["completion_tokens"], flush=True)
    """)
    (app_dir / "myapp.py").write_text(app)
    for argv in (["-m", "myapp"], ["-c", app]):
        out = run(argv, app_dir)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.splitlines() == ["app started", "tokens 4"], out.stdout


def test_a_worker_that_cannot_start_says_why(tiny, tmp_path):
    """A worker that dies while it starts (its rpc-server is not there: ggml aborts) fails
    the request with the reason it wrote to stderr, not only its exit code."""
    code = textwrap.dedent(f"""
        from pyllmrouter import ModelConfig, ModelSpec, Router
        from pyllmrouter.devices import RpcInventory
        from pyllmrouter.errors import RouterError
        inventory = RpcInventory({{"127.0.0.1:1": 4 << 30}})  # nothing listens on port 1
        spec = ModelSpec({str(tiny["tiny-llama"])!r}, ("-c", "256"))
        with Router([ModelConfig("chat", spec, devices=("RPC0",))], inventory=inventory) as router:
            try:
                router.complete("chat", "x", max_tokens=1)
            except RouterError as e:
                print("error:", e)
    """)
    out = run(["-c", code], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "exited while starting (exit code -6)" in out.stdout, out.stdout
    assert "Failed to connect to 127.0.0.1:1" in out.stdout, out.stdout
