"""Local processes on loopback, for the demo, the tests and the benchmarks:
free ports, ``pyllmrouter serve`` started and awaited, llama.cpp rpc-servers."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

from pyllmrouter.memory import cache_dir

__all__ = ["free_port", "wait_healthy", "start_serve", "serving", "llama_tool", "rpc_server_binary", "RpcServers",
           "rpc_live_bytes"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Until ``GET base/health`` answers 200; fails if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with code {proc.returncode} before it served")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{base} did not answer /health within {timeout:.0f} s")


def start_serve(args: Sequence[str], env: dict[str, str] | None = None,
                port: int | None = None) -> tuple[subprocess.Popen, str]:
    """``pyllmrouter serve ARGS --port PORT`` in its own process, once it serves."""
    port = port or free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pyllmrouter.cli", "serve", *args, "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc)
    except BaseException:
        proc.kill()
        raise
    return proc, base


@contextlib.contextmanager
def serving(common: Sequence[str], variants: dict[str, Sequence[str]]):
    """``pyllmrouter serve COMMON VARIANT`` for each named variant, side by side: {name: base
    URL}; all stopped on exit (a short graceful shutdown, so none outlasts the wait)."""
    procs, urls = [], {}
    try:
        for name, extra in variants.items():
            proc, urls[name] = start_serve([*common, "--shutdown-timeout", "5", *extra])
            procs.append(proc)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)


def llama_tool(name: str) -> Path:
    """A program of llama.cpp's (llama-server, ggml-rpc-server...), as
    scripts/build_llama_tools.sh builds it into the user's cache (whatever
    PYLLMROUTER_CACHE says for probes at the moment)."""
    saved = os.environ.pop("PYLLMROUTER_CACHE", None)
    try:
        return cache_dir() / "llama.cpp-build" / "bin" / name
    finally:
        if saved is not None:
            os.environ["PYLLMROUTER_CACHE"] = saved


def rpc_server_binary() -> Path:
    """llama.cpp's rpc-server (``llama_tool``)."""
    return llama_tool("ggml-rpc-server")


_ALLOC = re.compile(r"\[alloc_buffer\] device: (\d+), size: (\d+) -> remote_ptr: ([0-9a-f]+)")
_FREE = re.compile(r"\[free_buffer\] remote_ptr: ([0-9a-f]+)")


def rpc_live_bytes(log: Path) -> int:
    """The bytes an rpc-server holds allocated now, from its own log of buffer
    allocations and frees (``GGML_RPC_DEBUG``): what clients asked it for, summed
    over the buffers not freed yet."""
    held: dict[str, int] = {}
    for line in log.read_text(errors="replace").splitlines():
        if m := _ALLOC.search(line):
            held[m.group(3)] = int(m.group(2))
        elif m := _FREE.search(line):
            held.pop(m.group(1), None)
    return sum(held.values())


class RpcServers:
    """``with RpcServers(3) as endpoints:`` n rpc-servers on loopback, stopped on exit.

    With ``log_dir``, server i logs every buffer it allocates and frees to
    ``log_dir/rpc{i}.log``; ``rpc_live_bytes`` reads what it holds from there."""

    def __init__(self, n: int, binary: Path | None = None, log_dir: Path | None = None):
        self.n = n
        self.binary = binary or rpc_server_binary()
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []
        self.endpoints: list[str] = []

    def __enter__(self) -> list[str]:
        if not self.binary.exists():
            raise FileNotFoundError(f"{self.binary}: run scripts/build_llama_tools.sh ggml-rpc-server first")
        for i in range(self.n):
            port = free_port()
            log = open(self.log_dir / f"rpc{i}.log", "wb") if self.log_dir is not None else None
            try:  # the server keeps its own copy of the file descriptor
                self.procs.append(subprocess.Popen(
                    [str(self.binary), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                    stderr=log or subprocess.DEVNULL, env={**os.environ, "GGML_RPC_DEBUG": "1"} if log else None))
            finally:
                if log:
                    log.close()
            self.endpoints.append(f"127.0.0.1:{port}")
        for ep in self.endpoints:
            host, port = ep.rsplit(":", 1)
            deadline = time.monotonic() + 30
            while True:
                try:
                    socket.create_connection((host, int(port)), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        self.__exit__(None, None, None)
                        raise RuntimeError(f"rpc-server {ep} did not start") from None
                    time.sleep(0.05)
        return self.endpoints

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(10)
