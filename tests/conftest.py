"""Shared fixtures: tiny real GGUF models and an isolated probe cache.

The tests are grouped in folders by behaviour, as the docs' pages are (docs/development.md
has the map).  Every folder is on the import path, so a test module's helpers (the
simulated world, a live server) are imported by name from any folder."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import settings

sys.path[:0] = sorted(str(d) for d in Path(__file__).resolve().parent.iterdir()
                      if d.is_dir() and not d.name.startswith(("_", ".")))

from pyllmrouter.router.services import events
from pyllmrouter.tools import scripted, tinymodels
from pyllmrouter.tools.loopback import RpcServers, rpc_server_binary

# Property tests: the README's test command (and CI) runs a fixed, derandomized search, so a
# run that passed passes again; HYPOTHESIS_PROFILE=wide searches far more examples from a
# random seed (README: "Property tests"), and what it finds becomes an @example.
settings.register_profile("ci", max_examples=300, derandomize=True, deadline=None, database=None,
                          print_blob=True)
settings.register_profile("wide", max_examples=int(os.environ.get("HYPOTHESIS_EXAMPLES", "20000")),
                          deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def worker_pids() -> list[int]:
    """The worker processes this process started (live ones: a reaped or zombie one holds
    nothing), oldest first."""
    from pyllmrouter.router.workers.handle import WORKER_ENTRY

    me, out = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        state, ppid = stat.rpartition(")")[2].split()[:2]
        if int(ppid) == me and state != "Z" and WORKER_ENTRY.encode() in argv:
            out.append(int(entry))
    return sorted(out)


@pytest.fixture(scope="session", autouse=True)
def _session_llama_cache(tmp_path_factory):
    """llama.cpp's cache of downloads (which the router lists) is the tests' own: the user's
    downloads never show up in a test. Servers that outlive one test (module fixtures) see
    this one, which stays empty."""
    cache = tmp_path_factory.mktemp("llama-cache")
    os.environ["LLAMA_CACHE"] = str(cache)
    yield cache


@pytest.fixture(autouse=True)
def _empty_llama_cache(_session_llama_cache, tmp_path_factory, monkeypatch):
    """Each test starts with an empty cache of its own, so a model one test pulls is never
    listed in another's; and no test may leave anything in the shared one."""
    monkeypatch.setenv("LLAMA_CACHE", str(tmp_path_factory.mktemp("llama-cache")))
    yield
    left = sorted(p.name for p in _session_llama_cache.iterdir())
    assert not left, f"this test left {left} in the llama.cpp cache other tests list"


class _Kept(logging.Handler):
    """Keeps the records of one logger (an event listener's error, say)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(autouse=True)
def _no_listener_fails():
    """An event listener that raises is dropped by the bus with its traceback logged: under
    the tests that fails the test (a check made in a listener must never stop unseen)."""
    kept = _Kept()
    events.LOG.addHandler(kept)
    try:
        yield kept
    finally:
        events.LOG.removeHandler(kept)
    if kept.records:
        pytest.fail("an event listener raised:\n" + "\n".join(logging.Formatter().format(r) for r in kept.records))


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict:
    """The three tiny models (llama, qwen3moe, bert), written once per session."""
    return tinymodels.write_tiny_set(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def story(tmp_path_factory):
    """A model that tells its story again and again: a stream that lasts until it is stopped."""
    d = tmp_path_factory.mktemp("story")
    return scripted.write_scripted(d / "story.gguf", scripted.THINK_TEMPLATE, scripted.STORY_SCRIPT, loop=True)


@pytest.fixture(scope="session")
def shape7b(tmp_path_factory):
    """A sparse file with the full layout of a 7B Q4_0 llama."""
    return tinymodels.write_shape(tmp_path_factory.mktemp("shape") / "shape-7b.gguf", tinymodels.SHAPE_7B)


@pytest.fixture(scope="session")
def draft(tmp_path_factory):
    """A smaller llama with the tiny llama's vocabulary: a draft model for it."""
    return tinymodels.write_llama(tmp_path_factory.mktemp("draft") / "tiny-draft.gguf", tinymodels.DRAFT, seed=1)


@pytest.fixture(scope="session")
def projector(tmp_path_factory):
    """A LLaVA-style vision projector for the tiny llama."""
    return tinymodels.write_projector(tmp_path_factory.mktemp("mmproj") / "tiny-projector.gguf")


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


RPC_SERVER = rpc_server_binary()


@pytest.fixture(scope="module")
def rpc_servers():
    """Three rpc-servers on loopback (three CPU-backed ggml devices); stopped after the module."""
    with RpcServers(3, RPC_SERVER) as endpoints:
        yield endpoints


def run_py(code: str, env: dict | None = None, timeout: int = 300) -> dict:
    """Run ``code`` in a fresh interpreter (devices attached there stay there); the
    last line it prints is JSON."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
