"""A request's options checked against what llama-server's handlers read, before anything
runs (the Python API's ``chat``, ``complete``, ``embed``...): a misspelled option is a
TypeError that names it and the nearest known one, as a Python function's unknown keyword
is; ``extra_body`` sends options unchecked.

    known_keys() ──▶ the keys llama-server reads (extracted from the pinned source when the
                     extension was built: cmake/request_keys.py), asked of a short-lived
                     process once per extension build, then read from the cache
    check(where, options) ──▶ TypeError for the first unknown one

The router process imports no llama.cpp: the extension is found (not loaded) to key the
cache, and asked in a process of its own.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
from typing import Any, Mapping

from pyllmrouter.memory import cache_dir

__all__ = ["known_keys", "check"]


@functools.lru_cache(maxsize=1)
def known_keys() -> frozenset[str]:
    """The request keys llama-server's handlers read (empty: the extension is not built,
    and nothing is refused)."""
    spec = importlib.util.find_spec("pyllmrouter._native")
    if spec is None or not spec.origin:
        return frozenset()
    st = os.stat(spec.origin)
    stamp = hashlib.sha256(f"{spec.origin}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = cache_dir() / f"request-keys-{stamp}.json"
    try:
        return frozenset(json.loads(cached.read_text()))
    except (OSError, ValueError):
        pass
    out = subprocess.run([sys.executable, "-m", "pyllmrouter.engine.request_keys"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": "-1"})
    try:
        keys = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return frozenset()  # not askable: nothing refused rather than everything
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f".{cached.name}.{os.getpid()}.{threading.get_ident()}")  # one per thread: no two race
    tmp.write_text(json.dumps(keys))
    os.replace(tmp, cached)
    return frozenset(keys)


def check(where: str, options: Mapping[str, Any]) -> None:
    """TypeError for the first of ``options`` llama-server reads nowhere, naming it and the
    nearest key it does read."""
    keys = known_keys()
    if not keys:
        return
    for name in options:
        if name not in keys:
            near = difflib.get_close_matches(name, keys, n=1)
            hint = f": did you mean {near[0]!r}?" if near else ""
            raise TypeError(f"{where}() got an unexpected option {name!r}{hint} (llama-server reads no such key; "
                            f"extra_body={{...}} sends options unchecked)")
