"""The one way into llama.cpp from Python.

``llama_cpp`` is imported first and loads libllama/libggml; ``_native`` links the
same libraries by SONAME, so the process holds exactly one copy of each.  Both
are imported lazily: ``import pyllmrouter`` alone loads no backend, which is
what lets the router process stay free of any GPU context.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import sys
import threading
from types import ModuleType

__all__ = ["llama_cpp_module", "native", "forward_log", "bindings_only"]

# llama.cpp is chatty: its errors become exceptions anyway, so nothing here is
# louder than WARNING and information is DEBUG (quiet unless asked for).
_LEVELS = {"E": logging.WARNING, "W": logging.INFO, "I": logging.DEBUG, "D": logging.DEBUG}
LOG = logging.getLogger("pyllmrouter.llama")


# enum ggml_log_level: NONE, DEBUG, INFO, WARN, ERROR, CONT
_GGML_LEVELS = {1: "D", 2: "I", 3: "W", 4: "E"}


class _LogBridge:
    """llama.cpp's log callback, forwarding whole lines to ``logging``.

    Replaces llama_cpp's own callback (which prints to stderr); the instance
    keeps the ctypes trampoline alive for as long as the process runs.  Exactly
    one is installed, under a lock: two threads that both installed one would
    leave llama.cpp calling the trampoline of the instance that was dropped.
    """

    _lock = threading.Lock()
    _installed: "_LogBridge | None" = None

    @classmethod
    def install(cls, lc: ModuleType) -> "_LogBridge":
        with cls._lock:
            if cls._installed is None:
                cls._installed = cls(lc)
            return cls._installed

    def __init__(self, lc: ModuleType):
        self.level = "I"
        self.partial = ""
        self.callback = lc.llama_log_callback(self._on_log)
        lc.llama_log_set(self.callback, None)

    def _on_log(self, level: int, text: bytes, _user_data) -> None:
        if level != 5:  # CONT keeps the level of the line it continues
            self.level = _GGML_LEVELS.get(level, "D")
        self.partial += text.decode("utf-8", "replace")
        *lines, self.partial = self.partial.split("\n")
        forward_log([f"{self.level} {line}" for line in lines])


def _openmp_policy() -> None:
    """ggml's CPU backend runs each graph in an OpenMP team of the thread that computes
    it: one team per model's slot loop here, where llama-server has one per process.
    With more OpenMP threads than CPUs, libgomp's default policy spins only 100 times
    before a thread sleeps, idle teams count, and a busy model's steps then wait for
    its sleeping threads to wake (``bench/concurrency_bench.py --loaded 3``).  The
    active policy spins 1000 times in that case, with libgomp's usual 300000 otherwise
    (an idle model's threads still sleep within milliseconds).  Where the CPUs are
    truly oversubscribed by busy threads (``bench/ray_bench.py``: three nodes on one
    small machine) the longer spin costs throughput; a policy the user set (either
    variable) is left alone.  libgomp reads these when it loads, with llama.cpp."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "active"
        os.environ["GOMP_SPINCOUNT"] = "300000"


def bindings_only() -> None:
    """In a process of ours that uses llama.cpp through ``_native`` and the bindings alone
    (a worker, a checking process): ``llama_cpp``'s package registered without running its
    ``__init__``, which imports the high-level ``Llama`` (numpy, jinja2, the chat formats:
    a quarter of a second) that such a process never uses.  ``llama_cpp.llama_cpp`` (ctypes
    only) then loads libllama as it does under the package.  Call it before ``native()``."""
    if "llama_cpp" in sys.modules:
        return
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return  # not installed as a package: the import below says so
    sys.modules["llama_cpp"] = importlib.util.module_from_spec(spec)


@functools.cache
def llama_cpp_module() -> ModuleType:
    _openmp_policy()
    import llama_cpp.llama_cpp as lc  # noqa: PLC0415 - lazy on purpose

    _LogBridge.install(lc)
    return lc


@functools.cache
def native() -> ModuleType:
    llama_cpp_module()
    from pyllmrouter import _native  # noqa: PLC0415 - after llama_cpp on purpose

    # llama.cpp logs debug lines on every decode; each would take the GIL to reach the
    # bridge, so they stop in C++ unless debug logging is on now
    _native.route_log(1 if LOG.isEnabledFor(logging.DEBUG) else 2)
    return _native


def forward_log(lines: list[str]) -> None:
    """Pass llama.cpp log lines captured by the probe ("E text") to ``logging``.

    Quiet by default: nothing is emitted at a level a bare logging setup shows,
    except llama.cpp errors.
    """
    for line in lines:
        level = _LEVELS.get(line[:1], logging.DEBUG)
        if LOG.isEnabledFor(level):
            LOG.log(level, "%s", line[2:])
