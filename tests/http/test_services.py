"""What llama-server's router process does beside its models, side by side with
llama-server's router mode on the same arguments: CORS (the preflight before the API key,
origins echoed, localhost only, localhost by default once tools are on), the API keys
llama.cpp's parser reads, /tools (built-in tools, MCP servers' tools) and /cors-proxy,
each llama-server's 403 when off; and a tool call in flight does not hold up a stop."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from pyllmrouter.tools.loopback import free_port, llama_tool, start_serve, wait_healthy
from test_live import sse_events

pytestmark = pytest.mark.slow  # real servers


def _source_tests() -> Path:
    out = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[2] / "vendor" / "fetch.py"), "source"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip()) / "tools" / "server" / "tests"


@contextmanager
def both(models_dir: Path, *args: str, ours_args: tuple[str, ...] | None = None, cache: bool = False):
    """llama-server's router mode and ours, on one models directory and these arguments
    (``ours_args``: ours on others; ``cache``: ours serves llama.cpp's cache, pulls on, as
    llama-server's router does)."""
    binary = llama_tool("llama-server")
    if not binary.exists():
        pytest.skip(f"{binary} is missing: scripts/setup.sh --test builds it")
    port = free_port()
    peer = subprocess.Popen([str(binary), "--models-dir", str(models_dir), "--host", "127.0.0.1", "--port", str(port),
                             *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ours = None
    try:
        wait_healthy(f"http://127.0.0.1:{port}", peer)
        ours, base = start_serve(["--models-dir", str(models_dir), *([] if cache else ["--no-models-cache"]),
                                  *(args if ours_args is None else ours_args)])
        yield f"http://127.0.0.1:{port}", base
    finally:
        for proc in (peer, ours):
            if proc is not None:
                proc.terminate()
                proc.wait(30)


@pytest.fixture(scope="module")
def models_dir(tiny, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("models-dir")
    shutil.copy(tiny["tiny-llama"], d / "tiny.gguf")
    return d


def _cors(response: httpx.Response) -> dict[str, str]:
    return {k.lower(): v for k, v in response.headers.items() if k.lower().startswith("access-control-")}


ORIGINS = [None, "http://localhost:8080", "http://127.0.0.1:3000", "http://[::1]", "http://evil.com",
           "http://localhost.evil.com", "web.mydomain.fr", "https://app.example"]


LOCAL = {"http://localhost:8080", "http://127.0.0.1:3000", "http://[::1]"}


@pytest.mark.parametrize("theirs_args, ours_args", [
    (("--cors-origins", "localhost"), ()),  # ours by default: the local origins only
    ((), ("--cors-origins", "*")),  # llama-server's default, given back by one option
    (("--cors-origins", "localhost"), ("--cors-origins", "localhost")),
    (("--tools", "all"), ("--tools", "all")),
    (("--cors-origins", "https://app.example", "--no-cors-credentials"),) * 2,
    (("--api-key", "k1", "--cors-origins", "localhost"), ("--api-key", "k1"))],
    ids=["default", "star", "localhost", "tools", "fixed", "key"])
def test_cors_answers_as_llama_servers_router(models_dir, theirs_args, ours_args):
    """The preflight's and the answers' CORS headers are llama-server's for the same origins
    setting; a request from an origin that setting does not allow is refused by ours (403)."""
    allowed = {"*": set(ORIGINS), "https://app.example": {"https://app.example"}}.get(
        dict(zip(ours_args[::2], ours_args[1::2])).get("--cors-origins", "localhost"), LOCAL)
    with both(models_dir, *theirs_args, ours_args=ours_args) as (theirs, ours):
        for origin in ORIGINS:
            hdr = {"Origin": origin, "Access-Control-Request-Method": "POST"} if origin else {}
            a = httpx.options(theirs + "/v1/chat/completions", headers=hdr, timeout=30)
            b = httpx.options(ours + "/v1/chat/completions", headers=hdr, timeout=30)
            assert (b.status_code, _cors(b)) == (a.status_code, _cors(a)), origin  # the preflight: no key asked
            if origin:
                a, b = (httpx.get(base + "/v1/models", headers={"Origin": origin}, timeout=30) for base in (theirs, ours))
                if origin in allowed:
                    assert (b.status_code, _cors(b)) == (a.status_code, _cors(a)), origin
                else:
                    assert b.status_code == 403 and "--cors-origins" in b.json()["error"]["message"], origin


def test_api_keys_from_a_key_file_open_the_router(models_dir, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("first-key\nsecond-key\n")
    with both(models_dir, "--api-key-file", str(keys)) as (theirs, ours):
        for base in (theirs, ours):
            assert httpx.get(base + "/v1/models", timeout=30).status_code == 401
            for key in ("first-key", "second-key"):
                r = httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
                assert r.status_code == 200, base
            assert httpx.get(base + "/v1/health", timeout=30).status_code == 200  # public
            # the router's own options are not a model's: no model is given (or lists) the key file
            listed = httpx.get(base + "/models", headers={"Authorization": "Bearer first-key"}, timeout=30).json()
            args = [a for m in listed["data"] for a in m["status"]["args"]]
            assert args and str(keys) not in args and "--api-key-file" not in args, base


def test_router_props_say_whether_the_cors_proxy_is_on(models_dir):
    for args in ((), ("--ui-mcp-proxy",)):
        with both(models_dir, *args) as (theirs, ours):
            a, b = (httpx.get(base + "/props", timeout=30).json() for base in (theirs, ours))
            assert b["cors_proxy_enabled"] == a["cors_proxy_enabled"] == bool(args)


def test_tools_are_llama_servers_own_or_its_403(models_dir, tmp_path):
    note = tmp_path / "note.txt"
    note.write_text("a line to read back\n")
    with both(models_dir) as (theirs, ours):
        for path in ("/tools", "/cors-proxy"):
            a, b = (httpx.get(base + path, timeout=30) for base in (theirs, ours))
            assert (b.status_code, b.json()) == (a.status_code, a.json()) and b.status_code == 403
    with both(models_dir, "--tools", "all") as (theirs, ours):
        a, b = (httpx.get(base + "/tools", timeout=30).json() for base in (theirs, ours))
        assert b == a and {t["tool"] for t in b} >= {"read_file", "write_file", "exec_shell_command"}
        call = {"tool": "read_file", "params": {"path": str(note)}}
        a, b = (httpx.post(base + "/tools", json=call, timeout=30) for base in (theirs, ours))
        assert (b.status_code, b.json()) == (a.status_code, a.json())
        assert b.json()["plain_text_response"] == note.read_text()
        # a streamed tool: the same events
        call = {"tool": "exec_shell_command", "params": {"command": "echo one; echo two"}, "stream": True}
        a, b = (httpx.post(base + "/tools", json=call, timeout=30) for base in (theirs, ours))
        assert b.status_code == a.status_code == 200 and b.headers["content-type"] == a.headers["content-type"]
        events = [json.loads(line[6:]) for line in b.text.splitlines() if line.startswith("data: ")]
        assert events[-1]["done"] and "one\ntwo" in "".join(e.get("chunk", "") for e in events[:-1])


def test_mcp_tools_are_listed_and_called_and_a_stop_cuts_a_slow_call_short(models_dir):
    fixtures = _source_tests() / "fixtures"
    cfg = json.dumps({"mcpServers": {
        "echo": {"command": sys.executable, "args": [str(fixtures / "mcp_echo_server.py")]},
        "slow": {"command": sys.executable, "args": [str(fixtures / "mcp_slow_server.py"), "--delay", "20"],
                 "timeout_ms": 60000}}})
    args = ("--tools", "all", "--mcp-servers-json", cfg)
    with both(models_dir, *args) as (theirs, ours):
        a, b = (httpx.get(base + "/tools", timeout=30).json() for base in (theirs, ours))
        assert sorted(t["tool"] for t in b) == sorted(t["tool"] for t in a)
        assert {"echo_echo", "slow_sleep"} <= {t["tool"] for t in b}
        call = {"tool": "echo_echo", "params": {"message": "hello"}}
        a, b = (httpx.post(base + "/tools", json=call, timeout=30) for base in (theirs, ours))
        assert (b.status_code, b.json()) == (a.status_code, a.json()) and "hello" in b.text
    proc, base = start_serve(["--models-dir", str(models_dir), "--no-models-cache", *args])
    answered: list = []
    slow = threading.Thread(target=lambda: answered.append(httpx.post(
        base + "/tools", json={"tool": "slow_sleep", "params": {"seconds": 20}}, timeout=60).status_code))
    slow.start()
    time.sleep(2)  # the call is in the MCP server now
    t0 = time.monotonic()
    proc.terminate()
    proc.wait(30)
    stopped = time.monotonic() - t0
    slow.join(30)
    assert stopped < 3, f"the router took {stopped:.1f} s to stop under a 20 s tool call"
    assert answered and answered[0] >= 500  # the call ended with the services, not after 20 s


def test_a_pull_with_no_network_ends_as_llama_servers_router_ends_it(models_dir, monkeypatch):
    """With nowhere to download from, llama.cpp's downloader finds no file and says so only in
    its log: llama-server's router publishes download_finished (its child's handler returned)
    and lists nothing; so does ours."""
    import socket

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    monkeypatch.setenv("MODEL_ENDPOINT", f"http://127.0.0.1:{closed.getsockname()[1]}/")
    closed.close()
    name = "ggml-org/test-model-router-download:F16"
    seen: dict[str, list] = {}
    with both(models_dir, cache=True) as (theirs, ours):
        for base in (theirs, ours):
            events: list = []
            stop = threading.Event()
            sse_events(base, stop, events)
            time.sleep(0.5)
            assert httpx.post(base + "/models", json={"model": name}, timeout=30).status_code == 200
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not any(e.get("event", "").startswith("download_f") for e in events):
                time.sleep(0.1)
            stop.set()
            seen[base] = [(e["event"], e["model"]) for e in events if e.get("event", "").startswith("download_f")]
            assert name not in [m["id"] for m in httpx.get(base + "/models", timeout=30).json()["data"]]
    assert seen[ours] == seen[theirs] == [("download_finished", name)]
