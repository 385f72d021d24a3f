"""Shared fixtures: tiny real GGUF models and an isolated probe cache."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from pyllmrouter import tinymodels
from pyllmrouter.probe import cache_dir


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict:
    """The three tiny models (llama, qwen3moe, bert), written once per session."""
    return tinymodels.write_tiny_set(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def shape7b(tmp_path_factory):
    """A sparse file with the full layout of a 7B Q4_0 llama."""
    return tinymodels.write_shape(tmp_path_factory.mktemp("shape") / "shape-7b.gguf", tinymodels.SHAPE_7B)


# the cache the project's own setup filled (the pinned sdist lives there)
USER_CACHE = os.environ.get("PYLLMROUTER_CACHE")


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory):
    """One probe cache for a whole module (set for module-scoped fixtures too)."""
    mp = pytest.MonkeyPatch()
    path = tmp_path_factory.mktemp("cache")
    mp.setenv("PYLLMROUTER_CACHE", str(path))
    yield path
    mp.undo()


@pytest.fixture(autouse=True)
def _isolated_cache(request, tmp_path, monkeypatch):
    """Every test probes into its own cache directory, unless its module sets
    SHARE_PROBE_CACHE = True (router tests: re-probing every test costs seconds)."""
    if getattr(request.module, "SHARE_PROBE_CACHE", False):
        path = request.getfixturevalue("module_cache")
    else:
        path = tmp_path / "cache"
    monkeypatch.setenv("PYLLMROUTER_CACHE", str(path))


def _rpc_server_binary():
    """llama.cpp's rpc-server, built into the user's cache by scripts/build_llama_tools.sh."""
    base = os.environ.pop("PYLLMROUTER_CACHE", None)
    try:
        return cache_dir() / "llama.cpp-build" / "bin" / "ggml-rpc-server"
    finally:
        if base is not None:
            os.environ["PYLLMROUTER_CACHE"] = base


RPC_SERVER = _rpc_server_binary()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def rpc_servers():
    """Three rpc-servers on loopback (three CPU-backed ggml devices); stopped after the module."""
    procs, endpoints = [], []
    for _ in range(3):
        port = _free_port()
        procs.append(subprocess.Popen([str(RPC_SERVER), "-H", "127.0.0.1", "-p", str(port)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        endpoints.append(f"127.0.0.1:{port}")
    for ep in endpoints:
        host, port = ep.split(":")
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, f"rpc-server {ep} did not start"
                time.sleep(0.05)
    yield endpoints
    for p in procs:
        p.terminate()
        p.wait(10)


def run_py(code: str, env: dict | None = None, timeout: int = 300) -> dict:
    """Run ``code`` in a fresh interpreter (devices attached there stay there); the
    last line it prints is JSON."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
